// Shared blocks on CUDA: decode rows whose block tables hold the same physical blocks at the same positions (the
// samples or beams of one prompt, requests behind one cached system prompt) have those blocks read once per kv
// head for several rows, instead of once per row. The tensor-core decode kernel (decode_mma_kernels.cuh), split-KV.
//
// The plan comes from the host (paged_attn.plan_shared_blocks, from block tables and lengths the caller has there:
// no device-to-host copy, so the launch stays capturable), int32 [num_shared_tasks, kSharedPlanColumns]:
//   plan[i] = (ref, first_block, end_block, row_0, ..., row_7)      (-1 past the task's last row)
// Task i's partitions are the whole split-KV partitions inside tokens [first_block * block_size, end_block *
// block_size): [begin, end) = [ceil(first_block * block_size / ps), floor(end_block * block_size / ps)), ps the
// launch's partition size (empty when begin >= end). The task's thread blocks (grid.x = num_seqs + i, one per kv
// head, part of its head group and partition slot, as a row's own) read those partitions' K and V once, through
// ref's block table, for the head slots of its rows (row j in slots j * heads_per_block + h), and write each row's
// partition records as the row's own thread block would have: the same products per head slot (a column of an mma
// does not depend on the others), the same softmax and merge, so the same bits. The reduce is unchanged.
//
// A listing (task i, place j, row r) is used (the task writes r's records of [begin, end) and r's own thread
// blocks skip those partitions) if and only if:
//   (a) j < kSharedRows / heads_per_block (the rows whose heads fit the block's head slots), and r and ref are
//       sequences of the call;
//   (b) begin < end, r's length is at least end * ps, and r's window starts at or before begin * ps (the task
//       computes whole partitions, every token visible); with ALiBi, r's length is ref's (the bias of a slot is
//       taken from one position per thread block: a per-slot position cost the loop ~5% of its instructions);
//   (c) r's block-table entries over those partitions' blocks equal ref's;
//   (d) r is listed at most kMaxRowListings times in the plan, and no other listing of r (in another task, or
//       again in this one) has a range that overlaps [begin, end).
// Both sides evaluate this rule on the same tables, so each record is written exactly once whatever the plan holds:
// a plan that does not match the tables it is used with costs time, never a wrong result. (d) bounds the listings a
// thread block looks at; plan_shared_blocks lists a row at most 7 times (its tasks hold rows of one group of at
// most kSharedRows rows: csrc/shared_blocks.cpp), so its plans lose no listing to it at any depth.
#pragma once

#include "attention_params.cuh"

