// Paged decode attention on CUDA cores: the decode kernel (paged_attention_kernel), split-KV's reduce and the dispatch
// over their instantiations. One query row attends to the keys/values of its sequence, which lie in scattered blocks
// of the paged cache, reached through its block table.
// No torch here: csrc/cuda/attention.cpp checks the tensors and launches these kernels with the plan of
// plan_attention (launch_plan.h); the emulated tests launch them with the same plan. (Query rows of sequences with
// several query tokens have a tensor-core kernel of their own: varlen_attention_kernels.cuh; and on compute
// capability 8.0+ float16/bfloat16 decode over a cache of the same dtype takes decode_mma_kernels.cuh, which shares
// the parameters and tasks (attention_params.cuh), the partitions and this file's reduce. This kernel serves float32
// queries, fp8 caches, head dims without a tensor-core instantiation and older GPUs.)
//
// Math, per query row at position P of a sequence (P = L - 1 for the last token of a sequence of length L), query
// head h (reading kv head h / group_size) and token t in [start, P], start = max(0, P + 1 - sliding_window) (0
// without a window), as in csrc/cpu/attention.cpp:
//   x_t = scale * (q . k_t);  x_t = cap * tanh(x_t / cap) if logits_soft_cap = cap > 0;
//   x_t += slope[h] * (t - P) with ALiBi;  out = sum_t softmax(x)_t * v_t, accumulated in float32.
// With sinks (gpt-oss), head h's softmax also counts sinks[h] as a logit without a value (not scaled, capped,
// biased or windowed), once per row when its state is final (row_sum, row_lse: single pass, or split-KV's reduce,
// never a partition); with lse, the row's log-sum-exp is written too (it counts the sink).
// A row attends to the first P + 1 tokens: its "length" (seq_len below) is P + 1.
//
// Which query rows a launch serves (params.rows, a QueryRows: last of each sequence, single-token sequences, or
// every row), and so what grid.x counts ("items"): see attention_params.cuh, with the parameters and the task
// geometry all three kernels share; their shared arithmetic (conversions, reductions, sinks and lse):
// attention_math.cuh.
//
// Grid (plan.grid): (num_items, num_kv_heads * blocks_per_group, partition slots), kAttentionThreads threads. A
// thread block serves one item (x), one kv head and up to heads_per_block <= GROUP query heads of its head group (y;
// groups larger than kMaxGroup are split among blocks_per_group thread blocks), and the partitions z, z + gridDim.z,
// ... of the row's tokens (z = blockIdx.z; the plan bounds the slots, gridDim.z <= num_partitions, to fill the GPU's
// waves).
// K/V bytes are read once per thread block, so once in total for groups up to kMaxGroup.
//   - single pass (num_partitions = 1): the thread block covers the whole sequence and writes `out`.
//   - split-KV (flash-decoding, vLLM's v2): each of its partitions (partition_size tokens) is computed on its own,
//     from fresh accumulators, and writes its (max, sum, unnormalized output) record, so the records do not depend
//     on gridDim.z; paged_attention_reduce_kernel merges them exactly. Only the partitions that hold tokens of the
//     window are run (none past seq_len, so a block table wider than the sequences costs no work) and read.
//
// The attention kernel walks its tokens in tiles of kTile = 256 keys, in four steps per tile:
//   0. rows    (tile_rows):    the whole thread block computes, once per token, the offsets of its K and V rows
//              (one block-table load and one division per token) into shared memory, for steps 1 and 3 to read
//              (FlashInfer's kv_offset_smem), instead of every lane of a row redoing them per row.
//   1. logits  (tile_logits):  every K row of the tile is read once (16-byte loads) and dotted with all the
//              block's queries (held in registers); the lanes of a row reduce with warp shuffles; the raw logits
//              go to shared memory.
//   2. softmax (tile_softmax): one warp per query head applies soft cap and ALiBi to its logits (once per logit,
//              not on every lane of a row), updates the running max and sum (online softmax) and turns the tile's
//              logits into probabilities relative to the new max.
//   3. values  (tile_values):  every V row of the tile is read once and accumulated, weighted, into float32
//              registers, after the accumulators are rescaled to the new max.
// Then the row groups' accumulators are added in a fixed order (combine_and_write), so results are the same
// bit for bit from run to run.
//
// Lanes: a warp's lanes are split into row groups of LANES lanes; a row group reads one K or V row at a time, lane
// l taking the row's 16-byte vectors l, l + LANES, ...; row j of a tile goes to row group j % ROW_GROUPS.
//
// fp8 caches (AttentionParams<T, Fp8>, T = float, half or bfloat16; the format, e4m3 or e5m2, is a run-time parameter):
// a 16-byte load carries 16 cache values, converted to float in registers (cuda_fp8.h: two values per conversion);
// keys are read as float(stored) * k_scale (k_scale folded into the query's pre-scaling) and values as
// float(stored) * v_scale (applied to the accumulator when it is written). With more than one head per thread block
// a lane's 16 values per head would double the registers of q and acc (ptxas: 196 instead of 122 for 4 heads,
// spills for 8), halving the thread blocks an SM holds: those variants load 8-byte vectors (8 values, the same
// split of a row as half/bfloat16) and twice as many rows per batch, so the bytes in flight per lane stay those of
// a 16-byte split (DecodeSplit, RowSplit::UNROLL).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attention_math.cuh"
#include "attention_params.cuh"
#include "device.cuh"
#include "launch_plan.h"
#include "paged_cache.cuh"

