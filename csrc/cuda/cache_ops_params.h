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
// concat_and_cache_mla: row slot_mapping[t] of the latent cache is kv_c[t] then k_pe[t]. Every count in Units.
template <typename Unit>
struct ConcatAndCacheMlaParams {
  const Unit* kv_c;              // [num_tokens, kv_lora_rank], last dim contiguous: token t at t * kv_c_stride
  const Unit* k_pe;              // [num_tokens, rope_dim], last dim contiguous: token t at t * k_pe_stride
  int64_t kv_c_stride, k_pe_stride;
  int rank_units, rope_units;    // kv_lora_rank and rope_dim
  PagedCache<Unit> cache;        // [num_blocks, block_size, 1, kv_lora_rank + rope_dim]
  const int64_t* slot_mapping;   // [num_tokens]; slot < 0: a padding token, not written
};

// concat_and_cache_mla into an fp8 cache: each element quantized as reshape_and_cache_fp8 does, with `scale`.
// Counts and strides in elements.
template <typename T>  // float, __half or __nv_bfloat16
struct ConcatAndCacheMlaFp8Params {
  const T* kv_c;  // [num_tokens, kv_lora_rank], last dim contiguous
  const T* k_pe;  // [num_tokens, rope_dim], last dim contiguous
  int64_t kv_c_stride, k_pe_stride;
  int rank, rope_dim;
  PagedCache<__nv_fp8_storage_t> cache;  // [num_blocks, block_size, 1, kv_lora_rank + rope_dim]
  const int64_t* slot_mapping;           // [num_tokens]; slot < 0: a padding token, not written
  const float* scale;                    // [1], or nullptr: 1.0
  __nv_fp8_interpretation_t format;      // __NV_E4M3 or __NV_E5M2
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
