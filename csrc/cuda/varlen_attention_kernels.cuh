// Paged attention for sequences with several query rows (prefills, prefill chunks after a cached prefix), on tensor
// cores: FlashAttention-2's algorithm over the paged cache, on mma.sync m16n8k16 and ldmatrix (mma.cuh, whose
// opening comment gives the fragment layouts) with cp.async copies (cp_async.cuh). The parameters are the decode
// kernels' (AttentionParams, attention_params.cuh); the launch comes from plan_varlen_attention (launch_plan.h).
//
// Math, as in attention_kernels.cuh: the i-th of the q_s query rows of sequence s (length L) sits at position
// P = L - q_s + i and attends causally to tokens t in [max(0, P + 1 - sliding_window), P]: logit
// x = scale * (q . k_t), then soft cap, then + slope[h] * (t - P); softmax and the weighted sum of V in float32.
//
// Who serves which query row (the launcher, csrc/cuda/attention.cpp, launches both kernels on the same stream):
//   - sequences with one query row: the decode kernel (rows = kSingleTokenSeqs), split-KV and all, so a decode row
//     gets the same bits with or without query_start_loc;
//   - sequences with two or more: this kernel; its thread blocks of other sequences return at once.
//   Neither reads query_start_loc on the host: no synchronization, and the launches can be captured in a CUDA graph.
//
// Grid (plan.grid): (num_tokens / tokens_per_tile + num_seqs, num_kv_heads * blocks_per_group), kVarlenThreads
// threads. A thread block serves one query tile: kVarlenRows = 64 rows of (query token, query head) pairs,
// token-major, of tokens_per_tile consecutive query tokens of one sequence and heads_per_tile query heads of one kv
// head's head group (y: kv head and its thread block; groups larger than 64 heads are split among blocks_per_group
// thread blocks). The group's heads share the K/V tiles. Sequence s owns the grid.x range starting at
// qsl[s] / tokens_per_tile + s (enough tiles for its rows, at most one more: launch_plan.h); a block finds its
// sequence by binary search over query_start_loc. The range is walked backwards, so that the tiles with the most
// keys (the last rows of long sequences) start first.
//
// Q (64 rows, zeros where there is no row) is copied into shared memory once; warp w owns rows 16w .. 16w + 15.
// The keys some row of the tile sees, [key_begin, key_end), are walked in steps of N = varlen_key_tile keys (64;
// 16 at head dim 256). Per step (VarlenBlock::step, each numbered part a member function of VarlenBlock), with two
// stages of K and V in shared memory:
//   0. offsets  threads 0 .. N - 1 compute the next step's K and V row offsets (one block-table load per key, no
//               division per row) into shared memory (FlashInfer's kv_offset_smem); the copies read them there.
//   1. K        wait for this step's K; barrier; the next step's K rows start copying into the other stage
//               (cp.async, 16 bytes a copy, zero-filled past key_end), in flight during all of this step.
//   2. logits   S = Q K^T (16 x N per warp) on tensor cores: Q by ldmatrix, K by ldmatrix (its rows are the B
//               operand's columns); S stays in registers: lane (g, t) = (lane / 4, lane % 4) holds rows g and
//               g + 8, columns 8j + 2t and 8j + 2t + 1 of each 8-key tile j.
//   3. softmax  scale, soft cap, ALiBi (and in masked steps, below, the causal/window mask) per element; each row's
//               max over its quad (2 shuffles), the running max and sum (FlashAttention-2's online softmax) in the
//               quad's registers; O rescaled; P = exp(x - max) rounded to the input type as FlashAttention-2 does.
//   4. V        wait for this step's V; barrier; the next step's V rows start copying into the other stage (so V
//               of this step and K and V of the next are in flight while P V and the next logits run).
//   5. values   O += P V (16 x head_dim per warp, float32 accumulators in registers): P's A fragments are S's
//               accumulator registers, packed in pairs (the layouts line up), V by ldmatrix.trans.
// A step is "masked" when some row of the tile does not see some of its keys (the causal diagonal, the window's
// start, keys past key_end); the others, where every row sees every key, skip the mask. Masked steps run first,
// in their own loop, then the unmasked ones: the loop that does most of the work has no masking code.
// Masked logits are replaced by -inf (a select: a NaN or inf key's logit must not survive the mask), so a key's
// NaN or inf reaches exactly the rows that see it, as in the reference. A NaN or inf value is harder: a masked
// p = 0 times it is NaN in P V. So masked steps look for them in V (each thread in the rows it copied); only where
// there is one (never in a sane cache: no cost otherwise, and none in unmasked steps, where every row sees every
// value), the values as they are move to the free K stage, P V takes 0 in their place, and each lane adds p v for
// those values among the keys its rows see (P from shared memory, exactly as the product used it).
// Then out = O / l (row_sum of attention_math.cuh: with the row's sink; and row_lse) is written from the
// accumulators: lane (g, t) writes rows g and g + 8, elements 8j + 2t, + 1.
//
// fp8 caches (AttentionParams<T, Fp8>): the stored bytes are copied (cp.async) into two stages of their own, and
// each thread converts the rows it copied (exactly: every fp8 value is a half and a bfloat16) into one K and one V
// tile of T, after its wait and before the barrier; k_scale multiplies the logits with the softmax scale
// (q . (k_scale k) = k_scale (q . k)) and v_scale the output with 1 / l.
//
// Shared memory (varlen_smem in launch_plan.h; 87.5 KiB at head dim 128, 67 KiB at 256, 47.5 KiB at 64): Q, four
// K/V tiles, the key rows of two steps, each row's position and slope: two thread blocks or more per SM.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attention_math.cuh"
#include "attention_params.cuh"
#include "cp_async.cuh"
#include "device.cuh"
#include "launch_plan.h"
#include "mma.cuh"
#include "paged_cache.cuh"

