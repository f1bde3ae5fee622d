// The paged KV cache on CUDA, and all of its address arithmetic: every CUDA kernel (attention and the cache ops)
// reaches cache memory through PagedCache. (The CPU kernels compute addresses their own way, in csrc/cpu.)
//
// Layout: [num_blocks, block_size, num_kv_heads, head_dim], the last three dimensions contiguous, the block
// dimension with any stride. Token t of a sequence lives in block block_table[t / block_size] at offset
// t % block_size; its slot is block * block_size + offset. A token's rows of all kv heads are contiguous
// ([num_kv_heads, head_dim]); kv head h's row starts h * head_dim elements in.
#pragma once

#include "device.cuh"

namespace paged_attn {

// Every count is in units of T: the attention kernel uses the element type, the cache ops the integer Unit they
// copy with (head_dim is then in Units), copy_blocks bytes (T = char).
template <typename T>
struct PagedCache {
  T* data;               // [num_blocks, block_size, num_kv_heads, head_dim]
  int64_t block_stride;  // between blocks, >= block_size * num_kv_heads * head_dim
  int block_size, num_kv_heads, head_dim;

  // NOTE: block offsets are 64-bit: num_blocks * block_stride can exceed 2^31.
  __host__ __device__ __forceinline__ T* block(int64_t block_id) const { return data + block_id * block_stride; }

  // The rows [num_kv_heads, head_dim] of the token at `offset` in block `block_id`.
  __host__ __device__ __forceinline__ T* token(int64_t block_id, int64_t offset) const {
    return block(block_id) + offset * num_kv_heads * head_dim;
  }

  // The rows [num_kv_heads, head_dim] of a slot (block_id * block_size + offset, >= 0).
  __host__ __device__ __forceinline__ T* slot(int64_t slot_id) const {
    return token(slot_id / block_size, slot_id % block_size);
  }

  // Token t's row [head_dim] of kv head `kv_head`, in the sequence whose block-table row is `block_table`.
  __host__ __device__ __forceinline__ T* row(const int32_t* block_table, int t, int kv_head) const {
    return token(block_table[t / block_size], t % block_size) + static_cast<int64_t>(kv_head) * head_dim;
  }
};

}  // namespace paged_attn
