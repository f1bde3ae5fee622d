// merge_attention_states' launch (merge_attention_states_launch.h): the kernel of merge_attention_states_kernels.cuh
// on a plan's grid, for each dtype. No torch here: csrc/cuda/merge_attention_states.cpp calls it.
#include "../merge_attention_states_kernels.cuh"
#include "../merge_attention_states_launch.h"

namespace paged_attn {

template <typename T>
cudaError_t launch_merge_attention_states(const MergeAttentionStatesParams<T>& params, const CopyPlan& plan,
                                          cudaStream_t stream) {
  // grid (num_tokens, ceil(num_heads / kMergeRowsPerBlock)), one warp per (token, head) row
  merge_attention_states_kernel<T><<<to_dim3(plan.grid), plan.threads, plan.shared_bytes, stream>>>(params);
  return cudaGetLastError();
}

template cudaError_t launch_merge_attention_states<float>(const MergeAttentionStatesParams<float>&, const CopyPlan&,
                                                          cudaStream_t);
template cudaError_t launch_merge_attention_states<__half>(const MergeAttentionStatesParams<__half>&, const CopyPlan&,
                                                           cudaStream_t);
template cudaError_t launch_merge_attention_states<__nv_bfloat16>(const MergeAttentionStatesParams<__nv_bfloat16>&,
                                                                  const CopyPlan&, cudaStream_t);

}  // namespace paged_attn
