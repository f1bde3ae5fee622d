// The attention kernels for __nv_bfloat16 (see attention_launch.cuh: one file per dtype, compiled in parallel).
#include "../attention_launch.cuh"

namespace paged_attn {

cudaError_t launch_paged_attention(const AttentionParams<__nv_bfloat16>& params, const AttentionPlan& plan,
                                   cudaStream_t stream) {
  return launch_paged_attention_kernels(params, plan, stream);
}

cudaError_t paged_attention_blocks_per_sm(const AttentionParams<__nv_bfloat16>& params, int group_variant,
                                          bool tensor_cores, int device, int* blocks) {
  return attention_blocks_per_sm(params, group_variant, tensor_cores, device, blocks);
}

}  // namespace paged_attn
