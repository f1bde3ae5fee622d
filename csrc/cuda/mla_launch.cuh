// The launch of mla_attention's kernels for one dtype (instantiations/mla_attention_half.cu, _bf16.cu): the
// instantiation of (kv_lora_rank, rope_dim), with <<<>>> on a stream; they define the functions mla_launch.h
// declares.
#pragma once

#include <atomic>

#include "attention_kernels.cuh"  // paged_attention_reduce_kernel
#include "attention_launch.cuh"   // cached_blocks_per_sm
#include "mla_kernels.cuh"
#include "mla_launch.h"

namespace paged_attn {

template <typename T>
cudaError_t mla_blocks_per_sm(int kv_lora_rank, int rope_dim, int device, int* blocks) {
  cudaError_t error = cudaErrorInvalidValue;
  dispatch_mla(kv_lora_rank, rope_dim, MlaShapes{}, [&](auto lora, auto rope) {
    constexpr int LORA = decltype(lora)::value, ROPE = decltype(rope)::value;
    static std::atomic<int> cached[64] = {};  // 0: not asked yet
    error = cached_blocks_per_sm(cached, mla_attention_kernel<T, LORA, ROPE>,
                                 static_cast<int>(mla_smem(LORA + ROPE).bytes), device, blocks);
  });
  return error;
}

template <typename T>
cudaError_t launch_mla_attention_kernels(const AttentionParams<T>& params, const AttentionPlan& plan,
                                         int kv_lora_rank, cudaStream_t stream) {
  cudaError_t error = cudaSuccess;
  const bool found =
      dispatch_mla(kv_lora_rank, params.key_cache.head_dim - kv_lora_rank, MlaShapes{}, [&](auto lora, auto rope) {
        constexpr int LORA = decltype(lora)::value, ROPE = decltype(rope)::value;
        // NOTE: above 48 KiB of dynamic shared memory a kernel must opt in (per device: so on every launch; cheap).
        error = cudaFuncSetAttribute(mla_attention_kernel<T, LORA, ROPE>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, plan.shared_bytes);
        if (error != cudaSuccess) return;
        mla_attention_kernel<T, LORA, ROPE><<<to_dim3(plan.grid), plan.threads, plan.shared_bytes, stream>>>(params);
        if (plan.split() && cudaPeekAtLastError() == cudaSuccess) {
          paged_attention_reduce_kernel<T, T, LORA>
              <<<to_dim3(plan.reduce_grid), kAttentionThreads, 0, stream>>>(params);
        }
      });
  if (!found) return cudaErrorInvalidValue;
  return error != cudaSuccess ? error : cudaGetLastError();
}

}  // namespace paged_attn
