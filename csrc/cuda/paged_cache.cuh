// The paged KV cache on CUDA, and all of its address arithmetic: every CUDA kernel (attention and the cache ops)
// reaches cache memory through PagedCache. (The CPU kernels have the same helper, in csrc/cpu/paged_cache.h.)
//
// It needs the block, token and head strides (head_dim contiguous) and slot = block * block_size + offset; cache
// layout: see paged_attn/ops.py. (paged_cache_host.h builds one from a tensor.)
#pragma once

#include "device.cuh"

namespace paged_attn {

// Every count is in units of T: the attention kernels use the element type, the cache ops the integer Unit they
// copy with (head_dim and the strides are then in Units), copy_blocks bytes (T = char).
template <typename T>
struct PagedCache {
  T* data;  // [num_blocks, block_size, num_kv_heads, head_dim]
  // NOTE: strides are 64-bit: num_blocks * block_stride can exceed 2^31.
  int64_t block_stride, token_stride, head_stride;
  int block_size, num_kv_heads, head_dim;

  __host__ __device__ __forceinline__ T* block(int64_t block_id) const { return data + block_id * block_stride; }

  // The row [head_dim] of kv head 0 of the token at `offset` in block `block_id` (kv head h: + h * head_stride).
  __host__ __device__ __forceinline__ T* token(int64_t block_id, int64_t offset) const {
    return block(block_id) + offset * token_stride;
  }

  // The row [head_dim] of kv head `kv_head` of a slot (block_id * block_size + offset, >= 0).
  __host__ __device__ __forceinline__ T* slot_row(int64_t slot_id, int kv_head) const {
    return token(slot_id / block_size, slot_id % block_size) + kv_head * head_stride;
  }

  // Token t's row [head_dim] of kv head `kv_head`, in the sequence whose block-table row is `block_table`.
  __host__ __device__ __forceinline__ T* row(const int32_t* block_table, int t, int kv_head) const {
    return token(block_table[t / block_size], t % block_size) + kv_head * head_stride;
  }
  // The same row as an offset from `data`, in units of T (a kernel computes it once and keeps it in shared memory).
  __host__ __device__ __forceinline__ int64_t row_offset(const int32_t* block_table, int t, int kv_head) const {
    return row(block_table, t, kv_head) - data;
  }

  // The (token, kv head) row `r` of a block, rows numbered token-major (r = offset * num_kv_heads + kv_head).
  __host__ __device__ __forceinline__ T* block_row(int64_t block_id, int r) const {
    return token(block_id, r / num_kv_heads) + (r % num_kv_heads) * head_stride;
  }

  // Whether a block is one contiguous run of block_size * num_kv_heads * head_dim elements.
  __host__ __device__ __forceinline__ bool packed_rows() const {
    return head_stride == head_dim && token_stride == static_cast<int64_t>(num_kv_heads) * head_dim;
  }
};

}  // namespace paged_attn
