"""One MLA layer's attention over the latent paged cache (DeepSeek-V2/V3), in the two forms vLLM serves it in.

Every step first writes its tokens' latent rows (``concat_and_cache_mla``). Then, per sequence:

- **absorbed** (decodes, short chunks over a long context): the query is taken into the latent space
  (``q_nope @ W_UK`` per head, then ``q_pe``) and ``mla_attention`` attends over the latent rows themselves, each row
  read once for all heads; the output goes back through ``W_UV``.
- **up-projected** (prompts, long chunks): ``kv_b_proj`` turns the latent rows into per-head keys
  (``qk_nope_head_dim + qk_rope_head_dim``) and values (``v_head_dim``), and ``paged_attention`` with
  ``head_dim_v != head_dim`` attends over them: the step's own tokens causally, the cached context in chunks of at
  most MLA_CONTEXT_CHUNK tokens, merged by ``merge_attention_states`` (the up-projected keys and values of a
  sequence's whole context are never held at once).

The choice is by arithmetic, per sequence of q new tokens over L in all (``L - q`` cached): the absorbed form costs
``q R (d_nope + d_v)`` for the absorption and ``q L (2R + d_rope)`` for attention, the up-projected one
``L R (d_nope + d_v)`` to up-project and ``q L (d_nope + d_rope + d_v)`` for attention (per head; R =
kv_lora_rank); so a prompt (L = q) is up-projected and a decode over a long context is absorbed. On CUDA every step is absorbed
for now (paged_attention with ``head_dim_v != head_dim`` runs on the CPU only). The step's keys and
values in the up-projected form are laid out as a paged cache of block size 1 (block ``t`` = token ``t``), so
no copy is made into blocks.
"""

from __future__ import annotations

import itertools
from typing import Optional

import torch

from .. import ops
from .batch import Batch

__all__ = ["MLA_CONTEXT_CHUNK", "mla_attend"]

MLA_CONTEXT_CHUNK = 4096  # cached tokens of one sequence up-projected at once


