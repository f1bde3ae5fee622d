// Host-side helpers shared by every backend: argument checks, index range checks, and the opt-in validation
// switch (the memory-overlap geometry the checks use is in overlap.h). Kernels never validate; host entry points
// call these before anything is written.
#pragma once

#include <ATen/core/Tensor.h>

#include "overlap.h"  // has_self_overlap, block_span_bytes, tensors_overlap, same_memory, address_of

#include <cstdint>
#include <optional>
#include <vector>

namespace paged_attn {

// Index validation on CUDA copies index tensors to the host, which synchronizes with the device, so it is
// opt-in there: PAGED_ATTN_VALIDATE=1 in the environment, or paged_attn.set_validation(True) from Python.
// CPU kernels always validate indices (it is free there).
bool validation_enabled();
void set_validation_enabled(bool enabled);

// Batch-invariant CUDA decode (PAGED_ATTN_BATCH_INVARIANT=1, or paged_attn.set_batch_invariant(True)): the plan
// cuts every row's keys at the same fixed positions and always merges them through split-KV's reduce, so a row's
// bits do not depend on its batch (plan_attention in cuda/launch_plan.h). The CPU decode always is.
bool batch_invariant_enabled();
void set_batch_invariant_enabled(bool enabled);

// CPU kernels split work over threads only in tasks of at least this many bytes (moved, or read from the cache):
// with passive waiting (GOMP_SPINCOUNT=0) waking an OpenMP worker costs about as long as one thread takes to move
// or read 1 MiB. Figures: bench/RESULTS.md, "Waking OpenMP's threads: a quarter of a large decode step".
constexpr int64_t kMinBytesPerCpuTask = int64_t{1} << 20;

// Whether the CPU kernels take their AVX-512 paths here: the CPU has AVX512F/BW/VL/DQ and AVX512_BF16, and
// PAGED_ATTN_NO_AVX512 (which tests set to run the portable paths) is not in the environment. Decode, linear and
// elementwise ask it; elsewhere the linear's portable loop is slower than oneDNN, which the engine then uses.
bool cpu_avx512_bf16();

// float8_e4m3fn or float8_e5m2: a cache of 8-bit floats, read as float(stored) * scale (see check_kv_scales).
bool is_fp8(at::ScalarType dtype);

// The largest finite value of an fp8 dtype (448 for e4m3fn, 57344 for e5m2), where quantizing saturates.
float fp8_max_finite(at::ScalarType dtype);

// The per-cache scales of an fp8 cache: each absent (1.0) or a float32 tensor of one element on the cache's device
// (read on the device, so a call stays capturable in a CUDA graph). With a cache of any other dtype, scales are an
// error.
void check_kv_scales(const at::Tensor& key_cache, const std::optional<at::Tensor>& k_scale,
                     const std::optional<at::Tensor>& v_scale);
// One such scale, named `name` in messages (concat_and_cache_mla's scale, mla_attention's k_scale).
void check_scale(const at::Tensor& cache, const std::optional<at::Tensor>& scale, const char* name);

// The values of k_scale and v_scale (those given; check_kv_scales first) are finite and nonzero: a scale of 0 (or
// -0) stores 0 as NaN and everything else as +-max_finite, and +-inf stores zeros that read back NaN (0 * inf).
// Reads the values, which on CUDA synchronizes with the device, so the CUDA entry points call it only under
// validation_enabled() (the CPU ones always: they read the values anyway).
void check_kv_scale_values(const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale);
void check_scale_value(const std::optional<at::Tensor>& scale, const char* name);

// paged_attention's sinks (those given) hold no NaN: -inf is "no sink" and +inf a sink that takes the whole softmax
// (the output 0, its limit), but NaN has no meaning. Reads the values: on CUDA only under validation_enabled()
// (without it a NaN sink makes the head's output NaN, never a silent wrong number).
void check_sink_values(const std::optional<at::Tensor>& sinks);

// A paged cache as the ops accept it (cache layout: see paged_attn/ops.py): 4 dims, a cache dtype, block_size,
// num_kv_heads and head_dim positive (num_blocks may be 0), head_dim contiguous, no self-overlap (has_self_overlap).
void check_cache(const at::Tensor& cache, const char* name);

// The tiled layout (csrc/cpu/paged_cache.h; paged_attn/tiled_cache.py): key_cache [num_blocks, num_kv_heads,
// block_size / 16, head_dim / 2, 16, 2] and value_cache [num_blocks, num_kv_heads, block_size / 2, head_dim, 2],
// bfloat16 or fp8, head_dim a multiple of 32, contiguous within a block, on the CPU. The rank tells the layouts
// apart: an op never reads one as the other, and one tiled cache with a row-major one is an error.
inline bool is_tiled(const at::Tensor& cache) { return cache.dim() == 6 || cache.dim() == 5; }
void check_tiled_cache_pair(const at::Tensor& key_cache, const at::Tensor& value_cache);
// The caches as the other checks see them: as they are, or, where either is tiled, both checked
// (check_tiled_cache_pair) and viewed as [num_blocks, block_size, num_kv_heads, head_dim] over exactly the same
// memory (a block is one contiguous run in both layouts), so that the shape, dtype and overlap checks apply
// unchanged. The views' elements are not the caches' (only the kernels read the tiles).
std::pair<at::Tensor, at::Tensor> caches_for_checks(const at::Tensor& key_cache, const at::Tensor& value_cache);

// Whether a cache's block is one contiguous run: [block_size, num_kv_heads, head_dim] packed (strides
// num_kv_heads * head_dim, head_dim, 1).
bool has_packed_rows(const at::Tensor& cache);

// A tensor argument, its name, and whether the op writes it, for check_no_overlap.
struct NamedTensor {
  const at::Tensor* tensor;
  const char* name;
  bool written;  // an output (a mutated tensor): it must not overlap any other argument
};

// No output overlaps any other argument, output or input (tensors_overlap): the kernel would read memory it is
// writing, or two outputs would overwrite each other. Inputs, which are only read, may share memory with each other
// (e.g. one scale tensor as both k_scale and v_scale, or one tensor as key and value). The error names both, in
// argument order. Undefined and empty tensors are skipped. Sorts them by address, so n tensors in separate
// allocations cost O(n log n).
void check_no_overlap(c10::ArrayRef<NamedTensor> tensors);

// Two tensors that must agree in shape, dtype and device (e.g. key_cache and value_cache).
void check_same_layout(const at::Tensor& a, const char* a_name, const at::Tensor& b, const char* b_name);

// key_cache and value_cache: each a valid cache (check_cache), the two of the same shape, dtype and device.
void check_cache_pair(const at::Tensor& key_cache, const at::Tensor& value_cache);

// t (key or query) has the cache's dtype, or, for an fp8 cache, one of float32, float16, bfloat16.
void check_dtype_for_cache(const at::Tensor& t, const char* name, const at::Tensor& key_cache,
                           const char* cache_name = "key_cache");

// An MLA latent cache (paged_attn/mla.py): [num_blocks, block_size, kv_lora_rank + rope_dim], one row per token
// shared by all heads; a cache dtype, block_size and the row positive, the row contiguous, no self-overlap.
void check_latent_cache(const at::Tensor& kv_cache, const char* name = "kv_cache");

// A cache as the 4-dim paged cache the kernels address: a latent cache (3 dims) as [num_blocks, block_size, 1, row].
inline at::Tensor as_paged_cache(const at::Tensor& cache) { return cache.dim() == 3 ? cache.unsqueeze(2) : cache; }

// An index tensor: given dtype and rank, on the given device.
void check_index_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim,
                        const at::Device& device);

