"""The block manager's memory accounting: ``BlockManagerStats``, measured from the resident sequences' block tables
and the pools (``measure``); what a serving engine reports as blocks used, shared, cached and wasted."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from .block_pool import BlockPool
from .metadata import PAD_BLOCK_ID


@dataclass(frozen=True)
class BlockManagerStats:
    """Memory accounting; the token and block counts cover the sequences resident on the GPU."""

    num_gpu_blocks: int  # GPU blocks in total
    gpu_blocks_used: int  # physical GPU blocks referenced by at least one sequence
    gpu_blocks_free: int  # blocks an allocation could use now: free + evictable cached (= num_free_blocks)
    gpu_blocks_cached: int  # free blocks still holding a cached prefix block (part of gpu_blocks_free)
    cpu_blocks_used: int  # CPU blocks holding swapped-out sequences
    num_tokens: int  # tokens stored, summed over sequences (a shared token counts once per sequence)
    logical_blocks: int  # block-table entries, summed over sequences
    blocks_saved_by_sharing: int  # logical_blocks - gpu_blocks_used: blocks that fork / prefix hits saved
    internal_fragmentation: int  # empty slots in the (distinct) last blocks: the only wasted slots
    utilization: float  # slots holding a token / slots in used blocks (0.0 when nothing is stored)
    # GPU blocks held by the resident sequences per attention type: "global" and, with windowed groups,
    # "sliding_window" (a block of either holds block_size tokens of one group's layers)
    gpu_blocks_by_attention_type: dict[str, int] = dataclasses.field(default_factory=dict)


def measure(gpu_seqs: list[tuple[int, list[list[int]]]], group_windows: tuple[Optional[int], ...], block_size: int,
            gpu_pool: BlockPool, cpu_pool: BlockPool) -> BlockManagerStats:
    """The stats of the GPU-resident sequences, each ``(num_tokens, block tables per group)``, over these pools."""
    last_block_fill = {table[-1]: (num_tokens - 1) % block_size + 1 for num_tokens, tables in gpu_seqs
                       for table in tables if table[-1] != PAD_BLOCK_ID}
    fragmentation = sum(block_size - fill for fill in last_block_fill.values())
    used, logical = gpu_pool.num_used, gpu_pool.num_refs  # (each table entry of a GPU sequence holds one reference)
    by_type: dict[str, set[int]] = {}
    for group, window in enumerate(group_windows):
        held = by_type.setdefault("global" if window is None else "sliding_window", set())
        held.update(block_id for _, tables in gpu_seqs for block_id in tables[group] if block_id != PAD_BLOCK_ID)
    return BlockManagerStats(
        num_gpu_blocks=len(gpu_pool.blocks),
        gpu_blocks_used=used,
        gpu_blocks_free=gpu_pool.num_free,
        gpu_blocks_cached=gpu_pool.prefix_cache.num_evictable,
        cpu_blocks_used=cpu_pool.num_used,
        num_tokens=sum(num_tokens for num_tokens, _ in gpu_seqs),
        logical_blocks=logical,
        blocks_saved_by_sharing=gpu_pool.num_saved_by_sharing,
        internal_fragmentation=fragmentation,
        utilization=(used * block_size - fragmentation) / (used * block_size) if used else 0.0,
        gpu_blocks_by_attention_type={kind: len(held) for kind, held in by_type.items()},
    )
