// The argument and index-range checks of paged_attention and merge_attention_states, declared in common.h (with
// the cache ops' checks, in common.cpp, that they build on).
#include "common.h"

#include "cuda/launch_plan.h"  // kSharedPlanColumns, kMaxSharedTasks (plain C++)

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace paged_attn {

void check_paged_attention_args(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                                const at::Tensor& value_cache, const at::Tensor& block_tables,
                                const at::Tensor& seq_lens, double scale, const std::optional<at::Tensor>& alibi_slopes,
                                int64_t sliding_window, double logits_soft_cap,
                                const std::optional<at::Tensor>& query_start_loc, std::optional<int64_t> max_query_len,
                                const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                                const std::optional<at::Tensor>& lse, const std::optional<at::Tensor>& sinks,
                                const std::optional<at::Tensor>& shared_plan) {
  // The value cache may be narrower or wider than the key cache (head_dim_v: MLA's up-projected values, or the
  // latent rows' first kv_lora_rank columns), else alike.
  check_cache(key_cache, "key_cache");
  check_cache(value_cache, "value_cache");
  TORCH_CHECK(value_cache.device() == key_cache.device() && value_cache.scalar_type() == key_cache.scalar_type() &&
                  value_cache.sizes().slice(0, 3) == key_cache.sizes().slice(0, 3),
              "key_cache and value_cache must have the same dtype, device and [num_blocks, block_size, num_kv_heads] ",
              "(head_dim may differ), got ", key_cache.scalar_type(), " ", key_cache.sizes(), " on ",
              key_cache.device(), " and ", value_cache.scalar_type(), " ", value_cache.sizes(), " on ",
              value_cache.device());
  TORCH_CHECK(query.dim() == 3, "query must have shape [num_tokens, num_heads, head_dim], got ", query.sizes());
  TORCH_CHECK(query.device() == key_cache.device(), "query and key_cache must be on the same device, got ",
              query.device(), " and ", key_cache.device());
  check_dtype_for_cache(query, "query", key_cache);
  TORCH_CHECK(query.stride(2) == 1, "query must be contiguous in its last dimension (head_dim), got strides ",
              query.strides());
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = key_cache.size(2);
  int64_t num_seqs = num_tokens;  // one query token per sequence without query_start_loc
  if (query_start_loc.has_value()) {
    check_index_tensor(*query_start_loc, "query_start_loc", at::kInt, 1, query.device());
    TORCH_CHECK(query_start_loc->size(0) >= 1, "query_start_loc must have num_seqs + 1 entries (at least 1), got 0");
    num_seqs = query_start_loc->size(0) - 1;
    TORCH_CHECK(!max_query_len.has_value() || *max_query_len >= 0, "max_query_len must be >= 0, got ",
                *max_query_len);
  } else {
    TORCH_CHECK(!max_query_len.has_value(), "max_query_len is given without query_start_loc");
  }
  TORCH_CHECK(num_heads > 0 && head_dim > 0, "query must have positive num_heads and head_dim, got shape ",
              query.sizes());
  TORCH_CHECK(key_cache.size(3) == head_dim, "query has head_dim ", head_dim, " but the cache has head_dim ",
              key_cache.size(3));
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads (", num_heads,
              ") must be a multiple of num_kv_heads (", num_kv_heads, ")");
  const std::vector<int64_t> out_shape = {query.size(0), num_heads, value_cache.size(3)};  // head_dim_v
  TORCH_CHECK(out.sizes() == at::IntArrayRef(out_shape) && out.scalar_type() == query.scalar_type() &&
                  out.device() == query.device(),
              "out must be a ", query.scalar_type(), " tensor of shape ", at::IntArrayRef(out_shape), " on ",
              query.device(), ", got ", out.scalar_type(), " ", out.sizes(), " on ", out.device());
  TORCH_CHECK(out.is_contiguous(), "out must be contiguous");
  // num_seqs comes from query_start_loc, else from query: say which.
  const char* seqs_from = query_start_loc.has_value() ? " (query_start_loc has num_seqs + 1 entries)" : " (query rows)";
  check_index_tensor(block_tables, "block_tables", at::kInt, 2, query.device());
  TORCH_CHECK(block_tables.size(0) == num_seqs, "block_tables must have num_seqs = ", num_seqs, seqs_from,
              " rows, got ", block_tables.size(0));
  check_index_tensor(seq_lens, "seq_lens", at::kInt, 1, query.device());
  TORCH_CHECK(seq_lens.size(0) == num_seqs, "seq_lens must have num_seqs = ", num_seqs, seqs_from, " entries, got ",
              seq_lens.size(0));
  if (alibi_slopes.has_value()) {
    check_index_tensor(*alibi_slopes, "alibi_slopes", at::kFloat, 1, query.device());
    TORCH_CHECK(alibi_slopes->size(0) == num_heads, "alibi_slopes must have num_heads = ", num_heads,
                " entries, got ", alibi_slopes->size(0));
  }
  TORCH_CHECK(sliding_window >= 0, "sliding_window must be positive (or 0 for none), got ", sliding_window);
  TORCH_CHECK(std::isfinite(scale), "scale must be finite, got ", scale);
  TORCH_CHECK(std::isfinite(logits_soft_cap) && logits_soft_cap >= 0,
              "logits_soft_cap must be positive and finite (or 0 for none), got ", logits_soft_cap);
  check_kv_scales(key_cache, k_scale, v_scale);
  if (lse.has_value()) {
    TORCH_CHECK(lse->scalar_type() == at::kFloat && lse->dim() == 2 && lse->size(0) == query.size(0) &&
                    lse->size(1) == num_heads && lse->device() == query.device(),
                "lse must be a float32 tensor of shape [num_tokens, num_heads] = [", query.size(0), ", ", num_heads,
                "] on ", query.device(), ", got ", lse->scalar_type(), " ", lse->sizes(), " on ", lse->device());
    TORCH_CHECK(lse->is_contiguous(), "lse must be contiguous");
  }
  if (sinks.has_value()) {
    const auto dtype = sinks->scalar_type();
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
                "sinks must be float32, float16 or bfloat16 (one logit per query head), got ", dtype);
    TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == num_heads, "sinks must have shape [num_heads] = [", num_heads,
                "], got ", sinks->sizes());
    TORCH_CHECK(sinks->device() == query.device(), "sinks must be on the query's device ", query.device(), ", got ",
                sinks->device());
  }
  if (shared_plan.has_value()) {  // any contents: csrc/cuda/shared_blocks.cuh checks each listing against the tables
    check_index_tensor(*shared_plan, "shared_plan", at::kInt, 2, query.device());
    TORCH_CHECK(shared_plan->size(1) == kSharedPlanColumns && shared_plan->is_contiguous() &&
                    shared_plan->size(0) <= kMaxSharedTasks,
                "shared_plan must be a contiguous int32 tensor of shape [num_tasks, ", kSharedPlanColumns,
                "] with num_tasks <= ", kMaxSharedTasks, " (paged_attn.plan_shared_blocks), got ",
                shared_plan->sizes(), " with strides ", shared_plan->strides());
  }
  const at::Tensor none;
  check_no_overlap({{&out, "out", true}, {lse.has_value() ? &*lse : &none, "lse", true},
                    {&query, "query", false}, {&key_cache, "key_cache", false},
                    {&value_cache, "value_cache", false}, {&block_tables, "block_tables", false},
                    {sinks.has_value() ? &*sinks : &none, "sinks", false},
                    {shared_plan.has_value() ? &*shared_plan : &none, "shared_plan", false},
                    {&seq_lens, "seq_lens", false},
                    {alibi_slopes.has_value() ? &*alibi_slopes : &none, "alibi_slopes", false},
                    {query_start_loc.has_value() ? &*query_start_loc : &none, "query_start_loc", false},
                    {k_scale.has_value() ? &*k_scale : &none, "k_scale", false},
                    {v_scale.has_value() ? &*v_scale : &none, "v_scale", false}});
}

