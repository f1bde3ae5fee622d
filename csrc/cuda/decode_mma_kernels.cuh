// Paged decode attention on tensor cores: the decode kernel for float16 and bfloat16 queries over caches of the
// same dtype (head dims of DecodeMmaHeadDims, compute capability 8.0+). The same parameters, tasks, partitions,
// split-KV records and reduce as paged_attention_kernel (attention_kernels.cuh, whose opening comment gives the
// math and the grid); only the way a thread block walks its tokens differs. Built to stream K and V at HBM speed:
// per token row, no division and no block-table load; loads in flight while the previous tile is computed; a few
// instructions per 16 bytes (scripts/sass_report.py reads them from the SASS).
//
// A thread block (kAttentionThreads = 4 warps) serves one item, one kv head and up to kMaxGroup query heads of its
// head group, as paged_attention_kernel does. Its partition's tokens [begin, end) are cut into tiles of kDecodeTile =
// 16 tokens at absolute positions (tile c: tokens 16c .. 16c + 15; tokens of a tile outside [begin, end) are not
// read and count as -inf logits), and warp w takes tiles first + w, first + w + 4, ... on its own: a running max,
// sum and output per head, and a two-stage pipeline of its own in shared memory, so that the main loop has no
// __syncthreads. Per tile (attend_warp_tiles; steps 1-3: tile_logits, tile_softmax, tile_values):
//   0. (one tile ahead) the tile's K and V rows are copied into the free stage with cp.async, 16 bytes a copy,
//      from the row offsets of its cache blocks: the block-table entries are loaded once per tile (one, or two for
//      block_size 8), a tile ahead of their use, and give every row of K and V, with no division per row;
//   1. S^T = K Q^T on tensor cores (mma.m16n8k16: M = the 16 tokens, N = 8 head slots, K = head_dim): the K rows by
//      ldmatrix from shared memory, Q^T as B fragments held in registers for the whole kernel (loaded once, zero
//      past the thread block's heads). Each lane holds 4 logits: tokens g and g + 8 of heads 2t, 2t + 1 (g = lane / 4,
//      t = lane % 4; layouts in mma.cuh);
//   2. online softmax on those registers: scale, soft cap, ALiBi and the window applied once per tile; the tile's
//      max per head over the 8 lanes of one t (3 shuffles); p = exp(x - max), the running sum kept per lane (added
//      over lanes at the end) and the accumulators rescaled;
//   3. O^T += V^T P^T (M = head_dim in steps of 16, N = 8 head slots, K = the 16 tokens): V^T by ldmatrix.trans
//      from the same stage, P^T from the logits' registers by movmatrix (the accumulator layout of S^T, transposed,
//      is the B layout), rounded to the query dtype as FlashAttention-2 rounds P.
// At the end of a partition (merge_warps_and_write) the four warps' (max, sum, output) are merged in shared memory in
// warp order (the same bits on every run) and written: out = O / sum in single pass (row_sum: with the sink;
// row_lse), the partition's record in split-KV.
// Shared blocks (shared_blocks.cuh, split-KV): the thread blocks past num_seqs serve the tasks of a shared-blocks
// plan, their head slots holding several rows' heads; a row's own thread blocks skip the partitions a task computes
// for it. Only a head slot's row and head differ (with ALiBi a task's rows have one length): the loop is the same.
#pragma once

#include "attention_math.cuh"
#include "attention_params.cuh"
#include "cp_async.cuh"
#include "mma.cuh"
#include "shared_blocks.cuh"

