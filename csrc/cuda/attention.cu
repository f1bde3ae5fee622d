// Paged decode attention on CUDA: one query token per sequence attends to that sequence's keys/values, which lie
// in scattered blocks of the paged cache, reached through its block table.
//
// Algorithm (per thread block: one sequence, one kv head, up to kMaxGroup query heads of its group, and one
// partition of the sequence's tokens). The tokens are walked in tiles of kTile:
//   1. logits:  every K row of the tile is read once (16-byte loads) and dotted with all the group's queries
//               (held in registers); lanes of a row reduce with warp shuffles. Scale, soft cap and ALiBi are
//               applied; logits go to shared memory.
//   2. softmax: one warp per query head updates the running max and sum (online softmax) and turns the tile's
//               logits into probabilities relative to the new max.
//   3. values:  every V row of the tile is read once and accumulated, weighted, into float32 registers, after
//               the accumulators are rescaled to the new max.
// Row groups then add their accumulators in shared memory.
//
// Grid: (num_kv_heads * head_chunks, num_seqs, num_partitions); head_chunks = ceil(group / kMaxGroup), so each K/V
// byte is read from memory once per thread block (once in total for group sizes up to kMaxGroup).
//   - single pass (num_partitions == 1): the thread block covers the whole sequence and writes `out`.
//   - split-KV (flash-decoding, vLLM's v2): the thread block covers kPartitionSize tokens and writes its partial
//     (max, sum, unnormalized output); paged_attention_reduce_kernel merges the partitions exactly.
// The launcher picks split-KV when the single-pass grid would leave the GPU underfilled. No host-device
// synchronization: partitions are sized from block_tables' width, not from seq_lens, so the op can be captured
// in a CUDA graph.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "../common.h"

namespace paged_attn {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxGroup = 8;          // query heads served by one thread block
constexpr int kTile = 256;            // tokens per tile (logits held in shared memory)
constexpr int kUnroll = 4;            // rows loaded before they are used, per row group
constexpr int kPartitionSize = 512;   // tokens per partition in split-KV mode (a multiple of every block size)

// ---------------------------------------------------------------------------------------------------------------
// Conversions. A "vector" is 16 bytes: 8 half/bfloat16 or 4 float values.
__device__ inline float to_float(float x) { return x; }
__device__ inline float to_float(__half x) { return __half2float(x); }
__device__ inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ inline void from_float(float& out, float x) { out = x; }
__device__ inline void from_float(__half& out, float x) { out = __float2half_rn(x); }
__device__ inline void from_float(__nv_bfloat16& out, float x) { out = __float2bfloat16_rn(x); }

template <typename T>
struct VecTraits {
  static constexpr int kElems = 16 / sizeof(T);
};

__device__ inline void vec_to_floats(const uint4& v, float (&f)[4]) {
  const float4 x = *reinterpret_cast<const float4*>(&v);
  f[0] = x.x, f[1] = x.y, f[2] = x.z, f[3] = x.w;
}
__device__ inline void vec_to_floats(const uint4& v, float (&f)[8], __half) {
  const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 x = __half22float2(h[k]);
    f[2 * k] = x.x, f[2 * k + 1] = x.y;
  }
}
__device__ inline void vec_to_floats(const uint4& v, float (&f)[8], __nv_bfloat16) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 x = __bfloat1622float2(h[k]);
    f[2 * k] = x.x, f[2 * k + 1] = x.y;
  }
}
template <typename T>
__device__ inline void to_floats(const uint4& v, float (&f)[VecTraits<T>::kElems]) {
  if constexpr (std::is_same_v<T, float>) {
    vec_to_floats(v, f);
  } else {
    vec_to_floats(v, f, T{});
  }
}

// ---------------------------------------------------------------------------------------------------------------
// All paged address arithmetic, in one place. Token t of the sequence lives in block block_table[t / block_size]
// at offset t % block_size; its row for kv head h starts at (offset * num_kv_heads + h) * head_dim elements into
// the block. NOTE: block offsets are 64-bit: num_blocks * block_stride can exceed 2^31 elements.
template <typename T>
struct PagedKV {
  const T* key_cache;     // [num_blocks, block_size, num_kv_heads, head_dim]
  const T* value_cache;   // [num_blocks, block_size, num_kv_heads, head_dim]
  int64_t key_block_stride, value_block_stride;  // elements
  const int32_t* block_tables;                   // [num_seqs, max_blocks_per_seq]
  int max_blocks_per_seq, block_size, num_kv_heads, head_dim;

