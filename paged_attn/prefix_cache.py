"""The block manager's prefix cache: full KV blocks found again by their content (see ``BlockManager``)."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from paged_attn.block_manager import Block


GROUP_KEY = "group"  # first element of the keys of groups other than 0 (group 0's keys are ints)


def _block_hash(parent_hash: Optional[int], token_ids: tuple[int, ...]) -> int:
    """Prefix-cache key of a full block, chained over its parent's key (None for the first block)."""
    return hash((parent_hash, token_ids))


class PrefixCache:
    """The prefix cache: full GPU blocks registered by content, and the LRU order of those no sequence holds.

    A full block is registered under ``_block_hash(parent_hash, tokens)``, chained over the entry matched one block
    earlier. A lookup hits only if the candidate's tokens are equal and it was registered right after that very
    parent entry (``parent_content_id``; content ids are never reused), so a hash collision misses rather than
    handing out wrong KV. A registered block whose reference count drops to 0 is *evictable*: it keeps its content
    for later hits until the manager, out of plain free blocks, recycles the least recently used one.
    The cache shares the manager's ``Block`` records (their ``hash``, ``token_ids`` and content ids are set exactly
    while registered) and never allocates.

    With several KV-cache groups, the chain is group 0's; another group's block of the same token block is
    registered under ``(GROUP_KEY, group, content id of group 0's entry)``: content ids are never reused, so it is
    found only after exactly that prefix.
    """

    def __init__(self, blocks: list[Block], block_size: int):
        self.blocks = blocks
        self.block_size = block_size
        self.hash_to_block_id: dict = {}  # int chain hash (group 0) or (GROUP_KEY, group, content id)
        self.evictable_block_ids: OrderedDict[int, None] = OrderedDict()  # ref count 0 but cached, LRU first
        self._content_ids = itertools.count()

    @property
    def num_evictable(self) -> int:
        return len(self.evictable_block_ids)

    def lookup(self, block_hash: int, token_ids: tuple[int, ...], parent_content_id: Optional[int]) -> Optional[Block]:
        """The cached block with exactly this content after this parent entry, or None (collisions miss)."""
        block_id = self.hash_to_block_id.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.token_ids != token_ids or block.parent_content_id != parent_content_id:
            return None
        return block

    def longest_prefix(self, token_ids: list[int]) -> list[Block]:
        """Cached blocks of the longest cached prefix of ``token_ids``, never the block holding the last token."""
        hits: list[Block] = []
        parent_hash = parent_content_id = None
        for index in range((len(token_ids) - 1) // self.block_size):
            block_tokens = tuple(token_ids[index * self.block_size:(index + 1) * self.block_size])
            block = self.lookup(_block_hash(parent_hash, block_tokens), block_tokens, parent_content_id)
            if block is None:
                break
            hits.append(block)
            parent_hash, parent_content_id = block.hash, block.content_id
        return hits

    def publish(self, block: Block, token_ids: tuple[int, ...], parent_hash: Optional[int],
                parent_content_id: Optional[int]) -> tuple[int, int]:
        """Register the full ``block`` holding ``token_ids`` after the entry (parent_hash, parent_content_id);
        return the chain's new end (hash, content id). Content already cached (maybe in this very block) is
        chained onto, not registered twice; on a hash collision the block stays unregistered."""
        block_hash = _block_hash(parent_hash, token_ids)
        twin = self.lookup(block_hash, token_ids, parent_content_id)
        if twin is not None:
            return block_hash, twin.content_id
        content_id = next(self._content_ids)
        if block_hash not in self.hash_to_block_id:
            block.hash, block.token_ids = block_hash, token_ids
            block.content_id, block.parent_content_id = content_id, parent_content_id
            self.hash_to_block_id[block_hash] = block.block_id
        return block_hash, content_id

    def group_block(self, group: int, content_id: int) -> Optional[Block]:
        """The cached block of a group (>= 1) for the token block whose group-0 entry has ``content_id``, or None."""
        block_id = self.hash_to_block_id.get((GROUP_KEY, group, content_id))
        return None if block_id is None else self.blocks[block_id]

    def publish_group_block(self, block: Block, group: int, token_ids: tuple[int, ...], content_id: int) -> None:
        """Register a group's full ``block`` holding ``token_ids``, whose group-0 entry has ``content_id`` (once)."""
        key = (GROUP_KEY, group, content_id)
        if key not in self.hash_to_block_id and block.hash is None:
            block.hash, block.token_ids = key, token_ids
            self.hash_to_block_id[key] = block.block_id

    def hold(self, block: Block) -> None:
        """A sequence takes a reference to the cached ``block`` (a hit)."""
        if block.ref_count == 0:
            del self.evictable_block_ids[block.block_id]
        block.ref_count += 1

    def make_evictable(self, block: Block) -> None:
        """The last reference to the registered ``block`` went: keep it, most recently used."""
        self.evictable_block_ids[block.block_id] = None

    def evict(self) -> Block:
        """Unregister and return the least recently used evictable block (there must be one)."""
        block = self.blocks[self.evictable_block_ids.popitem(last=False)[0]]
        del self.hash_to_block_id[block.hash]
        block.hash = block.content_id = block.parent_content_id = None
        block.token_ids = ()
        return block
