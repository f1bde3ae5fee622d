// The AVX-512 bf16 decode path: steps 1-3 (logits, softmax, values) of the decode kernel (decode_kernels.h) for a
// bfloat16 query over a bfloat16 or fp8 cache, as AVX-512 micro-kernels, and the run-time choice of this path.
// Only these functions are compiled for AVX-512 (function target attribute) and they run only where the CPU has it
// (use_avx512), so no AVX-512 code can run on a CPU without it. (The prefill's AVX-512 float32 micro-kernels are in
// prefill_kernels.h. PA_TARGET_AVX512, exp_nonpositive and the bfloat16 conversions are in avx512_math.h.)
//
// AVX-512 bf16 (bfloat16 caches, head_dim a multiple of 32, CPU with AVX512_BF16; chosen at run time): both
// products use vdpbf16ps (32 bf16 multiply-adds into 16 float32 lanes per instruction, products exact, sums in
// float32): q . k on the bf16 query and keys as they are; p * v on token pairs, the value rows of tokens t and
// t + 1 interleaved element by element, p split into two bfloat16 terms hi + lo (together within about 2^-16
// of p, where FlashAttention rounds P to half precision, 2^-9) and one vdpbf16ps for each; the running sum adds
// the same hi + lo, so the weights still sum to one. The output agrees with the float32 reference to float32
// rounding, not just to the half-type tolerance. hi and lo are both > 0 where p > 0, and rows past a tile's
// tokens are not multiplied, so that a value of inf gives inf as in float32 (never 0 * inf or inf - inf).
//
// Tiled caches (paged_cache.h) are read as they are, with no shuffles: q . k as head_dim / 2 vdpbf16ps per head, each
// a tile row (one pair of dims of the 16 tokens) times the query's pair broadcast, into the 16 tokens' logits (no
// sum across lanes); p * v as one vdpbf16ps per 16 dims, token pair and term, a tile row of values (16 dims of
// the pair, interleaved) times the pair's weights broadcast, into the accumulator in the natural order.
#pragma once

#include "attention_common.h"
#include "avx512_math.h"  // PA_TARGET_AVX512, exp_nonpositive, widen_bf16, round_to_bf16


namespace paged_attn {
namespace {

#if defined(CPU_CAPABILITY_AVX2)
constexpr int64_t kBf16Vec = 32;  // bf16 elements per 512-bit vector

// Where element d of a head's accumulator lives on the AVX-512 path. Step 3 interleaves a vector of 32 elements
// of two value rows with unpacklo/unpackhi_epi16, which work within 128-bit lanes: the "lo" vector gets elements
// 8L + (0..3) of each lane L = 0..3, the "hi" vector elements 8L + (4..7); the accumulator of a vector is stored as
// [lo (16 floats), hi (16 floats)].
inline int64_t acc_index(int64_t d, bool avx512_bf16) {
  if (!avx512_bf16) return d;
  const int64_t r = d % kBf16Vec, lane = r / 8, w = r % 8;
  return d - r + (w / 4) * 16 + lane * 4 + w % 4;
}


// Decodes cache elements to bfloat16, 32 at a time (load_bf16x32): for fp8 caches the 128 magnitudes' bfloat16 bits
// (Fp8Table::bf16_magnitude) in four vectors, loaded once per call of the functions below.
struct Bf16Decoder {
  __m512i magnitudes[4];  // entries 0-31, 32-63, 64-95, 96-127
};

template <typename cache_t>
PA_TARGET_AVX512 inline Bf16Decoder bf16_decoder() {
  Bf16Decoder decoder;
  if constexpr (kIsFp8<cache_t>) {
    for (int i = 0; i < 4; ++i) decoder.magnitudes[i] = _mm512_load_si512(fp8_table<cache_t>.bf16_magnitude + 32 * i);
  }
  return decoder;
}

PA_TARGET_AVX512 inline __m512i load_bf16x32(const at::BFloat16* p, const Bf16Decoder&) {
  return _mm512_loadu_si512(p);
}

// 32 fp8 bytes, widened to 16 bits: two 64-entry lookups (vpermi2w reads the index's low 6 bits), the one
// selected by bit 6, then the sign bit moved from bit 7 to bit 15.
template <typename fp8_t, typename = std::enable_if_t<kIsFp8<fp8_t>>>
PA_TARGET_AVX512 inline __m512i load_bf16x32(const fp8_t* p, const Bf16Decoder& decoder) {
  const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i low = _mm512_permutex2var_epi16(decoder.magnitudes[0], bytes, decoder.magnitudes[1]);
  const __m512i high = _mm512_permutex2var_epi16(decoder.magnitudes[2], bytes, decoder.magnitudes[3]);
  const __m512i magnitude =
      _mm512_mask_blend_epi16(_mm512_test_epi16_mask(bytes, _mm512_set1_epi16(0x40)), low, high);
  // magnitude | ((bytes << 8) & 0x8000)
  return _mm512_ternarylogic_epi32(magnitude, _mm512_slli_epi16(bytes, 8), _mm512_set1_epi16(-0x8000), 0xF8);
}

// Per 128-bit lane L: [sum of a's 4 elements in L, same of b, c, d].
PA_TARGET_AVX512 inline __m512 reduce_in_lanes(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // a0+a2 b0+b2 a1+a3 b1+b3
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d ab_d = _mm512_castps_pd(ab), cd_d = _mm512_castps_pd(cd);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ab_d, cd_d)),  // a0+a2 b0+b2 c0+c2 d0+d2
                       _mm512_castpd_ps(_mm512_unpackhi_pd(ab_d, cd_d)));
}

