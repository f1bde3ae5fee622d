// The cache ops on CUDA: the torch-facing launchers (plain C++: the kernels, cache_ops_kernels.cuh, are launched by
// csrc/cuda/instantiations/cache_ops.cu through cache_ops_launch.h); their launch plans are in copy_plan.h.
//
//   reshape_and_cache, concat_and_cache_mla, copy_blocks: one kernel launch each (copy_blocks: one per kMaxLayersPerLaunch layers).
//   swap_blocks: no kernel: runs of consecutive (src, dst) block ids become one cudaMemcpy2DAsync each
//                (pitch = block stride), on the current stream; asynchronous when the CPU side is pinned.
//
// Index validation synchronizes, so it is opt-in (PAGED_ATTN_VALIDATE=1 / paged_attn.set_validation(True));
// swap_blocks' mapping lives on the CPU and is always checked.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "../common.h"
#include "cache_ops_launch.h"
#include "paged_cache_host.h"

namespace paged_attn {
namespace {

template <typename F>
void dispatch_width(int64_t width, F&& f) {
  TORCH_CHECK(dispatch_unit(width, f), "internal error: unsupported access width ", width);
}

// ---------------------------------------------------------------------------------------------------------------
// reshape_and_cache into fp8 caches (after the checks): one thread per element, quantizing.
void reshape_and_cache_fp8(const at::Tensor& key,          // [num_tokens, num_kv_heads, head_dim]
                           const at::Tensor& value,        // [num_tokens, num_kv_heads, head_dim]
                           at::Tensor& key_cache,          // [num_blocks, block_size, num_kv_heads, head_dim], fp8
                           at::Tensor& value_cache,        // [num_blocks, block_size, num_kv_heads, head_dim], fp8
                           const at::Tensor& slot_mapping,  // [num_tokens], int64, < 0 = padding
                           const std::optional<at::Tensor>& k_scale,    // [1], float32, or none
                           const std::optional<at::Tensor>& v_scale) {  // [1], float32, or none
  const int64_t num_tokens = key.size(0), num_kv_heads = key_cache.size(2), head_dim = key_cache.size(3);
  const CopyPlan plan = plan_reshape_and_cache(num_tokens, num_kv_heads, head_dim);
  TORCH_CHECK(plan.error.empty(), "reshape_and_cache: this call cannot be launched on CUDA: ", plan.error);
  const auto slots = slot_mapping.contiguous();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto run = [&](auto dtype_tag) {
    using T = decltype(dtype_tag);
    const ReshapeAndCacheFp8Params<T> params{
        static_cast<const T*>(key.data_ptr()), static_cast<const T*>(value.data_ptr()), key.stride(0), key.stride(1),
        value.stride(0), value.stride(1), paged_cache_of<__nv_fp8_storage_t>(key_cache),
        paged_cache_of<__nv_fp8_storage_t>(value_cache), slots.data_ptr<int64_t>(),
        k_scale.has_value() ? k_scale->data_ptr<float>() : nullptr,
        v_scale.has_value() ? v_scale->data_ptr<float>() : nullptr,
        key_cache.scalar_type() == at::kFloat8_e5m2 ? __NV_E5M2 : __NV_E4M3};
    C10_CUDA_CHECK(launch_reshape_and_cache_fp8(params, plan, stream));
  };
  switch (key.scalar_type()) {  // check_reshape_and_cache_args allows exactly these
    case at::kFloat: return run(float{});
    case at::kHalf: return run(__half{});
    case at::kBFloat16: return run(__nv_bfloat16{});
    default: TORCH_CHECK(false, "reshape_and_cache: unsupported dtype ", key.scalar_type());
  }
}

void reshape_and_cache_cuda(const at::Tensor& key,          // [num_tokens, num_kv_heads, head_dim]
                            const at::Tensor& value,        // [num_tokens, num_kv_heads, head_dim]
                            at::Tensor& key_cache,          // [num_blocks, block_size, num_kv_heads, head_dim]
                            at::Tensor& value_cache,        // [num_blocks, block_size, num_kv_heads, head_dim]
                            const at::Tensor& slot_mapping,  // [num_tokens], int64, < 0 = padding
                            const std::optional<at::Tensor>& k_scale,    // [1], float32 (fp8 caches only)
                            const std::optional<at::Tensor>& v_scale) {  // [1], float32 (fp8 caches only)
  check_reshape_and_cache_args(key, value, key_cache, value_cache, slot_mapping, k_scale,
                               v_scale);  // sizes > 0 (check_cache)
  const c10::cuda::CUDAGuard guard(key_cache.device());
  const int64_t num_tokens = key.size(0), block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2), head_dim = key_cache.size(3);
  if (validation_enabled()) {
    check_slot_range(slot_mapping.cpu(), key_cache.size(0) * block_size);
    check_kv_scale_values(k_scale, v_scale);
  }
  if (num_tokens == 0) return;
  if (is_fp8(key_cache.scalar_type())) {
    return reshape_and_cache_fp8(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale);
  }