namespace paged_attn {

constexpr int kDecodeWarps = kAttentionThreads / 32;
constexpr int kDecodeSlots = 8;  // head slots of a thread block: N of the m16n8k16 products (kMaxGroup)
static_assert(kMaxGroup <= kDecodeSlots, "a thread block's heads fit the N = 8 of one product");
static_assert(kSharedRows == kDecodeSlots, "a shared-blocks task fills the head slots with its rows' heads");

// One warp's stages in shared memory: stage s holds K rows [kDecodeTile][ROW] then V rows [kDecodeTile][ROW].
template <typename T, int HEAD_DIM>
struct DecodeStages {
  static constexpr int ROW = HEAD_DIM + 8;               // elements per row: padded (decode_mma_shared_bytes)
  static constexpr int CACHE = kDecodeTile * ROW;        // one tile of one cache
  static constexpr int STAGE = 2 * CACHE;                // K, then V
  static constexpr int WARP = 2 * STAGE;                 // two stages
  static constexpr int NVEC = HEAD_DIM / 8;              // 16-byte vectors per row
  static constexpr int COPIES = kDecodeTile * NVEC / 32;  // cp.async per lane per tile and cache
  static constexpr int KSTEPS = HEAD_DIM / 16;           // k steps of S^T, and m steps of O^T
  static_assert(HEAD_DIM % 16 == 0 && kDecodeTile * NVEC % 32 == 0, "whole 16 x 16 matrices, whole copies per lane");
  static_assert(WARP * kDecodeWarps * static_cast<int>(sizeof(T)) == decode_mma_shared_bytes(HEAD_DIM),
                "the launch plan's shared memory");
};

// The tile's two block-table entries' K/V rows of kv head `kv_head`: rows 0-7 of the tile lie in block
// entry[0], rows 8-15 in entry[1] (the same block unless block_size is 8).
struct TileBlocks {
  int32_t entry[2];
};

// Loads the block-table entries of tile `tile` (its tokens 16 tile .. 16 tile + 15): those that hold a token
// before `end` (an entry past the sequence's last block may be garbage, or past the table's row).
__device__ __forceinline__ TileBlocks load_tile_blocks(const int32_t* block_table, int tile, int end,
                                                       int block_shift) {
  const int first = tile * kDecodeTile;
  const int index0 = first >> block_shift, index1 = (first + 8) >> block_shift;
  TileBlocks blocks;
  blocks.entry[0] = block_table[index0];
  blocks.entry[1] = index1 != index0 && first + 8 < end ? block_table[index1] : blocks.entry[0];
  return blocks;
}

// Step 0's per-lane constants: the lane's COPIES vectors of a tile's rows (copy c = lane + 32 i: row c / NVEC,
// vector c % NVEC), as element offsets from the row's 8-row group in its block (the same for every tile: the
// launcher takes this kernel only where 8 token strides fit in int32).
template <int HEAD_DIM>
struct TileCopies {
  static constexpr int NVEC = HEAD_DIM / 8, COPIES = kDecodeTile * NVEC / 32;
  int lane;
  int row[COPIES];                   // the copy's row in the tile, 0-15
  int key_offset[COPIES], value_offset[COPIES];  // (row % 8) * token_stride + 8 * vector

  template <typename T>
  __device__ __forceinline__ TileCopies(const PagedCache<const T>& key_cache, const PagedCache<const T>& value_cache,
                                        int lane_)
      : lane(lane_) {
#pragma unroll
    for (int i = 0; i < COPIES; ++i) {
      const int c = lane + 32 * i, vec = c % NVEC;  // NVEC is a constant: no division
      row[i] = c / NVEC;
      key_offset[i] = (row[i] % 8) * static_cast<int>(key_cache.token_stride) + 8 * vec;
      value_offset[i] = (row[i] % 8) * static_cast<int>(value_cache.token_stride) + 8 * vec;
    }
  }
};

// The first K or V element of the 8-row groups of tile `tile` (rows 0-7 and 8-15) of kv head `kv_head`.
template <typename T>
__device__ __forceinline__ void tile_groups(const T* (&group)[2], const PagedCache<const T>& cache,
                                            const TileBlocks& blocks, int kv_head, int tile) {
  const int offset_mask = cache.block_size - 1;  // a power of two: 8, 16 or 32
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int first = tile * kDecodeTile + 8 * e;
    group[e] = cache.data + static_cast<int64_t>(blocks.entry[e]) * cache.block_stride +
               (first & offset_mask) * cache.token_stride + kv_head * cache.head_stride;
  }
}

