// CPU kernels of the cache ops. They only move bytes, so they are dtype-agnostic: a row of head_dim elements
// (or a whole block, when its rows are packed) is one memcpy; fp8 caches are copied byte for byte too. The one
// exception: reshape_and_cache into an fp8 cache quantizes each element (quantize_fp8). Every index is range-checked
// before anything is written, so a bad slot or block id raises an error and leaves the caches untouched.
//
// Cache addresses: paged_cache.h (PagedCache, shared with the attention kernels).
//
// Parallelism: at::parallel_for over tokens (reshape_and_cache) or over (layer, pair, key|value) copies
// (copy_blocks) or pairs (swap_blocks).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <cstring>

#include "../common.h"
#include "paged_cache.h"

namespace paged_attn {
namespace {

// at::parallel_for's grain: the fewest iterations (tokens, block copies) one thread takes, so that each thread moves
// at least kMinBytesPerCpuTask (common.h).
int64_t grain_for(int64_t bytes_per_iteration) {
  return std::max<int64_t>(1, kMinBytesPerCpuTask / std::max<int64_t>(1, bytes_per_iteration));
}

// The fp8 value nearest to x / scale: IEEE division in float32 (as the reference, so the two round the same
// quotient), saturated to +-max_finite (NaN compares false and stays NaN), then c10's round-to-nearest-even
// conversion (which would turn values past the largest finite one into NaN or inf, hence the clamp first).
template <typename fp8_t>
inline fp8_t quantize_fp8(float x, float scale, float max_finite) {
  float q = x / scale;
  if (q > max_finite) q = max_finite;
  if (q < -max_finite) q = -max_finite;
  return fp8_t(q);
}

// reshape_and_cache into fp8 caches: each of a row's head_dim elements quantized with its cache's scale.
template <typename scalar_t, typename fp8_t>
void quantize_rows(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                   const int64_t* slot_ptr, float k_scale, float v_scale) {
  const int64_t num_tokens = key.size(0);
  const int64_t num_kv_heads = key_cache.size(2), head_dim = key_cache.size(3);
  const float max_finite = fp8_max_finite(key_cache.scalar_type());
  const auto* key_ptr = key.const_data_ptr<scalar_t>();
  const auto* value_ptr = value.const_data_ptr<scalar_t>();
  const auto k_cache = cpu::paged_cache_of<fp8_t>(key_cache);
  const auto v_cache = cpu::paged_cache_of<fp8_t>(value_cache);
  at::parallel_for(0, num_tokens, grain_for(2 * num_kv_heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t token = begin; token < end; ++token) {
      const int64_t slot = slot_ptr[token];
      if (slot < 0) continue;  // padding token
      for (int64_t head = 0; head < num_kv_heads; ++head) {
        const scalar_t* k = key_ptr + token * key.stride(0) + head * key.stride(1);
        const scalar_t* v = value_ptr + token * value.stride(0) + head * value.stride(1);
        fp8_t* k_dst = k_cache.slot_row(slot, head);
        fp8_t* v_dst = v_cache.slot_row(slot, head);
        for (int64_t d = 0; d < head_dim; ++d) {
          k_dst[d] = quantize_fp8<fp8_t>(static_cast<float>(k[d]), k_scale, max_finite);
          v_dst[d] = quantize_fp8<fp8_t>(static_cast<float>(v[d]), v_scale, max_finite);
        }
      }
    }
  });
}

// reshape_and_cache into tiled caches (paged_cache.h): each element to its place in its tile, converted to the cache
// type (bfloat16: as it is; fp8: quantize_fp8 with its cache's scale).
template <typename scalar_t, typename cache_t>
void write_tiled(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                 const int64_t* slot_ptr, float k_scale, float v_scale) {
  const auto k_cache = cpu::paged_cache_of<cache_t>(key_cache);
  const auto v_cache = cpu::paged_cache_of<cache_t>(value_cache);
  const int64_t num_tokens = key.size(0), num_kv_heads = k_cache.num_kv_heads, head_dim = k_cache.head_dim;
  const auto* key_ptr = key.const_data_ptr<scalar_t>();
  const auto* value_ptr = value.const_data_ptr<scalar_t>();
  const float max_finite = is_fp8(key_cache.scalar_type()) ? fp8_max_finite(key_cache.scalar_type()) : 0.f;
  const auto convert = [max_finite](scalar_t x, float scale) {
    if constexpr (std::is_same_v<scalar_t, cache_t>) {
      (void)scale;
      return x;
    } else {
      return quantize_fp8<cache_t>(static_cast<float>(x), scale, max_finite);
    }
  };
  at::parallel_for(0, num_tokens, grain_for(2 * num_kv_heads * head_dim * int64_t{sizeof(cache_t)}),
                   [&](int64_t begin, int64_t end) {
    for (int64_t token = begin; token < end; ++token) {
      const int64_t slot = slot_ptr[token];
      if (slot < 0) continue;  // padding token
      const int64_t block = slot / k_cache.block_size, offset = slot % k_cache.block_size;
      const int64_t i = offset % cpu::kTiledTokens;  // the token's place in its tile
      for (int64_t head = 0; head < num_kv_heads; ++head) {
        const scalar_t* k = key_ptr + token * key.stride(0) + head * key.stride(1);
        const scalar_t* v = value_ptr + token * value.stride(0) + head * value.stride(1);
        cache_t* k_tile = k_cache.tile(block, offset) + head * k_cache.head_stride;
        cache_t* v_tile = v_cache.tile(block, offset) + head * v_cache.head_stride;
        for (int64_t d = 0; d < head_dim; ++d) {
          k_tile[k_cache.key_index(i, d)] = convert(k[d], k_scale);
          v_tile[v_cache.value_index(i, d)] = convert(v[d], v_scale);
        }
      }
    }
  });
}

void reshape_and_cache_cpu(const at::Tensor& key,          // [num_tokens, num_kv_heads, head_dim]
                           const at::Tensor& value,        // [num_tokens, num_kv_heads, head_dim]
                           at::Tensor& key_cache,          // [num_blocks, block_size, num_kv_heads, head_dim]
                           at::Tensor& value_cache,        // [num_blocks, block_size, num_kv_heads, head_dim]
                           const at::Tensor& slot_mapping,  // [num_tokens], int64, < 0 = padding
                           const std::optional<at::Tensor>& k_scale,    // [1], float32 (fp8 caches only)
                           const std::optional<at::Tensor>& v_scale) {  // [1], float32 (fp8 caches only)
  const auto [key_checked, value_checked] = caches_for_checks(key_cache, value_cache);  // tiled: as 4 dims
  check_reshape_and_cache_args(key, value, key_checked, value_checked, slot_mapping, k_scale, v_scale);
  const int64_t num_tokens = key.size(0), block_size = key_checked.size(1);
  const int64_t num_kv_heads = key_checked.size(2), head_dim = key_checked.size(3);
  check_slot_range(slot_mapping, key_checked.size(0) * block_size);
  check_kv_scale_values(k_scale, v_scale);
  if (num_tokens == 0 || num_kv_heads * head_dim == 0) return;
  // Element by element: into tiled caches (write_tiled) or fp8 row-major ones (quantize_rows); else row copies.
  if (is_tiled(key_cache) || is_fp8(key_cache.scalar_type())) {
    const auto slots = slot_mapping.contiguous();
    const int64_t* slot_ptr = slots.const_data_ptr<int64_t>();
    const float ks = k_scale.has_value() ? k_scale->item<float>() : 1.f;
    const float vs = v_scale.has_value() ? v_scale->item<float>() : 1.f;
    const bool tiled = is_tiled(key_cache);
    const auto run = [&](auto key_tag, auto cache_tag) {
      using scalar_t = decltype(key_tag);
      using cache_t = decltype(cache_tag);
      if (tiled) {
        write_tiled<scalar_t, cache_t>(key, value, key_cache, value_cache, slot_ptr, ks, vs);
      } else if constexpr (!std::is_same_v<cache_t, at::BFloat16>) {  // a row-major cache here is fp8
        quantize_rows<scalar_t, cache_t>(key, value, key_cache, value_cache, slot_ptr, ks, vs);
      }
    };
    const auto by_cache = [&](auto key_tag) {
      switch (key_cache.scalar_type()) {  // fp8, or bfloat16 (tiled): check_tiled_cache_pair, check_cache
        case at::kFloat8_e4m3fn: return run(key_tag, c10::Float8_e4m3fn{});
        case at::kFloat8_e5m2: return run(key_tag, c10::Float8_e5m2{});
        default: return run(key_tag, at::BFloat16{});
      }
    };
    switch (key.scalar_type()) {  // check_reshape_and_cache_args allows exactly these
      case at::kFloat: return by_cache(float{});
      case at::kHalf: return by_cache(at::Half{});
      case at::kBFloat16: return by_cache(at::BFloat16{});
      default: TORCH_INTERNAL_ASSERT(false, "unreachable: dtype checked above");
    }
  }

  // All strides in bytes (the caches' too: paged_cache_of<char>).
  const int64_t elem = key.element_size(), row_bytes = head_dim * elem;
  const int64_t key_token_stride = key.stride(0) * elem, key_head_stride = key.stride(1) * elem;
  const int64_t value_token_stride = value.stride(0) * elem, value_head_stride = value.stride(1) * elem;
  const auto* key_ptr = static_cast<const char*>(key.data_ptr());
  const auto* value_ptr = static_cast<const char*>(value.data_ptr());
  const auto k_cache = cpu::paged_cache_of<char>(key_cache);
  const auto v_cache = cpu::paged_cache_of<char>(value_cache);
  const auto slots = slot_mapping.contiguous();
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();

  at::parallel_for(0, num_tokens, grain_for(2 * num_kv_heads * row_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t token = begin; token < end; ++token) {
      const int64_t slot = slot_ptr[token];
      if (slot < 0) continue;  // padding token
      char* key_dst = k_cache.slot_row(slot, 0);  // kv head h's row: + h * head_stride
      char* value_dst = v_cache.slot_row(slot, 0);
      for (int64_t head = 0; head < num_kv_heads; ++head) {
        std::memcpy(key_dst + head * k_cache.head_stride,
                    key_ptr + token * key_token_stride + head * key_head_stride, row_bytes);
        std::memcpy(value_dst + head * v_cache.head_stride,
                    value_ptr + token * value_token_stride + head * value_head_stride, row_bytes);
      }
    }
  });
}