  const uint64_t elem = key.element_size();
  const int64_t width = access_width({head_dim * elem, key.stride(0) * elem, key.stride(1) * elem,
                                      value.stride(0) * elem, value.stride(1) * elem, key_cache.stride(0) * elem,
                                      key_cache.stride(1) * elem, key_cache.stride(2) * elem,
                                      value_cache.stride(0) * elem, value_cache.stride(1) * elem,
                                      value_cache.stride(2) * elem, address_of(key), address_of(value),
                                      address_of(key_cache), address_of(value_cache)});
  // Every value above is a multiple of the element size, so a Unit holds a whole number of elements.
  const int64_t per_unit = width / static_cast<int64_t>(elem);
  const auto to_units = [per_unit](int64_t elements) { return elements / per_unit; };
  const int64_t head_units = to_units(head_dim);
  const CopyPlan plan = plan_reshape_and_cache(num_tokens, num_kv_heads, head_units);
  TORCH_CHECK(plan.error.empty(), "reshape_and_cache: this call cannot be launched on CUDA: ", plan.error);
  const auto slots = slot_mapping.contiguous();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  dispatch_width(width, [&](auto unit) {
    using Unit = decltype(unit);
    const ReshapeAndCacheParams<Unit> params{static_cast<const Unit*>(key.data_ptr()),
                                             static_cast<const Unit*>(value.data_ptr()),
                                             to_units(key.stride(0)),
                                             to_units(key.stride(1)),
                                             to_units(value.stride(0)),
                                             to_units(value.stride(1)),
                                             paged_cache_of<Unit>(key_cache),
                                             paged_cache_of<Unit>(value_cache),
                                             slots.data_ptr<int64_t>()};
    C10_CUDA_CHECK(launch_reshape_and_cache(params, plan, stream));
  });
}

// ---------------------------------------------------------------------------------------------------------------
void copy_blocks_cuda(at::TensorList key_caches,     // num_layers x [num_blocks, block_size, num_kv_heads, head_dim]
                      at::TensorList value_caches,   // num_layers x the same, or none (then key_caches may be latent)
                      const at::Tensor& block_mapping) {  // [num_pairs, 2] of (src_block, dst_block), int64
  check_copy_blocks_args(key_caches, value_caches, block_mapping);  // sizes > 0 (check_cache)
  const int64_t num_layers = static_cast<int64_t>(key_caches.size());
  if (num_layers == 0 || block_mapping.size(0) == 0) return;
  const at::Tensor first = as_paged_cache(key_caches[0]);  // a latent cache as [num_blocks, block_size, 1, row]
  const int64_t caches_per_layer = value_caches.empty() ? 1 : 2;
  TORCH_CHECK(first.is_cuda(), "copy_blocks: the caches must be CUDA tensors here, got ", first.device());
  const c10::cuda::CUDAGuard guard(first.device());
  if (validation_enabled()) {
    check_block_mapping_range(block_mapping.cpu(), first.size(0), first.size(0), /*same_cache=*/true);
  }
  // NOTE: a CPU mapping is first copied into a pinned buffer of our own, which the upload then reads without
  // blocking the host: the caller's tensor may be overwritten as soon as we return (pin_memory() would alias it
  // when it is already pinned), and the host allocator keeps our buffer until the upload has run.
  at::Tensor mapping = block_mapping.contiguous();
  if (!block_mapping.is_cuda()) {
    at::Tensor staged = at::empty(block_mapping.sizes(), block_mapping.options().pinned_memory(true));
    staged.copy_(block_mapping);
    mapping = staged.to(first.device(), /*non_blocking=*/true);
  }

  const int64_t num_pairs = block_mapping.size(0);
  const uint64_t elem = first.element_size();
  const int64_t block_size = first.size(1), num_kv_heads = first.size(2), head_dim = first.size(3);
  // The access width divides every row's length, address and stride (a strided view is copied row by row).
  uint64_t alignment_bits = head_dim * elem;
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    for (int64_t c = 0; c < caches_per_layer; ++c) {
      const at::Tensor cache = as_paged_cache(c == 0 ? key_caches[layer] : value_caches[layer]);
      alignment_bits |= address_of(cache) | cache.stride(0) * elem | cache.stride(1) * elem | cache.stride(2) * elem;
    }
  }
  const int64_t width = access_width({alignment_bits});
  const int64_t block_units = block_size * num_kv_heads * head_dim * static_cast<int64_t>(elem) / width;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  for (int64_t first_layer = 0; first_layer < num_layers; first_layer += kMaxLayersPerLaunch) {
    const int64_t launch_layers = std::min<int64_t>(kMaxLayersPerLaunch, num_layers - first_layer);
    CopyBlocksParams params{};
    for (int64_t i = 0; i < launch_layers; ++i) {
      params.key[i] = paged_cache_of<char>(as_paged_cache(key_caches[first_layer + i]));  // counts in bytes
      if (caches_per_layer == 2) params.value[i] = paged_cache_of<char>(value_caches[first_layer + i]);
    }
    params.block_mapping = mapping.data_ptr<int64_t>();
    const CopyPlan plan = plan_copy_blocks(num_pairs, launch_layers, block_units, caches_per_layer);
    TORCH_CHECK(plan.error.empty(), "copy_blocks: this call cannot be launched on CUDA: ", plan.error);
    dispatch_width(width, [&](auto unit) {
      using Unit = decltype(unit);
      C10_CUDA_CHECK(launch_copy_blocks<Unit>(params, plan, stream));
    });
  }
}