  __device__ const T* row(const T* cache, int64_t block_stride, int seq, int token, int kv_head) const {
    const int64_t block = block_tables[static_cast<int64_t>(seq) * max_blocks_per_seq + token / block_size];
    return cache + block * block_stride + static_cast<int64_t>((token % block_size) * num_kv_heads + kv_head) * head_dim;
  }
};

// Loads this lane's 16-byte vectors (row_lane, row_lane + LANES, ...) of kUnroll rows of a tile of one cache: rows
// first_row + u * row_stride (u < kUnroll). A row at or past n is not read (it may be a NaN-poisoned slot past the
// sequence's end) and comes back as zeros. All loads are issued before any is used.
template <typename T, int LANES, int VPL, int NVEC>
__device__ inline void load_rows(uint4 (&rows)[kUnroll][VPL], const PagedKV<T>& kv, const T* cache,
                                 int64_t block_stride, int seq, int kv_head, int tile_begin, int first_row,
                                 int row_stride, int n, int row_lane) {
  constexpr int VEC = VecTraits<T>::kElems;
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int j = first_row + u * row_stride;
    const T* row = j < n ? kv.row(cache, block_stride, seq, tile_begin + j, kv_head) : nullptr;
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      const int v = row_lane + i * LANES;
      rows[u][i] = (row != nullptr && v < NVEC) ? *reinterpret_cast<const uint4*>(row + v * VEC) : uint4{0, 0, 0, 0};
    }
  }
}

template <int LANES>
__device__ inline float sum_over_lanes(float x) {
#pragma unroll
  for (int mask = LANES / 2; mask > 0; mask /= 2) x += __shfl_xor_sync(0xffffffffu, x, mask);
  return x;
}

__device__ inline float warp_max(float x) {
#pragma unroll
  for (int mask = 16; mask > 0; mask /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, mask));
  return x;
}

constexpr int pow2_ceil(int x) { return x <= 1 ? 1 : 2 * pow2_ceil((x + 1) / 2); }