// Step 0: starts the copies of tile `tile`'s K and V rows into `stage`: the rows of tokens outside [begin, end)
// are zero-filled and not read (their addresses, from block-table entries that may be garbage, are never used).
template <typename T, int HEAD_DIM>
__device__ __forceinline__ void copy_tile(T* stage, const TileCopies<HEAD_DIM>& copies,
                                          const PagedCache<const T>& key_cache,
                                          const PagedCache<const T>& value_cache, const TileBlocks& blocks,
                                          int kv_head, int tile, int begin, int end) {
  using S = DecodeStages<T, HEAD_DIM>;
  const T* k_group[2];
  const T* v_group[2];
  tile_groups(k_group, key_cache, blocks, kv_head, tile);
  tile_groups(v_group, value_cache, blocks, kv_head, tile);
  const unsigned first_rel = static_cast<unsigned>(tile * kDecodeTile - begin);  // token - begin, for row 0
  const unsigned count = static_cast<unsigned>(end - begin);
#pragma unroll
  for (int i = 0; i < S::COPIES; ++i) {
    const int row = copies.row[i];
    const bool in_bounds = first_rel + row < count;  // begin <= token < end
    T* dst = stage + row * S::ROW + 8 * (copies.lane + 32 * i - row * S::NVEC);  // 8 * vector
    cp_async_16(dst, (row < 8 ? k_group[0] : k_group[1]) + copies.key_offset[i], in_bounds);
    cp_async_16(dst + S::CACHE, (row < 8 ? v_group[0] : v_group[1]) + copies.value_offset[i], in_bounds);
  }
}

// Q^T as the B fragments of S^T = K Q^T, one per k step: lane (g, t) holds head slot g's elements 16 s + 2t, + 1
// and 16 s + 8 + 2t, + 1, unscaled (exact in T), zero for a slot without a head (has = false). query: slot g's row
// of the query (read only when has).
template <typename T, int HEAD_DIM>
__device__ __forceinline__ void load_query_fragments(uint32_t (&q)[HEAD_DIM / 16][2], const T* query, bool has,
                                                     int lane) {
  const int t = lane % 4;
#pragma unroll
  for (int s = 0; s < HEAD_DIM / 16; ++s) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int d = 16 * s + 8 * half + 2 * t;
      q[s][half] = has ? pack2<T>(to_float(query[d]), to_float(query[d + 1])) : 0u;
    }
  }
}

// This lane's share of its warp's online softmax over a partition (steps 1-3): O^T, and the running max and sum of
// head slots 2t and 2t + 1 (the sum over this lane's tokens only; the warp's lanes are added at the merge).
template <int HEAD_DIM>
struct LaneState {
  float acc[HEAD_DIM / 16][4];  // O^T: m step j, (dim 16 j + g (+ 8), head slot 2t (+ 1))
  float run_max[2], run_sum[2];

  __device__ __forceinline__ LaneState() {
#pragma unroll
    for (int j = 0; j < HEAD_DIM / 16; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    run_max[0] = run_max[1] = -INFINITY;
    run_sum[0] = run_sum[1] = 0.0f;
  }
};

// Step 1: S^T = K Q^T for the tile in k_stage. x: (token g, slot 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1).
template <typename T, int HEAD_DIM>
__device__ __forceinline__ void tile_logits(float (&x)[4], const T* k_stage, int k_lds,
                                            const uint32_t (&q)[HEAD_DIM / 16][2]) {
  x[0] = x[1] = x[2] = x[3] = 0.0f;
#pragma unroll
  for (int s = 0; s < HEAD_DIM / 16; ++s) {
    uint32_t a[4];
    ldmatrix_x4(a, k_stage + k_lds + 16 * s);
    mma_m16n8k16<T>(x, a, q[s], x);
  }
}

// Step 2: the online softmax over the tile's 16 tokens, per head slot: x becomes p = exp(logit - max) (0 outside
// [begin, end)), the running max and sum move on and O^T is rescaled. token0: the token of x[0] (16 tile + g).
template <typename T, int HEAD_DIM>
__device__ __forceinline__ void tile_softmax(float (&x)[4], LaneState<HEAD_DIM>& state, const AttentionParams<T>& p,
                                             const AttentionTask& task, const float (&slope)[2], float inv_soft_cap,
                                             int token0) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int token = token0 + (k >= 2 ? 8 : 0);
    float logit = x[k] * p.scale;
    if (p.logits_soft_cap > 0.0f) logit = p.logits_soft_cap * fast_tanh(logit * inv_soft_cap);
    logit += slope[k % 2] * static_cast<float>(token - (task.seq_len - 1));
    x[k] = token >= task.begin && token < task.end ? logit : -INFINITY;
  }
  float rescale[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float tile_max = fmaxf(x[h], x[h + 2]);
#pragma unroll
    for (int mask = 4; mask < 32; mask *= 2) {
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, mask));
    }
    const float new_max = fmaxf(state.run_max[h], tile_max);
    const float base = new_max == -INFINITY ? 0.0f : new_max;  // p = 0, never exp(-inf - -inf) = NaN
    x[h] = __expf(x[h] - base), x[h + 2] = __expf(x[h + 2] - base);
    rescale[h] = __expf(state.run_max[h] - base);  // 0 on the first tile with a token (run_max = -inf)
    state.run_sum[h] = state.run_sum[h] * rescale[h] + (x[h] + x[h + 2]);
    state.run_max[h] = new_max;
  }
