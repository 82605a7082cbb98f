"""fbgemm's int8 linear as a native op in compiled CPU decode steps (``edserve_int8::linear``).

Inside a compiled decode step (:mod:`edserve.engine.cpu_compile`) every int8 linear is one op
call from the graph's wrapper (C++). Through the opaque op (:mod:`.opaque_linear`) that call goes
back into Python: dispatcher -> a Python kernel -> fbgemm's boxed call, ~9 us for a one-row
384 x 384 linear against ~6 us for the native op (micro, 2-core Xeon, wave 31), and tiny.en makes
25 such calls a step (step 2.46 -> 2.32 ms). ``csrc/int8_linear.cpp`` registers an op that keeps
the packed weights by handle and calls fbgemm from C++ (bit-identical:
tests/models/test_int8_native.py).

The library is built on first use with :func:`torch.utils.cpp_extension.load` (a C++ compiler
and ninja; ~5 s on 2 cores) into a folder named after the torch version, and loaded from there
afterwards (~0.1 s). Only a compiled step builds it, when it compiles its first graph (inductor's
compile is paid then anyway); where it cannot be built the step keeps the opaque op (logged).
"""

from __future__ import annotations

import logging
import time
import weakref
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "int8_linear.cpp"
_NAME = "edserve_int8_linear"
STALE_LOCK_S = 600.0  # a build takes ~5 s (2-core Xeon); a lock this old is a dead builder's
# Whether the library is loaded in this process: None until the first load() (a process-wide
# fact: a native library, once loaded, stays loaded).
_loaded: bool | None = None


def build_dir(cache_dir: Path) -> Path:
    """Where the library is built and kept: per torch version (a build against another torch's
    headers must not be loaded)."""
    return cache_dir / "extensions" / f"{_NAME}-torch{torch.__version__}"


def load(cache_dir: Path | None) -> bool:
    """Build (first time) or load the library, once per process; False where that fails (the
    reason logged once). ``cache_dir``: the edserve cache (None: torch's extensions folder)."""
    global _loaded
    if _loaded is None:
        _loaded = _build(cache_dir)
    return _loaded


def loaded() -> bool:
    """Whether ``edserve_int8`` ops can be called in this process."""
    return bool(_loaded)


def _build(cache_dir: Path | None) -> bool:
    from torch.utils.cpp_extension import load as cpp_load

    folder = None if cache_dir is None else build_dir(cache_dir)
    try:
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            _clear_stale_lock(folder)
        cpp_load(_NAME, [str(SOURCE)], build_directory=None if folder is None else str(folder),
                 is_python_module=False, verbose=False)
    except Exception as e:  # no compiler or ninja, headers missing, a failed build
        logger.warning("native int8 linear not built (%s: %s); compiled steps call int8 "
                       "linears through the opaque op", type(e).__name__, e)
        return False
    torch.library.register_fake("edserve_int8::linear", _linear_fake)
    return True


def _clear_stale_lock(folder: Path) -> None:
    """Remove a build lock older than :data:`STALE_LOCK_S`: torch's builder waits for the lock
    file to go, so one left by a process killed mid-build would hold every later process."""
    lock = folder / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink(missing_ok=True)
            logger.warning("removed a stale build lock %s", lock)
    except FileNotFoundError:
        pass


def _linear_fake(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def keep(packed) -> int:
    """Store a prepacked fbgemm weight; its handle for :func:`linear` (library loaded)."""
    return torch.ops.edserve_int8.keep(packed)


def drop(handle: int) -> None:
    """Release the weight of ``handle`` (called when its module is collected)."""
    if _loaded:
        torch.ops.edserve_int8.drop(handle)


def linear(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    """``x [..., in] float32 -> [..., out_features]`` through the weight of ``handle``."""
    return torch.ops.edserve_int8.linear(x, handle, out_features)


def attach(model: nn.Module, cache_dir: Path | None) -> int:
    """Give every int8 linear under ``model`` a native handle (building the library if
    needed); returns how many modules have one (0: none to attach, or not built)."""
    modules = [m for m in model.modules() if callable(getattr(m, "attach_native", None))]
    if not modules or not load(cache_dir):
        return 0
    for m in modules:
        m.attach_native()
    return len(modules)


def release_with(module: nn.Module, handle: int) -> None:
    """Drop ``handle`` when ``module`` is collected."""
    weakref.finalize(module, drop, handle)
