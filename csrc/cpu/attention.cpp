// CPU kernel of paged decode attention (paged_attn::paged_attention): one query token per sequence.
//
// Math, per sequence s of length L, query head h (reading kv head h / group_size) and token t in [start, L),
// start = max(0, L - sliding_window) (0 without a window):
//   x_t = scale * (q . k_t);  x_t = cap * tanh(x_t / cap) if logits_soft_cap = cap > 0;
//   x_t += slope[h] * (t - (L - 1)) with ALiBi;  out = sum_t softmax(x)_t * v_t, all in float32.
//
// Work mapping: one task per (sequence, partition of its tokens). A task walks its tokens a block at a time, and
// within a block serves each kv head's whole group of query heads, so every key/value row is read from memory
// once (GQA reuse) and each block's rows are read as one contiguous run. Per (block, kv head):
//   1. logits of the group's heads for the block's tokens (vectorized dot products, query pre-scaled),
//   2. online softmax: per head, raise the running max once for the block (rescaling the running sum and the
//      accumulator only when it grew) and turn the logits into p = exp(x - max),
//   3. acc += p * v over the block's tokens.
// Usually a sequence is one partition and its task writes out = acc / sum. When there are too few sequences to
// keep every thread busy, each sequence's tokens are split into equal partitions; each task leaves its
// (max, sum, acc) per head in float32 scratch and a second parallel pass merges them exactly:
//   M = max_p max_p,  out = sum_p e^(max_p - M) acc_p / sum_p e^(max_p - M) sum_p.
// Only tokens t < L (and in the window) are ever read: unused cache slots and block-table entries may hold
// anything, NaN included.

// NOTE: at::vec::Vectorized picks its implementation from the CPU_CAPABILITY_* macros, which torch's own build
// sets per file. setup.py and CMakeLists.txt compile this extension with -march=x86-64-v3 (AVX2, FMA, F16C) on
// x86_64, so select the AVX2 implementation here, in a CPU_CAPABILITY namespace of our own so that these inline
// functions can never be confused with another library's build of the same headers. Elsewhere Vectorized falls
// back to its portable implementation.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CPU_CAPABILITY_AVX2
#define CPU_CAPABILITY paged_attn_avx2
#endif

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "../common.h"

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace paged_attn {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVecSize = Vec::size();
constexpr int64_t kMaxHeadTile = 4;           // query heads that share one pass over a key or value row
constexpr int64_t kMinPartitionTokens = 256;  // shorter partitions would cost more to merge than they gain
constexpr int64_t kPrefetchTokens = 16;       // how far ahead rows are prefetched (rounded up to whole blocks)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <typename scalar_t>
inline Vec load_float(const scalar_t* p) {  // kVecSize elements, widened to float
  if constexpr (std::is_same_v<scalar_t, float>) {
    return Vec::loadu(p);
  } else {
    Vec out;
    at::vec::load_to_float(p, out);
    return out;
  }
}

// Independent accumulators per query head, so that kHeads * kUnroll FMA chains hide the FMA latency.
template <int kHeads>
constexpr int kUnroll = kHeads <= 2 ? 4 : 2;

// The one place for paged address arithmetic. Token t of a sequence lives in block block_table[t / block_size]
// at offset t % block_size; in a block, token `offset`'s rows of all kv heads are contiguous ([num_kv_heads,
// head_dim]), so one kv head's rows are row_stride = num_kv_heads * head_dim elements apart.
template <typename scalar_t>
struct PagedKV {
  const scalar_t* key_cache;    // [num_blocks, block_size, num_kv_heads, head_dim], block stride key_block_stride
  const scalar_t* value_cache;  // [num_blocks, block_size, num_kv_heads, head_dim], block stride value_block_stride
  int64_t key_block_stride, value_block_stride, row_stride, head_dim;  // in elements

  // NOTE: block ids are widened to 64 bits first: block * block_stride can exceed 2^31.
  const scalar_t* keys(int32_t block, int64_t offset, int64_t kv_head) const {
    return key_cache + int64_t{block} * key_block_stride + offset * row_stride + kv_head * head_dim;
  }
  const scalar_t* values(int32_t block, int64_t offset, int64_t kv_head) const {
    return value_cache + int64_t{block} * value_block_stride + offset * row_stride + kv_head * head_dim;
  }
};

// logits[j * logits_stride] = q_j . k for one key row k and the kHeads query heads q_j = q + j * head_dim.
template <int kHeads, typename scalar_t>
inline void dot_heads(const float* q, const scalar_t* k, int64_t head_dim, float* logits, int64_t logits_stride) {
  constexpr int U = kUnroll<kHeads>;
  Vec acc[kHeads][U];
#pragma GCC unroll 8
  for (int j = 0; j < kHeads; ++j)
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) acc[j][u] = Vec(0.f);
  int64_t d = 0;
  for (; d + U * kVecSize <= head_dim; d += U * kVecSize) {
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) {
      const Vec key = load_float(k + d + u * kVecSize);
#pragma GCC unroll 8
      for (int j = 0; j < kHeads; ++j)
        acc[j][u] = at::vec::fmadd(Vec::loadu(q + j * head_dim + d + u * kVecSize), key, acc[j][u]);
    }
  }
  for (; d + kVecSize <= head_dim; d += kVecSize) {
    const Vec key = load_float(k + d);
#pragma GCC unroll 8
    for (int j = 0; j < kHeads; ++j) acc[j][0] = at::vec::fmadd(Vec::loadu(q + j * head_dim + d), key, acc[j][0]);
  }
