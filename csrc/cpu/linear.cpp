// CPU kernels of pack_linear_weight and linear: y = x W^T for the engine's projections, on a weight packed once
// for the dot-product units. A decode step multiplies a few rows by every weight of the model, so its time is the
// time to stream the weights from memory: the packed layout makes that one sequential read per thread, with no
// reordering and no horizontal sums.
//
// Layout: W [out_features N, in_features K] as column blocks of 64 outputs; within a block, K in steps of kps input
// features (2 for bfloat16: a pair per 32-bit lane, vdpbf16ps's operand; 1 for float32), each step the 64 outputs'
// kps weights: packed [ceil(N / 64), ceil(K / kps), 64, kps], zero past N and K.
//
// Algorithm (AVX-512, chosen at run time; else a portable loop over the same layout): for a block of 64 outputs and
// MR <= 6 rows of x, 4 * MR accumulators of 16 floats; per step, the block's four vectors of weights are loaded once
// and multiplied with each row's broadcast input (vdpbf16ps: a pair of bfloat16 products per lane, exact, summed in
// float32; vfmadd231ps for float32). Sums are float32, rounded once to the output's dtype (to nearest even). A row's
// sums do not depend on the other rows of the call (batch invariant).
//
// Parallelism: at::parallel_for over the column blocks, in tasks of at least kMinBytesPerCpuTask bytes of weights
// (times the rows' share of the work: 6 rows cost about as long as streaming the weights once); within a task, rows
// in chunks of 96 that stay in the L2 cache while the task's blocks pass over them.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../common.h"

namespace paged_attn {

namespace {

constexpr int64_t kBlockOutputs = 64;  // outputs per column block: 4 vectors of 16 float sums
constexpr int kVecs = 4;
constexpr int kMaxRows = 6;  // rows of x per micro-kernel call: 6 x 4 accumulators, 4 weight vectors, 1 input
constexpr int64_t kRowChunk = 16 * kMaxRows;  // rows of x a task keeps in cache over its blocks (<= 96 KiB a 512 row)

template <typename scalar_t>
constexpr int64_t kStepInputs = std::is_same_v<scalar_t, at::BFloat16> ? 2 : 1;  // input features per step

#define PA_TARGET_LINEAR __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// Step 3 (portable path): a row's float sums, as the output's dtype, the first `valid` of them stored.
template <typename scalar_t>
void store_row(const float* sums, scalar_t* y, int64_t valid) {
  for (int64_t j = 0; j < valid; ++j) y[j] = static_cast<scalar_t>(sums[j]);
}

// Steps 1-3, AVX-512: the sums of rows x[0..MR) (row stride ldx) with one column block `w` ([steps, 64, kps]).
// Per step: the block's 4 weight vectors loaded once, each row's input broadcast and multiplied with all 4.
template <int MR, typename scalar_t>
PA_TARGET_LINEAR void rows_times_block_avx512(const scalar_t* x, int64_t ldx, int64_t in_features, const scalar_t* w,
                                              scalar_t* y, int64_t ldy, int64_t valid) {
  __m512 acc[MR][kVecs];
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    const auto* wp = reinterpret_cast<const uint16_t*>(w);
    const auto* xp = reinterpret_cast<const uint16_t*>(x);
    const int64_t pairs = in_features / 2;
    for (int64_t p = 0; p < pairs; ++p) {
      __m512bh wv[kVecs];
      for (int v = 0; v < kVecs; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(wp + (p * kVecs + v) * 32);
      for (int r = 0; r < MR; ++r) {
        int32_t pair;
        std::memcpy(&pair, xp + r * ldx + 2 * p, sizeof(pair));
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
        for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, wv[v]);
      }
    }
    if (in_features % 2 == 1) {  // the last input alone: its pair's second weight is the zero padding
      __m512bh wv[kVecs];
      for (int v = 0; v < kVecs; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(wp + (pairs * kVecs + v) * 32);
      for (int r = 0; r < MR; ++r) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(xp[r * ldx + in_features - 1]);
        for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, wv[v]);
      }
    }
  } else {
    for (int64_t k = 0; k < in_features; ++k) {
      __m512 wv[kVecs];
      for (int v = 0; v < kVecs; ++v) wv[v] = _mm512_loadu_ps(w + (k * kVecs + v) * 16);
      for (int r = 0; r < MR; ++r) {
        const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
        for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_fmadd_ps(a, wv[v], acc[r][v]);
      }
    }
  }
  // Step 3: the first `valid` sums of each row, rounded to the output's dtype (vcvtneps2bf16: to nearest even).
  for (int v = 0; v < kVecs; ++v) {
    const int64_t lanes = std::clamp<int64_t>(valid - 16 * v, 0, 16);
    const __mmask16 mask = static_cast<__mmask16>((uint32_t{1} << lanes) - 1);
    for (int r = 0; r < MR; ++r) {
      if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
        _mm256_mask_storeu_epi16(y + r * ldy + 16 * v, mask, (__m256i)_mm512_cvtneps_pbh(acc[r][v]));
      } else {
        _mm512_mask_storeu_ps(y + r * ldy + 16 * v, mask, acc[r][v]);
      }
    }
  }
}