// ---------------------------------------------------------------------------------------------------------------
// swap_blocks: copy engine transfers, one per run of consecutive block ids.

// Makes `waiter` wait for the work queued so far on `stream`; the two may be on different devices.
void wait_for(const c10::cuda::CUDAStream& stream, const c10::cuda::CUDAStream& waiter) {
  cudaEvent_t event = nullptr;
  {
    const c10::cuda::CUDAGuard guard(stream.device_index());
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  }
  const auto destroy = [](cudaEvent_t* e) { C10_CUDA_IGNORE_ERROR(cudaEventDestroy(*e)); };  // freed once complete
  const std::unique_ptr<cudaEvent_t, decltype(destroy)> owner(&event, destroy);
  {
    const c10::cuda::CUDAGuard guard(stream.device_index());
    C10_CUDA_CHECK(cudaEventRecord(event, stream));
  }
  C10_CUDA_CHECK(cudaStreamWaitEvent(waiter, event, 0));
}
struct BlockRun {
  int64_t src, dst, count;
};

// Sorts the pairs by source block and merges runs where both ids advance by one.
std::vector<BlockRun> block_runs(const at::Tensor& block_mapping_cpu) {  // [num_pairs, 2]
  const auto mapping = block_mapping_cpu.contiguous();
  const int64_t* pairs = mapping.data_ptr<int64_t>();
  std::vector<std::pair<int64_t, int64_t>> sorted(mapping.size(0));
  for (size_t i = 0; i < sorted.size(); ++i) sorted[i] = {pairs[2 * i], pairs[2 * i + 1]};
  std::sort(sorted.begin(), sorted.end());
  std::vector<BlockRun> runs;
  for (const auto& [src, dst] : sorted) {
    if (!runs.empty() && runs.back().src + runs.back().count == src && runs.back().dst + runs.back().count == dst) {
      ++runs.back().count;
    } else {
      runs.push_back({src, dst, 1});
    }
  }
  return runs;
}

