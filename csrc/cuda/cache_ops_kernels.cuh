// The cache ops' CUDA kernels (no torch; their parameters: cache_ops_params.h; launched by
// csrc/cuda/instantiations/cache_ops.cu for csrc/cuda/cache_ops.cpp, and swap_blocks needs no kernel).
//
// These ops only move data, so the kernels are dtype-agnostic: they copy `Unit`s, the widest access (16, 8, 4, 2 or
// 1 bytes) that divides every address, stride and row length involved (access_width in launch_plan.h). With the
// usual head dims that is a 16-byte vector access per thread. Cache addresses come from PagedCache, so caches with
// any strides but the last (packed K|V halves, transposed token and head dimensions) are read and written row by
// row.
//
//   reshape_and_cache  grid (num_tokens): one thread block writes one token's [num_kv_heads, head_dim] rows. Into
//                      an fp8 cache (reshape_and_cache_fp8_kernel) each element is quantized, so it is not
//                      dtype-agnostic: one thread per element.
//   concat_and_cache_mla  grid (num_tokens): one thread block writes one token's latent row, kv_c then k_pe (fp8:
//                      concat_and_cache_mla_fp8_kernel, quantizing each element as reshape_and_cache_fp8_kernel).
//   copy_blocks        grid (num_pairs, num_layers, 2): one thread block copies one block of one layer's key
//                      (z = 0) or value (z = 1) cache. All layers (up to kMaxLayersPerLaunch) and pairs in one
//                      launch: the layers' base pointers travel as a kernel parameter (no pointer table to upload,
//                      CUDA-graph friendly).
#pragma once

#include <cstdint>

#include "cache_ops_params.h"
#include "device.cuh"
#include "paged_cache.cuh"

namespace paged_attn {

// ---------------------------------------------------------------------------------------------------------------
// reshape_and_cache. Every count is in Units.

template <typename Unit>
__global__ void reshape_and_cache_kernel(const ReshapeAndCacheParams<Unit> p) {
  const int64_t token = blockIdx.x;
  const int64_t slot = p.slot_mapping[token];
  if (slot < 0) return;  // NOTE: padding token, nothing to write
  const Unit* key_src = p.key + token * p.key_token_stride;
  const Unit* value_src = p.value + token * p.value_token_stride;
  const int head_units = p.key_cache.head_dim;
  for (int i = threadIdx.x; i < p.key_cache.num_kv_heads * head_units; i += blockDim.x) {
    const int head = i / head_units, u = i % head_units;
    p.key_cache.slot_row(slot, head)[u] = key_src[head * p.key_head_stride + u];
    p.value_cache.slot_row(slot, head)[u] = value_src[head * p.value_head_stride + u];
  }
}

// ---------------------------------------------------------------------------------------------------------------
// reshape_and_cache into fp8 caches: one thread per element, quantizing (ReshapeAndCacheFp8Params).
__device__ __forceinline__ float as_float(float x) { return x; }
__device__ __forceinline__ float as_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float as_float(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ __nv_fp8_storage_t quantize_fp8(float x, float scale, __nv_fp8_interpretation_t format) {
  return __nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, format);
}

template <typename T>
__global__ void reshape_and_cache_fp8_kernel(const ReshapeAndCacheFp8Params<T> p) {
  const int64_t token = blockIdx.x;
  const int64_t slot = p.slot_mapping[token];
  if (slot < 0) return;  // NOTE: padding token, nothing to write
  const float k_scale = p.k_scale != nullptr ? *p.k_scale : 1.0f;
  const float v_scale = p.v_scale != nullptr ? *p.v_scale : 1.0f;
  const T* key_src = p.key + token * p.key_token_stride;
  const T* value_src = p.value + token * p.value_token_stride;
  const int head_dim = p.key_cache.head_dim;
  for (int i = threadIdx.x; i < p.key_cache.num_kv_heads * head_dim; i += blockDim.x) {
    const int head = i / head_dim, d = i % head_dim;
    p.key_cache.slot_row(slot, head)[d] =
        quantize_fp8(as_float(key_src[head * p.key_head_stride + d]), k_scale, p.format);
    p.value_cache.slot_row(slot, head)[d] =
        quantize_fp8(as_float(value_src[head * p.value_head_stride + d]), v_scale, p.format);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// concat_and_cache_mla (ConcatAndCacheMlaParams: counts in Units; the fp8 kernel: in elements).
template <typename Unit>
__global__ void concat_and_cache_mla_kernel(const ConcatAndCacheMlaParams<Unit> p) {
  const int64_t token = blockIdx.x;
  const int64_t slot = p.slot_mapping[token];
  if (slot < 0) return;  // NOTE: padding token, nothing to write
  const Unit* kv_c = p.kv_c + token * p.kv_c_stride;
  const Unit* k_pe = p.k_pe + token * p.k_pe_stride;
  Unit* row = p.cache.slot_row(slot, 0);
  for (int u = threadIdx.x; u < p.rank_units + p.rope_units; u += blockDim.x) {
    row[u] = u < p.rank_units ? kv_c[u] : k_pe[u - p.rank_units];
  }
}

template <typename T>
__global__ void concat_and_cache_mla_fp8_kernel(const ConcatAndCacheMlaFp8Params<T> p) {
  const int64_t token = blockIdx.x;
  const int64_t slot = p.slot_mapping[token];
  if (slot < 0) return;  // NOTE: padding token, nothing to write
  const float scale = p.scale != nullptr ? *p.scale : 1.0f;
  const T* kv_c = p.kv_c + token * p.kv_c_stride;
  const T* k_pe = p.k_pe + token * p.k_pe_stride;
  __nv_fp8_storage_t* row = p.cache.slot_row(slot, 0);
  for (int d = threadIdx.x; d < p.rank + p.rope_dim; d += blockDim.x) {
    row[d] = quantize_fp8(as_float(d < p.rank ? kv_c[d] : k_pe[d - p.rank]), scale, p.format);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// copy_blocks (CopyBlocksParams). One block of one cache: only the view's (token, kv head) rows, each head_dim bytes (a strided view's block spans
// other memory between its rows, e.g. the V rows of a packed K|V cache, which must stay untouched); a block of
// packed rows is one run of bytes.
template <typename Unit>
__global__ void copy_blocks_kernel(const CopyBlocksParams p) {
  const int64_t pair = blockIdx.x;
  const PagedCache<char> cache = blockIdx.z == 0 ? p.key[blockIdx.y] : p.value[blockIdx.y];
  const int64_t src = p.block_mapping[2 * pair], dst = p.block_mapping[2 * pair + 1];
  const int row_units = cache.head_dim / static_cast<int>(sizeof(Unit));
  const int rows = cache.block_size * cache.num_kv_heads;
  if (cache.packed_rows()) {  // uniform across the launch's thread block
    const Unit* from = reinterpret_cast<const Unit*>(cache.block(src));
    Unit* to = reinterpret_cast<Unit*>(cache.block(dst));
    for (int64_t i = threadIdx.x; i < static_cast<int64_t>(rows) * row_units; i += blockDim.x) to[i] = from[i];
    return;
  }
  for (int64_t i = threadIdx.x; i < static_cast<int64_t>(rows) * row_units; i += blockDim.x) {
    const int r = static_cast<int>(i / row_units), u = static_cast<int>(i % row_units);
    reinterpret_cast<Unit*>(cache.block_row(dst, r))[u] = reinterpret_cast<const Unit*>(cache.block_row(src, r))[u];
  }
}

}  // namespace paged_attn