#pragma GCC unroll 8
  for (int j = 0; j < kHeads; ++j) {
#pragma GCC unroll 8
    for (int u = 1; u < U; ++u) acc[j][0] = acc[j][0] + acc[j][u];
    float sum = at::vec::vec_reduce_all<float>(std::plus<Vec>(), acc[j][0]);
    for (int64_t r = d; r < head_dim; ++r) sum += q[j * head_dim + r] * static_cast<float>(k[r]);
    logits[j * logits_stride] = sum;
  }
}

// acc_j += sum_i p_j[i] * v_i for the kHeads query heads (acc_j = acc + j * head_dim, p_j = p + j * p_stride)
// over num_tokens value rows v_i = v + i * row_stride.
template <int kHeads, typename scalar_t>
inline void accumulate_values(const float* p, int64_t p_stride, const scalar_t* v, int64_t row_stride,
                              int64_t num_tokens, int64_t head_dim, float* acc) {
  constexpr int U = kUnroll<kHeads>;
  int64_t d = 0;
  for (; d + U * kVecSize <= head_dim; d += U * kVecSize) {
    Vec sum[kHeads][U];
#pragma GCC unroll 8
    for (int j = 0; j < kHeads; ++j)
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) sum[j][u] = Vec::loadu(acc + j * head_dim + d + u * kVecSize);
    for (int64_t i = 0; i < num_tokens; ++i) {
      Vec row[U];
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) row[u] = load_float(v + i * row_stride + d + u * kVecSize);
#pragma GCC unroll 8
      for (int j = 0; j < kHeads; ++j) {
        const Vec weight(p[j * p_stride + i]);
#pragma GCC unroll 8
        for (int u = 0; u < U; ++u) sum[j][u] = at::vec::fmadd(weight, row[u], sum[j][u]);
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < kHeads; ++j)
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) sum[j][u].store(acc + j * head_dim + d + u * kVecSize);
  }
  for (; d + kVecSize <= head_dim; d += kVecSize) {
    Vec sum[kHeads];
#pragma GCC unroll 8
    for (int j = 0; j < kHeads; ++j) sum[j] = Vec::loadu(acc + j * head_dim + d);
    for (int64_t i = 0; i < num_tokens; ++i) {
      const Vec row = load_float(v + i * row_stride + d);
#pragma GCC unroll 8
      for (int j = 0; j < kHeads; ++j) sum[j] = at::vec::fmadd(Vec(p[j * p_stride + i]), row, sum[j]);
    }
#pragma GCC unroll 8
    for (int j = 0; j < kHeads; ++j) sum[j].store(acc + j * head_dim + d);
  }
  for (; d < head_dim; ++d)
    for (int64_t i = 0; i < num_tokens; ++i)
      for (int j = 0; j < kHeads; ++j)
        acc[j * head_dim + d] += p[j * p_stride + i] * static_cast<float>(v[i * row_stride + d]);
}