// [x, y] -> [x0 + x1, x2 + x3, y0 + y1, y2 + y3] over 128-bit lanes.
PA_TARGET_AVX512 inline __m512 add_lane_pairs(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Step 1 (logits): logits[j] lane i = scale * (q_j . k_i) for kHeads bf16 query heads q_j = q + j * q_stride and
// the tile's 16 key rows k_i = rows[i] + offset. Four tokens at a time: 4 * kHeads dot products in 16-lane partial
// sums, reduced in a tree of shuffles (reduce_in_lanes, then add_lane_pairs twice) into one vector per head.
template <int kHeads, typename cache_t>
PA_TARGET_AVX512 void tile_logits_avx512(const at::BFloat16* q, int64_t q_stride, const cache_t* const* rows,
                                         int64_t offset, int64_t head_dim, float scale,
                                         Prefetcher<cache_t>* prefetcher, __m512 logits[kHeads]) {
  const Bf16Decoder decoder = bf16_decoder<cache_t>();
  __m512 quarter[kHeads][4];  // [head][token quad g]: per 128-bit lane, the 4 tokens' partial sums
#pragma GCC unroll 4
  for (int g = 0; g < 4; ++g) {
    const cache_t* k[4];
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      k[r] = rows[4 * g + r] + offset;
      if (prefetcher) prefetcher->step(), prefetcher->keys(4 * g + r);
    }
    __m512 acc[4][kHeads];
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < kHeads; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += kBf16Vec) {
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        const __m512bh key = (__m512bh)load_bf16x32(k[r] + d, decoder);
#pragma GCC unroll 4
        for (int j = 0; j < kHeads; ++j) {
          acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)_mm512_loadu_si512(q + j * q_stride + d), key);
        }
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < kHeads; ++j) quarter[j][g] = reduce_in_lanes(acc[0][j], acc[1][j], acc[2][j], acc[3][j]);
  }
#pragma GCC unroll 4
  for (int j = 0; j < kHeads; ++j) {
    const __m512 sums = add_lane_pairs(add_lane_pairs(quarter[j][0], quarter[j][1]),
                                       add_lane_pairs(quarter[j][2], quarter[j][3]));
    logits[j] = _mm512_mul_ps(sums, _mm512_set1_ps(scale));
  }
}

// A pair of bfloat16 read as one 32-bit word (for a broadcast), at any even address (a query head may start at any
// element), without breaking the aliasing rules.
typedef int32_t bf16_pair_t __attribute__((aligned(2), may_alias));