namespace paged_attn {

constexpr int kAttentionWarps = kAttentionThreads / 32;
constexpr int kTile = 256;         // tokens per tile (their logits are held in shared memory)
constexpr int kUnroll = 4;         // rows of 16-byte vectors loaded before they are used, per row group

// ---------------------------------------------------------------------------------------------------------------
// How a thread block's lanes split a row of HEAD_DIM elements, and this thread's place in that split.
constexpr int pow2_ceil(int x) { return x <= 1 ? 1 : 2 * pow2_ceil((x + 1) / 2); }

template <typename T, int HEAD_DIM, int VEC_BYTES = 16>
struct RowSplit {
  using Vector = std::conditional_t<VEC_BYTES == 16, uint4, uint2>;             // one load
  static constexpr int UNROLL = kUnroll * 16 / VEC_BYTES;                        // rows per batch of loads
  static constexpr int VEC = VEC_BYTES / static_cast<int>(sizeof(T));           // elements per vector
  static constexpr int NVEC = HEAD_DIM / VEC;                                    // vectors per row
  static constexpr int LANES = pow2_ceil(NVEC) < 32 ? pow2_ceil(NVEC) : 32;     // lanes per row group
  static constexpr int VPL = (NVEC + LANES - 1) / LANES;                         // vectors per lane
  static constexpr int ROW_GROUPS = kAttentionWarps * (32 / LANES);              // per thread block
  static_assert(HEAD_DIM % VEC == 0, "a row must be a whole number of vectors");
  static_assert(VEC_BYTES == 16 || VEC_BYTES == 8, "16- or 8-byte vectors");

  int row_lane;        // this lane's place in its row group: it holds elements dim(row_lane, i, e)
  int row_group;       // warp * (32 / LANES) + row_in_warp
  int row_in_warp;     // the row group's place in its warp
  int warp_first_row;  // the first row of the tile that this warp's row groups read

  __device__ __forceinline__ explicit RowSplit(unsigned tid) {  // unsigned: shifts and masks, no sign fix-ups
    const int warp = static_cast<int>(tid / 32), lane = static_cast<int>(tid % 32);
    row_lane = lane % LANES, row_in_warp = lane / LANES;
    warp_first_row = warp * (32 / LANES);
    row_group = warp_first_row + row_in_warp;
  }