namespace paged_attn {

// ---------------------------------------------------------------------------------------------------------------
// What one thread block works on.

struct VarlenTile {
  bool active;             // false: no rows here (past the sequence's rows, or a sequence of fewer than 2 rows)
  int seq, kv_head;
  int first_head, heads;   // query heads [first_head, first_head + heads)
  int first_row, tokens;   // query rows [first_row, first_row + tokens) of the sequence
  int first_pos;           // the position of row first_row (< 0 only with an invalid query_start_loc)
  int key_begin, key_end;  // the keys some row of the tile sees
};

template <typename T, typename C>
__device__ __forceinline__ int clamped_query_start(const AttentionParams<T, C>& p, int seq) {
  return min(max(p.query_start_loc[seq], 0), p.num_tokens);
}

template <typename T, typename C>
__device__ __forceinline__ VarlenTile varlen_tile(const AttentionParams<T, C>& p) {
  VarlenTile tile{};
  const int tokens_per_tile = p.tokens_per_tile;
  const int x = static_cast<int>(gridDim.x - 1 - blockIdx.x);
  // The sequence: the last s whose first tile, qsl[s] / tokens_per_tile + s, is at or before x.
  int lo = 0, hi = p.num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (clamped_query_start(p, mid) / tokens_per_tile + mid <= x) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int seq = lo;
  const QueryRange range = query_range(p, seq);
  const int first_token = (x - (range.first / tokens_per_tile + seq)) * tokens_per_tile;
  tile.active = range.count() >= 2 && first_token >= 0 && first_token < range.count();
  if (!tile.active) return tile;
  tile.seq = seq;
  const BlockHeads heads = block_heads(p);
  tile.kv_head = heads.kv_head, tile.first_head = heads.first_head, tile.heads = heads.num_heads;
  tile.first_row = range.first + first_token;
  tile.tokens = min(tokens_per_tile, range.count() - first_token);
  tile.first_pos = clamped_seq_len(p, seq) - range.count() + first_token;
  tile.key_end = max(tile.first_pos + tile.tokens, 0);  // <= the clamped length: never past the block table
  tile.key_begin = p.sliding_window > 0 ? max(tile.first_pos + 1 - p.sliding_window, 0) : 0;
  return tile;
}

// Two values of T (half or bfloat16) with each inf or NaN (exponent bits all ones) replaced by +0; nonfinite is
// set when there was one.
template <typename T>
__device__ __forceinline__ uint32_t zero_nonfinite(uint32_t pair, bool& nonfinite) {
  constexpr uint32_t kExponent = std::is_same_v<T, __half> ? 0x7C00u : 0x7F80u;
  uint32_t keep = 0xFFFFFFFFu;
  if ((pair & kExponent) == kExponent) keep &= 0xFFFF0000u;
  if ((pair & (kExponent << 16)) == (kExponent << 16)) keep &= 0x0000FFFFu;
  nonfinite |= keep != 0xFFFFFFFFu;
  return pair & keep;
}
// The same for a 16-byte vector of 8 values.
template <typename T>
__device__ __forceinline__ uint4 zero_nonfinite(uint4 x, bool& nonfinite) {
  x.x = zero_nonfinite<T>(x.x, nonfinite), x.y = zero_nonfinite<T>(x.y, nonfinite);
  x.z = zero_nonfinite<T>(x.z, nonfinite), x.w = zero_nonfinite<T>(x.w, nonfinite);
  return x;
}

// A 16-byte vector of cache elements C, stored at dst (16-byte aligned shared memory) as values of T: as it is
// (C = T), or its 16 fp8 values converted (exactly) into 32 bytes. Returns whether a value is an inf or NaN.
template <typename T, typename C>
__device__ __forceinline__ bool store_cache_vec(T* dst, const uint4& v, __nv_fp8_interpretation_t format) {
  bool nonfinite = false;
  const auto store = [&](int i, const uint4& x) {
    (void)zero_nonfinite<T>(x, nonfinite);  // (only the test: the stores are as they are)
    reinterpret_cast<uint4*>(dst)[i] = x;
  };
  if constexpr (std::is_same_v<C, T>) {
    store(0, v);
  } else {
    float f[16];
    fp8_to_floats(v, f, format);
    uint4 halves[2];
    T* const values = reinterpret_cast<T*>(halves);
#pragma unroll
    for (int e = 0; e < 16; ++e) from_float(values[e], f[e]);
    store(0, halves[0]);
    store(1, halves[1]);
  }
  return nonfinite;
}

// ---------------------------------------------------------------------------------------------------------------
// The kernel.

// The kernel's compile-time shape.
template <typename T, typename C, int HEAD_DIM>
struct VarlenShape {
  static constexpr int N = varlen_key_tile(HEAD_DIM);     // keys per step
  static constexpr VarlenSmem kSmem = varlen_smem(HEAD_DIM, sizeof(T));
  static constexpr int ROW = static_cast<int>(kSmem.row);  // elements per row of Q, K and V in shared memory
  static constexpr int TILE = N * ROW;                     // elements of one K or V tile
  static constexpr bool kFp8 = !std::is_same_v<C, T>;
  static constexpr int KSTEPS = HEAD_DIM / 16;             // k steps of S = Q K^T (16 dims each)
  static constexpr int NTILES = N / 8;                     // 8-key tiles of S
  static constexpr int DTILES = HEAD_DIM / 8;              // 8-dim tiles of O
  static constexpr int VEC = 16 / static_cast<int>(sizeof(C));  // cache elements per copy (16 bytes)
  static constexpr int ROW_VECS = HEAD_DIM / VEC;          // copies per row
  static constexpr int COPIES = N * ROW_VECS;              // copies per cache and step
  static constexpr int PER_THREAD = (COPIES + kVarlenThreads - 1) / kVarlenThreads;
  // Which copies a thread makes. Paired (where the sizes allow): the row's first ROW_VECS / 2 threads each copy
  // vector k and k + ROW_VECS / 2 of it, so a warp's copy instruction reads whole 32-byte sectors and a thread
  // loads one row address per two copies; else copy c is vector tid + kVarlenThreads c of the N rows.
  static constexpr int HALF = ROW_VECS / 2, PASS_ROWS = HALF > 0 ? kVarlenThreads / HALF : 0;
  static constexpr bool kPaired = ROW_VECS % 2 == 0 && kVarlenThreads % HALF == 0 && N % PASS_ROWS == 0 &&
                                  COPIES % kVarlenThreads == 0;
  struct Copy {
    int row, element;  // row j of the N, elements [element, element + VEC)
    bool exists;
  };
  static __device__ __forceinline__ Copy copy(int tid, int c) {
    if constexpr (kPaired) {
      return {tid / HALF + (c / 2) * PASS_ROWS, VEC * (tid % HALF + (c % 2) * HALF), true};
    } else {
      const int i = tid + kVarlenThreads * c;
      return {i / ROW_VECS, VEC * (i % ROW_VECS), COPIES % kVarlenThreads == 0 || i < COPIES};
    }
  }
  static_assert(HEAD_DIM % 16 == 0 && N % 16 == 0 && kVarlenRows == 16 * (kVarlenThreads / 32), "the mma tiles");
  static_assert(HEAD_DIM % VEC == 0 && ROW >= kVarlenRows, "whole copies; P (64 x N) fits a tile");
  static_assert(!kFp8 || 4 * N * HEAD_DIM <= 2 * TILE * static_cast<int>(sizeof(T)), "the stored bytes' stages");
};

// A key's K and V rows (of the tile's kv head) in the caches; nullptr past key_end.
template <typename C>
struct alignas(16) KeyRows {
  const C* key;
  const C* value;
};

// One thread block's query tile, as the steps see it: the tile, its shared memory, its keys' rows in the caches, and
// this lane's rows (g and g + 8 of its warp's 16: positions, slopes, running max and sum, O). The softmax runs in
// base 2: run_max is the max of logit * log2(e), p = 2^(logit * log2(e) - run_max) = exp(logit - max).
template <typename T, typename C, int HEAD_DIM>  // C: the cache's element type (T, or Fp8)
struct VarlenBlock {
  using S = VarlenShape<T, C, HEAD_DIM>;
  static constexpr int N = S::N, ROW = S::ROW;
  static constexpr float kLog2e = 1.4426950408889634f;

