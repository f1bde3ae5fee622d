// paged_attention on CUDA: the torch-facing launcher (plain C++: the kernels are launched through attention_launch.h,
// by the torch-free files of instantiations/). It checks the arguments, plans the launches (launch_plan.h),
// allocates the split-KV scratch, fills AttentionParams and launches on the current stream. The decode plan takes the
// SM count and the resident blocks per SM of the kernel instantiation it launches (both cached per device).
//
//   decode (no query_start_loc): the decode kernels (single pass or split-KV), one item per sequence: on tensor
//       cores (decode_mma_kernels.cuh) for float16/bfloat16 over caches of the same dtype at the head dims of
//       DecodeMmaHeadDims (compute capability 8.0+), else attention_kernels.cuh.
//   query_start_loc, float16/bfloat16 queries (caches of the same dtype or fp8), a head dim of VarlenHeadDims,
//       compute capability 8.0+: the decode kernels for the sequences with one query row (rows = kSingleTokenSeqs)
//       and the tensor-core kernel (varlen_attention_kernels.cuh) for those with more (not launched when
//       max_query_len <= 1).
//   query_start_loc otherwise (float32, other head dims): the decode kernels for every query row (kEveryRow).
// shared_plan (a shared-blocks plan of paged_attn.plan_shared_blocks, on the device): decode on tensor cores takes
//   split-KV and one more thread block per task (shared_blocks.cuh); the other paths do not read it.
// fp8 caches (float8_e4m3fn, float8_e5m2): float32, float16 and bfloat16 queries, head dims of
// Fp8AttentionHeadDims; the scales stay on the device (read by the kernels), so the op stays capturable.
//
// Compile-time choices: the dtype, head_dim (AttentionHeadDims, VarlenHeadDims) and the group variant
// (AttentionGroupVariants) select the kernel instantiations. No host-device synchronization (unless index
// validation is on): the plans come from the tensors' shapes (the block table's width, num_tokens, num_seqs), never
// from seq_lens or query_start_loc, so the op can be captured in a CUDA graph.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "../common.h"
#include "attention_launch.h"
#include "copy_plan.h"  // access_width
#include "mla_launch.h"
#include "paged_cache_host.h"

namespace paged_attn {
namespace {

// A device attribute, cached per device (the query costs microseconds).
template <cudaDeviceAttr kAttribute>
int device_attribute(int device) {
  static std::atomic<int> values[64] = {};
  std::atomic<int>& cached = values[device % 64];
  int value = cached.load(std::memory_order_relaxed);
  if (value == 0 || device >= 64) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, kAttribute, device));
    if (device < 64) cached.store(value, std::memory_order_relaxed);
  }
  return value;
}

int multiprocessor_count(int device) { return device_attribute<cudaDevAttrMultiProcessorCount>(device); }

// Whether the GPU runs the tensor-core kernels (mma.sync on bfloat16 and cp.async need compute capability 8.0).
bool has_tensor_cores(int device) { return device_attribute<cudaDevAttrComputeCapabilityMajor>(device) >= 8; }

