// CPU kernels of paged attention (paged_attn::paged_attention). Decode: one query token per sequence, the kernel
// described first. With query_start_loc (variable-length queries: prefills, prefill chunks, decodes in one call),
// the rows of sequences with fewer than kMinPrefillQueryLen query tokens (decodes, short chunks) still take the
// decode kernel, each as a row at its own position, and sequences with more take the tiled prefill kernel
// ("Prefill" below), where a query tile shares each key/value tile among its rows.
//
// Math, per sequence s of length L, query head h (reading kv head h / group_size) and token t in [start, L),
// start = max(0, L - sliding_window) (0 without a window):
//   x_t = scale * (q . k_t);  x_t = cap * tanh(x_t / cap) if logits_soft_cap = cap > 0;
//   x_t += slope[h] * (t - (L - 1)) with ALiBi;  out = sum_t softmax(x)_t * v_t, accumulated in float32.
//
// Work mapping: one task per (sequence, partition of its tokens). A task walks its tokens a tile at a time: up to
// kTileTokens = 16 consecutive tokens, whatever the block size (a tile may span blocks; the tile holds each
// token's row pointers, looked up in the block table once). Within a tile it serves each kv head's whole group
// of query heads in turn, so every key/value row is read from memory once (GQA reuse). Per (tile, kv head), for
// tiles of up to 4 query heads of the group:
//   1. logits of the heads for the tile's tokens,
//   2. online softmax: when a logit exceeds a head's running max, raise the max (rescaling the running sum and
//      the accumulator); p = exp(x - max), and the running sum (kept per tile lane) += p,
//   3. acc += p * v over the tile's tokens.
// Meanwhile the task software-prefetches (see Prefetcher) the next tile's rows into L2 and the next (tile, kv head)
// unit's rows into L1, a few cache lines per token of work in steps 1 and 3.
// Usually a sequence is one partition and its task writes out = acc / sum. When there are too few sequences to
// keep every thread busy, each sequence's tokens are split into equal partitions; each task leaves its
// (max, sum, acc) per head in float32 scratch and a second parallel pass merges them exactly:
//   M = max_p max_p,  out = sum_p e^(max_p - M) acc_p / sum_p e^(max_p - M) sum_p.
// Only tokens t < L (and in the window) are ever read: unused cache slots and block-table entries may hold
// anything, NaN included.
//
// Two implementations of steps 1-3, picked per call:
//  - portable (at::vec, AVX2 on x86-64; float32, float16, and bfloat16 without AVX-512): q pre-scaled in float32,
//    one dot product per (token, head); p in float32.
//  - AVX-512 bf16 (bfloat16 caches, head_dim a multiple of 32, CPU with AVX512_BF16; chosen at run time): both
//    products use vdpbf16ps (32 bf16 multiply-adds into 16 float32 lanes per instruction, products exact, sums in
//    float32): q . k on the bf16 query and keys as they are; p * v on token pairs, the value rows of tokens t and
//    t + 1 interleaved element by element, p split into two bfloat16 terms hi + lo (together within about 2^-16
//    of p, where FlashAttention rounds P to half precision, 2^-9) and one vdpbf16ps for each; the running sum adds
//    the same hi + lo, so the weights still sum to one. The output agrees with the float32 reference to float32
//    rounding, not just to the half-type tolerance. hi and lo are both > 0 where p > 0, and rows past a tile's
//    tokens are not multiplied, so that a value of inf gives inf as in float32 (never 0 * inf or inf - inf).
//
// fp8 caches (float8_e4m3fn, float8_e5m2; the query float32, float16 or bfloat16): every fp8 value is exactly a
// bfloat16 and a float32. A bfloat16 query takes the AVX-512 path, which decodes 32 cache bytes at a time into
// bfloat16 in registers (load_bf16x32: a 128-entry table of the magnitudes' bfloat16 bits looked up with two
// vpermi2w, the sign bit put back) and then runs exactly as on a bfloat16 cache, reading half the bytes. The
// portable path and the prefill packing decode through a 256-entry float32 table. The scales are applied outside
// the loops: k_scale is folded into the logit scale (scale * (q . k_scale k) = (scale k_scale) (q . k)), v_scale
// multiplies the output (sum_t p_t v_scale v_t / sum_t p_t).

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
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#include "../common.h"

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace paged_attn {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVecSize = Vec::size();
constexpr int64_t kTileTokens = 16;           // tokens per step (one AVX-512 vector of logits per head)
constexpr int64_t kMaxHeadTile = 4;           // query heads that share one pass over a key or value row
constexpr int64_t kMinPartitionTokens = 256;  // shorter partitions would cost more to merge than they gain
constexpr int64_t kPrefetchTiles = 1;         // how many tiles ahead rows are prefetched into L2 (at least 1)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
static_assert(kTileTokens % kVecSize == 0, "a tile's logits must be whole vectors");
static_assert(kPrefetchTiles >= 1, "the next unit's rows are prefetched from the next tile, which must be loaded");

template <typename T>
constexpr bool kIsFp8 = std::is_same_v<T, c10::Float8_e4m3fn> || std::is_same_v<T, c10::Float8_e5m2>;

// The values of an fp8 type, by its byte: value[b] as float32 (exact, NaN and inf included), and bf16_magnitude[m]
// the bfloat16 bits of the magnitude m = b & 0x7F (exact too; the sign is bit 7 of b).
template <typename fp8_t>
struct Fp8Table {
  float value[256];
  alignas(64) uint16_t bf16_magnitude[128];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) value[b] = static_cast<float>(fp8_t(static_cast<uint8_t>(b), fp8_t::from_bits()));
    for (int m = 0; m < 128; ++m) bf16_magnitude[m] = c10::BFloat16(value[m]).x;
  }
};
template <typename fp8_t>
const Fp8Table<fp8_t> fp8_table{};

template <typename T>
inline float to_float(T x) {
  if constexpr (kIsFp8<T>) {
    return fp8_table<T>.value[x.x];
  } else {
    return static_cast<float>(x);
  }
}

template <typename scalar_t>
inline Vec load_float(const scalar_t* p) {  // kVecSize elements, widened to float
  if constexpr (std::is_same_v<scalar_t, float>) {
    return Vec::loadu(p);
  } else if constexpr (kIsFp8<scalar_t>) {
    float values[kVecSize];
    for (int64_t i = 0; i < kVecSize; ++i) values[i] = fp8_table<scalar_t>.value[p[i].x];
    return Vec::loadu(values);
  } else {
    Vec out;
    at::vec::load_to_float(p, out);
    return out;
  }
}

// This file's one place for paged address arithmetic (csrc/cpu/cache_ops.cpp and the CUDA kernels have their
// own). Token t of a sequence lives in block block_table[t / block_size] at offset t % block_size; its row of kv
// head g starts g * head_stride elements after the token's first row. Strides are each cache's own (vLLM's packed
// cache has head_stride = 2 * head_dim, this project's contiguous one head_dim).
template <typename scalar_t>
struct PagedKV {
  const scalar_t* key_cache;    // [num_blocks, block_size, num_kv_heads, head_dim], strides key_*_stride
  const scalar_t* value_cache;  // [num_blocks, block_size, num_kv_heads, head_dim], strides value_*_stride
  int64_t key_block_stride, key_token_stride, key_head_stride;  // in elements
  int64_t value_block_stride, value_token_stride, value_head_stride;

  // NOTE: block ids are widened to 64 bits first: block * block_stride can exceed 2^31.
  const scalar_t* keys(int32_t block, int64_t offset) const {  // kv head g's row at + g * key_head_stride
    return key_cache + int64_t{block} * key_block_stride + offset * key_token_stride;
  }
  const scalar_t* values(int32_t block, int64_t offset) const {  // kv head g's row at + g * value_head_stride
    return value_cache + int64_t{block} * value_block_stride + offset * value_token_stride;
  }
};

