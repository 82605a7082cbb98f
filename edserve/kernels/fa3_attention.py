"""FlashAttention-3's Hopper forward kernel for the encoders' bidirectional attention.

FA3 (Dao-AILab/flash-attention, ``hopper/``) overlaps its two GEMMs with the softmax by warp
specialization (producer warps issue TMA loads, two consumer warpgroups ping-pong ``wgmma``),
which Triton 3.6 does not express; cuDNN's fused kernel and edserve's Triton ones run the
encoders' attention at ~350-410 TFLOP/s on an H100/H200 (benchmarks/RESULTS.md, wave 38).

edserve calls it through one C function, ``edserve_fa3_fwd`` (``csrc/fa3_shim.cu``), loaded
with ctypes from the shared library that :file:`tools/build_fa3.sh` builds from FA3's source
(nvcc 13, sm_90a; only the kernels edserve calls: bf16, head dims <= 64 and <= 96, dense
batches). The entry point takes raw pointers and strides, so the library does not depend on
torch's C++ ABI: one build serves any torch. Its path comes from ``EDSERVE_FA3_LIB``.

Contract of :func:`fa3_attention`: q ``[N, H, Sq, hd]``, k/v ``[N, H, Sk, hd]`` (strided views
are fine, the last dim contiguous, 16-byte aligned rows), bf16 on a compute-capability-9.0
CUDA device, ``hd`` a multiple of 8 and <= 96; returns o ``[N, Sq, H, hd]`` contiguous (or
writes ``out``: that shape, any strides with a contiguous last dim), ``softmax(q k^T /
sqrt(hd)) v`` with no mask.
"""

from __future__ import annotations

import ctypes
import os

import torch

from edserve.kernels.dense_attention import check_qkv_shapes
from edserve.kernels.tma_attention import tma_aligned

ENV = "EDSERVE_FA3_LIB"
_lib: ctypes.CDLL | None = None


def fa3_library() -> ctypes.CDLL:
    """The loaded library (cached); raises RuntimeError naming ``EDSERVE_FA3_LIB`` when it is
    unset or does not load."""
    global _lib
    if _lib is None:
        path = os.environ.get(ENV)
        if not path:
            raise RuntimeError(f"FlashAttention-3 needs {ENV}=<path of libedserve_fa3.so> "
                               f"(built by tools/build_fa3.sh)")
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            raise RuntimeError(f"{ENV}={path} does not load: {e}") from e
        i, ll, p = ctypes.c_int, ctypes.c_longlong, ctypes.c_void_p
        lib.edserve_fa3_fwd.argtypes = [p, p, p, p, p] + [i] * 6 + [ll] * 12 + [ctypes.c_float, p]
        lib.edserve_fa3_fwd.restype = i
        _lib = lib
    return _lib


def fa3_unsupported(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """None when :func:`fa3_attention` runs here, else why not."""
    if device.type != "cuda":
        return f"needs CUDA, the device is {device}"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return "needs compute capability 9.0 (Hopper)"
    if dtype != torch.bfloat16:
        return f"needs bfloat16, got {dtype}"
    if head_dim % 8 or head_dim > 96:
        return f"needs a head dim <= 96 and a multiple of 8, got {head_dim}"
    try:
        fa3_library()
    except RuntimeError as e:
        return str(e)
    return None


def fa3_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """See the module doc. Raises ValueError on shapes, dtypes or strides the kernel cannot
    read, RuntimeError when the launch fails."""
    N, H, Sq, hd = check_qkv_shapes(q, k, v)
    why = fa3_unsupported(q.device, q.dtype, hd)
    if why:
        raise ValueError(f"fa3_attention {why}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"fa3_attention: {name} is {t.dtype} on {t.device}, q is "
                             f"{q.dtype} on {q.device}")
        if not tma_aligned(t):
            raise ValueError(f"fa3_attention: {name}'s last dim must be contiguous with "
                             f"16-byte aligned rows, got strides {t.stride()}")
    if out is None:
        out = torch.empty(N, Sq, H, hd, device=q.device, dtype=q.dtype)
    elif out.shape != (N, Sq, H, hd) or out.dtype != q.dtype or not tma_aligned(out):
        raise ValueError(f"fa3_attention: out must be a {q.dtype} [{N}, {Sq}, {H}, {hd}] with "
                         f"a contiguous last dim and 16-byte aligned rows, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    Sk = k.shape[2]
    if Sq == 0 or Sk == 0:  # nothing to launch; no keys: zeros (as the Triton kernels)
        return out.zero_()
    lse = torch.empty(N, H, Sq, device=q.device, dtype=torch.float32)  # written, not used
    rc = fa3_library().edserve_fa3_fwd(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
        N, Sq, Sk, H, H, hd,
        q.stride(0), q.stride(2), q.stride(1), k.stride(0), k.stride(2), k.stride(1),
        v.stride(0), v.stride(2), v.stride(1), out.stride(0), out.stride(1), out.stride(2),
        hd ** -0.5, torch.cuda.current_stream(q.device).cuda_stream)
    if rc != 0:
        raise RuntimeError(f"fa3_attention: edserve_fa3_fwd returned {rc}")
    return out
