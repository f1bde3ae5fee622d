// The attention kernels for fp8 caches with __nv_bfloat16 queries (see attention_launch.cuh: one file per dtype,
// compiled in parallel; the fp8 format, e4m3 or e5m2, is a run-time parameter, so one instantiation serves both).
#include "../attention_launch.cuh"

namespace paged_attn {

cudaError_t launch_paged_attention(const AttentionParams<__nv_bfloat16, Fp8>& params, const AttentionPlan& plan,
                                   cudaStream_t stream) {
  return launch_paged_attention_kernels(params, plan, stream);
}

cudaError_t paged_attention_blocks_per_sm(const AttentionParams<__nv_bfloat16, Fp8>& params, int group_variant,
                                          bool tensor_cores, int device, int* blocks) {
  return attention_blocks_per_sm(params, group_variant, tensor_cores, device, blocks);
}

}  // namespace paged_attn
