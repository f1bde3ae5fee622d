// pack_linear_weight and linear on CUDA: cuBLAS multiplies the weight as it is, so "packed" is the weight itself
// (contiguous [out_features, in_features]) and linear is torch's. The CPU kernels (csrc/cpu/linear.cpp) pack for the
// dot-product units; the ops exist on both devices so that a model's code does not ask where it runs.
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include "../common.h"

namespace paged_attn {
namespace {

bool is_linear_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
}

at::Tensor pack_linear_weight_cuda(const at::Tensor& weight) {  // [out_features, in_features]
  TORCH_CHECK(weight.dim() == 2, "pack_linear_weight: expected a 2-D weight [out_features, in_features], got shape ",
              weight.sizes());
  TORCH_CHECK(is_linear_dtype(weight.scalar_type()),
              "pack_linear_weight: expected a float32, float16 or bfloat16 weight on CUDA, got ", weight.scalar_type());
  return weight.contiguous();
}

at::Tensor linear_cuda(const at::Tensor& x,       // [num_rows, in_features]
                       const at::Tensor& packed,  // [out_features, in_features]: pack_linear_weight's output
                       int64_t out_features) {
  TORCH_CHECK(x.dim() == 2, "linear: expected x of shape [num_rows, in_features], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == packed.scalar_type() && is_linear_dtype(x.scalar_type()),
              "linear: expected x and packed_weight of one dtype (float32, float16 or bfloat16), got ",
              x.scalar_type(), " and ", packed.scalar_type());
  TORCH_CHECK(packed.dim() == 2 && packed.size(0) == out_features && packed.size(1) == x.size(1),
              "linear: on CUDA packed_weight must be pack_linear_weight's output [", out_features, ", ", x.size(1),
              "], got shape ", packed.sizes());
  return at::linear(x, packed);
}

}  // namespace
}  // namespace paged_attn

TORCH_LIBRARY_IMPL(paged_attn, CUDA, m) {
  m.impl("pack_linear_weight", &paged_attn::pack_linear_weight_cuda);
  m.impl("linear", &paged_attn::linear_cuda);
}