// Calls f(std::integral_constant<int, n>, first) for tiles of n <= kMaxHeadTile heads covering [0, group_size).
template <typename F>
inline void for_each_head_tile(int64_t group_size, F&& f) {
  for (int64_t first = 0; first < group_size; first += kMaxHeadTile) {
    switch (std::min(kMaxHeadTile, group_size - first)) {
      case 4: f(std::integral_constant<int, 4>{}, first); break;
      case 3: f(std::integral_constant<int, 3>{}, first); break;
      case 2: f(std::integral_constant<int, 2>{}, first); break;
      default: f(std::integral_constant<int, 1>{}, first); break;
    }
  }
}

template <typename scalar_t>
struct Problem {
  PagedKV<scalar_t> kv;
  const scalar_t* query;  // [num_seqs, num_heads, head_dim], strides query_seq_stride, query_head_stride
  int64_t query_seq_stride, query_head_stride;
  const int32_t* block_tables;  // [num_seqs, max_blocks_per_seq]
  const int32_t* seq_lens;      // [num_seqs]
  const float* alibi_slopes;    // [num_heads] or nullptr
  int64_t max_blocks_per_seq, block_size, num_heads, num_kv_heads, group_size, head_dim, sliding_window;
  float scale, logits_soft_cap;
  int64_t split;  // accumulator in split order over chunks of `split` elements (0: natural order), see split_index

  int64_t window_start(int64_t seq) const {
    return sliding_window > 0 ? std::max<int64_t>(0, seq_lens[seq] - sliding_window) : 0;
  }
};

// A task's scratch memory: the online-softmax state of every query head, and the logits of one group.
struct Scratch {
  int64_t logits_stride;  // block_size rounded up to whole vectors
  std::vector<float> buffer;
  float* q;          // [num_heads, head_dim], pre-scaled query
  float* acc;        // [num_heads, head_dim], unnormalized output
  float* max_logit;  // [num_heads], running max
  float* exp_sum;    // [num_heads], running sum of exp(x - max_logit)
  float* logits;     // [group_size, logits_stride]: x, then p = exp(x - max), of one block and one group

  Scratch(int64_t num_heads, int64_t group_size, int64_t head_dim, int64_t block_size)
      : logits_stride((block_size + kVecSize - 1) / kVecSize * kVecSize),
        buffer(num_heads * (2 * head_dim + 2) + group_size * logits_stride) {
    q = buffer.data();
    acc = q + num_heads * head_dim;
    max_logit = acc + num_heads * head_dim;
    exp_sum = max_logit + num_heads;
    logits = exp_sum + num_heads;
  }
};

// Software prefetch (into L2) of the rows a later step reads: one contiguous run of keys and one of values.
// NOTE: the prefetches are spread over the current block's work, a few cache lines per key row: issued in one
// burst they fill the core's outstanding-miss slots and stall it until the data arrives, and nothing overlaps.
struct Prefetcher {
  const char* keys = nullptr;
  const char* values = nullptr;
  int64_t bytes = 0, done = 0, bytes_per_step = 0;

  void step() {
    for (const int64_t stop = std::min(bytes, done + bytes_per_step); done < stop; done += 64) {
      __builtin_prefetch(keys + done, 0, 2);
      __builtin_prefetch(values + done, 0, 2);
    }
  }
};

#if defined(CPU_CAPABILITY_AVX2)
// Fast path for bfloat16 caches on CPUs with AVX-512 and AVX512_BF16 (head_dim a multiple of 32), used instead of
// dot_heads and accumulate_values, chosen at run time (use_avx512). Only these functions are compiled for
// AVX-512 (function target attribute), so no AVX-512 code can run on a CPU without it; elsewhere the portable
// path above runs.
//  - Logits: _mm512_dpbf16_ps on the bf16 query and keys as they are (products of two bf16 are exact in
//    float32), then times scale.
//  - Values: a bf16 value is the top half of a float32, so 32 bf16 loaded as one 512-bit vector widen in one
//    instruction each into two float vectors: the even elements (shift left) and the odd ones (mask). The
//    accumulator is element-wise, so the task's accumulator is kept in that "split" order (split_index) and put
//    back in order only at the end.
constexpr int64_t kSplitChunk512 = 32;  // bf16 elements per 512-bit load