  const AttentionParams<T, C>& p;
  const VarlenTile& tile;
  const int tid, warp, lane, g, t;
  const int W;  // the sliding window (0: none)
  // Shared memory (varlen_smem): Q, the K/V tiles, the key rows of two steps, each row's position and slope.
  T* const q_s;                // [kVarlenRows][ROW]
  T* const tiles;              // 4 x [N][ROW]
  KeyRows<C>* const rows_s;    // [2][N]
  int* const row_pos_s;        // [kVarlenRows]; -1: no row
  float* const row_slope_s;    // [kVarlenRows]
  // The keys' rows (step 0): the tile's kv head's rows of token 0 of block 0, and the strides as unsigned (block
  // entries are >= 0).
  const int32_t* const block_table;
  const int block_size, block_shift;  // 8, 16 or 32 (plan_varlen_attention)
  const C* const key_head;
  const C* const value_head;
  const uint64_t key_block_stride, key_token_stride, value_block_stride, value_token_stride;
  // This lane's rows.
  int pos[2];
  float slope[2], run_max[2] = {-INFINITY, -INFINITY}, run_sum[2] = {0.0f, 0.0f};
  float o[S::DTILES][4];  // O: tile jd, (row g, dims 8 jd + 2t, + 1), (row g + 8, the same dims)
  const float inv_soft_cap, logit_scale, logit_scale2;
  // ldmatrix row addresses (lane l passes row l % 8 of matrix l / 8; mma.cuh):
  //   Q (A, 16 x 16 at rows 16 w, dims 16 kk):  matrix m = (rows 8 (m & 1) .., dims 8 (m >> 1) ..);
  //   K (B of two 8-key tiles, 16 dims):         matrix m = (keys 8 (m >> 1) .., dims 8 (m & 1) ..);
  //   V (B of two 8-dim tiles, 16 keys, .trans): matrix m = (keys 8 (m & 1) .., dims 8 (m >> 1) ..).
  const int q_lds, k_lds, v_lds;

