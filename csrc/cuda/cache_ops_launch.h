// The cache ops' launches (csrc/cuda/instantiations/cache_ops.cu): declared without device code, so that the
// torch-facing launchers (csrc/cuda/cache_ops.cpp) compile as plain C++ and the kernels compile once for every torch
// release (they read no torch header: scripts/nvcc_cache.py keys them by what they read).
#pragma once

#include <cuda_runtime.h>

#include "cache_ops_params.h"

namespace paged_attn {

// The launches: each launches its kernel with the plan's grid on `stream` and returns cudaGetLastError(). Unit is one
// of dispatch_unit's types; T float, __half or __nv_bfloat16.
template <typename Unit>
cudaError_t launch_reshape_and_cache(const ReshapeAndCacheParams<Unit>& params, const CopyPlan& plan,
                                     cudaStream_t stream);
template <typename T>
cudaError_t launch_reshape_and_cache_fp8(const ReshapeAndCacheFp8Params<T>& params, const CopyPlan& plan,
                                         cudaStream_t stream);
template <typename Unit>
cudaError_t launch_concat_and_cache_mla(const ConcatAndCacheMlaParams<Unit>& params, const CopyPlan& plan,
                                        cudaStream_t stream);
template <typename T>
cudaError_t launch_concat_and_cache_mla_fp8(const ConcatAndCacheMlaFp8Params<T>& params, const CopyPlan& plan,
                                            cudaStream_t stream);
template <typename Unit>
cudaError_t launch_copy_blocks(const CopyBlocksParams& params, const CopyPlan& plan, cudaStream_t stream);

}  // namespace paged_attn
