// CPU kernels of paged attention (paged_attn::paged_attention). Decode: one query token per sequence, the kernel
// of decode_kernels.h. With query_start_loc (variable-length queries: prefills, prefill chunks, decodes in one call),
// the rows of sequences with fewer than kMinPrefillQueryLen query tokens (decodes, short chunks) still take the
// decode kernel, each as a row at its own position, and sequences with more take the tiled prefill kernel
// (prefill_kernels.h), where a query tile shares each key/value tile among its rows.
//
// The decode kernel is batch-invariant: a query row's keys are cut into partitions at fixed token positions (the
// multiples of kPartitionTokens = 512), each partition is attended from a fresh online-softmax state (max, sum, acc
// in float32), and the partitions' states are merged strictly left to right, M = max(M, m), s = e^(M_old - M) s +
// e^(m - M) s_partition, acc likewise; always, whatever the batch and the thread count (decode.cpp:
// decode_attention). So a row's output bits do not depend on the other rows of the call, on the thread count,
// or on which physical blocks hold its keys. Threads share out (row, partition) items, so that a few long rows still
// keep every thread busy.
// Shared blocks: where several rows read a partition's first tokens (or all) as the same tokens in the same physical
// blocks, that shared segment is attended once for them, then each row goes on alone to its partition's end
// (find_shared_blocks, attend_shared_blocks), each row from its own state, before the rest; the rows merge its state
// in partition order like any other, so sharing changes no bit either.
// Only tokens t < L (and in the window) are ever read: unused cache slots and block-table entries may hold
// anything, NaN included.
//
// This file: the entry point (argument checks, the dispatch by dtype, the split of a varlen batch between the
// decode and the prefill kernels). The pieces, in three translation units that compile in parallel (this one,
// decode.cpp, prefill.cpp), meeting in attention_params.h (AttentionParams, decode_attention, prefill_attention):
//  - attention_common.h: the at::vec setup (first: it must precede any include of Vectorized), constants, fp8
//    tables and load helpers, Tile, Prefetcher, Scratch (addresses: paged_cache.h, shared with cache_ops.cpp);
//  - decode.cpp: the decode kernel's host side (partitions.h: row states, partitions, their split among the
//    threads; then shared blocks, and the merge of a row's partitions);
//  - decode_kernels.h: the decode steps (logits, softmax, values) on the portable path, and a task's tile loop;
//  - avx512_kernels.h, amx_kernels.h: the same steps as AVX-512 bf16 and AMX micro-kernels;
//  - prefill_kernels.h: the tiled prefill kernel (instantiated in prefill.cpp).

#include "amx_kernels.h"  // (attention_common.h first): use_amx, avx512_bf16_path

#include <ATen/Functions.h>
#include <torch/library.h>