// Step 1 on a tiled cache: logits[j] lane i = scale * (q_j . k_i) for kHeads bf16 query heads q_j = q + j * q_stride
// over the 16 tokens of a tile of keys, key_tile [head_dim / 2][16][2]: per tile row (dims 2r, 2r + 1) one vdpbf16ps
// per head into U running sums per head (U * kHeads >= 8 independent chains, to cover the latency). Prefetch: the
// rows in 16 equal parts, one step and the next unit's slice (its keys(i)) per part.
template <int kHeads, typename cache_t>
PA_TARGET_AVX512 void tile_logits_tiled_avx512(const at::BFloat16* q, int64_t q_stride, const cache_t* key_tile,
                                               int64_t head_dim, float scale, Prefetcher<cache_t>* prefetcher,
                                               __m512 logits[kHeads]) {
  constexpr int U = kHeads >= 3 ? 2 : 8 / kHeads;  // head_dim / 2 is a multiple of 16
  const Bf16Decoder decoder = bf16_decoder<cache_t>();
  const int64_t num_rows = head_dim / 2, part_rows = num_rows / kTileTokens;  // prefetch: a step per 16th
  const bf16_pair_t* pairs[kHeads];  // each head's query as pairs of dims
#pragma GCC unroll 4
  for (int j = 0; j < kHeads; ++j) pairs[j] = reinterpret_cast<const bf16_pair_t*>(q + j * q_stride);
  __m512 acc[kHeads][U];
#pragma GCC unroll 4
  for (int j = 0; j < kHeads; ++j)
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) acc[j][u] = _mm512_setzero_ps();
  // Steps of step_rows rows (a multiple of U and of part_rows: both powers of two), each with its parts' prefetch.
  const int64_t step_rows = std::max<int64_t>(U, part_rows), parts_per_step = step_rows / part_rows;
  int64_t part = 0;
  for (int64_t r0 = 0; r0 < num_rows; r0 += step_rows) {
    for (int64_t p = 0; prefetcher && p < parts_per_step; ++p, ++part) prefetcher->step(), prefetcher->keys(part);
    for (int64_t r = r0; r < r0 + step_rows; r += U) {
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) {
        const __m512bh keys = (__m512bh)load_bf16x32(key_tile + (r + u) * 2 * kTileTokens, decoder);
#pragma GCC unroll 4
        for (int j = 0; j < kHeads; ++j) {
          acc[j][u] = _mm512_dpbf16_ps(acc[j][u], keys, (__m512bh)_mm512_set1_epi32(pairs[j][r + u]));
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < kHeads; ++j) {
#pragma GCC unroll 8
    for (int u = 1; u < U; ++u) acc[j][0] = _mm512_add_ps(acc[j][0], acc[j][u]);
    logits[j] = _mm512_mul_ps(acc[j][0], _mm512_set1_ps(scale));
  }
}

// Step 2 (softmax) for one head: x = its logits of the tile (lanes past the tile's tokens -inf). Raises the running
// max if needed, splits p = exp(x - max) into two bfloat16 terms, hi = p truncated to bfloat16 (one bf16 ulp less
// where that is p itself) and lo = bf16(p - hi) (together p to about 2^-16 relative), writes them as pairs,
// p_pairs[i] = (hi_2i, hi_2i+1) and p_pairs[8 + i] = (lo_2i, lo_2i+1), and adds hi + lo to the lane sums.
// NOTE: hi and lo are both > 0 wherever p > 0, so that a value of inf gives inf: rounding hi to nearest would
// leave lo = 0 (p = 1 at the max, any p exact in bf16: 0 * inf = NaN) or lo < 0 (inf - inf = NaN).
// kTerms = 1 (AttentionParams::p_terms): hi = p rounded to the nearest bfloat16, lo = 0 (P V then skips it); the
// sums add p itself, so the lse keeps float32's precision and the rounding errors of the weights (unbiased) average
// out in the output.
template <int kTerms = 2>
PA_TARGET_AVX512 inline void softmax_tile_avx512(__m512 x, float* max_logit, float* exp_sums, float* acc,
                                                 int64_t head_dim, uint32_t* p_pairs) {
  if (_mm512_cmp_ps_mask(x, _mm512_set1_ps(*max_logit), _CMP_GT_OQ)) {  // rarely, after the first tiles
    const float new_max = _mm512_reduce_max_ps(x);
    const float alpha = std::exp(*max_logit - new_max);  // 0 on the first tile: max_logit = -inf
    _mm512_storeu_ps(exp_sums, _mm512_mul_ps(_mm512_loadu_ps(exp_sums), _mm512_set1_ps(alpha)));
    for (int64_t d = 0; d < head_dim; d += 16) {
      _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), _mm512_set1_ps(alpha)));
    }
    *max_logit = new_max;
  }
  const __m512 p = exp_nonpositive(_mm512_sub_ps(x, _mm512_set1_ps(*max_logit)));
  if constexpr (kTerms == 1) {
    const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(p);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p_pairs), rounded);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p_pairs + kTileTokens / 2), _mm256_setzero_si256());
    _mm512_storeu_ps(exp_sums, _mm512_add_ps(_mm512_loadu_ps(exp_sums), p));
    return;
  }
  __m256i hi = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(p), 16));  // truncated: hi <= p
  const __mmask16 exact = _mm512_cmp_ps_mask(p, widen_bf16(hi), _CMP_EQ_OQ) &
                          _mm512_cmp_ps_mask(p, _mm512_setzero_ps(), _CMP_GT_OQ);
  hi = _mm256_mask_sub_epi16(hi, exact, hi, _mm256_set1_epi16(1));  // the bf16 below p: hi < p where p > 0
  const __m512 hi_float = widen_bf16(hi);
  const __m256bh lo = _mm512_cvtneps_pbh(_mm512_sub_ps(p, hi_float));  // exact difference (>= 0), then rounded
  const __m512 lo_float = widen_bf16((__m256i)lo);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p_pairs), hi);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p_pairs + kTileTokens / 2), (__m256i)lo);
  _mm512_storeu_ps(exp_sums, _mm512_add_ps(_mm512_loadu_ps(exp_sums), _mm512_add_ps(hi_float, lo_float)));
}