// The arguments every launch shares (the plans set the rest).
template <typename T, typename C>
AttentionParams<T, C> attention_params(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                                       const at::Tensor& value_cache, const at::Tensor& block_tables,
                                       const at::Tensor& seq_lens, const std::optional<at::Tensor>& query_start_loc,
                                       double scale, const std::optional<at::Tensor>& alibi_slopes,
                                       double logits_soft_cap, const std::optional<at::Tensor>& k_scale,
                                       const std::optional<at::Tensor>& v_scale, const at::Tensor& sinks_f32,
                                       const std::optional<at::Tensor>& lse) {
  AttentionParams<T, C> params{};
  params.out = static_cast<T*>(out.data_ptr());
  params.query = static_cast<const T*>(query.data_ptr());
  params.query_row_stride = query.stride(0), params.query_head_stride = query.stride(1);
  // 16-byte aligned rows (checked by the caller)
  params.key_cache = paged_cache_of<const C>(key_cache), params.value_cache = paged_cache_of<const C>(value_cache);
  params.block_tables = block_tables.data_ptr<int32_t>();
  params.seq_lens = seq_lens.data_ptr<int32_t>();
  params.query_start_loc = query_start_loc.has_value() ? query_start_loc->data_ptr<int32_t>() : nullptr;
  params.alibi_slopes = alibi_slopes.has_value() ? alibi_slopes->data_ptr<float>() : nullptr;
  params.sinks = sinks_f32.defined() ? sinks_f32.data_ptr<float>() : nullptr;
  params.lse = lse.has_value() ? lse->data_ptr<float>() : nullptr;  // contiguous (checked)
  params.num_seqs = static_cast<int>(block_tables.size(0)), params.num_tokens = static_cast<int>(query.size(0));
  params.num_heads = static_cast<int>(query.size(1));
  params.max_blocks_per_seq = block_tables.size(1);
  params.scale = static_cast<float>(scale);
  params.logits_soft_cap = static_cast<float>(logits_soft_cap);
  params.k_scale = k_scale.has_value() ? k_scale->data_ptr<float>() : nullptr;
  params.v_scale = v_scale.has_value() ? v_scale->data_ptr<float>() : nullptr;
  params.fp8_format = key_cache.scalar_type() == at::kFloat8_e5m2 ? __NV_E5M2 : __NV_E4M3;
  return params;
}

// With index validation on (PAGED_ATTN_VALIDATE=1; it synchronizes): query_start_loc and the block tables checked
// against seq_lens on the host, as the CPU kernels check them.
void validate_indices(const at::Tensor& block_tables, const at::Tensor& seq_lens,
                      const std::optional<at::Tensor>& query_start_loc, std::optional<int64_t> max_query_len,
                      int64_t num_tokens, int64_t num_blocks, int64_t block_size, int64_t sliding_window) {
  const at::Tensor seq_lens_cpu = seq_lens.cpu();
  const std::optional<at::Tensor> query_start_loc_cpu =
      query_start_loc.has_value() ? std::optional<at::Tensor>(query_start_loc->cpu()) : std::nullopt;
  if (query_start_loc_cpu.has_value()) {
    check_query_start_loc_range(*query_start_loc_cpu, seq_lens_cpu, num_tokens, max_query_len);
  }
  check_block_table_range(block_tables.cpu(), seq_lens_cpu, num_blocks, block_size, query_start_loc_cpu,
                          sliding_window);
}

// The split-KV scratch of a plan (nothing in single pass): float32 [num_items, num_heads, num_partitions] records
// and their [.., width] outputs, pointed to by params; they live as long as the returned holder (the caching
// allocator frees them in stream order, after the launches enqueued before it goes).
struct SplitScratch {
  at::Tensor out, max, sum;
};
template <typename T, typename C>
SplitScratch split_scratch(AttentionParams<T, C>& params, const AttentionPlan& plan, int64_t num_items,
                           int64_t num_heads, int64_t width, const at::Tensor& like) {
  SplitScratch scratch;
  if (!plan.split()) return scratch;
  const auto options = like.options().dtype(at::kFloat);
  scratch.out = at::empty({num_items, num_heads, plan.num_partitions, width}, options);
  scratch.max = at::empty({num_items, num_heads, plan.num_partitions}, options);
  scratch.sum = at::empty({num_items, num_heads, plan.num_partitions}, options);
  params.partial_out = scratch.out.data_ptr<float>();
  params.partial_max = scratch.max.data_ptr<float>();
  params.partial_sum = scratch.sum.data_ptr<float>();
  return scratch;
}

