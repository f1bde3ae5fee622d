// CPU kernels of paged attention (paged_attn::paged_attention). Decode: one query token per sequence, the kernel
// of decode_kernels.h. With query_start_loc (variable-length queries: prefills, prefill chunks, decodes in one call),
// the rows of sequences with fewer than kMinPrefillQueryLen query tokens (decodes, short chunks) still take the
// decode kernel, each as a row at its own position, and sequences with more take the tiled prefill kernel
// (prefill_kernels.h), where a query tile shares each key/value tile among its rows.
//
// Usually a sequence is one partition and its task writes out = acc / sum. When there are too few sequences to
// keep every thread busy, each sequence's tokens are split into equal partitions; each task leaves its
// (max, sum, acc) per head in float32 scratch and a second parallel pass merges them exactly:
//   M = max_p max_p,  out = sum_p e^(max_p - M) acc_p / sum_p e^(max_p - M) sum_p.
// Only tokens t < L (and in the window) are ever read: unused cache slots and block-table entries may hold
// anything, NaN included.
//
// This file: the entry point (argument checks, the dispatch by dtype, the split of a varlen batch between the
// decode and the prefill kernels), the decode kernel's plan (tasks and partitions), its task loop, and the merge of
// partitions. The pieces, all included into this one translation unit:
//  - attention_common.h: the at::vec setup (first: it must precede any include of Vectorized), constants, fp8
//    tables and load helpers, Problem, Tile, Prefetcher, Scratch (addresses: paged_cache.h, shared with
//    cache_ops.cpp);
//  - decode_kernels.h: the decode steps (logits, softmax, values) on the portable path, and a task's tile loop;
//  - avx512_kernels.h: the same steps as AVX-512 bf16 micro-kernels;
//  - prefill_kernels.h: the tiled prefill kernel.

#include "attention_common.h"  // first: it selects at::vec's implementation
#include "decode_kernels.h"
#include "prefill_kernels.h"

#include <torch/library.h>

