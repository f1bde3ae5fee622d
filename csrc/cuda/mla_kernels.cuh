// Multi-head latent attention (MLA, DeepSeek-V2/V3, Kimi K2) over a paged latent cache, on tensor cores: the kernel
// of mla_attention on CUDA, float16 and bfloat16 (the cache of the query's dtype), compute capability 8.0+.
//
// The math (paged_attn.reference.mla_attention): every token t of a sequence has one cache row c_t of ROW = LORA +
// ROPE values (kv_lora_rank compressed values, then rope_dim RoPE'd key dims), shared by all heads. Query row i
// (the absorbed query: q_nope W_UK, then q_pe) of head h attends to the tokens 0..P of its sequence:
//   logit_t = scale * q[i, h] . c_t   (all ROW dims),   out[i, h] = sum_t softmax(logit)_t * c_t[:LORA].
// With H heads a row of 2 * ROW bytes feeds ~4 H ROW flops: at 16-128 heads the products bound the call, so the
// heads are the M of mma.m16n8k16 and every row is read once per kMlaHeads heads.
//
// The grid (plan_mla_attention, mla_plan.h): x = items (decode: sequences; with query_start_loc: query rows,
// QueryRows::kEveryRow), y = groups of up to kMlaHeads heads (block_heads), z = partition slots (split-KV as the
// decode kernels: thread block z runs partitions z, z + gridDim.z, ...; paged_attention_reduce_kernel at HEAD_DIM =
// LORA merges their records). A thread block (4 warps) loads its heads' query rows into shared memory once (Q, zero
// rows past its heads) and from there into registers (Q's A fragments, most of its k steps), then walks its partition's tokens in steps of kMlaTile = 32 rows at absolute positions
// (tokens outside [begin, end) are not read, zero-filled and count as -inf logits), two stages in flight:
//   0. (one step ahead) the step's 32 cache rows are copied into the free stage with cp.async: warp w copies rows
//      8w .. 8w + 7 (one block-table entry, loaded a step ahead), 4 lanes a row, 16 bytes a copy;
//   1. S = Q C^T (tile_logits): warp w computes its 8 rows' logits for the 16 heads (M = heads, N = 8 rows, K =
//      ROW): Q's fragments from registers, C^T as B fragments by ldmatrix from the stage;
//   2. the online softmax in base 2 (step_max, step_weights): the step's max per head over the 4 warps through
//      shared memory (one barrier); the reference max moves, and O and the sums are rescaled, only where the step's
//      max exceeds it by more than 2^8 (rescale_state: the same decision in every warp; such a step leaves the hot
//      loop, whose steps do not rescale, and rejoins it); p = exp2(logit - ref) rounded to T into P in shared memory
//      (a second barrier); every lane keeps its part of the running sum;
//   3. O += P C[:, :LORA] (tile_values): warp w owns the output columns [LORA / 4 w, LORA / 4 (w + 1)) of the 16
//      heads (M = heads, N = 8 columns, K = the 32 rows): P by ldmatrix, the values by ldmatrix.trans from the same
//      stage as step 1 (one read of a row serves both products).
// At the end of a partition the lanes' and warps' sums are added in a fixed order (the same bits on every run) and
// each warp writes its columns: out = O / sum and lse in single pass, the partition's record in split-KV.
// Fragment layouts: mma.cuh (g = lane / 4, t = lane % 4).
#pragma once

#include "attention_math.cuh"
#include "attention_params.cuh"
#include "cp_async.cuh"
#include "mla_plan.h"
#include "mma.cuh"

