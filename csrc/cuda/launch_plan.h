// Launch planning of the CUDA attention kernels (the cache ops': copy_plan.h): plain C++17 (no CUDA, no torch), so
// that the torch-facing launchers (csrc/cuda/*.cpp), the emulated kernel tests and the Python test hook
// (paged_attn._C._launch_plan) compute the same launches. Each plan_* function takes sizes as the tensors give them
// (int64) and returns the grid, the block size, the dynamic shared memory and the kernel variant to launch, or an
// error that says why it cannot be launched.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "grid.h"  // Grid, grid_error, IntList, dispatch

namespace paged_attn {

// ---------------------------------------------------------------------------------------------------------------
// paged_attention (csrc/cuda/attention_kernels.cuh).

constexpr int kAttentionThreads = 128;  // threads per thread block, both kernels
constexpr int kMaxGroup = 8;            // query heads one thread block serves at most
constexpr int kPartitionSize = 512;     // the longest split-KV partition, in tokens (plan_attention: k / 8 of it)

// The instantiations: head dims, and group variants (GROUP: the query heads a thread block's registers are sized
// for; a block serving fewer heads takes the smallest variant that holds them).
using AttentionHeadDims = IntList<32, 64, 80, 96, 112, 120, 128, 192, 256>;
// fp8 caches (float16 / bfloat16 queries only): the head dims whose rows are whole 16-byte vectors.
using Fp8AttentionHeadDims = IntList<32, 64, 80, 96, 112, 128, 192, 256>;
using AttentionGroupVariants = IntList<1, 4, kMaxGroup>;

template <int... Groups>
constexpr int smallest_variant(IntList<Groups...>, int heads) {  // heads <= kMaxGroup
  int best = kMaxGroup;
  ((best = Groups >= heads && Groups < best ? Groups : best), ...);
  return best;
}

// The group variant (below) of a thread block for num_heads query heads over num_kv_heads (a divisor of num_heads):
// the heads of a head group, split evenly among ceil(group / kMaxGroup) thread blocks.
constexpr int attention_group_variant(int64_t num_heads, int64_t num_kv_heads) {
  const int64_t group_size = num_heads / num_kv_heads;
  const int64_t blocks_per_group = (group_size + kMaxGroup - 1) / kMaxGroup;
  return smallest_variant(AttentionGroupVariants{},
                          static_cast<int>((group_size + blocks_per_group - 1) / blocks_per_group));
}

// The tensor-core decode kernel (decode_mma_kernels.cuh) serves float16 and bfloat16 queries over caches of the
// same dtype, at these head dims (multiples of 16), on compute capability 8.0+; everything else takes
// paged_attention_kernel. Its shared memory is dynamic: per warp, two stages of a K and a V tile of
// kDecodeTile rows, each row padded by 8 elements (16 bytes) so that ldmatrix reads 8 rows from 8 bank groups.
constexpr int kDecodeTile = 16;  // keys per tile (a warp's step): the k of P V's m16n8k16
using DecodeMmaHeadDims = IntList<32, 64, 80, 96, 112, 128, 192, 256>;
constexpr int decode_mma_shared_bytes(int64_t head_dim) {
  return static_cast<int>(2 /*stages*/ * 2 /*K, V*/ * (kAttentionThreads / 32) * kDecodeTile * (head_dim + 8) * 2);
}

// Shared blocks (csrc/cuda/shared_blocks.cuh): the plan of paged_attn.plan_shared_blocks is int32
// [num_tasks, kSharedPlanColumns]: per task a reference sequence, a range of block-table positions [first_block,
// end_block) and up to kSharedRows sequences that hold the same blocks there (-1 past the last).
constexpr int kSharedRows = 8;  // one per head slot of the tensor-core decode kernel (MHA); fewer fit larger groups
constexpr int kSharedPlanColumns = 3 + kSharedRows;  // ref, first_block, end_block, rows...
constexpr int64_t kMaxSharedTasks = int64_t{1} << 20;  // (task * kSharedRows + place fits int32)

struct AttentionPlan {
  int group_size = 0;       // num_heads / num_kv_heads: the query heads that read one kv head
  int blocks_per_group = 0;  // thread blocks per (sequence, kv head, partition slot): ceil(group_size / kMaxGroup)
  int heads_per_block = 0;  // query heads one thread block serves: ceil(group_size / blocks_per_group) (the last
                            // thread block of a head group may have fewer)
  int group_variant = 0;    // the GROUP template argument: the smallest of AttentionGroupVariants >= heads_per_block
  int64_t max_context = 0;  // max_blocks_per_seq * block_size (at most INT32_MAX): no sequence reads past it
  int sliding_window = 0;   // the window the kernels take: 0 for none, also when it covers max_context
  int num_partitions = 1;   // 1: single pass; > 1: split-KV, the partitions of a table-wide sequence (they size the
                            // scratch: [num_items, num_heads, num_partitions]), merged by the reduce kernel
  int partition_size = 1;   // tokens per partition (max(max_context, 1) in single pass)
  Grid grid;                // paged_attention_kernel: (num_seqs, num_kv_heads * blocks_per_group, partition slots),
                            // the partition slots (grid.z) at most num_partitions: thread block z runs partitions z,
                            // z + grid.z, ... of its sequence; with shared tasks, grid.x = num_seqs + num_shared_tasks
  int num_shared_tasks = 0;  // the shared-blocks plan's tasks (split-KV only; 0: none)
  Grid reduce_grid;         // paged_attention_reduce_kernel (split-KV only): (num_seqs, num_heads, 1)
  int threads = kAttentionThreads;  // per thread block, both kernels
  int shared_bytes = 0;             // dynamic shared memory of the attention kernel (the reduce's is static)
  bool tensor_cores = false;        // the attention kernel is decode_mma_kernel (set by use_tensor_cores)
  std::string error;                // "" or why the call cannot be launched