  __device__ __forceinline__ VarlenBlock(const AttentionParams<T, C>& p_, const VarlenTile& tile_, char* smem)
      : p(p_),
        tile(tile_),
        tid(threadIdx.x),
        warp(tid / 32),
        lane(tid % 32),
        g(lane / 4),
        t(lane % 4),
        W(p_.sliding_window),
        q_s(reinterpret_cast<T*>(smem + S::kSmem.q)),
        tiles(reinterpret_cast<T*>(smem + S::kSmem.tiles)),
        rows_s(reinterpret_cast<KeyRows<C>*>(smem + S::kSmem.offsets)),
        row_pos_s(reinterpret_cast<int*>(smem + S::kSmem.row_pos)),
        row_slope_s(reinterpret_cast<float*>(smem + S::kSmem.row_slope)),
        block_table(p_.block_tables + static_cast<int64_t>(tile_.seq) * p_.max_blocks_per_seq),
        block_size(p_.key_cache.block_size),
        block_shift(block_size == 8 ? 3 : block_size == 16 ? 4 : 5),
        key_head(p_.key_cache.data + tile_.kv_head * p_.key_cache.head_stride),
        value_head(p_.value_cache.data + tile_.kv_head * p_.value_cache.head_stride),
        key_block_stride(p_.key_cache.block_stride),
        key_token_stride(p_.key_cache.token_stride),
        value_block_stride(p_.value_cache.block_stride),
        value_token_stride(p_.value_cache.token_stride),
        inv_soft_cap(p_.logits_soft_cap > 0.0f ? 1.0f / p_.logits_soft_cap : 0.0f),
        logit_scale(p_.k_scale != nullptr ? p_.scale * *p_.k_scale : p_.scale),
        logit_scale2(logit_scale * kLog2e),
        q_lds((warp * 16 + lane % 8 + 8 * ((lane / 8) & 1)) * ROW + 8 * (lane / 16)),
        k_lds((lane % 8 + 8 * (lane / 16)) * ROW + 8 * ((lane / 8) & 1)),
        v_lds((lane % 8 + 8 * ((lane / 8) & 1)) * ROW + 8 * (lane / 16)) {
#pragma unroll
    for (int jd = 0; jd < S::DTILES; ++jd) o[jd][0] = o[jd][1] = o[jd][2] = o[jd][3] = 0.0f;
  }

  // Stage s's K and V tiles (T = C: K stages 0, 1, V stages 0, 1; fp8: one K and one V tile of T), and for fp8 the
  // stored bytes' stages (K [N][HEAD_DIM], then V).
  __device__ __forceinline__ T* k_tile(int stage) const { return tiles + (S::kFp8 ? 0 : stage) * S::TILE; }
  __device__ __forceinline__ T* v_tile(int stage) const { return tiles + (S::kFp8 ? 1 : 2 + stage) * S::TILE; }
  __device__ __forceinline__ C* stored(int stage) const {
    return reinterpret_cast<C*>(tiles + 2 * S::TILE) + stage * 2 * N * HEAD_DIM;
  }
  // Row r of the tile (token-major (token, head) pairs) exists; a row at row_pos sees key.
  __device__ __forceinline__ bool has_row(int r) const {
    return r / p.heads_per_block < tile.tokens && r % p.heads_per_block < tile.heads;
  }
  __device__ __forceinline__ bool sees(int row_pos, int key) const {
    return key <= row_pos && (W == 0 || key > row_pos - W);
  }

