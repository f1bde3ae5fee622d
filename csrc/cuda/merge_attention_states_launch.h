// merge_attention_states' launch (csrc/cuda/instantiations/merge_attention_states.cu): declared without device code,
// so that the torch-facing launcher (csrc/cuda/merge_attention_states.cpp) compiles as plain C++ and the kernel once
// for every torch release (it reads no torch header: scripts/nvcc_cache.py keys it by what it reads).
#pragma once

#include <cuda_runtime.h>

#include "copy_plan.h"
#include "merge_attention_states_params.h"

namespace paged_attn {

// Launches merge_attention_states_kernel with the plan's grid on `stream`; returns cudaGetLastError(). T: float,
// __half or __nv_bfloat16.
template <typename T>
cudaError_t launch_merge_attention_states(const MergeAttentionStatesParams<T>& params, const CopyPlan& plan,
                                          cudaStream_t stream);

}  // namespace paged_attn