// ---------------------------------------------------------------------------------------------------------------
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kThreads) paged_attention_kernel(
    T* __restrict__ out,                  // [num_seqs, num_heads, HEAD_DIM]                  (single pass)
    float* __restrict__ partial_out,      // [num_seqs, num_heads, num_partitions, HEAD_DIM]  (split-KV)
    float* __restrict__ partial_max,      // [num_seqs, num_heads, num_partitions]
    float* __restrict__ partial_sum,      // [num_seqs, num_heads, num_partitions]
    const T* __restrict__ query,          // [num_seqs, num_heads, HEAD_DIM], strides below
    int64_t query_seq_stride, int64_t query_head_stride,
    const PagedKV<T> kv,
    const int32_t* __restrict__ seq_lens,      // [num_seqs]
    const float* __restrict__ alibi_slopes,    // [num_heads] or nullptr
    float scale, float soft_cap, int sliding_window, int num_heads, int partition_size) {
  // Lanes of a warp are split into row groups of LANES lanes; each row group reads one K or V row at a time,
  // lane l taking the 16-byte vectors l, l + LANES, ... of the row.
  constexpr int VEC = VecTraits<T>::kElems;
  constexpr int NVEC = HEAD_DIM / VEC;
  constexpr int LANES = pow2_ceil(NVEC) < 32 ? pow2_ceil(NVEC) : 32;
  constexpr int VPL = (NVEC + LANES - 1) / LANES;  // vectors per lane
  constexpr int ROW_GROUPS = kWarps * (32 / LANES);

  __shared__ float q_s[kMaxGroup][HEAD_DIM];
  __shared__ float logits_s[kMaxGroup][kTile];
  __shared__ float acc_s[kMaxGroup][HEAD_DIM];
  __shared__ float max_s[kMaxGroup], sum_s[kMaxGroup], rescale_s[kMaxGroup];

  const int seq = blockIdx.y, partition = blockIdx.z, num_partitions = gridDim.z;
  const int group = num_heads / kv.num_kv_heads;
  const int head_chunks = (group + kMaxGroup - 1) / kMaxGroup;
  const int kv_head = blockIdx.x / head_chunks;
  const int first_head = kv_head * group + (blockIdx.x % head_chunks) * kMaxGroup;
  const int num_group_heads = min(kMaxGroup, kv_head * group + group - first_head);

  const int seq_len = seq_lens[seq];
  const int window_start = sliding_window > 0 ? max(0, seq_len - sliding_window) : 0;
  const int begin = max(window_start, partition * partition_size);
  const int end = min(seq_len, (partition + 1) * partition_size);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // Row j of a tile is read by row group j % ROW_GROUPS. The loops below step over warp-uniform bases so that every
  // lane of a warp runs the same iterations (the lane shuffles need the whole warp).
  const int row_lane = lane % LANES, row_in_warp = lane / LANES, warp_first_row = warp * (32 / LANES);

  for (int i = tid; i < num_group_heads * HEAD_DIM; i += kThreads) {
    const int g = i / HEAD_DIM, d = i % HEAD_DIM;
    q_s[g][d] = scale * to_float(query[seq * query_seq_stride + (first_head + g) * query_head_stride + d]);
    acc_s[g][d] = 0.0f;
  }
  if (tid < kMaxGroup) {
    max_s[tid] = -INFINITY, sum_s[tid] = 0.0f, rescale_s[tid] = 0.0f;
  }
  __syncthreads();

  float q[kMaxGroup][VPL][VEC];     // this lane's slice of every query of the group (pre-scaled)
  float acc[kMaxGroup][VPL][VEC];   // this row group's weighted sum of V rows, same slice
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g)
#pragma unroll
    for (int i = 0; i < VPL; ++i)
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const int d = (row_lane + i * LANES) * VEC + e;
        q[g][i][e] = (g < num_group_heads && d < HEAD_DIM) ? q_s[g][d] : 0.0f;
        acc[g][i][e] = 0.0f;
      }

  for (int tile_begin = begin; tile_begin < end; tile_begin += kTile) {
    const int n = min(kTile, end - tile_begin);

    // 1. logits[g][j] for the tile's tokens.
    for (int j0 = warp_first_row; j0 < n; j0 += ROW_GROUPS * kUnroll) {
      uint4 k[kUnroll][VPL];
      load_rows<T, LANES, VPL, NVEC>(k, kv, kv.key_cache, kv.key_block_stride, seq, kv_head, tile_begin,
                                     j0 + row_in_warp, ROW_GROUPS, n, row_lane);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = j0 + row_in_warp + u * ROW_GROUPS;
        float kf[VPL][VEC];
#pragma unroll
        for (int i = 0; i < VPL; ++i) to_floats<T>(k[u][i], kf[i]);
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) {
          if (g >= num_group_heads) break;  // uniform across the thread block
          float dot = 0.0f;
#pragma unroll
          for (int i = 0; i < VPL; ++i)
#pragma unroll
            for (int e = 0; e < VEC; ++e) dot = fmaf(q[g][i][e], kf[i][e], dot);
          dot = sum_over_lanes<LANES>(dot);  // every lane takes part, also past the tile's end
          if (row_lane == 0 && j < n) {
            const int token = tile_begin + j;
            if (soft_cap > 0.0f) dot = soft_cap * tanhf(dot / soft_cap);
            if (alibi_slopes != nullptr) dot += alibi_slopes[first_head + g] * static_cast<float>(token - (seq_len - 1));
            logits_s[g][j] = dot;
          }
        }
      }
    }
    __syncthreads();

    // 2. Online softmax: one warp per query head.
    for (int g = warp; g < num_group_heads; g += kWarps) {
      float tile_max = -INFINITY;
      for (int j = lane; j < n; j += 32) tile_max = fmaxf(tile_max, logits_s[g][j]);
      const float new_max = fmaxf(max_s[g], warp_max(tile_max));
      float tile_sum = 0.0f;
      for (int j = lane; j < n; j += 32) {
        const float p = __expf(logits_s[g][j] - new_max);
        logits_s[g][j] = p;
        tile_sum += p;
      }
      tile_sum = sum_over_lanes<32>(tile_sum);
      __syncwarp();
      if (lane == 0) {
        const float rescale = __expf(max_s[g] - new_max);  // 0 on the first tile (max_s = -inf)
        rescale_s[g] = rescale;
        sum_s[g] = sum_s[g] * rescale + tile_sum;
        max_s[g] = new_max;
      }
    }
    __syncthreads();

    // 3. acc = acc * rescale + sum_j p[g][j] * V_j.
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      const float rescale = g < num_group_heads ? rescale_s[g] : 0.0f;
#pragma unroll
      for (int i = 0; i < VPL; ++i)
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[g][i][e] *= rescale;
    }
    for (int j0 = warp_first_row; j0 < n; j0 += ROW_GROUPS * kUnroll) {
      uint4 v[kUnroll][VPL];
      load_rows<T, LANES, VPL, NVEC>(v, kv, kv.value_cache, kv.value_block_stride, seq, kv_head, tile_begin,
                                     j0 + row_in_warp, ROW_GROUPS, n, row_lane);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = j0 + row_in_warp + u * ROW_GROUPS;
        if (j >= n) break;  // rows past the tile were not loaded (and may be NaN-poisoned slots)
        float vf[VPL][VEC];
#pragma unroll
        for (int i = 0; i < VPL; ++i) to_floats<T>(v[u][i], vf[i]);
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) {
          if (g >= num_group_heads) break;
          const float p = logits_s[g][j];
#pragma unroll
          for (int i = 0; i < VPL; ++i)
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[g][i][e] = fmaf(p, vf[i][e], acc[g][i][e]);
        }
      }
    }
    __syncthreads();  // logits_s is rewritten by the next tile
  }

  // Row groups add their accumulators.
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    if (g >= num_group_heads) break;
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      const int v = row_lane + i * LANES;
      if (v < NVEC) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) atomicAdd(&acc_s[g][v * VEC + e], acc[g][i][e]);
      }
    }
  }
  __syncthreads();

  for (int i = tid; i < num_group_heads * HEAD_DIM; i += kThreads) {
    const int g = i / HEAD_DIM, d = i % HEAD_DIM;
    const int64_t head_index = static_cast<int64_t>(seq) * num_heads + first_head + g;
    if (num_partitions == 1) {
      const float sum = sum_s[g];
      from_float(out[head_index * HEAD_DIM + d], sum > 0.0f ? acc_s[g][d] / sum : 0.0f);  // seq_len 0 -> zeros
    } else {
      partial_out[(head_index * num_partitions + partition) * HEAD_DIM + d] = acc_s[g][d];
      if (d == 0) {
        partial_max[head_index * num_partitions + partition] = max_s[g];
        partial_sum[head_index * num_partitions + partition] = sum_s[g];
      }
    }
  }
}

