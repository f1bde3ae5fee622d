// The launch of the attention kernels for one dtype: the instantiation that the plan and head_dim select, with
// <<<>>> on a stream. Compiled for each dtype in its own file under instantiations/ (attention_float.cu,
// attention_half.cu, attention_bf16.cu, attention_fp8_*.cu; the tensor-core kernel in varlen_attention_half.cu,
// varlen_attention_bf16.cu and varlen_attention_fp8_*.cu), so the instantiations compile in parallel;
// csrc/cuda/attention.cu calls launch_paged_attention and launch_varlen_attention.
#pragma once

#include <atomic>

#include "attention_kernels.cuh"
#include "decode_mma_kernels.cuh"
#include "varlen_attention_kernels.cuh"

namespace paged_attn {

// Launches paged_attention_kernel (decode_mma_kernel when plan.tensor_cores), then (split-KV)
// paged_attention_reduce_kernel, on `stream`; returns the launch error (cudaGetLastError), cudaErrorInvalidValue when
// the head dim or group variant is not instantiated. params must hold the plan (params.set_plan(plan)).
cudaError_t launch_paged_attention(const AttentionParams<float>& params, const AttentionPlan& plan,
                                   cudaStream_t stream);
cudaError_t launch_paged_attention(const AttentionParams<__half>& params, const AttentionPlan& plan,
                                   cudaStream_t stream);
cudaError_t launch_paged_attention(const AttentionParams<__nv_bfloat16>& params, const AttentionPlan& plan,
                                   cudaStream_t stream);
// fp8 caches (attention_fp8_float.cu, attention_fp8_half.cu, attention_fp8_bf16.cu).
cudaError_t launch_paged_attention(const AttentionParams<float, Fp8>& params, const AttentionPlan& plan,
                                   cudaStream_t stream);
cudaError_t launch_paged_attention(const AttentionParams<__half, Fp8>& params, const AttentionPlan& plan,
                                   cudaStream_t stream);
cudaError_t launch_paged_attention(const AttentionParams<__nv_bfloat16, Fp8>& params, const AttentionPlan& plan,
                                   cudaStream_t stream);

// The thread blocks of the paged_attention_kernel instantiation for params' head dim and group_variant (or, with
// tensor_cores, of decode_mma_kernel for the head dim) that one SM of the current device (`device`) holds at once,
// into *blocks: cudaOccupancyMaxActiveBlocksPerMultiprocessor at kAttentionThreads threads and the kernel's dynamic
// shared memory, cached per (device, instantiation); plan_attention's blocks_per_sm. cudaErrorInvalidValue when the
// head dim or group variant is not instantiated.
cudaError_t paged_attention_blocks_per_sm(const AttentionParams<float>& params, int group_variant, bool tensor_cores,
                                          int device, int* blocks);
cudaError_t paged_attention_blocks_per_sm(const AttentionParams<__half>& params, int group_variant, bool tensor_cores,
                                          int device, int* blocks);
cudaError_t paged_attention_blocks_per_sm(const AttentionParams<__nv_bfloat16>& params, int group_variant,
                                          bool tensor_cores, int device, int* blocks);
cudaError_t paged_attention_blocks_per_sm(const AttentionParams<float, Fp8>& params, int group_variant,
                                          bool tensor_cores, int device, int* blocks);
cudaError_t paged_attention_blocks_per_sm(const AttentionParams<__half, Fp8>& params, int group_variant,
                                          bool tensor_cores, int device, int* blocks);
cudaError_t paged_attention_blocks_per_sm(const AttentionParams<__nv_bfloat16, Fp8>& params, int group_variant,
                                          bool tensor_cores, int device, int* blocks);

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

// Launches varlen_attention_kernel on `stream` (float16 and bfloat16 queries; caches of the same dtype, or fp8:
// varlen_attention_fp8_half.cu, varlen_attention_fp8_bf16.cu); returns the launch error, cudaErrorInvalidValue when
// the head dim is not instantiated. params must hold the plan (params.set_varlen_plan).
cudaError_t launch_varlen_attention(const AttentionParams<__half>& params, const VarlenPlan& plan,
                                    cudaStream_t stream);
cudaError_t launch_varlen_attention(const AttentionParams<__nv_bfloat16>& params, const VarlenPlan& plan,
                                    cudaStream_t stream);
cudaError_t launch_varlen_attention(const AttentionParams<__half, Fp8>& params, const VarlenPlan& plan,
                                    cudaStream_t stream);
cudaError_t launch_varlen_attention(const AttentionParams<__nv_bfloat16, Fp8>& params, const VarlenPlan& plan,
                                    cudaStream_t stream);

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