  // The tile's rows into shared memory: positions, slopes, queries (zeros where there is no row).
  __device__ __forceinline__ void load_rows() {
    for (int r = tid; r < kVarlenRows; r += kVarlenThreads) {
      const bool row = has_row(r);
      row_pos_s[r] = row ? tile.first_pos + r / p.heads_per_block : -1;  // -1 sees no key
      row_slope_s[r] = row && p.alibi_slopes != nullptr ? p.alibi_slopes[tile.first_head + r % p.heads_per_block]
                                                        : 0.f;
    }
    for (int i = tid; i < kVarlenRows * HEAD_DIM; i += kVarlenThreads) {
      const int r = i / HEAD_DIM, d = i % HEAD_DIM;
      T x;
      from_float(x, 0.0f);
      if (has_row(r)) {
        const int64_t row = tile.first_row + r / p.heads_per_block;
        x = p.query[row * p.query_row_stride + (tile.first_head + r % p.heads_per_block) * p.query_head_stride + d];
      }
      q_s[r * ROW + d] = x;
    }
  }
  // This lane's rows' positions and slopes (after the barrier that follows load_rows).
  __device__ __forceinline__ void load_lane_rows() {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      pos[r] = row_pos_s[warp * 16 + g + 8 * r], slope[r] = row_slope_s[warp * 16 + g + 8 * r];
    }
  }

  // Step 0: the K and V rows of step `step`'s keys into slot `slot` (threads 0 .. N - 1, a key each).
  __device__ __forceinline__ void fill_rows(int slot, int step) {
    if (tid < N) {
      const int key = tile.key_begin + step * N + tid;
      KeyRows<C> rows{nullptr, nullptr};
      if (key < tile.key_end) {
        const uint32_t block = static_cast<uint32_t>(block_table[key >> block_shift]);
        const uint32_t offset = static_cast<uint32_t>(key & (block_size - 1));
        rows.key = key_head + block * key_block_stride + offset * key_token_stride;
        rows.value = value_head + block * value_block_stride + offset * value_token_stride;
      }
      rows_s[slot * N + tid] = rows;
    }
  }

  // Steps 1 and 4: this thread's copies of the keys' K (keys) or V rows of slot `slot` start (cp.async). FULL:
  // every key of the step is before key_end (the unmasked steps'), so no copy needs the zero fill. The rows'
  // addresses are loaded first, then the copies start back to back (ptxas pads each run of LDGSTS that follows
  // another shared-memory access with three no-ops).
  template <bool FULL>
  __device__ __forceinline__ void copy_rows(bool keys, int slot) {
    const KeyRows<C>* const rows = rows_s + slot * N;
    char* const tile_base = S::kFp8 ? reinterpret_cast<char*>(stored(slot) + (keys ? 0 : N * HEAD_DIM))
                                    : reinterpret_cast<char*>(keys ? k_tile(slot) : v_tile(slot));
    const C* src[S::PER_THREAD];
    int dst[S::PER_THREAD];  // bytes from tile_base
#pragma unroll
    for (int c = 0; c < S::PER_THREAD; ++c) {
      const typename S::Copy copy = S::copy(tid, c);
      const C* const row = copy.exists ? (keys ? rows[copy.row].key : rows[copy.row].value) : nullptr;
      if constexpr (FULL) {
        src[c] = row + copy.element;  // (not null)
      } else {
        src[c] = row != nullptr ? row + copy.element : nullptr;
      }
      dst[c] = S::kFp8 ? copy.row * HEAD_DIM + copy.element
                      : (copy.row * ROW + copy.element) * static_cast<int>(sizeof(T));
    }
#pragma unroll
    for (int c = 0; c < S::PER_THREAD; ++c) {
      if (S::copy(tid, c).exists) {
        if constexpr (FULL) {
          cp_async_16(tile_base + dst[c], src[c]);
        } else {
          cp_async_16(tile_base + dst[c], src[c] != nullptr ? src[c] : p.key_cache.data, src[c] != nullptr);
        }
      }
    }
  }

  // fp8: this thread's copies of stage `slot` converted into the K or V tile; whether one is an inf or NaN.
  // T = C: whether one of this thread's copies in the V tile is an inf or NaN.
  __device__ __forceinline__ bool own_rows(bool keys, int slot) {
    bool nonfinite = false;
#pragma unroll
    for (int c = 0; c < S::PER_THREAD; ++c) {
      const typename S::Copy copy = S::copy(tid, c);
      if (copy.exists) {
        T* const row = (keys ? k_tile(slot) : v_tile(slot)) + copy.row * ROW + copy.element;
        if constexpr (S::kFp8) {
          const C* const src = stored(slot) + (keys ? 0 : N * HEAD_DIM) + copy.row * HEAD_DIM + copy.element;
          nonfinite |= store_cache_vec<T, C>(row, *reinterpret_cast<const uint4*>(src), p.fp8_format);
        } else {
          (void)zero_nonfinite<T>(*reinterpret_cast<const uint4*>(row), nonfinite);
        }
      }
    }
    return nonfinite;
  }

