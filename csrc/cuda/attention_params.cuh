// What the attention kernels on CUDA are given, and what a thread block of theirs works on; shared by all three:
// the CUDA-core decode and split-KV's reduce (attention_kernels.cuh), the tensor-core decode
// (decode_mma_kernels.cuh) and the tensor-core prefill (varlen_attention_kernels.cuh).
//   - AttentionParams: one struct, passed by value to every attention kernel; a launch fills it from the tensors
//     (csrc/cuda/attention.cu) and from its plan (launch_plan.h).
//   - The task geometry, from AttentionParams and blockIdx: a row's length (clamped_seq_len), a sequence's query
//     rows (query_range, seq_of_row), a decode item's row (query_item), a window's first token (window_start), a
//     grid row's query heads (block_heads) and a decode thread block's task and partition (AttentionTask).
// The arithmetic they share (conversions, warp reductions, the end of a row): attention_math.cuh.
//
// Which query rows a decode launch serves (params.rows, a QueryRows), and so what its grid.x counts ("items"):
//   kLastOfEachSeq    decode without query_start_loc: item = sequence = query row, P = seq_lens[s] - 1.
//   kSingleTokenSeqs  query_start_loc given: item = sequence; only sequences with exactly one query row take part
//                     (their row query_start_loc[s], P = seq_lens[s] - 1, so the same bits as decode); the others'
//                     thread blocks return at once (the tensor-core kernel serves them).
//   kEveryRow         query_start_loc given: item = query row, for every row (the float32 path, and head dims
//                     without a tensor-core instantiation); the row's sequence is found by binary search in
//                     query_start_loc, P = seq_lens[s] - q_s + i for its i-th of q_s rows.
#pragma once

#include <cstdint>

#include "device.cuh"
#include "launch_plan.h"
#include "paged_cache.cuh"

namespace paged_attn {

// ---------------------------------------------------------------------------------------------------------------
// Parameters: one struct, passed by value to every attention kernel (also the tensor-core ones).

enum class QueryRows : int { kLastOfEachSeq, kSingleTokenSeqs, kEveryRow };  // see the top of this file

// An fp8 cache element: one byte (float8_e4m3fn or float8_e5m2, AttentionParams::fp8_format says which).
using Fp8 = __nv_fp8_storage_t;

template <typename T, typename C = T>  // C: the cache's element type (T, or Fp8)
struct AttentionParams {
  T* out;               // [num_tokens, num_heads, head_dim], contiguous
  float* partial_out;   // [num_items, num_heads, num_partitions, head_dim]  split-KV scratch (else unused)
  float* partial_max;   // [num_items, num_heads, num_partitions]            split-KV: each partition's max logit
  float* partial_sum;   // [num_items, num_heads, num_partitions]            split-KV: its sum of exp(logit - max)
  const T* query;       // [num_tokens, num_heads, head_dim], last dim contiguous:
  int64_t query_row_stride, query_head_stride;  // (t, h, d) at t * query_row_stride + h * query_head_stride + d
  PagedCache<const C> key_cache;    // [num_blocks, block_size, num_kv_heads, head_dim]
  PagedCache<const C> value_cache;  // [num_blocks, block_size, num_kv_heads, head_dim]
  const float* k_scale;             // [1] or nullptr (1.0): fp8 caches, keys read as float(stored) * k_scale
  const float* v_scale;             // [1] or nullptr (1.0): fp8 caches, values read as float(stored) * v_scale
  __nv_fp8_interpretation_t fp8_format;  // fp8 caches: __NV_E4M3 or __NV_E5M2
  const int32_t* block_tables;      // [num_seqs, max_blocks_per_seq], contiguous
  const int32_t* seq_lens;          // [num_seqs]; the kernels clamp them to [0, max_context]
  const int32_t* query_start_loc;   // [num_seqs + 1], or nullptr (kLastOfEachSeq); clamped to [0, num_tokens]
  const float* alibi_slopes;        // [num_heads], or nullptr
  const float* sinks;               // [num_heads], or nullptr: each head's sink logit (row_sum)
  float* lse;                       // [num_tokens, num_heads], contiguous, or nullptr: each row's log-sum-exp
  const int32_t* shared_plan;       // [num_shared_tasks, kSharedPlanColumns], or nullptr: shared blocks
                                    // (shared_blocks.cuh; the tensor-core decode kernel, split-KV only)
  int num_shared_tasks;             // the plan's (plan.num_shared_tasks: 0 when the launch is not split)
  QueryRows rows;                   // which query rows the decode kernels serve
  int num_seqs, num_tokens;
  int num_heads;
  int64_t max_blocks_per_seq;  // the block table's width (row stride)
  float scale;     // logits are scale * (q . k)
  float logits_soft_cap;  // > 0: logits become logits_soft_cap * tanh(logit / logits_soft_cap), before ALiBi; 0: none
  // From the plan (set_plan, or set_varlen_plan for the tensor-core kernel).
  int group_size, blocks_per_group, heads_per_block;
  int max_context;     // max_blocks_per_seq * block_size, at most INT32_MAX
  int sliding_window;  // 0: every token; else the last sliding_window tokens
  int num_partitions, partition_size;
  int tokens_per_tile;  // the tensor-core kernel's query tokens per thread block

  void set_plan(const AttentionPlan& plan) {
    group_size = plan.group_size, blocks_per_group = plan.blocks_per_group, heads_per_block = plan.heads_per_block;
    max_context = static_cast<int>(plan.max_context), sliding_window = plan.sliding_window;
    num_partitions = plan.num_partitions, partition_size = plan.partition_size;
    tokens_per_tile = 0;
  }
  void set_varlen_plan(const VarlenPlan& plan) {
    group_size = plan.group_size, blocks_per_group = plan.blocks_per_group, heads_per_block = plan.heads_per_tile;
    max_context = static_cast<int>(plan.max_context), sliding_window = plan.sliding_window;
    num_partitions = 1, partition_size = 0;
    tokens_per_tile = plan.tokens_per_tile;
  }
};

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