// The decode kernels over num_items items (see QueryRows in attention_params.cuh): decode_mma_kernel where
// decode_on_tensor_cores says so, else paged_attention_kernel.
// shared_plan: a shared-blocks plan, taken by decode (kLastOfEachSeq) on tensor cores; not read otherwise.
template <typename T, typename C>
void launch_decode(AttentionParams<T, C> params, QueryRows rows, int64_t num_items, int64_t sliding_window,
                   const at::Tensor& query, int64_t block_size, int64_t num_kv_heads,
                   const std::optional<at::Tensor>& shared_plan = std::nullopt) {
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int device = query.get_device();
  // The plan fills the SMs' waves with the instantiation it launches: its resident blocks per SM.
  const bool tensor_cores = decode_on_tensor_cores(head_dim, sizeof(C), std::is_same_v<C, Fp8>,
                                                   has_tensor_cores(device), params.key_cache.token_stride,
                                                   params.value_cache.token_stride);
  int blocks_per_sm = 0;
  C10_CUDA_CHECK(paged_attention_blocks_per_sm(params, attention_group_variant(num_heads, num_kv_heads),
                                               tensor_cores, device, &blocks_per_sm));
  TORCH_CHECK(blocks_per_sm >= 1, "paged_attention: the decode kernel for head_dim ", head_dim, " and ",
              num_heads / num_kv_heads, " query heads per kv head does not fit on an SM of this GPU");
  const bool sharing = shared_plan.has_value() && tensor_cores && rows == QueryRows::kLastOfEachSeq;
  AttentionPlan plan = plan_attention(num_items, num_heads, num_kv_heads, params.max_blocks_per_seq, block_size,
                                      sliding_window, multiprocessor_count(device), blocks_per_sm, kPartitionSize,
                                      sharing ? shared_plan->size(0) : 0, batch_invariant_enabled());
  TORCH_CHECK(plan.error.empty(), "paged_attention: this call cannot be launched on CUDA: ", plan.error);
  if (tensor_cores) use_tensor_cores(plan, head_dim);
  const SplitScratch scratch = split_scratch(params, plan, num_items, num_heads, head_dim, query);
  if (plan.num_shared_tasks > 0) {
    params.shared_plan = shared_plan->data_ptr<int32_t>();  // contiguous (checked)
    params.num_shared_tasks = plan.num_shared_tasks;
  }
  params.rows = rows;
  params.set_plan(plan);
  C10_CUDA_CHECK(launch_paged_attention(params, plan, c10::cuda::getCurrentCUDAStream()));
}