// Where element d of a head's row lives in split order, for chunks of `chunk` elements (0: no split order).
inline int64_t split_index(int64_t d, int64_t chunk) {
  if (chunk == 0) return d;
  const int64_t r = d % chunk;
  return d - r + (r % 2) * (chunk / 2) + r / 2;
}

// [sum of a[0]'s lanes, ..., sum of a[7]'s lanes].
inline __m256 reduce8(const __m256 a[8]) {
  const __m256 a0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 a4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a0123, a4567, 0x20), _mm256_permute2f128_ps(a0123, a4567, 0x31));
}

#define PAGED_ATTN_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

PAGED_ATTN_AVX512 inline __m256 sum_halves(__m512 a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
}

// logits[j * ld + i] = scale * (q_j . k_i) for kHeads bf16 query heads q_j = q + j * q_stride (natural order).
template <int kHeads>
PAGED_ATTN_AVX512 void dot_heads_avx512(const at::BFloat16* q, int64_t q_stride, const at::BFloat16* keys,
                                        int64_t row_stride, int64_t num_tokens, int64_t head_dim, float scale,
                                        float* logits, int64_t ld, Prefetcher* prefetcher) {
  constexpr int kRows = kHeads == 1 ? 8 : kHeads == 2 ? 4 : 2;
  for (int64_t i0 = 0; i0 < num_tokens; i0 += kRows) {
    const at::BFloat16* k[kRows];
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {  // rows past the end repeat the last one; their results are dropped
      k[r] = keys + std::min<int64_t>(i0 + r, num_tokens - 1) * row_stride;
      if (prefetcher) prefetcher->step();
    }
    __m512 acc[8];
#pragma GCC unroll 8
    for (int a = 0; a < 8; ++a) acc[a] = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += kSplitChunk512) {
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) {
        const __m512bh key = (__m512bh)_mm512_loadu_si512(k[r] + d);
#pragma GCC unroll 8
        for (int j = 0; j < kHeads; ++j) {
          const __m512bh qj = (__m512bh)_mm512_loadu_si512(q + j * q_stride + d);
          acc[r * kHeads + j] = _mm512_dpbf16_ps(acc[r * kHeads + j], qj, key);
        }
      }
    }
    __m256 halves[8];
#pragma GCC unroll 8
    for (int a = 0; a < 8; ++a) halves[a] = sum_halves(acc[a]);
    alignas(32) float sums[8];
    _mm256_store_ps(sums, _mm256_mul_ps(reduce8(halves), _mm256_set1_ps(scale)));
    for (int64_t r = 0; r < std::min<int64_t>(kRows, num_tokens - i0); ++r)
#pragma GCC unroll 8
      for (int j = 0; j < kHeads; ++j) logits[j * ld + i0 + r] = sums[r * kHeads + j];
  }
}

// As accumulate_values, with 512-bit vectors and acc in split order. C chunks of 32 elements at a
// time, for at least 8 independent accumulators; accumulate_values_avx512 below picks C.
template <int kHeads, int C>
PAGED_ATTN_AVX512 void accumulate_values_avx512_chunks(const float* p, int64_t ld, const at::BFloat16* v,
                                                       int64_t row_stride, int64_t num_tokens, int64_t head_dim,
                                                       int64_t d_begin, int64_t d_end, float* acc,
                                                       Prefetcher* prefetcher) {
  const __m512i odd_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t d = d_begin; d + C * kSplitChunk512 <= d_end; d += C * kSplitChunk512) {
    __m512 sum[kHeads][C][2];
#pragma GCC unroll 8
    for (int j = 0; j < kHeads; ++j)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          sum[j][c][h] = _mm512_loadu_ps(acc + j * head_dim + d + c * kSplitChunk512 + h * 16);
        }
    for (int64_t i = 0; i < num_tokens; ++i) {
      if (prefetcher && d == d_begin) prefetcher->step();
      __m512 row[C][2];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        const __m512i x = _mm512_loadu_si512(v + i * row_stride + d + c * kSplitChunk512);
        row[c][0] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        row[c][1] = _mm512_castsi512_ps(_mm512_and_si512(x, odd_mask));
      }
