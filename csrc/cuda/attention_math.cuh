// The arithmetic the attention kernels on CUDA share (attention_kernels.cuh, decode_mma_kernels.cuh,
// varlen_attention_kernels.cuh): conversions between the query, cache (fp8 included) and float types, and the fast
// intrinsics (fast_tanh, fast_exp2); warp reductions; and the end of a row, where its state is final: the sink and
// the log-sum-exp (row_sum, row_lse), and the output of a single-pass row without tokens (write_empty).
// Their parameters and task geometry: attention_params.cuh.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attention_params.cuh"
#include "device.cuh"

namespace paged_attn {

// ---------------------------------------------------------------------------------------------------------------
// Conversions. A "vector" is 16 bytes: 8 half/bfloat16 or 4 float values.
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ void from_float(float& out, float x) { out = x; }
__device__ __forceinline__ void from_float(__half& out, float x) { out = __float2half_rn(x); }
__device__ __forceinline__ void from_float(__nv_bfloat16& out, float x) { out = __float2bfloat16_rn(x); }

// tanh(x) = 1 - 2 / (exp(2x) + 1), from one exp and one approximate division (tanhf costs ~30 instructions in a
// loop; the tensor-core kernels' soft cap): absolute error ~1e-7 (logits_soft_cap * 1e-7 on a logit), +-1 for |x|
// large (exp gives inf or 0).
__device__ __forceinline__ float fast_tanh(float x) { return 1.0f - __fdividef(2.0f, __expf(2.0f * x) + 1.0f); }

// 2^x in one instruction (ex2.approx.ftz: relative error 2^-22, results below 2^-126 flushed to 0; __expf is the
// same instruction after multiplying by log2(e), but for subnormal handling that costs it three more). The
// tensor-core prefill keeps its softmax in base 2, with log2(e) folded into the scale. (Emulated: exp2f.)
__device__ __forceinline__ float fast_exp2(float x) {
#ifdef PAGED_ATTN_EMULATED
  return exp2f(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

__device__ __forceinline__ void vec_to_floats(const uint4& v, float (&f)[4], float) {
  const float4 x = *reinterpret_cast<const float4*>(&v);
  f[0] = x.x, f[1] = x.y, f[2] = x.z, f[3] = x.w;
}
__device__ __forceinline__ float2 to_float2(__half2 x) { return __half22float2(x); }
__device__ __forceinline__ float2 to_float2(__nv_bfloat162 x) { return __bfloat1622float2(x); }

template <typename T2>  // __half2 or __nv_bfloat162
__device__ __forceinline__ void pairs_to_floats(const uint4& v, float (&f)[8]) {
  const T2* pairs = reinterpret_cast<const T2*>(&v);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 x = to_float2(pairs[k]);
    f[2 * k] = x.x, f[2 * k + 1] = x.y;
  }
}
__device__ __forceinline__ void vec_to_floats(const uint4& v, float (&f)[8], __half) { pairs_to_floats<__half2>(v, f); }
__device__ __forceinline__ void vec_to_floats(const uint4& v, float (&f)[8], __nv_bfloat16) {
  pairs_to_floats<__nv_bfloat162>(v, f);
}

// N fp8 values (a 16- or 8-byte vector) to float: two at a time through half2 (exact: every fp8 value is a half).
template <typename V, int N>
__device__ __forceinline__ void fp8_to_floats(const V& v, float (&f)[N], __nv_fp8_interpretation_t format) {
  static_assert(sizeof(V) == N, "one byte per value");
  const __nv_fp8x2_storage_t* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(&v);
#pragma unroll
  for (int k = 0; k < N / 2; ++k) {
    const float2 x = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pairs[k], format)));
    f[2 * k] = x.x, f[2 * k + 1] = x.y;
  }
}

// A cache vector to floats: C's own conversion, or fp8 in the given format.
template <typename C, typename V, int N>
__device__ __forceinline__ void cache_vec_to_floats(const V& v, float (&f)[N], __nv_fp8_interpretation_t format) {
  if constexpr (std::is_same_v<C, Fp8>) {
    fp8_to_floats(v, f, format);
  } else {
    vec_to_floats(v, f, C{});
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Warp reductions (butterflies: every lane ends with the same result, in a fixed order of operations).
template <int LANES>
__device__ __forceinline__ float sum_over_lanes(float x) {
#pragma unroll
  for (int mask = LANES / 2; mask > 0; mask /= 2) x += __shfl_xor_sync(0xffffffffu, x, mask);
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int mask = 16; mask > 0; mask /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, mask));
  return x;
}

// ---------------------------------------------------------------------------------------------------------------
// The end of a row: its state is final, max M (-inf while it saw no logit) and sum l of exp(x - M) (of exp(x - 0)
// while M = -inf: 0), and the unnormalized output O (in units of exp(x - M)). Head h's sink S = sinks[h] counts
// here as one more logit, and only here, so no split counts it twice or drops it:
//   out = O / row_sum,  row_sum = l + exp(S - M);  lse = m + log(exp(M - m) l + exp(S - m)),  m = max(M, S).
// S = -inf (no sink, or none given) adds nothing: exactly O / l and M + log(l), the same bits as no sinks. S = +inf,
// or S - M past float's range (exp(S - M) = inf), or a row that saw no key (M = -inf) with a sink give out 0 (the
// limit); the lse, on base m, never overflows: +inf for S = +inf, S for a row that saw no key. A NaN sum (a NaN
// logit) stays NaN, and l = 0 (every logit -inf, no sink) gives 0 / 0 = NaN, as the reference. As csrc/cpu's
// finish_row (attention_common.h). O / row_sum keeps the division the kernels had before sinks, per element (a
// scale computed once per row, through shared memory, cost the main loops registers and spills by
// scripts/sass_report.py); the fast intrinsics, as the softmax's __expf.
__device__ __forceinline__ float sink_of(const float* sinks, int head) {
  return sinks != nullptr ? sinks[head] : -INFINITY;
}
__device__ __forceinline__ float row_sum(float max, float sum, float sink) {
  return sink == -INFINITY ? sum : sum + __expf(sink - max);
}
__device__ __forceinline__ float row_lse(float max, float sum, float sink) {
  const float m = fmaxf(max, sink);
  const float base = m == -INFINITY ? 0.0f : m;
  const float w = max == base ? 1.0f : __expf(max - base), e = sink == base ? 1.0f : __expf(sink - base);
  return base + __logf(fmaf(w, sum, e));
}

// A single-pass task without tokens (seq_len 0): a zero output row, lse -inf (or the sink). (In split-KV an empty
// partition writes nothing: the reduce reads only the partitions that hold tokens.)
template <typename T, typename C, int HEAD_DIM>
__device__ __forceinline__ void write_empty(const AttentionParams<T, C>& p, const AttentionTask& task) {
  const int64_t first_row = query_row(p) * p.num_heads + task.first_head;
  for (int k = threadIdx.x; k < task.num_heads * HEAD_DIM; k += kAttentionThreads) {
    from_float(p.out[first_row * HEAD_DIM + k], 0.0f);
  }
  if (p.lse != nullptr && static_cast<int>(threadIdx.x) < task.num_heads) {
    p.lse[first_row + threadIdx.x] = row_lse(-INFINITY, 0.0f, sink_of(p.sinks, task.first_head + threadIdx.x));
  }
}

}  // namespace paged_attn
