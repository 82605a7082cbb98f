"""Tensor parallelism (``--tensor-parallel-size N``): the model split across N ranks of one
host, rank 0 hosting the engine (scheduler, KV allocator) and mirroring each model call to the
other ranks.

* :mod:`~edserve.parallel.tp`: the transform of a loaded model (column/row-parallel linears);
* :mod:`~edserve.parallel.layers`: the parallel linear layers;
* :mod:`~edserve.parallel.distributed`: process-group set-up, follower processes;
* :mod:`~edserve.parallel.session`, :mod:`~edserve.parallel.leader`: rank 0;
* :mod:`~edserve.parallel.follower`: ranks 1..N-1;
* :mod:`~edserve.parallel.wire`, :mod:`~edserve.parallel.mirror`: what travels per call.
"""

from edserve.parallel.errors import TensorParallelError
from edserve.parallel.leader import TensorParallelModel, build_sharded_model
from edserve.parallel.session import shutdown
from edserve.parallel.tp import apply_tensor_parallel

__all__ = ["TensorParallelError", "TensorParallelModel", "apply_tensor_parallel",
           "build_sharded_model", "shutdown"]