  bool split() const { return num_partitions > 1; }
};

// Whether the decode kernels of a call are decode_mma_kernel (else paged_attention_kernel): float16/bfloat16
// (element_bytes 2) over a cache of the same dtype, a head dim of DecodeMmaHeadDims, compute capability 8.0+, and
// row offsets within 8 tokens of a block that fit in int32 (token strides in elements).
inline bool decode_on_tensor_cores(int64_t head_dim, int64_t element_bytes, bool fp8_cache, bool has_tensor_cores,
                                   int64_t key_token_stride, int64_t value_token_stride) {
  const int64_t widest = key_token_stride > value_token_stride ? key_token_stride : value_token_stride;
  return element_bytes == 2 && !fp8_cache && has_tensor_cores && contains(DecodeMmaHeadDims{}, head_dim) &&
         widest >= 0 && widest <= (INT32_MAX - head_dim) / 8;
}

// Makes a plan launch the tensor-core decode kernel (for a head dim of DecodeMmaHeadDims): its shared memory.
inline void use_tensor_cores(AttentionPlan& plan, int64_t head_dim) {
  plan.tensor_cores = true;
  plan.shared_bytes = decode_mma_shared_bytes(head_dim);
}

// A single pass this many waves long or longer is not split: its last wave wastes under 1/64 of the time (and the
// model's products stay far inside int64).
constexpr int64_t kMaxSinglePassWaves = 64;

// Whether blocks thread blocks fill their waves on slots: a single wave, or a last wave at least 90% full.
constexpr bool fills_waves(int64_t blocks, int64_t slots) {
  const int64_t last = blocks % slots;
  return blocks <= slots || last == 0 || 10 * last >= 9 * slots;
}

// The launch of paged_attention for these sizes, planned for the machine: num_sms multiprocessors, each holding
// blocks_per_sm thread blocks of the kernel at once (cudaOccupancyMaxActiveBlocksPerMultiprocessor of the
// instantiation launched; tests pass it), so slots = num_sms * blocks_per_sm blocks run together.
// partition_tokens: the longest split-KV partition (kPartitionSize). When it is a multiple of 512 the partitions
// may be k / 8 of it (k = 1..8: multiples of 64 tokens at the default, so the tensor-core kernel's 4 warps get the
// same number of 16-token tiles); otherwise (tests pass small ones to get many partitions from short sequences)
// they are exactly partition_tokens long. Beyond kMaxGridYZ partitions of a table-wide sequence they grow, in whole
// multiples of partition_tokens.
//
// The model (a ceiling and a proxy, not a measurement: no GPU has run it). Time is counted in token-times, the
// time a thread block takes to stream one token of its kv head. With base = num_seqs * num_kv_heads * blocks_per_group
// thread blocks per partition slot, P partitions of `size` tokens and a grid of Z partition slots (block z runs
// partitions z, z + Z, ... of its sequence: ceil(P / Z) at most), the call takes
//   ceil(base * Z / slots) * ceil(P / Z) * (size + overhead) + reduce
// for sequences that fill the table, where overhead = partition_tokens / 16 is a partition's fixed cost (the
// latency of its first loads, the merge of the warps' states, the partial results it writes and the reduce reads)
// and reduce = partition_tokens / 8 the reduce kernel's; the single pass takes ceil(base / slots) * (max_context +
// overhead). The plan is the least time over the single pass and every (size, Z) that is no slower than the plan
// of the longest partitions alone for sequences an eighth as long as the table (a table padded for one long
// sequence: smaller partitions over more slots can fill a full table's waves, but leave those slots idle for short
// sequences, where fewer slots looping over longer partitions do not). On equal time, one whose waves of thread
// blocks are full (fills_waves) first, then the fewest thread blocks, then the fewest partitions. The candidates of
// a size are the smallest Z of each ceil(P / Z) (a larger one only adds blocks), or, where that one's waves are not
// full, the smallest Z of the same time that fills them; those of fewer slots than one wave's most are slower.
// Full waves are a tie-break, not a constraint: no plan has them for some sizes (a context too short to split, at
// 1.5 waves of sequences), and where one has them but takes longer by the model, the faster plan is taken.
// Partitions keep their boundaries whatever Z is, so Z changes no result. The partition size does (the online
// softmax restarts at each partition), so on CUDA a sequence's bits may depend on its batch, as the choice between
// the single pass and split-KV already made them; unless batch_invariant: then the partitions are partition_tokens
// long (the size above for a table of at most kMaxGridYZ of them: 33.5M tokens at 512), at least two (a row of one
// partition leaves the second empty), so every row goes through the same partitions, records and reduce whatever
// the batch, the table's width and the GPU; Z fills one wave at most (it changes no result), and a shared-blocks
// plan's tasks are kept (their records are the rows' own bits, shared_blocks.cuh).
// The plan depends on the block table's width, never on seq_lens, so it needs no device-to-host copy and the
// launch can be captured in a CUDA graph.
//
// Shared blocks: num_shared_tasks > 0 (the tensor-core decode kernel, with the tasks of a shared-blocks plan) asks
// for split-KV, since a task writes the partition records of the rows it serves: the least time over the split
// plans alone (the model counts every row's partitions as its own: what sharing saves it does not see); grid.x
// gains one thread block per task. Where no split plan exists (a table of one partition), the plan is single pass
// and the tasks are dropped (num_shared_tasks = 0).
inline AttentionPlan plan_attention(int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                    int64_t max_blocks_per_seq, int64_t block_size, int64_t sliding_window,
                                    int64_t num_sms, int64_t blocks_per_sm,
                                    int64_t partition_tokens = kPartitionSize, int64_t num_shared_tasks = 0,
                                    bool batch_invariant = false) {
  AttentionPlan plan;
  constexpr int64_t kMaxSlotsFactor = int64_t{1} << 20;  // num_sms and blocks_per_sm: far below it on any GPU
  if (num_seqs < 1 || num_heads < 1 || num_kv_heads < 1 || block_size < 1 || max_blocks_per_seq < 0 ||
      sliding_window < 0 || num_sms < 1 || num_sms > kMaxSlotsFactor || blocks_per_sm < 1 ||
      blocks_per_sm > kMaxSlotsFactor || partition_tokens < 1 || partition_tokens > INT32_MAX || num_shared_tasks < 0 ||
      num_heads % num_kv_heads != 0) {
    plan.error = "invalid sizes: num_seqs " + std::to_string(num_seqs) + ", num_heads " + std::to_string(num_heads) +
                 ", num_kv_heads " + std::to_string(num_kv_heads) + ", max_blocks_per_seq " +
                 std::to_string(max_blocks_per_seq) + ", block_size " + std::to_string(block_size) +
                 ", sliding_window " + std::to_string(sliding_window) + ", num_sms " + std::to_string(num_sms) +
                 ", blocks_per_sm " + std::to_string(blocks_per_sm) + ", partition_tokens " +
                 std::to_string(partition_tokens) + ", num_shared_tasks " + std::to_string(num_shared_tasks) +
                 " (num_sms and blocks_per_sm in [1, 2^20], partition_tokens in [1, 2^31 - 1])";
    return plan;
  }
  const int64_t group_size = num_heads / num_kv_heads;
  const int64_t blocks_per_group = (group_size + kMaxGroup - 1) / kMaxGroup;
  const int64_t heads_per_block = (group_size + blocks_per_group - 1) / blocks_per_group;
  plan.grid = {num_seqs, num_kv_heads * blocks_per_group, 1};
  plan.error = grid_error(plan.grid, "num_seqs", "num_kv_heads * blocks_per_group", "partition slots");
  if (plan.error.empty()) {
    plan.error = grid_error({num_seqs, num_heads, 1}, "num_seqs", "num_heads", "1");  // the reduce kernel's grid
  }
  if (!plan.error.empty()) return plan;
  plan.group_size = static_cast<int>(group_size);
  plan.blocks_per_group = static_cast<int>(blocks_per_group);
  plan.heads_per_block = static_cast<int>(heads_per_block);
  plan.group_variant = attention_group_variant(num_heads, num_kv_heads);

  // seq_lens are int32, so no sequence is longer than INT32_MAX tokens whatever the table's width.
  constexpr int64_t kMaxTokens = INT32_MAX;
  plan.max_context = max_blocks_per_seq > kMaxTokens / block_size ? kMaxTokens : max_blocks_per_seq * block_size;
  // A window that covers every token the table can hold is no window (the CPU kernel reads it so, in int64).
  plan.sliding_window = sliding_window >= plan.max_context ? 0 : static_cast<int>(sliding_window);
  plan.partition_size = static_cast<int>(plan.max_context > 1 ? plan.max_context : 1);

  const int64_t base = plan.grid.x * plan.grid.y;  // thread blocks per partition slot
  const int64_t slots = num_sms * blocks_per_sm;
  const int64_t single_pass_waves = (base + slots - 1) / slots;
  int64_t longest = partition_tokens;
  if ((plan.max_context + longest - 1) / longest > kMaxGridYZ) {  // longer partitions, in whole multiples
    const int64_t needed = (plan.max_context + kMaxGridYZ - 1) / kMaxGridYZ;
    longest = (needed + partition_tokens - 1) / partition_tokens * partition_tokens;
  }
  // grid.x gains a thread block per task of a shared-blocks plan (split-KV only), where the grid allows
  const auto add_shared_tasks = [&] {
    const Grid grid = {num_seqs + num_shared_tasks, plan.grid.y, plan.grid.z};
    const std::string error = grid_error(grid, "num_seqs + num_shared_tasks", "num_kv_heads * blocks_per_group",
                                         "partition slots");
    if (error.empty()) plan.grid = grid, plan.num_shared_tasks = static_cast<int>(num_shared_tasks);
  };
  if (batch_invariant) {
    const int64_t partitions = std::max<int64_t>((plan.max_context + longest - 1) / longest, 2);
    plan.partition_size = static_cast<int>(longest);
    plan.num_partitions = static_cast<int>(partitions);
    plan.grid.z = std::min(partitions, std::max<int64_t>(1, slots / base));
    plan.reduce_grid = {num_seqs, num_heads, 1};
    if (num_shared_tasks > 0) add_shared_tasks();
    return plan;
  }
  const int64_t steps = partition_tokens % 512 == 0 ? 8 : 1;  // the sizes: longest * k / steps, k = 1..steps
  if (plan.max_context <= longest / steps || single_pass_waves >= kMaxSinglePassWaves) return plan;
  const bool split_only = num_shared_tasks > 0;

  // base < kMaxSinglePassWaves * slots <= 2^46 and Z <= 65535, so base * Z < 2^62; every time below is under 2^40.
  const int64_t overhead = partition_tokens / 16, reduce = partition_tokens / 8;
  struct Candidate {
    int64_t time, short_time, size, partitions, z;  // short_time: for sequences an eighth of the table's width
    bool full;
  };
  // A plan's time for sequences of `context` tokens (at most the table's width): the blocks whose partitions lie
  // past them find none and return at once (counted as free).
  const auto time_for = [&](int64_t context, int64_t size, int64_t partitions, int64_t z) {
    if (partitions == 1) return single_pass_waves * (context + overhead);
    const int64_t used = std::max<int64_t>((context + size - 1) / size, 1);  // the partitions with tokens
    const int64_t active = std::min(z, used);                                  // the slots with tokens
    return (base * active + slots - 1) / slots * ((used + active - 1) / active) * (size + overhead) + reduce;
  };
  const auto make = [&](int64_t size, int64_t partitions, int64_t z, bool full) {
    return Candidate{time_for(plan.max_context, size, partitions, z),
                     time_for(plan.max_context / 8, size, partitions, z), size, partitions, z, full};
  };
  const auto better = [](const Candidate& a, const Candidate& b) {  // a before b (blocks: base * z)
    if (a.time != b.time) return a.time < b.time;
    if (a.full != b.full) return a.full;
    if (a.z != b.z) return a.z < b.z;
    return a.partitions < b.partitions;
  };
  // f(candidate) for the partitions longest / steps * k, k = steps down to k_min, except those that cannot be as
  // fast as incumbent (f's best so far; the single pass at first).
  const auto each_candidate = [&](int64_t k_min, const Candidate& incumbent, auto&& f) {
    for (int64_t k = steps; k >= k_min; --k) {
      const int64_t size = longest / steps * k;
      const int64_t partitions = (plan.max_context + size - 1) / size;
      if (partitions < 2 || partitions > kMaxGridYZ) continue;
      // No grid takes less than the whole work spread over all slots, in whole partitions.
      if ((base * partitions + slots - 1) / slots * (size + overhead) + reduce > incumbent.time) continue;
      // Grids of one wave (z <= slots / base) take the least time at the most slots of it, z1; so the first z is
      // the smallest of z1's per_block (the same time, the fewest blocks).
      const int64_t z1 = std::max<int64_t>(1, std::min(partitions, slots / base));
      const int64_t first = (partitions + (partitions + z1 - 1) / z1 - 1) / ((partitions + z1 - 1) / z1);
      for (int64_t z = first;;) {  // the smallest z of each per_block = ceil(partitions / z), per_block descending
        const int64_t per_block = (partitions + z - 1) / z;
        const int64_t waves = (base * z + slots - 1) / slots;
        // Where z's waves are not full: the fewest slots of the same time whose blocks fill 90% of the last of
        // those waves, if they still run per_block partitions at most (some run one fewer).
        const int64_t filling = ((waves - 1) * 10 * slots + 9 * slots + 10 * base - 1) / (10 * base);
        const bool full = fills_waves(base * z, slots);
        if (full || filling > partitions || filling > waves * slots / base ||
            (partitions + filling - 1) / filling != per_block) {
          f(make(size, partitions, z, full));
        } else {
          f(make(size, partitions, filling, true));
        }
        if (per_block == 1) break;
        z = (partitions + per_block - 2) / (per_block - 1);  // the smallest z with ceil(partitions / z) < per_block
      }
    }
  };
  // The plan of the longest partitions alone (or the single pass), then the best plan no slower than it for short
  // sequences.
  // (split_only: the single pass as a candidate that every split plan beats)
  Candidate longest_plan = make(plan.max_context, 1, 1, fills_waves(base, slots));
  if (split_only) longest_plan.time = longest_plan.short_time = int64_t{1} << 62;
  each_candidate(steps, longest_plan, [&](const Candidate& c) {
    if (better(c, longest_plan)) longest_plan = c;
  });
  Candidate best = longest_plan;
  each_candidate(1, best, [&](const Candidate& c) {
    if (c.short_time <= longest_plan.short_time && better(c, best)) best = c;
  });
  if (best.partitions == 1) return plan;
  plan.partition_size = static_cast<int>(best.size);
  plan.num_partitions = static_cast<int>(best.partitions);
  plan.grid.z = best.z;
  plan.reduce_grid = {num_seqs, num_heads, 1};
  if (split_only) add_shared_tasks();
  return plan;
}

// ---------------------------------------------------------------------------------------------------------------
// paged_attention with query_start_loc: the tensor-core kernel (csrc/cuda/varlen_attention_kernels.cuh) for the
// sequences with two or more query rows. (Sequences with one query row take the decode kernel, planned by
// plan_attention; float32, and head dims without an instantiation here, take it for every row.)

constexpr int kVarlenThreads = 128;        // 4 warps
constexpr int kVarlenRows = 64;            // query rows of a thread block: 16 per warp, (token, query head) pairs

// The head dims with a tensor-core instantiation (multiples of 16, the k of mma.m16n8k16; 120 is not).
using VarlenHeadDims = IntList<64, 80, 96, 128, 256>;

// Keys per step: their K and V rows are copied into shared memory together (head dim 256: 16, so that two stages
// of K and V and Q fit the 99 KiB of shared memory of every GPU the build targets).
constexpr int varlen_key_tile(int head_dim) { return head_dim <= 128 ? 64 : 16; }

// The dynamic shared memory of the tensor-core kernel, in bytes from its (16-byte aligned) base. Rows of Q, K and V
// hold head_dim + 8 elements: 16 bytes of padding put the 8 rows of an ldmatrix in 8 different groups of 4 banks.
struct VarlenSmem {
  int64_t row;                 // elements per row of Q, K and V (head_dim + 8)
  int64_t q;                   // Q [kVarlenRows][row] (the input type)
  int64_t tiles;               // 4 x [key_tile][row] (the input type): K stages 0, 1 and V stages 0, 1; fp8 caches:
                               // K, V, then two stages of the stored bytes ([key_tile][head_dim] K, then V)
  int64_t offsets;             // [2][key_tile] RowOffsets: each key's K and V row offsets, for two steps
  int64_t row_pos, row_slope;  // [kVarlenRows] int32 / floats: each row's position and ALiBi slope
  int64_t bytes;               // the total
};

constexpr VarlenSmem varlen_smem(int64_t head_dim, int64_t element_bytes) {
  const int64_t key_tile = varlen_key_tile(static_cast<int>(head_dim));
  VarlenSmem m{};
  m.row = head_dim + 8;
  m.q = 0;
  m.tiles = m.q + kVarlenRows * m.row * element_bytes;
  m.offsets = m.tiles + 4 * key_tile * m.row * element_bytes;
  m.row_pos = m.offsets + 2 * key_tile * 16;
  m.row_slope = m.row_pos + kVarlenRows * 4;
  m.bytes = m.row_slope + kVarlenRows * 4;
  return m;
}

// Dynamic shared memory a thread block may opt in to on every GPU the build targets (compute capability 8.0 and
// up; sm_86 and sm_89 allow the least).
constexpr int64_t kMaxOptInSharedBytes = 99 * 1024;

struct VarlenPlan {
  int group_size = 0;       // num_heads / num_kv_heads
  int blocks_per_group = 0;  // thread blocks per (query tile, kv head): ceil(group_size / kVarlenRows)
  int heads_per_tile = 0;   // query heads of a tile: ceil(group_size / blocks_per_group) (the last thread block of a
                            // head group may have fewer)
  int tokens_per_tile = 0;  // query tokens of a tile: kVarlenRows / heads_per_tile (its rows: token-major pairs)
  int key_tile = 0;         // keys per step (varlen_key_tile)
  int64_t max_context = 0;  // as in AttentionPlan
  int sliding_window = 0;   // as in AttentionPlan
  Grid grid;                // (num_tokens / tokens_per_tile + num_seqs, num_kv_heads * blocks_per_group, 1)
  int threads = kVarlenThreads;
  int shared_bytes = 0;     // dynamic shared memory (varlen_smem)
  std::string error;        // "" or why the call cannot be launched
};

// The launch of the tensor-core kernel. Its grid does not depend on query_start_loc's values, so no device-to-host
// copy is needed: sequence s owns the tiles [qsl[s] / tokens_per_tile + s, qsl[s + 1] / tokens_per_tile + s + 1)
// of grid.x, at least ceil(q_s / tokens_per_tile) of them (floor is superadditive) and at most one more; every
// thread block finds its sequence by binary search, and tiles past a sequence's rows return at once.
inline VarlenPlan plan_varlen_attention(int64_t num_seqs, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                                        int64_t head_dim, int64_t element_bytes, int64_t max_blocks_per_seq,
                                        int64_t block_size, int64_t sliding_window) {
  VarlenPlan plan;
  if (num_seqs < 1 || num_tokens < 0 || num_heads < 1 || num_kv_heads < 1 || num_heads % num_kv_heads != 0 ||
      max_blocks_per_seq < 0 || sliding_window < 0) {
    plan.error = "invalid sizes: num_seqs " + std::to_string(num_seqs) + ", num_tokens " + std::to_string(num_tokens) +
                 ", num_heads " + std::to_string(num_heads) + ", num_kv_heads " + std::to_string(num_kv_heads) +
                 ", max_blocks_per_seq " + std::to_string(max_blocks_per_seq) + ", sliding_window " +
                 std::to_string(sliding_window);
    return plan;
  }
  if (!contains(VarlenHeadDims{}, head_dim)) {
    plan.error = "head_dim " + std::to_string(head_dim) + " has no tensor-core kernel (instantiated: " +
                 to_string(VarlenHeadDims{}) + ")";
    return plan;
  }
  if (element_bytes != 2) {
    plan.error = "the tensor-core kernel takes float16 and bfloat16 (element size 2), got element size " +
                 std::to_string(element_bytes);
    return plan;
  }
  if (block_size != 8 && block_size != 16 && block_size != 32) {
    plan.error = "block_size " + std::to_string(block_size) + " is not supported (supported: 8, 16, 32)";
    return plan;
  }
  const int64_t group_size = num_heads / num_kv_heads;
  const int64_t blocks_per_group = (group_size + kVarlenRows - 1) / kVarlenRows;
  const int64_t heads_per_tile = (group_size + blocks_per_group - 1) / blocks_per_group;
  plan.group_size = static_cast<int>(group_size);
  plan.blocks_per_group = static_cast<int>(blocks_per_group);
  plan.heads_per_tile = static_cast<int>(heads_per_tile);
  plan.tokens_per_tile = static_cast<int>(kVarlenRows / heads_per_tile);
  plan.key_tile = varlen_key_tile(static_cast<int>(head_dim));
  constexpr int64_t kMaxTokens = INT32_MAX;
  plan.max_context = max_blocks_per_seq > kMaxTokens / block_size ? kMaxTokens : max_blocks_per_seq * block_size;
  plan.sliding_window = sliding_window >= plan.max_context ? 0 : static_cast<int>(sliding_window);
  plan.grid = {num_tokens / plan.tokens_per_tile + num_seqs, num_kv_heads * blocks_per_group, 1};
  plan.error =
      grid_error(plan.grid, "num_tokens / tokens_per_tile + num_seqs", "num_kv_heads * blocks_per_group", "1");
  plan.shared_bytes = static_cast<int>(varlen_smem(head_dim, element_bytes).bytes);
  if (plan.error.empty() && plan.shared_bytes > kMaxOptInSharedBytes) {
    plan.error = "needs " + std::to_string(plan.shared_bytes) + " bytes of shared memory (at most " +
                 std::to_string(kMaxOptInSharedBytes) + ")";
  }
  return plan;
}

}  // namespace paged_attn
