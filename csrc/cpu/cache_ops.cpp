// CPU kernels of the cache ops. They only move bytes, so they are dtype-agnostic: a row of head_dim elements
// (or a whole block, when its rows are packed) is one memcpy. Every index is range-checked before anything is written, so a bad slot or
// block id raises an error and leaves the caches untouched.
//
// Parallelism: at::parallel_for over tokens (reshape_and_cache) or over (layer, pair, key|value) copies
// (copy_blocks) or pairs (swap_blocks).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "../common.h"

namespace paged_attn {
namespace {

// Split parallel work into chunks that move at least this many bytes, so thread start-up stays negligible.
constexpr int64_t kMinBytesPerTask = 64 * 1024;

int64_t grain_for(int64_t bytes_per_item) {
  return std::max<int64_t>(1, kMinBytesPerTask / std::max<int64_t>(1, bytes_per_item));
}

void reshape_and_cache_cpu(const at::Tensor& key,          // [num_tokens, num_kv_heads, head_dim]
                           const at::Tensor& value,        // [num_tokens, num_kv_heads, head_dim]
                           at::Tensor& key_cache,          // [num_blocks, block_size, num_kv_heads, head_dim]
                           at::Tensor& value_cache,        // [num_blocks, block_size, num_kv_heads, head_dim]
                           const at::Tensor& slot_mapping) {  // [num_tokens], int64, < 0 = padding
  check_reshape_and_cache_args(key, value, key_cache, value_cache, slot_mapping);
  const int64_t num_tokens = key.size(0), block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2), head_dim = key_cache.size(3);
  check_slot_range(slot_mapping, key_cache.size(0) * block_size);
  if (num_tokens == 0 || num_kv_heads * head_dim == 0) return;

  // All strides in bytes. NOTE: block offsets are computed in 64 bits: num_blocks * block_stride can exceed 2^31.
  const int64_t elem = key.element_size(), row_bytes = head_dim * elem;
  const int64_t key_token_stride = key.stride(0) * elem, key_head_stride = key.stride(1) * elem;
  const int64_t value_token_stride = value.stride(0) * elem, value_head_stride = value.stride(1) * elem;
  const int64_t key_block_stride = key_cache.stride(0) * elem, value_block_stride = value_cache.stride(0) * elem;
  const int64_t key_slot_stride = key_cache.stride(1) * elem, value_slot_stride = value_cache.stride(1) * elem;
  const int64_t key_cache_head_stride = key_cache.stride(2) * elem;
  const int64_t value_cache_head_stride = value_cache.stride(2) * elem;
  const auto* key_ptr = static_cast<const char*>(key.data_ptr());
  const auto* value_ptr = static_cast<const char*>(value.data_ptr());
  auto* key_cache_ptr = static_cast<char*>(key_cache.data_ptr());
  auto* value_cache_ptr = static_cast<char*>(value_cache.data_ptr());
  const auto slots = slot_mapping.contiguous();
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();

  at::parallel_for(0, num_tokens, grain_for(2 * num_kv_heads * row_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t token = begin; token < end; ++token) {
      const int64_t slot = slot_ptr[token];
      if (slot < 0) continue;  // padding token
      const int64_t block = slot / block_size, offset = slot % block_size;
      char* key_dst = key_cache_ptr + block * key_block_stride + offset * key_slot_stride;
      char* value_dst = value_cache_ptr + block * value_block_stride + offset * value_slot_stride;
      for (int64_t head = 0; head < num_kv_heads; ++head) {
        std::memcpy(key_dst + head * key_cache_head_stride,
                    key_ptr + token * key_token_stride + head * key_head_stride, row_bytes);
        std::memcpy(value_dst + head * value_cache_head_stride,
                    value_ptr + token * value_token_stride + head * value_head_stride, row_bytes);
      }
    }
  });
}

