// CPU kernel of merge_attention_states: two partial attention results over disjoint key ranges, each a row of
// head_dim values with its log-sum-exp, merged exactly (what a split-KV or cascade kernel does at its end).
//
//   m = max(lse_a, lse_b), w_a = exp(lse_a - m), w_b = exp(lse_b - m)
//   out = out_a * (w_a / (w_a + w_b)) + out_b * (w_b / (w_a + w_b))   in float32, rounded once to out's dtype
//   lse = m + log(w_a + w_b)
//
// Edges (the same in the CUDA kernel, csrc/cuda/merge_attention_states_kernels.cuh, and in
// paged_attn/reference.py): an lse of +inf dominates (a part whose softmax mass is infinite, as a +inf attention
// sink makes it: paged_attention then writes out 0 and lse +inf): the merge is that part's output, lse +inf (both
// +inf: their mean), so that splitting a call's keys and merging the parts gives the whole call for every sink;
// -inf is a part that saw no key; both -inf: scales 0 (out = 0 * out_a + 0 * out_b, so 0 for finite values) and
// lse = -inf; a NaN lse makes the whole row and its lse NaN; a NaN (or, with a zero scale, an inf) in out_a or out_b
// makes that element NaN. (vLLM's merge_attn_states reads +inf as -inf instead: FlashAttention 2's "no key" marker.)
//
// Parallelism: at::parallel_for over (token, head) rows, in tasks of at least kMinBytesPerCpuTask bytes.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "../common.h"

namespace paged_attn {
namespace {

struct MergeScales {
  float a, b, lse;
};

inline MergeScales merge_scales(float lse_a, float lse_b) {
  constexpr float inf = std::numeric_limits<float>::infinity();
  if ((lse_a == inf || lse_b == inf) && !std::isnan(lse_a) && !std::isnan(lse_b)) {  // an infinite mass dominates
    const float n = static_cast<float>(lse_a == inf) + static_cast<float>(lse_b == inf);
    return {static_cast<float>(lse_a == inf) / n, static_cast<float>(lse_b == inf) / n, inf};
  }
  if (lse_a == -inf && lse_b == -inf) return {0.f, 0.f, -inf};  // neither part saw a key
  const float m = std::fmax(lse_a, lse_b);  // fmax skips a NaN, but then that part's weight is NaN below
  const float w_a = std::exp(lse_a - m), w_b = std::exp(lse_b - m);
  const float sum = w_a + w_b;
  return {w_a / sum, w_b / sum, m + std::log(sum)};
}

template <typename scalar_t>
void merge_rows(at::Tensor& out, at::Tensor& lse, const at::Tensor& out_a, const at::Tensor& lse_a,
                const at::Tensor& out_b, const at::Tensor& lse_b) {
  const int64_t num_heads = out_a.size(1), head_dim = out_a.size(2), num_rows = out_a.size(0) * num_heads;
  auto* out_ptr = out.data_ptr<scalar_t>();
  auto* lse_ptr = lse.data_ptr<float>();
  const auto* a_ptr = out_a.const_data_ptr<scalar_t>();
  const auto* b_ptr = out_b.const_data_ptr<scalar_t>();
  const auto* lse_a_ptr = lse_a.const_data_ptr<float>();
  const auto* lse_b_ptr = lse_b.const_data_ptr<float>();
  const int64_t row_bytes = 3 * head_dim * static_cast<int64_t>(sizeof(scalar_t));
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerCpuTask / std::max<int64_t>(1, row_bytes));
  at::parallel_for(0, num_rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t token = row / num_heads, head = row % num_heads;
      const MergeScales s = merge_scales(lse_a_ptr[token * lse_a.stride(0) + head * lse_a.stride(1)],
                                         lse_b_ptr[token * lse_b.stride(0) + head * lse_b.stride(1)]);
      lse_ptr[token * lse.stride(0) + head * lse.stride(1)] = s.lse;
      const scalar_t* a = a_ptr + token * out_a.stride(0) + head * out_a.stride(1);
      const scalar_t* b = b_ptr + token * out_b.stride(0) + head * out_b.stride(1);
      scalar_t* o = out_ptr + token * out.stride(0) + head * out.stride(1);
      // Rows are contiguous (checked): GCC 12 (-O3 -march=x86-64-v3) vectorizes this loop for float32 and bfloat16
      // (-fopt-info-vec); float16 converts element by element.
      for (int64_t d = 0; d < head_dim; ++d) {
        o[d] = static_cast<scalar_t>(static_cast<float>(a[d]) * s.a + static_cast<float>(b[d]) * s.b);
      }
    }
  });
}

void merge_attention_states_cpu(at::Tensor& out,              // [num_tokens, num_heads, head_dim]
                                at::Tensor& lse,              // [num_tokens, num_heads], float32
                                const at::Tensor& out_a,      // [num_tokens, num_heads, head_dim]
                                const at::Tensor& lse_a,      // [num_tokens, num_heads], float32
                                const at::Tensor& out_b,      // [num_tokens, num_heads, head_dim]
                                const at::Tensor& lse_b) {    // [num_tokens, num_heads], float32
  check_merge_attention_states_args(out, lse, out_a, lse_a, out_b, lse_b);
  TORCH_CHECK(out_a.device().is_cpu(), "merge_attention_states (CPU kernel): out_a must be on the CPU, got ",
              out_a.device());
  if (lse.numel() == 0) return;
  switch (out_a.scalar_type()) {  // check_merge_attention_states_args allows exactly these
    case at::kFloat: return merge_rows<float>(out, lse, out_a, lse_a, out_b, lse_b);
    case at::kHalf: return merge_rows<at::Half>(out, lse, out_a, lse_a, out_b, lse_b);
    case at::kBFloat16: return merge_rows<at::BFloat16>(out, lse, out_a, lse_a, out_b, lse_b);
    default: TORCH_INTERNAL_ASSERT(false, "unreachable: dtype checked above");
  }
}

}  // namespace
}  // namespace paged_attn

TORCH_LIBRARY_IMPL(paged_attn, CPU, m) { m.impl("merge_attention_states", &paged_attn::merge_attention_states_cpu); }
