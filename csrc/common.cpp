// Implementations of the shared host-side checks declared in common.h: the validation switch, caches, indices,
// overlap, and the cache ops' arguments (the overlap geometry they use is in overlap.cpp; the attention ops'
// checks are in attention_checks.cpp).
#include "common.h"

#include <ATen/ops/isnan.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace paged_attn {

namespace {
bool env_flag(const char* name) {  // set, and neither "" nor "0"
  const char* env = std::getenv(name);
  return env != nullptr && std::strcmp(env, "") != 0 && std::strcmp(env, "0") != 0;
}
std::atomic<bool>& validation_flag() {
  static std::atomic<bool> flag{env_flag("PAGED_ATTN_VALIDATE")};
  return flag;
}
std::atomic<bool>& batch_invariant_flag() {
  static std::atomic<bool> flag{env_flag("PAGED_ATTN_BATCH_INVARIANT")};
  return flag;
}
}  // namespace

bool validation_enabled() { return validation_flag().load(std::memory_order_relaxed); }
void set_validation_enabled(bool enabled) { validation_flag().store(enabled, std::memory_order_relaxed); }
bool batch_invariant_enabled() { return batch_invariant_flag().load(std::memory_order_relaxed); }
void set_batch_invariant_enabled(bool enabled) {
  batch_invariant_flag().store(enabled, std::memory_order_relaxed);
}

bool is_fp8(at::ScalarType dtype) { return dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2; }

float fp8_max_finite(at::ScalarType dtype) {
  TORCH_INTERNAL_ASSERT(is_fp8(dtype), "fp8_max_finite of ", dtype);
  return dtype == at::kFloat8_e4m3fn ? 448.f : 57344.f;
}

void check_scale(const at::Tensor& cache, const std::optional<at::Tensor>& scale, const char* name) {
  if (!scale.has_value()) return;
  const at::Tensor& t = *scale;
  TORCH_CHECK(is_fp8(cache.scalar_type()), name, " is given but the cache is ", cache.scalar_type(),
              ": scales apply only to fp8 caches (float8_e4m3fn, float8_e5m2)");
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == 1, name, " must be a float32 tensor of one element, got ",
              t.scalar_type(), " of shape ", t.sizes());
  TORCH_CHECK(t.device() == cache.device(), name, " must be on the cache's device ", cache.device(), ", got ",
              t.device());
}

void check_kv_scales(const at::Tensor& key_cache, const std::optional<at::Tensor>& k_scale,
                     const std::optional<at::Tensor>& v_scale) {
  check_scale(key_cache, k_scale, "k_scale");
  check_scale(key_cache, v_scale, "v_scale");
}

void check_scale_value(const std::optional<at::Tensor>& scale, const char* name) {
  if (!scale.has_value()) return;
  const float value = scale->item<float>();
  TORCH_CHECK(std::isfinite(value) && value != 0.f, name, " must be finite and nonzero, got ", value,
              ": an fp8 cache stores x as the fp8 value nearest to x / ", name, " and reads it back times ", name,
              " (0 would store NaN and +-max, inf zeros that read back NaN)");
}

void check_kv_scale_values(const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  check_scale_value(k_scale, "k_scale");
  check_scale_value(v_scale, "v_scale");
}

void check_sink_values(const std::optional<at::Tensor>& sinks) {
  if (!sinks.has_value()) return;
  const at::Tensor nan = at::isnan(*sinks);
  TORCH_CHECK(!nan.any().item<bool>(), "sinks must not be NaN (-inf: no sink for that head), got NaN for head ",
              nan.nonzero().min().item<int64_t>());
}

void check_cache(const at::Tensor& cache, const char* name) {
  TORCH_CHECK(cache.dim() == 4, name, " must have shape [num_blocks, block_size, num_kv_heads, head_dim]",
              is_tiled(cache) ? " (a tiled cache, from pack_cache, is read by the CPU ops only, with both caches "
                                "tiled)"
                              : "",
              ", got ", cache.sizes());
  const auto dtype = cache.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 || is_fp8(dtype), name,
              " must be float32, float16, bfloat16, float8_e4m3fn or float8_e5m2, got ", dtype);
  // NOTE: num_blocks = 0 is an empty pool and fine; a zero block_size would divide by zero in the index math.
  TORCH_CHECK(cache.size(1) > 0 && cache.size(2) > 0 && cache.size(3) > 0, name,
              ": block_size, num_kv_heads and head_dim must be positive, got shape ", cache.sizes());
  TORCH_CHECK(cache.stride(3) == 1, name, ": the last dimension (head_dim) must be contiguous, got shape ",
              cache.sizes(), " with strides ", cache.strides());
  TORCH_CHECK(!has_self_overlap(cache), name,
              ": its elements must not overlap (no two (block, token, kv head) rows may share memory), got shape ",
              cache.sizes(), " with strides ", cache.strides());
}

