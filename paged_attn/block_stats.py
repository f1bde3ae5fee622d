"""The block manager's memory accounting: ``BlockManagerStats``, measured from the resident sequences' block tables
and the pools (``measure``); what a serving engine reports as blocks used, shared, cached and wasted."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from ._deprecation import renamed_attributes
from .block_pool import BlockPool
from .metadata import PAD_BLOCK_ID


@renamed_attributes(num_gpu_blocks="num_kv_blocks", gpu_blocks_used="kv_blocks_used", gpu_blocks_free="kv_blocks_free",
                    gpu_blocks_cached="kv_blocks_cached", cpu_blocks_used="swap_blocks_used",
                    gpu_blocks_by_attention_type="kv_blocks_by_attention_type")
@dataclass(frozen=True)
class BlockManagerStats:
    """Memory accounting; the token and block counts cover the sequences resident in the KV pool."""

    num_kv_blocks: int  # KV-pool blocks in total
    kv_blocks_used: int  # physical KV blocks referenced by at least one sequence
    kv_blocks_free: int  # blocks an allocation could use now: free + evictable cached (= num_free_blocks)
    kv_blocks_cached: int  # free blocks still holding a cached prefix block (part of kv_blocks_free)
    swap_blocks_used: int  # swap blocks holding swapped-out sequences
    num_tokens: int  # tokens stored, summed over sequences (a shared token counts once per sequence)
    logical_blocks: int  # block-table entries, summed over sequences
    blocks_saved_by_sharing: int  # logical_blocks - kv_blocks_used: blocks that fork / prefix hits saved
    internal_fragmentation: int  # empty slots in the (distinct) last blocks: the only wasted slots
    utilization: float  # slots holding a token / slots in used blocks (0.0 when nothing is stored)
    # KV blocks held by the resident sequences per attention type: "global" and, with windowed groups,
    # "sliding_window" (a block of either holds block_size tokens of one group's layers)
    kv_blocks_by_attention_type: dict[str, int] = dataclasses.field(default_factory=dict)


def measure(resident_seqs: list[tuple[int, list[list[int]]]], group_windows: tuple[Optional[int], ...], block_size: int,
            kv_pool: BlockPool, swap_pool: BlockPool) -> BlockManagerStats:
    """The stats of the resident sequences, each ``(num_tokens, block tables per group)``, over these pools."""
    # (a windowed group's table still short of the tokens, its blocks given chunk by chunk, ends in a full block)
    last_block_fill = {table[-1]: (num_tokens - 1) % block_size + 1 for num_tokens, tables in resident_seqs
                       for table in tables if len(table) == -(-num_tokens // block_size) and table[-1] != PAD_BLOCK_ID}
    fragmentation = sum(block_size - fill for fill in last_block_fill.values())
    used, logical = kv_pool.num_used, kv_pool.num_refs  # (each table entry of a resident sequence holds one reference)
    by_type: dict[str, set[int]] = {}
    for group, window in enumerate(group_windows):
        held = by_type.setdefault("global" if window is None else "sliding_window", set())
        held.update(block_id for _, tables in resident_seqs for block_id in tables[group] if block_id != PAD_BLOCK_ID)
    return BlockManagerStats(
        num_kv_blocks=len(kv_pool.blocks),
        kv_blocks_used=used,
        kv_blocks_free=kv_pool.num_free,
        kv_blocks_cached=kv_pool.prefix_cache.num_evictable,
        swap_blocks_used=swap_pool.num_used,
        num_tokens=sum(num_tokens for num_tokens, _ in resident_seqs),
        logical_blocks=logical,
        blocks_saved_by_sharing=kv_pool.num_saved_by_sharing,
        internal_fragmentation=fragmentation,
        utilization=(used * block_size - fragmentation) / (used * block_size) if used else 0.0,
        kv_blocks_by_attention_type={kind: len(held) for kind, held in by_type.items()},
    )