void paged_attention_cuda(at::Tensor& out,                  // [num_tokens, num_heads, head_dim]
                          const at::Tensor& query,          // [num_tokens, num_heads, head_dim]
                          const at::Tensor& key_cache,      // [num_blocks, block_size, num_kv_heads, head_dim]
                          const at::Tensor& value_cache,    // [num_blocks, block_size, num_kv_heads, head_dim]
                          const at::Tensor& block_tables,   // [num_seqs, max_blocks_per_seq], int32
                          const at::Tensor& seq_lens,       // [num_seqs], int32
                          double scale, const std::optional<at::Tensor>& alibi_slopes, int64_t sliding_window,
                          double logits_soft_cap,
                          const std::optional<at::Tensor>& query_start_loc,  // [num_seqs + 1], int32, or none
                          std::optional<int64_t> max_query_len,
                          const std::optional<at::Tensor>& k_scale,    // [1], float32 (fp8 caches only)
                          const std::optional<at::Tensor>& v_scale,  // [1], float32 (fp8 caches only)
                          const std::optional<at::Tensor>& lse,      // [num_tokens, num_heads], float32, or none
                          const std::optional<at::Tensor>& sinks,  // [num_heads], float32/16, bfloat16, or none
                          // [num_tasks, kSharedPlanColumns], int32, or none: shared blocks (shared_blocks.cuh)
                          const std::optional<at::Tensor>& shared_plan) {
  check_paged_attention_args(out, query, key_cache, value_cache, block_tables, seq_lens, scale, alibi_slopes,
                             sliding_window, logits_soft_cap, query_start_loc, max_query_len, k_scale, v_scale, lse,
                             sinks, shared_plan);
  const bool fp8 = is_fp8(key_cache.scalar_type());
  TORCH_CHECK(query.is_cuda(), "paged_attention: expected CUDA tensors, got ", query.device());
  TORCH_CHECK(value_cache.size(3) == key_cache.size(3), "paged_attention: values of another width than the keys ",
              "(head_dim_v ", value_cache.size(3), ", head_dim ", key_cache.size(3), ") are not on CUDA yet: CPU only");
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_seqs = block_tables.size(0);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(block_size == 8 || block_size == 16 || block_size == 32, "paged_attention: block_size ", block_size,
              " is not supported on CUDA (supported: 8, 16, 32)");
  TORCH_CHECK(contains(AttentionHeadDims{}, head_dim), "paged_attention: head_dim ", head_dim,
              " is not supported on CUDA (supported: ", to_string(AttentionHeadDims{}), ")");
  if (fp8) {
    TORCH_CHECK(contains(Fp8AttentionHeadDims{}, head_dim), "paged_attention: head_dim ", head_dim,
                " is not supported on CUDA with an fp8 cache (supported: ", to_string(Fp8AttentionHeadDims{}), ")");
  }
  TORCH_CHECK(num_tokens <= INT32_MAX, "paged_attention: at most 2^31 - 1 query rows on CUDA, got ", num_tokens);
  // The kernels read cache rows as 16-byte vectors.
  const uint64_t elem = key_cache.element_size();
  for (const at::Tensor* cache : {&key_cache, &value_cache}) {
    TORCH_CHECK(access_width({address_of(*cache), cache->stride(0) * elem, cache->stride(1) * elem,
                              cache->stride(2) * elem}) == 16,
                "paged_attention: on CUDA the cache rows must be 16-byte aligned: the data pointer and the block, ",
                "token and head strides in bytes must be multiples of 16, got ", cache == &key_cache ? "key" : "value",
                "_cache at ", cache->data_ptr(), " with strides ", cache->strides(), " of ", elem, "-byte elements");
  }
  const c10::cuda::CUDAGuard guard(query.device());
  if (validation_enabled()) {
    validate_indices(block_tables, seq_lens, query_start_loc, max_query_len, num_tokens, key_cache.size(0),
                     block_size, sliding_window);
    check_kv_scale_values(k_scale, v_scale);
    check_sink_values(sinks);
  }
  if (num_tokens == 0 || num_seqs == 0) return;

  const at::Tensor block_tables_c = block_tables.contiguous(), seq_lens_c = seq_lens.contiguous();
  const std::optional<at::Tensor> alibi_c =
      alibi_slopes.has_value() ? std::optional<at::Tensor>(alibi_slopes->contiguous()) : std::nullopt;
  const std::optional<at::Tensor> starts_c =
      query_start_loc.has_value() ? std::optional<at::Tensor>(query_start_loc->contiguous()) : std::nullopt;
  const at::Tensor sinks_f32 = sinks.has_value() ? sinks->to(at::kFloat).contiguous() : at::Tensor();  // exact
  const auto run = [&](auto dtype_tag, auto cache_tag) {
    using T = decltype(dtype_tag);
    using C = decltype(cache_tag);
    const AttentionParams<T, C> params =
        attention_params<T, C>(out, query, key_cache, value_cache, block_tables_c, seq_lens_c, starts_c, scale,
                               alibi_c, logits_soft_cap, k_scale, v_scale, sinks_f32, lse);
    if (!query_start_loc.has_value()) {
      return launch_decode(params, QueryRows::kLastOfEachSeq, num_seqs, sliding_window, query, block_size,
                           num_kv_heads, shared_plan);
    }
    const VarlenPlan plan = plan_varlen_attention(num_seqs, num_tokens, num_heads, num_kv_heads, head_dim,
                                                  query.element_size(), block_tables.size(1), block_size,
                                                  sliding_window);
    if constexpr (!std::is_same_v<T, float>) {
      if (plan.error.empty() && has_tensor_cores(query.get_device())) {
        launch_decode(params, QueryRows::kSingleTokenSeqs, num_seqs, sliding_window, query, block_size,
                      num_kv_heads);
        if (!max_query_len.has_value() || *max_query_len >= 2) {
          AttentionParams<T, C> varlen_params = params;
          varlen_params.set_varlen_plan(plan);
          C10_CUDA_CHECK(launch_varlen_attention(varlen_params, plan, c10::cuda::getCurrentCUDAStream()));
        }
        return;
      }
    }
    launch_decode(params, QueryRows::kEveryRow, num_tokens, sliding_window, query, block_size, num_kv_heads);
  };
  switch (query.scalar_type()) {  // check_paged_attention_args allows exactly these (and fp8 caches checked above)
    case at::kFloat: return fp8 ? run(float{}, Fp8{}) : run(float{}, float{});
    case at::kHalf: return fp8 ? run(__half{}, Fp8{}) : run(__half{}, __half{});
    case at::kBFloat16: return fp8 ? run(__nv_bfloat16{}, Fp8{}) : run(__nv_bfloat16{}, __nv_bfloat16{});
    default:
      TORCH_CHECK(false, "paged_attention: unsupported dtype ", query.scalar_type());
  }
}