void check_tiled_cache_pair(const at::Tensor& key_cache, const at::Tensor& value_cache) {
  TORCH_CHECK(key_cache.dim() == 6 && value_cache.dim() == 5,
              "key_cache and value_cache must have one layout: both tiled (pack_cache: key_cache [num_blocks, "
              "num_kv_heads, block_size / 16, head_dim / 2, 16, 2], value_cache [num_blocks, num_kv_heads, "
              "block_size / 2, head_dim, 2]) or both [num_blocks, block_size, num_kv_heads, head_dim], got shapes ",
              key_cache.sizes(), " and ", value_cache.sizes());
  TORCH_CHECK(key_cache.device().is_cpu() && value_cache.device().is_cpu(),
              "tiled caches are read by the CPU ops only, got key_cache on ", key_cache.device(),
              " and value_cache on ", value_cache.device());
  const auto dtype = key_cache.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || is_fp8(dtype),
              "a tiled cache must be bfloat16, float8_e4m3fn or float8_e5m2 (the dot-product units' types), got ",
              dtype);
  TORCH_CHECK(value_cache.scalar_type() == dtype, "key_cache and value_cache must have the same dtype, got ", dtype,
              " and ", value_cache.scalar_type());
  const int64_t num_blocks = key_cache.size(0), num_kv_heads = key_cache.size(1);
  const int64_t block_size = key_cache.size(2) * 16, head_dim = key_cache.size(3) * 2;
  TORCH_CHECK(key_cache.size(4) == 16 && key_cache.size(5) == 2 && value_cache.size(4) == 2 &&
                  value_cache.size(0) == num_blocks && value_cache.size(1) == num_kv_heads &&
                  value_cache.size(2) * 2 == block_size && value_cache.size(3) == head_dim,
              "tiled key_cache [num_blocks, num_kv_heads, block_size / 16, head_dim / 2, 16, 2] and value_cache "
              "[num_blocks, num_kv_heads, block_size / 2, head_dim, 2] must describe one cache, got shapes ",
              key_cache.sizes(), " and ", value_cache.sizes());
  TORCH_CHECK(num_kv_heads > 0 && block_size > 0 && head_dim > 0 && head_dim % 32 == 0,
              "a tiled cache needs num_kv_heads, block_size and head_dim positive and head_dim a multiple of 32, "
              "got key_cache shape ", key_cache.sizes());
  for (const at::Tensor* t : {&key_cache, &value_cache}) {
    const char* name = t == &key_cache ? "key_cache" : "value_cache";
    int64_t expected = 1;
    for (int64_t dim = t->dim() - 1; dim >= 1; --dim) {
      TORCH_CHECK(t->stride(dim) == expected, name, ": a tiled cache must be contiguous within each block (as ",
                  "pack_cache makes it), got shape ", t->sizes(), " with strides ", t->strides());
      expected *= t->size(dim);
    }
    TORCH_CHECK(num_blocks <= 1 || t->stride(0) >= expected, name,
                ": the block stride must reach past a block's elements, got shape ", t->sizes(), " with strides ",
                t->strides());
  }
}

std::pair<at::Tensor, at::Tensor> caches_for_checks(const at::Tensor& key_cache, const at::Tensor& value_cache) {
  if (!is_tiled(key_cache) && !is_tiled(value_cache)) return {key_cache, value_cache};
  check_tiled_cache_pair(key_cache, value_cache);
  const int64_t num_kv_heads = key_cache.size(1), block_size = key_cache.size(2) * 16;
  const int64_t head_dim = key_cache.size(3) * 2;
  const auto view = [&](const at::Tensor& t) {
    return t.as_strided({t.size(0), block_size, num_kv_heads, head_dim},
                        {t.stride(0), num_kv_heads * head_dim, head_dim, 1});
  };
  return {view(key_cache), view(value_cache)};
}