#pragma GCC unroll 8
      for (int j = 0; j < kHeads; ++j) {
        const __m512 weight = _mm512_set1_ps(p[j * ld + i]);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c)
#pragma GCC unroll 2
          for (int h = 0; h < 2; ++h) sum[j][c][h] = _mm512_fmadd_ps(weight, row[c][h], sum[j][c][h]);
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < kHeads; ++j)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          _mm512_storeu_ps(acc + j * head_dim + d + c * kSplitChunk512 + h * 16, sum[j][c][h]);
        }
  }
}

template <int kHeads>
PAGED_ATTN_AVX512 void accumulate_values_avx512(const float* p, int64_t ld, const at::BFloat16* v,
                                                int64_t row_stride, int64_t num_tokens, int64_t head_dim,
                                                float* acc, Prefetcher* prefetcher) {
  constexpr int C = kHeads >= 4 ? 1 : 4 / kHeads;
  const int64_t main = head_dim / (C * kSplitChunk512) * (C * kSplitChunk512);
  accumulate_values_avx512_chunks<kHeads, C>(p, ld, v, row_stride, num_tokens, head_dim, 0, main, acc, prefetcher);
  accumulate_values_avx512_chunks<kHeads, 1>(p, ld, v, row_stride, num_tokens, head_dim, main, head_dim, acc,
                                                main == 0 ? prefetcher : nullptr);
}

// The AVX-512 path is used where the CPU has AVX512F/BW/VL/DQ and AVX512_BF16, unless the environment variable
// PAGED_ATTN_NO_AVX512 is set (to test the AVX2 path on such a CPU).
inline bool use_avx512() {
  static const bool use = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512bf16") && std::getenv("PAGED_ATTN_NO_AVX512") == nullptr;
  return use;
}

// The split chunk of the query and accumulator (see split_index): 0 outside the bf16 fast paths.
template <typename scalar_t>
inline int64_t split_chunk(int64_t head_dim) {
  if (!std::is_same_v<scalar_t, at::BFloat16>) return 0;
  return head_dim % kSplitChunk512 == 0 && use_avx512() ? kSplitChunk512 : 0;
}
#else
template <typename scalar_t>
inline int64_t split_chunk(int64_t) { return 0; }
inline int64_t split_index(int64_t d, int64_t) { return d; }
#endif

// Steps 1-3 for the group of kv head `kv_head`, over the num_tokens tokens from t0 whose rows start at
// keys / values (row_stride apart).
template <typename scalar_t>
void attend_block(const Problem<scalar_t>& pb, const scalar_t* query, int64_t kv_head, int64_t t0, int64_t num_tokens,
                  int64_t last_token, const scalar_t* keys, const scalar_t* values, Scratch& sc,
                  Prefetcher& prefetcher) {
  const int64_t group_size = pb.group_size, head_dim = pb.head_dim, first_head = kv_head * group_size;
  const int64_t row_stride = pb.kv.row_stride, ld = sc.logits_stride;
  const float* q = sc.q + first_head * head_dim;
  float* acc = sc.acc + first_head * head_dim;

  // 1. Logits of every head of the group for the block's tokens.
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    if (pb.split == kSplitChunk512) {
      for_each_head_tile(group_size, [&](auto heads, int64_t first) {
        dot_heads_avx512<decltype(heads)::value>(query + (first_head + first) * pb.query_head_stride,
                                                 pb.query_head_stride, keys, row_stride, num_tokens, head_dim,
                                                 pb.scale, sc.logits + first * ld, ld,
                                                 first == 0 ? &prefetcher : nullptr);
      });
    }
  }