// concat_and_cache_mla: row slot_mapping[i] of the latent cache is kv_c[i] then k_pe[i], copied, or for an fp8
// cache quantized with `scale` (quantize_fp8, as reshape_and_cache).
template <typename scalar_t, typename cache_t>
void write_latent_rows(const at::Tensor& kv_c, const at::Tensor& k_pe, at::Tensor& kv_cache, const int64_t* slot_ptr,
                       float scale) {
  const int64_t num_tokens = kv_c.size(0), rank = kv_c.size(1), rope_dim = k_pe.size(1);
  const auto cache = cpu::paged_cache_of<cache_t>(kv_cache.unsqueeze(2));
  const auto* kv_c_ptr = kv_c.const_data_ptr<scalar_t>();
  const auto* k_pe_ptr = k_pe.const_data_ptr<scalar_t>();
  const int64_t row_bytes = (rank + rope_dim) * int64_t{sizeof(cache_t)};
  at::parallel_for(0, num_tokens, grain_for(row_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t token = begin; token < end; ++token) {
      const int64_t slot = slot_ptr[token];
      if (slot < 0) continue;  // padding token
      cache_t* dst = cache.slot_row(slot, 0);
      const scalar_t* c = kv_c_ptr + token * kv_c.stride(0);
      const scalar_t* pe = k_pe_ptr + token * k_pe.stride(0);
      if constexpr (std::is_same_v<scalar_t, cache_t>) {
        std::memcpy(dst, c, rank * sizeof(cache_t));
        std::memcpy(dst + rank, pe, rope_dim * sizeof(cache_t));
      } else {
        const float max_finite = fp8_max_finite(kv_cache.scalar_type());
        for (int64_t d = 0; d < rank; ++d) {
          dst[d] = quantize_fp8<cache_t>(static_cast<float>(c[d]), scale, max_finite);
        }
        for (int64_t d = 0; d < rope_dim; ++d) {
          dst[rank + d] = quantize_fp8<cache_t>(static_cast<float>(pe[d]), scale, max_finite);
        }
      }
    }
  });
}