// The rows of up to kTileTokens consecutive tokens [first, first + num_tokens) of one sequence. Entries from
// num_tokens on repeat the last token's rows, so that full-width loops may read them (their p is 0).
template <typename scalar_t>
struct Tile {
  int64_t first = 0, num_tokens = 0;
  const scalar_t* keys[kTileTokens];    // token first + i: [num_kv_heads, head_dim]
  const scalar_t* values[kTileTokens];  // token first + i: [num_kv_heads, head_dim]

  void load(const PagedKV<scalar_t>& kv, const int32_t* block_table, int64_t block_size, int64_t tile_first,
            int64_t end) {
    first = tile_first;
    num_tokens = std::min(kTileTokens, end - first);
    int64_t block = first / block_size, offset = first % block_size;
    for (int64_t i = 0; i < num_tokens; ++i) {
      keys[i] = kv.keys(block_table[block], offset);
      values[i] = kv.values(block_table[block], offset);
      if (++offset == block_size) offset = 0, ++block;
    }
    std::fill(keys + num_tokens, keys + kTileTokens, keys[num_tokens - 1]);
    std::fill(values + num_tokens, values + kTileTokens, values[num_tokens - 1]);
  }
};

// Software prefetch, two levels (the hardware prefetchers do not follow the block table):
//  - the next tile's rows, all kv heads, into L2 in address order, a few lines per step; the kernel takes two steps
//    per token and kv head (one in step 1, one in step 3), which cover the tile. Prefetches issued in one burst
//    would fill the core's miss buffers and stall it; lines out of address order cost DRAM bandwidth. The rows are
//    walked as spans of contiguous memory: a token's rows of all kv heads when they are contiguous (NHD), else
//    each row alone, token by token for each kv head where that is the address order (head-major caches: HND,
//    vLLM's LBHNC halves), head by head for each token otherwise (vLLM's LBNHC halves). Only the rows are
//    prefetched, never the memory between them (another head's or token's rows, the other half of a packed cache).
//  - the next (tile, kv head) unit's key and value rows into L1, a row at a time as the same token's row of the
//    current unit is worked on; they are in L2 by then.
// NOTE: both levels, and prefetching every line rather than leaving some to the hardware, were chosen on paired
// runs; the figures are in bench/RESULTS.md ("Two-level prefetch"; by cache layout: "CPU decode by cache layout").
template <typename scalar_t>
struct Prefetcher {
  // The layout, for every tile of a task.
  int64_t key_head_stride = 0, value_head_stride = 0;  // elements
  int64_t spans_per_token = 0;  // 1 (a token's rows are one span) or num_kv_heads (a span per row)
  bool heads_outer = false;     // walk a kv head's spans of every token, then the next kv head's
  int64_t span_lines = 0;       // cache lines prefetched per span (its lines, and one more if rows are unaligned)
  int64_t steps_per_tile = 0;   // step() calls per tile
  // The next tile's L2 prefetch.
  const Tile<scalar_t>* tile = nullptr;  // next tile (nullptr: none)
  int64_t lines_per_step = 0;            // cache lines of keys (and as many of values) per step
  int64_t token = 0, head = 0, line = 0;  // the cursor: next line to prefetch (head: span index within a token)
  // The next unit's L1 prefetch.
  const Tile<scalar_t>* unit_tile = nullptr;  // the next unit's tile (nullptr: none)
  int64_t key_offset = 0, value_offset = 0;   // its kv head's rows: elements into a token's rows
  int64_t head_bytes = 0;                     // bytes of a row

  Prefetcher(const PagedKV<scalar_t>& kv, int64_t num_kv_heads, int64_t head_dim) {
    key_head_stride = kv.key_head_stride, value_head_stride = kv.value_head_stride;
    head_bytes = head_dim * int64_t{sizeof(scalar_t)};
    const bool token_rows_contiguous =
        num_kv_heads == 1 || (kv.key_head_stride == head_dim && kv.value_head_stride == head_dim);
    spans_per_token = token_rows_contiguous ? 1 : num_kv_heads;
    heads_outer = !token_rows_contiguous && kv.key_token_stride < kv.key_head_stride;
    const int64_t span_bytes = (token_rows_contiguous ? num_kv_heads : 1) * head_bytes;
    // Every row starts on a cache line when the caches and their strides (in bytes) are multiples of 64.
    const uintptr_t strides = static_cast<uintptr_t>(kv.key_block_stride | kv.key_token_stride | kv.key_head_stride |
                                                     kv.value_block_stride | kv.value_token_stride |
                                                     kv.value_head_stride) * sizeof(scalar_t);
    const bool aligned = ((reinterpret_cast<uintptr_t>(kv.key_cache) | reinterpret_cast<uintptr_t>(kv.value_cache) |
                           strides | static_cast<uintptr_t>(span_bytes)) & 63) == 0;
    span_lines = (span_bytes + 63) / 64 + (aligned ? 0 : 1);
    steps_per_tile = 2 * num_kv_heads * kTileTokens;
  }

  void start_tile(const Tile<scalar_t>* next) {  // the tile to prefetch into L2 from now on (nullptr: none)
    tile = next, token = 0, head = 0, line = 0;
    if (next == nullptr) return;
    lines_per_step = (span_lines * spans_per_token * next->num_tokens + steps_per_tile - 1) / steps_per_tile;
  }

  void step() {
    if (tile == nullptr) return;
    for (int64_t n = 0; n < lines_per_step && token < tile->num_tokens && head < spans_per_token; ++n) {
      const uintptr_t key = reinterpret_cast<uintptr_t>(tile->keys[token] + head * key_head_stride);
      const uintptr_t value = reinterpret_cast<uintptr_t>(tile->values[token] + head * value_head_stride);
      __builtin_prefetch(reinterpret_cast<const void*>((key & ~uintptr_t{63}) + 64 * line), 0, 2);
      __builtin_prefetch(reinterpret_cast<const void*>((value & ~uintptr_t{63}) + 64 * line), 0, 2);
      if (++line < span_lines) continue;
      line = 0;
      if (heads_outer) {
        if (++token == tile->num_tokens) token = 0, ++head;
      } else {
        if (++head == spans_per_token) head = 0, ++token;
      }
    }
  }
  void keys(int64_t i) const {  // the next unit's key row of its token i
    if (unit_tile) lines_to_l1(unit_tile->keys[i] + key_offset);
  }
  void values(int64_t i) const {  // the next unit's value row of its token i
    if (unit_tile) lines_to_l1(unit_tile->values[i] + value_offset);
  }
  void lines_to_l1(const scalar_t* row) const {
    const uintptr_t begin = reinterpret_cast<uintptr_t>(row), end = begin + head_bytes;
    for (uintptr_t line = begin & ~uintptr_t{63}; line < end; line += 64) {
      __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 3);
    }
  }
};

// The work, as query rows: row r is a query token at position row_len(r) - 1 of sequence row_seq(r), attending
// to that sequence's tokens [window_start(r), row_len(r)). Decode: row r is sequence r's last token.
template <typename scalar_t, typename cache_t>
struct Problem {
  PagedKV<cache_t> kv;
  const scalar_t* query;  // [num_rows, num_heads, head_dim], strides query_row_stride, query_head_stride
  int64_t query_row_stride, query_head_stride;
  const int32_t* block_tables;  // [num_seqs, max_blocks_per_seq]
  const int32_t* row_lens;      // [num_rows]: position + 1 (decode: seq_lens)
  const int32_t* row_seqs;      // [num_rows]: the row's sequence, or nullptr: row r is sequence r (decode)
  const int32_t* row_tokens;    // [num_rows]: the row's index in query and out, or nullptr: r
  const float* alibi_slopes;    // [num_heads] or nullptr
  int64_t max_blocks_per_seq, block_size, num_heads, num_kv_heads, group_size, head_dim, sliding_window;
  float scale, logits_soft_cap;  // scale includes k_scale (fp8 caches)
  float v_scale;                 // multiplies the output (1 but for fp8 caches)
  bool avx512_bf16;  // take the AVX-512 bf16 path (and keep acc in its order, see acc_index)