  // The row element held at [i][e] of a lane's slice (>= HEAD_DIM: past the row, a lane with nothing to do).
  __device__ __forceinline__ int dim(int i, int e) const { return (row_lane + i * LANES) * VEC + e; }
};

// The decode kernel's split of a row of cache elements C: 16-byte vectors, but 8-byte ones for an fp8 cache with
// more than one head per thread block (16 fp8 values per lane and head would double the registers of q and acc).
template <typename C, int HEAD_DIM, int GROUP>
using DecodeSplit = RowSplit<C, HEAD_DIM, (sizeof(C) == 1 && GROUP > 1) ? 8 : 16>;

// A thread's slice of one row for each query head of its block: [GROUP][VPL][VEC] floats, in registers.
template <typename C, int HEAD_DIM, int GROUP>
using HeadSlices = float[GROUP][DecodeSplit<C, HEAD_DIM, GROUP>::VPL][DecodeSplit<C, HEAD_DIM, GROUP>::VEC];

// ---------------------------------------------------------------------------------------------------------------
// The attention kernel's steps, in order.

// The query of each head of the task, pre-scaled, as this lane's slices (zeros past the row and past the task's
// heads).
template <typename T, typename C, int HEAD_DIM, int GROUP>
__device__ __forceinline__ void load_query(HeadSlices<C, HEAD_DIM, GROUP>& q, const AttentionParams<T, C>& p,
                                           const AttentionTask& task, const DecodeSplit<C, HEAD_DIM, GROUP>& rs) {
  using R = DecodeSplit<C, HEAD_DIM, GROUP>;
  const T* query = p.query + query_row(p) * p.query_row_stride + task.first_head * p.query_head_stride;
  const float scale = p.k_scale != nullptr ? p.scale * *p.k_scale : p.scale;  // q . (k_scale k) = (k_scale q) . k
#pragma unroll
  for (int g = 0; g < GROUP; ++g)
#pragma unroll
    for (int i = 0; i < R::VPL; ++i)
#pragma unroll
      for (int e = 0; e < R::VEC; ++e) {
        const int d = rs.dim(i, e);
        q[g][i][e] = task.has_head(g) && d < HEAD_DIM ? scale * to_float(query[g * p.query_head_stride + d]) : 0.0f;
      }
}

// Loads this lane's vectors of UNROLL rows of the tile, rows first_row + u * ROW_GROUPS (u < UNROLL), of one
// cache, row j at data + rows_s[j] (step 0's table). A row at or past n is not read (it may be a NaN-poisoned slot
// past the sequence's end, and rows_s holds no entry for it): the tile's last row (n - 1) is loaded in its place,
// which the callers never use (fewer predicates than zero-filling: ptxas spilled them). Lanes past the row's end
// get zeros. All loads are issued before any is used.
template <typename R, typename C>
__device__ __forceinline__ void load_rows(typename R::Vector (&rows)[R::UNROLL][R::VPL], const C* data,
                                          const int64_t (&rows_s)[kTile], int first_row, int n, const R& rs) {
  using Vector = typename R::Vector;
#pragma unroll
  for (int u = 0; u < R::UNROLL; ++u) {
    const int j = min(first_row + u * R::ROW_GROUPS, n - 1);
    const C* row = data + rows_s[j];
#pragma unroll
    for (int i = 0; i < R::VPL; ++i) {
      const int v = rs.row_lane + i * R::LANES;
      rows[u][i] = v < R::NVEC ? *reinterpret_cast<const Vector*>(row + v * R::VEC) : Vector{};
    }
  }
}

// Walks this row group's rows of the tile in one cache: rows j = first + u * ROW_GROUPS, UNROLL at a time (all
// loads of a batch issued first), calling f(j, row) with this lane's slice of the row as floats ([VPL][VEC]; for
// j >= n, row n - 1 again: f must not use it). The loop steps over warp-uniform bases, so every lane of a warp makes
// the same calls, also past the tile's end (step 1's lane shuffles need the whole warp).
template <typename R, typename T, typename C, typename F>
__device__ __forceinline__ void for_each_row(const PagedCache<const C>& cache, const int64_t (&rows_s)[kTile],
                                             const AttentionParams<T, C>& p, const R& rs, int n, F&& f) {
  for (int j0 = rs.warp_first_row; j0 < n; j0 += R::ROW_GROUPS * R::UNROLL) {
    typename R::Vector rows[R::UNROLL][R::VPL];
    load_rows<R>(rows, cache.data, rows_s, j0 + rs.row_in_warp, n, rs);
#pragma unroll
    for (int u = 0; u < R::UNROLL; ++u) {
      float row[R::VPL][R::VEC];
#pragma unroll
      for (int i = 0; i < R::VPL; ++i) cache_vec_to_floats<C>(rows[u][i], row[i], p.fp8_format);
      f(j0 + rs.row_in_warp + u * R::ROW_GROUPS, row);
    }
  }
}

// 0. key_rows_s[j], value_rows_s[j]: where the K and V rows (kv head task.kv_head) of the tile's token
// tile_begin + j lie, as offsets from the caches' data, for j < n (nothing is written past n: steps 1 and 3 never
// read those entries).
template <typename T, typename C>
__device__ __forceinline__ void tile_rows(int64_t (&key_rows_s)[kTile], int64_t (&value_rows_s)[kTile],
                                          const AttentionParams<T, C>& p, const AttentionTask& task, int tile_begin,
                                          int n) {
  const int32_t* block_table = p.block_tables + static_cast<int64_t>(task.seq) * p.max_blocks_per_seq;
  for (int j = threadIdx.x; j < n; j += kAttentionThreads) {
    key_rows_s[j] = p.key_cache.row_offset(block_table, tile_begin + j, task.kv_head);
    value_rows_s[j] = p.value_cache.row_offset(block_table, tile_begin + j, task.kv_head);
  }
}

// 1. logits_s[g][j] = q_g . k for the tile's n tokens tile_begin + j (soft cap and ALiBi: step 2).
template <typename T, typename C, int HEAD_DIM, int GROUP>
__device__ __forceinline__ void tile_logits(float (&logits_s)[GROUP][kTile], const HeadSlices<C, HEAD_DIM, GROUP>& q,
                                            const AttentionParams<T, C>& p, const AttentionTask& task,
                                            const DecodeSplit<C, HEAD_DIM, GROUP>& rs,
                                            const int64_t (&key_rows_s)[kTile], int n) {
  using R = DecodeSplit<C, HEAD_DIM, GROUP>;
  for_each_row(p.key_cache, key_rows_s, p, rs, n, [&](int j, const float (&kf)[R::VPL][R::VEC]) {
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      if (!task.has_head(g)) break;  // uniform across the thread block
      float dot = 0.0f;
#pragma unroll
      for (int i = 0; i < R::VPL; ++i)
#pragma unroll
        for (int e = 0; e < R::VEC; ++e) dot = fmaf(q[g][i][e], kf[i][e], dot);
      dot = sum_over_lanes<R::LANES>(dot);  // every lane takes part, also past the tile's end
      if (rs.row_lane == 0 && j < n) {
        logits_s[g][j] = dot;
      }
    }
  });
}