// Step 3 (values): acc_j += sum_i p_j[i] * v_i for kHeads heads (acc_j = acc + j * head_dim in acc_index order, p_j the
// pairs p_pairs + j * 16) over the tile's value rows v_i = rows[i] + offset, i < num_tokens, elements
// [d_begin, d_end), C vectors of 32 at a time. Per token pair and vector: the two rows interleaved into lo/hi (see
// acc_index), then per head and half two vdpbf16ps, with the high and the low parts of the pair (p_2i, p_2i+1)
// broadcast. NOTE: the rows past num_tokens (the tile's padding, whose p is 0) are not multiplied: with an odd
// num_tokens the last pair's second row is zeros; a padding row repeats the last token's, and 0 * inf is NaN.
template <int kHeads, int C, int kTerms, typename cache_t>
PA_TARGET_AVX512 void tile_values_avx512_range(const uint32_t* p_pairs, const cache_t* const* rows,
                                               int64_t num_tokens, int64_t offset, int64_t head_dim,
                                               int64_t d_begin, int64_t d_end, float* acc,
                                               Prefetcher<cache_t>* prefetcher) {
  const Bf16Decoder decoder = bf16_decoder<cache_t>();
  for (int64_t d = d_begin; d + C * kBf16Vec <= d_end; d += C * kBf16Vec) {
    __m512 sum[kHeads][C][2];
#pragma GCC unroll 4
    for (int j = 0; j < kHeads; ++j)
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) sum[j][c][h] = _mm512_loadu_ps(acc + j * head_dim + d + c * kBf16Vec + h * 16);
#pragma GCC unroll 2
    for (int64_t i = 0; i < num_tokens; i += 2) {
      if (prefetcher && d == d_begin) {
        prefetcher->step(), prefetcher->step();
        prefetcher->values(i), prefetcher->values(i + 1);
      }
      const bool pair = i + 1 < num_tokens;
      __m512bh half[C][2];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const __m512i a = load_bf16x32(rows[i] + offset + d + c * kBf16Vec, decoder);
        const __m512i b =
            pair ? load_bf16x32(rows[i + 1] + offset + d + c * kBf16Vec, decoder) : _mm512_setzero_si512();
        half[c][0] = (__m512bh)_mm512_unpacklo_epi16(a, b);
        half[c][1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
      }
#pragma GCC unroll 4
      for (int j = 0; j < kHeads; ++j) {
        const uint32_t* pair = p_pairs + j * kTileTokens + i / 2;
        const __m512bh weight_hi = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair[0]));
        const __m512bh weight_lo = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair[kTileTokens / 2]));
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c)
#pragma GCC unroll 2
          for (int h = 0; h < 2; ++h) {
            if constexpr (kTerms == 2) sum[j][c][h] = _mm512_dpbf16_ps(sum[j][c][h], half[c][h], weight_lo);
            sum[j][c][h] = _mm512_dpbf16_ps(sum[j][c][h], half[c][h], weight_hi);
          }
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < kHeads; ++j)
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) _mm512_storeu_ps(acc + j * head_dim + d + c * kBf16Vec + h * 16, sum[j][c][h]);
  }
}