// block_mapping: int64 [num_pairs, 2] of (src_block, dst_block).
void check_block_mapping_shape(const at::Tensor& block_mapping, const at::Device& device);

// Every slot_mapping[i] is negative (padding) or in [0, num_slots). Takes a CPU tensor.
void check_slot_range(const at::Tensor& slot_mapping_cpu, int64_t num_slots);

// Every source block id is in [0, num_src_blocks), every destination in [0, num_dst_blocks), destinations
// are distinct, and (when the copy stays within one cache, e.g. same_memory(src, dst)) no destination is also a
// source. Takes a CPU tensor.
void check_block_mapping_range(const at::Tensor& block_mapping_cpu, int64_t num_src_blocks,
                               int64_t num_dst_blocks, bool same_cache);

// The shape, dtype, device and memory-overlap checks of each op, shared by its CPU and CUDA entry points (index
// ranges and scale values are checked separately, since on CUDA reading them needs the opt-in synchronization).
// key/value (query) have the caches' dtype, or any of float32, float16, bfloat16 when the caches are fp8.
// Overlap (check_no_overlap): the tensors an op writes (the caches of reshape_and_cache and copy_blocks, dst of
// swap_blocks, out of paged_attention) overlap no other argument; the tensors it only reads may share memory.
// swap_blocks writes each destination block as the whole run of bytes a block spans (block_span_bytes), so there
// dst's block spans must not overlap src's block spans (unless src and dst are one cache: same_memory) nor
// block_mapping.
void check_reshape_and_cache_args(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& slot_mapping,
                                  const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale);