  int64_t row_len(int64_t row) const { return row_lens[row]; }
  int64_t token(int64_t row) const { return row_tokens ? row_tokens[row] : row; }
  const int32_t* block_table(int64_t row) const {
    return block_tables + (row_seqs ? row_seqs[row] : row) * max_blocks_per_seq;
  }
  // The first token a query at `position` sees (the sliding window's start; 0 without one).
  int64_t first_visible(int64_t position) const {
    return sliding_window > 0 ? std::max<int64_t>(0, position - sliding_window + 1) : 0;
  }
  int64_t window_start(int64_t row) const { return first_visible(row_lens[row] - 1); }
};

// A task's scratch memory: the online-softmax state of every query head, and one tile's logits of one group.
struct Scratch {
  std::vector<float> buffer;
  float* q;          // [num_heads, head_dim], pre-scaled query (portable path)
  float* acc;        // [num_heads, head_dim], unnormalized output (in acc_index order)
  float* max_logit;  // [num_heads], running max
  float* exp_sums;   // [num_heads, kTileTokens], running sum of exp(x - max_logit), per tile lane
  float* logits;     // [group_size, kTileTokens]: x, then p = exp(x - max) (portable path)
  uint32_t* p_pairs;  // [group_size, 2, kTileTokens / 2]: p of tokens (2i, 2i + 1) as bf16 pairs, high then low
                      // parts (AVX-512 path)

  Scratch(int64_t num_heads, int64_t group_size, int64_t head_dim)
      : buffer(num_heads * (2 * head_dim + 1 + kTileTokens) + group_size * 2 * kTileTokens) {
    q = buffer.data();
    acc = q + num_heads * head_dim;
    max_logit = acc + num_heads * head_dim;
    exp_sums = max_logit + num_heads;
    logits = exp_sums + num_heads * kTileTokens;
    p_pairs = reinterpret_cast<uint32_t*>(logits + group_size * kTileTokens);
  }
};

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

// Soft cap and ALiBi on one head's logits x[i] of tokens t0 + i, i < kTileTokens.
template <typename scalar_t, typename cache_t>
void apply_logit_mods(const Problem<scalar_t, cache_t>& pb, int64_t head, int64_t t0, int64_t last_token, float* x) {
  for (int64_t i = 0; i < kTileTokens; i += kVecSize) {
    Vec xi = Vec::loadu(x + i);
    if (pb.logits_soft_cap > 0) xi = (xi / Vec(pb.logits_soft_cap)).tanh() * Vec(pb.logits_soft_cap);
    if (pb.alibi_slopes) {
      xi = xi + Vec(pb.alibi_slopes[head]) * Vec::arange(static_cast<float>(t0 + i - last_token), 1.f);
    }
    xi.store(x + i);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Portable path

// Independent accumulators per query head, so that kHeads * kUnroll FMA chains hide the FMA latency.
template <int kHeads>
constexpr int kUnroll = kHeads <= 2 ? 4 : 2;

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
    for (int64_t r = d; r < head_dim; ++r) sum += q[j * head_dim + r] * to_float(k[r]);
    logits[j * logits_stride] = sum;
  }
}

// acc_j += sum_i p_j[i] * v_i for the kHeads query heads (acc_j = acc + j * head_dim, p_j = p + j * kTileTokens)
// over the value rows v_i = rows[i] + offset, i < num_tokens. A prefetcher, if given, steps once per token and
// prefetches the next unit's value row of the token.
template <int kHeads, typename scalar_t>
inline void accumulate_values(const float* p, const scalar_t* const* rows, int64_t offset, int64_t num_tokens,
                              int64_t head_dim, float* acc, Prefetcher<scalar_t>* prefetcher) {
  constexpr int U = kUnroll<kHeads>;
  for (int64_t i = 0; prefetcher && head_dim < U * kVecSize && i < num_tokens; ++i) {
    prefetcher->step();
    prefetcher->values(i);
  }
  int64_t d = 0;
  for (; d + U * kVecSize <= head_dim; d += U * kVecSize) {
    Vec sum[kHeads][U];
#pragma GCC unroll 8
    for (int j = 0; j < kHeads; ++j)
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) sum[j][u] = Vec::loadu(acc + j * head_dim + d + u * kVecSize);
    for (int64_t i = 0; i < num_tokens; ++i) {
      if (prefetcher && d == 0) prefetcher->step(), prefetcher->values(i);
      const scalar_t* v = rows[i] + offset + d;
      Vec row[U];
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) row[u] = load_float(v + u * kVecSize);
#pragma GCC unroll 8
      for (int j = 0; j < kHeads; ++j) {
        const Vec weight(p[j * kTileTokens + i]);
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
      const Vec row = load_float(rows[i] + offset + d);
#pragma GCC unroll 8
      for (int j = 0; j < kHeads; ++j) sum[j] = at::vec::fmadd(Vec(p[j * kTileTokens + i]), row, sum[j]);
    }
#pragma GCC unroll 8
    for (int j = 0; j < kHeads; ++j) sum[j].store(acc + j * head_dim + d);
  }
  for (; d < head_dim; ++d)
    for (int64_t i = 0; i < num_tokens; ++i)
      for (int j = 0; j < kHeads; ++j)
        acc[j * head_dim + d] += p[j * kTileTokens + i] * to_float(rows[i][offset + d]);
}

// Steps 1-3 for the group of kv head `kv_head` over one tile (portable path).
template <typename scalar_t, typename cache_t>
void attend_tile(const Problem<scalar_t, cache_t>& pb, int64_t kv_head, const Tile<cache_t>& tile,
                 int64_t last_token, Scratch& sc, Prefetcher<cache_t>& prefetcher) {
  const int64_t group_size = pb.group_size, head_dim = pb.head_dim, first_head = kv_head * group_size;
  const int64_t key_offset = kv_head * pb.kv.key_head_stride, value_offset = kv_head * pb.kv.value_head_stride;
  const int64_t num_tokens = tile.num_tokens;
  const float* q = sc.q + first_head * head_dim;
  float* acc = sc.acc + first_head * head_dim;

  // 1. Logits of every head of the group for the tile's tokens.
  for (int64_t i = 0; i < num_tokens; ++i) {
    prefetcher.step();
    prefetcher.keys(i);
    for_each_head_tile(group_size, [&](auto heads, int64_t first) {
      dot_heads<decltype(heads)::value>(q + first * head_dim, tile.keys[i] + key_offset, head_dim,
                                        sc.logits + first * kTileTokens + i, kTileTokens);
    });
  }
  for (int64_t i = num_tokens; i < kTileTokens; ++i) prefetcher.step();
  // 2. Soft cap, ALiBi, running max, p = exp(x - max). Lanes past num_tokens are set to -inf, so exp gives 0.
  const Vec num_valid(static_cast<float>(num_tokens));
  for (int64_t j = 0; j < group_size; ++j) {
    const int64_t head = first_head + j;
    float* x = sc.logits + j * kTileTokens;
    if (pb.logits_soft_cap > 0 || pb.alibi_slopes) apply_logit_mods(pb, head, tile.first, last_token, x);
    Vec tile_max(kNegInf);
    for (int64_t i = 0; i < kTileTokens; i += kVecSize) {
      const Vec lane = Vec::arange(static_cast<float>(i), 1.f);
      const Vec xi = Vec::blendv(Vec(kNegInf), Vec::loadu(x + i), lane < num_valid);
      tile_max = at::vec::maximum(tile_max, xi);
      xi.store(x + i);
    }
    const float old_max = sc.max_logit[head];
    const float new_max = std::max(
        old_max, at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return at::vec::maximum(a, b); }, tile_max));
    if (new_max != old_max) {  // rescale only when the max grew (rarely, after the first tiles)
      const float alpha = std::exp(old_max - new_max);  // 0 on the first tile: old_max = -inf
      for (int64_t i = 0; i < kTileTokens; ++i) sc.exp_sums[head * kTileTokens + i] *= alpha;
      for (int64_t d = 0; d < head_dim; ++d) acc[j * head_dim + d] *= alpha;
      sc.max_logit[head] = new_max;
    }
    for (int64_t i = 0; i < kTileTokens; i += kVecSize) {
      const Vec p = (Vec::loadu(x + i) - Vec(new_max)).exp_u20();
      (Vec::loadu(sc.exp_sums + head * kTileTokens + i) + p).store(sc.exp_sums + head * kTileTokens + i);
      p.store(x + i);
    }
  }
  // 3. acc += p * v over the tile's tokens.
  for_each_head_tile(group_size, [&](auto heads, int64_t first) {
    accumulate_values<decltype(heads)::value>(sc.logits + first * kTileTokens, tile.values, value_offset,
                                              num_tokens, head_dim, acc + first * head_dim,
                                              first == 0 ? &prefetcher : nullptr);
  });
  for (int64_t i = num_tokens; i < kTileTokens; ++i) prefetcher.step();
}

