// The launch of the attention kernels for one dtype: the instantiation that the plan and head_dim select, with
// <<<>>> on a stream. Compiled for each dtype in its own file under instantiations/ (attention_float.cu,
// attention_half.cu, attention_bf16.cu, attention_fp8_*.cu; the tensor-core kernel in varlen_attention_half.cu,
// varlen_attention_bf16.cu and varlen_attention_fp8_*.cu), so the instantiations compile in parallel; they define
// the functions that attention_launch.h declares, which csrc/cuda/attention.cpp calls.
#pragma once

#include <atomic>

#include "attention_launch.h"
#include "attention_kernels.cuh"
#include "decode_mma_kernels.cuh"
#include "varlen_attention_kernels.cuh"

namespace paged_attn {

// cudaOccupancyMaxActiveBlocksPerMultiprocessor of `kernel` (with `shared_bytes` of dynamic shared memory, opted into
// above 48 KiB), cached per device in the static of the calling instantiation.
template <typename Kernel>
cudaError_t cached_blocks_per_sm(std::atomic<int> (&cached)[64], Kernel kernel, int shared_bytes, int device,
                                 int* blocks) {
  const bool cacheable = device >= 0 && device < 64;
  if (cacheable && (*blocks = cached[device].load(std::memory_order_relaxed)) > 0) return cudaSuccess;
  cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes);
  if (error == cudaSuccess) {
    error = cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, kernel, kAttentionThreads, shared_bytes);
  }
  if (error == cudaSuccess && cacheable && *blocks > 0) cached[device].store(*blocks, std::memory_order_relaxed);
  return error;
}

template <typename T, typename C, int HEAD_DIM, int GROUP>
cudaError_t cached_attention_blocks_per_sm(int device, int* blocks) {
  static std::atomic<int> cached[64] = {};  // 0: not asked yet
  return cached_blocks_per_sm(cached, paged_attention_kernel<T, C, HEAD_DIM, GROUP>, 0, device, blocks);
}

template <typename T, int HEAD_DIM>
cudaError_t cached_decode_mma_blocks_per_sm(int device, int* blocks) {
  static std::atomic<int> cached[64] = {};
  return cached_blocks_per_sm(cached, decode_mma_kernel<T, HEAD_DIM>, decode_mma_shared_bytes(HEAD_DIM), device,
                              blocks);
}

template <typename T, typename C>
cudaError_t attention_blocks_per_sm(const AttentionParams<T, C>& params, int group_variant, bool tensor_cores,
                                    int device, int* blocks) {
  cudaError_t error = cudaErrorInvalidValue;
  if constexpr (std::is_same_v<T, C> && sizeof(T) == 2) {
    if (tensor_cores) {
      dispatch(params.key_cache.head_dim, DecodeMmaHeadDims{}, [&](auto head_dim) {
        error = cached_decode_mma_blocks_per_sm<T, decltype(head_dim)::value>(device, blocks);
      });
      return error;
    }
  }
  dispatch_attention<C>(params.key_cache.head_dim, group_variant, [&](auto head_dim, auto group) {
    error = cached_attention_blocks_per_sm<T, C, decltype(head_dim)::value, decltype(group)::value>(device, blocks);
  });
  return error;
}

template <typename T, typename C>
cudaError_t launch_paged_attention_kernels(const AttentionParams<T, C>& params, const AttentionPlan& plan,
                                           cudaStream_t stream) {
  const int head_dim = params.key_cache.head_dim;
  const auto reduce = [&](auto head_dim_constant) {
    if (plan.split() && cudaPeekAtLastError() == cudaSuccess) {
      paged_attention_reduce_kernel<T, C, decltype(head_dim_constant)::value>
          <<<to_dim3(plan.reduce_grid), plan.threads, 0, stream>>>(params);
    }
  };
  bool found = false;
  if constexpr (std::is_same_v<T, C> && sizeof(T) == 2) {
    if (plan.tensor_cores) {
      found = dispatch(head_dim, DecodeMmaHeadDims{}, [&](auto head_dim_constant) {
        constexpr int HEAD_DIM = decltype(head_dim_constant)::value;
        // NOTE: above 48 KiB of dynamic shared memory a kernel must opt in (per device: so on every launch; cheap).
        const cudaError_t error = cudaFuncSetAttribute(
            decode_mma_kernel<T, HEAD_DIM>, cudaFuncAttributeMaxDynamicSharedMemorySize, plan.shared_bytes);
        if (error != cudaSuccess) return;  // cudaGetLastError reports it
        decode_mma_kernel<T, HEAD_DIM><<<to_dim3(plan.grid), plan.threads, plan.shared_bytes, stream>>>(params);
        reduce(head_dim_constant);
      });
      return found ? cudaGetLastError() : cudaErrorInvalidValue;
    }
  }
  if (plan.tensor_cores) return cudaErrorInvalidValue;  // no tensor-core decode for these types
  found = dispatch_attention<C>(head_dim, plan.group_variant, [&](auto head_dim_constant, auto group) {
    constexpr int HEAD_DIM = decltype(head_dim_constant)::value, GROUP = decltype(group)::value;
    paged_attention_kernel<T, C, HEAD_DIM, GROUP><<<to_dim3(plan.grid), plan.threads, 0, stream>>>(params);
    reduce(head_dim_constant);
  });
  return found ? cudaGetLastError() : cudaErrorInvalidValue;
}

template <typename T, typename C>
cudaError_t launch_varlen_attention_kernel(const AttentionParams<T, C>& params, const VarlenPlan& plan,
                                           cudaStream_t stream) {
  cudaError_t error = cudaSuccess;
  const bool found = dispatch(params.key_cache.head_dim, VarlenHeadDims{}, [&](auto head_dim) {
    constexpr int HEAD_DIM = decltype(head_dim)::value;
    // NOTE: above 48 KiB of dynamic shared memory a kernel must opt in (per device: so on every launch; cheap).
    error = cudaFuncSetAttribute(varlen_attention_kernel<T, C, HEAD_DIM>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, plan.shared_bytes);
    if (error == cudaSuccess) {
      varlen_attention_kernel<T, C, HEAD_DIM>
          <<<to_dim3(plan.grid), plan.threads, plan.shared_bytes, stream>>>(params);
    }
  });
  if (!found) return cudaErrorInvalidValue;
  return error != cudaSuccess ? error : cudaGetLastError();
}

}  // namespace paged_attn
