"""Pure-PyTorch references for every op, written for clarity, not speed. Tests compare the kernels with them.

Tiled caches (paged_attn/tiled_cache.py): the references of the cache ops and of paged_attention take a tiled pair
as the ops do; they compute on the row-major caches unpack_cache gives, and the writers write the result back, packed.
copy_blocks and swap_blocks move whole blocks, which is the same for either layout.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from .tiled_cache import is_tiled, pack_cache, unpack_cache

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize_fp8(
    x: torch.Tensor,  # float32, float16 or bfloat16
    dtype: torch.dtype,  # torch.float8_e4m3fn or torch.float8_e5m2
    scale: Optional[torch.Tensor] = None,  # float32 [1]; None: 1.0
) -> torch.Tensor:  # x's shape, dtype
    """What an fp8 cache stores for x: the fp8 value nearest to x / scale (the quotient in float32, then torch's
    round-to-nearest-even conversion), saturated to the largest finite value (448 for e4m3fn, 57344 for e5m2; the
    conversion alone would give NaN or inf past it); NaN stays NaN (clamp keeps it)."""
    quotient = x.float() if scale is None else x.float() / scale.float()
    max_finite = torch.finfo(dtype).max
    return quotient.clamp(-max_finite, max_finite).to(dtype)


def dequantize_fp8(
    stored: torch.Tensor,  # fp8
    scale: Optional[torch.Tensor] = None,  # float32 [1]; None: 1.0
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # stored's shape, dtype
    """What paged_attention reads from an fp8 cache: float(stored) * scale (exact in float64)."""
    values = stored.to(dtype)
    return values if scale is None else values * scale.to(device=values.device, dtype=dtype)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], or a tiled pair
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens], int64, < 0 = padding
    *,
    k_scale: Optional[torch.Tensor] = None,  # float32 [1], fp8 caches only
    v_scale: Optional[torch.Tensor] = None,
) -> None:
    if is_tiled(key_cache) or is_tiled(value_cache):
        key_rows, value_rows = unpack_cache(key_cache, value_cache)  # (checks the pair)
        reshape_and_cache(key, value, key_rows, value_rows, slot_mapping, k_scale=k_scale, v_scale=v_scale)
        key_tiled, value_tiled = pack_cache(key_rows, value_rows)
        key_cache.copy_(key_tiled)  # in place, whatever the caches' block stride
        value_cache.copy_(value_tiled)
        return
    block_size = key_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    if key_cache.dtype in FP8_DTYPES:
        key, value = quantize_fp8(key, key_cache.dtype, k_scale), quantize_fp8(value, value_cache.dtype, v_scale)
    key_cache[blocks, offsets] = key[keep]
    value_cache[blocks, offsets] = value[keep]


def copy_blocks(
    key_caches: Sequence[torch.Tensor],  # num_layers x [num_blocks, ...] (any layout: whole blocks are copied)
    value_caches: Sequence[torch.Tensor],
    block_mapping: torch.Tensor,  # [num_pairs, 2] of (src_block, dst_block)
) -> None:
    for src, dst in block_mapping.tolist():
        for cache in (*key_caches, *value_caches):
            cache[dst] = cache[src]


def swap_blocks(
    src: torch.Tensor,  # [num_src_blocks, ...]
    dst: torch.Tensor,  # [num_dst_blocks, ...]
    block_mapping: torch.Tensor,  # [num_pairs, 2] of (src_block, dst_block)
) -> None:
    for src_block, dst_block in block_mapping.tolist():
        dst[dst_block] = src[src_block].to(dst.device)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], or a tiled pair
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim_v] (head_dim_v: any)
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq], int32
    seq_lens: torch.Tensor,  # [num_seqs], int32
    *,
    query_start_loc: Optional[torch.Tensor] = None,  # [num_seqs + 1], int32; None: one query token per sequence
    scale: Optional[float] = None,
    alibi_slopes: Optional[torch.Tensor] = None,  # [num_heads], float32
    sliding_window: Optional[int] = None,
    logits_soft_cap: Optional[float] = None,
    compute_dtype: torch.dtype = torch.float32,
    k_scale: Optional[torch.Tensor] = None,  # float32 [1], fp8 caches only: keys read as float(stored) * k_scale
    v_scale: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    sinks: Optional[torch.Tensor] = None,  # [num_heads]: each head's sink logit (gpt-oss)
):  # [num_tokens, num_heads, head_dim_v], query dtype; return_lse: and lse [num_tokens, num_heads] in compute_dtype
    """Paged attention, one sequence at a time: gather the sequence's keys/values through its block table (fp8:
    dequantized), then causal softmax attention of its query tokens (the last q_s of its L_s tokens, at positions
    L_s - q_s + i) in compute_dtype, each row over exactly the keys it can see (so a NaN or inf outside them never
    reaches it). return_lse: also each row's natural-log log-sum-exp of its final logits (-inf for a row that sees
    no key). sinks: as openai/gpt-oss's torch/model.py sdpa, the sink is concatenated to the row's final logits
    before the softmax and its weight dropped (+inf: the limit, weights 0 and lse +inf); the lse counts it."""
    if is_tiled(key_cache) or is_tiled(value_cache):
        key_cache, value_cache = unpack_cache(key_cache, value_cache)  # (checks the pair)
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    if query_start_loc is None:
        query_start_loc = torch.arange(num_tokens + 1)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    out = torch.zeros(num_tokens, num_heads, value_cache.shape[3], dtype=compute_dtype, device=query.device)
    lse = torch.full((num_tokens, num_heads), -math.inf, dtype=compute_dtype, device=query.device)
    sink = None if sinks is None else sinks.to(query.device, compute_dtype)
    if sink is not None:
        lse[:] = sink  # a row that sees no key: only the sink
    for seq, seq_len in enumerate(lens):
        first, last = starts[seq], starts[seq + 1]
        if first == last or seq_len == 0:
            continue  # no query tokens; a decode row of an empty sequence stays zero
        tokens = torch.arange(seq_len, device=query.device)
        blocks = block_tables[seq].long().to(query.device)[tokens // block_size]
        keys = dequantize_fp8(key_cache[blocks, tokens % block_size], k_scale, compute_dtype)  # [seq_len, kv, d]
        values = dequantize_fp8(value_cache[blocks, tokens % block_size], v_scale, compute_dtype)
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        q = query[first:last].to(compute_dtype)  # [q_s, num_heads, head_dim]
        for row in range(last - first):
            # Only the keys this row can see enter its sums: a NaN or inf outside them (after its position, before
            # its window, in unused slots) must not reach it through 0 * NaN.
            position = seq_len - (last - first) + row
            lo = 0 if sliding_window is None else max(0, position - sliding_window + 1)
            visible = slice(lo, position + 1)
            logits = torch.einsum("hd,thd->ht", q[row], keys[visible]) * scale  # [num_heads, visible tokens]
            if logits_soft_cap is not None:
                logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
            if alibi_slopes is not None:
                distance = (tokens[visible] - position).to(compute_dtype)  # t - p <= 0
                logits = logits + alibi_slopes.to(query.device, compute_dtype)[:, None] * distance
            if sink is not None:
                logits = torch.cat([logits, sink[:, None]], dim=-1)
            probs = torch.softmax(logits, dim=-1)
            row_lse = torch.logsumexp(logits, dim=-1)
            if sink is not None:
                probs = torch.where(sink[:, None] == math.inf, 0.0, probs[:, :-1])  # the limit, not inf - inf
                row_lse = torch.where(sink == math.inf, math.inf, row_lse)
            out[first + row] = torch.einsum("ht,thd->hd", probs, values[visible])
            lse[first + row] = row_lse
    return (out.to(query.dtype), lse) if return_lse else out.to(query.dtype)


def concat_and_cache_mla(
    kv_c: torch.Tensor,  # [num_tokens, kv_lora_rank]
    k_pe: torch.Tensor,  # [num_tokens, rope_dim]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    slot_mapping: torch.Tensor,  # [num_tokens], int64, < 0 = padding
    *,
    scale: Optional[torch.Tensor] = None,  # float32 [1], fp8 caches only
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    rows = torch.cat([kv_c, k_pe], dim=-1)[keep]
    if kv_cache.dtype in FP8_DTYPES:
        rows = quantize_fp8(rows, kv_cache.dtype, scale)
    kv_cache[slots // kv_cache.shape[1], slots % kv_cache.shape[1]] = rows.to(kv_cache.dtype)


def mla_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, kv_lora_rank + rope_dim], the absorbed query
    kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq], int32
    seq_lens: torch.Tensor,  # [num_seqs], int32
    *,
    kv_lora_rank: int,
    scale: float,
    query_start_loc: Optional[torch.Tensor] = None,  # [num_seqs + 1], int32; None: one query token per sequence
    compute_dtype: torch.dtype = torch.float32,
    k_scale: Optional[torch.Tensor] = None,  # float32 [1], fp8 caches only
    return_lse: bool = False,
):  # [num_tokens, num_heads, kv_lora_rank], query dtype; return_lse: and lse [num_tokens, num_heads]
    """MLA in its absorbed form is attention with one kv head: every head's keys are the whole latent rows and its
    values their first kv_lora_rank dims."""
    cache = kv_cache[:, :, None]  # [num_blocks, block_size, 1, kv_lora_rank + rope_dim]
    return paged_attention(query, cache, cache[..., :kv_lora_rank], block_tables, seq_lens,
                           query_start_loc=query_start_loc, scale=scale, compute_dtype=compute_dtype, k_scale=k_scale,
                           v_scale=k_scale, return_lse=return_lse)


def attention_with_lse(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    keys: torch.Tensor,  # [num_keys, num_heads, head_dim]
    values: torch.Tensor,  # [num_keys, num_heads, head_dim]
    scale: Optional[float] = None,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, num_heads, head_dim], [num_tokens, num_heads] (compute_dtype)
    """Every query token attends to every key (no mask), returning the output and the natural-log log-sum-exp of
    each row's scaled logits: the two halves of a partial result that merge_attention_states merges. With no keys:
    out = 0 and lse = -inf."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    logits = torch.einsum("nhd,thd->nht", query.to(compute_dtype), keys.to(compute_dtype)) * scale
    lse = torch.logsumexp(logits, dim=-1)  # -inf over no keys
    if keys.shape[0] == 0:
        return torch.zeros(query.shape, dtype=compute_dtype, device=query.device), lse
    out = torch.einsum("nht,thd->nhd", torch.softmax(logits, dim=-1), values.to(compute_dtype))
    return out, lse


