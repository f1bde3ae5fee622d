// The tiled prefill kernel (the CPU side of csrc/cuda/varlen_attention_kernels.cuh): the query rows of sequences
// with at least kMinPrefillQueryLen query tokens (query_start_loc), in tiles.
//
// A task is (sequence, kv head, query tile): up to kPrefillRows rows (or one position's group_size if larger),
// r = i * group_size + j for the tile's query positions p0 + i and the head group's query heads j, so that query
// heads sharing a kv head share its key and value tiles. The task walks the keys its rows can see, [first_visible(p0),
// last position], kPrefillKeys tokens at a time; per key tile:
//   1. pack the tile's keys and values of the kv head as float32 into the task's scratch: keys transposed,
//      [head_dim][kPrefillKeys], values [kPrefillKeys][head_dim]. Only these tokens' rows are read (never the
//      slots past the sequence's end, nor tokens before the window), and nothing is packed ahead: a key is
//      converted once per query tile that sees it, about 1/rows of the tile's multiply-adds, and a chunk after a
//      long cached prefix costs no whole-sequence copy;
//   2. S = Q K^T for every row (Q pre-scaled, float32),
//   3. soft cap, ALiBi, the causal and window mask (-inf), then the online softmax per row: raise the row's max
//      (rescaling its sum and O), P = exp(S - max), sum += P,
//   4. O += P V, each row over exactly the keys it sees: a masked key's P is 0, but 0 * NaN = NaN, so a NaN or inf
//      value a row cannot see (after its position, before its window) must not be multiplied into it at all.
//      The tile's keys are cut into runs at every row's first and last visible key; each run goes into
//      the rows that see all of it (a contiguous run: both ends of a row's visible range grow with its position).
//      A row's keys are still added in order, so this is the plain loop's sum, bit for bit.
// (A NaN key a row cannot see needs no such care: its logit is overwritten by the mask in step 3.)
// Then out = O / sum. Micro-kernels: AVX-512 FMA, 6 rows x 32 keys (S) and 6 rows x 64 dims (O), where the CPU has
// it and head_dim % 16 == 0; plain loops the compiler vectorizes elsewhere. Tasks are pulled from a shared counter,
// most keys first: tiles late in a causal sequence cost more, and a static split would leave a thread idle.
// NOTE: below 4 query tokens, sharing a key tile among the rows does not pay for packing it: a 2-row chunk after a
// 16k-token prefix costs about 1.8x two decode rows in the tiled kernel, a 4-row one the same as 4 decode rows, an
// 8-row one 0.85x (bench/RESULTS.md, 2026-12-02). Such sequences' rows take the decode kernel.
#pragma once

#include "attention_common.h"
#include "avx512_kernels.h"