namespace paged_attn {

constexpr int kMlaWarps = kMlaThreads / 32;
static_assert(kMlaTile == 8 * kMlaWarps, "step 1: 8 rows per warp");

// The shared memory of one instantiation, in elements of T (mla_smem).
template <int LORA, int ROPE>
struct MlaLayout {
  static constexpr int ROW = LORA + ROPE;        // a cache row
  static constexpr int PAD_ROW = ROW + 8;        // its padded row in Q and the stages
  static constexpr int P_ROW = kMlaTile + 8;     // a padded row of P
  static constexpr int STAGE = kMlaTile * PAD_ROW;
  static constexpr int KSTEPS = ROW / 16;        // k steps of S
  static constexpr int COLS = LORA / kMlaWarps;  // a warp's output columns
  static constexpr int NTILES = COLS / 8;        // their n tiles in O += P C
  static constexpr int COPIES = ROW / 32;        // step 0: 16-byte copies per lane (4 lanes per row)
  // Q's k steps held in registers (tile_logits; the others by ldmatrix from Q's shared rows on every step): 24 of
  // 512 + 64's 36 (ptxas spills at 28 and more since the rescaling step left the hot loop), 6 of 128 + 32's 10
  // (with MIN_BLOCKS = 5: 94 registers, no spills)
  static constexpr int QREG = ROW <= 160 ? 6 : 24;
  static constexpr MlaSmem SMEM = mla_smem(ROW);
  // Resident thread blocks per SM that the registers must allow (__launch_bounds__): 5 at 128 + 32 (28 KB of
  // shared memory each); 512 + 64 holds 2 by its shared memory whatever the registers
  static constexpr int MIN_BLOCKS = ROW <= 160 ? 5 : 1;
  static_assert(SMEM.row == PAD_ROW && SMEM.stages == kMlaHeads * PAD_ROW, "the plan's layout");
  static_assert(KSTEPS % 2 == 0 && NTILES % 2 == 0, "ldmatrix.x4: two k steps of S, two n tiles of O");
};

// This lane's share of the online softmax of a partition, in base 2 (logits times scale * log2(e)): O for heads g
// and g + 8 of its warp's columns, their reference max (the same in every warp) and the sum of this lane's weights
// exp2(logit - ref).
template <int NTILES>
struct MlaState {
  float acc[NTILES][4];  // n tile j: (head g, columns 8 j + 2t, + 1), (head g + 8, the same columns)
  float ref[2], run_sum[2];