template <int kHeads, int kTerms, typename cache_t>
PA_TARGET_AVX512 void tile_values_avx512(const uint32_t* p_pairs, const cache_t* const* rows, int64_t num_tokens,
                                         int64_t offset, int64_t head_dim, float* acc,
                                         Prefetcher<cache_t>* prefetcher) {
  constexpr int C = kHeads >= 3 ? 2 : 4 / kHeads;  // at least 8 accumulators, at most 16
  const int64_t main = head_dim / (C * kBf16Vec) * (C * kBf16Vec);
  tile_values_avx512_range<kHeads, C, kTerms>(p_pairs, rows, num_tokens, offset, head_dim, 0, main, acc, prefetcher);
  tile_values_avx512_range<kHeads, 1, kTerms>(p_pairs, rows, num_tokens, offset, head_dim, main, head_dim, acc,
                                              main == 0 ? prefetcher : nullptr);
}

// Step 3 on a tiled cache: acc_j += sum_i p_j[i] * v_i for kHeads heads (acc_j = acc + j * head_dim, natural order;
// p_j the pairs p_pairs + j * 16) over the tile's lanes [lane0, lane0 + num_tokens) of value_tile [8][head_dim][2],
// dims [d_begin, d_end), C vectors of 16 dims at a time: per token pair and vector one tile row (16 dims of the
// two tokens, interleaved) times the pair's weights broadcast, per head and term. NOTE: a pair's lane outside the
// tile's tokens (its p is 0) is zeroed in the row, never multiplied: it may hold anything, NaN or inf.
template <int kHeads, int C, int kTerms, typename cache_t>
PA_TARGET_AVX512 void tile_values_tiled_avx512_range(const uint32_t* p_pairs, const cache_t* value_tile,
                                                     int64_t lane0, int64_t num_tokens, int64_t head_dim,
                                                     int64_t d_begin, int64_t d_end, float* acc,
                                                     Prefetcher<cache_t>* prefetcher) {
  const Bf16Decoder decoder = bf16_decoder<cache_t>();
  const int64_t first_pair = lane0 / 2, end_pair = (lane0 + num_tokens + 1) / 2;
  // The 16-bit elements kept in the first and the last pair: the second token only where lane0 is odd, the first
  // only where the tokens end at an odd lane.
  const __mmask32 first_keep = lane0 % 2 ? 0xAAAAAAAAu : 0xFFFFFFFFu;
  const __mmask32 last_keep = (lane0 + num_tokens) % 2 ? 0x55555555u : 0xFFFFFFFFu;
  for (int64_t d = d_begin; d + C * 16 <= d_end; d += C * 16) {
    __m512 sum[kHeads][C];
#pragma GCC unroll 4
    for (int j = 0; j < kHeads; ++j)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) sum[j][c] = _mm512_loadu_ps(acc + j * head_dim + d + c * 16);
    for (int64_t pair = first_pair; pair < end_pair; ++pair) {
      if (prefetcher && d == d_begin) {
        prefetcher->step(), prefetcher->step();
        prefetcher->values(2 * (pair - first_pair)), prefetcher->values(2 * (pair - first_pair) + 1);
      }
      const __mmask32 keep = (pair == first_pair ? first_keep : 0xFFFFFFFFu) &
                             (pair + 1 == end_pair ? last_keep : 0xFFFFFFFFu);
      __m512bh rows[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        rows[c] = (__m512bh)_mm512_maskz_mov_epi16(
            keep, load_bf16x32(value_tile + pair * 2 * head_dim + 2 * (d + c * 16), decoder));
      }
#pragma GCC unroll 4
      for (int j = 0; j < kHeads; ++j) {
        const uint32_t* pairs = p_pairs + j * kTileTokens + pair;
        const __m512bh weight_hi = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[0]));
        const __m512bh weight_lo = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[kTileTokens / 2]));
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
          if constexpr (kTerms == 2) sum[j][c] = _mm512_dpbf16_ps(sum[j][c], rows[c], weight_lo);
          sum[j][c] = _mm512_dpbf16_ps(sum[j][c], rows[c], weight_hi);
        }
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < kHeads; ++j)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + j * head_dim + d + c * 16, sum[j][c]);
  }
}

