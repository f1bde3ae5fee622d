// Launch planning of the CUDA kernels: plain C++17 (no CUDA, no torch), so that the torch-facing launchers
// (csrc/cuda/*.cu), the emulated kernel tests and the Python test hook (paged_attn._C._launch_plan) compute the same
// launches. Each plan_* function takes sizes as the tensors give them (int64) and returns the grid, the block size
// and the dynamic shared memory to launch with, or an error that says why it cannot be launched.
#pragma once

#include <cstdint>
#include <string>

namespace paged_attn {

// ---------------------------------------------------------------------------------------------------------------
// Grids.

// CUDA's limits on the grid: x < 2^31, y and z <= 65535.
constexpr int64_t kMaxGridX = (int64_t{1} << 31) - 1;
constexpr int64_t kMaxGridYZ = 65535;

struct Grid {
  int64_t x = 1, y = 1, z = 1;
};

// "" when every dimension of grid is within CUDA's limits; otherwise names the first that is not, with the
// quantity it stands for (e.g. x_name = "num_seqs").
inline std::string grid_error(const Grid& grid, const char* x_name, const char* y_name, const char* z_name) {
  const auto over = [](const char* axis, const char* name, int64_t value, int64_t limit) {
    return std::string("grid.") + axis + " = " + name + " = " + std::to_string(value) + " is outside [1, " +
           std::to_string(limit) + "]";
  };
  if (grid.x < 1 || grid.x > kMaxGridX) return over("x", x_name, grid.x, kMaxGridX);
  if (grid.y < 1 || grid.y > kMaxGridYZ) return over("y", y_name, grid.y, kMaxGridYZ);
  if (grid.z < 1 || grid.z > kMaxGridYZ) return over("z", z_name, grid.z, kMaxGridYZ);
  return "";
}

// ---------------------------------------------------------------------------------------------------------------
// Cache ops (csrc/cuda/cache_ops_kernels.cuh). They copy Units: 16, 8, 4, 2 or 1 bytes.

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

// copy_blocks: one thread block per (pair, layer, key or value) of one launch of up to kMaxLayersPerLaunch layers.
inline CopyPlan plan_copy_blocks(int64_t num_pairs, int64_t launch_layers, int64_t block_units) {
  CopyPlan plan;
  plan.grid = {num_pairs, launch_layers, 2};
  plan.threads = copy_threads(block_units);
  plan.error = block_units < 1                        ? "blocks must not be empty"
               : launch_layers > kMaxLayersPerLaunch ? "at most 128 layers per launch"
                                                     : grid_error(plan.grid, "num_pairs", "num_layers", "2");
  return plan;
}

}  // namespace paged_attn
