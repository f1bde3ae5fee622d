// Paged attention for sequences with several query rows (prefills, prefill chunks after a cached prefix), on tensor
// cores through nvcuda::wmma: FlashAttention-2's algorithm over the paged cache. The parameters are the decode
// kernels' (AttentionParams, attention_kernels.cuh); the launch comes from plan_varlen_attention (launch_plan.h).
//
// Math, as in attention_kernels.cuh: the i-th of the q_s query rows of sequence s (length L) sits at position
// P = L - q_s + i and attends causally to tokens t in [max(0, P + 1 - sliding_window), P]: logit
// x = scale * (q . k_t), then soft cap, then + slope[h] * (t - P); softmax and the weighted sum of V in float32.
//
// Who serves which query row (the launcher, csrc/cuda/attention.cu, launches both kernels on the same stream):
//   - sequences with one query row: the decode kernel (rows = kSingleTokenSeqs), split-KV and all, so a decode row
//     gets the same bits with or without query_start_loc;
//   - sequences with two or more: this kernel; its thread blocks of other sequences return at once.
//   Neither reads query_start_loc on the host: no synchronization, and the launches can be captured in a CUDA graph.
//
// Grid (plan.grid): (num_tokens / tokens_per_tile + num_seqs, num_kv_heads * head_chunks), kVarlenThreads threads.
// A thread block serves one tile: kVarlenRows = 64 rows of (query token, query head) pairs, token-major, of
// tokens_per_tile consecutive query tokens of one sequence and heads_per_tile query heads of one kv head's group
// (y: kv head and head chunk; groups larger than 64 heads are split into chunks). The group's heads share the
// K/V tiles. Sequence s owns the grid.x range starting at qsl[s] / tokens_per_tile + s (enough tiles for its rows,
// at most one more: launch_plan.h); a block finds its sequence by binary search over query_start_loc. The range is
// walked backwards, so that the tiles with the most keys (the last rows of long sequences) start first.
//
// Per tile, with N = key_tile keys per step (64; 32 above head dim 128), over the keys [key_begin, key_end) that
// some row of the tile sees (causal: up to the tile's last position; window: from its first position's start):
//   1. gather   all threads copy the N keys' K and V rows (16-byte loads through the block table) into shared
//               memory, as the input type (an fp8 cache's values converted: exact, every fp8 value is a half and a
//               bfloat16); rows past key_end are zeros (their slots may be NaN-poisoned or unowned). A key step
//               whose values hold an inf or NaN is marked (__syncthreads_or): see 4a and 4b.
//   2. logits   each warp owns 16 rows: S = Q K^T (16 x N) with wmma m16n16k16 (Q and K from shared memory), in
//               float32, stored to shared memory.
//   3. softmax  lanes 2r and 2r + 1 own row r of the warp: scale, soft cap, ALiBi and the causal/window mask per
//               element, then the online softmax (running max m and sum l, float32, in those two lanes'
//               registers); P = exp(x - m) is written in the input type, and l sums P as written. Each row's
//               rescale exp(m_old - m_new) goes to shared memory.
//   4. values   O (16 x head_dim, float32 accumulator fragments in registers) is rescaled row by row, then
//               O += P V with wmma. A fragment's element layout is unspecified, so the rescale reaches the elements
//               as a fragment loaded from a 16 x 16 matrix whose row r holds row r's rescale (written in step 3).
//   4a, 4b      only in a key step whose values hold an inf or NaN (none in a sane cache: no cost otherwise):
//               P V takes 0 in their place, since a masked p = 0 times NaN or inf is NaN (and would reach rows
//               that cannot see the key); then each row adds p v for those values among the keys it sees (the
//               values as they were, moved to k_s, free after step 2), as a fragment loaded from a 16 x 16 matrix
//               per 16 columns of O.
// Masked logits are replaced by -inf (a select: a NaN or inf key's logit must not survive the mask), so a key's
// NaN or inf reaches exactly the rows that see it, as in the reference.
// Then O / l is staged through shared memory (over Q, K and V) and written as the input type (row_sum of
// attention_kernels.cuh: with the row's sink; and row_lse).
//
// fp8 caches (AttentionParams<T, Fp8>): K and V hold the stored values in shared memory; k_scale multiplies the
// logits with the softmax scale (q . (k_scale k) = k_scale (q . k)) and v_scale the output with 1 / l.
//
// Shared memory (varlen_smem in launch_plan.h; about 81 KiB at head dim 128 and 84 KiB at 256, bf16):
// Q [64][D + 8], K and V [N][D + 8], S [64][N + 4] float, P [64][N + 8], the rescale [64][16] float, and each
// row's position and slope.
// Rows are padded to spread them over the banks; every wmma pointer stays 256-bit aligned.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attention_kernels.cuh"
#include "device.cuh"
#include "launch_plan.h"
#include "paged_cache.cuh"

