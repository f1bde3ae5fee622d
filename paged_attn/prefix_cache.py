"""The block manager's prefix cache: full KV blocks found again by their content (see ``BlockManager``).

The cache keeps its own entries (by block id) and the LRU order of the cached blocks no sequence holds; it never
reads or changes a block's reference count: the block pool tells it when a cached block becomes free
(``make_evictable``) or is held again (``reuse``), and asks it for the block to recycle (``evict``).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Callable, Optional

from .metadata import PAD_BLOCK_ID

GROUP_KEY = "group"  # first element of the keys of groups other than 0 (group 0's keys are ints)


def _block_hash(parent_hash: Optional[int], token_ids: tuple[int, ...]) -> int:
    """Prefix-cache key of a full block, chained over its parent's key (None for the first block)."""
    return hash((parent_hash, token_ids))


@dataclass(frozen=True)
class CacheEntry:
    """What the cache knows of one registered block."""

    key: Hashable  # its key in hash_to_block_id: an int chain hash (group 0) or a group key tuple
    token_ids: tuple[int, ...]
    content_id: Optional[int] = None  # group 0: never reused, so a child entry can name its exact parent
    parent_content_id: Optional[int] = None


class PrefixCache:
    """The prefix cache: full KV blocks registered by content, and the LRU order of those no sequence holds.

    A full block is registered under ``_block_hash(parent_hash, tokens)``, chained over the entry matched one block
    earlier. A lookup hits only if the candidate's tokens are equal and it was registered right after that very
    parent entry (``parent_content_id``; content ids are never reused), so a hash collision misses rather than
    handing out wrong KV. A registered block that no sequence holds is *evictable*: it keeps its content for later
    hits until the manager, out of plain free blocks, recycles the least recently used one.

    With several KV-cache groups, the chain is group 0's; another group's block of the same token block is
    registered under ``(GROUP_KEY, group, content id of group 0's entry)``: content ids are never reused, so it is
    found only after exactly that prefix.
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.hash_to_block_id: dict = {}  # int chain hash (group 0) or (GROUP_KEY, group, content id)
        self.entries: dict[int, CacheEntry] = {}  # by block id: the registered blocks
        self.evictable_block_ids: OrderedDict[int, None] = OrderedDict()  # held by no sequence, LRU first
        self._content_ids = itertools.count()

    @property
    def num_evictable(self) -> int:
        return len(self.evictable_block_ids)

    def is_cached(self, block_id: int) -> bool:
        return block_id in self.entries

    def lookup(self, block_hash: int, token_ids: tuple[int, ...], parent_content_id: Optional[int]) -> Optional[int]:
        """The id of the cached block with exactly this content after this parent entry, or None (collisions
        miss)."""
        block_id = self.hash_to_block_id.get(block_hash)
        if block_id is None:
            return None
        entry = self.entries[block_id]
        if entry.token_ids != token_ids or entry.parent_content_id != parent_content_id:
            return None
        return block_id

    def longest_prefix(self, token_ids: list[int]) -> list[int]:
        """Ids of the cached blocks of the longest cached prefix of ``token_ids``, never the block holding the last
        token."""
        hits: list[int] = []
        parent_hash = parent_content_id = None
        for index in range((len(token_ids) - 1) // self.block_size):
            block_tokens = tuple(token_ids[index * self.block_size:(index + 1) * self.block_size])
            block_id = self.lookup(_block_hash(parent_hash, block_tokens), block_tokens, parent_content_id)
            if block_id is None:
                break
            hits.append(block_id)
            parent_hash, parent_content_id = self.entries[block_id].key, self.entries[block_id].content_id
        return hits

    def hits(self, token_ids: list[int], num_groups: int,
             first_visible_block: Callable[[int, int], int]) -> list[list[int]]:
        """Per KV-cache group, the ids of the cached blocks of the longest prefix of ``token_ids`` every group can
        serve (``PAD_BLOCK_ID``: a windowed group's block that the first query after the prefix cannot see;
        ``first_visible_block(group, position)``: the first block a query at ``position`` sees). Group 0's chain
        gives the candidates; the longest prefix of H blocks for which each other group holds cached blocks from
        its first visible block to H wins."""
        chain = self.longest_prefix(token_ids)
        content_ids = [self.entries[block_id].content_id for block_id in chain]
        groups = [chain] + [[self.group_block(group, content_id) for content_id in content_ids]
                            for group in range(1, num_groups)]
        # last_missing[g][h]: the last index < h whose group-g block is not cached (-1: none)
        last_missing = []
        for blocks in groups:
            marks, last = [-1], -1
            for index, block in enumerate(blocks):
                last = index if block is None else last
                marks.append(last)
            last_missing.append(marks)
        num_hits = next(h for h in range(len(chain), -1, -1)
                        if all(marks[h] < first_visible_block(group, h * self.block_size)
                               for group, marks in enumerate(last_missing)))
        return [[block if index >= first_visible_block(group, num_hits * self.block_size) else PAD_BLOCK_ID
                 for index, block in enumerate(blocks[:num_hits])] for group, blocks in enumerate(groups)]

    def publish(self, block_id: int, token_ids: tuple[int, ...], parent_hash: Optional[int],
                parent_content_id: Optional[int]) -> tuple[int, int]:
        """Register the full block ``block_id`` holding ``token_ids`` after the entry (parent_hash,
        parent_content_id); return the chain's new end (hash, content id). Content already cached (maybe in this
        very block) is chained onto, not registered twice; on a hash collision the block stays unregistered."""
        block_hash = _block_hash(parent_hash, token_ids)
        twin = self.lookup(block_hash, token_ids, parent_content_id)
        if twin is not None:
            return block_hash, self.entries[twin].content_id
        content_id = next(self._content_ids)
        if block_hash not in self.hash_to_block_id:
            self.entries[block_id] = CacheEntry(block_hash, token_ids, content_id, parent_content_id)
            self.hash_to_block_id[block_hash] = block_id
        return block_hash, content_id

    def publish_blocks(self, block_ids: dict[int, int], token_ids: tuple[int, ...], parent_hash: Optional[int],
                       parent_content_id: Optional[int]) -> tuple[int, int]:
        """Register one full token block's blocks, ``block_ids``: group -> block id, group 0's first (``publish``),
        then every other group's that holds it (``publish_group_block``); return group 0's chain end."""
        groups = iter(block_ids.items())
        block_hash, content_id = self.publish(next(groups)[1], token_ids, parent_hash, parent_content_id)
        for group, block_id in groups:
            self.publish_group_block(block_id, group, token_ids, content_id)
        return block_hash, content_id

    def group_block(self, group: int, content_id: int) -> Optional[int]:
        """The id of the cached block of a group (>= 1) for the token block whose group-0 entry has ``content_id``,
        or None."""
        return self.hash_to_block_id.get((GROUP_KEY, group, content_id))

    def publish_group_block(self, block_id: int, group: int, token_ids: tuple[int, ...], content_id: int) -> None:
        """Register a group's full block holding ``token_ids``, whose group-0 entry has ``content_id`` (once)."""
        key = (GROUP_KEY, group, content_id)
        if key not in self.hash_to_block_id and block_id not in self.entries:
            self.entries[block_id] = CacheEntry(key, token_ids)
            self.hash_to_block_id[key] = block_id

    def reuse(self, block_id: int) -> None:
        """A sequence holds the cached block again (a hit): it is no longer evictable."""
        del self.evictable_block_ids[block_id]

    def make_evictable(self, block_id: int) -> None:
        """No sequence holds the cached block any more: keep it, most recently used."""
        self.evictable_block_ids[block_id] = None

    def evict(self) -> int:
        """Unregister the least recently used evictable block and return its id (there must be one)."""
        block_id = self.evictable_block_ids.popitem(last=False)[0]
        del self.hash_to_block_id[self.entries.pop(block_id).key]
        return block_id
