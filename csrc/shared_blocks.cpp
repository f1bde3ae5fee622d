// plan_shared_blocks: the shared-blocks plan of a decode batch for the CUDA kernel (paged_attention's shared_plan,
// read by csrc/cuda/shared_blocks.cuh), made on the host from the batch's block tables (so the launch never copies
// from the device). The search is the one the CPU decode uses (shared_blocks.h: sort_by_blocks); here its prefix
// tree is cut into tasks:
//   1. candidates: the rows with min_shared_tokens or more tokens in full blocks (a partly filled block is never
//      shared: the kernel shares whole blocks);
//   2. sort them by their full blocks' entries: neighbours' common blocks form the prefix tree as an array;
//   3. cut the sorted rows into groups of at most rows_per_task consecutive rows (a task's rows) where it costs
//      least: a cut between neighbours that share c blocks has both sides read those c blocks (per kv head), so
//      the cuts are those of least total c (a small dynamic program; none where the rows fit one group);
//   4. walk each group's prefix tree (the intervals of its rows whose common blocks reach a depth, with a stack;
//      a group's edges close every interval): a node that two or more rows reach and that adds min_shared_tokens or
//      more to its parent gives one task, the node's block range [parent's depth, depth) and all its rows.
// So a row is listed at most rows_per_task - 1 <= 7 times at any depth (the nodes of a group that hold it are
// nested, each with more rows than the one inside), within the kernel's kMaxRowListings = 8 (rule d: a row listed
// more often loses every listing; a plan of the whole tree listed the deepest rows of a chain of 13 forks 9 to 12
// times). A group reads each block its rows share once: blocks that m rows hold are read once per group holding
// some of them, ceil(m / rows_per_task) times where the cuts fall between subtrees (the samples of one prompt, the
// requests behind a system prompt, a chain of forks).
#include "shared_blocks.h"

#include <ATen/ops/tensor.h>
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
  // 3. The groups: cut_cost(j), the blocks sorted rows j - 1 and j share (the reads a cut before row j adds);
  // least[j], the least total cost of cutting rows [0, j) into groups; from[j], where the last of those starts (on
  // a tie the latest start: the groups in front stay full, as the rows of one prompt in tasks of rows_per_task).
  const int64_t n = static_cast<int64_t>(order.size());
  const auto cut_cost = [&](int64_t j) { return j == 0 ? 0 : sorted.common[j - 1] / block_size; };
  std::vector<int64_t> least(n + 1, 0), from(n + 1, 0);
  for (int64_t j = 1; j <= n; ++j) {
    least[j] = -1;
    for (int64_t start = j - 1; start >= std::max<int64_t>(0, j - per_task); --start) {
      const int64_t cost = least[start] + cut_cost(start);
      if (least[j] < 0 || cost < least[j]) least[j] = cost, from[j] = start;
    }
  }
  std::vector<bool> group_start(n + 1, false);
  for (int64_t j = n; j > 0; j = from[j]) group_start[from[j]] = true;
  // 4. The nodes: on the stack (depth, first sorted row) of the open intervals, deepest on top; an interval closes
  // where a neighbour pair shares less than its depth, or a group ends.
  std::vector<std::pair<int64_t, int64_t>> stack = {{0, 0}};
  for (int64_t i = 1; i <= n; ++i) {
    const int64_t depth = i < n && !group_start[i] ? sorted.common[i - 1] / block_size : 0;
    int64_t first = i - 1;
    while (depth < stack.back().first) {
      const auto [node_depth, node_first] = stack.back();
      stack.pop_back();
      first = node_first;
      const int64_t parent = std::max(depth, stack.back().first);
      if (node_depth - parent < min_blocks) continue;
      plan.insert(plan.end(), {static_cast<int32_t>(order[node_first]), static_cast<int32_t>(parent),
                               static_cast<int32_t>(node_depth)});  // rows [node_first, i): 2 to per_task
      for (int64_t k = 0; k < kSharedRows; ++k) {
        plan.push_back(node_first + k < i ? static_cast<int32_t>(order[node_first + k]) : -1);
      }
    }
    if (depth > stack.back().first) stack.push_back({depth, first});
  }
  return done();
}

}  // namespace
}  // namespace paged_attn

TORCH_LIBRARY_IMPL(paged_attn, CPU, m) { m.impl("plan_shared_blocks", &paged_attn::plan_shared_blocks); }
