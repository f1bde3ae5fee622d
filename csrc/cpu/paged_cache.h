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
//
// The tiled layout (paged_attn/tiled_cache.py; bfloat16 or fp8, block_size a multiple of 16, head_dim of 32): per
// block and kv head, the tokens in tiles of kTiledTokens = 16; a tile's keys [head_dim / 2][16][2] (each 32-element
// row one pair of dims of the 16 tokens: what vdpbf16ps multiplies by a broadcast query pair) and its values
// [8][head_dim][2] (token pairs interleaved element by element: what vdpbf16ps multiplies by a broadcast pair of
// weights). Both are 16 * head_dim elements, so a tile of keys and one of values start at the same place in their
// blocks (PagedCache::tile); key_index / value_index give an element's place within its tile.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <type_traits>

namespace paged_attn {
namespace cpu {  // not the CUDA side's PagedCache (paged_cache.cuh), which a CUDA build links into the same library

// Every count is in units of T: the attention kernels use the element type (const), the cache ops the element type
// (reshape_and_cache into fp8 caches) or char (the byte copies: strides and head_dim in bytes).
constexpr int64_t kTiledTokens = 16;

template <typename T>
struct PagedCache {
  T* data = nullptr;  // [num_blocks, block_size, num_kv_heads, head_dim], or tiled (see above)
  // NOTE: strides and ids are 64-bit: num_blocks * block_stride can exceed 2^31.
  // Tiled: token_stride = head_dim, the stride of a tile's head_dim-wide slices (which the prefetcher walks).
  int64_t block_stride = 0, token_stride = 0, head_stride = 0;
  int64_t block_size = 0, num_kv_heads = 0, head_dim = 0;
  bool tiled = false;  // the tiled layout: rows are not contiguous, token() and the row functions do not apply

  T* block(int64_t block_id) const { return data + block_id * block_stride; }

  // Tiled: the first element of kv head 0's tile that holds the token at `offset` of block `block_id` (kv head h:
  // + h * head_stride); key_index / value_index: element d of the tile's token i, from there.
  T* tile(int64_t block_id, int64_t offset) const {
    return block(block_id) + offset / kTiledTokens * kTiledTokens * head_dim;
  }
  static int64_t key_index(int64_t i, int64_t d) { return d / 2 * 2 * kTiledTokens + i * 2 + d % 2; }
  int64_t value_index(int64_t i, int64_t d) const { return i / 2 * 2 * head_dim + d * 2 + i % 2; }

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
// strides and head_dim converted from elements to units of T (T the element type, or char for bytes); or a checked
// tiled one (check_tiled_cache_pair), in elements.
template <typename T>
PagedCache<T> paged_cache_of(const at::Tensor& t) {
  if (t.dim() == 6 || t.dim() == 5) {  // tiled (check_tiled_cache_pair): keys 6 dims, values 5; in elements
    TORCH_INTERNAL_ASSERT(static_cast<int64_t>(sizeof(T)) == t.element_size());
    PagedCache<T> cache;
    if constexpr (std::is_const_v<T>) {
      cache.data = static_cast<T*>(t.const_data_ptr());
    } else {
      cache.data = static_cast<T*>(t.data_ptr());
    }
    const bool keys = t.dim() == 6;
    cache.tiled = true;
    cache.block_stride = t.stride(0);
    cache.head_stride = t.stride(1);
    cache.num_kv_heads = t.size(1);
    cache.block_size = t.size(2) * (keys ? kTiledTokens : 2);
    cache.head_dim = keys ? 2 * t.size(3) : t.size(3);
    cache.token_stride = cache.head_dim;
    return cache;
  }
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