  // Step 2: S = Q K^T (16 x N per warp) from K tile k_s.
  __device__ __forceinline__ void logits(float (&x)[S::NTILES][4], const T* k_s) const {
#pragma unroll
    for (int j = 0; j < S::NTILES; ++j) x[j][0] = x[j][1] = x[j][2] = x[j][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < S::KSTEPS; ++kk) {
      uint32_t a[4];
      ldmatrix_x4(a, q_s + q_lds + 16 * kk);
#pragma unroll
      for (int j = 0; j < S::NTILES; j += 2) {
        uint32_t b[4];
        ldmatrix_x4(b, k_s + j * 8 * ROW + k_lds + 16 * kk);
        const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        mma_m16n8k16<T>(x[j], a, b0, x[j]);
        mma_m16n8k16<T>(x[j + 1], a, b1, x[j + 1]);
      }
    }
  }

  // Step 3: softmax: element (j, e) is row g + 8 (e >> 1), key key0 + 8j + 2t + (e & 1); x becomes logit * log2(e)
  // (FEATURES or MASKED), or stays q . k (plain: the max is taken on it, then scaled); then P, rounded to T (the A
  // fragments of P V, two 8-key tiles each), and O rescaled.
  template <bool MASKED, bool FEATURES>
  __device__ __forceinline__ void softmax(float (&x)[S::NTILES][4], uint32_t (&prob)[S::NTILES][2], int key0) {
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < S::NTILES; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1, key = key0 + 8 * j + 2 * t + (e & 1);
        if constexpr (MASKED || FEATURES) {
          float logit = x[j][e] * logit_scale;
          if (p.logits_soft_cap > 0.0f) logit = p.logits_soft_cap * fast_tanh(logit * inv_soft_cap);
          if (p.alibi_slopes != nullptr) logit += slope[r] * static_cast<float>(key - pos[r]);
          logit *= kLog2e;
          if constexpr (MASKED) logit = sees(pos[r], key) ? logit : -INFINITY;  // a select, not a branch
          x[j][e] = logit;
        }
        tile_max[r] = fmaxf(tile_max[r], x[j][e]);
      }
    }
    float rescale[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
      if constexpr (!MASKED && !FEATURES) tile_max[r] *= logit_scale2;
      const float new_max = fmaxf(run_max[r], tile_max[r]);
      const float base = new_max == -INFINITY ? 0.0f : new_max;  // a row that has seen no key yet: all p = 0
      rescale[r] = fast_exp2(run_max[r] - base);                 // 0 on the row's first keys
      run_max[r] = new_max;
      run_sum[r] *= rescale[r];
#pragma unroll
      for (int j = 0; j < S::NTILES; ++j) {
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e) {
          if constexpr (MASKED || FEATURES) {
            x[j][e] = fast_exp2(x[j][e] - base);
          } else {
            x[j][e] = fast_exp2(fmaf(x[j][e], logit_scale2, -base));
          }
        }
        run_sum[r] += x[j][2 * r] + x[j][2 * r + 1];  // this lane's part (the quad's added at the end)
      }
    }
#pragma unroll
    for (int jd = 0; jd < S::DTILES; ++jd) {
      o[jd][0] *= rescale[0], o[jd][1] *= rescale[0], o[jd][2] *= rescale[1], o[jd][3] *= rescale[1];
    }