// Steps 1-2, portable: the same sums, one input at a time (float32: in the AVX-512 path's order; bfloat16 adds a
// pair's two products one after the other), the compiler vectorizing the 64 outputs.
template <typename scalar_t>
void block_sums_portable(const scalar_t* x, int64_t ldx, int rows, int64_t in_features, const scalar_t* w,
                         float (*sums)[kBlockOutputs]) {
  constexpr int64_t kps = kStepInputs<scalar_t>;
  for (int r = 0; r < rows; ++r) {
    float acc[kBlockOutputs] = {};
    for (int64_t k = 0; k < in_features; ++k) {
      const float a = static_cast<float>(x[r * ldx + k]);
      const scalar_t* wk = w + (k / kps) * kBlockOutputs * kps + k % kps;
      for (int64_t j = 0; j < kBlockOutputs; ++j) acc[j] += a * static_cast<float>(wk[j * kps]);
    }
    std::copy(acc, acc + kBlockOutputs, sums[r]);
  }
}

template <typename scalar_t, int MR>
void rows_times_block(const scalar_t* x, int64_t ldx, int64_t in_features, const scalar_t* w, scalar_t* y,
                      int64_t ldy, int64_t valid, bool avx512) {
  if (avx512) return rows_times_block_avx512<MR>(x, ldx, in_features, w, y, ldy, valid);
  float sums[kMaxRows][kBlockOutputs];
  block_sums_portable(x, ldx, MR, in_features, w, sums);
  for (int r = 0; r < MR; ++r) store_row(sums[r], y + r * ldy, valid);
}

template <typename scalar_t>
void linear_blocks(const at::Tensor& x, const at::Tensor& packed, at::Tensor& y, int64_t out_features) {
  const int64_t rows = x.size(0), in_features = x.size(1), num_blocks = packed.size(0);
  const int64_t block_elems = packed.stride(0);  // [steps, 64, kps], contiguous (checked)
  const scalar_t* x_ptr = x.data_ptr<scalar_t>();
  const scalar_t* w_ptr = packed.data_ptr<scalar_t>();
  scalar_t* y_ptr = y.data_ptr<scalar_t>();
  const int64_t ldx = x.stride(0), ldy = y.stride(0);
  const bool avx512 = cpu_avx512_bf16();
  const int64_t block_bytes = block_elems * static_cast<int64_t>(sizeof(scalar_t));
  const int64_t work_per_block = block_bytes * std::max<int64_t>(1, (rows + kMaxRows - 1) / kMaxRows);
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerCpuTask / work_per_block);
  at::parallel_for(0, num_blocks, grain, [&](int64_t begin, int64_t end) {
    // Rows in chunks that stay in the L2 cache while the task's blocks pass over them.
    for (int64_t chunk = 0; chunk < rows; chunk += kRowChunk) {
      const int64_t chunk_end = std::min(rows, chunk + kRowChunk);
      for (int64_t b = begin; b < end; ++b) {
        const scalar_t* w = w_ptr + b * block_elems;
        const int64_t valid = std::min(kBlockOutputs, out_features - b * kBlockOutputs);
        scalar_t* yb = y_ptr + b * kBlockOutputs;
        int64_t r = chunk;
        for (; r + kMaxRows <= chunk_end; r += kMaxRows) {
          rows_times_block<scalar_t, kMaxRows>(x_ptr + r * ldx, ldx, in_features, w, yb + r * ldy, ldy, valid,
                                               avx512);
        }
        const scalar_t* xr = x_ptr + r * ldx;
        scalar_t* yr = yb + r * ldy;
        switch (chunk_end - r) {  // the chunk's last rows, fewer than kMaxRows
          case 0: break;
          case 1: rows_times_block<scalar_t, 1>(xr, ldx, in_features, w, yr, ldy, valid, avx512); break;
          case 2: rows_times_block<scalar_t, 2>(xr, ldx, in_features, w, yr, ldy, valid, avx512); break;
          case 3: rows_times_block<scalar_t, 3>(xr, ldx, in_features, w, yr, ldy, valid, avx512); break;
          case 4: rows_times_block<scalar_t, 4>(xr, ldx, in_features, w, yr, ldy, valid, avx512); break;
          default: rows_times_block<scalar_t, 5>(xr, ldx, in_features, w, yr, ldy, valid, avx512); break;
        }
      }
    }
  });
}