bool has_packed_rows(const at::Tensor& cache) {
  return cache.stride(3) == 1 && cache.stride(2) == cache.size(3) && cache.stride(1) == cache.size(2) * cache.size(3);
}

namespace {
// "shape [..] with strides [..] at 0x..", for messages.
std::string layout_of(const at::Tensor& t) {
  std::ostringstream os;
  os << "shape " << t.sizes() << " with strides " << t.strides() << " at " << t.data_ptr();
  return os.str();
}
}  // namespace

void check_no_overlap(c10::ArrayRef<NamedTensor> tensors) {
  struct Entry {
    int64_t begin, end;
    size_t index;  // into tensors
  };
  c10::SmallVector<Entry, 8> entries;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = *tensors[i].tensor;
    if (!t.defined() || t.numel() == 0) continue;
    const auto [begin, end] = byte_range(t);
    entries.push_back({begin, end, i});
  }
  std::sort(entries.begin(), entries.end(), [](const Entry& x, const Entry& y) { return x.begin < y.begin; });
  for (size_t i = 0; i < entries.size(); ++i) {
    // Only tensors that start before this one ends can overlap it; two inputs may.
    for (size_t j = i + 1; j < entries.size() && entries[j].begin < entries[i].end; ++j) {
      const auto [first, second] = std::minmax(entries[i].index, entries[j].index);
      if (!tensors[first].written && !tensors[second].written) continue;
      TORCH_CHECK(!tensors_overlap(*tensors[first].tensor, *tensors[second].tensor), tensors[first].name, " and ",
                  tensors[second].name, " must not overlap in memory, but they share at least one element");
    }
  }
}

void check_same_layout(const at::Tensor& a, const char* a_name, const at::Tensor& b, const char* b_name) {
  TORCH_CHECK(a.device() == b.device(), a_name, " and ", b_name, " must be on the same device, got ", a.device(),
              " and ", b.device());
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), a_name, " and ", b_name, " must have the same dtype, got ",
              a.scalar_type(), " and ", b.scalar_type());
  TORCH_CHECK(a.sizes() == b.sizes(), a_name, " and ", b_name, " must have the same shape, got ", a.sizes(), " and ",
              b.sizes());
}

void check_cache_pair(const at::Tensor& key_cache, const at::Tensor& value_cache) {
  check_cache(key_cache, "key_cache");
  check_cache(value_cache, "value_cache");
  check_same_layout(key_cache, "key_cache", value_cache, "value_cache");
}

void check_index_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim,
                        const at::Device& device) {
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimension(s), got shape ", t.sizes());
  TORCH_CHECK(t.device() == device, name, " must be on ", device, ", got ", t.device());
}

void check_block_mapping_shape(const at::Tensor& block_mapping, const at::Device& device) {
  check_index_tensor(block_mapping, "block_mapping", at::kLong, 2, device);
  TORCH_CHECK(block_mapping.size(1) == 2,
              "block_mapping must have shape [num_pairs, 2] of (src_block, dst_block), got ", block_mapping.sizes());
}

void check_slot_range(const at::Tensor& slot_mapping_cpu, int64_t num_slots) {
  const auto slots = slot_mapping_cpu.contiguous();
  const int64_t* data = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < slots.numel(); ++i) {
    TORCH_CHECK(data[i] < num_slots, "slot_mapping[", i, "] = ", data[i], " is out of range: slots are in [0, ",
                num_slots, ") (num_blocks * block_size), and negative slots mark padding");
  }
}