void copy_blocks_cpu(at::TensorList key_caches,     // num_layers x [num_blocks, block_size, num_kv_heads, head_dim]
                     at::TensorList value_caches,   // num_layers x [num_blocks, block_size, num_kv_heads, head_dim]
                     const at::Tensor& block_mapping) {  // [num_pairs, 2] of (src_block, dst_block), int64
  check_copy_blocks_args(key_caches, value_caches, block_mapping);
  const int64_t num_layers = static_cast<int64_t>(key_caches.size());
  if (num_layers == 0 || block_mapping.size(0) == 0) return;
  const at::Tensor& first = key_caches[0];
  check_block_mapping_range(block_mapping, first.size(0), first.size(0), /*same_cache=*/true);

  const int64_t num_pairs = block_mapping.size(0), elem = first.element_size();
  const int64_t block_size = first.size(1), num_kv_heads = first.size(2), row_bytes = first.size(3) * elem;
  const int64_t block_bytes = block_size * num_kv_heads * row_bytes;
  const auto mapping = block_mapping.contiguous();
  const int64_t* pairs = mapping.data_ptr<int64_t>();

  // One task per (layer, pair, key|value). A block whose rows are packed is one memcpy, else one per row (e.g. the
  // K half of a packed K|V cache: the V rows between them are not this cache's to copy).
  at::parallel_for(0, num_layers * num_pairs * 2, grain_for(block_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t layer = task / (num_pairs * 2), pair = (task / 2) % num_pairs;
      const at::Tensor& cache = (task % 2 == 0) ? key_caches[layer] : value_caches[layer];
      auto* base = static_cast<char*>(cache.data_ptr());
      char* dst = base + pairs[2 * pair + 1] * cache.stride(0) * elem;
      const char* src = base + pairs[2 * pair] * cache.stride(0) * elem;
      if (has_packed_rows(cache)) {
        std::memcpy(dst, src, block_bytes);
        continue;
      }
      const int64_t slot_stride = cache.stride(1) * elem, head_stride = cache.stride(2) * elem;
      for (int64_t offset = 0; offset < block_size; ++offset) {
        for (int64_t head = 0; head < num_kv_heads; ++head) {
          const int64_t at = offset * slot_stride + head * head_stride;
          std::memcpy(dst + at, src + at, row_bytes);
        }
      }
    }
  });
}

void swap_blocks_cpu(const at::Tensor& src,             // [num_src_blocks, ...block shape]
                     at::Tensor& dst,                   // [num_dst_blocks, ...block shape]
                     const at::Tensor& block_mapping) {  // [num_pairs, 2] of (src_block, dst_block), int64, CPU
  check_swap_blocks_args(src, dst, block_mapping);
  check_block_mapping_range(block_mapping, src.size(0), dst.size(0), /*same_cache=*/same_memory(src, dst));
  const int64_t num_pairs = block_mapping.size(0), elem = src.element_size();
  if (num_pairs == 0) return;
  const int64_t block_bytes = block_span_bytes(src);  // a strided block: its whole span (check_swap_blocks_args)
  const int64_t src_block_stride = src.stride(0) * elem, dst_block_stride = dst.stride(0) * elem;
  const auto* src_ptr = static_cast<const char*>(src.data_ptr());
  auto* dst_ptr = static_cast<char*>(dst.data_ptr());
  const auto mapping = block_mapping.contiguous();
  const int64_t* pairs = mapping.data_ptr<int64_t>();

  at::parallel_for(0, num_pairs, grain_for(block_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      std::memcpy(dst_ptr + pairs[2 * pair + 1] * dst_block_stride, src_ptr + pairs[2 * pair] * src_block_stride,
                  block_bytes);
    }
  });
}

}  // namespace
}  // namespace paged_attn

TORCH_LIBRARY_IMPL(paged_attn, CPU, m) {
  m.impl("reshape_and_cache", &paged_attn::reshape_and_cache_cpu);
  m.impl("copy_blocks", &paged_attn::copy_blocks_cpu);
  m.impl("swap_blocks", &paged_attn::swap_blocks_cpu);
}
