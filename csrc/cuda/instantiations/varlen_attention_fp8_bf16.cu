// The tensor-core attention kernel for fp8 caches with __nv_bfloat16 queries (see attention_launch.cuh: one file
// per dtype, compiled in parallel; the fp8 format, e4m3 or e5m2, is a run-time parameter, so one instantiation
// serves both).
#include "../attention_launch.cuh"

namespace paged_attn {

cudaError_t launch_varlen_attention(const AttentionParams<__nv_bfloat16, Fp8>& params, const VarlenPlan& plan,
                                    cudaStream_t stream) {
  return launch_varlen_attention_kernel(params, plan, stream);
}

}  // namespace paged_attn
