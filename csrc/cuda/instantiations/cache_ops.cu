// The cache ops' launches (cache_ops_launch.h): the kernels of cache_ops_kernels.cuh on a plan's grid, for every
// Unit of dispatch_unit and every fp8 source dtype. No torch here: csrc/cuda/cache_ops.cpp calls these.
#include "../cache_ops_kernels.cuh"
#include "../cache_ops_launch.h"

namespace paged_attn {

template <typename Unit>
cudaError_t launch_reshape_and_cache(const ReshapeAndCacheParams<Unit>& params, const CopyPlan& plan,
                                     cudaStream_t stream) {
  reshape_and_cache_kernel<Unit><<<to_dim3(plan.grid), plan.threads, plan.shared_bytes, stream>>>(params);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_reshape_and_cache_fp8(const ReshapeAndCacheFp8Params<T>& params, const CopyPlan& plan,
                                         cudaStream_t stream) {
  reshape_and_cache_fp8_kernel<T><<<to_dim3(plan.grid), plan.threads, plan.shared_bytes, stream>>>(params);
  return cudaGetLastError();
}

template <typename Unit>
cudaError_t launch_concat_and_cache_mla(const ConcatAndCacheMlaParams<Unit>& params, const CopyPlan& plan,
                                        cudaStream_t stream) {
  concat_and_cache_mla_kernel<Unit><<<to_dim3(plan.grid), plan.threads, plan.shared_bytes, stream>>>(params);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_concat_and_cache_mla_fp8(const ConcatAndCacheMlaFp8Params<T>& params, const CopyPlan& plan,
                                            cudaStream_t stream) {
  concat_and_cache_mla_fp8_kernel<T><<<to_dim3(plan.grid), plan.threads, plan.shared_bytes, stream>>>(params);
  return cudaGetLastError();
}

template <typename Unit>
cudaError_t launch_copy_blocks(const CopyBlocksParams& params, const CopyPlan& plan, cudaStream_t stream) {
  copy_blocks_kernel<Unit><<<to_dim3(plan.grid), plan.threads, plan.shared_bytes, stream>>>(params);
  return cudaGetLastError();
}

#define PA_CACHE_OPS_FOR_UNIT(Unit)                                                                                   \
  template cudaError_t launch_reshape_and_cache<Unit>(const ReshapeAndCacheParams<Unit>&, const CopyPlan&,           \
                                                      cudaStream_t);                                                 \
  template cudaError_t launch_copy_blocks<Unit>(const CopyBlocksParams&, const CopyPlan&, cudaStream_t);         \
  template cudaError_t launch_concat_and_cache_mla<Unit>(const ConcatAndCacheMlaParams<Unit>&, const CopyPlan&,     \
                                                         cudaStream_t);
PA_CACHE_OPS_FOR_UNIT(uint4)
PA_CACHE_OPS_FOR_UNIT(uint2)
PA_CACHE_OPS_FOR_UNIT(uint32_t)
PA_CACHE_OPS_FOR_UNIT(uint16_t)
PA_CACHE_OPS_FOR_UNIT(uint8_t)
#undef PA_CACHE_OPS_FOR_UNIT

template cudaError_t launch_reshape_and_cache_fp8<float>(const ReshapeAndCacheFp8Params<float>&, const CopyPlan&,
                                                         cudaStream_t);
template cudaError_t launch_reshape_and_cache_fp8<__half>(const ReshapeAndCacheFp8Params<__half>&, const CopyPlan&,
                                                          cudaStream_t);
template cudaError_t launch_reshape_and_cache_fp8<__nv_bfloat16>(const ReshapeAndCacheFp8Params<__nv_bfloat16>&,
                                                                 const CopyPlan&, cudaStream_t);
template cudaError_t launch_concat_and_cache_mla_fp8<float>(const ConcatAndCacheMlaFp8Params<float>&,
                                                            const CopyPlan&, cudaStream_t);
template cudaError_t launch_concat_and_cache_mla_fp8<__half>(const ConcatAndCacheMlaFp8Params<__half>&,
                                                             const CopyPlan&, cudaStream_t);
template cudaError_t launch_concat_and_cache_mla_fp8<__nv_bfloat16>(
    const ConcatAndCacheMlaFp8Params<__nv_bfloat16>&, const CopyPlan&, cudaStream_t);

}  // namespace paged_attn