// mla_attention on CUDA: mla_attention_kernel (mla_kernels.cuh) over one item per sequence (decode) or per query
// row (query_start_loc: QueryRows::kEveryRow), split-KV as plan_mla_attention says, the reduce at HEAD_DIM =
// kv_lora_rank. float16 and bfloat16 latent caches at the (kv_lora_rank, rope_dim) pairs of MlaShapes, block sizes
// that are powers of two from 8, compute capability 8.0+. No host-device synchronization (unless validation is on).
void mla_attention_cuda(at::Tensor& out,                 // [num_tokens, num_heads, kv_lora_rank], contiguous
                        const at::Tensor& query,         // [num_tokens, num_heads, kv_lora_rank + rope_dim]
                        const at::Tensor& kv_cache,      // [num_blocks, block_size, kv_lora_rank + rope_dim]
                        const at::Tensor& block_tables,  // [num_seqs, max_blocks_per_seq], int32
                        const at::Tensor& seq_lens,      // [num_seqs], int32
                        int64_t kv_lora_rank, double scale,
                        const std::optional<at::Tensor>& query_start_loc,  // [num_seqs + 1], int32, or none
                        std::optional<int64_t> max_query_len,
                        const std::optional<at::Tensor>& k_scale,  // [1], float32 (fp8 caches only)
                        const std::optional<at::Tensor>& lse) {    // [num_tokens, num_heads], float32, or none
  check_mla_attention_args(out, query, kv_cache, block_tables, seq_lens, kv_lora_rank, query_start_loc, k_scale, lse);
  TORCH_CHECK(query.is_cuda(), "mla_attention: expected CUDA tensors, got ", query.device());
  const auto dtype = query.scalar_type();
  TORCH_CHECK(!is_fp8(kv_cache.scalar_type()), "mla_attention: fp8 latent caches are not on CUDA yet (CPU only); ",
              "float16 and bfloat16 caches are");
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, "mla_attention on CUDA takes float16 and bfloat16, got ",
              dtype, " (float32 runs on the CPU)");
  const int device = query.get_device();
  TORCH_CHECK(has_tensor_cores(device), "mla_attention on CUDA needs compute capability 8.0 or newer");
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), row = kv_cache.size(2);
  const int64_t num_seqs = block_tables.size(0), block_size = kv_cache.size(1);
  TORCH_CHECK(num_tokens <= INT32_MAX, "mla_attention: at most 2^31 - 1 query rows on CUDA, got ", num_tokens);
  // The kernel copies rows as 16-byte vectors and keeps a step's row offsets (32 token strides) in int32.
  const uint64_t elem = kv_cache.element_size();
  TORCH_CHECK(access_width({address_of(kv_cache), kv_cache.stride(0) * elem, kv_cache.stride(1) * elem,
                            address_of(query), query.stride(0) * elem, query.stride(1) * elem}) == 16 &&
                  kv_cache.stride(1) <= (INT32_MAX - row) / kMlaTile,
              "mla_attention: on CUDA the rows of kv_cache and query must be 16-byte aligned (data pointers and ",
              "strides in bytes multiples of 16, token strides below 2^31 / 32), got kv_cache strides ",
              kv_cache.strides(), ", query strides ", query.strides());
  const c10::cuda::CUDAGuard guard(query.device());
  if (validation_enabled()) {
    validate_indices(block_tables, seq_lens, query_start_loc, max_query_len, num_tokens, kv_cache.size(0), block_size,
                     0);
  }
  if (num_tokens == 0 || num_seqs == 0) return;

  const at::Tensor block_tables_c = block_tables.contiguous(), seq_lens_c = seq_lens.contiguous();
  const std::optional<at::Tensor> starts_c =
      query_start_loc.has_value() ? std::optional<at::Tensor>(query_start_loc->contiguous()) : std::nullopt;
  const int64_t num_items = query_start_loc.has_value() ? num_tokens : num_seqs;
  const at::Tensor cache = kv_cache.unsqueeze(2);  // [num_blocks, block_size, 1, row]: one kv head
  const auto run = [&](auto dtype_tag) {
    using T = decltype(dtype_tag);
    AttentionParams<T> params = attention_params<T, T>(out, query, cache, cache, block_tables_c, seq_lens_c, starts_c,
                                                       scale, std::nullopt, 0.0, std::nullopt, std::nullopt,
                                                       at::Tensor(), lse);
    params.rows = query_start_loc.has_value() ? QueryRows::kEveryRow : QueryRows::kLastOfEachSeq;
    // (the shape checked first: the occupancy query needs an instantiated kernel)
    const std::string error = mla_shape_error(kv_lora_rank, row - kv_lora_rank, block_size);
    TORCH_CHECK(error.empty(), "mla_attention: this call cannot be launched on CUDA: ", error);
    int blocks_per_sm = 0;
    C10_CUDA_CHECK(mla_attention_blocks_per_sm(T{}, static_cast<int>(kv_lora_rank),
                                               static_cast<int>(row - kv_lora_rank), device, &blocks_per_sm));
    TORCH_CHECK(blocks_per_sm >= 1, "mla_attention: the kernel for kv_lora_rank ", kv_lora_rank,
                " does not fit on an SM of this GPU");
    const AttentionPlan plan = plan_mla_attention(num_items, num_heads, kv_lora_rank, row - kv_lora_rank,
                                                  block_tables.size(1), block_size, multiprocessor_count(device),
                                                  blocks_per_sm, kPartitionSize, batch_invariant_enabled());
    TORCH_CHECK(plan.error.empty(), "mla_attention: this call cannot be launched on CUDA: ", plan.error);
    const SplitScratch scratch = split_scratch(params, plan, num_items, num_heads, kv_lora_rank, query);
    params.set_plan(plan);
    C10_CUDA_CHECK(launch_mla_attention(params, plan, static_cast<int>(kv_lora_rank),
                                        c10::cuda::getCurrentCUDAStream()));
  };
  if (dtype == at::kHalf) return run(__half{});
  run(__nv_bfloat16{});
}

}  // namespace
}  // namespace paged_attn

TORCH_LIBRARY_IMPL(paged_attn, CUDA, m) {
  m.impl("paged_attention", &paged_attn::paged_attention_cuda);
  m.impl("mla_attention", &paged_attn::mla_attention_cuda);
}