namespace paged_attn {
namespace {

// ---------------------------------------------------------------------------------------------------------------
// The decode kernel's host side: plan the tasks, run them, merge the partitions.

// How the rows' tokens are cut into tasks: each row into num_partitions partitions of partition_size tokens (whole
// tiles, but the last), one task each.
struct Plan {
  int64_t num_partitions = 1;
  int64_t partition_size = kTileTokens;
  int64_t max_tasks = 1;  // the most tasks worth a thread each
};

// Plan. Threads only for work worth waking them (kMinBytesPerCpuTask of keys and values per task). Split rows only
// when there are too few to keep the threads evenly busy: into as many partitions as make the task count a
// multiple of the thread count, each at least kMinPartitionTokens long.
template <typename scalar_t, typename cache_t>
Plan plan_tasks(const Problem<scalar_t, cache_t>& pb, int64_t num_rows) {
  const int64_t num_threads = at::get_num_threads();
  int64_t max_len = 0, total_len = 0;  // tokens attended to, after the sliding window
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t len = pb.row_len(r) - pb.window_start(r);
    max_len = std::max(max_len, len);
    total_len += len;
  }
  const int64_t kv_bytes = total_len * 2 * pb.num_kv_heads * pb.head_dim * int64_t{sizeof(cache_t)};
  Plan plan;
  plan.max_tasks = std::max<int64_t>(1, kv_bytes / kMinBytesPerCpuTask);
  if (plan.max_tasks > 1 && num_rows < 4 * num_threads && num_rows % num_threads != 0) {
    const int64_t balanced = num_threads / std::gcd(num_rows, num_threads);  // num_rows * balanced % num_threads == 0
    plan.num_partitions = std::clamp<int64_t>(max_len / kMinPartitionTokens, 1, balanced);
  }
  // Whole tiles per partition (but the last).
  plan.partition_size =
      std::max<int64_t>(1, (max_len + plan.num_partitions * kTileTokens - 1) / (plan.num_partitions * kTileTokens)) *
      kTileTokens;
  return plan;
}

// Partial results of split rows (num_partitions > 1; else empty): max logit and exp sum [num_rows, num_heads,
// num_partitions], acc [num_rows, num_heads, num_partitions, head_dim].
struct Partials {
  std::vector<float> buffer;
  float* max_logits;
  float* exp_sums;
  float* accs;
  Partials(int64_t num_rows, int64_t num_heads, int64_t head_dim, const Plan& plan) {
    const int64_t num_partials = num_rows * num_heads * plan.num_partitions;
    buffer.resize(plan.num_partitions > 1 ? num_partials * (head_dim + 2) : 0);
    max_logits = buffer.data();
    exp_sums = max_logits + num_partials;
    accs = exp_sums + num_partials;
  }
};

// The task loop: task (row, partition) attends its tokens (decode_kernels.h: attend), then writes out = acc / sum
// (one partition) or its (max, sum, acc) per head into partials.
template <typename scalar_t, typename cache_t>
void run_tasks(const Problem<scalar_t, cache_t>& pb, int64_t num_rows, const Plan& plan, Partials& partials,
               scalar_t* out) {
  const int64_t num_heads = pb.num_heads, head_dim = pb.head_dim;
  const int64_t num_partitions = plan.num_partitions, partition_size = plan.partition_size;
  const int64_t num_tasks = num_rows * num_partitions;
  const int64_t num_chunks = std::max<int64_t>(1, std::min(num_tasks, plan.max_tasks));  // at most
  const int64_t grain = (num_tasks + num_chunks - 1) / num_chunks;
  at::parallel_for(0, num_tasks, grain, [&](int64_t task_begin, int64_t task_end) {
    Scratch sc(num_heads, pb.group_size, head_dim);
    for (int64_t task = task_begin; task < task_end; ++task) {
      const int64_t row = task / num_partitions, partition = task % num_partitions, len = pb.row_len(row);
      const int64_t begin = std::min(pb.window_start(row) + partition * partition_size, len);
      attend(pb, row, begin, std::min(begin + partition_size, len), sc);
      for (int64_t h = 0; h < num_heads; ++h) {
        const int64_t out_row = pb.token(row) * num_heads + h;
        const float* acc = sc.acc + h * head_dim;
        const float* lane_sums = sc.exp_sums + h * kTileTokens;
        const float exp_sum = std::accumulate(lane_sums, lane_sums + kTileTokens, 0.f);
        if (num_partitions == 1) {
          const float inv_sum = exp_sum > 0 ? pb.v_scale / exp_sum : 0.f;  // 0 for an empty sequence
          for (int64_t d = 0; d < head_dim; ++d) {
            out[out_row * head_dim + d] = static_cast<scalar_t>(acc[acc_index(d, pb.avx512_bf16)] * inv_sum);
          }
        } else {
          const int64_t slot = (row * num_heads + h) * num_partitions + partition;
          partials.max_logits[slot] = sc.max_logit[h];
          partials.exp_sums[slot] = exp_sum;
          for (int64_t d = 0; d < head_dim; ++d) {
            partials.accs[slot * head_dim + d] = acc[acc_index(d, pb.avx512_bf16)];
          }
        }
      }
    }
  });
}

// Merge the partitions of each (row, head) exactly (see the top of this file); empty partitions (max -inf)
// contribute nothing.
template <typename scalar_t, typename cache_t>
void merge_partitions(const Problem<scalar_t, cache_t>& pb, int64_t num_rows, const Plan& plan,
                      const Partials& partials, scalar_t* out) {
  const int64_t num_heads = pb.num_heads, head_dim = pb.head_dim, num_partitions = plan.num_partitions;
  const int64_t merge_grain = std::max<int64_t>(
      1, kMinBytesPerCpuTask / (num_partitions * (head_dim + 2) * int64_t{sizeof(float)}));
  at::parallel_for(0, num_rows * num_heads, merge_grain, [&](int64_t row_begin, int64_t row_end) {
    std::vector<float> merged(head_dim);
    for (int64_t row = row_begin; row < row_end; ++row) {
      const float* row_max = partials.max_logits + row * num_partitions;
      const float global_max = *std::max_element(row_max, row_max + num_partitions);
      std::fill(merged.begin(), merged.end(), 0.f);
      float total = 0.f;
      for (int64_t p = 0; p < num_partitions; ++p) {
        if (row_max[p] == kNegInf) continue;
        const float weight = std::exp(row_max[p] - global_max);
        total += weight * partials.exp_sums[row * num_partitions + p];
        const float* acc = partials.accs + (row * num_partitions + p) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) merged[d] += weight * acc[d];
      }
      const float inv_total = total > 0 ? pb.v_scale / total : 0.f;
      scalar_t* dst = out + (pb.token(row / num_heads) * num_heads + row % num_heads) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(merged[d] * inv_total);
    }
  });
}

