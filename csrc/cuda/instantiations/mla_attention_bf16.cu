// The latent-attention kernel for __nv_bfloat16 (see mla_launch.cuh: one file per dtype, compiled in parallel).
#include "../mla_launch.cuh"

namespace paged_attn {

cudaError_t launch_mla_attention(const AttentionParams<__nv_bfloat16>& params, const AttentionPlan& plan, int kv_lora_rank,
                                 cudaStream_t stream) {
  return launch_mla_attention_kernels(params, plan, kv_lora_rank, stream);
}

cudaError_t mla_attention_blocks_per_sm(__nv_bfloat16, int kv_lora_rank, int rope_dim, int device, int* blocks) {
  return mla_blocks_per_sm<__nv_bfloat16>(kv_lora_rank, rope_dim, device, blocks);
}

}  // namespace paged_attn
