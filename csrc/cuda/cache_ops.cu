// CUDA kernels of the cache ops.
//
// These ops only move data, so the kernels are dtype-agnostic: they copy `Unit`s, the widest access (16, 8, 4,
// 2 or 1 bytes) that divides every address, stride and row length involved (see access_width in common.h).
// With the usual head dims that is a 16-byte vector access per thread.
//
//   reshape_and_cache  grid (num_tokens): one thread block writes one token's [num_kv_heads, head_dim] rows.
//   copy_blocks        grid (num_pairs, num_layers, 2): one thread block copies one block of one layer's key
//                      (z = 0) or value (z = 1) cache. All layers and pairs in one launch: the layers' base
//                      pointers travel as a kernel parameter (no pointer table to upload, CUDA-graph friendly).
//   swap_blocks        no kernel: runs of consecutive (src, dst) block ids become one cudaMemcpy2DAsync each
//                      (pitch = block stride), on the current stream; asynchronous when the CPU side is pinned.
//
// Index validation synchronizes, so it is opt-in (PAGED_ATTN_VALIDATE=1 / paged_attn.set_validation(True));
// swap_blocks' mapping lives on the CPU and is always checked.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../common.h"

namespace paged_attn {
namespace {

constexpr int kMaxThreads = 512;

int threads_for(int64_t units) {
  return static_cast<int>(std::min<int64_t>(kMaxThreads, (units + 31) / 32 * 32));
}

// Calls f(Unit{}) with the integer type of `width` bytes (uint4 for 16).
template <typename F>
void dispatch_width(int64_t width, F&& f) {
  switch (width) {
    case 16: f(uint4{}); break;
    case 8: f(uint2{}); break;
    case 4: f(uint32_t{}); break;
    case 2: f(uint16_t{}); break;
    case 1: f(uint8_t{}); break;
    default: TORCH_CHECK(false, "internal error: unsupported access width ", width);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// reshape_and_cache: every stride is in Units.
template <typename Unit>
__global__ void reshape_and_cache_kernel(
    const Unit* __restrict__ key,              // [num_tokens, num_kv_heads, head_dim]
    const Unit* __restrict__ value,            // [num_tokens, num_kv_heads, head_dim]
    Unit* __restrict__ key_cache,              // [num_blocks, block_size, num_kv_heads, head_dim]
    Unit* __restrict__ value_cache,            // [num_blocks, block_size, num_kv_heads, head_dim]
    const int64_t* __restrict__ slot_mapping,  // [num_tokens]
    int64_t key_token_stride, int64_t key_head_stride, int64_t value_token_stride, int64_t value_head_stride,
    int64_t key_block_stride, int64_t value_block_stride, int block_size, int num_kv_heads, int head_units) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;  // NOTE: padding token, nothing to write
  // NOTE: 64-bit block offsets: num_blocks * block_stride can exceed 2^31 units.
  const int64_t block = slot / block_size, offset = slot % block_size;
  Unit* key_dst = key_cache + block * key_block_stride + offset * num_kv_heads * head_units;
  Unit* value_dst = value_cache + block * value_block_stride + offset * num_kv_heads * head_units;
  const Unit* key_src = key + token * key_token_stride;
  const Unit* value_src = value + token * value_token_stride;
  for (int i = threadIdx.x; i < num_kv_heads * head_units; i += blockDim.x) {
    const int head = i / head_units, u = i % head_units;
    key_dst[i] = key_src[head * key_head_stride + u];
    value_dst[i] = value_src[head * value_head_stride + u];
  }
}

void reshape_and_cache_cuda(const at::Tensor& key,          // [num_tokens, num_kv_heads, head_dim]
                            const at::Tensor& value,        // [num_tokens, num_kv_heads, head_dim]
                            at::Tensor& key_cache,          // [num_blocks, block_size, num_kv_heads, head_dim]
                            at::Tensor& value_cache,        // [num_blocks, block_size, num_kv_heads, head_dim]
                            const at::Tensor& slot_mapping) {  // [num_tokens], int64, < 0 = padding
  check_reshape_and_cache_args(key, value, key_cache, value_cache, slot_mapping);
  const c10::cuda::CUDAGuard guard(key_cache.device());
  const int64_t num_tokens = key.size(0), block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2), head_dim = key_cache.size(3);
  if (validation_enabled()) check_slot_range(slot_mapping.cpu(), key_cache.size(0) * block_size);
  if (num_tokens == 0 || num_kv_heads * head_dim == 0) return;

  const uint64_t elem = key.element_size();
  const int64_t width = access_width({head_dim * elem, key.stride(0) * elem, key.stride(1) * elem,
                                      value.stride(0) * elem, value.stride(1) * elem, key_cache.stride(0) * elem,
                                      value_cache.stride(0) * elem, address_of(key), address_of(value),
                                      address_of(key_cache), address_of(value_cache)});
  // Every value above is a multiple of the element size, so a Unit holds a whole number of elements.
  const int64_t per_unit = width / static_cast<int64_t>(elem);
  auto to_units = [per_unit](int64_t elements) { return elements / per_unit; };
  const int head_units = static_cast<int>(to_units(head_dim));
  const auto slots = slot_mapping.contiguous();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  dispatch_width(width, [&](auto unit) {
    using Unit = decltype(unit);
    reshape_and_cache_kernel<Unit><<<num_tokens, threads_for(num_kv_heads * head_units), 0, stream>>>(
        static_cast<const Unit*>(key.data_ptr()), static_cast<const Unit*>(value.data_ptr()),
        static_cast<Unit*>(key_cache.data_ptr()), static_cast<Unit*>(value_cache.data_ptr()),
        slots.data_ptr<int64_t>(), to_units(key.stride(0)), to_units(key.stride(1)), to_units(value.stride(0)),
        to_units(value.stride(1)), to_units(key_cache.stride(0)), to_units(value_cache.stride(0)),
        static_cast<int>(block_size), static_cast<int>(num_kv_heads), head_units);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// ---------------------------------------------------------------------------------------------------------------
// copy_blocks: the layers' caches, passed by value as a kernel parameter. Block strides are in bytes.
constexpr int kMaxLayersPerLaunch = 128;  // 4 KiB of parameters; deeper models take one launch per 128 layers

struct LayerCaches {
  char* key[kMaxLayersPerLaunch];
  char* value[kMaxLayersPerLaunch];
  int64_t key_block_stride[kMaxLayersPerLaunch];
  int64_t value_block_stride[kMaxLayersPerLaunch];
};

template <typename Unit>
__global__ void copy_blocks_kernel(const LayerCaches layers,
                                   const int64_t* __restrict__ block_mapping,  // [num_pairs, 2]
                                   int64_t block_units) {  // Units per block: block_size * num_kv_heads * head_dim
  const int64_t pair = blockIdx.x;
  const int layer = blockIdx.y;
  const bool is_value = blockIdx.z == 1;
  char* base = is_value ? layers.value[layer] : layers.key[layer];
  const int64_t block_stride = is_value ? layers.value_block_stride[layer] : layers.key_block_stride[layer];
  const Unit* src = reinterpret_cast<const Unit*>(base + block_mapping[2 * pair] * block_stride);
  Unit* dst = reinterpret_cast<Unit*>(base + block_mapping[2 * pair + 1] * block_stride);
  for (int64_t i = threadIdx.x; i < block_units; i += blockDim.x) dst[i] = src[i];
}

void copy_blocks_cuda(at::TensorList key_caches,     // num_layers x [num_blocks, block_size, num_kv_heads, head_dim]
                      at::TensorList value_caches,   // num_layers x [num_blocks, block_size, num_kv_heads, head_dim]
                      const at::Tensor& block_mapping) {  // [num_pairs, 2] of (src_block, dst_block), int64
  check_copy_blocks_args(key_caches, value_caches, block_mapping);
  const int64_t num_layers = static_cast<int64_t>(key_caches.size());
  if (num_layers == 0 || block_mapping.size(0) == 0) return;
  const at::Tensor& first = key_caches[0];
  TORCH_CHECK(first.is_cuda(), "copy_blocks: the caches must be CUDA tensors here, got ", first.device());
  const c10::cuda::CUDAGuard guard(first.device());
  if (validation_enabled()) {
    check_block_mapping_range(block_mapping.cpu(), first.size(0), first.size(0), /*same_cache=*/true);
  }
  // A CPU mapping is staged through pinned memory, so the upload does not block the host.
  const at::Tensor mapping = block_mapping.is_cuda()
                                 ? block_mapping.contiguous()
                                 : block_mapping.contiguous().pin_memory().to(first.device(), /*non_blocking=*/true);

  const int64_t num_pairs = block_mapping.size(0);
  const uint64_t elem = first.element_size();
  const uint64_t block_bytes = first.size(1) * first.size(2) * first.size(3) * elem;
  uint64_t alignment_bits = block_bytes;
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    alignment_bits |= address_of(key_caches[layer]) | address_of(value_caches[layer]) |
                      key_caches[layer].stride(0) * elem | value_caches[layer].stride(0) * elem;
  }
  const int64_t width = access_width({alignment_bits});
  const int64_t block_units = block_bytes / width;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  for (int64_t first_layer = 0; first_layer < num_layers; first_layer += kMaxLayersPerLaunch) {
    const int64_t launch_layers = std::min<int64_t>(kMaxLayersPerLaunch, num_layers - first_layer);
    LayerCaches layers{};
    for (int64_t i = 0; i < launch_layers; ++i) {
      const at::Tensor& key_cache = key_caches[first_layer + i];
      const at::Tensor& value_cache = value_caches[first_layer + i];
      layers.key[i] = static_cast<char*>(key_cache.data_ptr());
      layers.value[i] = static_cast<char*>(value_cache.data_ptr());
      layers.key_block_stride[i] = key_cache.stride(0) * elem;
      layers.value_block_stride[i] = value_cache.stride(0) * elem;
    }
    const dim3 grid(num_pairs, launch_layers, 2);
    dispatch_width(width, [&](auto unit) {
      using Unit = decltype(unit);
      copy_blocks_kernel<Unit><<<grid, threads_for(block_units), 0, stream>>>(layers, mapping.data_ptr<int64_t>(),
                                                                               block_units);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
}

// ---------------------------------------------------------------------------------------------------------------
// swap_blocks: copy engine transfers, one per run of consecutive block ids.
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
  check_swap_blocks_args(src, dst, block_mapping);
  check_block_mapping_range(block_mapping, src.size(0), dst.size(0), /*same_cache=*/same_memory(src, dst));
  if (block_mapping.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(src.is_cuda() ? src.device() : dst.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const size_t elem = src.element_size();
  const size_t block_bytes = src.numel() / src.size(0) * elem;
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
}

}  // namespace
}  // namespace paged_attn

TORCH_LIBRARY_IMPL(paged_attn, CUDA, m) {
  m.impl("reshape_and_cache", &paged_attn::reshape_and_cache_cuda);
  m.impl("copy_blocks", &paged_attn::copy_blocks_cuda);
  m.impl("swap_blocks", &paged_attn::swap_blocks_cuda);
}