void concat_and_cache_mla_cpu(const at::Tensor& kv_c,          // [num_tokens, kv_lora_rank], last dim contiguous
                              const at::Tensor& k_pe,          // [num_tokens, rope_dim], last dim contiguous
                              at::Tensor& kv_cache,            // [num_blocks, block_size, kv_lora_rank + rope_dim]
                              const at::Tensor& slot_mapping,  // [num_tokens], int64, < 0 = padding
                              const std::optional<at::Tensor>& scale) {  // [1], float32 (fp8 caches only)
  check_concat_and_cache_mla_args(kv_c, k_pe, kv_cache, slot_mapping, scale);
  check_slot_range(slot_mapping, kv_cache.size(0) * kv_cache.size(1));
  check_scale_value(scale, "scale");
  if (kv_c.size(0) == 0) return;
  const auto slots = slot_mapping.contiguous();
  const int64_t* slot_ptr = slots.const_data_ptr<int64_t>();
  const float s = scale.has_value() ? scale->item<float>() : 1.f;
  const auto write = [&](auto input_tag, auto cache_tag) {
    write_latent_rows<decltype(input_tag), decltype(cache_tag)>(kv_c, k_pe, kv_cache, slot_ptr, s);
  };
  const auto by_cache = [&](auto tag) {
    switch (kv_cache.scalar_type()) {
      case at::kFloat8_e4m3fn: return write(tag, c10::Float8_e4m3fn{});
      case at::kFloat8_e5m2: return write(tag, c10::Float8_e5m2{});
      default: return write(tag, tag);
    }
  };
  switch (kv_c.scalar_type()) {  // check_concat_and_cache_mla_args allows exactly these
    case at::kFloat: return by_cache(float{});
    case at::kHalf: return by_cache(at::Half{});
    case at::kBFloat16: return by_cache(at::BFloat16{});
    default: TORCH_INTERNAL_ASSERT(false, "unreachable: dtype checked above");
  }
}