bool is_linear_dtype(at::ScalarType dtype) { return dtype == at::kFloat || dtype == at::kBFloat16; }

at::Tensor pack_linear_weight_cpu(const at::Tensor& weight) {  // [out_features, in_features]
  TORCH_CHECK(weight.dim() == 2, "pack_linear_weight: expected a 2-D weight [out_features, in_features], got shape ",
              weight.sizes());
  TORCH_CHECK(is_linear_dtype(weight.scalar_type()), "pack_linear_weight: expected a float32 or bfloat16 weight, got ",
              weight.scalar_type());
  TORCH_CHECK(weight.device().is_cpu(), "pack_linear_weight (CPU kernel): expected a CPU weight, got ",
              weight.device());
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t kps = weight.scalar_type() == at::kBFloat16 ? 2 : 1;
  const int64_t blocks = (n + kBlockOutputs - 1) / kBlockOutputs, steps = (k + kps - 1) / kps;
  at::Tensor padded = at::zeros({blocks * kBlockOutputs, steps * kps}, weight.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
  // [blocks, 64, steps, kps] -> [blocks, steps, 64, kps]
  return padded.view({blocks, kBlockOutputs, steps, kps}).permute({0, 2, 1, 3}).contiguous();
}

at::Tensor linear_cpu(const at::Tensor& x,       // [num_rows, in_features], rows contiguous
                      const at::Tensor& packed,  // [ceil(out_features / 64), ceil(in_features / kps), 64, kps]
                      int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "linear (CPU kernel): expected CPU tensors, got x on ",
              x.device(), " and packed_weight on ", packed.device());
  TORCH_CHECK(x.dim() == 2, "linear: expected x of shape [num_rows, in_features], got ", x.sizes());
  TORCH_CHECK(is_linear_dtype(x.scalar_type()) && packed.scalar_type() == x.scalar_type(),
              "linear: expected x and packed_weight both float32 or both bfloat16, got ", x.scalar_type(), " and ",
              packed.scalar_type());
  const int64_t kps = x.scalar_type() == at::kBFloat16 ? 2 : 1, in_features = x.size(1);
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kBlockOutputs && packed.size(3) == kps &&
                  packed.size(1) == (in_features + kps - 1) / kps && packed.is_contiguous(),
              "linear: packed_weight must be pack_linear_weight's output for ", in_features,
              " input features (contiguous [ceil(out_features / 64), ", (in_features + kps - 1) / kps, ", 64, ",
              kps, "]), got shape ", packed.sizes(), " and strides ", packed.strides());
  TORCH_CHECK(out_features > (packed.size(0) - 1) * kBlockOutputs && out_features <= packed.size(0) * kBlockOutputs,
              "linear: out_features ", out_features, " does not match packed_weight's ", packed.size(0),
              " blocks of 64 outputs");
  TORCH_CHECK(in_features == 0 || x.stride(1) == 1, "linear: x's rows must be contiguous, got strides ", x.strides());
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0 || out_features == 0) return y;
  if (x.scalar_type() == at::kBFloat16) {
    linear_blocks<at::BFloat16>(x, packed, y, out_features);
  } else {
    linear_blocks<float>(x, packed, y, out_features);
  }
  return y;
}

}  // namespace
}  // namespace paged_attn

TORCH_LIBRARY_IMPL(paged_attn, CPU, m) {
  m.impl("pack_linear_weight", &paged_attn::pack_linear_weight_cpu);
  m.impl("linear", &paged_attn::linear_cpu);
}
