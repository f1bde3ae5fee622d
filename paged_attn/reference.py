"""Pure-PyTorch references for every op, written for clarity, not speed. Tests compare the kernels with them."""

from __future__ import annotations

from typing import Sequence

import torch


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens], int64, < 0 = padding
) -> None:
    block_size = key_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[keep]
    value_cache[blocks, offsets] = value[keep]


def copy_blocks(
    key_caches: Sequence[torch.Tensor],  # num_layers x [num_blocks, block_size, num_kv_heads, head_dim]
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