void copy_blocks_cpu(at::TensorList key_caches,     // num_layers x [num_blocks, block_size, num_kv_heads, head_dim]
                     at::TensorList value_caches,   // num_layers x the same, or none (then key_caches may be latent)
                     const at::Tensor& block_mapping) {  // [num_pairs, 2] of (src_block, dst_block), int64
  // Tiled caches as their 4-dim views (caches_for_checks): a block is one contiguous run in both layouts, and
  // copy_blocks moves whole blocks.
  std::vector<at::Tensor> keys(key_caches.begin(), key_caches.end()), values(value_caches.begin(), value_caches.end());
  for (size_t layer = 0; layer < values.size() && layer < keys.size(); ++layer) {
    std::tie(keys[layer], values[layer]) = caches_for_checks(keys[layer], values[layer]);
  }
  key_caches = keys, value_caches = values;
  check_copy_blocks_args(key_caches, value_caches, block_mapping);
  const int64_t num_layers = static_cast<int64_t>(key_caches.size());
  if (num_layers == 0 || block_mapping.size(0) == 0) return;
  const at::Tensor first = as_paged_cache(key_caches[0]);
  const int64_t caches_per_layer = value_caches.empty() ? 1 : 2;
  check_block_mapping_range(block_mapping, first.size(0), first.size(0), /*same_cache=*/true);

  const int64_t num_pairs = block_mapping.size(0), elem = first.element_size();
  const int64_t block_size = first.size(1), num_kv_heads = first.size(2), row_bytes = first.size(3) * elem;
  const int64_t block_bytes = block_size * num_kv_heads * row_bytes;
  const auto mapping = block_mapping.contiguous();
  const int64_t* pairs = mapping.data_ptr<int64_t>();

  // One task per (layer, pair, key|value). A block whose rows are packed is one memcpy, else one per row (e.g. the
  // K half of a packed K|V cache: the V rows between them are not this cache's to copy).
  const int64_t num_tasks = num_layers * num_pairs * caches_per_layer;
  at::parallel_for(0, num_tasks, grain_for(block_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t layer = task / (num_pairs * caches_per_layer), pair = (task / caches_per_layer) % num_pairs;
      const at::Tensor cache =
          as_paged_cache(task % caches_per_layer == 0 ? key_caches[layer] : value_caches[layer]);
      const auto c = cpu::paged_cache_of<char>(cache);  // in bytes
      const int64_t dst = pairs[2 * pair + 1], src = pairs[2 * pair];
      if (has_packed_rows(cache)) {
        std::memcpy(c.block(dst), c.block(src), block_bytes);
        continue;
      }
      for (int64_t offset = 0; offset < block_size; ++offset) {
        for (int64_t head = 0; head < num_kv_heads; ++head) {
          std::memcpy(c.token(dst, offset) + head * c.head_stride, c.token(src, offset) + head * c.head_stride,
                      row_bytes);
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
  m.impl("concat_and_cache_mla", &paged_attn::concat_and_cache_mla_cpu);
}
