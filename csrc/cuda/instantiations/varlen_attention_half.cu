// The tensor-core attention kernel for __half (see attention_launch.cuh: one file per dtype, compiled in parallel).
#include "../attention_launch.cuh"

namespace paged_attn {

cudaError_t launch_varlen_attention(const AttentionParams<__half>& params, const VarlenPlan& plan,
                                    cudaStream_t stream) {
  return launch_varlen_attention_kernel(params, plan, stream);
}

}  // namespace paged_attn
