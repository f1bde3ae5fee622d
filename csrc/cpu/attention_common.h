// What every piece of the CPU attention kernels shares (attention.cpp, decode.cpp and prefill.cpp include it first;
// everything here has internal linkage, a copy in each translation unit, but AttentionParams, which they pass to
// one another: attention_params.h): the at::vec setup, the constants, fp8 decoding tables and load helpers, and the
// decode kernel's Tile, Prefetcher and Scratch. Words as in the
// glossary of paged_attn/ops.py (tile, partition, row, shared blocks...).
//
// Math, per sequence s of length L, query head h (reading kv head h / group_size) and token t in [start, L),
// start = max(0, L - sliding_window) (0 without a window):
//   x_t = scale * (q . k_t);  x_t = cap * tanh(x_t / cap) if logits_soft_cap = cap > 0;
//   x_t += slope[h] * (t - (L - 1)) with ALiBi;  out = sum_t softmax(x)_t * v_t, accumulated in float32.
// With sinks (gpt-oss), head h's softmax also counts sink[h] as a logit without a value, once per row, when the
// row's state is final (finish_row): out = sum_t e^(x_t - M) v_t / (e^(sink[h] - M) + sum_t e^(x_t - M)).
//
// fp8 caches (float8_e4m3fn, float8_e5m2; the query float32, float16 or bfloat16): every fp8 value is exactly a
// bfloat16 and a float32. A bfloat16 query takes the AVX-512 path, which decodes 32 cache bytes at a time into
// bfloat16 in registers (load_bf16x32: a 128-entry table of the magnitudes' bfloat16 bits looked up with two
// vpermi2w, the sign bit put back) and then runs exactly as on a bfloat16 cache, reading half the bytes. The
// portable path and the prefill packing decode through a 256-entry float32 table. The scales are applied outside
// the loops: k_scale is folded into the logit scale (scale * (q . k_scale k) = (scale k_scale) (q . k)), v_scale
// multiplies the output (sum_t p_t v_scale v_t / sum_t p_t).
#pragma once