void check_block_mapping_range(const at::Tensor& block_mapping_cpu, int64_t num_src_blocks,
                               int64_t num_dst_blocks, bool same_cache) {
  const auto mapping = block_mapping_cpu.contiguous();
  const int64_t* pairs = mapping.data_ptr<int64_t>();
  const int64_t num_pairs = mapping.size(0);
  for (int64_t i = 0; i < num_pairs; ++i) {
    const int64_t src = pairs[2 * i], dst = pairs[2 * i + 1];
    TORCH_CHECK(src >= 0 && src < num_src_blocks, "block_mapping[", i, "] = (", src, ", ", dst,
                "): source block ", src, " is out of range [0, ", num_src_blocks, ")");
    TORCH_CHECK(dst >= 0 && dst < num_dst_blocks, "block_mapping[", i, "] = (", src, ", ", dst,
                "): destination block ", dst, " is out of range [0, ", num_dst_blocks, ")");
  }
  // Destinations must be distinct (two writers to one block would race), and within one cache a destination
  // must not also be read as a source (the result would depend on the copy order).
  std::vector<int64_t> dsts(num_pairs);
  for (int64_t i = 0; i < num_pairs; ++i) dsts[i] = pairs[2 * i + 1];
  std::sort(dsts.begin(), dsts.end());
  const auto dup = std::adjacent_find(dsts.begin(), dsts.end());
  TORCH_CHECK(dup == dsts.end(), "block_mapping: destination block ", dup == dsts.end() ? 0 : *dup,
              " appears more than once; destinations must be distinct");
  if (same_cache) {
    for (int64_t i = 0; i < num_pairs; ++i) {
      const int64_t src = pairs[2 * i];
      TORCH_CHECK(!std::binary_search(dsts.begin(), dsts.end(), src), "block_mapping: block ", src,
                  " is both a source and a destination; destinations must never be sources");
    }
  }
}

void check_dtype_for_cache(const at::Tensor& t, const char* name, const at::Tensor& key_cache,
                           const char* cache_name) {
  if (is_fp8(key_cache.scalar_type())) {
    const auto dtype = t.scalar_type();
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, name,
                " must be float32, float16 or bfloat16 with an fp8 cache (", key_cache.scalar_type(), "), got ", dtype);
    return;
  }
  TORCH_CHECK(t.scalar_type() == key_cache.scalar_type(), name, " and ", cache_name, " must have the same dtype, got ",
              t.scalar_type(), " and ", key_cache.scalar_type());
}

void check_latent_cache(const at::Tensor& kv_cache, const char* name) {
  TORCH_CHECK(kv_cache.dim() == 3, name, " must have shape [num_blocks, block_size, kv_lora_rank + rope_dim], got ",
              kv_cache.sizes());
  const auto dtype = kv_cache.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 || is_fp8(dtype), name,
              " must be float32, float16, bfloat16, float8_e4m3fn or float8_e5m2, got ", dtype);
  TORCH_CHECK(kv_cache.size(1) > 0 && kv_cache.size(2) > 0, name,
              ": block_size and kv_lora_rank + rope_dim must be positive, got shape ", kv_cache.sizes());
  TORCH_CHECK(kv_cache.stride(2) == 1, name, ": the last dimension (kv_lora_rank + rope_dim) must be contiguous, ",
              "got shape ", kv_cache.sizes(), " with strides ", kv_cache.strides());
  TORCH_CHECK(!has_self_overlap(kv_cache), name, ": its elements must not overlap (no two rows may share memory), ",
              "got shape ", kv_cache.sizes(), " with strides ", kv_cache.strides());
}

void check_concat_and_cache_mla_args(const at::Tensor& kv_c, const at::Tensor& k_pe, const at::Tensor& kv_cache,
                                     const at::Tensor& slot_mapping, const std::optional<at::Tensor>& scale) {
  check_latent_cache(kv_cache);
  TORCH_CHECK(kv_c.dim() == 2 && k_pe.dim() == 2 && k_pe.size(0) == kv_c.size(0),
              "kv_c and k_pe must have shapes [num_tokens, kv_lora_rank] and [num_tokens, rope_dim], got ",
              kv_c.sizes(), " and ", k_pe.sizes());
  TORCH_CHECK(kv_c.size(1) + k_pe.size(1) == kv_cache.size(2), "kv_c and k_pe hold ", kv_c.size(1), " + ",
              k_pe.size(1), " values per token but a row of kv_cache holds kv_lora_rank + rope_dim = ",
              kv_cache.size(2));
  TORCH_CHECK(kv_c.scalar_type() == k_pe.scalar_type() && kv_c.device() == k_pe.device(),
              "kv_c and k_pe must have the same dtype and device, got ", kv_c.scalar_type(), " on ", kv_c.device(),
              " and ", k_pe.scalar_type(), " on ", k_pe.device());
  TORCH_CHECK(kv_c.device() == kv_cache.device(), "kv_c and kv_cache must be on the same device, got ", kv_c.device(),
              " and ", kv_cache.device());
  check_dtype_for_cache(kv_c, "kv_c", kv_cache, "kv_cache");
  TORCH_CHECK((kv_c.stride(1) == 1 || kv_c.size(1) <= 1) && (k_pe.stride(1) == 1 || k_pe.size(1) <= 1),
              "kv_c and k_pe must be contiguous in their last dimension, got strides ", kv_c.strides(), " and ",
              k_pe.strides());
  check_index_tensor(slot_mapping, "slot_mapping", at::kLong, 1, kv_cache.device());
  TORCH_CHECK(slot_mapping.size(0) == kv_c.size(0), "slot_mapping must have num_tokens = ", kv_c.size(0),
              " entries, got ", slot_mapping.size(0));
  check_scale(kv_cache, scale, "scale");
  const at::Tensor none;
  check_no_overlap({{&kv_c, "kv_c", false}, {&k_pe, "k_pe", false}, {&kv_cache, "kv_cache", true},
                    {&slot_mapping, "slot_mapping", false}, {scale.has_value() ? &*scale : &none, "scale", false}});
}

