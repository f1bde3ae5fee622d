// CPU kernels of the engine's elementwise layer work: rms_norm, add_rms_norm and silu_and_mul. Each is one pass
// over a row where torch's eager code makes several (a norm: float(), pow, mean, add, rsqrt, mul, to(), mul), with
// the eager code's roundings, so that a model gives what it gives eager up to the order of one sum (and, in
// silu_and_mul, exp_nonpositive's error, within 4e-6 relative):
//   rms_norm:     y = T(x * r), r = 1 / sqrt(sum(x^2) / n + eps) over the row in float32; out = T(weight * y)
//   add_rms_norm: hidden = T(x + residual); out = rms_norm(hidden)
//   silu_and_mul: s = T(g / (1 + exp(-g))); out = T(s * u), for the row [g | u] of gate_up
// T() rounds to the tensors' dtype T (float32: nothing; bfloat16: to nearest even, as c10::BFloat16 does).
//
// AVX-512 (chosen at run time where the CPU has AVX512F/BW/VL/DQ and AVX512_BF16, unless PAGED_ATTN_NO_AVX512 is
// set) for float32 and bfloat16, 16 elements per vector, the row's tail masked; a portable loop elsewhere (and for
// float16). Rows are shared among the threads in tasks of at least kMinBytesPerCpuTask bytes, so a decode step's
// few rows stay on the calling thread (no OpenMP wake-up).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../common.h"
#include "avx512_math.h"

namespace paged_attn {
namespace {

// ---- AVX-512: 16 elements of a row as float32, the last `n` < 16 of a row masked ----

template <typename T>
PA_TARGET_AVX512 inline __m512 load16(const T* p, __mmask16 mask) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(mask, p);
  } else {
    return widen_bf16(_mm256_maskz_loadu_epi16(mask, p));
  }
}

template <typename T>
PA_TARGET_AVX512 inline void store16(T* p, __m512 x, __mmask16 mask) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_mask_storeu_ps(p, mask, x);
  } else {
    _mm256_mask_storeu_epi16(p, mask, round_to_bf16(x));
  }
}

// x rounded to T and back (the eager code's intermediate roundings).
template <typename T>
PA_TARGET_AVX512 inline __m512 round16(__m512 x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return widen_bf16(round_to_bf16(x));
  }
}

inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << remaining) - 1);
}

// One row of rms_norm / add_rms_norm (residual: nullptr for rms_norm; else hidden = T(x + residual) is written to
// `hidden` and normalized).
template <typename T>
PA_TARGET_AVX512 void norm_row_avx512(const T* x, const T* residual, const T* weight, float eps, int64_t n,
                                      T* hidden, T* out) {
  // Step 1: the row (after the residual add, rounded) and its sum of squares, in 16 lanes.
  __m512 sum_sq = _mm512_setzero_ps();
  const T* h = residual ? hidden : x;
  for (int64_t d = 0; d < n; d += 16) {
    const __mmask16 mask = tail_mask(n - d);
    __m512 v = load16(x + d, mask);
    if (residual) {
      v = round16<T>(_mm512_add_ps(v, load16(residual + d, mask)));
      store16(hidden + d, v, mask);
    }
    sum_sq = _mm512_fmadd_ps(v, v, sum_sq);
  }
  // Step 2: r = 1 / sqrt(mean + eps), as torch's rsqrt (a division by the rounded square root).
  const float r = 1.f / std::sqrt(_mm512_reduce_add_ps(sum_sq) / static_cast<float>(n) + eps);
  // Step 3: out = T(weight * T(h * r)).
  const __m512 rv = _mm512_set1_ps(r);
  for (int64_t d = 0; d < n; d += 16) {
    const __mmask16 mask = tail_mask(n - d);
    const __m512 y = round16<T>(_mm512_mul_ps(load16(h + d, mask), rv));
    store16(out + d, _mm512_mul_ps(load16(weight + d, mask), y), mask);
  }
}