template <int kHeads, int kTerms, typename cache_t>
PA_TARGET_AVX512 void tile_values_tiled_avx512(const uint32_t* p_pairs, const cache_t* value_tile, int64_t lane0,
                                               int64_t num_tokens, int64_t head_dim, float* acc,
                                               Prefetcher<cache_t>* prefetcher) {
  constexpr int C = kHeads >= 3 ? 4 : 8 / kHeads;  // at least 8 accumulators, at most 16
  const int64_t main = head_dim / (C * 16) * (C * 16);
  tile_values_tiled_avx512_range<kHeads, C, kTerms>(p_pairs, value_tile, lane0, num_tokens, head_dim, 0, main, acc,
                                                    prefetcher);
  tile_values_tiled_avx512_range<kHeads, 2, kTerms>(p_pairs, value_tile, lane0, num_tokens, head_dim, main,
                                                    head_dim, acc, main == 0 ? prefetcher : nullptr);
}

// Step 2 for query head `head` over one tile (the AVX-512 and AMX paths): its scaled logits x, with soft cap and
// ALiBi (apply_logit_mods edits them in memory, at spill: 16 floats), masked to the tile's tokens, into the row's
// running state (sc); p as bfloat16 pairs into p_pairs.
template <int kTerms = 2, typename cache_t>
PA_TARGET_AVX512 inline void softmax_head_avx512(const AttentionParams<at::BFloat16, cache_t>& params,
                                                 int64_t head, const Tile<cache_t>& tile, int64_t last_token,
                                                 __m512 x, float* spill, Scratch& sc, uint32_t* p_pairs) {
  if (params.logits_soft_cap > 0 || params.alibi_slopes) {
    _mm512_storeu_ps(spill, x);
    apply_logit_mods(params, head, tile.first - tile.lane0, last_token, spill);  // lane 0's token
    x = _mm512_loadu_ps(spill);
  }
  const __mmask16 valid = static_cast<__mmask16>(((1u << tile.num_tokens) - 1) << tile.lane0);
  softmax_tile_avx512<kTerms>(_mm512_mask_blend_ps(valid, _mm512_set1_ps(kNegInf), x), sc.max_logit + head,
                              sc.exp_sums + head * kTileTokens, sc.acc + head * params.head_dim_v, params.head_dim_v,
                              p_pairs);
}

// Steps 1-3 for query heads [head0, head0 + kHeads) of kv head `kv_head`'s head group over one tile (AVX-512 bf16
// path).
template <int kHeads, int kTerms, typename cache_t>
PA_TARGET_AVX512 void attend_heads_avx512(const AttentionParams<at::BFloat16, cache_t>& params,
                                          const at::BFloat16* query, int64_t kv_head, int64_t head0,
                                          const Tile<cache_t>& tile, int64_t last_token, Scratch& sc,
                                          Prefetcher<cache_t>* prefetcher) {
  const int64_t head_dim = params.head_dim;
  const at::BFloat16* q = query + head0 * params.query_head_stride;
  __m512 logits[kHeads];
  if (params.tiled) {
    tile_logits_tiled_avx512<kHeads>(q, params.query_head_stride, tile.key_tile + kv_head * params.kv.key.head_stride,
                                     head_dim, params.scale, prefetcher, logits);
  } else {
    tile_logits_avx512<kHeads>(q, params.query_head_stride, tile.keys, kv_head * params.kv.key.head_stride, head_dim,
                               params.scale, prefetcher, logits);
  }
  for (int j = 0; j < kHeads; ++j) {
    softmax_head_avx512<kTerms>(params, head0 + j, tile, last_token, logits[j], sc.logits + j * kTileTokens, sc,
                                sc.p_pairs + j * kTileTokens);
  }
  float* acc = sc.acc + head0 * params.head_dim_v;
  if (params.tiled) {
    tile_values_tiled_avx512<kHeads, kTerms>(sc.p_pairs, tile.value_tile + kv_head * params.kv.value.head_stride,
                                             tile.lane0, tile.num_tokens, params.head_dim_v, acc, prefetcher);
  } else {
    tile_values_avx512<kHeads, kTerms>(sc.p_pairs, tile.values, tile.num_tokens,
                                       kv_head * params.kv.value.head_stride, params.head_dim_v, acc, prefetcher);
  }
}