// 2. Online softmax, one warp per query head: first the logits' soft cap (inv_soft_cap = 1 / logits_soft_cap) and
// ALiBi, each lane on its own logits j = lane, lane + 32, ... (the same lanes then read them again); raise the
// running max to the tile's, turn the tile's logits into p = exp(x - max), rescale the running sum and add the
// tile's. rescale_s[g] tells step 3 how to rescale.
// NOTE: a division here would call the slow path of IEEE division and make ptxas spill registers.
// Non-finite logits (NaN or inf keys, all visible: a task reads only its row's tokens): a NaN logit leaves the max
// alone (fmaxf) and makes its p, the sum and the output NaN; while every logit so far is -inf, p is exp(-inf - 0)
// = 0, never exp(-inf - -inf) = NaN, as the reference's softmax gives 0 there (and 0 / 0 = NaN when all are).
template <typename T, typename C, int GROUP>
__device__ __forceinline__ void tile_softmax(float (&logits_s)[GROUP][kTile], float (&max_s)[GROUP],
                                             float (&sum_s)[GROUP], float (&rescale_s)[GROUP],
                                             const AttentionParams<T, C>& p, const AttentionTask& task,
                                             float inv_soft_cap, int tile_begin, int n) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool soft_cap = p.logits_soft_cap > 0.0f, alibi = p.alibi_slopes != nullptr;
  for (int g = warp; g < task.num_heads; g += kAttentionWarps) {
    const float slope = alibi ? p.alibi_slopes[task.first_head + g] : 0.0f;
    float tile_max = -INFINITY;
    for (int j = lane; j < n; j += 32) {
      float x = logits_s[g][j];
      if (soft_cap || alibi) {  // uniform across the thread block
        if (soft_cap) x = p.logits_soft_cap * tanhf(x * inv_soft_cap);
        if (alibi) x += slope * static_cast<float>(tile_begin + j - (task.seq_len - 1));
        logits_s[g][j] = x;
      }
      tile_max = fmaxf(tile_max, x);
    }
    const float new_max = fmaxf(max_s[g], warp_max(tile_max));
    const float base = new_max == -INFINITY ? 0.0f : new_max;  // the same as new_max for any finite logit
    float tile_sum = 0.0f;
    for (int j = lane; j < n; j += 32) {
      const float prob = __expf(logits_s[g][j] - base);
      logits_s[g][j] = prob;
      tile_sum += prob;
    }
    tile_sum = sum_over_lanes<32>(tile_sum);
    __syncwarp();  // every lane has read max_s[g]
    if (lane == 0) {
      const float rescale = __expf(max_s[g] - base);  // 0 on the first tile (max_s = -inf)
      rescale_s[g] = rescale;
      sum_s[g] = sum_s[g] * rescale + tile_sum;
      max_s[g] = new_max;
    }
  }
}