  __device__ __forceinline__ MlaState() {
#pragma unroll
    for (int j = 0; j < NTILES; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    ref[0] = ref[1] = -INFINITY;
    run_sum[0] = run_sum[1] = 0.0f;
  }
};

// Lazy rescaling (FlashAttention-4's): the weights are exp2(logit - ref) against a reference max per head that moves
// only when a step's max exceeds it by more than kMlaRescaleLog2, so that weights stay <= 2^8 (within float16 and
// bfloat16) and O and the sums are rescaled on a partition's first step with a token and rarely after.
constexpr float kMlaRescaleLog2 = 8.0f;

// The block-table entry of rows 8 warp .. 8 warp + 7 of step `tile` (one block: block_size is a power of two >= 8),
// or 0 when none of them is before `end` (an entry past the sequence's last block may be garbage).
__device__ __forceinline__ int32_t mla_group_entry(const int32_t* block_table, int tile, int warp, int end,
                                                   int block_shift) {
  const int first = tile * kMlaTile + 8 * warp;
  return first < end ? block_table[first >> block_shift] : 0;
}

// Step 0: starts the copies of this warp's 8 rows of step `tile` into `stage`. Lane l copies row l / 4's vectors
// l % 4, l % 4 + 4, ...; rows outside [begin, end) are zero-filled and not read.
template <typename T, int LORA, int ROPE>
__device__ __forceinline__ void copy_mla_rows(T* stage, const PagedCache<const T>& cache, int32_t entry, int tile,
                                              int warp, int lane, int begin, int end) {
  using L = MlaLayout<LORA, ROPE>;
  const int row = 8 * warp + lane / 4, token = tile * kMlaTile + row;
  const bool in_bounds = token >= begin && token < end;
  const T* src = cache.data + static_cast<int64_t>(entry) * cache.block_stride +
                 static_cast<int64_t>(token & (cache.block_size - 1)) * cache.token_stride + 8 * (lane % 4);
  T* dst = stage + row * L::PAD_ROW + 8 * (lane % 4);
#pragma unroll
  for (int i = 0; i < L::COPIES; ++i) cp_async_16(dst + 32 * i, src + 32 * i, in_bounds);
}

// Q's first QREG k steps as A fragments in registers (loaded once per thread block: ldmatrix from Q's shared rows);
// step 1 reads the others from shared memory on every step.
template <int QREG>
struct QueryFragments {
  uint32_t a[QREG > 0 ? QREG : 1][4];
};

// Step 1: S = Q C^T for this warp's 8 rows of the stage. s: (head g, rows 2t, 2t + 1), (head g + 8, the same rows).
// Two accumulators (even and odd k steps) halve the chain of dependent products.
template <typename T, int LORA, int ROPE, int QREG>
__device__ __forceinline__ void tile_logits(float (&s)[4], const QueryFragments<QREG>& q_regs, const T* q_shared,
                                            int q_lds, const T* stage, int c_lds) {
  using L = MlaLayout<LORA, ROPE>;
  float odd[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  s[0] = s[1] = s[2] = s[3] = 0.0f;
  uint32_t c[2][4];  // C^T of k steps k and k + 1, and of the next two (loaded one pair ahead)
  ldmatrix_x4(c[0], stage + c_lds);
#pragma unroll
  for (int k = 0; k < L::KSTEPS; k += 2) {
    const uint32_t(&now)[4] = c[(k / 2) % 2];
    if (k + 2 < L::KSTEPS) ldmatrix_x4(c[(k / 2 + 1) % 2], stage + c_lds + 16 * (k + 2));
    uint32_t q[4];
    if (k < QREG) {
      mma_m16n8k16<T>(s, q_regs.a[k], {now[0], now[1]}, s);
    } else {
      ldmatrix_x4(q, q_shared + q_lds + 16 * k);
      mma_m16n8k16<T>(s, q, {now[0], now[1]}, s);
    }
    if (k + 1 < QREG) {
      mma_m16n8k16<T>(odd, q_regs.a[k + 1], {now[2], now[3]}, odd);
    } else {
      ldmatrix_x4(q, q_shared + q_lds + 16 * (k + 1));
      mma_m16n8k16<T>(odd, q, {now[2], now[3]}, odd);
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) s[i] += odd[i];
}

// Moves the reference max of heads g and g + 8 to the step's max where it is higher, rescaling this lane's O and
// sums (by 1 for a head whose reference stays, by 0 on the first step with a token).
template <int NTILES>
__device__ __forceinline__ void rescale_state(MlaState<NTILES>& state, const float (&tile_max)[2]) {
  float factor[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float ref = fmaxf(state.ref[h], tile_max[h]);
    factor[h] = ref == -INFINITY ? 1.0f : fast_exp2(state.ref[h] - ref);  // (exp2(-inf) = 0)
    state.ref[h] = ref;
    state.run_sum[h] *= factor[h];
  }
#pragma unroll
  for (int j = 0; j < NTILES; ++j) {
    state.acc[j][0] *= factor[0], state.acc[j][1] *= factor[0];
    state.acc[j][2] *= factor[1], state.acc[j][3] *= factor[1];
  }
}

// Step 2a: the step's logits in base 2 (0 ... -inf outside [begin, end)) and their max per head over the 4 warps
// (through shared memory: one barrier), into tile_max; whether the reference max must move for them (more than 2^8
// below a step's max, for a head of the warp: the same answer in every warp, whose lanes hold all 16 heads, from the
// same maxima). token0: the token of s[0] (32 tile + 8 warp + 2t).
template <int NTILES>
__device__ __forceinline__ bool step_max(float (&s)[4], float (&tile_max)[2], const MlaState<NTILES>& state,
                                         float (*tile_max_s)[kMlaHeads], float scale_log2, const AttentionTask& task,
                                         int token0, int warp, int g, int t) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int token = token0 + k % 2;
    s[k] = token >= task.begin && token < task.end ? s[k] * scale_log2 : -INFINITY;
  }
  tile_max[0] = fmaxf(s[0], s[1]), tile_max[1] = fmaxf(s[2], s[3]);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
    tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
  }
  if (t == 0) tile_max_s[warp][g] = tile_max[0], tile_max_s[warp][g + 8] = tile_max[1];
  __syncthreads();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int w = 0; w < kMlaWarps; ++w) tile_max[h] = fmaxf(tile_max[h], tile_max_s[w][g + 8 * h]);
  }
  const bool grow = tile_max[0] > state.ref[0] + kMlaRescaleLog2 || tile_max[1] > state.ref[1] + kMlaRescaleLog2;
  return __any_sync(0xffffffffu, grow);
}

