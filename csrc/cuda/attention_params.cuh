// The task geometry of the attention kernels on CUDA (device code), from AttentionParams (attention_params.h) and
// blockIdx; see attention_params.h for what each kernel is given.
#pragma once

#include <cstdint>

#include "attention_params.h"
#include "device.cuh"

namespace paged_attn {

// ---------------------------------------------------------------------------------------------------------------
// What one thread block of paged_attention_kernel works on (from blockIdx), and the sequence extent both kernels
// derive from seq_lens and query_start_loc. Invalid values (validation is opt-in on CUDA) are clamped, so that no
// kernel reads past a sequence's row of the block table, or past the query and output tensors.

// seq_lens[seq], clamped to [0, max_context].
template <typename T, typename C>
__device__ __forceinline__ int clamped_seq_len(const AttentionParams<T, C>& p, int seq) {
  const int len = p.seq_lens[seq];
  return len < 0 ? 0 : len > p.max_context ? p.max_context : len;
}

// Sequence seq's query rows [first, last), from query_start_loc clamped to [0, num_tokens].
struct QueryRange {
  int first, last;
  __device__ __forceinline__ int count() const { return last - first; }
};
template <typename T, typename C>
__device__ __forceinline__ QueryRange query_range(const AttentionParams<T, C>& p, int seq) {
  const int first = min(max(p.query_start_loc[seq], 0), p.num_tokens);
  return {first, min(max(p.query_start_loc[seq + 1], first), p.num_tokens)};
}

// The sequence a query row belongs to: the last s with query_start_loc[s] <= row (binary search).
template <typename T, typename C>
__device__ __forceinline__ int seq_of_row(const AttentionParams<T, C>& p, int row) {
  int lo = 0, hi = p.num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.query_start_loc[mid] <= row) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// A decode kernel's item (blockIdx.x): the query row it serves, the row's sequence, and the row's length (its
// position + 1: the tokens it attends to, before the window). active = false: not this launch's row.
struct QueryItem {
  int seq;
  int64_t row;
  int seq_len;
  bool active;
};

template <typename T, typename C>
__device__ __forceinline__ QueryItem query_item(const AttentionParams<T, C>& p, int item) {
  if (p.rows == QueryRows::kLastOfEachSeq) return {item, item, clamped_seq_len(p, item), true};
  if (p.rows == QueryRows::kSingleTokenSeqs) {
    const QueryRange range = query_range(p, item);
    return {item, range.first, clamped_seq_len(p, item), range.count() == 1};
  }
  const int seq = seq_of_row(p, item);
  const QueryRange range = query_range(p, seq);
  const int i = item - range.first;  // the row's place among its sequence's rows
  // position L - q_s + i; a row outside its range (only with an invalid query_start_loc) attends to nothing
  const int len = i >= 0 && i < range.count() ? clamped_seq_len(p, seq) - range.count() + i + 1 : 0;
  return {seq, item, max(len, 0), true};
}

__device__ __forceinline__ int window_start(int seq_len, int sliding_window) {
  return sliding_window > 0 && seq_len > sliding_window ? seq_len - sliding_window : 0;
}

// The query heads of this thread block's grid row blockIdx.y: kv head blockIdx.y / blocks_per_group, and its part
// (blockIdx.y % blocks_per_group) of the head group, [first_head, first_head + num_heads), 1 <= num_heads <=
// heads_per_block. Every kernel of the decode and prefill grids maps blockIdx.y so.
struct BlockHeads {
  int kv_head, first_head, num_heads;
};
template <typename T, typename C>
__device__ __forceinline__ BlockHeads block_heads(const AttentionParams<T, C>& p) {
  BlockHeads heads;
  heads.kv_head = blockIdx.y / p.blocks_per_group;
  const int first_in_group = (blockIdx.y % p.blocks_per_group) * p.heads_per_block;
  heads.first_head = heads.kv_head * p.group_size + first_in_group;
  heads.num_heads = min(p.heads_per_block, p.group_size - first_in_group);
  return heads;
}

// NOTE: the query row is not kept here: it is live only at the start and the end, and ptxas spilled registers when
// it was held through the token loop. query_row(p) finds it again.
struct AttentionTask {
  int seq, kv_head;
  bool active;                // false: not this launch's row (kSingleTokenSeqs), nothing to do
  int first_head, num_heads;  // query heads [first_head, first_head + num_heads), 1 <= num_heads <= heads_per_block
  int partition;
  int seq_len;                // the row's length (position + 1), clamped
  int begin, end;             // the partition's tokens in the window: [begin, end), empty when begin >= end

  // Whether the block's g-th head slot holds a head. Known at compile time for g = 0 (fewer predicates to keep
  // live: ptxas spilled them in the 1-head variant).
  __device__ __forceinline__ bool has_head(int g) const { return g == 0 || g < num_heads; }
};

// The query (and output) row of this thread block's item.
template <typename T, typename C>
__device__ __forceinline__ int64_t query_row(const AttentionParams<T, C>& p) {
  return query_item(p, blockIdx.x).row;
}

// Points the task at one partition: its tokens in the window, [begin, end) (empty when begin >= end).
template <typename T, typename C>
__device__ __forceinline__ void set_partition(AttentionTask& task, const AttentionParams<T, C>& p, int partition) {
  task.partition = partition;
  const int64_t partition_begin = static_cast<int64_t>(partition) * p.partition_size;
  const int64_t partition_end = partition_begin + p.partition_size;
  const int start = window_start(task.seq_len, p.sliding_window);
  task.begin = partition_begin > start ? static_cast<int>(partition_begin) : start;
  task.end = partition_end < task.seq_len ? static_cast<int>(partition_end) : task.seq_len;
}

// The task of this thread block's first partition (blockIdx.z); set_partition moves it to another.
template <typename T, typename C>
__device__ __forceinline__ AttentionTask attention_task(const AttentionParams<T, C>& p) {
  AttentionTask task;
  const QueryItem item = query_item(p, blockIdx.x);
  task.seq = item.seq, task.active = item.active;
  const BlockHeads heads = block_heads(p);
  task.kv_head = heads.kv_head, task.first_head = heads.first_head, task.num_heads = heads.num_heads;
  task.seq_len = item.seq_len;
  set_partition(task, p, static_cast<int>(blockIdx.z));
  return task;
}

}  // namespace paged_attn