void swap_blocks_cuda(const at::Tensor& src,             // [num_src_blocks, ...block shape]
                      at::Tensor& dst,                   // [num_dst_blocks, ...block shape]
                      const at::Tensor& block_mapping) {  // [num_pairs, 2] of (src_block, dst_block), int64, CPU
  check_swap_blocks_args(src, dst, block_mapping);  // block shapes without a zero size
  check_block_mapping_range(block_mapping, src.size(0), dst.size(0), /*same_cache=*/same_memory(src, dst));
  if (block_mapping.size(0) == 0) return;
  // The copies run on the current stream of the source's device (or of dst's, when src is on the CPU).
  const c10::cuda::CUDAGuard guard(src.is_cuda() ? src.device() : dst.device());
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream();
  // NOTE: between two GPUs, dst's device has a current stream of its own: the copies must wait for the work queued
  // there (it may still use dst), and that stream's later work must wait for the copies. Events order both ways.
  const bool peer = src.is_cuda() && dst.is_cuda() && src.device() != dst.device();
  const c10::cuda::CUDAStream dst_stream = peer ? c10::cuda::getCurrentCUDAStream(dst.device().index()) : stream;
  if (peer) wait_for(dst_stream, stream);
  const size_t elem = src.element_size();
  const size_t block_bytes = block_span_bytes(src);  // a strided block: its whole span (check_swap_blocks_args)
  const size_t src_pitch = src.stride(0) * elem, dst_pitch = dst.stride(0) * elem;
  const auto* src_ptr = static_cast<const char*>(src.data_ptr());
  auto* dst_ptr = static_cast<char*>(dst.data_ptr());
  for (const BlockRun& run : block_runs(block_mapping)) {
    // cudaMemcpyDefault: the direction (H2D, D2H, D2D, peer) follows from the pointers (unified addressing).
    char* to = dst_ptr + run.dst * dst_pitch;
    const char* from = src_ptr + run.src * src_pitch;
    if (run.count == 1) {
      C10_CUDA_CHECK(cudaMemcpyAsync(to, from, block_bytes, cudaMemcpyDefault, stream));
    } else {
      C10_CUDA_CHECK(cudaMemcpy2DAsync(to, dst_pitch, from, src_pitch, block_bytes, run.count, cudaMemcpyDefault,
                                       stream));
    }
  }
  if (peer) wait_for(stream, dst_stream);
}

