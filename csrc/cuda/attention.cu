// paged_attention on CUDA: the torch-facing launcher. It checks the arguments, plans the launch (plan_attention in
// launch_plan.h: single pass or split-KV, grid, kernel variant), allocates the split-KV scratch, fills
// AttentionParams and launches on the current stream. The algorithm and the kernels are in attention_kernels.cuh;
// their instantiations, one file per dtype, in attention_{float,half,bf16}.cu.
//
// Compile-time choices: the dtype, head_dim (AttentionHeadDims) and the group variant (AttentionGroupVariants)
// select the kernel instantiation. No host-device synchronization (unless index validation is on): the plan comes
// from the block table's width, not from seq_lens, so the op can be captured in a CUDA graph.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>

#include "../common.h"
#include "attention_launch.cuh"

namespace paged_attn {
namespace {

int multiprocessor_count(int device) {  // cached: the attribute query costs microseconds
  static std::atomic<int> counts[64] = {};
  std::atomic<int>& cached = counts[device % 64];
  int count = cached.load(std::memory_order_relaxed);
  if (count == 0 || device >= 64) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
    if (device < 64) cached.store(count, std::memory_order_relaxed);
  }
  return count;
}

template <typename T>
void launch(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
            const std::optional<at::Tensor>& alibi_slopes, double logits_soft_cap, const AttentionPlan& plan) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  at::Tensor partial_out, partial_max, partial_sum;
  if (plan.split()) {
    const auto options = query.options().dtype(at::kFloat);
    partial_out = at::empty({num_seqs, num_heads, plan.num_partitions, head_dim}, options);
    partial_max = at::empty({num_seqs, num_heads, plan.num_partitions}, options);
    partial_sum = at::empty({num_seqs, num_heads, plan.num_partitions}, options);
  }
  const auto cache = [](const at::Tensor& t) {  // check_cache: the last three dims are contiguous
    return PagedCache<const T>{static_cast<const T*>(t.data_ptr()), t.stride(0), static_cast<int>(t.size(1)),
                               static_cast<int>(t.size(2)), static_cast<int>(t.size(3))};
  };
  AttentionParams<T> params{};
  params.out = static_cast<T*>(out.data_ptr());
  params.partial_out = plan.split() ? partial_out.data_ptr<float>() : nullptr;
  params.partial_max = plan.split() ? partial_max.data_ptr<float>() : nullptr;
  params.partial_sum = plan.split() ? partial_sum.data_ptr<float>() : nullptr;
  params.query = static_cast<const T*>(query.data_ptr());
  params.query_seq_stride = query.stride(0), params.query_head_stride = query.stride(1);
  params.key_cache = cache(key_cache), params.value_cache = cache(value_cache);
  params.block_tables = block_tables.data_ptr<int32_t>();
  params.seq_lens = seq_lens.data_ptr<int32_t>();
  params.alibi_slopes = alibi_slopes.has_value() ? alibi_slopes->data_ptr<float>() : nullptr;
  params.num_heads = static_cast<int>(num_heads);
  params.max_blocks_per_seq = block_tables.size(1);
  params.scale = static_cast<float>(scale);
  params.soft_cap = static_cast<float>(logits_soft_cap);
  params.set_plan(plan);
  C10_CUDA_CHECK(launch_paged_attention(params, plan, c10::cuda::getCurrentCUDAStream()));
}

void paged_attention_cuda(at::Tensor& out,                  // [num_seqs, num_heads, head_dim]
                          const at::Tensor& query,          // [num_seqs, num_heads, head_dim]
                          const at::Tensor& key_cache,      // [num_blocks, block_size, num_kv_heads, head_dim]
                          const at::Tensor& value_cache,    // [num_blocks, block_size, num_kv_heads, head_dim]
                          const at::Tensor& block_tables,   // [num_seqs, max_blocks_per_seq], int32
                          const at::Tensor& seq_lens,       // [num_seqs], int32
                          double scale, const std::optional<at::Tensor>& alibi_slopes, int64_t sliding_window,
                          double logits_soft_cap,
                          const std::optional<at::Tensor>& query_start_loc,  // [num_seqs + 1], int32, or none
                          std::optional<int64_t> max_query_len) {
  check_paged_attention_args(out, query, key_cache, value_cache, block_tables, seq_lens, scale, alibi_slopes,
                             sliding_window, logits_soft_cap, query_start_loc, max_query_len);
  TORCH_CHECK(query.is_cuda(), "paged_attention: expected CUDA tensors, got ", query.device());
  TORCH_CHECK(!query_start_loc.has_value(), "paged_attention: query_start_loc is not supported on CUDA yet");
  TORCH_CHECK(has_packed_rows(key_cache) && has_packed_rows(value_cache),
              "paged_attention: caches with strided rows are not supported on CUDA yet");
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(block_size == 8 || block_size == 16 || block_size == 32, "paged_attention: block_size ", block_size,
              " is not supported on CUDA (supported: 8, 16, 32)");
  TORCH_CHECK(contains(AttentionHeadDims{}, head_dim), "paged_attention: head_dim ", head_dim,
              " is not supported on CUDA (supported: ", to_string(AttentionHeadDims{}), ")");
  const uint64_t elem = key_cache.element_size();
  TORCH_CHECK(access_width({address_of(key_cache), address_of(value_cache), key_cache.stride(0) * elem,
                            value_cache.stride(0) * elem}) == 16,
              "paged_attention: the caches and their block strides must be 16-byte aligned on CUDA");
  const c10::cuda::CUDAGuard guard(query.device());
  if (validation_enabled()) check_block_table_range(block_tables.cpu(), seq_lens.cpu(), key_cache.size(0), block_size);
  if (num_seqs == 0) return;
  const int64_t num_sms = multiprocessor_count(query.get_device());
  const AttentionPlan plan = plan_attention(num_seqs, num_heads, num_kv_heads, block_tables.size(1), block_size,
                                            sliding_window, num_sms);
  TORCH_CHECK(plan.error.empty(), "paged_attention: this call cannot be launched on CUDA: ", plan.error);

  const at::Tensor block_tables_c = block_tables.contiguous(), seq_lens_c = seq_lens.contiguous();
  const std::optional<at::Tensor> alibi_c =
      alibi_slopes.has_value() ? std::optional<at::Tensor>(alibi_slopes->contiguous()) : std::nullopt;
  const auto run = [&](auto dtype_tag) {
    launch<decltype(dtype_tag)>(out, query, key_cache, value_cache, block_tables_c, seq_lens_c, scale, alibi_c,
                                logits_soft_cap, plan);
  };
  switch (query.scalar_type()) {  // check_paged_attention_args allows exactly these
    case at::kFloat: return run(float{});
    case at::kHalf: return run(__half{});
    case at::kBFloat16: return run(__nv_bfloat16{});
    default:
      TORCH_CHECK(false, "paged_attention: unsupported dtype ", query.scalar_type());
  }
}

}  // namespace
}  // namespace paged_attn

TORCH_LIBRARY_IMPL(paged_attn, CUDA, m) { m.impl("paged_attention", &paged_attn::paged_attention_cuda); }