// The decode kernel over rows [0, num_rows) of the problem.
template <typename scalar_t, typename cache_t>
void paged_attention_kernel(const Problem<scalar_t, cache_t>& pb, int64_t num_rows,
                            scalar_t* out) {  // [num_tokens, num_heads, head_dim], contiguous; row r at token(r)
  const Plan plan = plan_tasks(pb, num_rows);
  Partials partials(num_rows, pb.num_heads, pb.head_dim, plan);
  run_tasks(pb, num_rows, plan, partials, out);
  if (plan.num_partitions > 1) merge_partitions(pb, num_rows, plan, partials, out);
}

}  // namespace

void paged_attention_cpu(at::Tensor& out,                 // [num_tokens, num_heads, head_dim], contiguous
                         const at::Tensor& query,         // [num_tokens, num_heads, head_dim], last dim contiguous
                         const at::Tensor& key_cache,     // [num_blocks, block_size, num_kv_heads, head_dim]
                         const at::Tensor& value_cache,   // [num_blocks, block_size, num_kv_heads, head_dim]
                         const at::Tensor& block_tables,  // [num_seqs, max_blocks_per_seq], int32
                         const at::Tensor& seq_lens,      // [num_seqs], int32
                         double scale,
                         const std::optional<at::Tensor>& alibi_slopes,  // [num_heads], float32
                         int64_t sliding_window, double logits_soft_cap,
                         const std::optional<at::Tensor>& query_start_loc,  // [num_seqs + 1], int32, or none
                         std::optional<int64_t> max_query_len,
                         const std::optional<at::Tensor>& k_scale,    // [1], float32 (fp8 caches only)
                         const std::optional<at::Tensor>& v_scale) {  // [1], float32 (fp8 caches only)
  check_paged_attention_args(out, query, key_cache, value_cache, block_tables, seq_lens, scale, alibi_slopes,
                             sliding_window, logits_soft_cap, query_start_loc, max_query_len, k_scale, v_scale);
  const int64_t block_size = key_cache.size(1);
  check_block_table_range(block_tables, seq_lens, key_cache.size(0), block_size);
  if (query_start_loc.has_value()) check_query_start_loc_range(*query_start_loc, seq_lens, query.size(0), max_query_len);
  check_kv_scale_values(k_scale, v_scale);
  if (out.numel() == 0) return;
  const int64_t num_rows = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = key_cache.size(2);

  const auto tables = block_tables.contiguous();
  const auto lens = seq_lens.contiguous();
  const auto slopes = alibi_slopes.has_value() ? alibi_slopes->contiguous() : at::Tensor();
  // With query_start_loc: sequences with at least kMinPrefillQueryLen query tokens go to the tiled prefill kernel;
  // the rows of those with fewer (decodes, short chunks) to the decode kernel: row i of the q_s rows of sequence s,
  // at position L_s - q_s + i, as a row of length L_s - q_s + i + 1.
  std::vector<int32_t> decode_lens, decode_seqs, decode_tokens, prefill_seqs;
  const auto starts = query_start_loc.has_value() ? query_start_loc->contiguous() : at::Tensor();
  if (starts.defined()) {
    const int32_t* qsl = starts.const_data_ptr<int32_t>();
    const int32_t* len = lens.const_data_ptr<int32_t>();
    for (int32_t s = 0; s + 1 < starts.size(0); ++s) {
      const int32_t query_len = qsl[s + 1] - qsl[s];
      if (query_len >= kMinPrefillQueryLen) {
        prefill_seqs.push_back(s);
        continue;
      }
      for (int32_t i = 0; i < query_len; ++i) {
        decode_lens.push_back(len[s] - query_len + i + 1);
        decode_seqs.push_back(s);
        decode_tokens.push_back(qsl[s] + i);
      }
    }
  }
  const float k_scale_value = k_scale.has_value() ? k_scale->item<float>() : 1.f;
  const float v_scale_value = v_scale.has_value() ? v_scale->item<float>() : 1.f;
  const auto run = [&](auto dtype_tag, auto cache_tag) {
    using scalar_t = decltype(dtype_tag);
    using cache_t = decltype(cache_tag);
    Problem<scalar_t, cache_t> pb;
    pb.kv.key = cpu::paged_cache_of<const cache_t>(key_cache);
    pb.kv.value = cpu::paged_cache_of<const cache_t>(value_cache);
    pb.query = query.const_data_ptr<scalar_t>();
    pb.query_row_stride = query.stride(0);
    pb.query_head_stride = query.stride(1);
    pb.block_tables = tables.const_data_ptr<int32_t>();
    pb.row_lens = lens.const_data_ptr<int32_t>();  // decode: row r is sequence r (row_seqs, row_tokens nullptr)
    pb.alibi_slopes = slopes.defined() ? slopes.const_data_ptr<float>() : nullptr;
    pb.max_blocks_per_seq = tables.size(1);
    pb.block_size = block_size;
    pb.num_heads = num_heads;
    pb.num_kv_heads = num_kv_heads;
    pb.group_size = num_heads / num_kv_heads;
    pb.head_dim = head_dim;
    pb.sliding_window = sliding_window;
    pb.scale = static_cast<float>(scale) * k_scale_value;
    pb.logits_soft_cap = static_cast<float>(logits_soft_cap);
    pb.v_scale = v_scale_value;
    pb.avx512_bf16 = avx512_bf16_path<scalar_t, cache_t>(head_dim);
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    if (!starts.defined()) return paged_attention_kernel(pb, num_rows, out_ptr);
    if (!prefill_seqs.empty()) {
      prefill_kernel(pb, starts.const_data_ptr<int32_t>(), lens.const_data_ptr<int32_t>(), prefill_seqs, out_ptr);
    }
    if (!decode_seqs.empty()) {
      pb.row_lens = decode_lens.data(), pb.row_seqs = decode_seqs.data(), pb.row_tokens = decode_tokens.data();
      paged_attention_kernel(pb, static_cast<int64_t>(decode_seqs.size()), out_ptr);
    }
  };
  // The cache's dtype: the query's, or fp8 (check_paged_attention_args allows exactly these).
  const auto by_cache = [&](auto dtype_tag) {
    switch (key_cache.scalar_type()) {
      case at::kFloat8_e4m3fn: return run(dtype_tag, c10::Float8_e4m3fn{});
      case at::kFloat8_e5m2: return run(dtype_tag, c10::Float8_e5m2{});
      default: return run(dtype_tag, dtype_tag);
    }
  };
  switch (query.scalar_type()) {
    case at::kFloat: by_cache(float{}); break;
    case at::kHalf: by_cache(at::Half{}); break;
    case at::kBFloat16: by_cache(at::BFloat16{}); break;
    default: TORCH_INTERNAL_ASSERT(false, "unreachable: dtype checked above");
  }
}

}  // namespace paged_attn

TORCH_LIBRARY_IMPL(paged_attn, CPU, m) {
  m.impl("paged_attention", &paged_attn::paged_attention_cpu);
}
