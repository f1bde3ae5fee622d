"""The block manager: paged KV-cache memory, handed out like an operating system hands out pages.

The KV cache is cut into *blocks* of ``block_size`` token *slots*. Each sequence keeps a *block table*, the
list of physical block ids that hold its tokens in order, so token ``i`` (prompt and generated alike) lives at
slot ``block_table[i // block_size] * block_size + i % block_size`` (``metadata.py``; cache layout: ``ops.py``).
Only the last block of a sequence is ever partly empty. The manager does the bookkeeping only; the caller moves
the data with the cache ops (``reshape_and_cache``, ``copy_blocks``, ``swap_blocks``) using the slots and block
pairs it returns.

Vocabulary:

- *physical block*: one page of the KV pool (or of the swap space), a ``Block`` with a *reference count*: the number of
  block-table entries pointing at it. A block is free exactly when its reference count is 0.
- *logical block*: one entry of a block table. ``fork`` (parallel sampling, beam search) and the prefix cache
  map several logical blocks onto one physical block.
- *copy-on-write*: before a sequence writes into a shared block, ``append_slot`` moves it onto a private copy
  and returns the ``(src_block, dst_block)`` pair the caller must copy first. A block being written to always
  has exactly one owner.
- *prefix cache* (``enable_prefix_caching``; ``prefix_cache.py``): every full KV block, filled by a prompt or by
  generated tokens, is registered under a hash chained over its parent block's and its own tokens; a new
  sequence reuses the cached blocks of its longest cached prefix (a hash collision misses). A cached block whose
  reference count drops to 0 stays *evictable*: it counts as free and keeps its content for later hits until
  it is recycled, least recently used first, once no plain free block is left.
- *published*: a full block enters the prefix cache only when the caller says its KV is written
  (``mark_computed``, after the step that wrote it completed), never when its slots are handed out. A step
  that fails before that leaves nothing behind: freeing its sequences frees their unpublished blocks, so no
  later request can hit KV that was never written. (A sequence allocated before the step that computes its
  prefix has completed computes that prefix again; the engine's scheduler holds such a request back until then.)
- *swapping*: preemption moves a group of sequences (the beams of one request) from the KV pool to the swap space
  (CPU blocks) and back; a block shared inside the group is moved once and stays shared.
- *KV-cache groups* (``group_windows``; window-aware memory, design: ``paged_attn/engine/WINDOW_MEMORY.md``): a
  model whose layers attend over sliding windows splits its layers into groups of equal size, each global (every
  token) or windowed (its queries at position ``p`` read tokens ``p - window + 1 .. p`` only). All groups draw
  their blocks (pages of ``block_size`` tokens of the group's layers) from the one pool, and each sequence keeps
  one block table per group, all of the same length. Once no query still to come can see a windowed group's
  block (``mark_computed`` says which queries remain), the block is released and its table entry becomes
  ``PAD_BLOCK_ID``; global groups keep every block. The default is one global group: a block holds every layer.
  With prefix caching, group 0 must be global: its chain of hashes finds the prefix, and the other groups' blocks
  are registered under group 0's entry for the same token block; a hit of ``H`` blocks needs, in each group, the
  blocks its first query (position ``H * block_size``) can still see. A prompt computed in chunks can have its
  windowed groups' blocks taken chunk by chunk (``allocate(..., num_tokens=0)``, then ``hold_tokens`` before each
  chunk): a windowed group then holds at most ``ceil((window - 1 + chunk) / block_size) + 1`` blocks at once
  (``max_blocks_held``), and a request's peak falls with its steady state.

The blocks and their reference counts live in a ``BlockPool`` per device (``block_pool.py``), the accounting in
``block_stats.py``. Allocating, freeing and copying-on-write a block is O(1); no operation scans the pool.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Optional, Union

import torch

from ._deprecation import renamed_attributes, renamed_keywords
from .block_pool import BlockPool, distinct_block_ids, held, move_tables
from .block_stats import BlockManagerStats, measure
from .metadata import PAD_BLOCK_ID, block_tables_tensor, token_slots
from .prefix_cache import PrefixCache


class OutOfBlocksError(RuntimeError):
    """Not enough free blocks for a request. The manager is left exactly as it was."""


@dataclass(eq=False)
class SeqState:
    """What the manager knows about one sequence."""

    token_ids: list[int]
    block_tables: list[list[int]]  # per group: KV block ids (swap ones while swapped out); PAD_BLOCK_ID: released
    swapped_out: bool = False
    # Windowed groups: no query before this position is still to come (allocate's cached tokens, mark_computed),
    # and per group the table entries below released_below[g] are released (PAD_BLOCK_ID).
    window_floor: int = 0
    released_below: list[int] = dataclasses.field(default_factory=list)
    # End of the prefix-cache chain: hash and content id of the cache entry matching the last published block.
    prefix_hash: Optional[int] = None
    prefix_content_id: Optional[int] = None
    num_published_blocks: int = 0  # leading full blocks that the chain covers (hits, or published by this seq)


@renamed_attributes(num_gpu_blocks="num_kv_blocks", num_cpu_blocks="num_swap_blocks",
                    num_free_cpu_blocks="num_free_swap_blocks")
class BlockManager:
    """Paged KV memory: block tables with reference counts, copy-on-write, fork, prefix caching, swapping.

    Sequence ids are any hashable values; token ids are non-negative integers (Python or NumPy ints). Every
    method validates its arguments before changing anything: an unknown id raises ``KeyError``; a duplicate
    id, a swapped-out sequence where a resident one is needed (or the reverse), a token id that is not a
    non-negative integer or a bad count or range raises ``ValueError``; lack of memory raises
    ``OutOfBlocksError``. In each case the manager is unchanged. The ``can_*`` methods raise the same caller
    errors and return False only for lack of memory.

    Example (parallel sampling)::

        bm = BlockManager(num_kv_blocks=64, block_size=16)
        bm.allocate(0, prompt_ids)                # prefill writes the prompt at bm.slot_mapping(0, 0, n)
        bm.fork(0, 1)                             # a second sample shares every block
        slot, cow = bm.append_slot(1, token_id)   # the last block was shared: cow == (old, new)
        if cow:
            paged_attn.copy_blocks(key_caches, value_caches, [cow])  # before writing at `slot`
        bm.free(0); bm.free(1)

    With prefix caching, the caller also says when a sequence's KV is written (``mark_computed``): only then
    do its full blocks become hits for later sequences. With several KV-cache groups (``group_windows``: per
    group None for global or its sliding window), ``append_slots`` and ``block_tables`` give every group's slots
    and tables, and ``mark_computed`` also releases the windowed groups' blocks that no later query can see.
    """

    @renamed_keywords(num_gpu_blocks="num_kv_blocks", num_cpu_blocks="num_swap_blocks")
    def __init__(self, num_kv_blocks: int, block_size: int = 16, *, num_swap_blocks: int = 0,
                 enable_prefix_caching: bool = False, group_windows: Iterable[Optional[int]] = (None,)):
        num_kv_blocks = _count(num_kv_blocks, "num_kv_blocks", minimum=1)
        block_size = _count(block_size, "block_size", minimum=1)
        num_swap_blocks = _count(num_swap_blocks, "num_swap_blocks")
        if isinstance(group_windows, (str, bytes)) or not isinstance(group_windows, Iterable):
            raise ValueError(f"group_windows must be a list with None or a window per group, got {group_windows!r}")
        group_windows = tuple(None if w is None else _count(w, "a group's sliding window", minimum=1)
                              for w in group_windows)
        if not group_windows:
            raise ValueError("group_windows needs at least one group")
        if enable_prefix_caching and group_windows[0] is not None:
            raise ValueError(f"with prefix caching, group 0 must be global (its hash chain finds the prefix), got "
                             f"group_windows={group_windows}")
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.num_swap_blocks = num_swap_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.group_windows = group_windows
        self.prefix_cache = PrefixCache(block_size)  # also holds the evictable free KV blocks
        self.kv_pool = BlockPool(num_kv_blocks, self.prefix_cache)
        self.swap_pool = BlockPool(num_swap_blocks)
        self.seqs: dict[Hashable, SeqState] = {}

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    # ---- capacity ----
    @property
    def num_free_blocks(self) -> int:
        """KV blocks an allocation could use now: free ones plus evictable cached ones."""
        return self.kv_pool.num_free

    @property
    def num_free_swap_blocks(self) -> int:
        return self.swap_pool.num_free

    # ---- new sequences ----
    def can_allocate(self, token_ids: Iterable[int], keep_free: int = 0, num_tokens: Optional[int] = None) -> bool:
        """Whether ``allocate`` of ``token_ids`` (and ``num_tokens``) would succeed (prefix-cache hits counted) and
        leave at least ``keep_free`` blocks free."""
        token_ids = self._prompt(token_ids)
        keep_free = _count(keep_free, "keep_free")
        num_tokens = len(token_ids) if num_tokens is None else min(_count(num_tokens, "num_tokens"), len(token_ids))
        return self._blocks_needed(token_ids, self._prefix_hits(token_ids), num_tokens) + keep_free \
            <= self.num_free_blocks

    def cached_prefix_length(self, token_ids: Iterable[int]) -> int:
        """How many leading tokens of ``token_ids`` an ``allocate`` now would find cached (what it would return)."""
        return len(self._prefix_hits(self._prompt(token_ids))[0]) * self.block_size

    def allocate(self, seq_id: Hashable, token_ids: Iterable[int], num_tokens: Optional[int] = None) -> int:
        """Create sequence ``seq_id`` holding ``token_ids``; return how many leading tokens are already cached.

        The caller computes the KV of tokens ``[cached, len(token_ids))`` only. A cache hit never covers the
        block that holds the last prompt token, so at most ``len(token_ids) - 1`` tokens are reported cached
        and the last token's logits are always computed: when a prompt is entirely cached, its last block is
        recomputed into a fresh block rather than written into a shared one (which would break "a block being
        written has one owner" and could race with readers). That costs at most one block of recomputation.
        A windowed group holds, of the cached blocks, only those the first query computed can see.

        ``num_tokens`` (default: all of them): the windowed groups take fresh blocks for the positions below it only
        (0: none); ``hold_tokens`` gives them the rest, chunk by chunk. Global groups take every block now.
        """
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} already exists")
        token_ids = self._prompt(token_ids)
        num_tokens = len(token_ids) if num_tokens is None else _count(num_tokens, "num_tokens")
        if num_tokens > len(token_ids):
            raise ValueError(f"num_tokens must be <= the {len(token_ids)} tokens of sequence {seq_id!r}, got "
                             f"{num_tokens}")
        hits = self._prefix_hits(token_ids)
        self._check_kv_capacity(self._blocks_needed(token_ids, hits, num_tokens), f"allocating sequence {seq_id!r}")
        self.kv_pool.hold_tables(hits)
        num_hits = len(hits[0])
        tables = [group_hits + [self.kv_pool.take() for _ in range(
            num_hits, self._table_length(group, len(token_ids), num_tokens, num_hits))] for group, group_hits in enumerate(hits)]
        cached = num_hits * self.block_size
        seq = SeqState(token_ids, tables, num_published_blocks=num_hits, window_floor=cached,
                       released_below=[self._first_visible_block(g, cached) for g in range(self.num_groups)])
        if num_hits:
            entry = self.prefix_cache.entries[hits[0][-1]]
            seq.prefix_hash, seq.prefix_content_id = entry.key, entry.content_id
        self.seqs[seq_id] = seq
        return cached

    def fork(self, parent_seq_id: Hashable, child_seq_id: Hashable) -> None:
        """Make ``child_seq_id`` share every block of ``parent_seq_id`` (on whichever device it is)."""
        parent = self._seq(parent_seq_id)
        if child_seq_id in self.seqs:
            raise ValueError(f"cannot fork onto sequence {child_seq_id!r}: it already exists")
        (self.swap_pool if parent.swapped_out else self.kv_pool).hold_tables(parent.block_tables)
        self.seqs[child_seq_id] = dataclasses.replace(
            parent, token_ids=list(parent.token_ids), block_tables=[list(t) for t in parent.block_tables],
            released_below=list(parent.released_below))

    def blocks_to_hold(self, seq_id: Hashable, num_tokens: int) -> int:
        """Free blocks ``hold_tokens(seq_id, num_tokens)`` would take."""
        seq = self._resident_seq(seq_id)
        num_blocks = -(-self._held_tokens(seq, num_tokens) // self.block_size)
        return sum(max(0, num_blocks - len(table)) for table in seq.block_tables)

    def hold_tokens(self, seq_id: Hashable, num_tokens: int) -> None:
        """Make every group hold the blocks of the sequence's positions below ``num_tokens`` (before the step that
        computes them): the windowed groups of a sequence allocated with fewer tokens take their next blocks."""
        seq = self._resident_seq(seq_id)
        num_blocks = -(-self._held_tokens(seq, num_tokens) // self.block_size)
        self._check_kv_capacity(sum(max(0, num_blocks - len(table)) for table in seq.block_tables),
                                f"holding tokens of sequence {seq_id!r}")
        for table in seq.block_tables:
            table += [self.kv_pool.take() for _ in range(len(table), num_blocks)]

    def window_blocks_to_come(self, seq_id: Hashable, chunk_tokens: int) -> int:
        """Blocks the sequence's windowed groups may still take while its prompt is computed in chunks of at most
        ``chunk_tokens`` (beyond those they hold): what a scheduler keeps free for it."""
        seq = self._resident_seq(seq_id)
        num_blocks = -(-len(seq.token_ids) // self.block_size)
        most = self.max_blocks_held(len(seq.token_ids), chunk_tokens, per_group=True)
        # a group holds its entries from released_below on (those before it are PAD_BLOCK_ID)
        return sum(min(num_blocks - len(table), max(0, limit - (len(table) - released)))
                   for limit, table, released, window in zip(most, seq.block_tables, seq.released_below,
                                                             self.group_windows) if window is not None)

    def max_blocks_held(self, num_tokens: int, chunk_tokens: int, per_group: bool = False):
        """The most blocks a sequence of up to ``num_tokens`` tokens holds at once in all groups (or a list per
        group), its prompt computed in chunks of at most ``chunk_tokens`` with windowed groups given their blocks
        chunk by chunk: a global group holds all ``ceil(num_tokens / block_size)``; a windowed one, during a chunk
        of C tokens from position s, the blocks of positions ``s - window + 1 .. s + C - 1``: at most
        ``ceil((window - 1 + C) / block_size) + 1`` (a decode step is a chunk of 1)."""
        num_blocks = -(-_count(num_tokens, "num_tokens") // self.block_size)
        chunk_tokens = _count(chunk_tokens, "chunk_tokens", minimum=1)
        most = [num_blocks if window is None else min(num_blocks, -(-(window - 1 + chunk_tokens) // self.block_size)
                                                      + 1) for window in self.group_windows]
        return most if per_group else sum(most)

    # ---- decoding ----
    def can_append_slot(self, seq_id: Hashable) -> bool:
        seq = self._resident_seq(seq_id)
        return self._append_blocks_needed(seq) <= self.num_free_blocks

    def append_slot(self, seq_id: Hashable, token_id: int) -> tuple[int, Optional[tuple[int, int]]]:
        """Reserve the slot of one more token; return ``(slot, cow)`` (one KV-cache group only: else
        ``append_slots``).

        ``cow`` is None, or ``(src_block, dst_block)`` when the last block was shared: the caller copies
        ``src_block`` into ``dst_block`` (``copy_blocks``) before writing the new token at ``slot``. The block
        holding ``slot`` then has exactly one owner.
        """
        self._resident_seq(seq_id)
        if self.num_groups != 1:
            raise ValueError(f"append_slot serves one KV-cache group; this manager has {self.num_groups}: use "
                             f"append_slots")
        slots, cows = self.append_slots(seq_id, token_id)
        return slots[0], (cows[0] if cows else None)

    def append_slots(self, seq_id: Hashable, token_id: int) -> tuple[list[int], list[tuple[int, int]]]:
        """Reserve the slots of one more token, one per KV-cache group; return ``(slots, cows)``: the slot in each
        group's table, and the ``(src_block, dst_block)`` copies to make first (see ``append_slot``)."""
        seq = self._resident_seq(seq_id)
        token_id = _token_id(token_id)
        position = len(seq.token_ids)
        self._check_kv_capacity(self._append_blocks_needed(seq), f"appending to sequence {seq_id!r}")
        cows = []
        for table in seq.block_tables:
            if position % self.block_size == 0:
                table.append(self.kv_pool.take())
            elif self.kv_pool.blocks[table[-1]].ref_count > 1:
                src_block_id, dst_block_id = table[-1], self.kv_pool.take()
                self.kv_pool.release(src_block_id)  # still held by others
                table[-1] = dst_block_id
                cows.append((src_block_id, dst_block_id))
        seq.token_ids.append(token_id)
        return [table[-1] * self.block_size + position % self.block_size for table in seq.block_tables], cows

    def mark_computed(self, seq_id: Hashable, num_tokens: Optional[int] = None) -> None:
        """Declare the KV of the sequence's first ``num_tokens`` tokens (default: all it holds) written.

        Call it once the step that wrote them completed. With prefix caching, the full blocks among them are
        published: later ``allocate`` calls can hit them. Blocks never marked are never hit, so a step that
        fails (and whose sequences are freed) leaves no cache entry for KV that was not written. With windowed
        groups it also says that no query before position ``num_tokens`` is still to come: their blocks that
        no later query can see are released.
        """
        seq = self._resident_seq(seq_id)
        num_tokens = len(seq.token_ids) if num_tokens is None else _count(num_tokens, "num_tokens")
        if num_tokens > len(seq.token_ids):
            raise ValueError(f"sequence {seq_id!r} holds {len(seq.token_ids)} tokens, cannot mark {num_tokens} "
                             f"computed")
        if self.enable_prefix_caching:
            for index in range(seq.num_published_blocks, num_tokens // self.block_size):  # extend the chain
                block_ids = {group: table[index] for group, table in enumerate(seq.block_tables)
                             if table[index] != PAD_BLOCK_ID}  # (group 0 is global: it holds every block)
                seq.prefix_hash, seq.prefix_content_id = self.prefix_cache.publish_blocks(
                    block_ids, tuple(seq.token_ids[index * self.block_size:(index + 1) * self.block_size]),
                    seq.prefix_hash, seq.prefix_content_id)
                seq.num_published_blocks = index + 1
        seq.window_floor = max(seq.window_floor, num_tokens)
        for group, table in enumerate(seq.block_tables):
            end = self._first_visible_block(group, seq.window_floor)
            for index in range(seq.released_below[group], end):  # oldest first: the LRU evicts them first
                if table[index] != PAD_BLOCK_ID:
                    self.kv_pool.release(table[index])
                    table[index] = PAD_BLOCK_ID
            seq.released_below[group] = max(seq.released_below[group], end)

    def free(self, seq_id: Hashable) -> None:
        """Drop the sequence (resident or swapped out) and release its blocks."""
        seq = self._seq(seq_id)
        (self.swap_pool if seq.swapped_out else self.kv_pool).release_tables(seq.block_tables)
        del self.seqs[seq_id]

    # ---- paged metadata for the kernels ----
    def block_table(self, seq_id: Hashable, group: int = 0) -> list[int]:
        """A copy of a group's block table (swap block ids while the sequence is swapped out)."""
        return list(self._seq(seq_id).block_tables[self._group_index(group)])

    def block_tables(self, seq_id: Hashable) -> list[list[int]]:
        """Copies of every group's block table."""
        return [list(table) for table in self._seq(seq_id).block_tables]

    def is_swapped_out(self, seq_id: Hashable) -> bool:
        return self._seq(seq_id).swapped_out

    def slot_mapping(self, seq_id: Hashable, start: int, end: int, group: int = 0) -> list[int]:
        """KV cache slots in a group of the token positions ``[start, end)`` of a sequence resident in the KV pool
        (positions of released blocks have none: ValueError)."""
        seq = self._resident_seq(seq_id)
        group = self._group_index(group)
        start, end = _count(start, "start", minimum=None), _count(end, "end", minimum=None)
        if not 0 <= start <= end <= len(seq.token_ids):
            raise ValueError(f"positions [{start}, {end}) are out of range for sequence {seq_id!r} "
                             f"of {len(seq.token_ids)} tokens")
        if start < end and start < seq.released_below[group] * self.block_size:
            raise ValueError(f"positions before {seq.released_below[group] * self.block_size} of sequence "
                             f"{seq_id!r} are out of group {group}'s window: their blocks are released")
        return token_slots(seq.block_tables[group], self.block_size, start, end)

    def block_tables_tensor(self, seq_ids: Iterable[Hashable], device: Union[torch.device, str] = "cpu",
                            group: int = 0) -> torch.Tensor:
        """int32 ``[len(seq_ids), max_blocks]`` block tables of a group, padded with ``PAD_BLOCK_ID``, for
        paged_attention."""
        group = self._group_index(group)
        return block_tables_tensor([self._resident_seq(seq_id).block_tables[group] for seq_id in seq_ids]).to(device)

    def num_blocks_held(self, seq_ids: Iterable[Hashable]) -> int:
        """Distinct blocks (of every group) that these sequences hold, a block shared among them counted once."""
        return len(distinct_block_ids([self._seq(seq_id).block_tables for seq_id in seq_ids]))

    # ---- swapping ----
    def can_swap_out(self, seq_ids: Iterable[Hashable]) -> bool:
        group = self._group(seq_ids, swapped_out=False)
        return len(distinct_block_ids([seq.block_tables for seq in group])) <= self.num_free_swap_blocks

    def swap_out(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """Move a group of resident sequences to swap blocks; return the ``(kv_block, swap_block)`` copies to make.

        A block shared inside the group is moved once and stays shared; released entries stay released. The KV
        blocks are released like on ``free``: a cached full block keeps its (still valid) content in the prefix
        cache as an evictable block, so other sequences can still hit it until its memory is needed.
        """
        group = self._group(seq_ids, swapped_out=False)
        kv_block_ids = distinct_block_ids([seq.block_tables for seq in group])
        if len(kv_block_ids) > self.num_free_swap_blocks:
            raise OutOfBlocksError(f"swapping out {len(group)} sequences needs {len(kv_block_ids)} free swap "
                                   f"blocks, but only {self.num_free_swap_blocks} are free")
        return self._move(group, self.kv_pool, self.swap_pool, swapped_out=True)

    def can_swap_in(self, seq_ids: Iterable[Hashable]) -> bool:
        group = self._group(seq_ids, swapped_out=True)
        return len(distinct_block_ids([seq.block_tables for seq in group])) <= self.num_free_blocks

    def swap_in(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """Move a swapped-out group back to fresh KV blocks; return the ``(swap_block, kv_block)`` copies.

        With prefix caching, the full blocks are published again (or chained onto equal entries still cached)
        by ``mark_computed``, once the caller has copied them in.
        """
        group = self._group(seq_ids, swapped_out=True)
        swap_block_ids = distinct_block_ids([seq.block_tables for seq in group])
        self._check_kv_capacity(len(swap_block_ids), f"swapping in {len(group)} sequences")
        mapping = self._move(group, self.swap_pool, self.kv_pool, swapped_out=False)
        for seq in group:
            seq.prefix_hash = seq.prefix_content_id = None
            seq.num_published_blocks = 0
        return mapping

    # ---- accounting ----
    def stats(self) -> BlockManagerStats:
        resident_seqs = [(len(seq.token_ids), seq.block_tables) for seq in self.seqs.values() if not seq.swapped_out]
        return measure(resident_seqs, self.group_windows, self.block_size, self.kv_pool, self.swap_pool)

    # ---- helpers ----
    def _seq(self, seq_id: Hashable) -> SeqState:
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"unknown sequence {seq_id!r}")
        return seq

    def _resident_seq(self, seq_id: Hashable) -> SeqState:
        seq = self._seq(seq_id)
        if seq.swapped_out:
            raise ValueError(f"sequence {seq_id!r} is swapped out; swap it in first")
        return seq

    def _group_index(self, group: int) -> int:
        group = _count(group, "group")
        if group >= self.num_groups:
            raise ValueError(f"group must be < {self.num_groups} (the KV-cache groups), got {group}")
        return group

    def _first_visible_block(self, group: int, position: int) -> int:
        """The first block of a group that a query at ``position`` (or later) can see."""
        window = self.group_windows[group]
        return 0 if window is None else max(0, (position - window + 1) // self.block_size)

    def _group(self, seq_ids: Iterable[Hashable], swapped_out: bool) -> list[SeqState]:
        seq_ids = list(seq_ids)
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"duplicate sequence ids in swap group {seq_ids!r}")
        group = [self._seq(seq_id) for seq_id in seq_ids]
        for seq_id, seq in zip(seq_ids, group):
            if seq.swapped_out != swapped_out:
                where = "already swapped out" if seq.swapped_out else "not swapped out"
                raise ValueError(f"sequence {seq_id!r} is {where}")
        return group

    @staticmethod
    def _move(group: list[SeqState], source: BlockPool, target: BlockPool, swapped_out: bool) -> list[tuple[int, int]]:
        tables, mapping = move_tables([seq.block_tables for seq in group], source, target)
        for seq, seq_tables in zip(group, tables):
            seq.block_tables, seq.swapped_out = seq_tables, swapped_out
        return mapping

    @staticmethod
    def _prompt(token_ids: Iterable[int]) -> list[int]:
        if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Iterable):
            raise ValueError(f"token_ids must be an iterable of token ids, got {type(token_ids).__name__}")
        token_ids = [_token_id(token_id) for token_id in token_ids]
        if not token_ids:
            raise ValueError("a sequence needs at least one token")
        return token_ids

    def _check_kv_capacity(self, needed: int, action: str) -> None:
        if needed > self.num_free_blocks:
            raise OutOfBlocksError(f"{action} needs {needed} free KV blocks, but only {self.num_free_blocks} "
                                   f"are free ({self.prefix_cache.num_evictable} of them evictable cached blocks)")

    def _blocks_needed(self, token_ids: list[int], hits: list[list[int]], num_tokens: Optional[int] = None) -> int:
        """Free blocks an allocation takes: fresh blocks plus the hits that are now evictable, in every group."""
        num_tokens = len(token_ids) if num_tokens is None else num_tokens
        num_hits = len(hits[0])
        return sum(self._table_length(group, len(token_ids), num_tokens, num_hits) - num_hits
                   for group in range(self.num_groups)) + sum(
            self.kv_pool.blocks[block_id].ref_count == 0 for block_id in held(hits))

    def _table_length(self, group: int, num_token_ids: int, num_tokens: int, num_hits: int) -> int:
        """The entries of a group's table in a new sequence: a global group's cover every token, a windowed one's
        the prefix-cache hits and the positions below num_tokens."""
        held_tokens = num_token_ids if self.group_windows[group] is None else num_tokens
        return max(num_hits, -(-held_tokens // self.block_size))

    def _held_tokens(self, seq: SeqState, num_tokens: int) -> int:
        num_tokens = _count(num_tokens, "num_tokens")
        if num_tokens > len(seq.token_ids):
            raise ValueError(f"num_tokens must be <= the sequence's {len(seq.token_ids)} tokens, got {num_tokens}")
        return num_tokens

    def _append_blocks_needed(self, seq: SeqState) -> int:
        """Blocks an append_slots takes: in each group a new last block, or a copy of a shared one."""
        if len(seq.token_ids) % self.block_size == 0:
            return self.num_groups
        return sum(self.kv_pool.blocks[table[-1]].ref_count > 1 for table in seq.block_tables)

    def _prefix_hits(self, token_ids: list[int]) -> list[list[int]]:
        """Per group, the cached blocks of the longest prefix every group can serve (``PrefixCache.hits``)."""
        if not self.enable_prefix_caching:
            return [[] for _ in self.group_windows]
        return self.prefix_cache.hits(token_ids, self.num_groups, self._first_visible_block)



def _count(value, name: str, minimum: Optional[int] = 0) -> int:
    """``value`` as a Python int >= ``minimum`` (None: any); bools and floats (even integral ones) are refused."""
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _token_id(value) -> int:
    return _count(value, "a token id")
