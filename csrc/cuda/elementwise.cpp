// rms_norm, add_rms_norm and silu_and_mul on CUDA: torch's own ops, in the order of transformers' eager code (the
// fused one-pass kernels are the CPU's, csrc/cpu/elementwise.cpp, where each op's wake-up and dispatch cost more than
// its arithmetic); the ops exist on both devices so that a model's code does not ask where it runs.
#include <ATen/TensorOperators.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/silu.h>
#include <torch/library.h>

#include "../common.h"

namespace paged_attn {
namespace {

bool is_elementwise_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
}

void check_rows(const at::Tensor& x, const char* op, const char* name) {
  TORCH_CHECK(x.dim() == 2, op, ": expected ", name, " of shape [num_rows, width], got ", x.sizes());
  TORCH_CHECK(is_elementwise_dtype(x.scalar_type()), op, ": expected ", name,
              " of dtype float32, bfloat16 or float16, got ", x.scalar_type());
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  check_rows(x, op, "x");
  TORCH_CHECK(weight.device() == x.device() && weight.dim() == 1 && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              op, ": expected a weight [", x.size(1), "] of x's dtype ", x.scalar_type(), " on ", x.device(),
              ", got shape ", weight.sizes(), ", dtype ", weight.scalar_type(), " on ", weight.device());
  TORCH_CHECK(x.size(1) > 0, op, ": expected rows of at least one element, got x of shape ", x.sizes());
}

at::Tensor normalized(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor x32 = x.to(at::kFloat);
  const at::Tensor y = x32 * at::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * y.to(x.scalar_type());
}

at::Tensor rms_norm_cuda(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args(x, weight, "rms_norm");
  return normalized(x, weight, eps);
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_cuda(const at::Tensor& x, const at::Tensor& residual,
                                                     const at::Tensor& weight, double eps) {
  check_norm_args(x, weight, "add_rms_norm");
  check_rows(residual, "add_rms_norm", "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
                  residual.device() == x.device(),
              "add_rms_norm: expected residual of x's shape ", x.sizes(), ", dtype ", x.scalar_type(), " and device ",
              x.device(), ", got ", residual.sizes(), ", ", residual.scalar_type(), " and ", residual.device());
  at::Tensor hidden = x + residual;
  return {hidden, normalized(hidden, weight, eps)};
}

at::Tensor silu_and_mul_cuda(const at::Tensor& gate_up) {  // [num_rows, 2 * width]
  check_rows(gate_up, "silu_and_mul", "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_and_mul: expected gate_up [num_rows, 2 * width], got an odd width ",
              gate_up.size(1));
  const int64_t n = gate_up.size(1) / 2;
  return at::silu(gate_up.narrow(1, 0, n)) * gate_up.narrow(1, n, n);
}

}  // namespace
}  // namespace paged_attn

TORCH_LIBRARY_IMPL(paged_attn, CUDA, m) {
  m.impl("rms_norm", &paged_attn::rms_norm_cuda);
  m.impl("add_rms_norm", &paged_attn::add_rms_norm_cuda);
  m.impl("silu_and_mul", &paged_attn::silu_and_mul_cuda);
}