#endif
  for (int64_t i = 0; i < num_tokens && !pb.split; ++i) {
    prefetcher.step();
    for_each_head_tile(group_size, [&](auto heads, int64_t first) {
      dot_heads<decltype(heads)::value>(q + first * head_dim, keys + i * row_stride, head_dim,
                                        sc.logits + first * ld + i, ld);
    });
  }
  // 2. Soft cap, ALiBi, running max, p = exp(x - max). Lanes past num_tokens are set to -inf, so exp gives 0.
  const Vec num_valid(static_cast<float>(num_tokens));
  for (int64_t j = 0; j < group_size; ++j) {
    const int64_t head = first_head + j;
    float* x = sc.logits + j * ld;
    Vec block_max(kNegInf);
    for (int64_t i = 0; i < ld; i += kVecSize) {
      Vec xi = Vec::loadu(x + i);
      if (pb.logits_soft_cap > 0) xi = (xi / Vec(pb.logits_soft_cap)).tanh() * Vec(pb.logits_soft_cap);
      if (pb.alibi_slopes) {
        xi = xi + Vec(pb.alibi_slopes[head]) * Vec::arange(static_cast<float>(t0 + i - last_token), 1.f);
      }
      xi = Vec::blendv(Vec(kNegInf), xi, Vec::arange(static_cast<float>(i), 1.f) < num_valid);
      block_max = at::vec::maximum(block_max, xi);
      xi.store(x + i);
    }
    const float old_max = sc.max_logit[head];
    const float new_max = std::max(
        old_max, at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return at::vec::maximum(a, b); }, block_max));
    Vec sum(0.f);
    for (int64_t i = 0; i < ld; i += kVecSize) {
      const Vec p = (Vec::loadu(x + i) - Vec(new_max)).exp_u20();
      sum = sum + p;
      p.store(x + i);
    }
    if (new_max != old_max) {  // rescale only when the max grew (rarely, after the first blocks)
      const float alpha = std::exp(old_max - new_max);  // 0 on the first block: old_max = -inf
      sc.exp_sum[head] *= alpha;
      for (int64_t d = 0; d < head_dim; ++d) acc[j * head_dim + d] *= alpha;
      sc.max_logit[head] = new_max;
    }
    sc.exp_sum[head] += at::vec::vec_reduce_all<float>(std::plus<Vec>(), sum);
  }
  // 3. acc += p * v over the block's tokens.
  for_each_head_tile(group_size, [&](auto heads, int64_t first) {
#if defined(CPU_CAPABILITY_AVX2)
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
      if (pb.split == kSplitChunk512) {
        accumulate_values_avx512<decltype(heads)::value>(sc.logits + first * ld, ld, values, row_stride, num_tokens,
                                                         head_dim, acc + first * head_dim,
                                                         first == 0 ? &prefetcher : nullptr);
        return;
      }
    }
#endif
    accumulate_values<decltype(heads)::value>(sc.logits + first * ld, ld, values, row_stride, num_tokens, head_dim,
                                              acc + first * head_dim);
  });
}

// Attends every query head of sequence `seq` to its tokens [begin, end), leaving (max, sum, acc) in sc.
template <typename scalar_t>
void attend(const Problem<scalar_t>& pb, int64_t seq, int64_t begin, int64_t end, Scratch& sc) {
  const int64_t num_heads = pb.num_heads, head_dim = pb.head_dim, block_size = pb.block_size;
  for (int64_t h = 0; h < num_heads; ++h) {
    const scalar_t* q_row = pb.query + seq * pb.query_seq_stride + h * pb.query_head_stride;
    for (int64_t d = 0; d < head_dim; ++d) {
      sc.q[h * head_dim + d] = pb.scale * static_cast<float>(q_row[d]);  // unused on the AVX-512 path
    }
  }
  std::fill_n(sc.acc, num_heads * head_dim, 0.f);
  std::fill_n(sc.max_logit, num_heads, kNegInf);
  std::fill_n(sc.exp_sum, num_heads, 0.f);
  const int32_t* block_table = pb.block_tables + seq * pb.max_blocks_per_seq;
  const int64_t last_token = pb.seq_lens[seq] - 1;
  // Rows are prefetched prefetch_distance tokens ahead, a whole number of blocks: each step prefetches the same
  // offsets of one later block.
  const int64_t prefetch_distance = (kPrefetchTokens + block_size - 1) / block_size * block_size;

  for (int64_t t0 = begin; t0 < end;) {
    const int32_t block = block_table[t0 / block_size];
    const int64_t offset = t0 % block_size, num_tokens = std::min(block_size - offset, end - t0);
    Prefetcher prefetcher;
    if (t0 + prefetch_distance < end) {
      const int32_t ahead = block_table[(t0 + prefetch_distance) / block_size];
      prefetcher.keys = reinterpret_cast<const char*>(pb.kv.keys(ahead, offset, 0));
      prefetcher.values = reinterpret_cast<const char*>(pb.kv.values(ahead, offset, 0));
      prefetcher.bytes =
          std::min(num_tokens, end - t0 - prefetch_distance) * pb.kv.row_stride * int64_t{sizeof(scalar_t)};
      // Steps: one per row in step 1, and on the AVX-512 path (whose loops are short) one more per row in the
      // first pass of step 3.
      const int64_t steps = pb.num_kv_heads * num_tokens * (pb.split ? 2 : 1);
      prefetcher.bytes_per_step = (prefetcher.bytes / 64 + steps - 1) / steps * 64;
    }
    for (int64_t kv_head = 0; kv_head < pb.num_kv_heads; ++kv_head) {
      attend_block(pb, pb.query + seq * pb.query_seq_stride, kv_head, t0, num_tokens, last_token,
                   pb.kv.keys(block, offset, kv_head), pb.kv.values(block, offset, kv_head), sc, prefetcher);
    }
    t0 += num_tokens;
  }
}