namespace paged_attn {
namespace {

constexpr int64_t kPrefillRows = 48;  // rows of a query tile (a multiple of the micro-kernels' 6)
constexpr int64_t kPrefillKeys = 32;  // keys of a key tile: two AVX-512 vectors of logits per row
constexpr int kMicroRows = 6;

struct PrefillScratch {
  std::vector<float> buffer;
  float* q;          // [max_rows, head_dim], pre-scaled
  float* o;          // [max_rows, head_dim]
  float* s;          // [max_rows, kPrefillKeys]: logits, then P
  float* k;          // [kPrefillKeys, head_dim]: the keys as they are read, then transposed into kt
  float* kt;         // [head_dim, kPrefillKeys]
  float* v;          // [kPrefillKeys, head_dim]
  float* max_logit;  // [max_rows]
  float* sum;        // [max_rows]
  PrefillScratch(int64_t max_rows, int64_t head_dim)
      : buffer(2 * max_rows * head_dim + max_rows * kPrefillKeys + 3 * kPrefillKeys * head_dim + 2 * max_rows) {
    q = buffer.data();
    o = q + max_rows * head_dim;
    s = o + max_rows * head_dim;
    k = s + max_rows * kPrefillKeys;
    kt = k + kPrefillKeys * head_dim;
    v = kt + head_dim * kPrefillKeys;
    max_logit = v + kPrefillKeys * head_dim;
    sum = max_logit + max_rows;
  }
};

// Portable micro-kernels. kt = k transposed: kt[d][n] = k[n][d] for n < num_keys, 0 from num_keys on.
inline void transpose_keys_portable(const float* k, int64_t num_keys, int64_t head_dim, float* kt) {
  for (int64_t d = 0; d < head_dim; ++d) {
    for (int64_t n = 0; n < num_keys; ++n) kt[d * kPrefillKeys + n] = k[n * head_dim + d];
    std::fill(kt + d * kPrefillKeys + num_keys, kt + (d + 1) * kPrefillKeys, 0.f);
  }
}

// s[r] = q[r] . kt (all kPrefillKeys lanes), for `rows` rows.
inline void qk_rows_portable(const float* q, int64_t rows, int64_t head_dim, const float* kt, float* s) {
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = s + r * kPrefillKeys;
    std::fill_n(sr, kPrefillKeys, 0.f);
    for (int64_t d = 0; d < head_dim; ++d) {
      const float qd = q[r * head_dim + d];
      const float* k = kt + d * kPrefillKeys;
      for (int64_t n = 0; n < kPrefillKeys; ++n) sr[n] += qd * k[n];
    }
  }
}

// o[r] += sum_n p[r][n] v[n] over n < num_keys, for `rows` rows.
inline void pv_rows_portable(const float* p, int64_t rows, int64_t num_keys, const float* v, int64_t head_dim,
                             float* o) {
  for (int64_t r = 0; r < rows; ++r) {
    float* orow = o + r * head_dim;
    for (int64_t n = 0; n < num_keys; ++n) {
      const float w = p[r * kPrefillKeys + n];
      const float* vrow = v + n * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) orow[d] += w * vrow[d];
    }
  }
}