namespace paged_attn {

constexpr int kMaxRowListings = 8;  // listings of one row that count (rule d)

// The split-KV partitions [begin, end) that task `task` computes (before the rows' checks).
struct SharedRange {
  int begin, end;
};

template <typename T, typename C>
__device__ __forceinline__ SharedRange shared_range(const AttentionParams<T, C>& p, int task) {
  const int32_t* entry = p.shared_plan + static_cast<int64_t>(task) * kSharedPlanColumns;
  const int64_t first = entry[1], end = entry[2];
  if (first < 0 || end > p.max_blocks_per_seq || first >= end) return {0, 0};
  const int64_t block_size = p.key_cache.block_size, ps = p.partition_size;
  const int64_t last = min(end * block_size / ps, static_cast<int64_t>(p.num_partitions));
  return {static_cast<int>((first * block_size + ps - 1) / ps), static_cast<int>(last)};
}

// A decode thread block's view of the plan, in shared memory.
struct SharedBlocksState {
  int rows[kSharedRows];                      // the rows whose listings are looked up (-1: none)
  int count[kSharedRows];                     // each one's listings in the plan (all of them counted)
  int listing[kSharedRows][kMaxRowListings];  // the first kMaxRowListings found: task * kSharedRows + place
  int skip_begin[kMaxRowListings];            // the partition ranges the block skips: a row's block, those that
  int skip_end[kMaxRowListings];              // tasks compute for its row; a task's block, those past its range
  int num_skip;
  int slot_item[kSharedRows];                 // a task's block: the row of each of its head slots, -1: none
  int slot_head[kSharedRows];                 // and the slot's query head
};

// The listings of s.rows[0 .. n) in the plan (the whole thread block; s.rows written before the call).
template <typename T, typename C>
__device__ __forceinline__ void find_listings(const AttentionParams<T, C>& p, SharedBlocksState& s, int n) {
  if (threadIdx.x < kSharedRows) s.count[threadIdx.x] = 0;
  __syncthreads();
  const int64_t entries = static_cast<int64_t>(p.num_shared_tasks) * kSharedRows;
  for (int64_t e = threadIdx.x; e < entries; e += kAttentionThreads) {
    const int task = static_cast<int>(e / kSharedRows), place = static_cast<int>(e % kSharedRows);
    const int row = p.shared_plan[static_cast<int64_t>(task) * kSharedPlanColumns + 3 + place];
    for (int k = 0; k < n; ++k) {
      if (row >= 0 && row == s.rows[k]) {
        const int at = atomicAdd(&s.count[k], 1);
        if (at < kMaxRowListings) s.listing[k][at] = task * kSharedRows + place;
      }
    }
  }
  __syncthreads();
}

// Rules (a), (b) and (d) for listing `listing` of s.rows[k] (the same answer in every thread).
template <typename T, typename C>
__device__ __forceinline__ bool listing_fits(const AttentionParams<T, C>& p, const SharedBlocksState& s, int k,
                                             int listing) {
  const int row = s.rows[k], count = s.count[k];
  const int task = listing / kSharedRows, place = listing % kSharedRows;
  const int ref = p.shared_plan[static_cast<int64_t>(task) * kSharedPlanColumns];
  if (row < 0 || row >= p.num_seqs || ref < 0 || ref >= p.num_seqs || count > kMaxRowListings ||
      place >= kSharedRows / p.heads_per_block) {
    return false;
  }
  const SharedRange range = shared_range(p, task);
  const int64_t ps = p.partition_size;
  const int seq_len = clamped_seq_len(p, row);
  if (range.begin >= range.end || seq_len < range.end * ps ||
      window_start(seq_len, p.sliding_window) > range.begin * ps ||
      (p.alibi_slopes != nullptr && seq_len != clamped_seq_len(p, ref))) {
    return false;
  }
  for (int o = 0; o < count; ++o) {
    const int other = s.listing[k][o];
    if (other == listing) continue;
    const SharedRange r = shared_range(p, other / kSharedRows);
    if (r.begin < r.end && r.begin < range.end && range.begin < r.end) return false;
  }
  return true;
}

// Rule (c): whether row's block-table entries equal ref's over the blocks of the partitions (all threads call it).
template <typename T, typename C>
__device__ __forceinline__ bool same_blocks(const AttentionParams<T, C>& p, int row, int ref, SharedRange range) {
  const int64_t block_size = p.key_cache.block_size, ps = p.partition_size;
  const int64_t first = range.begin * ps / block_size, last = (range.end * ps + block_size - 1) / block_size;
  const int32_t* a = p.block_tables + static_cast<int64_t>(row) * p.max_blocks_per_seq;
  const int32_t* b = p.block_tables + static_cast<int64_t>(ref) * p.max_blocks_per_seq;
  bool same = true;
  for (int64_t i = first + threadIdx.x; i < last; i += kAttentionThreads) same = same && a[i] == b[i];
  return __syncthreads_and(same);
}

// The task of a shared-blocks task's thread block (attention_task's fields; seq: the reference sequence, whose
// block table it reads; seq_len: its length, or the end of the range if longer (the partitions past the range are
// skipped; ALiBi takes seq_len - 1 as the position); begin: the range's start). Not active without partitions.
template <typename T, typename C>
__device__ __forceinline__ AttentionTask shared_blocks_task(const AttentionParams<T, C>& p, int shared_task) {
  AttentionTask task;
  const int ref = p.shared_plan[static_cast<int64_t>(shared_task) * kSharedPlanColumns];
  const SharedRange range = shared_range(p, shared_task);
  task.seq = ref >= 0 && ref < p.num_seqs ? ref : 0;  // (read only if a row is listed validly: then ref is valid)
  task.active = range.begin < range.end;
  const BlockHeads heads = block_heads(p);
  task.kv_head = heads.kv_head, task.first_head = heads.first_head, task.num_heads = heads.num_heads;
  task.partition = static_cast<int>(blockIdx.z);
  task.begin = range.begin * p.partition_size;  // range.end * ps <= num_partitions * ps: within int32 (the plan)
  const int64_t range_end = static_cast<int64_t>(range.end) * p.partition_size;
  const int ref_len = ref >= 0 && ref < p.num_seqs ? clamped_seq_len(p, ref) : 0;
  task.seq_len = task.end = static_cast<int>(min(max(range_end, static_cast<int64_t>(ref_len)),
                                                 static_cast<int64_t>(INT32_MAX)));
  return task;
}

// A row's own thread block: the partitions that tasks compute for row `seq`, into s.skip_*.
template <typename T, typename C>
__device__ __forceinline__ void plan_row_block(const AttentionParams<T, C>& p, SharedBlocksState& s, int seq) {
  if (threadIdx.x == 0) s.rows[0] = seq;
  find_listings(p, s, 1);
  const int n = min(s.count[0], kMaxRowListings);
  int owned = 0;
  for (int m = 0; m < n; ++m) {  // uniform: the same values in every thread
    const int listing = s.listing[0][m], task = listing / kSharedRows;
    if (!listing_fits(p, s, 0, listing)) continue;
    const SharedRange range = shared_range(p, task);
    if (!same_blocks(p, seq, p.shared_plan[static_cast<int64_t>(task) * kSharedPlanColumns], range)) continue;
    if (threadIdx.x == 0) s.skip_begin[owned] = range.begin, s.skip_end[owned] = range.end;
    ++owned;
  }
  if (threadIdx.x == 0) s.num_skip = owned;
  __syncthreads();
}

// Whether the block skips `partition` (s.skip_*).
__device__ __forceinline__ bool skipped(const SharedBlocksState& s, int partition) {
  for (int m = 0; m < s.num_skip; ++m) {
    if (partition >= s.skip_begin[m] && partition < s.skip_end[m]) return true;
  }
  return false;
}

// A task's thread block (task = blockIdx.x - num_seqs; query heads [first_head, first_head + num_heads)): its rows'
// head slots into s.slot_item / s.slot_head; returns how many slots hold a row.
template <typename T, typename C>
__device__ __forceinline__ int plan_task_block(const AttentionParams<T, C>& p, SharedBlocksState& s, int task,
                                               int first_head, int num_heads) {
  const int32_t* entry = p.shared_plan + static_cast<int64_t>(task) * kSharedPlanColumns;
  if (threadIdx.x < kSharedRows) s.rows[threadIdx.x] = entry[3 + threadIdx.x];
  find_listings(p, s, kSharedRows);
  const SharedRange range = shared_range(p, task);
  const int rows_per_block = kSharedRows / p.heads_per_block;
  int slots = 0;
  for (int j = 0; j < rows_per_block; ++j) {  // uniform
    const bool ok = listing_fits(p, s, j, task * kSharedRows + j) && same_blocks(p, s.rows[j], entry[0], range);
    if (static_cast<int>(threadIdx.x) < p.heads_per_block) {
      const int slot = j * p.heads_per_block + threadIdx.x;
      s.slot_item[slot] = ok && static_cast<int>(threadIdx.x) < num_heads ? s.rows[j] : -1;
      s.slot_head[slot] = first_head + threadIdx.x;
    }
    slots += ok ? num_heads : 0;
  }
  for (int slot = rows_per_block * p.heads_per_block + threadIdx.x; slot < kSharedRows; slot += kAttentionThreads) {
    s.slot_item[slot] = -1, s.slot_head[slot] = first_head;
  }
  if (threadIdx.x == 0) s.num_skip = 1, s.skip_begin[0] = range.end, s.skip_end[0] = INT32_MAX;
  __syncthreads();
  return slots;
}

}  // namespace paged_attn
