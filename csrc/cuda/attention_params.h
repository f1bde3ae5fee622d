// What the attention kernels on CUDA are given, and what a thread block of theirs works on; shared by all three:
// the CUDA-core decode and split-KV's reduce (attention_kernels.cuh), the tensor-core decode
// (decode_mma_kernels.cuh) and the tensor-core prefill (varlen_attention_kernels.cuh).
//   - AttentionParams: one struct, passed by value to every attention kernel; a launch fills it from the tensors
//     (csrc/cuda/attention.cpp) and from its plan (launch_plan.h). This header has no device code, so the
//     torch-facing launcher compiles it as plain C++.
//   - The task geometry, from AttentionParams and blockIdx (attention_params.cuh: device code): a row's length
//     (clamped_seq_len), a sequence's query rows (query_range, seq_of_row), a decode item's row (query_item), a
//     window's first token (window_start), a grid row's query heads (block_heads) and a decode thread block's task
//     and partition (AttentionTask).
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

}  // namespace paged_attn