#pragma unroll
  for (int j = 0; j < HEAD_DIM / 16; ++j) {
    state.acc[j][0] *= rescale[0], state.acc[j][1] *= rescale[1];
    state.acc[j][2] *= rescale[0], state.acc[j][3] *= rescale[1];
  }
}

// Step 3: O^T += V^T P^T for the tile in v_stage: P^T's B fragment is the transpose of P's accumulator-layout halves
// (tokens 0-7, 8-15), rounded to T.
template <typename T, int HEAD_DIM>
__device__ __forceinline__ void tile_values(float (&acc)[HEAD_DIM / 16][4], const float (&x)[4], const T* v_stage,
                                            int v_lds) {
  const uint32_t pt[2] = {movmatrix_trans(pack2<T>(x[0], x[1])), movmatrix_trans(pack2<T>(x[2], x[3]))};
#pragma unroll
  for (int j = 0; j < HEAD_DIM / 16; ++j) {
    uint32_t a[4];
    ldmatrix_x4_trans(a, v_stage + v_lds + 16 * j);
    mma_m16n8k16<T>(acc[j], a, pt, acc[j]);
  }
}

// Steps 0-3 over this warp's tiles of the task's partition [task.begin, task.end) (tiles first + warp, + 4, ...),
// two stages in flight: leaves the warp's state in `state`.
template <typename T, int HEAD_DIM>
__device__ __forceinline__ void attend_warp_tiles(LaneState<HEAD_DIM>& state, const AttentionParams<T>& p,
                                                  const AttentionTask& task, T* stages,
                                                  const TileCopies<HEAD_DIM>& copies, const int32_t* block_table,
                                                  int block_shift, const uint32_t (&q)[HEAD_DIM / 16][2],
                                                  const float (&slope)[2], float inv_soft_cap, int warp, int g,
                                                  int k_lds, int v_lds) {
  using S = DecodeStages<T, HEAD_DIM>;
  const int tile_end = (task.end + kDecodeTile - 1) / kDecodeTile;
  int tile = task.begin / kDecodeTile + warp;  // this warp's next tile to compute
  // The pipeline: tile in stage 0, the next (tile + kDecodeWarps) copied during its computation.
  if (tile < tile_end) {
    copy_tile<T, HEAD_DIM>(stages, copies, p.key_cache, p.value_cache,
                           load_tile_blocks(block_table, tile, task.end, block_shift), task.kv_head, tile, task.begin,
                           task.end);
  }
  cp_async_commit();
  TileBlocks next_blocks{};
  if (tile + kDecodeWarps < tile_end) {
    next_blocks = load_tile_blocks(block_table, tile + kDecodeWarps, task.end, block_shift);
  }
  for (int stage = 0; tile < tile_end; tile += kDecodeWarps, stage ^= 1) {
    // 0. The next tile into the other stage (free: the last tile's __syncwarp below), and its successor's
    //    block-table entries.
    const int next = tile + kDecodeWarps;
    if (next < tile_end) {
      copy_tile<T, HEAD_DIM>(stages + (stage ^ 1) * S::STAGE, copies, p.key_cache, p.value_cache, next_blocks,
                             task.kv_head, next, task.begin, task.end);
      if (next + kDecodeWarps < tile_end) {
        next_blocks = load_tile_blocks(block_table, next + kDecodeWarps, task.end, block_shift);
      }
    }
    cp_async_commit();
    cp_async_wait<1>();  // this tile's group is complete (the next one's may be pending)
    __syncwarp();        // and every lane's copies of it are visible to the whole warp
    const T* k_stage = stages + stage * S::STAGE;
    const T* v_stage = k_stage + S::CACHE;
    float x[4];
    tile_logits<T, HEAD_DIM>(x, k_stage, k_lds, q);                                             // 1. S^T = K Q^T
    tile_softmax<T, HEAD_DIM>(x, state, p, task, slope, inv_soft_cap, tile * kDecodeTile + g);  // 2. softmax
    tile_values<T, HEAD_DIM>(state.acc, x, v_stage, v_lds);                                     // 3. O^T += V^T P^T
    __syncwarp();  // every lane is done with this stage before the next iteration copies into it
  }
  cp_async_wait_all();  // (only empty groups are left)
}

