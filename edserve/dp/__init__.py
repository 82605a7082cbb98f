"""Data parallelism on one host: N engine worker processes behind one API process.

:class:`~edserve.dp.client.DataParallelClient` implements the
:class:`~edserve.engine.protocol.EngineClient` surface, so ``create_app`` and every route are
unchanged; it routes each engine request to the least-loaded worker
(:mod:`edserve.dp.router`) over ZeroMQ (:mod:`edserve.dp.protocol`), streams its deltas back,
fails the requests of a worker that dies with a 503 (:class:`~edserve.dp.errors.WorkerLost`)
and restarts it. Workers (:mod:`edserve.dp.worker`) are pinned one per GPU on CUDA, or share
the CPU cores (:mod:`edserve.dp.placement`).
"""
