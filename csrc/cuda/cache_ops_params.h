// The cache ops' kernel parameters (no torch, no device code: the torch-facing launchers, csrc/cuda/cache_ops.cpp,
// compile them as plain C++; the kernels, cache_ops_kernels.cuh, and the emulator read them too).
#pragma once

#include <cstdint>

#include "copy_plan.h"
#include "device.cuh"
#include "paged_cache.cuh"

namespace paged_attn {

// Calls f(Unit{}) with the integer type of `width` bytes (uint4 for 16, uint2 for 8); false for other widths.
template <typename F>
bool dispatch_unit(int64_t width, F&& f) {
  switch (width) {
    case 16: f(uint4{}); return true;
    case 8: f(uint2{}); return true;
    case 4: f(uint32_t{}); return true;
    case 2: f(uint16_t{}); return true;
    case 1: f(uint8_t{}); return true;
    default: return false;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// reshape_and_cache. Every count is in Units.
template <typename Unit>
struct ReshapeAndCacheParams {
  const Unit* key;    // [num_tokens, num_kv_heads, head_dim], last dim contiguous:
  const Unit* value;  // [num_tokens, num_kv_heads, head_dim]   (t, h, u) at t * token_stride + h * head_stride + u
  int64_t key_token_stride, key_head_stride, value_token_stride, value_head_stride;
  PagedCache<Unit> key_cache;    // [num_blocks, block_size, num_kv_heads, head_dim]
  PagedCache<Unit> value_cache;  // [num_blocks, block_size, num_kv_heads, head_dim]
  const int64_t* slot_mapping;   // [num_tokens]; slot < 0: a padding token, not written
};

// reshape_and_cache into fp8 caches: each element stored as the fp8 value nearest to x / scale (the quotient an
// IEEE float division, then round to nearest even), saturated to the largest finite value; NaN stays NaN
// (__nv_cvt_float_to_fp8 with __NV_SATFINITE). Counts and strides in elements.
template <typename T>  // float, __half or __nv_bfloat16
struct ReshapeAndCacheFp8Params {
  const T* key;    // [num_tokens, num_kv_heads, head_dim], last dim contiguous
  const T* value;  // [num_tokens, num_kv_heads, head_dim]
  int64_t key_token_stride, key_head_stride, value_token_stride, value_head_stride;
  PagedCache<__nv_fp8_storage_t> key_cache;    // [num_blocks, block_size, num_kv_heads, head_dim]
  PagedCache<__nv_fp8_storage_t> value_cache;  // [num_blocks, block_size, num_kv_heads, head_dim]
  const int64_t* slot_mapping;                 // [num_tokens]; slot < 0: a padding token, not written
  const float* k_scale;                        // [1], or nullptr: 1.0
  const float* v_scale;                        // [1], or nullptr: 1.0
  __nv_fp8_interpretation_t format;            // __NV_E4M3 or __NV_E5M2
};

// ---------------------------------------------------------------------------------------------------------------
// copy_blocks: the caches of up to kMaxLayersPerLaunch layers, passed by value as the kernel parameter (about 12 KiB:
// CUDA 12.1+ takes up to 32 KiB of parameters). Every layer has the same block shape (check_copy_blocks_args);
// each cache its own strides. Counts are in bytes (PagedCache<char>: head_dim is the row's bytes).
struct CopyBlocksParams {
  PagedCache<char> key[kMaxLayersPerLaunch];    // layer l: [num_blocks, block_size, num_kv_heads, head_dim]
  PagedCache<char> value[kMaxLayersPerLaunch];  // layer l: [num_blocks, block_size, num_kv_heads, head_dim]
  const int64_t* block_mapping;                 // [num_pairs, 2] of (src_block, dst_block)
};

}  // namespace paged_attn