def merge_attention_states(
    out_a: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    lse_a: torch.Tensor,  # [num_tokens, num_heads], natural log
    out_b: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    lse_b: torch.Tensor,  # [num_tokens, num_heads]
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:  # out_a's dtype; float32
    """The merge of two partial results over disjoint key ranges, in compute_dtype, out rounded once to out_a's dtype:
    m = max(lse_a, lse_b), w = exp(lse - m), out = (w_a out_a + w_b out_b) / (w_a + w_b), lse = m + log(w_a + w_b).
    Edges as the kernels (csrc/cpu/merge_attention_states.cpp): a +inf lse dominates (scale 1 for the +inf parts,
    divided by their count, 0 for the other; lse +inf); both -inf gives scales 0 and lse -inf; a NaN lse gives a NaN
    row and lse; NaN (or inf times a zero scale) in out_a / out_b gives NaN there."""
    a, b = lse_a.to(compute_dtype), lse_b.to(compute_dtype)
    dominant = ((a == math.inf) | (b == math.inf)) & ~a.isnan() & ~b.isnan()
    inf_a, inf_b = (a == math.inf).to(compute_dtype), (b == math.inf).to(compute_dtype)
    a, b = torch.where(dominant, 0.0, a), torch.where(dominant, 0.0, b)  # (finite stand-ins, replaced below)
    empty = (a == -math.inf) & (b == -math.inf)
    m = torch.where(empty, 0.0, torch.maximum(a, b))  # maximum propagates NaN, as the weights do anyway
    w_a, w_b = torch.exp(a - m), torch.exp(b - m)  # both 0 where empty
    total = w_a + w_b
    lse = torch.where(empty, -math.inf, m + torch.log(total))
    total = torch.where(empty, 1.0, total)
    scale_a, scale_b = w_a / total, w_b / total
    count = torch.where(dominant, inf_a + inf_b, 1.0)
    scale_a = torch.where(dominant, inf_a / count, scale_a)[..., None]
    scale_b = torch.where(dominant, inf_b / count, scale_b)[..., None]
    lse = torch.where(dominant, math.inf, lse)
    out = out_a.to(compute_dtype) * scale_a + out_b.to(compute_dtype) * scale_b
    return out.to(out_a.dtype), lse.to(torch.float32)


class PagedAttentionExecutor:
    """Teaching reference: PagedAttention as the paper describes it, one sequence and one head at a time, walking
    the sequence's blocks in order with an online softmax.

    It keeps its own cache layout, the one of the paper's (and vLLM's original) kernel: keys as
    ``[num_blocks, num_kv_heads, head_dim, block_size]``, so that one block of keys for a head is a matrix the query
    multiplies directly, and values as ``[num_blocks, num_kv_heads, block_size, head_dim]``. ``from_nhd`` converts
    this project's row-major cache layout (a tiled pair: ``unpack_cache`` it first). Slow on purpose: read it, don't
    run it in production.
    """

    def __init__(self, key_blocks: torch.Tensor, value_blocks: torch.Tensor):
        self.key_blocks = key_blocks  # [num_blocks, num_kv_heads, head_dim, block_size]
        self.value_blocks = value_blocks  # [num_blocks, num_kv_heads, block_size, head_dim]
        self.block_size = key_blocks.shape[3]

    @classmethod
    def from_nhd(cls, key_cache: torch.Tensor, value_cache: torch.Tensor) -> "PagedAttentionExecutor":
        """From caches in this project's layout, [num_blocks, block_size, num_kv_heads, head_dim]."""
        return cls(key_cache.permute(0, 2, 3, 1).contiguous(), value_cache.permute(0, 2, 1, 3).contiguous())

    def forward(
        self,
        query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
        block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq]
        seq_lens: torch.Tensor,  # [num_seqs]
        scale: Optional[float] = None,
    ) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
        num_seqs, num_heads, head_dim = query.shape
        group = num_heads // self.key_blocks.shape[1]
        scale = head_dim**-0.5 if scale is None else scale
        out = torch.zeros(num_seqs, num_heads, head_dim, dtype=torch.float32)
        for seq in range(num_seqs):
            seq_len = int(seq_lens[seq])
            for head in range(num_heads):
                kv_head = head // group
                q = query[seq, head].float()
                running_max, running_sum = float("-inf"), 0.0
                acc = torch.zeros(head_dim)
                for logical_block in range((seq_len + self.block_size - 1) // self.block_size):
                    physical_block = int(block_tables[seq, logical_block])
                    n = min(self.block_size, seq_len - logical_block * self.block_size)  # tokens in this block
                    keys = self.key_blocks[physical_block, kv_head, :, :n].float()  # [head_dim, n]
                    values = self.value_blocks[physical_block, kv_head, :n].float()  # [n, head_dim]
                    logits = (q @ keys) * scale  # [n]
                    new_max = max(running_max, float(logits.max()))
                    rescale = math.exp(running_max - new_max)  # exp(-inf) = 0 on the first block
                    weights = torch.exp(logits - new_max)
                    running_sum = running_sum * rescale + float(weights.sum())
                    acc = acc * rescale + weights @ values
                    running_max = new_max
                if running_sum > 0:
                    out[seq, head] = acc / running_sum
        return out.to(query.dtype)
