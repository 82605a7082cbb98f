"""Linear layers whose weights ``torch.compile`` cannot trace, called through one opaque op.

fbgemm's int8 packed weights (a TorchScript object, :mod:`edserve.models.quantize`) and oneDNN's
prepacked float32 weights (an ``mkldnn`` layout tensor, :mod:`edserve.models.cpu_linear`) have no
fake-tensor form, so dynamo cannot trace a module holding them. Such a module subclasses
:class:`OpaqueLinear`: eagerly it runs :meth:`~OpaqueLinear.eager`; inside a compiled graph
(:mod:`edserve.engine.cpu_compile`) it becomes one call of the custom op
``edserve::opaque_linear(x, handle, out_features)``, which looks the live module up by handle.
"""

from __future__ import annotations

import copy
import itertools
import weakref
from collections.abc import Callable

import torch
from torch import nn

# Modules whose weight the model reads directly (slices rows of), so no transform replaces them.
KEEP_FLOAT = ("cross_kv_proj",)

# Live opaque linears by handle (a module gone from every model is gone from here too).
_LIVE: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()
# By handle, the module's ``direct()`` function of ``x``, where it has one (dropped with the
# module): the compiled step's ~25 calls a step skip the weak lookup and the method call.
_DIRECT: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}


# Defined through torch.library.Library with a CPU kernel rather than @custom_op: a compiled
# decode step calls it ~25 times per tiny.en step, and custom_op's Python wrapper cost ~9 us a
# call against ~2.5 us here (2-core Xeon; benchmarks/RESULTS.md, wave 22).
_LIB = torch.library.Library("edserve", "DEF")
_LIB.define("opaque_linear(Tensor x, int handle, int out_features) -> Tensor")


def _opaque_linear_cpu(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    direct = _DIRECT.get(handle)
    return direct(x) if direct is not None else _LIVE[handle].eager(x)


def _opaque_linear_fake(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


_LIB.impl("opaque_linear", _opaque_linear_cpu, "CPU")
torch.library.register_fake("edserve::opaque_linear", _opaque_linear_fake, lib=_LIB)

# ``torch.mv`` kept whole inside a compiled graph: inductor decomposes a matrix-vector product
# into its own C++ reduction loop, which for the one-row bf16 logits (tiny.en's 40 MB
# vocabulary) ran ~2 ms slower per step than ATen's kernel on a 2-core AMX Xeon (wave 24).
_LIB.define("mv(Tensor mat, Tensor vec) -> Tensor")
_LIB.impl("mv", lambda mat, vec: torch.mv(mat, vec), "CPU")
torch.library.register_fake("edserve::mv", lambda mat, vec: mat.new_empty(mat.shape[:1]),
                            lib=_LIB)


def mv(mat: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
    """``torch.mv(mat [n, d], vec [d]) -> [n]``; one opaque op when compiling (CPU)."""
    if torch.compiler.is_compiling():
        return torch.ops.edserve.mv(mat, vec)
    return torch.mv(mat, vec)


class OpaqueLinear:
    """Mixin: ``eager(x)`` computes ``[..., in] -> [..., out_features]``; ``forward`` dispatches.

    Call :meth:`register` once the module is built; a deep copy registers itself anew.
    """

    handle: int  # key in _LIVE
    out_features: int

    def eager(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def direct(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """A function of ``x`` equal to :meth:`eager` that holds no reference to the module
        (the opaque op calls it), or None (the op calls :meth:`eager`)."""
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self.compiled(x)
        return self.eager(x)

    def compiled(self, x: torch.Tensor) -> torch.Tensor:
        """What a graph being compiled calls: the opaque op (a subclass may call an op of its
        own that dynamo can trace, equal to :meth:`eager`)."""
        return torch.ops.edserve.opaque_linear(x, self.handle, self.out_features)

    def register(self) -> None:
        self.handle = next(_HANDLES)
        _LIVE[self.handle] = self
        fn = self.direct()
        if fn is not None:
            _DIRECT[self.handle] = fn
            weakref.finalize(self, _DIRECT.pop, self.handle, None)

    def __deepcopy__(self, memo: dict):
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        clone.__dict__.update(copy.deepcopy(self.__dict__, memo))
        clone.register()
        return clone


def replace_linears(root: nn.Module, make: Callable[[nn.Linear], nn.Module],
                    skip: tuple[nn.Module, ...] = ()) -> int:
    """Replace every ``nn.Linear`` under ``root`` (but :data:`KEEP_FLOAT` and the subtrees in
    ``skip``) by ``make(linear)`` in place, keeping a FusedLinear's row layout (``parts``)
    inspectable; returns the count."""
    count = 0
    for name, child in list(root.named_children()):
        if name in KEEP_FLOAT or any(child is m for m in skip):
            continue
        if isinstance(child, nn.Linear):
            new = make(child)
            parts = getattr(child, "parts", None)
            if parts is not None:
                new.parts = parts
            setattr(root, name, new)
            count += 1
        else:
            count += replace_linears(child, make, skip)
    return count