// The shared memory of the merge: each warp's record (over the stages, once every warp is done with them), then
// per head slot the warps' weights, the total and the max.
struct MergeScratch {
  float* out;                     // [kDecodeWarps][kDecodeSlots][HEAD_DIM]
  float* max;                     // [kDecodeWarps][kDecodeSlots]
  float* sum;                     // [kDecodeWarps][kDecodeSlots]
  float (*weight)[kDecodeSlots];  // [kDecodeWarps][kDecodeSlots]: each warp's exp(max_w - max)
  float* total;                   // [kDecodeSlots]: the sum over warps of weight * sum_w
  float* max_all;                 // [kDecodeSlots]: the max over warps
};

// The end of a partition: the four warps' (max, sum, O) merged in warp order (the same bits on every run), then
// written: out = O / sum and lse in single pass (row_sum, row_lse: with the sink), the partition's record in
// split-KV.
template <typename T, int HEAD_DIM>
__device__ __forceinline__ void merge_warps_and_write(LaneState<HEAD_DIM>& state, const MergeScratch& m,
                                                      const AttentionParams<T>& p, const AttentionTask& task,
                                                      bool task_block, const SharedBlocksState& share, int warp,
                                                      int g, int t) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int mask = 4; mask < 32; mask *= 2) state.run_sum[h] += __shfl_xor_sync(0xffffffffu, state.run_sum[h], mask);
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < HEAD_DIM / 16; ++j) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int slot = 2 * t + k % 2, d = 16 * j + g + (k >= 2 ? 8 : 0);
      m.out[(warp * kDecodeSlots + slot) * HEAD_DIM + d] = state.acc[j][k];
    }
  }
  if (g == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      m.max[warp * kDecodeSlots + 2 * t + h] = state.run_max[h];
      m.sum[warp * kDecodeSlots + 2 * t + h] = state.run_sum[h];
    }
  }
  __syncthreads();
  const int64_t row = p.num_partitions == 1 ? query_row(p) : 0;
  const int num_slots = task_block ? kDecodeSlots : task.num_heads;
  if (static_cast<int>(threadIdx.x) < num_slots) {
    const int slot = threadIdx.x;
    float max_all = -INFINITY;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) max_all = fmaxf(max_all, m.max[w * kDecodeSlots + slot]);
    const float base = max_all == -INFINITY ? 0.0f : max_all;
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      // every warp is added, also at weight 0 (0 * NaN = NaN: a NaN sum or output makes the row NaN)
      const float weight = __expf(m.max[w * kDecodeSlots + slot] - base);
      m.weight[w][slot] = weight;
      total += weight * m.sum[w * kDecodeSlots + slot];
    }
    m.total[slot] = total, m.max_all[slot] = max_all;
  }
  __syncthreads();
  for (int k = threadIdx.x; k < num_slots * HEAD_DIM; k += kAttentionThreads) {
    const int slot = k / HEAD_DIM, d = k % HEAD_DIM;
    float o = 0.0f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) o += m.weight[w][slot] * m.out[(w * kDecodeSlots + slot) * HEAD_DIM + d];
    if (p.num_partitions == 1) {
      // the task has tokens, so total >= 1, or NaN, or 0 (every logit -inf: NaN)
      const float sink = sink_of(p.sinks, task.first_head + slot);
      const int64_t out_row = row * p.num_heads + task.first_head + slot;
      from_float(p.out[out_row * HEAD_DIM + d], o / row_sum(m.max_all[slot], m.total[slot], sink));
      if (d == 0 && p.lse != nullptr) p.lse[out_row] = row_lse(m.max_all[slot], m.total[slot], sink);
    } else {
      const int item = task_block ? share.slot_item[slot] : static_cast<int>(blockIdx.x);
      if (item < 0) continue;  // a task's slot without a row
      const int head = task_block ? share.slot_head[slot] : task.first_head + slot;
      const int64_t record = (static_cast<int64_t>(item) * p.num_heads + head) * p.num_partitions + task.partition;
      p.partial_out[record * HEAD_DIM + d] = o;
      if (d == 0) p.partial_max[record] = m.max_all[slot], p.partial_sum[record] = m.total[slot];
    }
  }
  __syncthreads();  // the merge is done with shared memory before the next partition's copies
}