// ---------------------------------------------------------------------------------------------------------------
// AVX-512 bf16 path. Only these functions are compiled for AVX-512 (function target attribute) and they run only
// where the CPU has it (use_avx512), so no AVX-512 code can run on a CPU without it.

#if defined(CPU_CAPABILITY_AVX2)
constexpr int64_t kChunk = 32;  // bf16 elements per 512-bit vector

// Where element d of a head's accumulator lives on the AVX-512 path. Step 3 interleaves a chunk of 32 elements
// of two value rows with unpacklo/unpackhi_epi16, which work within 128-bit lanes: the "lo" vector gets elements
// 8L + (0..3) of each lane L = 0..3, the "hi" vector elements 8L + (4..7); the accumulator of a chunk is stored as
// [lo (16 floats), hi (16 floats)].
inline int64_t acc_index(int64_t d, bool avx512_bf16) {
  if (!avx512_bf16) return d;
  const int64_t r = d % kChunk, lane = r / 8, w = r % 8;
  return d - r + (w / 4) * 16 + lane * 4 + w % 4;
}

#define PAGED_ATTN_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// Decodes cache elements to bfloat16, 32 at a time (load_bf16x32): for fp8 caches the 128 magnitudes' bfloat16 bits
// (Fp8Table::bf16_magnitude) in four vectors, loaded once per call of the functions below.
struct Bf16Decoder {
  __m512i magnitudes[4];  // entries 0-31, 32-63, 64-95, 96-127
};

template <typename cache_t>
PAGED_ATTN_AVX512 inline Bf16Decoder bf16_decoder() {
  Bf16Decoder decoder;
  if constexpr (kIsFp8<cache_t>) {
    for (int i = 0; i < 4; ++i) decoder.magnitudes[i] = _mm512_load_si512(fp8_table<cache_t>.bf16_magnitude + 32 * i);
  }
  return decoder;
}

PAGED_ATTN_AVX512 inline __m512i load_bf16x32(const at::BFloat16* p, const Bf16Decoder&) {
  return _mm512_loadu_si512(p);
}

// 32 fp8 bytes, widened to 16 bits: two 64-entry lookups (vpermi2w reads the index's low 6 bits), the one
// selected by bit 6, then the sign bit moved from bit 7 to bit 15.
template <typename fp8_t, typename = std::enable_if_t<kIsFp8<fp8_t>>>
PAGED_ATTN_AVX512 inline __m512i load_bf16x32(const fp8_t* p, const Bf16Decoder& decoder) {
  const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i low = _mm512_permutex2var_epi16(decoder.magnitudes[0], bytes, decoder.magnitudes[1]);
  const __m512i high = _mm512_permutex2var_epi16(decoder.magnitudes[2], bytes, decoder.magnitudes[3]);
  const __m512i magnitude =
      _mm512_mask_blend_epi16(_mm512_test_epi16_mask(bytes, _mm512_set1_epi16(0x40)), low, high);
  // magnitude | ((bytes << 8) & 0x8000)
  return _mm512_ternarylogic_epi32(magnitude, _mm512_slli_epi16(bytes, 8), _mm512_set1_epi16(-0x8000), 0xF8);
}

// Per 128-bit lane L: [sum of a's 4 elements in L, same of b, c, d].
PAGED_ATTN_AVX512 inline __m512 reduce_in_lanes(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // a0+a2 b0+b2 a1+a3 b1+b3
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d ab_d = _mm512_castps_pd(ab), cd_d = _mm512_castps_pd(cd);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ab_d, cd_d)),  // a0+a2 b0+b2 c0+c2 d0+d2
                       _mm512_castpd_ps(_mm512_unpackhi_pd(ab_d, cd_d)));
}

