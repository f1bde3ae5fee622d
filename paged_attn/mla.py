"""Typed wrappers of the MLA ops (multi-head latent attention, DeepSeek-V2/V3 and Kimi K2): the latent cache's writer
and the attention that reads it. Their fakes are in ``paged_attn/fakes.py``; ``paged_attn.ops`` re-exports them.

The latent cache: ``kv_cache`` ``[num_blocks, block_size, kv_lora_rank + rope_dim]``, one row per token shared by
all heads: the token's compressed KV (``kv_c``, after ``kv_a_layernorm``) and then its RoPE'd key part (``k_pe``);
DeepSeek-V3 has 512 + 64. Slots, block tables, fp8 dtypes and the memory rules are those of the paged cache
(``paged_attn/ops.py``), with one row in place of ``num_kv_heads`` rows; an fp8 latent cache has one scale.
:func:`swap_blocks` copies its blocks as it copies any cache's (``swap_blocks(kv_cache, kv_cache, pairs)`` copies
within it, for copy-on-write).
"""

from __future__ import annotations

from typing import Optional

import torch

from .fakes import _check_max_query_len, _is_finite, _is_int


def concat_and_cache_mla(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    scale: Optional[torch.Tensor] = None,
) -> None:
    """Write new tokens' latent rows into their cache slots, in place: row ``slot_mapping[i]`` becomes ``kv_c[i]``
    followed by ``k_pe[i]``.

    Args:
        kv_c: ``[num_tokens, kv_lora_rank]``, the compressed KV after ``kv_a_layernorm``.
        k_pe: ``[num_tokens, rope_dim]``, the key's RoPE part after RoPE. Both of the cache's dtype (float32, float16
            or bfloat16 for an fp8 cache), any row strides with the last dimension contiguous (slices of one
            projection's output).
        kv_cache: ``[num_blocks, block_size, kv_lora_rank + rope_dim]``, modified in place.
        slot_mapping: int64 ``[num_tokens]`` on the cache's device; a negative slot skips the token.
        scale: fp8 caches only: float32 ``[1]`` (default 1.0); the cache stores the fp8 value nearest to ``x /
            scale`` (vLLM's "fp8" convention: one scale per tensor), read back as ``float(stored) * scale``.

    Example::

        kv_c, k_pe = kv_a_proj(x).split([kv_lora_rank, rope_dim], dim=-1)
        paged_attn.concat_and_cache_mla(kv_a_layernorm(kv_c), rope(k_pe), kv_cache, slot_mapping)
    """
    torch.ops.paged_attn.concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, scale=scale)


def mla_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    kv_lora_rank: int,
    scale: float,
    query_start_loc: Optional[torch.Tensor] = None,
    max_query_len: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    k_scale: Optional[torch.Tensor] = None,
):
    """Multi-head latent attention over the latent cache (the absorbed form that MLA decodes with).

    For query row ``i`` at position ``p`` of sequence ``s``, whose latent rows are ``C_s`` (``[L_s,
    kv_lora_rank + rope_dim]``)::

        logits_t = scale * query[i, h] . C_s[t]           (all kv_lora_rank + rope_dim dims), t = 0..p
        out[i, h] = sum_t softmax(logits)_t * C_s[t, :kv_lora_rank]

    Args:
        query: ``[num_tokens, num_heads, kv_lora_rank + rope_dim]``: the absorbed query, ``q_nope @ W_UK`` then
            ``q_pe`` (last dimension contiguous), in the cache's dtype (float32, float16 or bfloat16 for fp8).
        kv_cache: the latent cache ``[num_blocks, block_size, kv_lora_rank + rope_dim]``.
        block_tables, seq_lens, query_start_loc, max_query_len: as :func:`paged_attention`'s: without
            ``query_start_loc`` one query token per sequence (decode); with it, several (speculative decoding,
            chunks), each attending causally up to its own position.
        kv_lora_rank: the compressed KV width (512 in DeepSeek-V3); the row's last dims are the RoPE part.
        scale: the logit scale, required: DeepSeek's is ``mscale**2 / sqrt(qk_nope_head_dim +
            qk_rope_head_dim)`` (YaRN's ``mscale``), not ``1 / sqrt(kv_lora_rank + rope_dim)``.
        out: optional ``[num_tokens, num_heads, kv_lora_rank]`` contiguous output to write into.
        return_lse: also return each row's log-sum-exp (float32 ``[num_tokens, num_heads]``, natural log, ``-inf``
            for a row that sees no key), to merge with :func:`merge_attention_states`.
        k_scale: an fp8 cache's scale (float32 ``[1]``; rows read as ``float(stored) * k_scale``).

    Returns:
        ``[num_tokens, num_heads, kv_lora_rank]`` in the query dtype (``out`` when given); with ``return_lse``,
        ``(out, lse)``. Any head count (no padding), any block size. On the CPU each latent row is read once for
        all heads, and a row's output bits do not depend on the batch or the thread count (as
        :func:`paged_attention`'s). On CUDA (compute capability 8.0+): float16 and bfloat16 latent caches of
        512 + 64 (DeepSeek-V2/V3, Kimi K2) or 128 + 32, block sizes that are powers of two from 8, on tensor cores
        (16 heads a thread block); with batch invariance (:func:`paged_attn.set_batch_invariant`) a row's bits do not
        depend on the batch there either. fp8 latent caches and other shapes on CUDA raise an error that says so.

    Example::

        out = paged_attn.mla_attention(q_absorbed, kv_cache, block_tables, seq_lens, kv_lora_rank=512,
                                       scale=softmax_scale)
        o = torch.einsum("thc,hcv->thv", out, w_uv)  # back through W_UV
    """
    if query.dim() != 3 or query.shape[1] == 0 or query.shape[2] == 0:
        raise ValueError(f"query must have shape [num_tokens, num_heads, kv_lora_rank + rope_dim] with positive "
                         f"num_heads and row, got {tuple(query.shape)}")
    if not (_is_int(kv_lora_rank) and 1 <= kv_lora_rank <= query.shape[2]):
        raise ValueError(f"kv_lora_rank must be an integer in [1, {query.shape[2]}] (the query's last dimension: "
                         f"kv_lora_rank + rope_dim), got {kv_lora_rank!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float, torch.SymFloat, torch.SymInt)) \
            or not _is_finite(scale):
        raise ValueError(f"scale must be a finite number (DeepSeek's softmax_scale), got {scale!r}")
    _check_max_query_len(max_query_len, query_start_loc)
    if out is None:
        out = torch.empty(query.shape[:2] + (kv_lora_rank,), dtype=query.dtype, device=query.device)
    lse = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device) if return_lse else None
    torch.ops.paged_attn.mla_attention(out, query, kv_cache, block_tables, seq_lens, int(kv_lora_rank), float(scale),
                                       query_start_loc, None if max_query_len is None else int(max_query_len),
                                       k_scale=k_scale, lse=lse)
    return (out, lse) if return_lse else out