// Step 2b: s becomes p = exp2(logit - ref), written to P as T; this lane's sums take its p (a barrier: P is
// visible to every warp after it).
template <typename T, int NTILES>
__device__ __forceinline__ void step_weights(float (&s)[4], MlaState<NTILES>& state, T* p_shared, int warp, int g,
                                             int t) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float base = state.ref[h] == -INFINITY ? 0.0f : state.ref[h];  // p = 0, never exp2(-inf - -inf) = NaN
    s[2 * h] = fast_exp2(s[2 * h] - base), s[2 * h + 1] = fast_exp2(s[2 * h + 1] - base);
    state.run_sum[h] += s[2 * h] + s[2 * h + 1];
  }
  const int column = 8 * warp + 2 * t;
  *reinterpret_cast<uint32_t*>(p_shared + g * (kMlaTile + 8) + column) = pack2<T>(s[0], s[1]);
  *reinterpret_cast<uint32_t*>(p_shared + (g + 8) * (kMlaTile + 8) + column) = pack2<T>(s[2], s[3]);
  __syncthreads();
}

// Step 3: O += P C[:, columns] for the step in the stage (this warp's columns).
template <typename T, int LORA, int ROPE>
__device__ __forceinline__ void tile_values(MlaState<MlaLayout<LORA, ROPE>::NTILES>& state, const T* p_shared,
                                            int p_lds, const T* stage, int v_lds) {
  using L = MlaLayout<LORA, ROPE>;
#pragma unroll
  for (int k = 0; k < kMlaTile / 16; ++k) {
    uint32_t p[4];
    ldmatrix_x4(p, p_shared + p_lds + 16 * k);
#pragma unroll
    for (int j = 0; j < L::NTILES; j += 2) {
      uint32_t v[4];
      ldmatrix_x4_trans(v, stage + v_lds + 16 * k * L::PAD_ROW + 8 * j);
      mma_m16n8k16<T>(state.acc[j], p, {v[0], v[1]}, state.acc[j]);
      mma_m16n8k16<T>(state.acc[j + 1], p, {v[2], v[3]}, state.acc[j + 1]);
    }
  }
}

// The end of a partition: the sums of the lanes (over t) and of the warps (in warp order) per head, then this
// warp's columns of heads g and g + 8: out = O / sum and lse in single pass, the partition's record in split-KV.
template <typename T, int LORA, int ROPE>
__device__ __forceinline__ void write_mla_partition(MlaState<MlaLayout<LORA, ROPE>::NTILES>& state,
                                                    float (*sum_s)[kMlaHeads], const AttentionParams<T>& p,
                                                    const AttentionTask& task, int warp, int g, int t) {
  using L = MlaLayout<LORA, ROPE>;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    state.run_sum[h] += __shfl_xor_sync(0xffffffffu, state.run_sum[h], 1);
    state.run_sum[h] += __shfl_xor_sync(0xffffffffu, state.run_sum[h], 2);
  }
  if (t == 0) sum_s[warp][g] = state.run_sum[0], sum_s[warp][g + 8] = state.run_sum[1];
  __syncthreads();
  const int64_t row = p.num_partitions == 1 ? query_row(p) : 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int slot = g + 8 * h;
    const float max = state.ref[h] * 0.6931471805599453f;  // the sums' reference, in natural units (ln 2)
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kMlaWarps; ++w) total += sum_s[w][slot];
    if (slot >= task.num_heads) continue;
    const int head = task.first_head + slot;
    if (p.num_partitions == 1) {
      // the task has tokens, so total >= 1, or NaN, or 0 (every logit -inf: NaN)
      T* out = p.out + (row * p.num_heads + head) * LORA + L::COLS * warp + 2 * t;
#pragma unroll
      for (int j = 0; j < L::NTILES; ++j) {
        *reinterpret_cast<uint32_t*>(out + 8 * j) =
            pack2<T>(state.acc[j][2 * h] / total, state.acc[j][2 * h + 1] / total);
      }
      if (warp == 0 && t == 0 && p.lse != nullptr) {
        p.lse[row * p.num_heads + head] = row_lse(max, total, -INFINITY);
      }
    } else {
      const int64_t record =
          (static_cast<int64_t>(blockIdx.x) * p.num_heads + head) * p.num_partitions + task.partition;
      float* out = p.partial_out + record * LORA + L::COLS * warp + 2 * t;
#pragma unroll
      for (int j = 0; j < L::NTILES; ++j) {
        *reinterpret_cast<float2*>(out + 8 * j) = make_float2(state.acc[j][2 * h], state.acc[j][2 * h + 1]);
      }
      if (warp == 0 && t == 0) p.partial_max[record] = max, p.partial_sum[record] = total;
    }
  }
  __syncthreads();  // every warp has read sum_s and is done with the stages before the next partition
}