#if defined(CPU_CAPABILITY_AVX2)
template <int R>
PA_TARGET_AVX512 void qk_micro_avx512(const float* q, int64_t head_dim, const float* kt, float* s) {
  __m512 acc[R][2];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t d = 0; d < head_dim; ++d) {
    const __m512 k0 = _mm512_loadu_ps(kt + d * kPrefillKeys), k1 = _mm512_loadu_ps(kt + d * kPrefillKeys + 16);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512 qd = _mm512_set1_ps(q[r * head_dim + d]);
      acc[r][0] = _mm512_fmadd_ps(qd, k0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(qd, k1, acc[r][1]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(s + r * kPrefillKeys, acc[r][0]);
    _mm512_storeu_ps(s + r * kPrefillKeys + 16, acc[r][1]);
  }
}

template <int R, int C>
PA_TARGET_AVX512 void pv_micro_avx512(const float* p, int64_t num_keys, const float* v, int64_t head_dim,
                                      float* o) {  // o: the rows' dims [d0, d0 + 16 C), v: from d0
  __m512 acc[R][C];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_loadu_ps(o + r * head_dim + 16 * c);
  for (int64_t n = 0; n < num_keys; ++n) {
    __m512 vn[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) vn[c] = _mm512_loadu_ps(v + n * head_dim + 16 * c);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512 w = _mm512_set1_ps(p[r * kPrefillKeys + n]);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(w, vn[c], acc[r][c]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + r * head_dim + 16 * c, acc[r][c]);
}

// Calls f(std::integral_constant<int, R>, first_row) over [0, rows) in sets of up to kMicroRows.
template <typename F>
inline void for_each_micro_rows(int64_t rows, F&& f) {
  for (int64_t first = 0; first < rows; first += kMicroRows) {
    switch (std::min<int64_t>(kMicroRows, rows - first)) {
      case 6: f(std::integral_constant<int, 6>{}, first); break;
      case 5: f(std::integral_constant<int, 5>{}, first); break;
      case 4: f(std::integral_constant<int, 4>{}, first); break;
      case 3: f(std::integral_constant<int, 3>{}, first); break;
      case 2: f(std::integral_constant<int, 2>{}, first); break;
      default: f(std::integral_constant<int, 1>{}, first); break;
    }
  }
}

PA_TARGET_AVX512 void qk_rows_avx512(const float* q, int64_t rows, int64_t head_dim, const float* kt, float* s) {
  for_each_micro_rows(rows, [&](auto micro, int64_t first) {
    qk_micro_avx512<decltype(micro)::value>(q + first * head_dim, head_dim, kt, s + first * kPrefillKeys);
  });
}

PA_TARGET_AVX512 void pv_rows_avx512(const float* p, int64_t rows, int64_t num_keys, const float* v,
                                     int64_t head_dim, float* o) {
  for_each_micro_rows(rows, [&](auto micro, int64_t first) {
    constexpr int R = decltype(micro)::value;
    const float* pr = p + first * kPrefillKeys;
    float* orow = o + first * head_dim;
    int64_t d = 0;
    for (; d + 64 <= head_dim; d += 64) pv_micro_avx512<R, 4>(pr, num_keys, v + d, head_dim, orow + d);
    switch ((head_dim - d) / 16) {
      case 3: pv_micro_avx512<R, 3>(pr, num_keys, v + d, head_dim, orow + d); break;
      case 2: pv_micro_avx512<R, 2>(pr, num_keys, v + d, head_dim, orow + d); break;
      case 1: pv_micro_avx512<R, 1>(pr, num_keys, v + d, head_dim, orow + d); break;
      default: break;
    }
  });
}

// Step 3 for one row whose logits x (2 vectors; -inf where masked) are final: raise the max (rescaling sum and
// the row of O), x = P = exp(x - max), sum += P. A row that sees nothing yet (max -inf) gets P = 0. A NaN logit
// makes the max NaN, and so the row's sum and O (vmaxps and std::max may each drop a NaN operand).
PA_TARGET_AVX512 void softmax_row_avx512(float* x, float* max_logit, float* sum, float* orow, int64_t head_dim) {
  const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
  const bool nan = _mm512_cmp_ps_mask(x0, x1, _CMP_UNORD_Q) != 0;  // a NaN in either
  const float new_max = nan ? std::numeric_limits<float>::quiet_NaN()
                            : std::max(*max_logit, _mm512_reduce_max_ps(_mm512_max_ps(x0, x1)));
  if (new_max == kNegInf) {
    _mm512_storeu_ps(x, _mm512_setzero_ps());
    _mm512_storeu_ps(x + 16, _mm512_setzero_ps());
    return;
  }
  if (new_max != *max_logit) {
    const float alpha = std::exp(*max_logit - new_max);  // 0 on the row's first visible tile
    *sum *= alpha;
    const __m512 a = _mm512_set1_ps(alpha);
    for (int64_t d = 0; d < head_dim; d += 16) _mm512_storeu_ps(orow + d, _mm512_mul_ps(a, _mm512_loadu_ps(orow + d)));
    *max_logit = new_max;
  }
  const __m512 m = _mm512_set1_ps(new_max);
  const __m512 p0 = exp_nonpositive(_mm512_sub_ps(x0, m)), p1 = exp_nonpositive(_mm512_sub_ps(x1, m));
  _mm512_storeu_ps(x, p0);
  _mm512_storeu_ps(x + 16, p1);
  *sum += _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
}

// The 16 x 16 matrix r[0 .. 15] transposed in place: three rounds of shuffles, pairs of elements, then of 4-lane
// quarters, then of 8-lane halves.
PA_TARGET_AVX512 inline void transpose_16x16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {  // rows i and i + 1 interleaved
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // then 4 x 4 submatrices transposed within each quarter
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 16; i += 8) {  // then the quarters moved: twice, by 4 rows, then by 8
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + 4 + j], 0x88);
      t[i + 4 + j] = _mm512_shuffle_f32x4(r[i + j], r[i + 4 + j], 0xDD);
    }
  }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xDD);
  }
}

// transpose_keys_portable for head_dim % 16 == 0, by 16 x 16 submatrices.
PA_TARGET_AVX512 void transpose_keys_avx512(const float* k, int64_t num_keys, int64_t head_dim, float* kt) {
  for (int64_t n0 = 0; n0 < kPrefillKeys; n0 += 16) {
    for (int64_t d0 = 0; d0 < head_dim; d0 += 16) {
      __m512 r[16];
      for (int64_t i = 0; i < 16; ++i) {
        r[i] = n0 + i < num_keys ? _mm512_loadu_ps(k + (n0 + i) * head_dim + d0) : _mm512_setzero_ps();
      }
      transpose_16x16(r);
      for (int64_t j = 0; j < 16; ++j) _mm512_storeu_ps(kt + (d0 + j) * kPrefillKeys + n0, r[j]);
    }
  }
}