void check_mla_attention_args(const at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                              const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t kv_lora_rank,
                              const std::optional<at::Tensor>& query_start_loc,
                              const std::optional<at::Tensor>& k_scale,
                              const std::optional<at::Tensor>& lse) {
  check_latent_cache(kv_cache);
  const int64_t row = kv_cache.size(2);
  TORCH_CHECK(query.dim() == 3 && query.size(2) == row,
              "query must have shape [num_tokens, num_heads, kv_lora_rank + rope_dim] with the cache's row of ", row,
              ", got ", query.sizes());
  TORCH_CHECK(query.device() == kv_cache.device(), "query and kv_cache must be on the same device, got ",
              query.device(), " and ", kv_cache.device());
  check_dtype_for_cache(query, "query", kv_cache, "kv_cache");
  TORCH_CHECK(kv_lora_rank >= 1 && kv_lora_rank <= row, "kv_lora_rank must be in [1, ", row,
              "] (the cache's row: kv_lora_rank + rope_dim), got ", kv_lora_rank);
  TORCH_CHECK(out.dim() == 3 && out.size(0) == query.size(0) && out.size(1) == query.size(1) &&
                  out.size(2) == kv_lora_rank && out.scalar_type() == query.scalar_type() &&
                  out.device() == query.device(),
              "out must be a ", query.scalar_type(), " tensor of shape [num_tokens, num_heads, kv_lora_rank] = [",
              query.size(0), ", ", query.size(1), ", ", kv_lora_rank, "] on ", query.device(), ", got ",
              out.scalar_type(), " ", out.sizes(), " on ", out.device());
  TORCH_CHECK(out.is_contiguous(), "out must be contiguous");
  check_scale(kv_cache, k_scale, "k_scale");
  const at::Tensor none;
  check_no_overlap({{&out, "out", true}, {lse.has_value() ? &*lse : &none, "lse", true},
                    {&query, "query", false}, {&kv_cache, "kv_cache", false}, {&block_tables, "block_tables", false},
                    {&seq_lens, "seq_lens", false},
                    {query_start_loc.has_value() ? &*query_start_loc : &none, "query_start_loc", false},
                    {k_scale.has_value() ? &*k_scale : &none, "k_scale", false}});
}