// Merges the partitions of split-KV: out = sum_p w_p * partial_out_p / sum_p w_p * partial_sum_p with
// w_p = exp(partial_max_p - max_p partial_max_p). Empty partitions (sum 0) get weight 0.
// Grid: (num_heads, num_seqs); dynamic shared memory: num_partitions floats.
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kThreads) paged_attention_reduce_kernel(
    T* __restrict__ out,                        // [num_seqs, num_heads, HEAD_DIM]
    const float* __restrict__ partial_out,      // [num_seqs, num_heads, num_partitions, HEAD_DIM]
    const float* __restrict__ partial_max,      // [num_seqs, num_heads, num_partitions]
    const float* __restrict__ partial_sum,      // [num_seqs, num_heads, num_partitions]
    int num_partitions) {
  extern __shared__ float weights_s[];  // [num_partitions]
  const int64_t head_index = static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x;
  const float* maxes = partial_max + head_index * num_partitions;
  const float* sums = partial_sum + head_index * num_partitions;

  float global_max = -INFINITY;
  for (int p = 0; p < num_partitions; ++p) {
    if (sums[p] > 0.0f) global_max = fmaxf(global_max, maxes[p]);
  }
  for (int p = threadIdx.x; p < num_partitions; p += blockDim.x) {
    weights_s[p] = sums[p] > 0.0f ? __expf(maxes[p] - global_max) : 0.0f;
  }
  __syncthreads();
  float total = 0.0f;
  for (int p = 0; p < num_partitions; ++p) total += weights_s[p] * sums[p];

  for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
    float o = 0.0f;
    for (int p = 0; p < num_partitions; ++p) {
      if (weights_s[p] > 0.0f) o += weights_s[p] * partial_out[(head_index * num_partitions + p) * HEAD_DIM + d];
    }
    from_float(out[head_index * HEAD_DIM + d], total > 0.0f ? o / total : 0.0f);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Host side.

int multiprocessor_count(int device) {
  static int counts[64] = {0};
  int& count = counts[device % 64];
  if (count == 0) C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

template <typename T, int HEAD_DIM>
void launch(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
            const std::optional<at::Tensor>& alibi_slopes, int64_t sliding_window, double logits_soft_cap) {
  const int num_seqs = query.size(0), num_heads = query.size(1);
  TORCH_CHECK(num_seqs <= 65535, "paged_attention: at most 65535 sequences per call on CUDA, got ", num_seqs);
  const int block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int max_blocks_per_seq = block_tables.size(1);
  const int64_t max_context = static_cast<int64_t>(max_blocks_per_seq) * block_size;
  const int group = num_heads / num_kv_heads;
  const int head_chunks = (group + kMaxGroup - 1) / kMaxGroup;

  // Split-KV when one thread block per (sequence, kv head) would leave SMs idle and sequences can be long.
  // The partition count comes from the block table's width (known on the host), not from seq_lens.
  const int64_t single_pass_blocks = static_cast<int64_t>(num_seqs) * num_kv_heads * head_chunks;
  const int64_t wanted_blocks = 4 * static_cast<int64_t>(multiprocessor_count(query.get_device()));
  int num_partitions = 1;
  if (single_pass_blocks < wanted_blocks && max_context > kPartitionSize) {
    num_partitions = static_cast<int>((max_context + kPartitionSize - 1) / kPartitionSize);
  }
  const int partition_size = num_partitions == 1 ? static_cast<int>(std::max<int64_t>(max_context, 1)) : kPartitionSize;

  at::Tensor partial_out, partial_max, partial_sum;
  if (num_partitions > 1) {
    const auto options = query.options().dtype(at::kFloat);
    partial_out = at::empty({num_seqs, num_heads, num_partitions, HEAD_DIM}, options);
    partial_max = at::empty({num_seqs, num_heads, num_partitions}, options);
    partial_sum = at::empty({num_seqs, num_heads, num_partitions}, options);
  }
  const PagedKV<T> kv{static_cast<const T*>(key_cache.data_ptr()),
                      static_cast<const T*>(value_cache.data_ptr()),
                      key_cache.stride(0),
                      value_cache.stride(0),
                      block_tables.data_ptr<int32_t>(),
                      max_blocks_per_seq,
                      block_size,
                      num_kv_heads,
                      HEAD_DIM};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid(num_kv_heads * head_chunks, num_seqs, num_partitions);
  paged_attention_kernel<T, HEAD_DIM><<<grid, kThreads, 0, stream>>>(
      static_cast<T*>(out.data_ptr()), num_partitions > 1 ? partial_out.data_ptr<float>() : nullptr,
      num_partitions > 1 ? partial_max.data_ptr<float>() : nullptr,
      num_partitions > 1 ? partial_sum.data_ptr<float>() : nullptr, static_cast<const T*>(query.data_ptr()),
      query.stride(0), query.stride(1), kv, seq_lens.data_ptr<int32_t>(),
      alibi_slopes.has_value() ? alibi_slopes->data_ptr<float>() : nullptr, static_cast<float>(scale),
      static_cast<float>(logits_soft_cap), static_cast<int>(sliding_window), num_heads, partition_size);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (num_partitions > 1) {
    paged_attention_reduce_kernel<T, HEAD_DIM>
        <<<dim3(num_heads, num_seqs), kThreads, num_partitions * sizeof(float), stream>>>(
            static_cast<T*>(out.data_ptr()), partial_out.data_ptr<float>(), partial_max.data_ptr<float>(),
            partial_sum.data_ptr<float>(), num_partitions);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// The one compile-time switch: head_dim selects the kernel instantiation (dtype is dispatched around it).
template <typename T>
void dispatch_head_dim(int64_t head_dim, at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                       double scale, const std::optional<at::Tensor>& alibi_slopes, int64_t sliding_window,
                       double logits_soft_cap) {
  auto run = [&](auto head_dim_constant) {
    launch<T, decltype(head_dim_constant)::value>(out, query, key_cache, value_cache, block_tables, seq_lens, scale,
                                                  alibi_slopes, sliding_window, logits_soft_cap);
  };
  switch (head_dim) {
    case 32: return run(std::integral_constant<int, 32>{});
    case 64: return run(std::integral_constant<int, 64>{});
    case 80: return run(std::integral_constant<int, 80>{});
    case 96: return run(std::integral_constant<int, 96>{});
    case 112: return run(std::integral_constant<int, 112>{});
    case 120: return run(std::integral_constant<int, 120>{});
    case 128: return run(std::integral_constant<int, 128>{});
    case 192: return run(std::integral_constant<int, 192>{});
    case 256: return run(std::integral_constant<int, 256>{});
    default:
      TORCH_CHECK(false, "paged_attention: head_dim ", head_dim,
                  " is not supported on CUDA (supported: 32, 64, 80, 96, 112, 120, 128, 192, 256)");
  }
}

void paged_attention_cuda(at::Tensor& out,                  // [num_seqs, num_heads, head_dim]
                          const at::Tensor& query,          // [num_seqs, num_heads, head_dim]
                          const at::Tensor& key_cache,      // [num_blocks, block_size, num_kv_heads, head_dim]
                          const at::Tensor& value_cache,    // [num_blocks, block_size, num_kv_heads, head_dim]
                          const at::Tensor& block_tables,   // [num_seqs, max_blocks_per_seq], int32
                          const at::Tensor& seq_lens,       // [num_seqs], int32
                          double scale, const std::optional<at::Tensor>& alibi_slopes, int64_t sliding_window,
                          double logits_soft_cap) {
  check_paged_attention_args(out, query, key_cache, value_cache, block_tables, seq_lens, scale, alibi_slopes,
                             sliding_window, logits_soft_cap);
  TORCH_CHECK(query.is_cuda(), "paged_attention: expected CUDA tensors, got ", query.device());
  const int64_t block_size = key_cache.size(1);
  TORCH_CHECK(block_size == 8 || block_size == 16 || block_size == 32, "paged_attention: block_size ", block_size,
              " is not supported on CUDA (supported: 8, 16, 32)");
  const uint64_t elem = key_cache.element_size();
  TORCH_CHECK(access_width({address_of(key_cache), address_of(value_cache), key_cache.stride(0) * elem,
                            value_cache.stride(0) * elem}) == 16,
              "paged_attention: the caches and their block strides must be 16-byte aligned on CUDA");
  const c10::cuda::CUDAGuard guard(query.device());
  if (validation_enabled()) check_block_table_range(block_tables.cpu(), seq_lens.cpu(), key_cache.size(0), block_size);
  if (query.size(0) == 0 || query.size(1) == 0) return;
  const at::Tensor block_tables_c = block_tables.contiguous(), seq_lens_c = seq_lens.contiguous();
  const std::optional<at::Tensor> alibi_c =
      alibi_slopes.has_value() ? std::optional<at::Tensor>(alibi_slopes->contiguous()) : std::nullopt;

  const int64_t head_dim = query.size(2);
  switch (query.scalar_type()) {
    case at::kFloat:
      return dispatch_head_dim<float>(head_dim, out, query, key_cache, value_cache, block_tables_c, seq_lens_c, scale,
                                      alibi_c, sliding_window, logits_soft_cap);
    case at::kHalf:
      return dispatch_head_dim<__half>(head_dim, out, query, key_cache, value_cache, block_tables_c, seq_lens_c,
                                       scale, alibi_c, sliding_window, logits_soft_cap);
    case at::kBFloat16:
      return dispatch_head_dim<__nv_bfloat16>(head_dim, out, query, key_cache, value_cache, block_tables_c,
                                              seq_lens_c, scale, alibi_c, sliding_window, logits_soft_cap);
    default:
      TORCH_CHECK(false, "paged_attention: unsupported dtype ", query.scalar_type());
  }
}

}  // namespace
}  // namespace paged_attn

TORCH_LIBRARY_IMPL(paged_attn, CUDA, m) { m.impl("paged_attention", &paged_attn::paged_attention_cuda); }