// 3. acc = acc * rescale + sum_j p[g][j] * V_j over the tile's rows of this row group.
template <typename T, typename C, int HEAD_DIM, int GROUP>
__device__ __forceinline__ void tile_values(HeadSlices<C, HEAD_DIM, GROUP>& acc, const float (&logits_s)[GROUP][kTile],
                                            const float (&rescale_s)[GROUP], const AttentionParams<T, C>& p,
                                            const AttentionTask& task, const DecodeSplit<C, HEAD_DIM, GROUP>& rs,
                                            const int64_t (&value_rows_s)[kTile], int n) {
  using R = DecodeSplit<C, HEAD_DIM, GROUP>;
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    const float rescale = task.has_head(g) ? rescale_s[g] : 0.0f;
#pragma unroll
    for (int i = 0; i < R::VPL; ++i)
#pragma unroll
      for (int e = 0; e < R::VEC; ++e) acc[g][i][e] *= rescale;
  }
  for_each_row(p.value_cache, value_rows_s, p, rs, n, [&](int j, const float (&vf)[R::VPL][R::VEC]) {
    if (j >= n) return;  // past the tile: row n - 1 again, and logits_s holds no probability for it
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      if (!task.has_head(g)) break;
      const float prob = logits_s[g][j];
#pragma unroll
      for (int i = 0; i < R::VPL; ++i)
#pragma unroll
        for (int e = 0; e < R::VEC; ++e) acc[g][i][e] = fmaf(prob, vf[i][e], acc[g][i][e]);
    }
  });
}