void check_merge_attention_states_args(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& out_a,
                                       const at::Tensor& lse_a, const at::Tensor& out_b, const at::Tensor& lse_b) {
  TORCH_CHECK(out_a.dim() == 3, "out_a must have shape [num_tokens, num_heads, head_dim], got ", out_a.sizes());
  const auto dtype = out_a.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "out_a must be float32, float16 or bfloat16, got ", dtype);
  check_same_layout(out_a, "out_a", out_b, "out_b");
  check_same_layout(out_a, "out_a", out, "out");
  for (const auto& [t, name] : {std::pair{&out_a, "out_a"}, std::pair{&out_b, "out_b"}, std::pair{&out, "out"}}) {
    TORCH_CHECK(t->stride(2) == 1 || t->size(2) <= 1, name,
                " must be contiguous in its last dimension (head_dim), got strides ", t->strides());
  }
  const auto lse_sizes = out_a.sizes().slice(0, 2);
  for (const auto& [t, name] : {std::pair{&lse_a, "lse_a"}, std::pair{&lse_b, "lse_b"}, std::pair{&lse, "lse"}}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat, name, " must be float32, got ", t->scalar_type());
    TORCH_CHECK(t->sizes() == lse_sizes, name, " must have shape [num_tokens, num_heads] = ", lse_sizes, ", got ",
                t->sizes());
    TORCH_CHECK(t->device() == out_a.device(), name, " and out_a must be on the same device, got ", t->device(),
                " and ", out_a.device());
  }
  TORCH_CHECK(!has_self_overlap(out), "out must not have overlapping elements, got shape ", out.sizes(),
              " and strides ", out.strides());
  TORCH_CHECK(!has_self_overlap(lse), "lse must not have overlapping elements, got shape ", lse.sizes(),
              " and strides ", lse.strides());
  check_no_overlap({{&out, "out", true}, {&lse, "lse", true}, {&out_a, "out_a", false}, {&lse_a, "lse_a", false},
                    {&out_b, "out_b", false}, {&lse_b, "lse_b", false}});
}

