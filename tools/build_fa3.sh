#!/usr/bin/env bash
# Build libedserve_fa3.so: FlashAttention-3's Hopper forward kernel (bf16, head dims 64 / 96,
# dense batches) behind edserve's C entry point (edserve/kernels/csrc/fa3_shim.cu), for
# `--encoder-attention fa3` and the Mllama vision tower's `fa3` kernel (EDSERVE_FA3_LIB=<the .so>).
#
#   bash tools/build_fa3.sh FLASH_ATTENTION_DIR CUTLASS_DIR [OUT_DIR]
#
# FLASH_ATTENTION_DIR: a checkout of github.com/Dao-AILab/flash-attention (measured at 0251105a);
# CUTLASS_DIR: github.com/NVIDIA/cutlass at the commit that checkout pins as csrc/cutlass
# (7127592). nvcc 13.0 from PATH, or from pip (no GPU needed to build; ~2 minutes on 2 cores):
#   pip install nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 \
#     nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85
# The CUDA runtime is linked statically and the .so needs no torch: one build serves any torch
# on a driver of CUDA 13.0 or newer.
# The .so contains FlashAttention-3's and CUTLASS's code (both BSD-3-Clause: keep their LICENSE
# files beside it if you ship it); this repository holds only the shim that calls them.
set -euo pipefail
FA=${1:?flash-attention checkout}; CUTLASS=${2:?cutlass checkout}
OUT=${3:-build/fa3}
HERE=$(cd "$(dirname "$0")/.." && pwd)
if ! command -v nvcc >/dev/null; then  # the pip wheels' nvcc (nvidia is a namespace package)
  CU=$(python3 -c "
import os, nvidia
print(next((os.path.join(p, 'cu13') for p in nvidia.__path__
            if os.path.exists(os.path.join(p, 'cu13', 'bin', 'nvcc'))), ''))" 2>/dev/null || true)
  [ -n "$CU" ] || { echo "no nvcc on PATH and none from pip (see the header)" >&2; exit 1; }
  export PATH=$CU/bin:$PATH
fi
CU_LIB=$(dirname "$(command -v nvcc)")/../lib
mkdir -p "$OUT"
FLAGS=(-O3 -std=c++17 --use_fast_math --expt-relaxed-constexpr --expt-extended-lambda -w
  -gencode arch=compute_90a,code=sm_90a -Xcompiler -fPIC
  -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED -DCUTLASS_ENABLE_GDC_FOR_SM90
  -DCUTLASS_DEBUG_TRACE_LEVEL=0 -DNDEBUG
  -I"$FA/hopper" -I"$CUTLASS/include")
# every FA3 feature this entry point does not call, off: two kernels (causal or not) a head dim
for f in BACKWARD PAGEDKV SPLIT APPENDKV LOCAL SOFTCAP PACKGQA FP16 FP8 VARLEN CLUSTER \
         HDIM128 HDIM192 HDIM256 SM8x; do
  FLAGS+=(-DFLASHATTENTION_DISABLE_$f)
done
FLAGS+=(-DFLASH_ATTENTION_DISABLE_HDIMDIFF64 -DFLASH_ATTENTION_DISABLE_HDIMDIFF192)
nvcc "${FLAGS[@]}" -c "$FA/hopper/instantiations/flash_fwd_hdim64_bf16_sm90.cu" -o "$OUT/h64.o" &
h64=$!
nvcc "${FLAGS[@]}" -c "$FA/hopper/instantiations/flash_fwd_hdim96_bf16_sm90.cu" -o "$OUT/h96.o" &
h96=$!
nvcc "${FLAGS[@]}" -c "$HERE/edserve/kernels/csrc/fa3_shim.cu" -o "$OUT/shim.o"
wait $h64  # set -e: a failed compile stops the build here
wait $h96
nvcc -shared -gencode arch=compute_90a,code=sm_90a "$OUT/shim.o" "$OUT/h64.o" "$OUT/h96.o" \
  -o "$OUT/libedserve_fa3.so" -cudart static -L"$CU_LIB"
echo "built $OUT/libedserve_fa3.so: export EDSERVE_FA3_LIB=$(cd "$OUT" && pwd)/libedserve_fa3.so"