// 4. The row groups' accumulators are summed in row-group order (a fixed order: the same bits on every run) and
// written: out = acc / sum in single pass (row_sum: with the sink; and row_lse), the partition's (acc, max, sum)
// in split-KV (no sink: the reduce counts it). An fp8 cache's v_scale multiplies acc here (so the reduce needs no
// scale).
template <typename T, typename C, int HEAD_DIM, int GROUP>
__device__ __forceinline__ void combine_and_write(
    float (&partial_s)[DecodeSplit<C, HEAD_DIM, GROUP>::ROW_GROUPS][GROUP][HEAD_DIM],
    const HeadSlices<C, HEAD_DIM, GROUP>& acc, const float (&max_s)[GROUP], const float (&sum_s)[GROUP],
    const AttentionParams<T, C>& p, const AttentionTask& task, const DecodeSplit<C, HEAD_DIM, GROUP>& rs) {
  using R = DecodeSplit<C, HEAD_DIM, GROUP>;
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    if (!task.has_head(g)) break;
#pragma unroll
    for (int i = 0; i < R::VPL; ++i)
#pragma unroll
      for (int e = 0; e < R::VEC; ++e) {
        const int d = rs.dim(i, e);
        if (d < HEAD_DIM) partial_s[rs.row_group][g][d] = acc[g][i][e];
      }
  }
  __syncthreads();
  const int64_t row = p.num_partitions == 1 ? query_row(p) : 0;
  const float v_scale = p.v_scale != nullptr ? *p.v_scale : 1.0f;
  for (int k = threadIdx.x; k < task.num_heads * HEAD_DIM; k += kAttentionThreads) {
    const int g = k / HEAD_DIM, d = k % HEAD_DIM;
    float o = 0.0f;
#pragma unroll
    for (int r = 0; r < R::ROW_GROUPS; ++r) o += partial_s[r][g][d];
    if (p.v_scale != nullptr) o *= v_scale;
    if (p.num_partitions == 1) {
      const int64_t out_row = row * p.num_heads + task.first_head + g;
      // the task has tokens, so sum >= 1, or NaN (a NaN logit: NaN out, never 0), or 0 (every logit -inf: NaN)
      const float sink = sink_of(p.sinks, task.first_head + g);
      from_float(p.out[out_row * HEAD_DIM + d], o / row_sum(max_s[g], sum_s[g], sink));
      if (d == 0 && p.lse != nullptr) p.lse[out_row] = row_lse(max_s[g], sum_s[g], sink);
    } else {
      const int64_t slot = (static_cast<int64_t>(blockIdx.x) * p.num_heads + task.first_head + g) * p.num_partitions +
                           task.partition;
      p.partial_out[slot * HEAD_DIM + d] = o;
      if (d == 0) p.partial_max[slot] = max_s[g], p.partial_sum[slot] = sum_s[g];
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The kernels.

// One thread block: the partitions blockIdx.z, blockIdx.z + gridDim.z, ... of its item's row that hold tokens of the
// window (the grid's partition slots are bounded by the plan, so a block may run several; each is computed as a
// block of its own would, from fresh accumulators, and writes its own record); in single pass the whole row.
//
// Registers: the loop over partitions (around the tile loop) made ptxas keep more values live than a block of one
// partition did (fp8 cache, head dim 256, one head: 118 registers instead of 80), spills in some variants, a
// resident block fewer per SM. decode_min_blocks<C, HEAD_DIM, GROUP>() is, per variant, the blocks per SM it held
// with one partition per block (a5ad90d, scripts/sass_baseline.json); as __launch_bounds__'s minimum it caps the
// registers at what those blocks allow, which the variants meet with no local memory (sm_90, ptxas 13.0:
// scripts/sass_report.py --baseline compares every variant). One exception: float16/bfloat16 at head dim 192 with
// one head holds 7 (at 8, ptxas spilled ~40 bytes); it runs only below sm_80, where the tensor-core decode does not.
// What ptxas spills at a cap moves with small changes anywhere in the kernel: RowSplit's unsigned thread index and
// the assumption seq_len >= 0 below are what took the last 8-byte stack frames away.
template <typename C, int HEAD_DIM, int GROUP>
constexpr int decode_min_blocks() {
  if constexpr (sizeof(C) == 4) {  // float32
    if (GROUP == 1) return HEAD_DIM <= 128 ? 9 : HEAD_DIM == 192 ? 7 : 6;
    if (GROUP == 4) return HEAD_DIM == 32 || HEAD_DIM == 64 || HEAD_DIM == 128 ? 6 : HEAD_DIM <= 120 ? 5 : 4;
    return HEAD_DIM <= 128 ? 4 : 2;
  } else if constexpr (sizeof(C) == 1) {  // fp8
    if (GROUP == 1) return HEAD_DIM == 80 || HEAD_DIM == 96 || HEAD_DIM == 112 || HEAD_DIM == 192 ? 5 : 6;
    return GROUP == 4 ? 4 : 2;
  } else {  // float16, bfloat16
    return GROUP == 1 ? (HEAD_DIM == 192 ? 7 : 8) : GROUP == 4 ? 4 : 2;
  }
}

template <typename T, typename C, int HEAD_DIM, int GROUP>
__global__ void __launch_bounds__(kAttentionThreads, (decode_min_blocks<C, HEAD_DIM, GROUP>()))
    paged_attention_kernel(const AttentionParams<T, C> p) {
  using R = DecodeSplit<C, HEAD_DIM, GROUP>;
  PA_SHARED(float, logits_s, [GROUP][kTile]);  // the tile's logits, then probabilities
  PA_SHARED(float, max_s, [GROUP]);            // running max of each head's logits
  PA_SHARED(float, sum_s, [GROUP]);            // running sum of exp(logit - max)
  PA_SHARED(float, rescale_s, [GROUP]);        // exp(old max - new max) of the last tile
  PA_SHARED(float, partial_s, [R::ROW_GROUPS][GROUP][HEAD_DIM]);  // each row group's accumulator, at the end
  PA_SHARED(int64_t, key_rows_s, [kTile]);    // the tile's K rows (step 0): offsets from key_cache.data
  PA_SHARED(int64_t, value_rows_s, [kTile]);  // and its V rows, from value_cache.data

  AttentionTask task = attention_task(p);
  if (!task.active) return;  // uniform across the thread block
  if (p.num_partitions == 1 && task.begin >= task.end) {  // uniform across the thread block
    write_empty<T, C, HEAD_DIM>(p, task);
    return;
  }
  // Split-KV: the first of this block's partitions in the window (those before it hold no tokens of it).
  const int first = window_start(task.seq_len, p.sliding_window) / p.partition_size;
  int partition = task.partition;
  if (partition < first) partition += (first - partition + gridDim.z - 1) / gridDim.z * gridDim.z;
  PA_ASSUME(task.seq_len >= 0);  // clamped: the loop's 64-bit bound needs no register for its high word
  if (static_cast<int64_t>(partition) * p.partition_size >= task.seq_len) return;  // no partition with tokens
  const float inv_soft_cap = p.logits_soft_cap > 0.0f ? 1.0f / p.logits_soft_cap : 0.0f;
  const R rs(threadIdx.x);
  HeadSlices<C, HEAD_DIM, GROUP> q;    // this lane's slice of every query of the block (pre-scaled)
  HeadSlices<C, HEAD_DIM, GROUP> acc;  // this row group's weighted sum of V rows, same slice
  load_query<T, C, HEAD_DIM, GROUP>(q, p, task, rs);

  for (; static_cast<int64_t>(partition) * p.partition_size < task.seq_len; partition += gridDim.z) {
    set_partition(task, p, partition);  // begin < end: partition >= first
#pragma unroll
    for (int g = 0; g < GROUP; ++g)
#pragma unroll
      for (int i = 0; i < R::VPL; ++i)
#pragma unroll
        for (int e = 0; e < R::VEC; ++e) acc[g][i][e] = 0.0f;
    if (static_cast<int>(threadIdx.x) < GROUP) {
      max_s[threadIdx.x] = -INFINITY, sum_s[threadIdx.x] = 0.0f, rescale_s[threadIdx.x] = 0.0f;
    }
    __syncthreads();

    for (int tile_begin = task.begin; tile_begin < task.end; tile_begin += kTile) {
      const int n = min(kTile, task.end - tile_begin);
      tile_rows(key_rows_s, value_rows_s, p, task, tile_begin, n);
      __syncthreads();
      tile_logits<T, C, HEAD_DIM, GROUP>(logits_s, q, p, task, rs, key_rows_s, n);
      __syncthreads();
      tile_softmax(logits_s, max_s, sum_s, rescale_s, p, task, inv_soft_cap, tile_begin, n);
      __syncthreads();
      tile_values<T, C, HEAD_DIM, GROUP>(acc, logits_s, rescale_s, p, task, rs, value_rows_s, n);
      __syncthreads();  // logits_s and the row tables are rewritten by the next tile
    }
    combine_and_write<T, C, HEAD_DIM, GROUP>(partial_s, acc, max_s, sum_s, p, task, rs);
    __syncthreads();  // combine_and_write is done with max_s and sum_s before the next partition resets them
  }
}

// Merges the partitions of split-KV for one (sequence, query head): with M the largest partition max,
// out = sum_p w_p * partial_out_p / sum_p w_p * partial_sum_p, w_p = exp(partial_max_p - M), over the partitions
// that hold tokens (the others' records are never read or written).
//   1. M: every thread takes the maxes of a strided subset of the partitions (independent loads), then warp and
//      block maxima.
//   2. The partitions are split over row groups (RowSplit<float, HEAD_DIM>: LANES lanes read a partition's output
//      row as 16-byte vectors; a warp holds 32 / LANES row groups): row group r merges partitions first + r,
//      first + r + ROW_GROUPS, ..., UNROLL at a time with all their loads (max, sum, output row) issued first, so
//      ROW_GROUPS * UNROLL partitions are in flight per thread block, not one.
//   3. The row groups' (weighted sum, total) are added in shared memory in row-group order.
// A fixed assignment and order: the result does not depend on thread timing. Every such partition is added, also
// at weight 0 (0 * NaN = NaN: a partition whose sum or output is NaN, from a NaN logit or value, makes the row NaN,
// as in the reference, even when its max is -inf or far below M).
// Grid (plan.reduce_grid): (num_items, num_heads), kAttentionThreads threads.
template <typename T, typename C, int HEAD_DIM>
__global__ void __launch_bounds__(kAttentionThreads) paged_attention_reduce_kernel(const AttentionParams<T, C> p) {
  using R = RowSplit<float, HEAD_DIM>;
  PA_SHARED(float, warp_max_s, [kAttentionWarps]);
  PA_SHARED(float, out_s, [R::ROW_GROUPS][HEAD_DIM]);  // each row group's weighted sum of its partitions' outputs
  PA_SHARED(float, total_s, [R::ROW_GROUPS]);          // and of their sums
  const int head = blockIdx.y, tid = threadIdx.x;
  const QueryItem item = query_item(p, blockIdx.x);
  if (!item.active) return;  // uniform across the thread block

  // The partitions [first, last) that hold tokens of the window.
  const int seq_len = item.seq_len;
  const int first = window_start(seq_len, p.sliding_window) / p.partition_size;
  const int last = static_cast<int>((static_cast<int64_t>(seq_len) + p.partition_size - 1) / p.partition_size);
  const int64_t record = static_cast<int64_t>(blockIdx.x) * p.num_heads + head;
  const float* maxes = p.partial_max + record * p.num_partitions;
  const float* sums = p.partial_sum + record * p.num_partitions;
  const float* outs = p.partial_out + record * p.num_partitions * HEAD_DIM;  // 16-byte aligned rows

  // 1.
  float max_all = -INFINITY;
  for (int q = first + tid; q < last; q += kAttentionThreads) max_all = fmaxf(max_all, maxes[q]);
  max_all = warp_max(max_all);
  if (tid % 32 == 0) warp_max_s[tid / 32] = max_all;
  __syncthreads();
  max_all = warp_max_s[0];
#pragma unroll
  for (int w = 1; w < kAttentionWarps; ++w) max_all = fmaxf(max_all, warp_max_s[w]);

  // 2.
  const R rs(tid);
  float o[R::VPL][R::VEC] = {};
  float total = 0.0f;
  for (int q0 = first + rs.row_group; q0 < last; q0 += R::ROW_GROUPS * R::UNROLL) {
    float m[R::UNROLL], s[R::UNROLL];
    uint4 v[R::UNROLL][R::VPL];
#pragma unroll
    for (int u = 0; u < R::UNROLL; ++u) {
      const int q = min(q0 + u * R::ROW_GROUPS, last - 1);  // past last: partition last - 1 again, not added
      m[u] = maxes[q], s[u] = sums[q];
#pragma unroll
      for (int i = 0; i < R::VPL; ++i) {
        const int vec = rs.row_lane + i * R::LANES;
        v[u][i] = vec < R::NVEC ? *reinterpret_cast<const uint4*>(outs + static_cast<int64_t>(q) * HEAD_DIM +
                                                                  vec * R::VEC)
                                : uint4{};
      }
    }
#pragma unroll
    for (int u = 0; u < R::UNROLL; ++u) {
      if (q0 + u * R::ROW_GROUPS >= last) break;
      const float w = m[u] == -INFINITY ? 0.0f : __expf(m[u] - max_all);
      total += w * s[u];
#pragma unroll
      for (int i = 0; i < R::VPL; ++i) {
        float f[R::VEC];
        vec_to_floats(v[u][i], f, float{});
#pragma unroll
        for (int e = 0; e < R::VEC; ++e) o[i][e] = fmaf(w, f[e], o[i][e]);
      }
    }
  }

  // 3.
#pragma unroll
  for (int i = 0; i < R::VPL; ++i)
#pragma unroll
    for (int e = 0; e < R::VEC; ++e) {
      const int d = rs.dim(i, e);
      if (d < HEAD_DIM) out_s[rs.row_group][d] = o[i][e];
    }
  if (rs.row_lane == 0) total_s[rs.row_group] = total;
  __syncthreads();
  float sum_total = 0.0f;
#pragma unroll
  for (int r = 0; r < R::ROW_GROUPS; ++r) sum_total += total_s[r];
  // the row's sink, once (row_sum). No partition (seq_len 0): out 0, lse -inf or the sink (max_all = -inf,
  // total 0); else the total >= 1, NaN, or 0 when every logit is -inf (NaN, as the reference's 0 / 0)
  const float sink = sink_of(p.sinks, head), row_total = row_sum(max_all, sum_total, sink);
  const int64_t out_row = item.row * p.num_heads + head;
  if (tid == 0 && p.lse != nullptr) p.lse[out_row] = row_lse(max_all, sum_total, sink);
  for (int d = tid; d < HEAD_DIM; d += kAttentionThreads) {
    float sum_o = 0.0f;
#pragma unroll
    for (int r = 0; r < R::ROW_GROUPS; ++r) sum_o += out_s[r][d];
    from_float(p.out[out_row * HEAD_DIM + d], first < last ? sum_o / row_total : 0.0f);
  }
}

// Calls f(std::integral_constant<int, HEAD_DIM>{}, std::integral_constant<int, GROUP>{}) for the kernel
// instantiation of a head_dim and plan.group_variant for cache elements C; false when head_dim is not instantiated
// (fp8 caches: Fp8AttentionHeadDims, the multiples of 16).
template <typename C = void, typename F>
bool dispatch_attention(int head_dim, int group_variant, F&& f) {
  using HeadDims = std::conditional_t<std::is_same_v<C, Fp8>, Fp8AttentionHeadDims, AttentionHeadDims>;
  bool found = false;
  dispatch(head_dim, HeadDims{}, [&](auto head_dim_constant) {
    found = dispatch(group_variant, AttentionGroupVariants{},
                     [&](auto group_constant) { f(head_dim_constant, group_constant); });
  });
  return found;
}

}  // namespace paged_attn