// [x, y] -> [x0 + x1, x2 + x3, y0 + y1, y2 + y3] over 128-bit lanes.
PAGED_ATTN_AVX512 inline __m512 add_lane_pairs(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Step 1: logits[j] lane i = scale * (q_j . k_i) for kHeads bf16 query heads q_j = q + j * q_stride and the tile's
// 16 key rows k_i = rows[i] + offset. Four tokens at a time: 4 * kHeads dot products in 16-lane partial sums,
// reduced in a tree of shuffles (reduce_in_lanes, then add_lane_pairs twice) into one vector per head.
template <int kHeads, typename cache_t>
PAGED_ATTN_AVX512 void tile_logits_avx512(const at::BFloat16* q, int64_t q_stride, const cache_t* const* rows,
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
    for (int64_t d = 0; d < head_dim; d += kChunk) {
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

// exp(x) for x <= 0 (exact 0 below about -87, and for -inf): 2^n * 2^f with n = round(x log2 e), |f| <= 1/2,
// 2^f by a degree-5 polynomial (relative error below 1e-7).
PAGED_ATTN_AVX512 inline __m512 exp_nonpositive(__m512 x) {
  const __m512 y = _mm512_max_ps(_mm512_set1_ps(-200.f), _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 poly = _mm512_set1_ps(1.3266980e-3f);
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(9.6754692e-3f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(5.5507425e-2f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(2.4022122e-1f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(6.9314694e-1f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(1.0000001f));
  return _mm512_scalef_ps(poly, n);
}

// 16 bfloat16 -> 16 float32 (exact).
PAGED_ATTN_AVX512 inline __m512 widen_bf16(__m256i bf16) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16));
}

// Step 2 for one head: x = its logits of the tile (lanes past the tile's tokens -inf). Raises the running max if
// needed, splits p = exp(x - max) into two bfloat16 terms, hi = p truncated to bfloat16 (one bf16 ulp less where
// that is p itself) and lo = bf16(p - hi) (together p to about 2^-16 relative), writes them as pairs,
// p_pairs[i] = (hi_2i, hi_2i+1) and p_pairs[8 + i] = (lo_2i, lo_2i+1), and adds hi + lo to the lane sums.
// NOTE: hi and lo are both > 0 wherever p > 0, so that a value of inf gives inf: rounding hi to nearest would
// leave lo = 0 (p = 1 at the max, any p exact in bf16: 0 * inf = NaN) or lo < 0 (inf - inf = NaN).
PAGED_ATTN_AVX512 inline void softmax_tile_avx512(__m512 x, float* max_logit, float* exp_sums, float* acc,
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

// Step 3: acc_j += sum_i p_j[i] * v_i for kHeads heads (acc_j = acc + j * head_dim in acc_index order, p_j the
// pairs p_pairs + j * 16) over the tile's value rows v_i = rows[i] + offset, i < num_tokens, elements
// [d_begin, d_end), C chunks of 32 at a time. Per token pair and chunk: the two rows interleaved into lo/hi (see
// acc_index), then per head and half two vdpbf16ps, with the high and the low parts of the pair (p_2i, p_2i+1)
// broadcast. NOTE: the rows past num_tokens (the tile's padding, whose p is 0) are not multiplied: with an odd
// num_tokens the last pair's second row is zeros; a padding row repeats the last token's, and 0 * inf is NaN.
template <int kHeads, int C, typename cache_t>
PAGED_ATTN_AVX512 void tile_values_avx512_chunks(const uint32_t* p_pairs, const cache_t* const* rows,
                                                 int64_t num_tokens, int64_t offset, int64_t head_dim,
                                                 int64_t d_begin, int64_t d_end, float* acc,
                                                 Prefetcher<cache_t>* prefetcher) {
  const Bf16Decoder decoder = bf16_decoder<cache_t>();
  for (int64_t d = d_begin; d + C * kChunk <= d_end; d += C * kChunk) {
    __m512 sum[kHeads][C][2];
#pragma GCC unroll 4
    for (int j = 0; j < kHeads; ++j)
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) sum[j][c][h] = _mm512_loadu_ps(acc + j * head_dim + d + c * kChunk + h * 16);
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
        const __m512i a = load_bf16x32(rows[i] + offset + d + c * kChunk, decoder);
        const __m512i b =
            pair ? load_bf16x32(rows[i + 1] + offset + d + c * kChunk, decoder) : _mm512_setzero_si512();
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
            sum[j][c][h] = _mm512_dpbf16_ps(sum[j][c][h], half[c][h], weight_lo);
            sum[j][c][h] = _mm512_dpbf16_ps(sum[j][c][h], half[c][h], weight_hi);
          }
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < kHeads; ++j)
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) _mm512_storeu_ps(acc + j * head_dim + d + c * kChunk + h * 16, sum[j][c][h]);
  }
}

template <int kHeads, typename cache_t>
PAGED_ATTN_AVX512 void tile_values_avx512(const uint32_t* p_pairs, const cache_t* const* rows, int64_t num_tokens,
                                          int64_t offset, int64_t head_dim, float* acc,
                                          Prefetcher<cache_t>* prefetcher) {
  constexpr int C = kHeads >= 3 ? 1 : 4 / kHeads;  // at least 8 accumulators, at most 16
  const int64_t main = head_dim / (C * kChunk) * (C * kChunk);
  tile_values_avx512_chunks<kHeads, C>(p_pairs, rows, num_tokens, offset, head_dim, 0, main, acc, prefetcher);
  tile_values_avx512_chunks<kHeads, 1>(p_pairs, rows, num_tokens, offset, head_dim, main, head_dim, acc,
                                       main == 0 ? prefetcher : nullptr);
}

// Steps 1-3 for query heads [head0, head0 + kHeads) of kv head `kv_head`'s group over one tile (AVX-512 bf16 path).
template <int kHeads, typename cache_t>
PAGED_ATTN_AVX512 void attend_heads_avx512(const Problem<at::BFloat16, cache_t>& pb, const at::BFloat16* query,
                                           int64_t kv_head, int64_t head0, const Tile<cache_t>& tile,
                                           int64_t last_token, Scratch& sc, Prefetcher<cache_t>* prefetcher) {
  const int64_t head_dim = pb.head_dim;
  __m512 logits[kHeads];
  tile_logits_avx512<kHeads>(query + head0 * pb.query_head_stride, pb.query_head_stride, tile.keys,
                             kv_head * pb.kv.key_head_stride,
                             head_dim, pb.scale, prefetcher, logits);
  const __mmask16 valid = static_cast<__mmask16>((1u << tile.num_tokens) - 1);
  for (int j = 0; j < kHeads; ++j) {
    const int64_t head = head0 + j;
    if (pb.logits_soft_cap > 0 || pb.alibi_slopes) {
      float* x = sc.logits + j * kTileTokens;
      _mm512_storeu_ps(x, logits[j]);
      apply_logit_mods(pb, head, tile.first, last_token, x);
      logits[j] = _mm512_loadu_ps(x);
    }
    softmax_tile_avx512(_mm512_mask_blend_ps(valid, _mm512_set1_ps(kNegInf), logits[j]), sc.max_logit + head,
                        sc.exp_sums + head * kTileTokens, sc.acc + head * head_dim, head_dim,
                        sc.p_pairs + j * kTileTokens);
  }
  tile_values_avx512<kHeads>(sc.p_pairs, tile.values, tile.num_tokens, kv_head * pb.kv.value_head_stride, head_dim,
                             sc.acc + head0 * head_dim, prefetcher);
}

template <typename cache_t>
void attend_tile_avx512(const Problem<at::BFloat16, cache_t>& pb, const at::BFloat16* query, int64_t kv_head,
                        const Tile<cache_t>& tile, int64_t last_token, Scratch& sc, Prefetcher<cache_t>& prefetcher) {
  for_each_head_tile(pb.group_size, [&](auto heads, int64_t first) {
    attend_heads_avx512<decltype(heads)::value>(pb, query, kv_head, kv_head * pb.group_size + first, tile,
                                                last_token, sc, first == 0 ? &prefetcher : nullptr);
  });
}

// The AVX-512 path is used where the CPU has AVX512F/BW/VL/DQ and AVX512_BF16, unless the environment variable
// PAGED_ATTN_NO_AVX512 is set (to test the portable AVX2 path on such a CPU).
inline bool use_avx512() {
  static const bool use = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512bf16") && std::getenv("PAGED_ATTN_NO_AVX512") == nullptr;
  return use;
}

// A bfloat16 query over a bfloat16 or fp8 cache.
template <typename scalar_t, typename cache_t>
constexpr bool kHasAvx512Path =
    std::is_same_v<scalar_t, at::BFloat16> && (std::is_same_v<cache_t, at::BFloat16> || kIsFp8<cache_t>);

template <typename scalar_t, typename cache_t>
inline bool avx512_bf16_path(int64_t head_dim) {
  return kHasAvx512Path<scalar_t, cache_t> && head_dim % kChunk == 0 && use_avx512();
}
#else
inline int64_t acc_index(int64_t d, bool) { return d; }
template <typename scalar_t, typename cache_t>
inline bool avx512_bf16_path(int64_t) { return false; }
#endif

// ---------------------------------------------------------------------------------------------------------------
// Tasks

// Attends every query head of query row `row` to its sequence's tokens [begin, end), leaving (max, lane sums, acc)
// in sc.
template <typename scalar_t, typename cache_t>
void attend(const Problem<scalar_t, cache_t>& pb, int64_t row, int64_t begin, int64_t end, Scratch& sc) {
  const int64_t num_heads = pb.num_heads, head_dim = pb.head_dim;
  const scalar_t* query = pb.query + pb.token(row) * pb.query_row_stride;  // [num_heads, head_dim]
  if (!pb.avx512_bf16) {
    for (int64_t h = 0; h < num_heads; ++h) {
      for (int64_t d = 0; d < head_dim; ++d) {
        sc.q[h * head_dim + d] = pb.scale * static_cast<float>(query[h * pb.query_head_stride + d]);
      }
    }
  }
  std::fill_n(sc.acc, num_heads * head_dim, 0.f);
  std::fill_n(sc.max_logit, num_heads, kNegInf);
  std::fill_n(sc.exp_sums, num_heads * kTileTokens, 0.f);
  const int32_t* block_table = pb.block_table(row);
  const int64_t last_token = pb.row_len(row) - 1;
  const int64_t num_tiles = (end - begin + kTileTokens - 1) / kTileTokens;

  // tiles[k % kRing] is tile k; tile k + kPrefetchTiles is looked up while tile k is worked on.
  constexpr int64_t kRing = kPrefetchTiles + 1;
  Tile<cache_t> tiles[kRing];
  for (int64_t k = 0; k < std::min(kPrefetchTiles, num_tiles); ++k) {
    tiles[k].load(pb.kv, block_table, pb.block_size, begin + k * kTileTokens, end);
  }
  Prefetcher<cache_t> prefetcher(pb.kv, pb.num_kv_heads, pb.head_dim);
  for (int64_t k = 0; k < num_tiles; ++k) {
    const Tile<cache_t>& tile = tiles[k % kRing];
    if (k + kPrefetchTiles < num_tiles) {
      Tile<cache_t>& ahead = tiles[(k + kPrefetchTiles) % kRing];
      ahead.load(pb.kv, block_table, pb.block_size, begin + (k + kPrefetchTiles) * kTileTokens, end);
      prefetcher.start_tile(&ahead);
    } else {
      prefetcher.start_tile(nullptr);
    }
    for (int64_t kv_head = 0; kv_head < pb.num_kv_heads; ++kv_head) {
      // The next unit: the next kv head of this tile, or the first of the next tile (loaded: kPrefetchTiles >= 1).
      const bool last_head = kv_head + 1 == pb.num_kv_heads;
      prefetcher.unit_tile = !last_head ? &tile : k + 1 < num_tiles ? &tiles[(k + 1) % kRing] : nullptr;
      prefetcher.key_offset = last_head ? 0 : (kv_head + 1) * pb.kv.key_head_stride;
      prefetcher.value_offset = last_head ? 0 : (kv_head + 1) * pb.kv.value_head_stride;
#if defined(CPU_CAPABILITY_AVX2)
      if constexpr (kHasAvx512Path<scalar_t, cache_t>) {
        if (pb.avx512_bf16) {
          attend_tile_avx512(pb, query, kv_head, tile, last_token, sc, prefetcher);
          continue;
        }
      }
#endif
      attend_tile(pb, kv_head, tile, last_token, sc, prefetcher);
    }
  }
}

template <typename scalar_t, typename cache_t>
void paged_attention_kernel(const Problem<scalar_t, cache_t>& pb, int64_t num_rows,
                            scalar_t* out) {  // [num_tokens, num_heads, head_dim], contiguous; row r at token(r)
  const int64_t num_heads = pb.num_heads, head_dim = pb.head_dim;

  // Threads only for work worth waking them (kMinBytesPerCpuTask of keys and values per task). Split rows only
  // when there are too few to keep the threads evenly busy: into as many partitions as make the task count a
  // multiple of the thread count, each at least kMinPartitionTokens long.
  const int64_t num_threads = at::get_num_threads();
  int64_t max_len = 0, total_len = 0;  // tokens attended to, after the sliding window
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t len = pb.row_len(r) - pb.window_start(r);
    max_len = std::max(max_len, len);
    total_len += len;
  }
  const int64_t kv_bytes = total_len * 2 * pb.num_kv_heads * head_dim * int64_t{sizeof(cache_t)};
  const int64_t max_tasks = std::max<int64_t>(1, kv_bytes / kMinBytesPerCpuTask);
  int64_t num_partitions = 1;
  if (max_tasks > 1 && num_rows < 4 * num_threads && num_rows % num_threads != 0) {
    const int64_t balanced = num_threads / std::gcd(num_rows, num_threads);  // num_rows * balanced % num_threads == 0
    num_partitions = std::clamp<int64_t>(max_len / kMinPartitionTokens, 1, balanced);
  }
  // Whole tiles per partition (but the last).
  const int64_t partition_size =
      std::max<int64_t>(1, (max_len + num_partitions * kTileTokens - 1) / (num_partitions * kTileTokens)) *
      kTileTokens;

  // Partial results of split rows: max logit and exp sum [num_rows, num_heads, num_partitions],
  // acc [num_rows, num_heads, num_partitions, head_dim].
  const int64_t num_partials = num_rows * num_heads * num_partitions;
  std::vector<float> partials(num_partitions > 1 ? num_partials * (head_dim + 2) : 0);
  float* max_logits = partials.data();
  float* exp_sums = max_logits + num_partials;
  float* partial_accs = exp_sums + num_partials;

  const int64_t num_tasks = num_rows * num_partitions;
  const int64_t num_chunks = std::max<int64_t>(1, std::min(num_tasks, max_tasks));  // at most
  const int64_t grain = (num_tasks + num_chunks - 1) / num_chunks;
  at::parallel_for(0, num_tasks, grain, [&](int64_t task_begin, int64_t task_end) {
    Scratch sc(num_heads, pb.group_size, head_dim);
    for (int64_t task = task_begin; task < task_end; ++task) {
      const int64_t row = task / num_partitions, partition = task % num_partitions, len = pb.row_len(row);
      const int64_t begin = std::min(pb.window_start(row) + partition * partition_size, len);
      attend(pb, row, begin, std::min(begin + partition_size, len), sc);
      for (int64_t h = 0; h < num_heads; ++h) {
        const int64_t out_row = pb.token(row) * num_heads + h;
        const float* acc = sc.acc + h * head_dim;
        const float* lane_sums = sc.exp_sums + h * kTileTokens;
        const float exp_sum = std::accumulate(lane_sums, lane_sums + kTileTokens, 0.f);
        if (num_partitions == 1) {
          const float inv_sum = exp_sum > 0 ? pb.v_scale / exp_sum : 0.f;  // 0 for an empty sequence
          for (int64_t d = 0; d < head_dim; ++d) {
            out[out_row * head_dim + d] = static_cast<scalar_t>(acc[acc_index(d, pb.avx512_bf16)] * inv_sum);
          }
        } else {
          const int64_t slot = (row * num_heads + h) * num_partitions + partition;
          max_logits[slot] = sc.max_logit[h];
          exp_sums[slot] = exp_sum;
          for (int64_t d = 0; d < head_dim; ++d) {
            partial_accs[slot * head_dim + d] = acc[acc_index(d, pb.avx512_bf16)];
          }
        }
      }
    }
  });
  if (num_partitions == 1) return;

  // Merge the partitions of each (row, head); empty partitions (max -inf) contribute nothing.
  const int64_t merge_grain = std::max<int64_t>(
      1, kMinBytesPerCpuTask / (num_partitions * (head_dim + 2) * int64_t{sizeof(float)}));
  at::parallel_for(0, num_rows * num_heads, merge_grain, [&](int64_t row_begin, int64_t row_end) {
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
      const float inv_total = total > 0 ? pb.v_scale / total : 0.f;
      scalar_t* dst = out + (pb.token(row / num_heads) * num_heads + row % num_heads) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(merged[d] * inv_total);
    }
  });
}

