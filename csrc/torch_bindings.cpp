// The table of contents: every op of the paged_attn library, declared once. Each backend file
// (csrc/cpu/*.cpp, csrc/cuda/*.cpp) registers its kernels at its bottom with TORCH_LIBRARY_IMPL, so a
// CPU-only build simply leaves csrc/cuda/ out. Fake (meta) kernels for torch.compile live in
// paged_attn/fakes.py.
//
// Every op takes caches [num_blocks, block_size, num_kv_heads, head_dim]; cache layout: see paged_attn/ops.py.
// Memory: a tensor an op writes (marked (a!), (b!)) overlaps no other argument; the ones it only reads may overlap.
#include <torch/library.h>

TORCH_LIBRARY(paged_attn, m) {
  // Write token i's key/value ([num_tokens, num_kv_heads, head_dim]) into cache slot slot_mapping[i]; slot < 0 skips.
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping, *, Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
  // Copy block src -> dst for every (src, dst) row of block_mapping [num_pairs, 2], in every layer (copy-on-write).
  m.def("copy_blocks(Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor block_mapping) -> ()");
  // Copy blocks between caches on any pair of devices (swap out / in); block_mapping [num_pairs, 2] lives on the CPU.
  m.def("swap_blocks(Tensor src, Tensor(a!) dst, Tensor block_mapping) -> ()");
  // Paged attention: out[i, h] = softmax(scale * q[i, h] . K_s[:p + 1]) V_s[:p + 1] for query token i at position p of
  // sequence s, over s's paged keys/values. Without query_start_loc one token per sequence (decode, p = L_s - 1);
  // with it (int32 [num_seqs + 1]) tokens qsl[s]..qsl[s + 1] are the last ones of sequence s (prefill, chunks,
  // mixed batches); max_query_len bounds qsl[s + 1] - qsl[s]. sliding_window = 0, logits_soft_cap = 0: off.
  // lse (float32 [num_tokens, num_heads], optional): each row's log-sum-exp of its logits (-inf: no key seen), CPU
  // and CUDA. sinks ([num_heads], float32/16, bfloat16, optional): a per-head logit with no value (gpt-oss).
  // shared_plan (int32 [num_tasks, 11], optional; plan_shared_blocks): blocks that rows share, read once (CUDA).
  m.def("paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, Tensor? alibi_slopes, int sliding_window, float logits_soft_cap, "
        "Tensor? query_start_loc=None, int? max_query_len=None, *, Tensor? k_scale=None, Tensor? v_scale=None, "
        "Tensor(b!)? lse=None, Tensor? sinks=None, Tensor? shared_plan=None) -> ()");
  // MLA (multi-head latent attention: DeepSeek-V2/V3, Kimi K2): write token i's compressed KV kv_c [num_tokens,
  // kv_lora_rank] and RoPE'd key part k_pe [num_tokens, rope_dim] as row slot_mapping[i] of the latent cache kv_cache
  // [num_blocks, block_size, kv_lora_rank + rope_dim] (one row per token, for all heads); slot < 0 skips; an fp8
  // cache stores the value nearest to x / scale.
  m.def("concat_and_cache_mla(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping, *, "
        "Tensor? scale=None) -> ()");
  // MLA attention over the latent cache: out[i, h] = softmax(scale * q[i, h] . C_s[:p + 1]) C_s[:p + 1, :kv_lora_rank]
  // for query token i at position p of sequence s, C_s its latent rows; query [num_tokens, num_heads, kv_lora_rank +
  // rope_dim] is the absorbed query, out [num_tokens, num_heads, kv_lora_rank]. query_start_loc, max_query_len and
  // lse as paged_attention's; k_scale: an fp8 cache's scale. CPU only so far.
  m.def("mla_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
        "int kv_lora_rank, float scale, Tensor? query_start_loc=None, int? max_query_len=None, *, "
        "Tensor? k_scale=None, Tensor(b!)? lse=None) -> ()");
  // The shared-blocks plan of a decode batch for paged_attention's shared_plan (CUDA), from its CPU block_tables
  // [num_seqs, max_blocks_per_seq] and seq_lens [num_seqs] (int32): int32 [num_tasks, 11], rows that hold the same
  // full blocks, per task (ref, first_block, end_block, row_0..row_7); csrc/shared_blocks.cpp.
  m.def("plan_shared_blocks(Tensor block_tables, Tensor seq_lens, int block_size, int num_queries_per_kv, "
        "int min_shared_tokens) -> Tensor");
  // The engine's projections on the CPU: y = x W^T, x [num_rows, in_features] (float32 or bfloat16), W [out_features,
  // in_features] packed once by pack_linear_weight for the dot-product units ([ceil(out_features / 64),
  // ceil(in_features / kps), 64, kps], kps = 2 for bfloat16, 1 for float32; csrc/cpu/linear.cpp); sums in float32.
  // On CUDA the packed weight is W itself (cuBLAS).
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("linear(Tensor x, Tensor packed_weight, int out_features) -> Tensor");
  // The engine's elementwise layer work, one pass per row (csrc/cpu/elementwise.cpp; on CUDA torch's own ops): RMSNorm
  // out = T(weight * T(x / sqrt(mean(x^2) + eps))) of x [num_rows, width] (float32 math, T() rounding to x's dtype,
  // as transformers' LlamaRMSNorm); add_rms_norm: hidden = T(x + residual) and its RMSNorm, (hidden, out);
  // silu_and_mul: T(T(silu(gate)) * up) of gate_up [num_rows, 2 * width] = [gate | up], out [num_rows, width].
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  // Merge two partial attention results over disjoint key ranges (out_* [num_tokens, num_heads, head_dim], lse_*
  // float32 [num_tokens, num_heads], natural log): out = softmax-weighted mix of out_a, out_b; lse = logaddexp.
  m.def("merge_attention_states(Tensor(a!) out, Tensor(b!) lse, Tensor out_a, Tensor lse_a, Tensor out_b, "
        "Tensor lse_b) -> ()");
}
