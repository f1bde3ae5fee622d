// merge_attention_states on CUDA: the kernel (no torch; its parameters: merge_attention_states_params.h; launched by
// csrc/cuda/instantiations/merge_attention_states.cu with plan_merge_attention_states of copy_plan.h).
//
// Two partial attention results over disjoint key ranges A and B, each a row of head_dim values with the
// natural-log log-sum-exp of its logits, merged exactly:
//
//   m = max(lse_a, lse_b), w_a = exp(lse_a - m), w_b = exp(lse_b - m)
//   out = out_a * (w_a / (w_a + w_b)) + out_b * (w_b / (w_a + w_b))   in float32, rounded once to out's dtype
//   lse = m + log(w_a + w_b)
//
// Edges (as the CPU kernel, csrc/cpu/merge_attention_states.cpp, and paged_attn/reference.py): a +inf lse dominates
// (a +inf sink's part: the merge is that part's output and lse +inf; both +inf: their mean); -inf is a part that
// saw no key; both -inf: scales 0 and lse -inf (no 0 / 0); a NaN lse makes the row and its lse NaN; a NaN in out_a
// or out_b makes that element NaN.
//
// Grid (num_tokens, ceil(num_heads / kMergeRowsPerBlock)), kMergeRowsPerBlock warps per block: warp w of block
// (t, y) merges row (token t, head y * kMergeRowsPerBlock + w); its lanes stride over head_dim, one element each
// per step (coalesced), and lane 0 writes the row's lse. Every lane computes the row's two scales itself (two
// broadcast loads): no shared memory, no barrier.
#pragma once

#include <cmath>
#include <cstdint>

#include "copy_plan.h"
#include "device.cuh"
#include "merge_attention_states_params.h"

namespace paged_attn {
namespace merge_detail {
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
}  // namespace merge_detail


template <typename T>
__global__ void merge_attention_states_kernel(const MergeAttentionStatesParams<T> p) {
  const int64_t token = blockIdx.x;
  const int head = blockIdx.y * kMergeRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (head >= p.num_heads) return;  // the last block's spare warps

  float lse_a = p.lse_a[token * p.lse_a_stride[0] + head * p.lse_a_stride[1]];
  float lse_b = p.lse_b[token * p.lse_b_stride[0] + head * p.lse_b_stride[1]];
  float scale_a = 0.0f, scale_b = 0.0f, lse = -INFINITY;  // neither part saw a key: no 0 / 0
  if ((lse_a == INFINITY || lse_b == INFINITY) && lse_a == lse_a && lse_b == lse_b) {  // +inf dominates (not NaN)
    const float n = static_cast<float>(lse_a == INFINITY) + static_cast<float>(lse_b == INFINITY);
    scale_a = static_cast<float>(lse_a == INFINITY) / n, scale_b = static_cast<float>(lse_b == INFINITY) / n;
    lse = INFINITY;
  } else if (lse_a != -INFINITY || lse_b != -INFINITY) {
    const float m = fmaxf(lse_a, lse_b);  // fmaxf skips a NaN, but then that part's weight is NaN below
    const float w_a = expf(lse_a - m), w_b = expf(lse_b - m);
    const float sum = w_a + w_b;
    scale_a = w_a / sum, scale_b = w_b / sum, lse = m + logf(sum);
  }
  if (lane == 0) p.lse[token * p.lse_stride[0] + head * p.lse_stride[1]] = lse;

  const T* a = p.out_a + token * p.out_a_stride[0] + head * p.out_a_stride[1];
  const T* b = p.out_b + token * p.out_b_stride[0] + head * p.out_b_stride[1];
  T* o = p.out + token * p.out_stride[0] + head * p.out_stride[1];
  for (int d = lane; d < p.head_dim; d += 32) {
    const float merged = merge_detail::to_float(a[d]) * scale_a + merge_detail::to_float(b[d]) * scale_b;
    o[d] = merge_detail::from_float<T>(merged);
  }
}

}  // namespace paged_attn