// ---------------------------------------------------------------------------------------------------------------
// Prefill: the query rows of sequences with at least kMinPrefillQueryLen query tokens (query_start_loc), in tiles.
//
// A task is (sequence, kv head, query tile): up to kPrefillRows rows (or one position's group_size if larger),
// r = i * group_size + j for the tile's query positions p0 + i and the group's query heads j, so that query heads
// sharing a kv head share its key and value tiles. The task walks the keys its rows can see, [first_visible(p0),
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
//      The tile's keys are cut into segments at every row's first and last visible key; each segment goes into
//      the rows that see all of it (a contiguous run: both ends of a row's visible range grow with its position).
//      A row's keys are still added in order, so this is the plain loop's sum, bit for bit.
// (A NaN key a row cannot see needs no such care: its logit is overwritten by the mask in step 3.)
// Then out = O / sum. Micro-kernels: AVX-512 FMA, 6 rows x 32 keys (S) and 6 rows x 64 dims (O), where the CPU has
// it and head_dim % 16 == 0; plain loops the compiler vectorizes elsewhere. Tasks are pulled from a shared counter,
// most keys first: tiles late in a causal sequence cost more, and a static split would leave a thread idle.
// NOTE: below 4 query tokens, sharing a key tile among the rows does not pay for packing it: a 2-row chunk after a
// 16k-token prefix costs about 1.8x two decode rows in the tiled kernel, a 4-row one the same as 4 decode rows, an
// 8-row one 0.85x (bench/RESULTS.md, 2026-12-02). Such sequences' rows take the decode kernel.
constexpr int64_t kMinPrefillQueryLen = 4;
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
PAGED_ATTN_AVX512 void qk_micro_avx512(const float* q, int64_t head_dim, const float* kt, float* s) {
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
PAGED_ATTN_AVX512 void pv_micro_avx512(const float* p, int64_t num_keys, const float* v, int64_t head_dim,
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

// Calls f(std::integral_constant<int, R>, first_row) over [0, rows) in groups of up to kMicroRows.
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

PAGED_ATTN_AVX512 void qk_rows_avx512(const float* q, int64_t rows, int64_t head_dim, const float* kt, float* s) {
  for_each_micro_rows(rows, [&](auto micro, int64_t first) {
    qk_micro_avx512<decltype(micro)::value>(q + first * head_dim, head_dim, kt, s + first * kPrefillKeys);
  });
}

PAGED_ATTN_AVX512 void pv_rows_avx512(const float* p, int64_t rows, int64_t num_keys, const float* v,
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
PAGED_ATTN_AVX512 void softmax_row_avx512(float* x, float* max_logit, float* sum, float* orow, int64_t head_dim) {
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
PAGED_ATTN_AVX512 inline void transpose_16x16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {  // rows i and i + 1 interleaved
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // then 4 x 4 blocks transposed within each quarter
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

// transpose_keys_portable for head_dim % 16 == 0, by 16 x 16 blocks.
PAGED_ATTN_AVX512 void transpose_keys_avx512(const float* k, int64_t num_keys, int64_t head_dim, float* kt) {
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
void pack_key_tile(const PagedKV<cache_t>& kv, const int32_t* block_table, int64_t block_size, int64_t kv_head,
                   int64_t head_dim, int64_t t0, int64_t num_keys, int64_t next_num_keys, bool avx512,
                   PrefillScratch& sc) {
  const auto rows = [&](int64_t t) {  // token t's key and value rows of kv_head
    const int32_t block = block_table[t / block_size];
    return std::pair{kv.keys(block, t % block_size) + kv_head * kv.key_head_stride,
                     kv.values(block, t % block_size) + kv_head * kv.value_head_stride};
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
void prefill_task(const Problem<scalar_t, cache_t>& pb, const int32_t* query_start_loc, const int32_t* seq_lens,
                  const PrefillTask& task, int64_t positions_per_tile, bool avx512, PrefillScratch& sc,
                  scalar_t* out) {
  const int64_t group_size = pb.group_size, head_dim = pb.head_dim, seq = task.seq;
  const int64_t query_len = query_start_loc[seq + 1] - query_start_loc[seq];
  const int64_t num_positions = std::min<int64_t>(positions_per_tile, query_len - task.first);
  const int64_t rows = num_positions * group_size;
  const int64_t first_position = seq_lens[seq] - query_len + task.first;  // of the tile's first row
  const int64_t last_position = first_position + num_positions - 1;
  const int64_t first_head = task.kv_head * group_size;
  const int64_t first_query_row = query_start_loc[seq] + task.first;  // in query / out
  const int32_t* block_table = pb.block_tables + seq * pb.max_blocks_per_seq;
  const bool logit_mods = pb.logits_soft_cap > 0 || pb.alibi_slopes != nullptr;

  for (int64_t i = 0; i < num_positions; ++i) {
    for (int64_t j = 0; j < group_size; ++j) {
      const scalar_t* q =
          pb.query + (first_query_row + i) * pb.query_row_stride + (first_head + j) * pb.query_head_stride;
      float* qr = sc.q + (i * group_size + j) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) qr[d] = pb.scale * static_cast<float>(q[d]);
    }
  }
  std::fill_n(sc.o, rows * head_dim, 0.f);
  std::fill_n(sc.max_logit, rows, kNegInf);
  std::fill_n(sc.sum, rows, 0.f);

  // Every key in [first_visible(first_position), last_position] is seen by some row of the tile.
  for (int64_t t0 = pb.first_visible(first_position); t0 <= last_position; t0 += kPrefillKeys) {
    const int64_t num_keys = std::min(kPrefillKeys, last_position + 1 - t0);
    const int64_t next_num_keys = std::clamp<int64_t>(last_position + 1 - (t0 + kPrefillKeys), 0, kPrefillKeys);
    // 1. Pack.
    pack_key_tile(pb.kv, block_table, pb.block_size, task.kv_head, head_dim, t0, num_keys, next_num_keys, avx512, sc);
    // 2. S = Q K^T.
#if defined(CPU_CAPABILITY_AVX2)
    if (avx512) {
      qk_rows_avx512(sc.q, rows, head_dim, sc.kt, sc.s);
    } else
#endif
      qk_rows_portable(sc.q, rows, head_dim, sc.kt, sc.s);
    // 3. Logit mods, mask, online softmax.
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t position = first_position + r / group_size, head = first_head + r % group_size;
      float* x = sc.s + r * kPrefillKeys;
      const int64_t visible_begin = pb.first_visible(position);
      const bool all_visible = t0 + kPrefillKeys - 1 <= position && t0 >= visible_begin;
      if (logit_mods || !all_visible) {
        for (int64_t n = 0; n < kPrefillKeys; ++n) {
          const int64_t t = t0 + n;
          if (t > position || t < visible_begin) {  // lanes past num_keys are past every row's position
            x[n] = kNegInf;
            continue;
          }
          if (pb.logits_soft_cap > 0) x[n] = pb.logits_soft_cap * std::tanh(x[n] / pb.logits_soft_cap);
          if (pb.alibi_slopes) x[n] += pb.alibi_slopes[head] * static_cast<float>(t - position);
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
    // 4. O += P V, by segments. Position i sees the tile's keys [lo[i], hi[i]) (empty if hi[i] <= lo[i]).
    int64_t lo[kPrefillRows], hi[kPrefillRows];
    bool cut[kPrefillKeys + 1] = {};
    for (int64_t i = 0; i < num_positions; ++i) {
      const int64_t position = first_position + i;
      lo[i] = std::clamp<int64_t>(pb.first_visible(position) - t0, 0, num_keys);
      hi[i] = std::clamp<int64_t>(position + 1 - t0, 0, num_keys);
      if (lo[i] < hi[i]) cut[lo[i]] = cut[hi[i]] = true;
    }
    int64_t i_begin = 0;  // the segment's positions: [i_begin, i_end)
    for (int64_t a = 0, b = 1; b <= num_keys; ++b) {
      if (!cut[b]) continue;
      while (hi[i_begin] < b) ++i_begin;  // some position sees key a, so this stops within the tile
      int64_t i_end = i_begin;
      while (i_end < num_positions && lo[i_end] <= a) ++i_end;
      const int64_t first_row = i_begin * group_size, seg_rows = (i_end - i_begin) * group_size;
      const float* p = sc.s + first_row * kPrefillKeys + a;
      float* o = sc.o + first_row * head_dim;
#if defined(CPU_CAPABILITY_AVX2)
      if (avx512) {
        pv_rows_avx512(p, seg_rows, b - a, sc.v + a * head_dim, head_dim, o);
      } else
#endif
        pv_rows_portable(p, seg_rows, b - a, sc.v + a * head_dim, head_dim, o);
      a = b;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r / group_size, head = first_head + r % group_size;
    scalar_t* dst = out + ((first_query_row + i) * pb.num_heads + head) * head_dim;
    const float inv_sum = pb.v_scale / sc.sum[r];  // sum > 0: every row sees at least its own token
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(sc.o[r * head_dim + d] * inv_sum);
  }
}

// Every query row of the sequences in `seqs` (each with at least kMinPrefillQueryLen query tokens), in tiles.
template <typename scalar_t, typename cache_t>
void prefill_kernel(const Problem<scalar_t, cache_t>& pb, const int32_t* query_start_loc, const int32_t* seq_lens,
                    const std::vector<int32_t>& seqs, scalar_t* out) {  // out: [num_tokens, num_heads, head_dim]
  const int64_t positions_per_tile = std::max<int64_t>(1, kPrefillRows / pb.group_size);
  std::vector<PrefillTask> tasks;
  for (const int32_t seq : seqs) {
    const int64_t query_len = query_start_loc[seq + 1] - query_start_loc[seq];
    for (int64_t first = 0; first < query_len; first += positions_per_tile) {
      const int64_t last_position = seq_lens[seq] - query_len + std::min(query_len, first + positions_per_tile) - 1;
      const int64_t first_position = seq_lens[seq] - query_len + first;
      const int64_t first_token = pb.first_visible(first_position);
      for (int64_t kv_head = 0; kv_head < pb.num_kv_heads; ++kv_head) {
        tasks.push_back({seq, static_cast<int32_t>(kv_head), static_cast<int32_t>(first),
                         static_cast<int32_t>(last_position + 1 - first_token)});
      }
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const auto& a, const auto& b) { return a.num_keys > b.num_keys; });
#if defined(CPU_CAPABILITY_AVX2)
  const bool avx512 = pb.head_dim % 16 == 0 && use_avx512f();
#else
  const bool avx512 = false;
#endif
  // Threads only for work worth waking them (kMinBytesPerCpuTask of keys and values walked per thread).
  int64_t keys_walked = 0;
  for (const PrefillTask& task : tasks) keys_walked += task.num_keys;
  const int64_t kv_bytes = keys_walked * 2 * pb.head_dim * int64_t{sizeof(cache_t)};
  const int64_t num_workers = std::clamp<int64_t>(kv_bytes / kMinBytesPerCpuTask, 1,
                                                  std::min<int64_t>(at::get_num_threads(), tasks.size()));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, num_workers, 1, [&](int64_t begin, int64_t end) {
    if (begin >= end) return;
    PrefillScratch sc(positions_per_tile * pb.group_size, pb.head_dim);
    for (int64_t i = next++; i < static_cast<int64_t>(tasks.size()); i = next++) {
      prefill_task(pb, query_start_loc, seq_lens, tasks[i], positions_per_tile, avx512, sc, out);
    }
  });
}

}  // namespace

void paged_attention_cpu(at::Tensor& out,                 // [num_tokens, num_heads, head_dim], contiguous
                         const at::Tensor& query,         // [num_tokens, num_heads, head_dim], last dim contiguous
                         const at::Tensor& key_cache,     // [num_blocks, block_size, num_kv_heads, head_dim]
                         const at::Tensor& value_cache,   // [num_blocks, block_size, num_kv_heads, head_dim]
                         const at::Tensor& block_tables,  // [num_seqs, max_blocks_per_seq], int32
                         const at::Tensor& seq_lens,      // [num_seqs], int32
                         double scale,
                         const std::optional<at::Tensor>& alibi_slopes,  // [num_heads], float32
                         int64_t sliding_window, double logits_soft_cap,
                         const std::optional<at::Tensor>& query_start_loc,  // [num_seqs + 1], int32, or none
                         std::optional<int64_t> max_query_len,
                         const std::optional<at::Tensor>& k_scale,    // [1], float32 (fp8 caches only)
                         const std::optional<at::Tensor>& v_scale) {  // [1], float32 (fp8 caches only)
  check_paged_attention_args(out, query, key_cache, value_cache, block_tables, seq_lens, scale, alibi_slopes,
                             sliding_window, logits_soft_cap, query_start_loc, max_query_len, k_scale, v_scale);
  const int64_t block_size = key_cache.size(1);
  check_block_table_range(block_tables, seq_lens, key_cache.size(0), block_size);
  if (query_start_loc.has_value()) check_query_start_loc_range(*query_start_loc, seq_lens, query.size(0), max_query_len);
  check_kv_scale_values(k_scale, v_scale);
  if (out.numel() == 0) return;
  const int64_t num_rows = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = key_cache.size(2);

  const auto tables = block_tables.contiguous();
  const auto lens = seq_lens.contiguous();
  const auto slopes = alibi_slopes.has_value() ? alibi_slopes->contiguous() : at::Tensor();
  // With query_start_loc: sequences with at least kMinPrefillQueryLen query tokens go to the tiled prefill kernel;
  // the rows of those with fewer (decodes, short chunks) to the decode kernel: row i of the q_s rows of sequence s,
  // at position L_s - q_s + i, as a row of length L_s - q_s + i + 1.
  std::vector<int32_t> decode_lens, decode_seqs, decode_tokens, prefill_seqs;
  const auto starts = query_start_loc.has_value() ? query_start_loc->contiguous() : at::Tensor();
  if (starts.defined()) {
    const int32_t* qsl = starts.const_data_ptr<int32_t>();
    const int32_t* len = lens.const_data_ptr<int32_t>();
    for (int32_t s = 0; s + 1 < starts.size(0); ++s) {
      const int32_t query_len = qsl[s + 1] - qsl[s];
      if (query_len >= kMinPrefillQueryLen) {
        prefill_seqs.push_back(s);
        continue;
      }
      for (int32_t i = 0; i < query_len; ++i) {
        decode_lens.push_back(len[s] - query_len + i + 1);
        decode_seqs.push_back(s);
        decode_tokens.push_back(qsl[s] + i);
      }
    }
  }
  const float k_scale_value = k_scale.has_value() ? k_scale->item<float>() : 1.f;
  const float v_scale_value = v_scale.has_value() ? v_scale->item<float>() : 1.f;
  const auto run = [&](auto dtype_tag, auto cache_tag) {
    using scalar_t = decltype(dtype_tag);
    using cache_t = decltype(cache_tag);
    const PagedKV<cache_t> kv{static_cast<const cache_t*>(key_cache.const_data_ptr()),
                              static_cast<const cache_t*>(value_cache.const_data_ptr()),
                              key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
                              value_cache.stride(0), value_cache.stride(1), value_cache.stride(2)};
    Problem<scalar_t, cache_t> pb{kv, query.const_data_ptr<scalar_t>(), query.stride(0), query.stride(1),
                                  tables.const_data_ptr<int32_t>(), lens.const_data_ptr<int32_t>(), nullptr, nullptr,
                                  slopes.defined() ? slopes.const_data_ptr<float>() : nullptr, tables.size(1),
                                  block_size, num_heads, num_kv_heads, num_heads / num_kv_heads, head_dim,
                                  sliding_window, static_cast<float>(scale) * k_scale_value,
                                  static_cast<float>(logits_soft_cap), v_scale_value,
                                  avx512_bf16_path<scalar_t, cache_t>(head_dim)};
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    if (!starts.defined()) return paged_attention_kernel(pb, num_rows, out_ptr);
    if (!prefill_seqs.empty()) {
      prefill_kernel(pb, starts.const_data_ptr<int32_t>(), lens.const_data_ptr<int32_t>(), prefill_seqs, out_ptr);
    }
    if (!decode_seqs.empty()) {
      pb.row_lens = decode_lens.data(), pb.row_seqs = decode_seqs.data(), pb.row_tokens = decode_tokens.data();
      paged_attention_kernel(pb, static_cast<int64_t>(decode_seqs.size()), out_ptr);
    }
  };
  // The cache's dtype: the query's, or fp8 (check_paged_attention_args allows exactly these).
  const auto by_cache = [&](auto dtype_tag) {
    switch (key_cache.scalar_type()) {
      case at::kFloat8_e4m3fn: return run(dtype_tag, c10::Float8_e4m3fn{});
      case at::kFloat8_e5m2: return run(dtype_tag, c10::Float8_e5m2{});
      default: return run(dtype_tag, dtype_tag);
    }
  };
  switch (query.scalar_type()) {
    case at::kFloat: by_cache(float{}); break;
    case at::kHalf: by_cache(at::Half{}); break;
    case at::kBFloat16: by_cache(at::BFloat16{}); break;
    default: TORCH_INTERNAL_ASSERT(false, "unreachable: dtype checked above");
  }
}

}  // namespace paged_attn

TORCH_LIBRARY_IMPL(paged_attn, CPU, m) {
  m.impl("paged_attention", &paged_attn::paged_attention_cpu);
}