#ifndef PAGED_ATTN_EMULATED
#include <mma.h>
#endif

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
  tile.kv_head = blockIdx.y / p.head_chunks;
  const int first_in_group = (blockIdx.y % p.head_chunks) * p.heads_per_block;
  tile.first_head = tile.kv_head * p.group_size + first_in_group;
  tile.heads = min(p.heads_per_block, p.group_size - first_in_group);
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

template <typename T, typename C, int HEAD_DIM>  // C: the cache's element type (T, or Fp8)
__global__ void __launch_bounds__(kVarlenThreads) varlen_attention_kernel(const AttentionParams<T, C> p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // bfloat16 wmma needs sm_80; the launcher takes the decode kernel's path on older GPUs
#else
  namespace wmma = nvcuda::wmma;
  constexpr VarlenSmem kSmem = varlen_smem(HEAD_DIM, sizeof(T));
  constexpr int N = varlen_key_tile(HEAD_DIM);
  constexpr int QKV_LD = kSmem.qkv_ld, S_LD = kSmem.s_ld, P_LD = kSmem.p_ld, O_LD = kSmem.o_ld;
  constexpr int VEC = 16 / static_cast<int>(sizeof(C));  // cache elements per 16-byte vector
  constexpr int ROW_VECS = HEAD_DIM / VEC;
  constexpr int D_FRAGS = HEAD_DIM / 16, N_FRAGS = N / 16;
  using Accumulator = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
  static_assert(HEAD_DIM % 16 == 0 && N % 16 == 0 && kVarlenRows == 16 * (kVarlenThreads / 32), "the wmma tiles");

  const VarlenTile tile = varlen_tile(p);
  if (!tile.active) return;  // uniform across the thread block
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

  PA_EXTERN_SHARED(uint4, smem_raw);
  char* const smem = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + kVarlenAlignment - 1) /
                                             kVarlenAlignment * kVarlenAlignment);
  T* const q_s = reinterpret_cast<T*>(smem + kSmem.q);               // [kVarlenRows][QKV_LD]
  T* const k_s = reinterpret_cast<T*>(smem + kSmem.k);               // [N][QKV_LD]
  T* const v_s = reinterpret_cast<T*>(smem + kSmem.v);               // [N][QKV_LD]
  float* const o_s = reinterpret_cast<float*>(smem + kSmem.o);       // [kVarlenRows][O_LD], at the end
  float* const s_s = reinterpret_cast<float*>(smem + kSmem.s);       // [kVarlenRows][S_LD]
  T* const p_s = reinterpret_cast<T*>(smem + kSmem.pr);              // [kVarlenRows][P_LD]
  float* const rescale_s = reinterpret_cast<float*>(smem + kSmem.rescale);  // [kVarlenRows][16]
  int* const row_pos_s = reinterpret_cast<int*>(smem + kSmem.row_pos);      // [kVarlenRows]; -1: no row
  float* const row_slope_s = reinterpret_cast<float*>(smem + kSmem.row_slope);  // [kVarlenRows]

  // The tile's rows (token-major (token, head) pairs): positions, slopes, queries (zeros where there is no row).
  const auto has_row = [&](int r) { return r / p.heads_per_block < tile.tokens && r % p.heads_per_block < tile.heads; };
  for (int r = tid; r < kVarlenRows; r += kVarlenThreads) {
    const bool row = has_row(r);
    row_pos_s[r] = row ? tile.first_pos + r / p.heads_per_block : -1;  // -1 sees no key
    row_slope_s[r] = row && p.alibi_slopes != nullptr ? p.alibi_slopes[tile.first_head + r % p.heads_per_block] : 0.f;
  }
  for (int i = tid; i < kVarlenRows * HEAD_DIM; i += kVarlenThreads) {
    const int r = i / HEAD_DIM, d = i % HEAD_DIM;
    T x;
    from_float(x, 0.0f);
    if (has_row(r)) {
      const int64_t row = tile.first_row + r / p.heads_per_block;
      x = p.query[row * p.query_row_stride + (tile.first_head + r % p.heads_per_block) * p.query_head_stride + d];
    }
    q_s[r * QKV_LD + d] = x;
  }
  __syncthreads();

  // This warp's output rows, as accumulator fragments.
  Accumulator o[D_FRAGS];