def mla_attend(model, layer: dict, batch: Batch, group: int, q_nope: torch.Tensor, q_pe: torch.Tensor,
               kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
               k_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """Write the step's latent rows, attend; ``[num_tokens, num_heads * v_head_dim]``.

    q_nope ``[num_tokens, num_heads, qk_nope_head_dim]``, q_pe ``[num_tokens, num_heads, qk_rope_head_dim]``
    (RoPE'd), kv_c ``[num_tokens, kv_lora_rank]`` (normed), k_pe ``[num_tokens, qk_rope_head_dim]`` (RoPE'd),
    kv_cache ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``."""
    ops.concat_and_cache_mla(kv_c, k_pe, kv_cache, batch.slot_mapping[group], scale=k_scale)
    mla, num_heads = model.config.mla, model.config.num_heads
    num_tokens = q_nope.shape[0]
    block_tables = batch.block_tables[group]
    if batch.max_query_len == 1 and (model.upproject_min_query_len or 2) > 1:  # a decode step: all absorbed
        return _absorbed(model, layer, q_nope, q_pe, kv_cache, block_tables, batch.seq_lens, None, 1, k_scale)
    starts = batch.query_start_loc.tolist()
    seq_lens = batch.seq_lens.tolist()
    upprojected = [_upproject(model, end - start, seq_len) for start, end, seq_len in
                   zip(starts, starts[1:], seq_lens)]
    out = torch.empty(num_tokens, num_heads * mla.v_head_dim, dtype=q_nope.dtype, device=q_nope.device)
    for form in (False, True):
        seqs = [s for s, up in enumerate(upprojected) if up == form]
        if not seqs:
            continue
        lens = [starts[s + 1] - starts[s] for s in seqs]
        local_starts = list(itertools.accumulate(lens, initial=0))  # the rows' sequences, in the rows taken
        rows = torch.cat([torch.arange(starts[s], starts[s + 1]) for s in seqs]).to(q_nope.device)
        index = torch.tensor(seqs, device=q_nope.device)
        if form:
            out[rows] = _upprojected(model, layer, q_nope[rows], q_pe[rows], kv_c[rows], k_pe[rows], kv_cache,
                                     block_tables[index], [seq_lens[s] for s in seqs], local_starts, k_scale)
        else:
            out[rows] = _absorbed(model, layer, q_nope[rows], q_pe[rows], kv_cache, block_tables[index],
                                  batch.seq_lens[index], torch.tensor(local_starts, dtype=torch.int32,
                                                                      device=q_nope.device), max(lens), k_scale)
    return out


def _upproject(model, query_len: int, seq_len: int) -> bool:
    """Whether a sequence of ``query_len`` new tokens over ``seq_len`` in all takes the up-projected form."""
    if model.upproject_min_query_len is not None:
        return query_len >= model.upproject_min_query_len
    if model.device.type == "cuda":  # paged_attention with head_dim_v != head_dim is CPU-only so far
        return False
    mla = model.config.mla
    up = (seq_len - query_len) * mla.kv_lora_rank * (mla.qk_nope_head_dim + mla.v_head_dim)
    absorbed = query_len * seq_len * (2 * mla.kv_lora_rank + mla.qk_rope_head_dim -
                                      model.config.head_dim - mla.v_head_dim)
    return up < absorbed


def _absorbed(model, layer, q_nope, q_pe, kv_cache, block_tables, seq_lens, query_start_loc, max_query_len,
              k_scale) -> torch.Tensor:
    """``mla_attention`` on the absorbed query ``[q_nope @ W_UK, q_pe]``, then ``W_UV``: ``[rows, heads * v]``."""
    mla = model.config.mla
    q_latent = torch.bmm(q_nope.transpose(0, 1), layer["w_uk"]).transpose(0, 1)  # [rows, heads, kv_lora_rank]
    query = torch.cat([q_latent, q_pe], dim=-1)
    latent_out = ops.mla_attention(query, kv_cache, block_tables, seq_lens, kv_lora_rank=mla.kv_lora_rank,
                                   scale=model.scale, query_start_loc=query_start_loc,
                                   max_query_len=max_query_len if query_start_loc is not None else None,
                                   k_scale=k_scale)
    return torch.bmm(latent_out.transpose(0, 1), layer["w_uv_t"]).transpose(0, 1).flatten(1)


def _keys_values(model, layer, kv_c: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent rows up-projected: keys ``[n, 1, heads, d_nope + d_rope]`` and values ``[n, 1, heads, d_v]``, a paged
    cache of block size 1."""
    mla, num_heads = model.config.mla, model.config.num_heads
    kv = model._linear(kv_c, layer["kv_b_proj"]).view(-1, num_heads, mla.qk_nope_head_dim + mla.v_head_dim)
    k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
    k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, num_heads, -1)], dim=-1)
    return k.unsqueeze(1), v.contiguous().unsqueeze(1)


def _upprojected(model, layer, q_nope, q_pe, kv_c, k_pe, kv_cache, block_tables, seq_lens: list[int],
                 starts: list[int], k_scale) -> torch.Tensor:
    """The up-projected form for some sequences, whose rows are ``starts[s]:starts[s + 1]``: ``[rows, heads *
    v_head_dim]``."""
    device = q_nope.device
    query = torch.cat([q_nope, q_pe], dim=-1)
    # the step's own tokens, causally: token t of the step is block t of a block-size-1 cache
    keys, values = _keys_values(model, layer, kv_c, k_pe)
    query_lens = [end - start for start, end in zip(starts, starts[1:])]
    own_tables = torch.zeros(len(query_lens), max(query_lens), dtype=torch.int32)
    for s, n in enumerate(query_lens):
        own_tables[s, :n] = torch.arange(starts[s], starts[s] + n, dtype=torch.int32)
    out, lse = ops.paged_attention(query, keys, values, own_tables.to(device),
                                   torch.tensor(query_lens, dtype=torch.int32, device=device), scale=model.scale,
                                   query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
                                   max_query_len=max(query_lens), return_lse=True)
    # the cached context of each sequence, in chunks: every query row sees all of it (one row per "sequence")
    block_size = kv_cache.shape[1]
    rows_latent = kv_cache.view(-1, kv_cache.shape[-1])
    for s, (seq_len, n) in enumerate(zip(seq_lens, query_lens)):
        rows = slice(starts[s], starts[s] + n)
        for begin in range(0, seq_len - n, MLA_CONTEXT_CHUNK):
            end = min(seq_len - n, begin + MLA_CONTEXT_CHUNK)
            positions = torch.arange(begin, end, device=device)
            slots = block_tables[s, positions // block_size].long() * block_size + positions % block_size
            latent = rows_latent[slots]
            if k_scale is not None:  # an fp8 cache: stored = x / scale
                latent = (latent.float() * k_scale).to(query.dtype)
            keys, values = _keys_values(model, layer, latent[:, :model.config.mla.kv_lora_rank],
                                        latent[:, model.config.mla.kv_lora_rank:])
            tables = torch.arange(end - begin, dtype=torch.int32, device=device).expand(n, -1).contiguous()
            part, part_lse = ops.paged_attention(query[rows], keys, values, tables,
                                                 torch.full((n,), end - begin, dtype=torch.int32, device=device),
                                                 scale=model.scale, return_lse=True)
            out[rows], lse[rows] = ops.merge_attention_states(part, part_lse, out[rows], lse[rows])
    return out.flatten(1)