// NOTE: at::vec::Vectorized picks its implementation from the CPU_CAPABILITY_* macros, which torch's own build
// sets per file. setup.py and CMakeLists.txt compile this extension with -march=x86-64-v3 (AVX2, FMA, F16C) on
// x86_64, so select the AVX2 implementation here, in a CPU_CAPABILITY namespace of our own so that these inline
// functions can never be confused with another library's build of the same headers. Elsewhere Vectorized falls
// back to its portable implementation. This is the one place the macros are set: the three .cpp files and every
// header of their pieces include this header first.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CPU_CAPABILITY_AVX2
#define CPU_CAPABILITY paged_attn_avx2
#endif

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

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
#include "attention_params.h"
#include "paged_cache.h"

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace paged_attn {
namespace {

using cpu::AttentionParams;
using cpu::kMinPrefillQueryLen;

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVecSize = Vec::size();
constexpr int64_t kTileTokens = 16;        // keys per decode tile (one AVX-512 vector of logits per head)
constexpr int64_t kMaxHeadsPerPass = 4;    // query heads that share one pass over a key or value row
constexpr int64_t kPartitionTokens = 512;  // a decode row's partitions: its keys cut at multiples of this
constexpr int64_t kPrefetchTiles = 1;      // how many tiles ahead rows are prefetched into L2 (at least 1)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
static_assert(kTileTokens % kVecSize == 0, "a tile's logits must be whole vectors");
static_assert(kPartitionTokens % kTileTokens == 0, "partition boundaries must be tile boundaries");
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

using cpu::PagedCache;
using cpu::PagedKV;

// The rows of up to kTileTokens consecutive tokens [first, first + num_tokens) of one sequence. Entries from
// num_tokens on repeat the last token's rows, so that full-width loops may read them (their p is 0).
// Tiled caches (paged_cache.h): the tokens are lanes [lane0, lane0 + num_tokens) of the cache's tile that holds
// them (first - lane0 a multiple of 16), key_tile and value_tile its kv head 0's keys and values; keys[i] and
// values[i] are then the tiles' head_dim-wide slices lane0 + i, the memory the prefetcher walks.
template <typename scalar_t>
struct Tile {
  int64_t first = 0, num_tokens = 0;
  const scalar_t* keys[kTileTokens];    // token first + i: [num_kv_heads, head_dim]
  const scalar_t* values[kTileTokens];  // token first + i: [num_kv_heads, head_dim]
  int64_t lane0 = 0;                    // tiled: the first token's lane (row-major: 0)
  const scalar_t* key_tile = nullptr;   // tiled: [head_dim / 2][16][2]; kv head h: + h * head_stride
  const scalar_t* value_tile = nullptr;  // tiled: [8][head_dim][2]

  void load(const PagedKV<scalar_t>& kv, const int32_t* block_table, int64_t block_size, int64_t tile_first,
            int64_t end) {
    first = tile_first;
    num_tokens = std::min(kTileTokens, end - first);
    if (kv.key.tiled) {  // a tile lies in one block (block_size a multiple of 16)
      static_assert(kTileTokens == cpu::kTiledTokens, "a decode tile is a cache tile");
      lane0 = first % kTileTokens;
      const int64_t block = block_table[first / block_size], offset = first % block_size;
      key_tile = kv.key.tile(block, offset), value_tile = kv.value.tile(block, offset);
      for (int64_t i = 0; i < num_tokens; ++i) {
        keys[i] = key_tile + (lane0 + i) * kv.key.token_stride;
        values[i] = value_tile + (lane0 + i) * kv.value.token_stride;
      }
    } else {
      int64_t block = first / block_size, offset = first % block_size;
      for (int64_t i = 0; i < num_tokens; ++i) {
        keys[i] = kv.key.token(block_table[block], offset);
        values[i] = kv.value.token(block_table[block], offset);
        if (++offset == block_size) offset = 0, ++block;
      }
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
  // The layout, for every tile of an attend call.
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

  // Tiled caches: a tile's keys and values of a kv head are one contiguous run each (chunk_lines lines), walked
  // head by head, line by line, a key line and a value line per prefetch; the whole tile (all 16 lanes are read).
  // NOTE: the lines of its slices (keys[i]) without walking them token by token: fewer instructions, no pointer
  // loads. The software prefetch costs instructions (with the data in L2, a unit's steps 1 and 3 took half the time
  // without it), but from memory it doubles decode's speed; figures: bench/LOG.md, "The tiled cache layout".
  bool tiled = false;
  int64_t chunk_lines = 0, num_heads = 0;

  Prefetcher(const PagedKV<scalar_t>& kv, int64_t num_kv_heads, int64_t head_dim, int64_t head_dim_v) {
    key_head_stride = kv.key.head_stride, value_head_stride = kv.value.head_stride;
    tiled = kv.key.tiled;
    num_heads = num_kv_heads;
    chunk_lines = kTileTokens * head_dim * int64_t{sizeof(scalar_t)} / 64;
    head_bytes = std::max(head_dim, head_dim_v) * int64_t{sizeof(scalar_t)};
    const bool token_rows_contiguous =
        num_kv_heads == 1 || (kv.key.head_stride == head_dim && kv.value.head_stride == head_dim_v);
    spans_per_token = token_rows_contiguous ? 1 : num_kv_heads;
    heads_outer = !token_rows_contiguous && kv.key.token_stride < kv.key.head_stride;
    const int64_t span_bytes = (token_rows_contiguous ? num_kv_heads : 1) * head_bytes;
    // Every row starts on a cache line when the caches and their strides (in bytes) are multiples of 64.
    const uintptr_t strides = static_cast<uintptr_t>(kv.key.block_stride | kv.key.token_stride | kv.key.head_stride |
                                                     kv.value.block_stride | kv.value.token_stride |
                                                     kv.value.head_stride) * sizeof(scalar_t);
    const bool aligned = ((reinterpret_cast<uintptr_t>(kv.key.data) | reinterpret_cast<uintptr_t>(kv.value.data) |
                           strides | static_cast<uintptr_t>(span_bytes)) & 63) == 0;
    span_lines = (span_bytes + 63) / 64 + (aligned ? 0 : 1);
    steps_per_tile = 2 * num_kv_heads * kTileTokens;
  }

  void start_tile(const Tile<scalar_t>* next) {  // the tile to prefetch into L2 from now on (nullptr: none)
    tile = next, token = 0, head = 0, line = 0;
    if (next == nullptr) return;
    if (tiled) {
      lines_per_step = (chunk_lines * num_heads + steps_per_tile - 1) / steps_per_tile;
      return;
    }
    lines_per_step = (span_lines * spans_per_token * next->num_tokens + steps_per_tile - 1) / steps_per_tile;
  }

  void step() {
    if (tile == nullptr) return;
    if (tiled) {
      for (int64_t n = 0; n < lines_per_step && head < num_heads; ++n) {
        __builtin_prefetch(reinterpret_cast<const char*>(tile->key_tile + head * key_head_stride) + 64 * line, 0, 2);
        __builtin_prefetch(reinterpret_cast<const char*>(tile->value_tile + head * value_head_stride) + 64 * line, 0,
                           2);
        if (++line == chunk_lines) line = 0, ++head;
      }
      return;
    }
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

// How a row's final state (max, sum of exp(x - max), acc) of one head becomes its output and log-sum-exp:
// out = acc * out_scale, lse = log(sum of exp over the logits and the sink). Without a sink out_scale =
// v_scale / sum (0 for a row that saw no key: sum = 0) and lse = max + log(sum). With a sink S (gpt-oss: a logit
// with no value vector, outside the soft cap, ALiBi and the window, counted once, here at the end), over
// M = max(max, S): total = e^(max - M) sum + e^(S - M), out_scale = v_scale e^(max - M) / total, lse = M + log(total),
// so a row that saw no key gives out 0 and lse S. S = -inf is no sink (the same bits as none); S = +inf takes the
// whole softmax: out 0 (the limit), lse +inf. A NaN max or sum (a NaN logit) stays NaN.
struct RowFinish {
  float out_scale, lse;
};
inline RowFinish finish_row(float max, float sum, float v_scale, const float* sinks, int64_t head) {
  const float sink = sinks ? sinks[head] : -INFINITY;
  if (sink == -INFINITY) return {sum > 0 ? v_scale / sum : 0.f, max + std::log(sum)};
  if (sink == INFINITY) return {0.f, INFINITY};
  const float m = std::isnan(max) ? max : std::max(max, sink);
  const float w = max == m ? 1.f : std::exp(max - m);  // 0 for a row that saw no key (max = -inf)
  const float total = std::fma(w, sum, std::exp(sink - m));
  return {v_scale * w / total, m + std::log(total)};
}

// One row's scratch memory while it is attended: the online-softmax state of every query head, and one tile's
// logits of one head group.
struct Scratch {
  std::vector<float> buffer;
  float* q;          // [num_heads, head_dim], pre-scaled query (portable path)
  float* acc;        // [num_heads, head_dim_v], unnormalized output (in acc_index order)
  float* max_logit;  // [num_heads], running max
  float* exp_sums;   // [num_heads, kTileTokens], running sum of exp(x - max_logit), per tile lane
  float* logits;     // [group_size, kTileTokens]: x, then p = exp(x - max) (portable path)
  uint32_t* p_pairs;  // [group_size, 2, kTileTokens / 2]: p of tokens (2i, 2i + 1) as bf16 pairs, high then low
                      // parts (AVX-512 path)

  Scratch(int64_t num_heads, int64_t group_size, int64_t head_dim, int64_t head_dim_v)
      : buffer(num_heads * (head_dim + head_dim_v + 1 + kTileTokens) + group_size * 2 * kTileTokens) {
    q = buffer.data();
    acc = q + num_heads * head_dim;
    max_logit = acc + num_heads * head_dim_v;
    exp_sums = max_logit + num_heads;
    logits = exp_sums + num_heads * kTileTokens;
    p_pairs = reinterpret_cast<uint32_t*>(logits + group_size * kTileTokens);
  }
};

// How many threads to wake for num_tasks tasks that walk kv_bytes of keys and values in all: one per
// kMinBytesPerCpuTask, at least 1, at most one per task and no more than torch's threads.
inline int64_t threads_worth_waking(int64_t kv_bytes, int64_t num_tasks) {
  return std::clamp<int64_t>(kv_bytes / kMinBytesPerCpuTask, 1, std::min<int64_t>(at::get_num_threads(), num_tasks));
}

// Calls f(std::integral_constant<int, n>, first) for passes of n <= kMaxHeadsPerPass heads covering [0, group_size).
template <typename F>
inline void for_each_head_pass(int64_t group_size, F&& f) {
  for (int64_t first = 0; first < group_size; first += kMaxHeadsPerPass) {
    switch (std::min(kMaxHeadsPerPass, group_size - first)) {
      case 4: f(std::integral_constant<int, 4>{}, first); break;
      case 3: f(std::integral_constant<int, 3>{}, first); break;
      case 2: f(std::integral_constant<int, 2>{}, first); break;
      default: f(std::integral_constant<int, 1>{}, first); break;
    }
  }
}

// Soft cap and ALiBi on one head's logits x[i] of tokens t0 + i, i < kTileTokens.
template <typename scalar_t, typename cache_t>
void apply_logit_mods(const AttentionParams<scalar_t, cache_t>& params, int64_t head, int64_t t0, int64_t last_token,
                      float* x) {
  for (int64_t i = 0; i < kTileTokens; i += kVecSize) {
    Vec xi = Vec::loadu(x + i);
    if (params.logits_soft_cap > 0) xi = (xi / Vec(params.logits_soft_cap)).tanh() * Vec(params.logits_soft_cap);
    if (params.alibi_slopes) {
      xi = xi + Vec(params.alibi_slopes[head]) * Vec::arange(static_cast<float>(t0 + i - last_token), 1.f);
    }
    xi.store(x + i);
  }
}

}  // namespace
}  // namespace paged_attn
