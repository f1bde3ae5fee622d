// The AMX decode path (Intel AMX-BF16; chosen at run time): steps 1-3 of the decode kernel (decode_kernels.h) for a
// bfloat16 query over a bfloat16 or fp8 cache, as tile matrix products (TDPBF16PS), for every query row of a unit
// (tile of 16 tokens, kv head) at once: the row alone, or the rows of a shared segment (decode.cpp).
//
// Per unit, the tile's key and value rows are laid out once for the products, and every row uses that layout:
//   key_t   [head_dim / 32][16 dim pairs][16 tokens]: the keys as bf16 pairs (elements 2r, 2r + 1 of a 32-element
//           vector), transposed, the B operand of S = Q K^T;
//   value_b [head_dim / 16][16][16]: row r < 8 holds the values of tokens (2r, 2r + 1) interleaved element by
//           element over 16 elements in acc_index order (avx512_kernels.h), row r + 8 the same again; zeros past
//           the tile's tokens (0 * inf would be NaN). The B operand of acc += P V.
// Then per row, per up to 16 heads of the kv head's head group (M):
//   1. S[h][t] = scale * (q_h . k_t): the heads' query rows (A) against key_t, head_dim / 32 products into one tile
//      register;
//   2. the AVX-512 path's softmax per head (softmax_tile_avx512: the running max and sums, p as bfloat16 pairs,
//      hi then lo, together p to about 2^-16);
//   3. acc[h][d] += sum_t (hi_t + lo_t) v_t[d]: the heads' [hi | lo] pairs (A, K = 32) against value_b, one
//      product per 16 elements of acc (loaded, added to, stored).
// The AMX unit computes each element of a product from its row of A and its column of B only, so a row's logits
// and values, and so its bits, are the same whatever other rows share the unit (M, or the other rows' turns).
// Opt-in (PAGED_ATTN_AMX=1), because it is not yet faster everywhere: on an Intel Xeon with AMX (2 cores, 2026-12-05,
// bench/RESULTS.md) rows that share blocks run 1.8x faster than on the AVX-512 path, but a row alone ~1.25x slower
// (the per-unit layout and the tile-register loads and stores cost more than 4 heads' products gain). The bits
// differ from the AVX-512 path's (other sums), so the choice is per process, never per batch.
// Tile registers: 0 S, 1 Q, 2 key_t (step 1); 3 P, 4 and 2 value_b, 5 and 6 acc (step 3). The configuration is
// per thread; attend loads it where the rows change and releases the tile registers at the end (AmxTiles).
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <string>

#include "avx512_kernels.h"