template <typename scalar_t>
void paged_attention_kernel(const Problem<scalar_t>& pb, int64_t num_seqs,
                            scalar_t* out) {  // [num_seqs, num_heads, head_dim], contiguous
  const int64_t num_heads = pb.num_heads, head_dim = pb.head_dim;

  // Split sequences only when there are too few to keep the threads evenly busy: into as many partitions as make
  // the task count a multiple of the thread count, each at least kMinPartitionTokens long.
  const int64_t num_threads = at::get_num_threads();
  int64_t max_len = 0;  // tokens attended to, after the sliding window
  for (int64_t s = 0; s < num_seqs; ++s) max_len = std::max(max_len, pb.seq_lens[s] - pb.window_start(s));
  int64_t num_partitions = 1;
  if (num_seqs < 4 * num_threads && num_seqs % num_threads != 0) {
    const int64_t balanced = num_threads / std::gcd(num_seqs, num_threads);  // num_seqs * balanced % num_threads == 0
    num_partitions = std::clamp<int64_t>(max_len / kMinPartitionTokens, 1, balanced);
  }
  const int64_t partition_size = std::max<int64_t>(1, (max_len + num_partitions - 1) / num_partitions);

  // Partial results of split sequences: max logit and exp sum [num_seqs, num_heads, num_partitions],
  // acc [num_seqs, num_heads, num_partitions, head_dim].
  const int64_t num_rows = num_seqs * num_heads * num_partitions;
  std::vector<float> partials(num_partitions > 1 ? num_rows * (head_dim + 2) : 0);
  float* max_logits = partials.data();
  float* exp_sums = max_logits + num_rows;
  float* partial_accs = exp_sums + num_rows;

  at::parallel_for(0, num_seqs * num_partitions, 1, [&](int64_t task_begin, int64_t task_end) {
    Scratch sc(num_heads, pb.group_size, head_dim, pb.block_size);
    for (int64_t task = task_begin; task < task_end; ++task) {
      const int64_t seq = task / num_partitions, partition = task % num_partitions, len = pb.seq_lens[seq];
      const int64_t begin = std::min(pb.window_start(seq) + partition * partition_size, len);
      attend(pb, seq, begin, std::min(begin + partition_size, len), sc);
      for (int64_t h = 0; h < num_heads; ++h) {
        const int64_t row = seq * num_heads + h;
        const float* acc = sc.acc + h * head_dim;
        if (num_partitions == 1) {
          const float inv_sum = sc.exp_sum[h] > 0 ? 1.f / sc.exp_sum[h] : 0.f;  // 0 for an empty sequence
          for (int64_t d = 0; d < head_dim; ++d) {
            out[row * head_dim + d] = static_cast<scalar_t>(acc[split_index(d, pb.split)] * inv_sum);
          }
        } else {
          const int64_t slot = row * num_partitions + partition;
          max_logits[slot] = sc.max_logit[h];
          exp_sums[slot] = sc.exp_sum[h];
          for (int64_t d = 0; d < head_dim; ++d) {
            partial_accs[slot * head_dim + d] = acc[split_index(d, pb.split)];
          }
        }
      }
    }
  });
  if (num_partitions == 1) return;

  // Merge the partitions of each (seq, head) row; empty partitions (max -inf) contribute nothing.
  at::parallel_for(0, num_seqs * num_heads, 1, [&](int64_t row_begin, int64_t row_end) {
    std::vector<float> merged(head_dim);
    for (int64_t row = row_begin; row < row_end; ++row) {
      const float* row_max = max_logits + row * num_partitions;
      const float global_max = *std::max_element(row_max, row_max + num_partitions);
      std::fill(merged.begin(), merged.end(), 0.f);
      float total = 0.f;
      for (int64_t p = 0; p < num_partitions; ++p) {
        if (row_max[p] == kNegInf) continue;
        const float weight = std::exp(row_max[p] - global_max);
        total += weight * exp_sums[row * num_partitions + p];
        const float* acc = partial_accs + (row * num_partitions + p) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) merged[d] += weight * acc[d];
      }
      const float inv_total = total > 0 ? 1.f / total : 0.f;
      for (int64_t d = 0; d < head_dim; ++d) out[row * head_dim + d] = static_cast<scalar_t>(merged[d] * inv_total);
    }
  });
}

}  // namespace

