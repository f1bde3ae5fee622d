// merge_attention_states on CUDA: the torch-facing launcher (plain C++). The kernel, its algorithm and grid mapping
// are in merge_attention_states_kernels.cuh (launched by csrc/cuda/instantiations/merge_attention_states.cu), its
// launch plan in copy_plan.h (plan_merge_attention_states).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <limits>

#include "../common.h"
#include "merge_attention_states_launch.h"

namespace paged_attn {
namespace {

void merge_attention_states_cuda(at::Tensor& out,             // [num_tokens, num_heads, head_dim]
                                 at::Tensor& lse,             // [num_tokens, num_heads], float32
                                 const at::Tensor& out_a,     // [num_tokens, num_heads, head_dim]
                                 const at::Tensor& lse_a,     // [num_tokens, num_heads], float32
                                 const at::Tensor& out_b,     // [num_tokens, num_heads, head_dim]
                                 const at::Tensor& lse_b) {   // [num_tokens, num_heads], float32
  check_merge_attention_states_args(out, lse, out_a, lse_a, out_b, lse_b);
  TORCH_CHECK(out_a.is_cuda(), "merge_attention_states (CUDA kernel): out_a must be on a CUDA device, got ",
              out_a.device());
  const int64_t num_tokens = out_a.size(0), num_heads = out_a.size(1), head_dim = out_a.size(2);
  if (num_tokens == 0 || num_heads == 0) return;
  TORCH_CHECK(num_heads <= std::numeric_limits<int>::max() && head_dim <= std::numeric_limits<int>::max(),
              "merge_attention_states: num_heads and head_dim must fit in int32, got shape ", out_a.sizes());
  const CopyPlan plan = plan_merge_attention_states(num_tokens, num_heads);
  TORCH_CHECK(plan.error.empty(), "merge_attention_states: this call cannot be launched on CUDA: ", plan.error);
  const c10::cuda::CUDAGuard guard(out_a.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto run = [&](auto dtype_tag) {
    using T = decltype(dtype_tag);
    const MergeAttentionStatesParams<T> params{
        static_cast<T*>(out.data_ptr()), lse.data_ptr<float>(),
        static_cast<const T*>(out_a.data_ptr()), lse_a.data_ptr<float>(),
        static_cast<const T*>(out_b.data_ptr()), lse_b.data_ptr<float>(),
        {out.stride(0), out.stride(1)}, {out_a.stride(0), out_a.stride(1)}, {out_b.stride(0), out_b.stride(1)},
        {lse.stride(0), lse.stride(1)}, {lse_a.stride(0), lse_a.stride(1)}, {lse_b.stride(0), lse_b.stride(1)},
        static_cast<int>(num_heads), static_cast<int>(head_dim)};
    C10_CUDA_CHECK(launch_merge_attention_states(params, plan, stream));
  };
  switch (out_a.scalar_type()) {  // check_merge_attention_states_args allows exactly these
    case at::kFloat: return run(float{});
    case at::kHalf: return run(__half{});
    case at::kBFloat16: return run(__nv_bfloat16{});
    default: TORCH_CHECK(false, "merge_attention_states: unsupported dtype ", out_a.scalar_type());
  }
}

}  // namespace
}  // namespace paged_attn

TORCH_LIBRARY_IMPL(paged_attn, CUDA, m) {
  m.impl("merge_attention_states", &paged_attn::merge_attention_states_cuda);
}