// One row of silu_and_mul: g / (1 + exp(-g)) with e = exp(-|g|) <= 1: g / (1 + e) for g >= 0, g e / (e + 1) below
// (no overflow; -inf gives NaN and +inf gives inf, as torch's silu).
template <typename T>
PA_TARGET_AVX512 void silu_row_avx512(const T* gate, const T* up, int64_t n, T* out) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t d = 0; d < n; d += 16) {
    const __mmask16 mask = tail_mask(n - d);
    const __m512 g = load16(gate + d, mask);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 numerator = _mm512_mask_mul_ps(g, negative, g, e);
    const __m512 s = round16<T>(_mm512_div_ps(numerator, _mm512_add_ps(one, e)));
    store16(out + d, _mm512_mul_ps(s, load16(up + d, mask)), mask);
  }
}

// ---- Portable: the same steps, element by element ----

template <typename T>
void norm_row_portable(const T* x, const T* residual, const T* weight, float eps, int64_t n, T* hidden, T* out) {
  float sum_sq = 0.f;
  const T* h = residual ? hidden : x;
  for (int64_t d = 0; d < n; ++d) {
    float v = static_cast<float>(x[d]);
    if (residual) {
      hidden[d] = static_cast<T>(v + static_cast<float>(residual[d]));
      v = static_cast<float>(hidden[d]);
    }
    sum_sq += v * v;
  }
  const float r = 1.f / std::sqrt(sum_sq / static_cast<float>(n) + eps);
  for (int64_t d = 0; d < n; ++d) {
    const float y = static_cast<float>(static_cast<T>(static_cast<float>(h[d]) * r));
    out[d] = static_cast<T>(static_cast<float>(weight[d]) * y);
  }
}

template <typename T>
void silu_row_portable(const T* gate, const T* up, int64_t n, T* out) {
  for (int64_t d = 0; d < n; ++d) {
    const float g = static_cast<float>(gate[d]);
    const float s = static_cast<float>(static_cast<T>(g / (1.f + std::exp(-g))));
    out[d] = static_cast<T>(s * static_cast<float>(up[d]));
  }
}

// ---- Host side ----

// row(i) for every row, in tasks of at least kMinBytesPerCpuTask bytes (bytes_per_row each).
template <typename F>
void for_each_row(int64_t num_rows, int64_t bytes_per_row, const F& row) {
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerCpuTask / std::max<int64_t>(1, bytes_per_row));
  at::parallel_for(0, num_rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) row(i);
  });
}

bool is_elementwise_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
}

void check_rows(const at::Tensor& x, const char* op, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), op, " (CPU kernel): expected ", name, " on the CPU, got ", x.device());
  TORCH_CHECK(x.dim() == 2, op, ": expected ", name, " of shape [num_rows, width], got ", x.sizes());
  TORCH_CHECK(is_elementwise_dtype(x.scalar_type()), op, ": expected ", name,
              " of dtype float32, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK(x.size(1) == 0 || x.stride(1) == 1, op, ": ", name, "'s rows must be contiguous, got strides ",
              x.strides());
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  check_rows(x, op, "x");
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 1 && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type() && weight.is_contiguous(),
              op, ": expected a contiguous CPU weight [", x.size(1), "] of x's dtype ", x.scalar_type(),
              ", got shape ", weight.sizes(), ", dtype ", weight.scalar_type(), " on ", weight.device());
  TORCH_CHECK(x.size(1) > 0, op, ": expected rows of at least one element, got x of shape ", x.sizes());
}