template <typename cache_t>
void attend_tile_avx512(const AttentionParams<at::BFloat16, cache_t>& params, const at::BFloat16* query,
                        int64_t kv_head, const Tile<cache_t>& tile, int64_t last_token, Scratch& sc,
                        Prefetcher<cache_t>& prefetcher) {
  for_each_head_pass(params.group_size, [&](auto heads, int64_t first) {
    constexpr int kHeads = decltype(heads)::value;
    const int64_t head0 = kv_head * params.group_size + first;
    Prefetcher<cache_t>* pf = first == 0 ? &prefetcher : nullptr;
    if (params.p_terms == 1) {
      return attend_heads_avx512<kHeads, 1>(params, query, kv_head, head0, tile, last_token, sc, pf);
    }
    attend_heads_avx512<kHeads, 2>(params, query, kv_head, head0, tile, last_token, sc, pf);
  });
}

// out[d] = bfloat16(acc[acc_index(d)] * scale) for d < head_dim (a multiple of 32): step 3's accumulator order
// undone 32 elements at a time (lo holds elements 8L + 0..3 of each 128-bit lane L, hi 8L + 4..7) and rounded as
// the scalar conversion rounds (round_to_bf16): the same bits. acc_index_order = false (tiled caches): acc in the
// natural order.
PA_TARGET_AVX512 inline void store_head_avx512(const float* acc, float scale, at::BFloat16* out, int64_t head_dim,
                                               bool acc_index_order = true) {
  const __m512i first = acc_index_order ? _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23)
                                        : _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i second =
      acc_index_order ? _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31)
                      : _mm512_setr_epi32(16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
  const __m512 factor = _mm512_set1_ps(scale);
  for (int64_t d = 0; d < head_dim; d += kBf16Vec) {
    const __m512 lo = _mm512_loadu_ps(acc + d), hi = _mm512_loadu_ps(acc + d + 16);
    const __m512 x0 = _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), factor);
    const __m512 x1 = _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), factor);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d), round_to_bf16(x0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d + 16), round_to_bf16(x1));
  }
}

// The AVX-512 path is used where the CPU has AVX512F/BW/VL/DQ and AVX512_BF16, unless the environment variable
// PAGED_ATTN_NO_AVX512 is set (to test the portable AVX2 path on such a CPU): common.h's cpu_avx512_bf16.
inline bool use_avx512() { return cpu_avx512_bf16(); }

// A bfloat16 query over a bfloat16 or fp8 cache.
template <typename scalar_t, typename cache_t>
constexpr bool kHasAvx512Path =
    std::is_same_v<scalar_t, at::BFloat16> && (std::is_same_v<cache_t, at::BFloat16> || kIsFp8<cache_t>);

template <typename scalar_t, typename cache_t>
inline bool avx512_bf16_path(int64_t head_dim, int64_t head_dim_v) {
  return kHasAvx512Path<scalar_t, cache_t> && head_dim % kBf16Vec == 0 && head_dim_v % kBf16Vec == 0 && use_avx512();
}
#else
inline int64_t acc_index(int64_t d, bool) { return d; }
template <typename scalar_t, typename cache_t>
inline bool avx512_bf16_path(int64_t, int64_t) { return false; }
#endif

}  // namespace
}  // namespace paged_attn