#pragma unroll
    for (int j = 0; j < S::NTILES; ++j) {
      prob[j][0] = pack2<T>(x[j][0], x[j][1]), prob[j][1] = pack2<T>(x[j][2], x[j][3]);
    }
  }

  // Step 5a (masked steps whose V holds an inf or NaN): the values as they are go to values_s (this step's K tile,
  // free: every warp is done with it), V keeps them with each inf or NaN replaced by 0, and P goes to p_s for 5b.
  __device__ __forceinline__ void set_aside_nonfinite_values(T* v_s, T* values_s, T* p_s,
                                                             const uint32_t (&prob)[S::NTILES][2]) {
    for (int i = tid; i < N * (HEAD_DIM / 8); i += kVarlenThreads) {
      const int j = i / (HEAD_DIM / 8), e = 8 * (i % (HEAD_DIM / 8));
      uint4* const value = reinterpret_cast<uint4*>(v_s + j * ROW + e);
      const uint4 stored_value = *value;
      *reinterpret_cast<uint4*>(values_s + j * ROW + e) = stored_value;
      bool unused = false;
      *value = zero_nonfinite<T>(stored_value, unused);
    }
#pragma unroll
    for (int j = 0; j < S::NTILES; ++j) {
      *reinterpret_cast<uint32_t*>(p_s + g * N + 8 * j + 2 * t) = prob[j][0];
      *reinterpret_cast<uint32_t*>(p_s + (g + 8) * N + 8 * j + 2 * t) = prob[j][1];
    }
    __syncthreads();
  }

  // Step 5: O += P V: the A fragment of keys 16 kk .. 16 kk + 15 is P's tiles 2 kk and 2 kk + 1.
  __device__ __forceinline__ void values(const uint32_t (&prob)[S::NTILES][2], const T* v_s) {
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk) {
      const uint32_t a[4] = {prob[2 * kk][0], prob[2 * kk][1], prob[2 * kk + 1][0], prob[2 * kk + 1][1]};
#pragma unroll
      for (int jd = 0; jd < S::DTILES; jd += 2) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, v_s + kk * 16 * ROW + v_lds + 8 * jd);
        const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        mma_m16n8k16<T>(o[jd], a, b0, o[jd]);
        mma_m16n8k16<T>(o[jd + 1], a, b1, o[jd + 1]);
      }
    }
  }

  // Step 5b: O += p v for the inf and NaN values each row sees (p as P V used it, from p_s).
  __device__ __forceinline__ void add_nonfinite_values(const T* values_s, const T* p_s, int key0) {
#pragma unroll 1
    for (int c = 0; c < N; ++c) {
      const int key = key0 + c;
      const bool see0 = sees(pos[0], key), see1 = sees(pos[1], key);
      const float p0 = to_float(p_s[g * N + c]), p1 = to_float(p_s[(g + 8) * N + c]);
#pragma unroll
      for (int jd = 0; jd < S::DTILES; ++jd) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float v = to_float(values_s[c * ROW + 8 * jd + 2 * t + e]);
          if (!(fabsf(v) < INFINITY)) {
            if (see0) o[jd][e] += p0 * v;
            if (see1) o[jd][2 + e] += p1 * v;
          }
        }
      }
    }
    __syncthreads();  // every warp is done with P and the values before the next copies overwrite them
  }

  // One step: keys [key_begin + N i, + N) from stage `slot`; `next` (-1: none) is copied into stage slot ^ 1.
  // MASKED: the causal/window mask and the inf/NaN values (and `next` may need the zero fill); FEATURES: soft cap,
  // ALiBi, any scale (else `plain`).
  template <bool MASKED, bool FEATURES>
  __device__ __forceinline__ void step(int i, int next, int slot) {
    constexpr bool FULL = !MASKED;  // every key of `next` is before key_end
    const int key0 = tile.key_begin + i * N;
    // 0. the next step's rows (read by its copies, after the barrier below)
    if (next >= 0) fill_rows(slot ^ 1, next);
    // 1. this step's K is here (its V may not be); the next step's K starts copying
    cp_async_wait<1>();
    if constexpr (S::kFp8) (void)own_rows(true, slot);
    __syncthreads();  // K and the rows visible; every warp is done with the previous step
    if (next >= 0) copy_rows<FULL>(true, slot ^ 1);
    cp_async_commit();
    // 2. S = Q K^T; 3. softmax
    const T* const k_s = k_tile(slot);
    float x[S::NTILES][4];
    logits(x, k_s);
    uint32_t prob[S::NTILES][2];
    softmax<MASKED, FEATURES>(x, prob, key0);
    // 4. this step's V is here; the next step's V starts copying (masked steps: after 5)
    cp_async_wait<1>();
    bool fix_values = false;
    if constexpr (S::kFp8) {
      const bool nonfinite = own_rows(false, slot);
      if constexpr (MASKED) fix_values = __syncthreads_or(nonfinite);
    } else if constexpr (MASKED) {
      fix_values = __syncthreads_or(own_rows(false, slot));
    }
    if constexpr (!MASKED) {
      __syncthreads();  // V visible; every warp is done with this step's K
      if (next >= 0) copy_rows<FULL>(false, slot ^ 1);
      cp_async_commit();
    }
    T* const v_s = v_tile(slot);
    // 5a. P to shared memory (T = C: the next V stage, not yet copied into; fp8: this step's stored bytes,
    // converted) and the values as they are to this step's K tile, where V holds an inf or NaN
    T* const p_s = (S::kFp8 ? reinterpret_cast<T*>(stored(slot)) : v_tile(slot ^ 1)) + warp * 16 * N;  // [16][N]
    T* const values_s = const_cast<T*>(k_s);
    if (MASKED && fix_values) set_aside_nonfinite_values(v_s, values_s, p_s, prob);  // uniform
    // 5. O += P V
    values(prob, v_s);
    if constexpr (MASKED) {
      // 5b. O += p v for the inf and NaN values each row sees
      if (fix_values) add_nonfinite_values(values_s, p_s, key0);  // uniform across the thread block
      if (next >= 0) copy_rows<FULL>(false, slot ^ 1);
      cp_async_commit();
    }
  }

  // out = O / l, from the accumulators: rows g and g + 8 of this warp.
  __device__ __forceinline__ void write_out() {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      run_sum[r] += __shfl_xor_sync(0xffffffffu, run_sum[r], 1);
      run_sum[r] += __shfl_xor_sync(0xffffffffu, run_sum[r], 2);
      const int row = warp * 16 + g + 8 * r;
      if (!has_row(row)) continue;
      const float max = run_max[r] * (1.0f / kLog2e);  // back to the natural log's units
      const float v_scale = p.v_scale != nullptr ? *p.v_scale : 1.0f;
      // pos < 0: a row that sees no key (an invalid query_start_loc): 0. Else run_sum >= 1, or NaN (a NaN logit),
      // or 0 when every logit it sees is -inf (0 / 0 = NaN, as the reference).
      const int head = tile.first_head + row % p.heads_per_block;
      const float sink = sink_of(p.sinks, head);
      const float inv_sum = pos[r] >= 0 ? v_scale / row_sum(max, run_sum[r], sink) : 0.0f;
      const int64_t out_row = static_cast<int64_t>(tile.first_row + row / p.heads_per_block) * p.num_heads + head;
      if (t == 0 && p.lse != nullptr) p.lse[out_row] = row_lse(max, run_sum[r], sink);
      T* const out = p.out + out_row * HEAD_DIM;
#pragma unroll
      for (int jd = 0; jd < S::DTILES; ++jd) {
        *reinterpret_cast<uint32_t*>(out + 8 * jd + 2 * t) =
            pack2<T>(o[jd][2 * r] * inv_sum, o[jd][2 * r + 1] * inv_sum);
      }
    }
  }
};

