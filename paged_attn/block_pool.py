"""The block pool: the physical blocks of the KV pool or of the swap space, their reference counts, and the free
ones; and moving block tables from one pool to the other (swapping).

A block's reference count is the number of block-table entries pointing at it; a block is free exactly when it is
0. In the KV pool with prefix caching, a free block the prefix cache still holds is *evictable*: it counts as free,
keeps its content for later hits, and is recycled, least recently used first, only once no plain free block is
left. Taking, holding and releasing a block is O(1): free ids sit in a deque, evictable ones in the prefix cache's
LRU; nothing scans the pool.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

from .metadata import PAD_BLOCK_ID
from .prefix_cache import PrefixCache


@dataclass(eq=False)
class Block:
    """One physical block of ``block_size`` slots."""

    block_id: int
    ref_count: int = 0


class BlockPool:
    """``num_blocks`` blocks; ``prefix_cache``: the KV pool's, whose registered blocks stay cached while free."""

    def __init__(self, num_blocks: int, prefix_cache: Optional[PrefixCache] = None):
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))  # free and holding nothing cached
        self.prefix_cache = prefix_cache
        self.num_refs = 0  # the reference counts' sum: block-table entries pointing into this pool

    @property
    def num_free(self) -> int:
        """Blocks an allocation could use now: free ones plus evictable cached ones."""
        return len(self.free_block_ids) + (self.prefix_cache.num_evictable if self.prefix_cache else 0)

    @property
    def num_used(self) -> int:
        return len(self.blocks) - self.num_free

    @property
    def num_saved_by_sharing(self) -> int:
        """Block-table entries beyond one per used block: the blocks that fork and prefix hits saved."""
        return self.num_refs - self.num_used

    def take(self, ref_count: int = 1) -> int:
        """A free block, with this reference count: a plain free one, else the least recently used evictable one
        (the caller has checked that one is free)."""
        block_id = self.free_block_ids.popleft() if self.free_block_ids else self.prefix_cache.evict()
        self.blocks[block_id].ref_count = ref_count
        self.num_refs += ref_count
        return block_id

    def hold(self, block_id: int) -> None:
        """One more table entry points at the block (a fork, a prefix-cache hit, a block swapped in or out)."""
        block = self.blocks[block_id]
        if block.ref_count == 0 and self.prefix_cache is not None and self.prefix_cache.is_cached(block_id):
            self.prefix_cache.reuse(block_id)
        block.ref_count += 1
        self.num_refs += 1

    def release(self, block_id: int) -> None:
        """One table entry less points at the block; at none, it is free (evictable if cached)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        self.num_refs -= 1
        if block.ref_count == 0:
            if self.prefix_cache is not None and self.prefix_cache.is_cached(block_id):
                self.prefix_cache.make_evictable(block_id)
            else:
                self.free_block_ids.append(block_id)

    def hold_tables(self, tables: list[list[int]]) -> None:
        for block_id in held(tables):
            self.hold(block_id)

    def release_tables(self, tables: list[list[int]]) -> None:
        for table in tables:
            for block_id in reversed(table):  # tail first, so a prefix outlives its suffix in the LRU
                if block_id != PAD_BLOCK_ID:
                    self.release(block_id)


def held(tables: list[list[int]]):
    """The block ids the tables hold (released entries, ``PAD_BLOCK_ID``, skipped), table after table."""
    return (block_id for table in tables for block_id in table if block_id != PAD_BLOCK_ID)


def distinct_block_ids(tables_of_seqs: list[list[list[int]]]) -> list[int]:
    """The block ids that the sequences' tables hold, each once, in order of first appearance."""
    return list(dict.fromkeys(block_id for tables in tables_of_seqs for block_id in held(tables)))


def move_tables(tables_of_seqs: list[list[list[int]]], source: BlockPool,
                target: BlockPool) -> tuple[list[list[list[int]]], list[tuple[int, int]]]:
    """Swapping: the sequences' tables pointed at fresh blocks of ``target`` (a block shared among them moves once;
    released entries stay released), their ``source`` blocks released; and the ``(old, new)`` pairs to copy."""
    mapping = {block_id: target.take(ref_count=0) for block_id in distinct_block_ids(tables_of_seqs)}
    moved = []
    for tables in tables_of_seqs:
        source.release_tables(tables)
        moved.append([[PAD_BLOCK_ID if block_id == PAD_BLOCK_ID else mapping[block_id] for block_id in table]
                      for table in tables])
        target.hold_tables(moved[-1])
    return moved, list(mapping.items())