// The kernel: the item's task, Q into shared memory, then per partition: steps 0-3 over its tokens, two stages in
// flight, and write_mla_partition. p: AttentionParams with key_cache = the latent cache [num_blocks, block_size, 1,
// ROW] (value_cache unused), query [num_tokens, num_heads, ROW], out [num_tokens, num_heads, LORA] (contiguous), the
// plan of plan_mla_attention. Dynamic shared memory: mla_smem(ROW).bytes.
template <typename T, int LORA, int ROPE>
__global__ void __launch_bounds__(kMlaThreads, MlaLayout<LORA, ROPE>::MIN_BLOCKS)
    mla_attention_kernel(const AttentionParams<T> p) {
  using L = MlaLayout<LORA, ROPE>;
  PA_EXTERN_SHARED(uint4, shared_u4);
  PA_SHARED(float, tile_max_s, [kMlaWarps][kMlaHeads]);  // step 2: each warp's max per head
  PA_SHARED(float, sum_s, [kMlaWarps][kMlaHeads]);       // the end: each warp's sum per head
  T* const q_shared = reinterpret_cast<T*>(shared_u4) + L::SMEM.q;
  T* const stages = reinterpret_cast<T*>(shared_u4) + L::SMEM.stages;
  T* const p_shared = reinterpret_cast<T*>(shared_u4) + L::SMEM.p;

  AttentionTask task = attention_task(p);
  if (!task.active) return;  // uniform across the thread block
  if (p.num_partitions == 1 && task.begin >= task.end) {  // uniform: a row without tokens
    write_empty<T, T, LORA>(p, task);
    return;
  }
  int partition = task.partition;
  if (static_cast<int64_t>(partition) * p.partition_size >= task.seq_len) return;  // no partition with tokens

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  // Q: the thread block's heads' rows, zero rows past them.
  const T* query = p.query + query_row(p) * p.query_row_stride;
#pragma unroll
  for (int i = 0; i < (kMlaHeads * L::ROW / 8 + kMlaThreads - 1) / kMlaThreads; ++i) {
    const int c = threadIdx.x + kMlaThreads * i, head = c / (L::ROW / 8), vec = c % (L::ROW / 8);
    if (c < kMlaHeads * L::ROW / 8) {
      const bool has = head < task.num_heads;
      cp_async_16(q_shared + head * L::PAD_ROW + 8 * vec,
                  query + (task.first_head + (has ? head : 0)) * p.query_head_stride + 8 * vec, has);
    }
  }
  const int32_t* block_table = p.block_tables + static_cast<int64_t>(task.seq) * p.max_blocks_per_seq;
  int block_shift = 3;  // log2(block_size): a power of two from 8 (plan_mla_attention)
  while ((1 << block_shift) < p.key_cache.block_size) ++block_shift;
  // ldmatrix row addresses (lane l passes row l % 8 of matrix l / 8):
  //   Q (A of S, rows = heads): matrix m = (heads 8 (m & 1) .., dims 8 (m >> 1) ..) of each 16 x 16 step;
  //   C^T (B of S, two k steps): matrix m = (this warp's 8 rows, dims 8 m ..);
  //   P (A of O, rows = heads): as Q, over the step's rows;
  //   C (B of O, transposed): matrix m = (rows 8 (m & 1) .., this warp's columns 8 (m >> 1) ..).
  const int q_lds = (lane % 8 + 8 * ((lane / 8) & 1)) * L::PAD_ROW + 8 * (lane / 16);
  const int c_lds = (8 * warp + lane % 8) * L::PAD_ROW + 8 * (lane / 8);
  const int p_lds = (lane % 8 + 8 * ((lane / 8) & 1)) * L::P_ROW + 8 * (lane / 16);
  const int v_lds = (lane % 8 + 8 * ((lane / 8) & 1)) * L::PAD_ROW + L::COLS * warp + 8 * (lane / 16);

  // Q's fragments into registers, once Q has landed.
  cp_async_wait_all();
  __syncthreads();
  QueryFragments<L::QREG> q_regs;
#pragma unroll
  for (int k = 0; k < L::QREG; ++k) ldmatrix_x4(q_regs.a[k], q_shared + q_lds + 16 * k);
  const float scale_log2 = p.scale * 1.4426950408889634f;  // log2(e)
  for (; static_cast<int64_t>(partition) * p.partition_size < task.seq_len; partition += gridDim.z) {
    set_partition(task, p, partition);  // begin < end: no window, a partition below seq_len
    MlaState<L::NTILES> state;
    const int tile_end = (task.end + kMlaTile - 1) / kMlaTile;
    int tile = task.begin / kMlaTile;
    copy_mla_rows<T, LORA, ROPE>(stages, p.key_cache,
                                 mla_group_entry(block_table, tile, warp, task.end, block_shift), tile, warp, lane,
                                 task.begin, task.end);
    cp_async_commit();
    int32_t next_entry = mla_group_entry(block_table, tile + 1, warp, task.end, block_shift);
    int stage = 0;
    float s[4], tile_max[2];
    while (tile < tile_end) {
      // The steps whose max stays within 2^8 of the reference: the hot loop, with no rescaling in it.
      bool moves = false;
      for (; tile < tile_end; ++tile, stage ^= 1) {
        cp_async_wait<0>();
        __syncthreads();  // the step's rows are visible; every warp is done with the other stage
        // 0. The next step's rows into the other stage, and its successor's block-table entry.
        if (tile + 1 < tile_end) {
          copy_mla_rows<T, LORA, ROPE>(stages + (stage ^ 1) * L::STAGE, p.key_cache, next_entry, tile + 1, warp,
                                       lane, task.begin, task.end);
          next_entry = mla_group_entry(block_table, tile + 2, warp, task.end, block_shift);
        }
        cp_async_commit();
        const T* stage_rows = stages + stage * L::STAGE;
        tile_logits<T, LORA, ROPE, L::QREG>(s, q_regs, q_shared, q_lds, stage_rows, c_lds);  // 1. S = Q C^T
        moves = step_max(s, tile_max, state, tile_max_s, scale_log2, task,                    // 2. softmax
                         tile * kMlaTile + 8 * warp + 2 * t, warp, g, t);
        if (moves) break;  // (uniform across the thread block)
        step_weights<T, L::NTILES>(s, state, p_shared, warp, g, t);
        tile_values<T, LORA, ROPE>(state, p_shared, p_lds, stage_rows, v_lds);  // 3. O += P C
      }
      if (!moves) break;
      // A step that moves the reference (a partition's first with a token, rarely another): O and the sums
      // rescaled, then the rest of the step.
      rescale_state(state, tile_max);
      step_weights<T, L::NTILES>(s, state, p_shared, warp, g, t);
      tile_values<T, LORA, ROPE>(state, p_shared, p_lds, stages + stage * L::STAGE, v_lds);
      ++tile, stage ^= 1;
    }
    write_mla_partition<T, LORA, ROPE>(state, sum_s, p, task, warp, g, t);
  }
  cp_async_wait_all();  // (only empty groups are left)
}

}  // namespace paged_attn