// concat_and_cache_mla: one launch; the rows copied in the widest Unit that divides every address, stride and
// width, or quantized into an fp8 cache (one thread per element), as the CPU writes them (the same bytes).
void concat_and_cache_mla_cuda(const at::Tensor& kv_c,          // [num_tokens, kv_lora_rank], last dim contiguous
                               const at::Tensor& k_pe,          // [num_tokens, rope_dim], last dim contiguous
                               at::Tensor& kv_cache,            // [num_blocks, block_size, kv_lora_rank + rope_dim]
                               const at::Tensor& slot_mapping,  // [num_tokens], int64, < 0 = padding
                               const std::optional<at::Tensor>& scale) {  // [1], float32 (fp8 caches only)
  check_concat_and_cache_mla_args(kv_c, k_pe, kv_cache, slot_mapping, scale);
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  const int64_t num_tokens = kv_c.size(0), rank = kv_c.size(1), rope_dim = k_pe.size(1);
  if (validation_enabled()) {
    check_slot_range(slot_mapping.cpu(), kv_cache.size(0) * kv_cache.size(1));
    check_scale_value(scale, "scale");
  }
  if (num_tokens == 0) return;
  const auto slots = slot_mapping.contiguous();
  const at::Tensor cache = kv_cache.unsqueeze(2);  // [num_blocks, block_size, 1, kv_lora_rank + rope_dim]
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (is_fp8(kv_cache.scalar_type())) {
    const CopyPlan plan = plan_reshape_and_cache(num_tokens, 1, rank + rope_dim);
    TORCH_CHECK(plan.error.empty(), "concat_and_cache_mla: this call cannot be launched on CUDA: ", plan.error);
    const auto run = [&](auto dtype_tag) {
      using T = decltype(dtype_tag);
      const ConcatAndCacheMlaFp8Params<T> params{
          static_cast<const T*>(kv_c.data_ptr()), static_cast<const T*>(k_pe.data_ptr()), kv_c.stride(0),
          k_pe.stride(0), static_cast<int>(rank), static_cast<int>(rope_dim),
          paged_cache_of<__nv_fp8_storage_t>(cache), slots.data_ptr<int64_t>(),
          scale.has_value() ? scale->data_ptr<float>() : nullptr,
          kv_cache.scalar_type() == at::kFloat8_e5m2 ? __NV_E5M2 : __NV_E4M3};
      C10_CUDA_CHECK(launch_concat_and_cache_mla_fp8(params, plan, stream));
    };
    switch (kv_c.scalar_type()) {  // check_concat_and_cache_mla_args allows exactly these
      case at::kFloat: return run(float{});
      case at::kHalf: return run(__half{});
      case at::kBFloat16: return run(__nv_bfloat16{});
      default: TORCH_CHECK(false, "concat_and_cache_mla: unsupported dtype ", kv_c.scalar_type());
    }
  }
  const uint64_t elem = kv_c.element_size();
  const int64_t width = access_width({rank * elem, rope_dim * elem, kv_c.stride(0) * elem, k_pe.stride(0) * elem,
                                      kv_cache.stride(0) * elem, kv_cache.stride(1) * elem, address_of(kv_c),
                                      address_of(k_pe), address_of(kv_cache)});
  const int64_t per_unit = width / static_cast<int64_t>(elem);  // every value above is a multiple of elem
  const CopyPlan plan = plan_reshape_and_cache(num_tokens, 1, (rank + rope_dim) / per_unit);
  TORCH_CHECK(plan.error.empty(), "concat_and_cache_mla: this call cannot be launched on CUDA: ", plan.error);
  dispatch_width(width, [&](auto unit) {
    using Unit = decltype(unit);
    const ConcatAndCacheMlaParams<Unit> params{static_cast<const Unit*>(kv_c.data_ptr()),
                                               static_cast<const Unit*>(k_pe.data_ptr()),
                                               kv_c.stride(0) / per_unit,
                                               k_pe.stride(0) / per_unit,
                                               static_cast<int>(rank / per_unit),
                                               static_cast<int>(rope_dim / per_unit),
                                               paged_cache_of<Unit>(cache),
                                               slots.data_ptr<int64_t>()};
    C10_CUDA_CHECK(launch_concat_and_cache_mla(params, plan, stream));
  });
}

}  // namespace
}  // namespace paged_attn

TORCH_LIBRARY_IMPL(paged_attn, CUDA, m) {
  m.impl("concat_and_cache_mla", &paged_attn::concat_and_cache_mla_cuda);
  m.impl("reshape_and_cache", &paged_attn::reshape_and_cache_cuda);
  m.impl("copy_blocks", &paged_attn::copy_blocks_cuda);
  m.impl("swap_blocks", &paged_attn::swap_blocks_cuda);
}