namespace paged_attn {

namespace {

// A call on tiled caches that the tiled kernel does not serve (a query of another dtype than bfloat16, a CPU without
// AVX512_BF16, sequences for the prefill kernel): the blocks the rows read (as check_block_table_range reckons
// them: from the first row's window start to the end) unpacked into row-major caches, and the block tables
// renumbered to them (entries no row reads: 0). The rows' bits are then those of row-major caches.
struct UnpackedBlocks {
  at::Tensor key_cache, value_cache, block_tables;
};
UnpackedBlocks unpack_read_blocks(const at::Tensor& key_tiled, const at::Tensor& value_tiled,
                                  const at::Tensor& tables,  // [num_seqs, max_blocks_per_seq], int32, contiguous
                                  const at::Tensor& lens,    // [num_seqs], int32, contiguous
                                  const at::Tensor& starts,  // [num_seqs + 1], int32, contiguous, or undefined
                                  int64_t block_size, int64_t sliding_window) {
  const int64_t num_seqs = tables.size(0), width = tables.size(1);
  std::vector<int32_t> new_id(key_tiled.size(0), -1);
  std::vector<int64_t> read;
  at::Tensor renumbered = at::zeros(tables.sizes(), tables.options());
  const int32_t* table = tables.const_data_ptr<int32_t>();
  const int32_t* len = lens.const_data_ptr<int32_t>();
  int32_t* out = renumbered.data_ptr<int32_t>();
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t first_row = int64_t{len[s]} - (starts.defined() ? starts.const_data_ptr<int32_t>()[s + 1] -
                                                                        starts.const_data_ptr<int32_t>()[s]
                                                                  : 1);
    const int64_t first_read = sliding_window > 0 ? std::max<int64_t>(0, first_row - sliding_window + 1) : 0;
    for (int64_t b = first_read / block_size; b < (len[s] + block_size - 1) / block_size; ++b) {
      int32_t& id = new_id[table[s * width + b]];
      if (id < 0) id = static_cast<int32_t>(read.size()), read.push_back(table[s * width + b]);
      out[s * width + b] = id;
    }
  }
  const at::Tensor ids = at::empty({static_cast<int64_t>(read.size())}, at::kLong);
  std::copy(read.begin(), read.end(), ids.data_ptr<int64_t>());
  const int64_t n = ids.size(0), num_kv_heads = key_tiled.size(1), head_dim = value_tiled.size(3);
  // As integers of the element's width (index_select and copies of any dtype), then back.
  const auto bits = key_tiled.element_size() == 1 ? at::kByte : at::kShort;
  const at::Tensor key = key_tiled.view(bits).index_select(0, ids).permute({0, 2, 4, 1, 3, 5});
  const at::Tensor value = value_tiled.view(bits).index_select(0, ids).permute({0, 2, 4, 1, 3});
  return {key.reshape({n, block_size, num_kv_heads, head_dim}).view(key_tiled.scalar_type()),
          value.reshape({n, block_size, num_kv_heads, head_dim}).view(value_tiled.scalar_type()), renumbered};
}

// paged_attention_cpu's work, with p_terms (AttentionParams): 1 for MLA.
void run_paged_attention(at::Tensor& out,                 // [num_tokens, num_heads, head_dim], contiguous
                         const at::Tensor& query,         // [num_tokens, num_heads, head_dim], last dim contiguous
                         const at::Tensor& key_cache,     // [num_blocks, block_size, num_kv_heads, head_dim], or tiled
                         const at::Tensor& value_cache,   // [num_blocks, block_size, num_kv_heads, head_dim], or tiled
                         const at::Tensor& block_tables,  // [num_seqs, max_blocks_per_seq], int32
                         const at::Tensor& seq_lens,      // [num_seqs], int32
                         double scale,
                         const std::optional<at::Tensor>& alibi_slopes,  // [num_heads], float32
                         int64_t sliding_window, double logits_soft_cap,
                         const std::optional<at::Tensor>& query_start_loc,  // [num_seqs + 1], int32, or none
                         std::optional<int64_t> max_query_len,
                         const std::optional<at::Tensor>& k_scale,    // [1], float32 (fp8 caches only)
                         const std::optional<at::Tensor>& v_scale,  // [1], float32 (fp8 caches only)
                         const std::optional<at::Tensor>& lse,      // [num_tokens, num_heads], float32, or none
                         const std::optional<at::Tensor>& sinks,  // [num_heads], float32/16, bfloat16, or none
                         // [num_tasks, 11], int32, or none: checked, not read (this kernel finds the sharing itself)
                         const std::optional<at::Tensor>& shared_plan, int p_terms) {
  const auto [key_checked, value_checked] = caches_for_checks(key_cache, value_cache);  // tiled: as 4 dims
  check_paged_attention_args(out, query, key_checked, value_checked, block_tables, seq_lens, scale, alibi_slopes,
                             sliding_window, logits_soft_cap, query_start_loc, max_query_len, k_scale, v_scale, lse,
                             sinks, shared_plan);
  const int64_t block_size = key_checked.size(1);
  if (query_start_loc.has_value()) {
    check_query_start_loc_range(*query_start_loc, seq_lens, query.size(0), max_query_len);
  }
  check_block_table_range(block_tables, seq_lens, key_checked.size(0), block_size, query_start_loc, sliding_window);
  check_kv_scale_values(k_scale, v_scale);
  check_sink_values(sinks);
  if (out.numel() == 0) return;
  const int64_t num_rows = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = key_checked.size(2), head_dim_v = value_checked.size(3);

  auto tables = block_tables.contiguous();
  const auto lens = seq_lens.contiguous();
  const auto slopes = alibi_slopes.has_value() ? alibi_slopes->contiguous() : at::Tensor();
  const auto sinks_f32 = sinks.has_value() ? sinks->to(at::kFloat).contiguous() : at::Tensor();  // exact
  // With query_start_loc: sequences with at least kMinPrefillQueryLen query tokens go to the tiled prefill kernel;
  // the rows of those with fewer (decodes, short chunks) to the decode kernel: row i of the q_s rows of sequence s,
  // at position L_s - q_s + i, as a row of length L_s - q_s + i + 1. Values of another width than the keys
  // (head_dim_v: MLA) take the decode kernel for every row (the rows of a sequence share its partitions there).
  const int64_t min_prefill_query_len =
      head_dim_v == head_dim ? cpu::kMinPrefillQueryLen : std::numeric_limits<int64_t>::max();
  std::vector<int32_t> decode_lens, decode_seqs, decode_tokens, prefill_seqs;
  const auto starts = query_start_loc.has_value() ? query_start_loc->contiguous() : at::Tensor();
  if (starts.defined()) {
    const int32_t* qsl = starts.const_data_ptr<int32_t>();
    const int32_t* len = lens.const_data_ptr<int32_t>();
    for (int32_t s = 0; s + 1 < starts.size(0); ++s) {
      const int32_t query_len = qsl[s + 1] - qsl[s];
      if (query_len >= min_prefill_query_len) {
        prefill_seqs.push_back(s);
        continue;
      }
      for (int32_t i = 0; i < query_len; ++i) {
        decode_lens.push_back(len[s] - query_len + i + 1);
        decode_seqs.push_back(s);
        decode_tokens.push_back(qsl[s] + i);
      }
    }
  }
  // Tiled caches: read as they are by the AVX-512 bf16 decode steps (avx512_kernels.h), else unpacked.
  at::Tensor keys = key_cache, values = value_cache;
  if (is_tiled(key_cache) && !(query.scalar_type() == at::kBFloat16 && use_avx512() && prefill_seqs.empty())) {
    UnpackedBlocks unpacked = unpack_read_blocks(key_cache, value_cache, tables, lens, starts, block_size,
                                                 sliding_window);
    keys = unpacked.key_cache, values = unpacked.value_cache, tables = unpacked.block_tables;
  }
  const float k_scale_value = k_scale.has_value() ? k_scale->item<float>() : 1.f;
  const float v_scale_value = v_scale.has_value() ? v_scale->item<float>() : 1.f;
  const auto run = [&](auto dtype_tag, auto cache_tag) {
    using scalar_t = decltype(dtype_tag);
    using cache_t = decltype(cache_tag);
    AttentionParams<scalar_t, cache_t> params;
    params.kv.key = cpu::paged_cache_of<const cache_t>(keys);
    params.kv.value = cpu::paged_cache_of<const cache_t>(values);
    params.query = query.const_data_ptr<scalar_t>();
    params.query_row_stride = query.stride(0);
    params.query_head_stride = query.stride(1);
    params.block_tables = tables.const_data_ptr<int32_t>();
    params.row_lens = lens.const_data_ptr<int32_t>();  // decode: row r is sequence r (row_seqs, row_tokens nullptr)
    params.alibi_slopes = slopes.defined() ? slopes.const_data_ptr<float>() : nullptr;
    params.max_blocks_per_seq = tables.size(1);
    params.block_size = block_size;
    params.num_heads = num_heads;
    params.num_kv_heads = num_kv_heads;
    params.group_size = num_heads / num_kv_heads;
    params.head_dim = head_dim;
    params.head_dim_v = head_dim_v;
    params.sliding_window = sliding_window;
    params.scale = static_cast<float>(scale) * k_scale_value;
    params.logits_soft_cap = static_cast<float>(logits_soft_cap);
    params.v_scale = v_scale_value;
    params.avx512_bf16 = avx512_bf16_path<scalar_t, cache_t>(head_dim, head_dim_v);
    params.tiled = params.kv.key.tiled;
    params.amx = params.avx512_bf16 && use_amx() && head_dim_v == head_dim && !params.tiled;
    params.p_terms = p_terms;
    params.lse = lse.has_value() ? lse->data_ptr<float>() : nullptr;
    params.sinks = sinks_f32.defined() ? sinks_f32.const_data_ptr<float>() : nullptr;
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    if (!starts.defined()) return cpu::decode_attention(params, num_rows, out_ptr);
    if (!prefill_seqs.empty()) {
      cpu::prefill_attention(params, starts.const_data_ptr<int32_t>(), lens.const_data_ptr<int32_t>(), prefill_seqs,
                              out_ptr);
    }
    if (!decode_seqs.empty()) {
      params.row_lens = decode_lens.data(), params.row_seqs = decode_seqs.data();
      params.row_tokens = decode_tokens.data();
      cpu::decode_attention(params, static_cast<int64_t>(decode_seqs.size()), out_ptr);
    }
  };
  // The cache's dtype: the query's, or fp8 (check_paged_attention_args allows exactly these).
  const auto by_cache = [&](auto dtype_tag) {
    switch (key_cache.scalar_type()) {
      case at::kFloat8_e4m3fn: return run(dtype_tag, c10::Float8_e4m3fn{});
      case at::kFloat8_e5m2: return run(dtype_tag, c10::Float8_e5m2{});
      default: return run(dtype_tag, dtype_tag);
    }
  };
  switch (query.scalar_type()) {
    case at::kFloat: by_cache(float{}); break;
    case at::kHalf: by_cache(at::Half{}); break;
    case at::kBFloat16: by_cache(at::BFloat16{}); break;
    default: TORCH_INTERNAL_ASSERT(false, "unreachable: dtype checked above");
  }
}

}  // namespace

