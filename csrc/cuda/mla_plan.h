// Launch planning of mla_attention on CUDA (csrc/cuda/mla_kernels.cuh): plain C++17 like launch_plan.h, whose
// partition model it reuses, so that the launcher (csrc/cuda/attention.cpp), the emulated kernel tests and the
// Python test hook (paged_attn._C._launch_plan("mla_attention", ...)) compute the same launches.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

#include "launch_plan.h"

namespace paged_attn {

// The kernel: latent attention on tensor cores, float16 and bfloat16 (the cache of the query's dtype), compute
// capability 8.0+. A thread block serves one item (a query row), kMlaHeads query heads (the M of the m16n8k16
// products; fewer are zero rows of Q in shared memory) and its partitions; its dynamic shared memory holds Q, two
// stages of kMlaTile cache rows and the step's P, rows padded by 8 elements (16 bytes) so that ldmatrix reads 8 rows
// from 8 bank groups.

constexpr int kMlaThreads = 128;  // 4 warps
constexpr int kMlaHeads = 16;     // query heads per thread block
constexpr int kMlaTile = 32;      // cache rows per step: 8 per warp in S = Q K^T

// The (kv_lora_rank, rope_dim) pairs instantiated: DeepSeek-V2/V3's and Kimi K2's 512 + 64, and 128 + 32 (the
// tests' small models). The kernel needs kv_lora_rank % 64 == 0 (four warps' 16-column steps of P V) and a row of
// whole 32-element steps.
template <int LORA, int ROPE>
struct MlaShape {
  static_assert(LORA % 64 == 0 && (LORA + ROPE) % 32 == 0, "the kernel's steps");
};
template <typename... Shapes>
struct MlaShapeList {};
using MlaShapes = MlaShapeList<MlaShape<512, 64>, MlaShape<128, 32>>;

template <int... L, int... R, typename F>
bool dispatch_mla(int64_t kv_lora_rank, int64_t rope_dim, MlaShapeList<MlaShape<L, R>...>, F&& f) {
  return ((kv_lora_rank == L && rope_dim == R
               ? (f(std::integral_constant<int, L>{}, std::integral_constant<int, R>{}), true)
               : false) ||
          ...);
}
template <int... L, int... R>
std::string to_string(MlaShapeList<MlaShape<L, R>...>) {  // "512 + 64, 128 + 32"
  std::string s;
  ((s += (s.empty() ? "" : ", ") + std::to_string(L) + " + " + std::to_string(R)), ...);
  return s;
}

// The dynamic shared memory, in elements of 16 bits from its (16-byte aligned) base.
struct MlaSmem {
  int64_t row;    // elements per row of Q and of the stages: kv_lora_rank + rope_dim + 8
  int64_t q;      // Q [kMlaHeads][row]
  int64_t stages; // 2 x [kMlaTile][row]: the cache rows of two steps
  int64_t p;      // P [kMlaHeads][kMlaTile + 8]: the step's weights, rounded to the query's dtype
  int64_t bytes;  // the total, in bytes
};
constexpr MlaSmem mla_smem(int64_t row_width) {
  MlaSmem m{};
  m.row = row_width + 8;
  m.q = 0;
  m.stages = kMlaHeads * m.row;
  m.p = m.stages + 2 * kMlaTile * m.row;
  m.bytes = 2 * (m.p + kMlaHeads * (kMlaTile + 8));
  return m;
}

// "" when the kernel serves this latent row and block size, else why not (instantiated shapes: MlaShapes; block
// sizes: powers of two from 8, so that a warp's 8 rows of a step lie in one block).
inline std::string mla_shape_error(int64_t kv_lora_rank, int64_t rope_dim, int64_t block_size) {
  bool instantiated = false;
  dispatch_mla(kv_lora_rank, rope_dim, MlaShapes{}, [&](auto, auto) { instantiated = true; });
  if (!instantiated) {
    return "kv_lora_rank + rope_dim = " + std::to_string(kv_lora_rank) + " + " + std::to_string(rope_dim) +
           " has no kernel (instantiated: " + to_string(MlaShapes{}) + ")";
  }
  if (block_size < 8 || (block_size & (block_size - 1)) != 0 || block_size > (int64_t{1} << 30)) {
    return "block_size " + std::to_string(block_size) + " is not supported (supported: powers of two from 8)";
  }
  return "";
}

// The launch of mla_attention over num_items query rows (decode: one per sequence; with query_start_loc: every
// row): plan_attention's partitions and waves (the same model and batch invariance) for ceil(num_heads / kMlaHeads)
// thread blocks per item, where paged_attention has a kv head's blocks; the split-KV reduce is
// paged_attention_reduce_kernel at HEAD_DIM = kv_lora_rank over the heads. Block sizes: powers of two from 8 (a
// warp's 8 rows of a step lie in one block).
inline AttentionPlan plan_mla_attention(int64_t num_items, int64_t num_heads, int64_t kv_lora_rank, int64_t rope_dim,
                                        int64_t max_blocks_per_seq, int64_t block_size, int64_t num_sms,
                                        int64_t blocks_per_sm, int64_t partition_tokens = kPartitionSize,
                                        bool batch_invariant = false) {
  AttentionPlan plan;
  if (num_items < 1 || num_heads < 1) {
    plan.error = "invalid sizes: num_items " + std::to_string(num_items) + ", num_heads " + std::to_string(num_heads);
    return plan;
  }
  plan.error = mla_shape_error(kv_lora_rank, rope_dim, block_size);
  if (!plan.error.empty()) return plan;
  const int64_t head_tiles = (num_heads + kMlaHeads - 1) / kMlaHeads;
  plan = plan_attention(num_items, head_tiles, head_tiles, max_blocks_per_seq, block_size, 0, num_sms, blocks_per_sm,
                        partition_tokens, 0, batch_invariant);
  if (!plan.error.empty()) return plan;
  plan.error = grid_error({num_items, num_heads, 1}, "num_items", "num_heads", "1");  // the reduce kernel's grid
  if (!plan.error.empty()) return plan;
  plan.group_size = static_cast<int>(num_heads);  // one latent row for every head
  plan.blocks_per_group = static_cast<int>(head_tiles);
  plan.heads_per_block = static_cast<int>((num_heads + head_tiles - 1) / head_tiles);
  plan.group_variant = 0;
  if (plan.split()) plan.reduce_grid = {num_items, num_heads, 1};
  plan.threads = kMlaThreads;
  plan.tensor_cores = true;
  plan.shared_bytes = static_cast<int>(mla_smem(kv_lora_rank + rope_dim).bytes);
  if (plan.shared_bytes > kMaxOptInSharedBytes) {
    plan.error = "needs " + std::to_string(plan.shared_bytes) + " bytes of shared memory (at most " +
                 std::to_string(kMaxOptInSharedBytes) + ")";
  }
  return plan;
}

}  // namespace paged_attn