// The kernel: the tile's rows into shared memory, then its key steps (the masked ones, then the unmasked), each
// copying the one after it, then out.
template <typename T, typename C, int HEAD_DIM>  // C: the cache's element type (T, or Fp8)
__global__ void __launch_bounds__(kVarlenThreads, 2) varlen_attention_kernel(const AttentionParams<T, C> p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // mma.sync on bfloat16 and cp.async need sm_80; the launcher takes the decode kernel's path before
#else
  constexpr int N = VarlenShape<T, C, HEAD_DIM>::N;
  const VarlenTile tile = varlen_tile(p);
  if (!tile.active) return;  // uniform across the thread block
  PA_EXTERN_SHARED(uint4, smem_u4);
  VarlenBlock<T, C, HEAD_DIM> b(p, tile, reinterpret_cast<char*>(smem_u4));
  b.load_rows();

  // The steps: i = 0 .. steps - 1 covers keys [key_begin + N i, + N). Unmasked: [lo, hi), where every row of the
  // tile sees every key (key + N - 1 <= first_pos, and with a window key > last_pos - window); masked: the others.
  const int W = p.sliding_window;
  const int steps = (tile.key_end - tile.key_begin + N - 1) / N;
  const int last_pos = tile.first_pos + tile.tokens - 1;
  const int window_room = last_pos - W - tile.key_begin;  // (W > 0) steps i with N i > window_room
  const int causal_room = tile.first_pos - tile.key_begin - N + 1;  // steps i with N i <= causal_room
  const int lo = min(W == 0 || window_room < 0 ? 0 : window_room / N + 1, steps);
  const int hi = max(min(causal_room < 0 ? 0 : causal_room / N + 1, steps), lo);
  // Without soft cap and ALiBi, and with a positive scale, the max of the logits is the scaled max of q . k: the
  // unmasked steps then take one FFMA and one ex2 per logit.
  const bool plain = p.logits_soft_cap == 0.0f && p.alibi_slopes == nullptr && b.logit_scale2 > 0.0f;

  // The prologue: the first step's rows and copies. Then the masked steps ([0, lo), then [hi, steps)), then the
  // unmasked ones; each step copies the one after it.
  const int first_masked = lo > 0 ? 0 : hi;
  const int first = first_masked < steps ? first_masked : lo < hi ? lo : -1;
  if (first >= 0) b.fill_rows(0, first);
  __syncthreads();  // the rows, Q, the rows' positions and slopes
  b.load_lane_rows();
  if (first >= 0) b.template copy_rows<false>(true, 0);
  cp_async_commit();
  if (first >= 0) b.template copy_rows<false>(false, 0);
  cp_async_commit();
  int slot = 0;
  for (int i = first_masked; i < steps; slot ^= 1) {
    const int following = i + 1 == lo ? hi : i + 1;  // the next masked step (steps: none)
    b.template step<true, true>(i, following < steps ? following : lo < hi ? lo : -1, slot);
    i = following;
  }
  if (plain) {  // uniform across the thread block
    for (int i = lo; i < hi; ++i, slot ^= 1) b.template step<false, false>(i, i + 1 < hi ? i + 1 : -1, slot);
  } else {
    for (int i = lo; i < hi; ++i, slot ^= 1) b.template step<false, true>(i, i + 1 < hi ? i + 1 : -1, slot);
  }
  cp_async_wait_all();  // (only empty groups are left)
  b.write_out();
#endif
}

}  // namespace paged_attn