void paged_attention_cpu(at::Tensor& out,                 // [num_seqs, num_heads, head_dim], contiguous
                         const at::Tensor& query,         // [num_seqs, num_heads, head_dim], last dim contiguous
                         const at::Tensor& key_cache,     // [num_blocks, block_size, num_kv_heads, head_dim]
                         const at::Tensor& value_cache,   // [num_blocks, block_size, num_kv_heads, head_dim]
                         const at::Tensor& block_tables,  // [num_seqs, max_blocks_per_seq], int32
                         const at::Tensor& seq_lens,      // [num_seqs], int32
                         double scale,
                         const std::optional<at::Tensor>& alibi_slopes,  // [num_heads], float32
                         int64_t sliding_window, double logits_soft_cap) {
  check_paged_attention_args(out, query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes,
                             sliding_window, logits_soft_cap);
  const int64_t block_size = key_cache.size(1);
  check_block_table_range(block_tables, seq_lens, key_cache.size(0), block_size);
  if (out.numel() == 0) return;
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = key_cache.size(2);

  const auto tables = block_tables.contiguous();
  const auto lens = seq_lens.contiguous();
  const auto slopes = alibi_slopes.has_value() ? alibi_slopes->contiguous() : at::Tensor();
  const auto run = [&](auto dtype_tag) {
    using scalar_t = decltype(dtype_tag);
    const PagedKV<scalar_t> kv{key_cache.const_data_ptr<scalar_t>(), value_cache.const_data_ptr<scalar_t>(),
                               key_cache.stride(0), value_cache.stride(0), num_kv_heads * head_dim, head_dim};
    const Problem<scalar_t> pb{kv, query.const_data_ptr<scalar_t>(), query.stride(0), query.stride(1),
                               tables.const_data_ptr<int32_t>(), lens.const_data_ptr<int32_t>(),
                               slopes.defined() ? slopes.const_data_ptr<float>() : nullptr, tables.size(1),
                               block_size, num_heads, num_kv_heads, num_heads / num_kv_heads, head_dim,
                               sliding_window, static_cast<float>(scale), static_cast<float>(logits_soft_cap),
                               split_chunk<scalar_t>(head_dim)};
    paged_attention_kernel(pb, num_seqs, out.data_ptr<scalar_t>());
  };
  switch (query.scalar_type()) {  // check_paged_attention_args allows exactly these
    case at::kFloat: run(float{}); break;
    case at::kHalf: run(at::Half{}); break;
    case at::kBFloat16: run(at::BFloat16{}); break;
    default: TORCH_INTERNAL_ASSERT(false, "unreachable: dtype checked above");
  }
}

}  // namespace paged_attn

TORCH_LIBRARY_IMPL(paged_attn, CPU, m) {
  m.impl("paged_attention", &paged_attn::paged_attention_cpu);
}