void check_query_start_loc_range(const at::Tensor& query_start_loc_cpu, const at::Tensor& seq_lens_cpu,
                                 int64_t num_tokens, std::optional<int64_t> max_query_len) {
  const auto starts = query_start_loc_cpu.contiguous();
  const auto lens = seq_lens_cpu.contiguous();
  const int32_t* qsl = starts.data_ptr<int32_t>();
  const int32_t* len = lens.data_ptr<int32_t>();
  const int64_t num_seqs = starts.size(0) - 1;
  TORCH_CHECK(qsl[0] == 0, "query_start_loc[0] must be 0, got ", qsl[0]);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t query_len = int64_t{qsl[s + 1]} - qsl[s];
    TORCH_CHECK(query_len >= 0, "query_start_loc must be non-decreasing, got query_start_loc[", s, "] = ", qsl[s],
                " > query_start_loc[", s + 1, "] = ", qsl[s + 1]);
    TORCH_CHECK(query_len <= len[s], "sequence ", s, " has ", query_len,
                " query tokens (query_start_loc[s + 1] - query_start_loc[s]) but seq_lens[", s, "] = ", len[s],
                ": its query tokens are its last ones, so there can be at most seq_lens[s]");
    TORCH_CHECK(!max_query_len.has_value() || query_len <= *max_query_len, "sequence ", s, " has ", query_len,
                " query tokens, more than max_query_len = ", *max_query_len);
  }
  TORCH_CHECK(qsl[num_seqs] == num_tokens, "query_start_loc[-1] must be num_tokens = ", num_tokens,
              " (query rows), got ", qsl[num_seqs]);
}

void check_block_table_range(const at::Tensor& block_tables_cpu, const at::Tensor& seq_lens_cpu, int64_t num_blocks,
                             int64_t block_size, const std::optional<at::Tensor>& query_start_loc_cpu,
                             int64_t sliding_window) {
  const auto tables = block_tables_cpu.contiguous();
  const auto lens = seq_lens_cpu.contiguous();
  const auto starts = query_start_loc_cpu.has_value() ? query_start_loc_cpu->contiguous() : at::Tensor();
  const int32_t* table = tables.data_ptr<int32_t>();
  const int32_t* len = lens.data_ptr<int32_t>();
  const int32_t* qsl = starts.defined() ? starts.const_data_ptr<int32_t>() : nullptr;
  const int64_t max_blocks_per_seq = tables.size(1);
  for (int64_t s = 0; s < lens.size(0); ++s) {
    TORCH_CHECK(len[s] >= 0 && len[s] <= max_blocks_per_seq * block_size, "seq_lens[", s, "] = ", len[s],
                " is out of range [0, ", max_blocks_per_seq * block_size,
                "] (max_blocks_per_seq * block_size)");
    const int64_t used_blocks = (len[s] + block_size - 1) / block_size;
    const int64_t first_row = int64_t{len[s]} - (qsl != nullptr ? int64_t{qsl[s + 1]} - qsl[s] : 1);
    const int64_t first_read = sliding_window > 0 ? std::max<int64_t>(0, first_row - sliding_window + 1) : 0;
    for (int64_t b = first_read / block_size; b < used_blocks; ++b) {
      const int32_t block = table[s * max_blocks_per_seq + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block_tables[", s, ", ", b, "] = ", block,
                  " is out of range [0, ", num_blocks, ") (sequence ", s, " has ", len[s], " tokens)");
    }
  }
}

}  // namespace paged_attn