void check_reshape_and_cache_args(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& slot_mapping,
                                  const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  check_cache_pair(key_cache, value_cache);
  TORCH_CHECK(key.dim() == 3, "key must have shape [num_tokens, num_kv_heads, head_dim], got ", key.sizes());
  check_same_layout(key, "key", value, "value");
  TORCH_CHECK(key.device() == key_cache.device(), "key and key_cache must be on the same device, got ", key.device(),
              " and ", key_cache.device());
  check_dtype_for_cache(key, "key", key_cache);
  TORCH_CHECK(key.size(1) == key_cache.size(2) && key.size(2) == key_cache.size(3),
              "key is [num_tokens, num_kv_heads, head_dim] = ", key.sizes(),
              " but the cache holds [num_kv_heads, head_dim] = [", key_cache.size(2), ", ", key_cache.size(3), "]");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1,
              "key and value must be contiguous in their last dimension (head_dim), got strides ", key.strides(),
              " and ", value.strides());
  check_index_tensor(slot_mapping, "slot_mapping", at::kLong, 1, key_cache.device());
  TORCH_CHECK(slot_mapping.size(0) == key.size(0), "slot_mapping must have num_tokens = ", key.size(0),
              " entries, got ", slot_mapping.size(0));
  check_kv_scales(key_cache, k_scale, v_scale);
  const at::Tensor none;
  check_no_overlap({{&key, "key", false}, {&value, "value", false}, {&key_cache, "key_cache", true},
                    {&value_cache, "value_cache", true}, {&slot_mapping, "slot_mapping", false},
                    {k_scale.has_value() ? &*k_scale : &none, "k_scale", false},
                    {v_scale.has_value() ? &*v_scale : &none, "v_scale", false}});
}

void check_copy_blocks_args(at::TensorList key_caches, at::TensorList value_caches,
                            const at::Tensor& block_mapping) {
  TORCH_CHECK(key_caches.size() == value_caches.size() || value_caches.empty(),
              "key_caches and value_caches must have the same number of layers (or value_caches none: one cache per ",
              "layer, as MLA's latent caches), got ", key_caches.size(), " and ", value_caches.size());
  if (key_caches.empty()) return;
  const bool one_cache_per_layer = value_caches.empty();
  const at::Tensor& first = key_caches[0];
  std::vector<std::string> names;  // key_caches[0], value_caches[0], key_caches[1], ... (reserved: c_str() stays put)
  std::vector<NamedTensor> args;   // the caches in that order, then block_mapping
  names.reserve(2 * key_caches.size());
  for (size_t layer = 0; layer < key_caches.size(); ++layer) {
    for (const bool is_value : {false, true}) {
      if (is_value && one_cache_per_layer) continue;
      const at::Tensor& cache = is_value ? value_caches[layer] : key_caches[layer];
      const std::string& name =
          names.emplace_back((is_value ? "value_caches[" : "key_caches[") + std::to_string(layer) + "]");
      if (one_cache_per_layer && cache.dim() == 3) {
        check_latent_cache(cache, name.c_str());
      } else {
        check_cache(cache, name.c_str());
      }
      check_same_layout(first, "key_caches[0]", cache, name.c_str());
      args.push_back({&cache, name.c_str(), true});
    }
  }
  TORCH_CHECK(block_mapping.device().is_cpu() || block_mapping.device() == first.device(),
              "block_mapping must be on the CPU or on the caches' device ", first.device(), ", got ",
              block_mapping.device());
  check_block_mapping_shape(block_mapping, block_mapping.device());
  args.push_back({&block_mapping, "block_mapping", false});
  check_no_overlap(args);  // any two caches of any layers, and the mapping
}

