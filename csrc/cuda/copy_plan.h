// Launch planning of the CUDA cache ops and merge_attention_states (the attention kernels': launch_plan.h): plain
// C++17 (no CUDA, no torch), shared by the launchers, the emulated kernel tests and the Python test hook.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "grid.h"  // Grid, grid_error

namespace paged_attn {

// ---------------------------------------------------------------------------------------------------------------
// Cache ops (csrc/cuda/cache_ops_kernels.cuh). They copy Units: 16, 8, 4, 2 or 1 bytes.

// Widest access in bytes (16, 8, 4, 2 or 1) that divides every byte count and address given: the kernels that only
// move data use it to pick their load/store width without dispatching on dtype.
inline int64_t access_width(std::initializer_list<uint64_t> byte_values) {
  uint64_t bits = 16;
  for (uint64_t v : byte_values) bits |= v;
  return static_cast<int64_t>(bits & (~bits + 1));  // lowest set bit
}

constexpr int kMaxCopyThreads = 512;
constexpr int kMaxLayersPerLaunch = 128;  // copy_blocks: layers whose pointers one launch carries as a parameter

struct CopyPlan {
  Grid grid;
  int threads = 32;  // per thread block: a multiple of 32, at most kMaxCopyThreads
  int shared_bytes = 0;
  std::string error;  // "" or why the call cannot be launched
};

// Threads for a thread block that copies `units` Units: a whole number of warps, at least one.
constexpr int copy_threads(int64_t units) {
  return units >= kMaxCopyThreads ? kMaxCopyThreads : units <= 32 ? 32 : static_cast<int>((units + 31) / 32 * 32);
}

// reshape_and_cache: one thread block per token, copying its [num_kv_heads, head_units] rows.
inline CopyPlan plan_reshape_and_cache(int64_t num_tokens, int64_t num_kv_heads, int64_t head_units) {
  CopyPlan plan;
  plan.grid = {num_tokens, 1, 1};
  plan.threads = copy_threads(num_kv_heads * head_units);
  plan.error = num_kv_heads < 1 || head_units < 1 ? "num_kv_heads and head_dim must be positive"
                                                  : grid_error(plan.grid, "num_tokens", "1", "1");
  return plan;
}

// merge_attention_states: one warp per (token, head) row, kMergeRowsPerBlock heads of one token per thread block.
constexpr int kMergeRowsPerBlock = 4;
inline CopyPlan plan_merge_attention_states(int64_t num_tokens, int64_t num_heads) {
  CopyPlan plan;
  plan.grid = {num_tokens, (num_heads + kMergeRowsPerBlock - 1) / kMergeRowsPerBlock, 1};
  plan.threads = 32 * kMergeRowsPerBlock;
  plan.error = grid_error(plan.grid, "num_tokens", "ceil(num_heads / 4)", "1");
  return plan;
}

// copy_blocks: one thread block per (pair, layer, key or value) of one launch of up to kMaxLayersPerLaunch layers
// (caches_per_layer 1: one cache per layer, as MLA's latent caches).
inline CopyPlan plan_copy_blocks(int64_t num_pairs, int64_t launch_layers, int64_t block_units,
                                 int64_t caches_per_layer = 2) {
  CopyPlan plan;
  plan.grid = {num_pairs, launch_layers, caches_per_layer};
  plan.threads = copy_threads(block_units);
  plan.error = block_units < 1                        ? "blocks must not be empty"
               : launch_layers > kMaxLayersPerLaunch ? "at most 128 layers per launch"
                                                     : grid_error(plan.grid, "num_pairs", "num_layers", "2");
  return plan;
}

}  // namespace paged_attn
