// The paged KV cache on the CPU, and all of its address arithmetic: the CPU attention kernels (attention.cpp,
// decode.cpp, prefill.cpp and their headers) and the CPU cache ops (cache_ops.cpp) reach cache memory through
// PagedCache. It mirrors
// csrc/cuda/paged_cache.cuh, with the same names (block, token, slot_row, row, block_row), so that one reading of
// the layout serves both backends.
//
// Token t of a sequence lives in block block_table[t / block_size] at offset t % block_size; its slot is
// block * block_size + offset; its row of kv head g starts g * head_stride units after the token's first row.
// Strides are each cache's own (vLLM's packed cache has head_stride = 2 * head_dim, this project's contiguous one
// head_dim; head-major caches have token_stride < head_stride). Cache layout: see paged_attn/ops.py.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <type_traits>

namespace paged_attn {
namespace cpu {  // not the CUDA side's PagedCache (paged_cache.cuh), which a CUDA build links into the same library

// Every count is in units of T: the attention kernels use the element type (const), the cache ops the element type
// (reshape_and_cache into fp8 caches) or char (the byte copies: strides and head_dim in bytes).
template <typename T>
struct PagedCache {
  T* data = nullptr;  // [num_blocks, block_size, num_kv_heads, head_dim]
  // NOTE: strides and ids are 64-bit: num_blocks * block_stride can exceed 2^31.
  int64_t block_stride = 0, token_stride = 0, head_stride = 0;
  int64_t block_size = 0, num_kv_heads = 0, head_dim = 0;

  T* block(int64_t block_id) const { return data + block_id * block_stride; }

  // The row [head_dim] of kv head 0 of the token at `offset` in block `block_id` (kv head h: + h * head_stride).
  T* token(int64_t block_id, int64_t offset) const { return block(block_id) + offset * token_stride; }

  // The row [head_dim] of kv head `kv_head` of a slot (block_id * block_size + offset, >= 0).
  T* slot_row(int64_t slot_id, int64_t kv_head) const {
    return token(slot_id / block_size, slot_id % block_size) + kv_head * head_stride;
  }

  // Token t's row [head_dim] of kv head `kv_head`, in the sequence whose block-table row is `block_table`.
  T* row(const int32_t* block_table, int64_t t, int64_t kv_head) const {
    return token(block_table[t / block_size], t % block_size) + kv_head * head_stride;
  }

  // The (token, kv head) row `r` of a block, rows numbered token-major (r = offset * num_kv_heads + kv_head).
  T* block_row(int64_t block_id, int64_t r) const {
    return token(block_id, r / num_kv_heads) + (r % num_kv_heads) * head_stride;
  }
};

// A checked cache tensor ([num_blocks, block_size, num_kv_heads, head_dim], check_cache) as a PagedCache<T>, the
// strides and head_dim converted from elements to units of T (T the element type, or char for bytes).
template <typename T>
PagedCache<T> paged_cache_of(const at::Tensor& t) {
  const int64_t elem = t.element_size();
  const auto to_units = [elem](int64_t elements) { return elements * elem / static_cast<int64_t>(sizeof(T)); };
  PagedCache<T> cache;
  if constexpr (std::is_const_v<T>) {
    cache.data = static_cast<T*>(t.const_data_ptr());
  } else {
    cache.data = static_cast<T*>(t.data_ptr());
  }
  cache.block_stride = to_units(t.stride(0));
  cache.token_stride = to_units(t.stride(1));
  cache.head_stride = to_units(t.stride(2));
  cache.block_size = t.size(1);
  cache.num_kv_heads = t.size(2);
  cache.head_dim = to_units(t.size(3));
  return cache;
}

// The two caches attention reads, each with its own strides.
template <typename T>
struct PagedKV {
  PagedCache<const T> key, value;
};

}  // namespace cpu
}  // namespace paged_attn
