// plan_shared_blocks: the shared-blocks plan of a decode batch for the CUDA kernel (paged_attention's shared_plan,
// read by csrc/cuda/shared_blocks.cuh), made on the host from the batch's block tables (so the launch never copies
// from the device). The search is the one the CPU decode uses (shared_blocks.h: sort_by_blocks); here its prefix
// tree is cut into tasks:
//   1. candidates: the rows with min_shared_tokens or more tokens in full blocks (a partly filled block is never
//      shared: the kernel shares whole blocks);
//   2. sort them by their full blocks' entries: neighbours' common blocks form the prefix tree as an array;
//   3. walk the tree's nodes (the intervals of sorted rows whose common blocks reach a depth, with a stack): a node
//      that two or more rows reach and that adds min_shared_tokens or more to its parent gives tasks, each the
//      node's block range [parent's depth, depth) and up to rows_per_task of its rows, a lone leftover row in none.
#include "shared_blocks.h"

#include <torch/library.h>

#include <atomic>

#include "common.h"
#include "cuda/launch_plan.h"  // kMaxGroup, kSharedRows, kSharedPlanColumns, kMaxSharedTasks (plain C++)

namespace paged_attn {

namespace {
std::atomic<int64_t> tokens_saved{0};
}  // namespace
int64_t shared_tokens_saved() { return tokens_saved.load(); }
void add_shared_tokens_saved(int64_t tokens) { tokens_saved += tokens; }

namespace {

// A thread block of the CUDA decode holds kSharedRows head slots: the rows of one task fill them with their heads.
int64_t rows_per_task(int64_t num_queries_per_kv) {
  const int64_t blocks_per_group = (num_queries_per_kv + kMaxGroup - 1) / kMaxGroup;  // launch_plan.h
  const int64_t heads_per_block = (num_queries_per_kv + blocks_per_group - 1) / blocks_per_group;
  return kSharedRows / heads_per_block;
}

// block_tables: int32 [num_seqs, max_blocks_per_seq] (CPU)
// seq_lens:     int32 [num_seqs] (CPU)
// returns:      int32 [num_tasks, kSharedPlanColumns]: per task (ref, first_block, end_block, row_0, ..., row_7)
at::Tensor plan_shared_blocks(const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t block_size,
                              int64_t num_queries_per_kv, int64_t min_shared_tokens) {
  check_index_tensor(block_tables, "block_tables", at::kInt, 2, at::Device(at::kCPU));
  check_index_tensor(seq_lens, "seq_lens", at::kInt, 1, at::Device(at::kCPU));
  TORCH_CHECK(seq_lens.size(0) == block_tables.size(0), "seq_lens must have num_seqs = ", block_tables.size(0),
              " entries (block_tables' rows), got ", seq_lens.size(0));
  TORCH_CHECK(block_size >= 1 && num_queries_per_kv >= 1 && min_shared_tokens >= 1,
              "block_size, num_queries_per_kv and min_shared_tokens must be positive, got ", block_size, ", ",
              num_queries_per_kv, " and ", min_shared_tokens);
  const at::Tensor tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  const int64_t num_seqs = tables.size(0), width = tables.size(1), per_task = rows_per_task(num_queries_per_kv);
  std::vector<int32_t> plan;  // the tasks' columns, one after the other
  const auto done = [&] {
    const int64_t num_tasks = std::min<int64_t>(plan.size() / kSharedPlanColumns, kMaxSharedTasks);
    return at::tensor(std::vector<int32_t>(plan.begin(), plan.begin() + num_tasks * kSharedPlanColumns), at::kInt)
        .view({num_tasks, kSharedPlanColumns});
  };
  if (per_task < 2 || num_seqs < 2 || width == 0) return done();
  // 1. Candidates.
  const int32_t* entries = tables.data_ptr<int32_t>();
  std::vector<int64_t> full(num_seqs), candidates;  // full blocks per row
  const int64_t min_blocks = min_shared_tokens / block_size + (min_shared_tokens % block_size != 0);
  for (int64_t r = 0; r < num_seqs; ++r) {
    full[r] = std::min<int64_t>(std::max<int32_t>(lens.data_ptr<int32_t>()[r], 0) / block_size, width);
    if (full[r] >= min_blocks) candidates.push_back(r);
  }
  if (candidates.size() < 2) return done();
  // 2. Sorted by their full blocks; depth[i]: the blocks sorted rows i and i + 1 share.
  const SortedRows sorted = sort_by_blocks(
      std::move(candidates), [&](int64_t r) { return entries + r * width; },
      [&](int64_t r) { return full[r] * block_size; }, block_size);
  const std::vector<int64_t>& order = sorted.order;
  // 3. The nodes: on the stack (depth, first sorted row) of the open intervals, deepest on top; an interval closes
  // where a neighbour pair shares less than its depth.
  std::vector<std::pair<int64_t, int64_t>> stack = {{0, 0}};
  const int64_t n = static_cast<int64_t>(order.size());
  for (int64_t i = 1; i <= n; ++i) {
    const int64_t depth = i < n ? sorted.common[i - 1] / block_size : 0;
    int64_t first = i - 1;
    while (depth < stack.back().first) {
      const auto [node_depth, node_first] = stack.back();
      stack.pop_back();
      first = node_first;
      const int64_t parent = std::max(depth, stack.back().first);
      if (node_depth - parent < min_blocks) continue;
      for (int64_t t = node_first; i - t >= 2; t += per_task) {  // rows [t, t + per_task) of the node's, 2 or more
        const int64_t end = std::min(i, t + per_task);
        plan.insert(plan.end(), {static_cast<int32_t>(order[t]), static_cast<int32_t>(parent),
                                 static_cast<int32_t>(node_depth)});
        for (int64_t k = 0; k < kSharedRows; ++k) plan.push_back(t + k < end ? static_cast<int32_t>(order[t + k]) : -1);
      }
    }
    if (depth > stack.back().first) stack.push_back({depth, first});
  }
  return done();
}

}  // namespace
}  // namespace paged_attn

TORCH_LIBRARY_IMPL(paged_attn, CPU, m) { m.impl("plan_shared_blocks", &paged_attn::plan_shared_blocks); }