void paged_attention_cpu(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                         const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         double scale, const std::optional<at::Tensor>& alibi_slopes, int64_t sliding_window,
                         double logits_soft_cap, const std::optional<at::Tensor>& query_start_loc,
                         std::optional<int64_t> max_query_len, const std::optional<at::Tensor>& k_scale,
                         const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& lse,
                         const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& shared_plan) {
  run_paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, scale, alibi_slopes, sliding_window,
                      logits_soft_cap, query_start_loc, max_query_len, k_scale, v_scale, lse, sinks, shared_plan,
                      /*p_terms=*/2);
}

// MLA: the latent cache viewed as [num_blocks, block_size, 1, row] is the keys, and its first kv_lora_rank columns
// the values, of a paged attention with one kv head for all query heads, so each latent row is read once for every
// head (decode_kernels.h: a tile's rows serve the whole head group), with split partitions, batch invariance, lse,
// query_start_loc and shared blocks as paged_attention has them. On the AVX-512 bf16 path each weight p enters P V
// as one bfloat16 (p_terms = 1): at 16-128 heads the products, not the bytes, bound the call.
void mla_attention_cpu(at::Tensor& out,                 // [num_tokens, num_heads, kv_lora_rank], contiguous
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
  const at::Tensor cache = kv_cache.unsqueeze(2);
  run_paged_attention(out, query, cache, cache.narrow(3, 0, kv_lora_rank), block_tables, seq_lens, scale,
                      std::nullopt, 0, 0.0, query_start_loc, max_query_len, k_scale, k_scale, lse, std::nullopt,
                      std::nullopt, /*p_terms=*/1);
}

}  // namespace paged_attn

TORCH_LIBRARY_IMPL(paged_attn, CPU, m) {
  m.impl("paged_attention", &paged_attn::paged_attention_cpu);
  m.impl("mla_attention", &paged_attn::mla_attention_cpu);
}