// out (and hidden, with a residual) for every row of x.
template <typename T>
void norm_rows(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, float eps,
               at::Tensor* hidden, at::Tensor& out) {
  const int64_t n = x.size(1), rows = x.size(0);
  const T* xp = x.const_data_ptr<T>();
  const T* rp = residual ? residual->const_data_ptr<T>() : nullptr;
  T* hp = hidden ? hidden->mutable_data_ptr<T>() : nullptr;
  const T* wp = weight.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  const int64_t xs = x.stride(0), rs = residual ? residual->stride(0) : 0;
  const bool avx512 = !std::is_same_v<T, at::Half> && cpu_avx512_bf16();
  for_each_row(rows, n * int64_t{sizeof(T)} * (residual ? 4 : 2), [&](int64_t i) {
    const T* r = rp ? rp + i * rs : nullptr;
    T* h = hp ? hp + i * n : nullptr;
    if constexpr (!std::is_same_v<T, at::Half>) {
      if (avx512) return norm_row_avx512<T>(xp + i * xs, r, wp, eps, n, h, op + i * n);
    }
    norm_row_portable<T>(xp + i * xs, r, wp, eps, n, h, op + i * n);
  });
}

template <typename F>
void dispatch_elementwise(at::ScalarType dtype, const F& f) {
  if (dtype == at::kBFloat16) {
    f(at::BFloat16{});
  } else if (dtype == at::kHalf) {
    f(at::Half{});
  } else {
    f(float{});
  }
}

at::Tensor rms_norm_cpu(const at::Tensor& x,       // [num_rows, width], rows contiguous
                        const at::Tensor& weight,  // [width]
                        double eps) {
  check_norm_args(x, weight, "rms_norm");
  at::Tensor out = at::empty(x.sizes(), x.options());
  dispatch_elementwise(x.scalar_type(), [&](auto tag) {
    norm_rows<decltype(tag)>(x, nullptr, weight, static_cast<float>(eps), nullptr, out);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_cpu(const at::Tensor& x,         // [num_rows, width]
                                                    const at::Tensor& residual,  // [num_rows, width]
                                                    const at::Tensor& weight,    // [width]
                                                    double eps) {
  check_norm_args(x, weight, "add_rms_norm");
  check_rows(residual, "add_rms_norm", "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: expected residual of x's shape ", x.sizes(), " and dtype ", x.scalar_type(), ", got ",
              residual.sizes(), " and ", residual.scalar_type());
  at::Tensor hidden = at::empty(x.sizes(), x.options()), out = at::empty(x.sizes(), x.options());
  dispatch_elementwise(x.scalar_type(), [&](auto tag) {
    norm_rows<decltype(tag)>(x, &residual, weight, static_cast<float>(eps), &hidden, out);
  });
  return {hidden, out};
}

at::Tensor silu_and_mul_cpu(const at::Tensor& gate_up) {  // [num_rows, 2 * width]: [gate | up]
  check_rows(gate_up, "silu_and_mul", "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_and_mul: expected gate_up [num_rows, 2 * width], got an odd width ",
              gate_up.size(1));
  const int64_t n = gate_up.size(1) / 2, rows = gate_up.size(0);
  at::Tensor out = at::empty({rows, n}, gate_up.options());
  if (rows == 0 || n == 0) return out;
  dispatch_elementwise(gate_up.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* gp = gate_up.const_data_ptr<T>();
    T* op = out.mutable_data_ptr<T>();
    const int64_t gs = gate_up.stride(0);
    const bool avx512 = !std::is_same_v<T, at::Half> && cpu_avx512_bf16();
    for_each_row(rows, 3 * n * int64_t{sizeof(T)}, [&](int64_t i) {
      if constexpr (!std::is_same_v<T, at::Half>) {
        if (avx512) return silu_row_avx512<T>(gp + i * gs, gp + i * gs + n, n, op + i * n);
      }
      silu_row_portable<T>(gp + i * gs, gp + i * gs + n, n, op + i * n);
    });
  });
  return out;
}

}  // namespace
}  // namespace paged_attn

TORCH_LIBRARY_IMPL(paged_attn, CPU, m) {
  m.impl("rms_norm", &paged_attn::rms_norm_cpu);
  m.impl("add_rms_norm", &paged_attn::add_rms_norm_cpu);
  m.impl("silu_and_mul", &paged_attn::silu_and_mul_cpu);
}
