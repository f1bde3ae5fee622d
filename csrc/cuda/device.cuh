// What the CUDA kernel headers (attention_kernels.cuh, cache_ops_kernels.cuh) take from the device: the CUDA
// toolkit's headers (half, bfloat16 and fp8 types and conversions), the two macros through which every
// shared-memory array is declared, and (not emulated) the conversion of a planned Grid to dim3.
//
// The kernel headers include no torch header, so they also compile on the host under the CPU emulator of the CUDA
// device API (tests/emulated/simt.h). The emulator's header is included first and defines PAGED_ATTN_EMULATED; it
// provides threadIdx, blockIdx, blockDim, gridDim, the intrinsics and the keywords (__global__, __device__, ...),
// and may define PA_SHARED / PA_EXTERN_SHARED its own way.
#pragma once

#ifndef PAGED_ATTN_EMULATED
#include <cuda_runtime.h>
#include <vector_types.h>
#endif
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "grid.h"  // Grid

namespace paged_attn {
inline dim3 to_dim3(const Grid& grid) {  // after grid_error(grid) == ""
  return dim3(static_cast<unsigned>(grid.x), static_cast<unsigned>(grid.y), static_cast<unsigned>(grid.z));
}
}  // namespace paged_attn

// A static shared-memory array: PA_SHARED(float, logits_s, [kGroup][kTile]); index it as an array.
#ifndef PA_SHARED
#define PA_SHARED(type, name, dims) __shared__ type name dims
#endif

// The dynamic shared-memory array of a launch (its size is the launch's dynamic shared-memory bytes):
// PA_EXTERN_SHARED(float, weights_s); index it as an array, never take its sizeof. (No kernel uses dynamic shared
// memory today: every plan has shared_bytes = 0.)
#ifndef PA_EXTERN_SHARED
#define PA_EXTERN_SHARED(type, name) extern __shared__ type name[]
#endif

// A fact about a value that the compiler may use (nvcc's __builtin_assume: e.g. a length known to be >= 0 needs no
// register for the high word of its 64-bit sign extension). Under the emulator it is checked instead.
#ifndef PAGED_ATTN_EMULATED
#define PA_ASSUME(cond) __builtin_assume(cond)
#else
#define PA_ASSUME(cond) ((cond) ? (void)0 : __builtin_trap())
#endif