inline bool use_avx512f() {
  static const bool use = __builtin_cpu_supports("avx512f") && std::getenv("PAGED_ATTN_NO_AVX512") == nullptr;
  return use;
}
#endif

// Step 1: the keys and values of tokens [t0, t0 + num_keys) of one sequence (its block table), kv head kv_head,
// as float32: sc.kt [head_dim][kPrefillKeys] (lanes from num_keys on zero), sc.v [kPrefillKeys][head_dim] (rows
// from num_keys on left as they are: step 4 never reads them). The rows are converted as they lie (into sc.k and
// sc.v), then the keys transposed. Meanwhile the next tile's rows, tokens [t0 + kPrefillKeys, + next_num_keys),
// are prefetched into L2, one token's per token packed (the hardware prefetchers do not follow the block table;
// without this the packing waits on memory most of the time).
template <typename cache_t>
void pack_key_tile(const PagedKV<cache_t>& kv, const int32_t* block_table, int64_t kv_head,
                   int64_t head_dim, int64_t t0, int64_t num_keys, int64_t next_num_keys, bool avx512,
                   PrefillScratch& sc) {
  const auto rows = [&](int64_t t) {  // token t's key and value rows of kv_head
    return std::pair{kv.key.row(block_table, t, kv_head), kv.value.row(block_table, t, kv_head)};
  };
  const int64_t row_bytes = head_dim * int64_t{sizeof(cache_t)};
  for (int64_t n = 0; n < std::max(num_keys, next_num_keys); ++n) {
    if (n < next_num_keys) {
      const auto [k, vr] = rows(t0 + kPrefillKeys + n);
      for (int64_t byte = 0; byte < row_bytes; byte += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(k) + byte, 0, 2);
        __builtin_prefetch(reinterpret_cast<const char*>(vr) + byte, 0, 2);
      }
    }
    if (n < num_keys) {
      const auto [k, vr] = rows(t0 + n);
      float* kn = sc.k + n * head_dim;
      float* vn = sc.v + n * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) kn[d] = to_float(k[d]);
      for (int64_t d = 0; d < head_dim; ++d) vn[d] = to_float(vr[d]);
    }
  }
#if defined(CPU_CAPABILITY_AVX2)
  if (avx512) return transpose_keys_avx512(sc.k, num_keys, head_dim, sc.kt);
#endif
  transpose_keys_portable(sc.k, num_keys, head_dim, sc.kt);
}

struct PrefillTask {
  int32_t seq;       // the sequence
  int32_t kv_head;
  int32_t first;     // the tile's first query token within the sequence's rows
  int32_t num_keys;  // keys the tile walks (its cost)
};

