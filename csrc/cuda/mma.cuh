// Warp-level tensor-core operations of sm_80+, as inline PTX: ldmatrix, movmatrix and mma.sync m16n8k16 with
// float16/bfloat16 inputs and float32 accumulators. Unlike nvcuda::wmma, their fragments' element layouts are
// documented (PTX ISA, "Warp-level matrix fragment mma.m16n8k16" and "ldmatrix"), so kernels may compute on the
// fragments' elements directly. With g = lane / 4 and t = lane % 4 (a "quad" is the 4 lanes of one g):
//
//   A  (16 x 16, row):  a[0] = (row g,     cols 2t, 2t+1)   a[1] = (row g + 8, cols 2t, 2t+1)
//                       a[2] = (row g,     cols 2t+8, +9)   a[3] = (row g + 8, cols 2t+8, +9)
//   B  (16 x 8, col):   b[0] = (rows 2t, 2t+1, col g)       b[1] = (rows 2t+8, 2t+9, col g)
//   C, D (16 x 8):      c[0], c[1] = (row g, cols 2t, 2t+1) c[2], c[3] = (row g + 8, cols 2t, 2t+1)
//   (each 32-bit register holds two 16-bit elements, the lower column or row in the low half)
//
//   ldmatrix_x4(r, row):        four 8 x 8 matrices of 16-bit elements, each row 16 contiguous bytes in shared
//                               memory: lane l passes the address of row l % 8 of matrix l / 8; r[i] = matrix i's
//                               (row g, cols 2t, 2t+1).   ldmatrix_x4_trans: r[i] = matrix i's (rows 2t, 2t+1, col g).
//   movmatrix_trans(x):         one 8 x 8 matrix held as (row g, cols 2t, 2t+1) in every lane -> its transpose, held
//                               the same way.
//   mma_m16n8k16<T>(d, a, b, c): d = a * b + c.
//
// All are collectives of the whole warp (every lane calls them at the same place, converged). Under the CPU
// emulator (tests/emulated/simt.h, PAGED_ATTN_EMULATED) they are the emulator's collectives with the same layouts.
#pragma once

#include <cstdint>
#include <type_traits>

#include "device.cuh"

namespace paged_attn {

// Two floats as one register of two 16-bit elements of T (x in the low half), rounded to nearest even.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float x, float y);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float x, float y) {
  const __half2 h = __floats2half2_rn(x, y);
  return *reinterpret_cast<const uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float x, float y) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<const uint32_t*>(&h);
}

#ifdef PAGED_ATTN_EMULATED

template <typename T>
inline void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const float (&c)[4],
                         simt::Site site = simt::Site::here()) {
  simt::mma_m16n8k16<T>(d, a, b, c, site);
}
inline void ldmatrix_x4(uint32_t (&r)[4], const void* row, simt::Site site = simt::Site::here()) {
  simt::ldmatrix_x4(r, row, false, site);
}
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row, simt::Site site = simt::Site::here()) {
  simt::ldmatrix_x4(r, row, true, site);
}
inline uint32_t movmatrix_trans(uint32_t x, simt::Site site = simt::Site::here()) {
  return simt::movmatrix_trans(x, site);
}

#else

template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                             const float (&c)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
  }
#else
  __trap();  // the launchers take these kernels only on compute capability 8.0+
#endif
}

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row)));
#else
  __trap();
#endif
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row)));
#else
  __trap();
#endif
}

__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
#else
  __trap();
#endif
  return y;
}

#endif  // PAGED_ATTN_EMULATED

}  // namespace paged_attn
