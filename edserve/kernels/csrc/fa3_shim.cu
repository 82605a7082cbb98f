// edserve_fa3_fwd: a C entry point to FlashAttention-3's Hopper forward kernel
// (Dao-AILab/flash-attention, hopper/), called from Python by ctypes
// (edserve/kernels/fa3_attention.py). Built by tools/build_fa3.sh with FA3's instantiations
// for bf16 at head dims 64 and 96; no torch headers, so the library does not depend on
// torch's C++ ABI.
//
// Contract: dense batches (no varlen, paging, split-KV, softcap, GQA packing, causal or local
// mask), q/k/v/o bf16 on the current device, last dim contiguous, strides in elements:
//   q [b, sq, h, d] by (q_bs, q_rs, q_hs); k, v [b, sk, h, d]; o [b, sq, h, d]; lse [b, h, sq]
//   (float, written). d a multiple of 8 and <= 96 (64 and 96 kernels; FA3 reads a smaller d
//   through its TMA descriptors' bounds). Returns 0, or -1 for shapes the build does not
//   cover, -2 off compute capability 9.0, else the CUDA error of the launch.
#include "flash.h"
#include <cuda_runtime.h>
#include <cutlass/numeric_types.h>

template <int Arch, typename T, int kHeadDim, int kHeadDimV, bool Split, bool PagedKVNonTMA,
          bool Has_softcap, bool PackGQA>
void run_mha_fwd_(Flash_fwd_params &params, cudaStream_t stream);

extern "C" int edserve_fa3_fwd(void *q, void *k, void *v, void *o, float *lse,
                               int b, int sq, int sk, int h, int hk, int d,
                               long long q_bs, long long q_rs, long long q_hs,
                               long long k_bs, long long k_rs, long long k_hs,
                               long long v_bs, long long v_rs, long long v_hs,
                               long long o_bs, long long o_rs, long long o_hs,
                               float scale, void *stream) {
    if (d > 96 || d % 8 != 0 || h != hk || b <= 0 || sq <= 0 || sk <= 0) return -1;
    int dev = 0, major = 0, minor = 0, num_sm = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    cudaDeviceGetAttribute(&num_sm, cudaDevAttrMultiProcessorCount, dev);
    if (major * 10 + minor != 90) return -2;

    Flash_fwd_params p = {};  // what FA3's set_params_fprop sets for this case
    p.is_bf16 = true;
    p.q_ptr = q; p.k_ptr = k; p.v_ptr = v; p.o_ptr = o; p.softmax_lse_ptr = lse;
    p.q_batch_stride = q_bs; p.q_row_stride = q_rs; p.q_head_stride = q_hs;
    p.k_batch_stride = k_bs; p.k_row_stride = k_rs; p.k_head_stride = k_hs;
    p.v_batch_stride = v_bs; p.v_row_stride = v_rs; p.v_head_stride = v_hs; p.v_dim_stride = 1;
    p.o_batch_stride = o_bs; p.o_row_stride = o_rs; p.o_head_stride = o_hs;
    p.b = b; p.b_k = b; p.h = h; p.h_k = hk;
    p.seqlen_q = sq; p.seqlen_k = sk;
    p.seqlen_q_rounded = (sq + 127) / 128 * 128; p.seqlen_k_rounded = (sk + 127) / 128 * 128;
    p.total_q = b * sq; p.total_k = b * sk;
    int const d_rounded = d <= 64 ? 64 : 96;
    p.d = d; p.d_rounded = d_rounded; p.dv = d; p.dv_rounded = d_rounded;
    p.scale_softmax = scale;
    p.p_dropout = 1.f; p.rp_dropout = 1.f; p.p_dropout_in_uint8_t = 255;
    p.window_size_left = sk - 1; p.window_size_right = sq - 1;  // no window: every key
    p.arch = 90; p.num_sm = num_sm;
    p.num_splits = 1;

    auto s = static_cast<cudaStream_t>(stream);
    if (d <= 64) {
        run_mha_fwd_<90, cutlass::bfloat16_t, 64, 64, false, false, false, false>(p, s);
    } else {
        run_mha_fwd_<90, cutlass::bfloat16_t, 96, 96, false, false, false, false>(p, s);
    }
    return static_cast<int>(cudaGetLastError());
}