template <typename scalar_t, typename cache_t>
void prefill_task(const AttentionParams<scalar_t, cache_t>& params, const int32_t* query_start_loc,
                  const int32_t* seq_lens, const PrefillTask& task, int64_t positions_per_tile, bool avx512,
                  PrefillScratch& sc, scalar_t* out) {
  const int64_t group_size = params.group_size, head_dim = params.head_dim, seq = task.seq;
  const int64_t query_len = query_start_loc[seq + 1] - query_start_loc[seq];
  const int64_t num_positions = std::min<int64_t>(positions_per_tile, query_len - task.first);
  const int64_t rows = num_positions * group_size;
  const int64_t first_position = seq_lens[seq] - query_len + task.first;  // of the tile's first row
  const int64_t last_position = first_position + num_positions - 1;
  const int64_t first_head = task.kv_head * group_size;
  const int64_t first_query_row = query_start_loc[seq] + task.first;  // in query / out
  const int32_t* block_table = params.block_tables + seq * params.max_blocks_per_seq;
  const bool logit_mods = params.logits_soft_cap > 0 || params.alibi_slopes != nullptr;

  for (int64_t i = 0; i < num_positions; ++i) {
    for (int64_t j = 0; j < group_size; ++j) {
      const scalar_t* q =
          params.query + (first_query_row + i) * params.query_row_stride + (first_head + j) * params.query_head_stride;
      float* qr = sc.q + (i * group_size + j) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) qr[d] = params.scale * static_cast<float>(q[d]);
    }
  }
  std::fill_n(sc.o, rows * head_dim, 0.f);
  std::fill_n(sc.max_logit, rows, kNegInf);
  std::fill_n(sc.sum, rows, 0.f);

  // Every key in [first_visible(first_position), last_position] is seen by some row of the tile.
  for (int64_t t0 = params.first_visible(first_position); t0 <= last_position; t0 += kPrefillKeys) {
    const int64_t num_keys = std::min(kPrefillKeys, last_position + 1 - t0);
    const int64_t next_num_keys = std::clamp<int64_t>(last_position + 1 - (t0 + kPrefillKeys), 0, kPrefillKeys);
    // 1. Pack (the keys and values of the tile).
    pack_key_tile(params.kv, block_table, task.kv_head, head_dim, t0, num_keys, next_num_keys, avx512, sc);
    // 2. Logits: S = Q K^T.
#if defined(CPU_CAPABILITY_AVX2)
    if (avx512) {
      qk_rows_avx512(sc.q, rows, head_dim, sc.kt, sc.s);
    } else
#endif
      qk_rows_portable(sc.q, rows, head_dim, sc.kt, sc.s);
    // 3. Softmax: logit mods, mask, online softmax.
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t position = first_position + r / group_size, head = first_head + r % group_size;
      float* x = sc.s + r * kPrefillKeys;
      const int64_t visible_begin = params.first_visible(position);
      const bool all_visible = t0 + kPrefillKeys - 1 <= position && t0 >= visible_begin;
      if (logit_mods || !all_visible) {
        for (int64_t n = 0; n < kPrefillKeys; ++n) {
          const int64_t t = t0 + n;
          if (t > position || t < visible_begin) {  // lanes past num_keys are past every row's position
            x[n] = kNegInf;
            continue;
          }
          if (params.logits_soft_cap > 0) x[n] = params.logits_soft_cap * std::tanh(x[n] / params.logits_soft_cap);
          if (params.alibi_slopes) x[n] += params.alibi_slopes[head] * static_cast<float>(t - position);
        }
      }
#if defined(CPU_CAPABILITY_AVX2)
      if (avx512) {
        softmax_row_avx512(x, sc.max_logit + r, sc.sum + r, sc.o + r * head_dim, head_dim);
        continue;
      }
#endif
      // at::vec::maximum propagates NaN (std::max would drop a NaN logit, and with it the row's whole tile).
      const float old_max = sc.max_logit[r];
      Vec tile_max(old_max);
      for (int64_t n = 0; n < kPrefillKeys; n += kVecSize) tile_max = at::vec::maximum(tile_max, Vec::loadu(x + n));
      const float new_max =
          at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return at::vec::maximum(a, b); }, tile_max);
      if (new_max == kNegInf) {  // nothing visible to this row yet
        std::fill_n(x, kPrefillKeys, 0.f);
        continue;
      }
      if (new_max != old_max) {
        const float alpha = std::exp(old_max - new_max);  // 0 on the row's first visible tile
        sc.sum[r] *= alpha;
        float* orow = sc.o + r * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) orow[d] *= alpha;
        sc.max_logit[r] = new_max;
      }
      Vec row_sum(0.f);
      for (int64_t n = 0; n < kPrefillKeys; n += kVecSize) {
        const Vec p = (Vec::loadu(x + n) - Vec(new_max)).exp_u20();
        row_sum = row_sum + p;
        p.store(x + n);
      }
      sc.sum[r] += at::vec::vec_reduce_all<float>(std::plus<Vec>(), row_sum);
    }
    // 4. Values: O += P V, by runs. Position i sees the tile's keys [lo[i], hi[i]) (empty if hi[i] <= lo[i]).
    int64_t lo[kPrefillRows], hi[kPrefillRows];
    bool cut[kPrefillKeys + 1] = {};
    for (int64_t i = 0; i < num_positions; ++i) {
      const int64_t position = first_position + i;
      lo[i] = std::clamp<int64_t>(params.first_visible(position) - t0, 0, num_keys);
      hi[i] = std::clamp<int64_t>(position + 1 - t0, 0, num_keys);
      if (lo[i] < hi[i]) cut[lo[i]] = cut[hi[i]] = true;
    }
    int64_t i_begin = 0;  // the run's positions: [i_begin, i_end)
    for (int64_t a = 0, b = 1; b <= num_keys; ++b) {
      if (!cut[b]) continue;
      while (hi[i_begin] < b) ++i_begin;  // some position sees key a, so this stops within the tile
      int64_t i_end = i_begin;
      while (i_end < num_positions && lo[i_end] <= a) ++i_end;
      const int64_t first_row = i_begin * group_size, run_rows = (i_end - i_begin) * group_size;
      const float* p = sc.s + first_row * kPrefillKeys + a;
      float* o = sc.o + first_row * head_dim;
#if defined(CPU_CAPABILITY_AVX2)
      if (avx512) {
        pv_rows_avx512(p, run_rows, b - a, sc.v + a * head_dim, head_dim, o);
      } else
#endif
        pv_rows_portable(p, run_rows, b - a, sc.v + a * head_dim, head_dim, o);
      a = b;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r / group_size, head = first_head + r % group_size;
    scalar_t* dst = out + ((first_query_row + i) * params.num_heads + head) * head_dim;
    // sum > 0: every row sees at least its own token
    const RowFinish finish = finish_row(sc.max_logit[r], sc.sum[r], params.v_scale, params.sinks, head);
    const float inv_sum = finish.out_scale;
    if (params.lse) params.lse[(first_query_row + i) * params.num_heads + head] = finish.lse;
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(sc.o[r * head_dim + d] * inv_sum);
  }
}

