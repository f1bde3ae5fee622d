// AVX-512 helpers shared by the CPU kernels (attention's avx512_kernels.h and prefill_kernels.h, elementwise.cpp):
// the target attribute that compiles a function for AVX-512 (called only where the CPU has it), an exp for x <= 0,
// and bfloat16 <-> float32 conversions with c10::BFloat16's rounding. No torch header: plain intrinsics.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

namespace paged_attn {
namespace {

#define PA_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// exp(x) for x <= 0 (exact 0 below about -87, and for -inf): 2^n * 2^f with n = round(x log2 e), |f| <= 1/2,
// 2^f by a degree-5 polynomial whose constant term is 1, so exp(0) = 1 exactly (a row that sees one key with logit 0
// has lse 0). Largest relative error against exp in double, every float x (bench/exp_error.c): 2.3e-7 over
// [-1, 0], 3.9e-6 over [-87, 0], the most of it from rounding x log2 e to float32 where |x| is large.
PA_TARGET_AVX512 inline __m512 exp_nonpositive(__m512 x) {
  const __m512 y = _mm512_max_ps(_mm512_set1_ps(-200.f), _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 poly = _mm512_set1_ps(1.3266980e-3f);
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(9.6754692e-3f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(5.5507425e-2f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(2.4022122e-1f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(6.9314694e-1f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(poly, n);
}

// 16 bfloat16 -> 16 float32 (exact).
PA_TARGET_AVX512 inline __m512 widen_bf16(__m256i bf16) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16));
}

// 16 floats -> 16 bfloat16, rounded to nearest even as c10::BFloat16's constructor rounds (NaN to 0x7FC0,
// denormals kept), where vcvtneps2bf16 would flush denormals.
PA_TARGET_AVX512 inline __m256i round_to_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0x7FC0)));
}

}  // namespace
}  // namespace paged_attn
#endif