namespace paged_attn {
namespace {

#if defined(CPU_CAPABILITY_AVX2)
// Compiles a function for AMX (the environment variable PAGED_ATTN_AMX=1 is what opts in at run time).
#define PA_TARGET_AMX \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")))

constexpr int64_t kAmxRows = 16;  // a tile register's most rows (heads per product)

// The AMX path is used where PAGED_ATTN_AMX=1 is set, the CPU has AMX-TILE and AMX-BF16 (and the AVX-512 bf16 path
// is in use) and Linux grants this process the tile data state.
inline bool use_amx() {
  static const bool use = [] {
    const char* on = std::getenv("PAGED_ATTN_AMX");
    if (on == nullptr || std::string(on) != "1") return false;
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return use;
}

// The tile-register configuration of a thread (palette 1): 16 rows, but M rows for P and acc (registers 3, 5, 6)
// and the entries' rows (at most 16) for S and Q (registers 0, 1), loaded where they change; released at the end.
struct AmxTiles {
  int64_t rows = 0;  // M of the loaded configuration (0: none)

  int64_t qk_rows = 0;  // rows of S and Q (registers 0, 1)

  PA_TARGET_AMX void configure(int64_t m, int64_t qk) {
    if (m == rows && qk == qk_rows) return;
    struct alignas(64) {
      uint8_t palette_id, start_row, reserved[14];
      uint16_t colsb[16];
      uint8_t rows[16];
    } config = {};
    config.palette_id = 1;
    for (int t = 0; t < 7; ++t) {
      config.colsb[t] = 64;
      config.rows[t] = static_cast<uint8_t>(t == 3 || t == 5 || t == 6 ? m : t <= 1 ? qk : 16);
    }
    // NOTE: not _tile_loadconfig: GCC 12's tells the compiler that it reads 8 bytes of the configuration, so the
    // stores of the rest may be dropped or moved past it (then a later tile instruction raises #UD).
    asm volatile("ldtilecfg %0" ::"m"(config));
    rows = m, qk_rows = qk;
  }
  ~AmxTiles() {  // not compiled for AMX: it also runs (and does nothing) on CPUs without it
    if (rows != 0) release();
  }
  PA_TARGET_AMX static void release() { _tile_release(); }
};

// r[i] (16 dwords each) becomes column i: r[j] element i = old r[i] element j.
PA_TARGET_AMX inline void transpose_16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + j], 128-bit lane L: rows 4i..4i+3 of column 4L + j
    r[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i x0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88), x1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xDD);
    const __m512i y0 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88);
    const __m512i y1 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xDD);
    t[j] = _mm512_shuffle_i32x4(x0, y0, 0x88), t[8 + j] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    t[4 + j] = _mm512_shuffle_i32x4(x1, y1, 0x88), t[12 + j] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// key_t and value_b (see the top) for the tile's rows of kv head `kv_head`, with the prefetcher's 2 x 16 steps.
template <typename cache_t>
PA_TARGET_AMX void layout_tile_amx(const AttentionParams<at::BFloat16, cache_t>& params, int64_t kv_head,
                                   const Tile<cache_t>& tile, uint32_t* key_t, uint32_t* value_b,
                                   Prefetcher<cache_t>& prefetcher) {
  const Bf16Decoder decoder = bf16_decoder<cache_t>();
  const int64_t head_dim = params.head_dim, n = tile.num_tokens;
  const int64_t key_offset = kv_head * params.kv.key.head_stride;
  const int64_t value_offset = kv_head * params.kv.value.head_stride;
  for (int64_t c = 0; c < head_dim / kBf16Vec; ++c) {
    __m512i r[16];  // the padding rows repeat the last token's: their logits are masked
    for (int i = 0; i < 16; ++i) {
      r[i] = load_bf16x32(tile.keys[i] + key_offset + c * kBf16Vec, decoder);
      if (c == 0) {
        prefetcher.step();
        if (i < n) prefetcher.keys(i);
      }
    }
    transpose_16x16(r);
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(key_t + (c * 16 + i) * 16, r[i]);
  }
  for (int64_t c = 0; c < head_dim / kBf16Vec; ++c) {
    uint32_t* lo_rows = value_b + (2 * c) * 256;
    uint32_t* hi_rows = value_b + (2 * c + 1) * 256;
    for (int64_t r = 0; r < 8; ++r) {
      if (c == 0) {
        prefetcher.step(), prefetcher.step();
        if (2 * r < n) prefetcher.values(2 * r);
        if (2 * r + 1 < n) prefetcher.values(2 * r + 1);
      }
      __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
      if (2 * r < n) {
        const __m512i a = load_bf16x32(tile.values[2 * r] + value_offset + c * kBf16Vec, decoder);
        const __m512i b = 2 * r + 1 < n
                              ? load_bf16x32(tile.values[2 * r + 1] + value_offset + c * kBf16Vec, decoder)
                              : _mm512_setzero_si512();
        lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
      }
      _mm512_storeu_si512(lo_rows + r * 16, lo), _mm512_storeu_si512(lo_rows + (r + 8) * 16, lo);
      _mm512_storeu_si512(hi_rows + r * 16, hi), _mm512_storeu_si512(hi_rows + (r + 8) * 16, hi);
    }
  }
}