void check_copy_blocks_args(at::TensorList key_caches, at::TensorList value_caches,
                            const at::Tensor& block_mapping);
void check_swap_blocks_args(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& block_mapping);
void check_paged_attention_args(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                                const at::Tensor& value_cache, const at::Tensor& block_tables,
                                const at::Tensor& seq_lens, double scale, const std::optional<at::Tensor>& alibi_slopes,
                                int64_t sliding_window, double logits_soft_cap,
                                const std::optional<at::Tensor>& query_start_loc, std::optional<int64_t> max_query_len,
                                const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                                const std::optional<at::Tensor>& lse, const std::optional<at::Tensor>& sinks,
                                const std::optional<at::Tensor>& shared_plan);

// concat_and_cache_mla: kv_c [num_tokens, kv_lora_rank] and k_pe [num_tokens, rope_dim] (last dims contiguous,
// any row strides) fill the latent cache's rows (check_latent_cache: kv_lora_rank + rope_dim); slot_mapping int64
// [num_tokens]; scale for fp8 caches only. The cache overlaps no other argument.
void check_concat_and_cache_mla_args(const at::Tensor& kv_c, const at::Tensor& k_pe, const at::Tensor& kv_cache,
                                     const at::Tensor& slot_mapping, const std::optional<at::Tensor>& scale);
// mla_attention: query [num_tokens, num_heads, row] (the latent cache's row: kv_lora_rank + rope_dim), out
// [num_tokens, num_heads, kv_lora_rank] contiguous in query's dtype, 1 <= kv_lora_rank <= row; out and lse overlap
// no other argument. The rest (block tables, lengths, query_start_loc, lse, k_scale) as paged_attention's, which the
// CPU kernel then runs over the cache as one kv head.
void check_mla_attention_args(const at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                              const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t kv_lora_rank,
                              const std::optional<at::Tensor>& query_start_loc,
                              const std::optional<at::Tensor>& k_scale,
                              const std::optional<at::Tensor>& lse);

// merge_attention_states: out_a, out_b [num_tokens, num_heads, head_dim] of one dtype (float32, float16, bfloat16),
// shape and device, last dimension contiguous; lse_a, lse_b float32 [num_tokens, num_heads] on that device, any
// strides; out like out_a, lse like lse_a (any strides, no self-overlap); out and lse overlap no other argument.
void check_merge_attention_states_args(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& out_a,
                                       const at::Tensor& lse_a, const at::Tensor& out_b, const at::Tensor& lse_b);

// query_start_loc (int32 [num_seqs + 1]) starts at 0, never decreases and ends at num_tokens; each sequence's
// query_len = qsl[s + 1] - qsl[s] is at most seq_lens[s] and, when max_query_len is given, at most max_query_len.
// Takes CPU tensors.
void check_query_start_loc_range(const at::Tensor& query_start_loc_cpu, const at::Tensor& seq_lens_cpu,
                                 int64_t num_tokens, std::optional<int64_t> max_query_len);

// Every seq_lens[s] is in [0, max_blocks_per_seq * block_size], and the block-table entries that sequence s
// reads are in [0, num_blocks): the first ceil(seq_lens[s] / block_size), except, with a sliding window, those
// wholly before the window of its first query row (at seq_lens[s] - query_len; query_len 1 without
// query_start_loc), which are never read: a windowed cache may have released them (-1). Takes CPU tensors;
// query_start_loc, if given, already checked (check_query_start_loc_range).
void check_block_table_range(const at::Tensor& block_tables_cpu, const at::Tensor& seq_lens_cpu, int64_t num_blocks,
                             int64_t block_size, const std::optional<at::Tensor>& query_start_loc_cpu,
                             int64_t sliding_window);

// (address_of is in overlap.h; access_width, the widest access that divides a set of addresses and strides, is in
// cuda/copy_plan.h.)

}  // namespace paged_attn
