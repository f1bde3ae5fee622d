"""The block pool: the physical blocks of one device (GPU or CPU), their reference counts, and the free ones.

A block's reference count is the number of block-table entries pointing at it; a block is free exactly when it is
0. On the GPU with prefix caching, a free block the prefix cache still holds is *evictable*: it counts as free,
keeps its content for later hits, and is recycled, least recently used first, only once no plain free block is
left. Taking, holding and releasing a block is O(1): free ids sit in a deque, evictable ones in the prefix cache's
LRU; nothing scans the pool.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

from .prefix_cache import PrefixCache


@dataclass(eq=False)
class Block:
    """One physical block of ``block_size`` slots."""

    block_id: int
    ref_count: int = 0


class BlockPool:
    """``num_blocks`` blocks; ``prefix_cache``: the GPU's, whose registered blocks stay cached while free."""

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