void check_swap_blocks_args(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& block_mapping) {
  TORCH_CHECK(src.dim() >= 1 && dst.dim() >= 1, "src and dst must be caches with a leading block dimension");
  TORCH_CHECK(src.scalar_type() == dst.scalar_type(), "src and dst must have the same dtype, got ",
              src.scalar_type(), " and ", dst.scalar_type());
  TORCH_CHECK(src.sizes().slice(1) == dst.sizes().slice(1), "src and dst must have the same per-block shape, got ",
              src.sizes(), " and ", dst.sizes());
  const auto block_shape = src.sizes().slice(1);
  TORCH_CHECK(std::find(block_shape.begin(), block_shape.end(), 0) == block_shape.end(),
              "src and dst must have positive sizes after the block dimension, got ", src.sizes());
  // A block is copied as the run of bytes it spans (block_span_bytes), so src and dst must lay a block out alike;
  // the block dimension may have any stride, as long as the blocks' spans do not overlap.
  TORCH_CHECK(src.strides().slice(1) == dst.strides().slice(1),
              "src and dst must have the same strides within a block (all dimensions after the first), got ",
              src.strides(), " and ", dst.strides());
  for (const at::Tensor* t : {&src, &dst}) {
    TORCH_CHECK(t->device().is_cpu() || t->device().is_cuda(), "swap_blocks supports CPU and CUDA tensors, got ",
                t->device());
    TORCH_CHECK(t->size(0) == 0 || !has_self_overlap(t->select(0, 0)),
                "src and dst must not have overlapping elements within a block, got strides ", t->strides());
    TORCH_CHECK(t->size(0) <= 1 || t->stride(0) * t->element_size() >= block_span_bytes(*t),
                "src and dst blocks must not overlap (the block stride must reach past the bytes a block spans), got "
                "shape ", t->sizes(), " with strides ", t->strides());
  }
  check_block_mapping_shape(block_mapping, at::Device(at::kCPU));
  // NOTE: each destination block is written as the whole run of bytes a block spans (block_span_bytes), the bytes
  // between its rows included (e.g. the V rows of a packed K|V cache when its K half is swapped), so what dst's
  // blocks span, not just its elements, must miss what is read: src's block spans, and block_mapping. src and dst
  // may be one cache (exactly the same memory; the caller then forbids destinations that are sources), but not two
  // different views of shared memory.
  if (dst.size(0) == 0) return;  // nothing is written
  const Footprint dst_spans = block_spans_of(dst);
  if (src.size(0) != 0 && src.device() == dst.device() && !same_memory(src, dst)) {
    TORCH_CHECK(!footprints_intersect(block_spans_of(src), dst_spans),
                "src and dst must not overlap in memory: swap_blocks copies each block as the ", block_span_bytes(src),
                " bytes it spans (from its first element to the end of its last, the bytes between its rows "
                "included), and some block of src and some block of dst span a common byte; got src ",
                layout_of(src), " and dst ", layout_of(dst), " (", src.element_size(), "-byte elements)");
  }
  if (block_mapping.numel() != 0 && block_mapping.device() == dst.device()) {  // (block_mapping is on the CPU)
    TORCH_CHECK(!footprints_intersect(footprint_of(block_mapping), dst_spans),
                "dst and block_mapping must not overlap in memory: block_mapping lies within the bytes dst's blocks "
                "span (each block is copied as the ", block_span_bytes(dst), " bytes it spans)");
  }
}

bool cpu_avx512_bf16() {
#if defined(__x86_64__)
  static const bool use = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512bf16") && std::getenv("PAGED_ATTN_NO_AVX512") == nullptr;
  return use;
#else
  return false;
#endif
}

}  // namespace paged_attn