// Every query row of the sequences in `seqs` (each with at least kMinPrefillQueryLen query tokens), in tiles.
template <typename scalar_t, typename cache_t>
void prefill_kernel(const AttentionParams<scalar_t, cache_t>& params, const int32_t* query_start_loc,
                    const int32_t* seq_lens, const std::vector<int32_t>& seqs,
                    scalar_t* out) {  // out: [num_tokens, num_heads, head_dim]
  const int64_t positions_per_tile = std::max<int64_t>(1, kPrefillRows / params.group_size);
  std::vector<PrefillTask> tasks;
  for (const int32_t seq : seqs) {
    const int64_t query_len = query_start_loc[seq + 1] - query_start_loc[seq];
    for (int64_t first = 0; first < query_len; first += positions_per_tile) {
      const int64_t last_position = seq_lens[seq] - query_len + std::min(query_len, first + positions_per_tile) - 1;
      const int64_t first_position = seq_lens[seq] - query_len + first;
      const int64_t first_token = params.first_visible(first_position);
      for (int64_t kv_head = 0; kv_head < params.num_kv_heads; ++kv_head) {
        tasks.push_back({seq, static_cast<int32_t>(kv_head), static_cast<int32_t>(first),
                         static_cast<int32_t>(last_position + 1 - first_token)});
      }
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const auto& a, const auto& b) { return a.num_keys > b.num_keys; });
#if defined(CPU_CAPABILITY_AVX2)
  const bool avx512 = params.head_dim % 16 == 0 && use_avx512f();
#else
  const bool avx512 = false;
#endif
  // Threads only for work worth waking them (kMinBytesPerCpuTask of keys and values walked per thread).
  int64_t keys_walked = 0;
  for (const PrefillTask& task : tasks) keys_walked += task.num_keys;
  const int64_t kv_bytes = keys_walked * 2 * params.head_dim * int64_t{sizeof(cache_t)};
  const int64_t num_workers = threads_worth_waking(kv_bytes, static_cast<int64_t>(tasks.size()));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, num_workers, 1, [&](int64_t begin, int64_t end) {
    if (begin >= end) return;
    PrefillScratch sc(positions_per_tile * params.group_size, params.head_dim);
    for (int64_t i = next++; i < static_cast<int64_t>(tasks.size()); i = next++) {
      prefill_task(params, query_start_loc, seq_lens, tasks[i], positions_per_tile, avx512, sc, out);
    }
  });
}

}  // namespace
}  // namespace paged_attn