#pragma unroll
  for (int f = 0; f < D_FRAGS; ++f) wmma::fill_fragment(o[f], 0.0f);
  // The softmax row of this lane (lanes 2r and 2r + 1 share row r), its running max and sum.
  const int row = warp * 16 + lane / 2, half = lane % 2;
  const int pos = row_pos_s[row];
  const float slope = row_slope_s[row];
  const float inv_soft_cap = p.logits_soft_cap > 0.0f ? 1.0f / p.logits_soft_cap : 0.0f;
  const float logit_scale = p.k_scale != nullptr ? p.scale * *p.k_scale : p.scale;
  float running_max = -INFINITY, running_sum = 0.0f;
  const auto sees = [&](int t) { return t <= pos && (p.sliding_window == 0 || t > pos - p.sliding_window); };

  const int32_t* block_table = p.block_tables + static_cast<int64_t>(tile.seq) * p.max_blocks_per_seq;
  float* const s_w = s_s + warp * 16 * S_LD;  // this warp's 16 rows of S
  T* const p_w = p_s + warp * 16 * P_LD;      // and of P
  float* const rescale_w = rescale_s + warp * 16 * 16;  // and the rescale of each, repeated over 16 columns
  for (int key0 = tile.key_begin; key0 < tile.key_end; key0 += N) {
    const int n = min(N, tile.key_end - key0);

    // 1. gather
    bool nonfinite = false;  // this thread stored an inf or NaN value
    for (int i = tid; i < N * ROW_VECS; i += kVarlenThreads) {
      const int j = i / ROW_VECS, v = i % ROW_VECS;
      uint4 key = {0, 0, 0, 0}, value = {0, 0, 0, 0};
      if (j < n) {
        key = *reinterpret_cast<const uint4*>(p.key_cache.row(block_table, key0 + j, tile.kv_head) + v * VEC);
        value = *reinterpret_cast<const uint4*>(p.value_cache.row(block_table, key0 + j, tile.kv_head) + v * VEC);
      }
      (void)store_cache_vec<T, C>(k_s + j * QKV_LD + v * VEC, key, p.fp8_format);
      nonfinite |= store_cache_vec<T, C>(v_s + j * QKV_LD + v * VEC, value, p.fp8_format);
    }
    const bool fix_values = __syncthreads_or(nonfinite);  // uniform across the thread block

    // 2. logits: S = Q K^T (K^T is K read column-major)
    {
      Accumulator s[N_FRAGS];
#pragma unroll
      for (int j = 0; j < N_FRAGS; ++j) wmma::fill_fragment(s[j], 0.0f);
#pragma unroll
      for (int kk = 0; kk < D_FRAGS; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> q;
        wmma::load_matrix_sync(q, q_s + warp * 16 * QKV_LD + kk * 16, QKV_LD);
#pragma unroll
        for (int j = 0; j < N_FRAGS; ++j) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> k;
          wmma::load_matrix_sync(k, k_s + j * 16 * QKV_LD + kk * 16, QKV_LD);
          wmma::mma_sync(s[j], q, k, s[j]);
        }
      }
#pragma unroll
      for (int j = 0; j < N_FRAGS; ++j) wmma::store_matrix_sync(s_w + j * 16, s[j], S_LD, wmma::mem_row_major);
    }
    __syncwarp();

    // 3. softmax: this lane's columns of its row are half, half + 2, ...
    float* const s_row = s_w + (lane / 2) * S_LD;
    T* const p_row = p_w + (lane / 2) * P_LD;
    float tile_max = -INFINITY;
    for (int c = half; c < N; c += 2) {
      const int t = key0 + c;
      float x = s_row[c] * logit_scale;
      if (p.logits_soft_cap > 0.0f) x = p.logits_soft_cap * tanhf(x * inv_soft_cap);
      x += slope * static_cast<float>(t - pos);
      x = c < n && sees(t) ? x : -INFINITY;  // a select: a NaN logit must not survive the mask
      s_row[c] = x;
      tile_max = fmaxf(tile_max, x);
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    const float new_max = fmaxf(running_max, tile_max);
    const float base = new_max == -INFINITY ? 0.0f : new_max;  // a row that has seen no key yet: all p = 0
    const float rescale = __expf(running_max - base);           // 0 on the row's first keys
    float tile_sum = 0.0f;
    for (int c = half; c < N; c += 2) {
      T prob;
      from_float(prob, __expf(s_row[c] - base));
      p_row[c] = prob;
      tile_sum += to_float(prob);
    }
    tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, 1);  // the same sum in both lanes (+ commutes)
    running_sum = running_sum * rescale + tile_sum;
    running_max = new_max;