// Steps 1-3 of kv head `kv_head` over one tile for the rows rows[0..n) (last_tokens[i], scs[i]); e = i * group + j
// numbers the (row, head of the head group) pairs. queries: [pad16(n * group), head_dim] bf16, entry e's query
// (rows past n * group zero); logits: [pad16(n * group), 16] floats; p_pairs: [n * group, 16] dwords; layout:
// [head_dim * 24] dwords (key_t, value_b).
//   1. S for up to 16 entries at a time (the rows' heads stacked: more heads per product where rows share a tile);
//   2. each entry's softmax into its row's state;
//   3. per 32 elements of acc, value_b loaded once, each row's heads (up to 16 at a time) against it.
template <typename cache_t>
PA_TARGET_AMX void attend_tile_amx(const AttentionParams<at::BFloat16, cache_t>& params, int64_t kv_head,
                                   const Tile<cache_t>& tile, int64_t n, const at::BFloat16* queries,
                                   const int64_t* last_tokens, Scratch* const* scs, uint32_t* layout, float* logits,
                                   uint32_t* p_pairs, AmxTiles& tiles, Prefetcher<cache_t>& prefetcher) {
  const int64_t head_dim = params.head_dim, group = params.group_size, entries = n * group;
  const int64_t vectors = head_dim / kBf16Vec;
  uint32_t* key_t = layout;
  uint32_t* value_b = layout + vectors * 256;
  layout_tile_amx(params, kv_head, tile, key_t, value_b, prefetcher);
  // 1. (qk: the rows of S and Q; the last product's rows past `entries` are zeros)
  const int64_t qk = std::min(kAmxRows, entries);
  tiles.configure(std::min(kAmxRows, group), qk);
  for (int64_t e0 = 0; e0 < entries; e0 += kAmxRows) {
    _tile_zero(0);
    for (int64_t c = 0; c < vectors; ++c) {
      _tile_loadd(1, queries + e0 * head_dim + c * kBf16Vec, head_dim * 2);
      _tile_loadd(2, key_t + c * 256, 64);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, logits + e0 * kTileTokens, 64);
  }
  // 2.
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < group; ++j) {
      float* x = logits + (i * group + j) * kTileTokens;
      softmax_head_avx512(params, kv_head * group + j, tile, last_tokens[i],
                          _mm512_mul_ps(_mm512_loadu_ps(x), _mm512_set1_ps(params.scale)), x, *scs[i],
                          p_pairs + (i * group + j) * kTileTokens);
    }
  }
  // 3. Two pieces of 16 elements at a time (B in registers 4, 2; acc in 5, 6): independent products overlap.
  const int64_t pieces = head_dim / 16;
  for (int64_t first = 0; first < group; first += kAmxRows) {
    tiles.configure(std::min(kAmxRows, group - first), qk);
    for (int64_t b = 0; b < pieces; b += 2) {  // head_dim % 32 == 0: whole pairs
      _tile_loadd(4, value_b + b * 256, 64);
      _tile_loadd(2, value_b + (b + 1) * 256, 64);
      for (int64_t i = 0; i < n; ++i) {
        float* acc = scs[i]->acc + (kv_head * group + first) * head_dim + b * 16;
        const int64_t stride = head_dim * 4;
        _tile_loadd(3, p_pairs + (i * group + first) * kTileTokens, 64);
        _tile_loadd(5, acc, stride);
        _tile_loadd(6, acc + 16, stride);
        _tile_dpbf16ps(5, 3, 4);
        _tile_dpbf16ps(6, 3, 2);
        _tile_stored(5, acc, stride);
        _tile_stored(6, acc + 16, stride);
      }
    }
  }
}
#else
inline bool use_amx() { return false; }
#endif

}  // namespace
}  // namespace paged_attn
