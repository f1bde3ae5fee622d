// The attention kernels for __half (see attention_launch.cuh: one file per dtype, compiled in parallel).
#include "../attention_launch.cuh"

namespace paged_attn {

cudaError_t launch_paged_attention(const AttentionParams<__half>& params, const AttentionPlan& plan,
                                   cudaStream_t stream) {
  return launch_paged_attention_kernels(params, plan, stream);
}

}  // namespace paged_attn