// The kernel: the item's task (or a shared-blocks task), this lane's constants and query fragments, then per
// partition of the item: attend_warp_tiles (steps 0-3), merge_warps_and_write. Shared memory:
// decode_mma_shared_bytes(HEAD_DIM) bytes, dynamic (the plan's shared_bytes): the warps' stages, then (after each
// partition) the warps' records for the merge.
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kAttentionThreads) decode_mma_kernel(const AttentionParams<T> p) {
  using S = DecodeStages<T, HEAD_DIM>;
  PA_EXTERN_SHARED(uint4, shared_u4);
  PA_SHARED(float, weight_s, [kDecodeWarps][kDecodeSlots]);  // merge: each warp's weight exp(max_w - max)
  PA_SHARED(float, total_s, [kDecodeSlots]);                 // merge: the sum over warps of weight * sum_w
  PA_SHARED(float, max_all_s, [kDecodeSlots]);               // merge: the max over warps
  T* const shared = reinterpret_cast<T*>(shared_u4);
  // The merge's records, over the stages (after every warp is done with them).
  float* const out_s = reinterpret_cast<float*>(shared_u4);  // [kDecodeWarps][kDecodeSlots][HEAD_DIM]
  float* const max_s = out_s + kDecodeWarps * kDecodeSlots * HEAD_DIM;  // [kDecodeWarps][kDecodeSlots]
  float* const sum_s = max_s + kDecodeWarps * kDecodeSlots;             // [kDecodeWarps][kDecodeSlots]
  const MergeScratch merge{out_s, max_s, sum_s, weight_s, total_s, max_all_s};

  PA_SHARED(SharedBlocksState, share_s, [1]);               // shared blocks (split-KV with a plan)

  // A shared-blocks task's thread block (blockIdx.x >= num_seqs): its task's partitions, read through the block
  // table of its reference sequence, for its rows' head slots (plan_task_block); a row's: its row, but not the
  // partitions that tasks compute for it (plan_row_block).
  const bool sharing = p.num_shared_tasks > 0 && p.num_partitions > 1 && p.rows == QueryRows::kLastOfEachSeq;
  // (only with a plan: grid.x = num_seqs + its tasks; with kEveryRow the items are query rows, past num_seqs)
  const bool task_block = sharing && static_cast<int>(blockIdx.x) >= p.num_seqs;
  const int shared_task = static_cast<int>(blockIdx.x) - p.num_seqs;
  AttentionTask task = task_block ? shared_blocks_task(p, shared_task) : attention_task(p);
  if (!task.active) return;  // uniform across the thread block
  if (p.num_partitions == 1 && task.begin >= task.end) {  // uniform across the thread block
    write_empty<T, T, HEAD_DIM>(p, task);
    return;
  }
  // The partitions to skip (share_s[0].skip_*): a row's block, those that tasks compute for its row; a task's,
  // those past its range. (Read from shared memory in the loop: held in registers, they cost the loop ~10%.)
  if (task_block) {
    if (plan_task_block(p, share_s[0], shared_task, task.first_head, task.num_heads) == 0) return;  // uniform
  } else if (sharing) {
    plan_row_block(p, share_s[0], task.seq);
  }
  const int first_partition =
      task_block ? task.begin / p.partition_size : window_start(task.seq_len, p.sliding_window) / p.partition_size;
  int partition = task.partition;
  if (partition < first_partition) {
    partition += (first_partition - partition + gridDim.z - 1) / gridDim.z * gridDim.z;
  }
  if (static_cast<int64_t>(partition) * p.partition_size >= task.seq_len) return;  // no partition with tokens

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  T* const stages = shared + warp * S::WARP;
  const int32_t* block_table = p.block_tables + static_cast<int64_t>(task.seq) * p.max_blocks_per_seq;
  const int block_shift = p.key_cache.block_size == 8 ? 3 : p.key_cache.block_size == 16 ? 4 : 5;  // 8, 16, 32
  const float inv_soft_cap = p.logits_soft_cap > 0.0f ? 1.0f / p.logits_soft_cap : 0.0f;
  // This lane's two head slots, 2t and 2t + 1: their ALiBi slopes (0 past the task's heads). (The position is
  // seq_len - 1 for every slot: with ALiBi a task's rows have its reference sequence's length.)
  float slope[2] = {0.0f, 0.0f};
  if (p.alibi_slopes != nullptr) {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int slot = 2 * t + k;
      const bool has = task_block ? share_s[0].slot_item[slot] >= 0 : slot < task.num_heads;
      const int head = task_block ? share_s[0].slot_head[slot] : task.first_head + slot;
      slope[k] = has ? p.alibi_slopes[head] : 0.0f;
    }
  }
  const TileCopies<HEAD_DIM> copies(p.key_cache, p.value_cache, lane);
  // ldmatrix row addresses within a tile (lane l passes row l % 8 of matrix l / 8):
  //   K (A of S^T, non-transposed): matrix m = (tokens 8 (m & 1) .., dims 8 (m >> 1) ..) of each 16 x 16 operand;
  //   V (A of O^T = V^T .., transposed): matrix m = (tokens 8 (m >> 1) .., dims 8 (m & 1) ..).
  const int k_lds = (lane % 8 + 8 * ((lane / 8) & 1)) * S::ROW + 8 * (lane / 16);
  const int v_lds = (lane % 8 + 8 * (lane / 16)) * S::ROW + 8 * ((lane / 8) & 1);
  uint32_t q[S::KSTEPS][2];
  if (task_block) {  // slot g: (row slot_item[g], head slot_head[g]); the row of a decode item is its sequence
    const int item = share_s[0].slot_item[g];
    load_query_fragments<T, HEAD_DIM>(
        q, p.query + max(item, 0) * p.query_row_stride + share_s[0].slot_head[g] * p.query_head_stride, item >= 0,
        lane);
  } else {
    const bool has = g < task.num_heads;
    load_query_fragments<T, HEAD_DIM>(
        q, p.query + query_row(p) * p.query_row_stride + (task.first_head + (has ? g : 0)) * p.query_head_stride,
        has, lane);
  }

  for (; static_cast<int64_t>(partition) * p.partition_size < task.seq_len; partition += gridDim.z) {
    if (sharing && skipped(share_s[0], partition)) continue;  // uniform
    if (task_block) {  // the whole partition: every row of the task sees it all
      task.partition = partition, task.begin = partition * p.partition_size, task.end = task.begin + p.partition_size;
    } else {
      set_partition(task, p, partition);  // begin < end: partition >= first_partition
    }
    LaneState<HEAD_DIM> state;
    attend_warp_tiles<T, HEAD_DIM>(state, p, task, stages, copies, block_table, block_shift, q, slope, inv_soft_cap,
                                   warp, g, k_lds, v_lds);
    merge_warps_and_write<T, HEAD_DIM>(state, merge, p, task, task_block, share_s[0], warp, g, t);
  }
}

}  // namespace paged_attn