#pragma unroll
    for (int c = half; c < 16; c += 2) rescale_w[(lane / 2) * 16 + c] = rescale;
    __syncwarp();

    // 4a. (only in a key step whose values hold an inf or NaN) the values as they are move to k_s, free once
    // every warp is done with step 2, and v_s keeps them with each inf or NaN replaced by 0, for P V: a masked p
    // of 0 times NaN or inf would be NaN. 4b adds them back, for the rows that see them.
    if (fix_values) {  // uniform across the thread block
      __syncthreads();
      for (int i = tid; i < N * (HEAD_DIM / 8); i += kVarlenThreads) {
        const int j = i / (HEAD_DIM / 8), v = i % (HEAD_DIM / 8);
        uint4* const value = reinterpret_cast<uint4*>(v_s + j * QKV_LD + v * 8);
        const uint4 x = *value;
        *reinterpret_cast<uint4*>(k_s + j * QKV_LD + v * 8) = x;
        bool unused = false;
        *value = zero_nonfinite<T>(x, unused);
      }
      __syncthreads();
    }

    // 4. values: O = O * rescale (per row) + P V
    {
      Accumulator row_rescale;  // every element: its row's rescale (whatever the fragment's layout)
      wmma::load_matrix_sync(row_rescale, rescale_w, 16, wmma::mem_row_major);
#pragma unroll
      for (int f = 0; f < D_FRAGS; ++f)
#pragma unroll
        for (int e = 0; e < Accumulator::num_elements; ++e) o[f].x[e] *= row_rescale.x[e];
    }
#pragma unroll
    for (int kk = 0; kk < N_FRAGS; ++kk) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> prob;
      wmma::load_matrix_sync(prob, p_w + kk * 16, P_LD);
#pragma unroll
      for (int f = 0; f < D_FRAGS; ++f) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> value;
        wmma::load_matrix_sync(value, v_s + kk * 16 * QKV_LD + f * 16, QKV_LD);
        wmma::mma_sync(o[f], prob, value, o[f]);
      }
    }

    // 4b. O += p v for the inf and NaN values this row sees (the values as they are in k_s): lanes 2r and 2r + 1
    // take row r's columns [8 half, 8 half + 8) of each 16 columns of O, one at a time (few registers: they are
    // spent on O), p in float from the row's logits.
    if (fix_values) {  // uniform across the thread block
      const float* const x_row = s_w + (lane / 2) * S_LD;
      const float row_base = running_max == -INFINITY ? 0.0f : running_max;  // step 3's base
#pragma unroll
      for (int f = 0; f < D_FRAGS; ++f) {  // unrolled: o[f] stays in registers
        __syncwarp();  // every lane has loaded rescale_w (above), or the previous columns' matrix
#pragma unroll 1
        for (int e = 0; e < 8; ++e) {
          const int d = f * 16 + half * 8 + e;
          float extra = 0.0f;
#pragma unroll 1
          for (int c = 0; c < n; ++c) {
            const float v = to_float(k_s[c * QKV_LD + d]);
            if (sees(key0 + c) && !(fabsf(v) < INFINITY)) extra += __expf(x_row[c] - row_base) * v;
          }
          rescale_w[(lane / 2) * 16 + half * 8 + e] = extra;
        }
        __syncwarp();
        Accumulator fix;
        wmma::load_matrix_sync(fix, rescale_w, 16, wmma::mem_row_major);
#pragma unroll
        for (int e = 0; e < Accumulator::num_elements; ++e) o[f].x[e] += fix.x[e];
      }
    }
    __syncthreads();  // k_s, v_s (and then q_s: O is staged over them) are rewritten next
  }

  // out = O / l, staged through shared memory (the fragments' layout is unspecified).
  float* const o_w = o_s + warp * 16 * O_LD;
#pragma unroll
  for (int f = 0; f < D_FRAGS; ++f) wmma::store_matrix_sync(o_w + f * 16, o[f], O_LD, wmma::mem_row_major);
  __syncwarp();
  if (has_row(row)) {
    const float v_scale = p.v_scale != nullptr ? *p.v_scale : 1.0f;
    // pos < 0: a row that sees no key (an invalid query_start_loc): 0. Else running_sum >= 1, or NaN (a NaN logit),
    // or 0 when every logit it sees is -inf (0 / 0 = NaN, as the reference).
    const int head = tile.first_head + row % p.heads_per_block;
    const float sink = sink_of(p.sinks, head);
    const float inv_sum = pos >= 0 ? v_scale / row_sum(running_max, running_sum, sink) : 0.0f;
    const int64_t out_row = static_cast<int64_t>(tile.first_row + row / p.heads_per_block) * p.num_heads + head;
    if (half == 0 && p.lse != nullptr) p.lse[out_row] = row_lse(running_max, running_sum, sink);
    T* const out = p.out + out_row * HEAD_DIM;
    const float* const o_row = o_w + (lane / 2) * O_LD;
    for (int d = half * (HEAD_DIM / 2); d < (half + 1) * (HEAD_DIM / 2); ++d) from_float(out[d], o_row[d] * inv_sum);
  }
#endif
}

}  // namespace paged_attn
