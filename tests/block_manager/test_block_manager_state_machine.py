"""Random interleavings of every BlockManager operation against a simulated KV cache.

The simulated cache holds, in each slot, a stand-in for the KV of a token: the tuple of the tokens up to and
including it (real KV depends on the whole prefix, so a prefix-cache hit on equal tokens after a different
prefix must show up as wrong data). The machine writes each new token's stand-in into the slot the manager
hands out, performs the returned copy-on-write and swap copies block by block, marks the KV computed (at once or
later), and after every step checks that each sequence reads back exactly its own tokens through its block table,
that every cached block really holds its tokens, and that the reference counts and free lists agree with the
block tables. Failed steps are simulated too: sequences are allocated or extended, garbage is written where their
KV would go, and they are freed without being marked computed; no cached block may ever hold that garbage.

The manager may have several KV-cache groups, global or windowed (window-aware memory): every group's slots are
written, and each group's table must hold exactly the blocks that a query still to come can see (from the block
of position ``floor - window + 1`` on, ``floor`` being the most tokens marked computed or found cached): released
entries before them, and each group's blocks read back their tokens.
"""

from collections import Counter

import pytest
from conftest import snapshot
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from paged_attn import prefix_cache
from paged_attn.block_manager import PAD_BLOCK_ID, BlockManager, OutOfBlocksError

EMPTY = None  # a simulated slot that no token was ever written to
GARBAGE = ("garbage",)  # what a failed step leaves in the slots it was writing
tokens_strategy = st.lists(st.integers(0, 2), min_size=1, max_size=8)  # tiny vocabulary: prefixes repeat


def kv(tokens, position):
    """What the simulated cache stores for token ``position`` of a sequence."""
    return tuple(tokens[:position + 1])


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(num_kv_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 3, 4]),
                num_swap_blocks=st.integers(0, 8), enable_prefix_caching=st.booleans(),
                hash_kind=st.sampled_from(["chained", "chained", "weak", "constant"]),
                group_windows=st.sampled_from([(None,), (None,), (None, 1), (None, 3), (None, 2, 5), (None, None, 4),
                                               (4,), (2, None)]))
    def setup(self, num_kv_blocks, block_size, num_swap_blocks, enable_prefix_caching, hash_kind, group_windows):
        # "weak" drops the parent from the hash and "constant" makes every block collide: neither may ever
        # produce a wrong hit, which the read-back invariant would catch.
        self.real_hash = prefix_cache._block_hash
        if hash_kind == "weak":
            prefix_cache._block_hash = lambda parent_hash, token_ids: hash(token_ids) % 5
        elif hash_kind == "constant":
            prefix_cache._block_hash = lambda parent_hash, token_ids: 0
        if enable_prefix_caching and group_windows[0] is not None:
            with pytest.raises(ValueError, match="group 0 must be global"):
                BlockManager(num_kv_blocks, block_size, enable_prefix_caching=True, group_windows=group_windows)
            enable_prefix_caching = False
        self.bm = BlockManager(num_kv_blocks, block_size, num_swap_blocks=num_swap_blocks,
                               enable_prefix_caching=enable_prefix_caching, group_windows=group_windows)
        self.floor = {}  # seq_id -> no query before this position is still to come
        self.kv_cache = [EMPTY] * (num_kv_blocks * block_size)
        self.swap_cache = [EMPTY] * (num_swap_blocks * block_size)
        self.expected = {}  # seq_id -> the tokens the sequence must read back
        self.past_prompts = []  # token lists of current and earlier sequences, to draw shared prefixes from
        self.next_seq_id = 0

    def teardown(self):
        if hasattr(self, "real_hash"):
            prefix_cache._block_hash = self.real_hash

    # ---- helpers ----

    def seq_ids(self, swapped_out):
        return [s for s in sorted(self.expected) if self.bm.is_swapped_out(s) == swapped_out]

    # Rules that need a sequence do nothing when there is none (preconditions would make hypothesis give up).
    def pick(self, index, swapped_out=None):
        candidates = sorted(self.expected) if swapped_out is None else self.seq_ids(swapped_out)
        return candidates[index % len(candidates)] if candidates else None

    def pick_group(self, indices, swapped_out):
        candidates = self.seq_ids(swapped_out)
        return list(dict.fromkeys(candidates[i % len(candidates)] for i in indices)) if candidates else None

    def expect_unchanged(self, error, call, *args):
        before = snapshot(self.bm)
        try:
            call(*args)
        except error:
            pass
        else:
            raise AssertionError(f"{call.__name__}{args} did not raise {error.__name__}")
        assert snapshot(self.bm) == before

    def write(self, slot, value):
        # Whoever writes a slot must be the only owner of its block.
        assert self.bm.kv_pool.blocks[slot // self.bm.block_size].ref_count == 1
        self.kv_cache[slot] = value

    def copy_block(self, src_cache, src, dst_cache, dst):
        bs = self.bm.block_size
        dst_cache[dst * bs:(dst + 1) * bs] = src_cache[src * bs:(src + 1) * bs]

    # ---- rules ----

    def new_prompt(self, tail, base, cut):
        prefix = self.past_prompts[base % len(self.past_prompts)][:cut] if self.past_prompts and base % 3 else []
        seq_id, self.next_seq_id = self.next_seq_id, self.next_seq_id + 1
        return seq_id, prefix + tail

    def append(self, seq_id, token, tokens):
        """append_slot(s) and the copies-on-write; returns each group's slot to write, or None when out of blocks."""
        bm = self.bm
        if not bm.can_append_slot(seq_id):
            self.expect_unchanged(OutOfBlocksError, bm.append_slots, seq_id, token)
            self.expect_unchanged(OutOfBlocksError if bm.num_groups == 1 else ValueError, bm.append_slot, seq_id,
                                  token)
            return None
        if bm.num_groups == 1:
            slot, cow = bm.append_slot(seq_id, token)
            slots, cows = [slot], [] if cow is None else [cow]
        else:
            self.expect_unchanged(ValueError, bm.append_slot, seq_id, token)
            slots, cows = bm.append_slots(seq_id, token)
        assert len(slots) == bm.num_groups
        for src, dst in cows:
            assert src != dst and bm.kv_pool.blocks[src].ref_count >= 1
            self.copy_block(self.kv_cache, src, self.kv_cache, dst)
        tokens.append(token)
        return slots

    def slots(self, seq_id, start, end):
        return [slot for group in range(self.bm.num_groups) for slot in self.bm.slot_mapping(seq_id, start, end, group)]

    def mark(self, seq_id, num_tokens=None):
        self.bm.mark_computed(seq_id, num_tokens)
        num_tokens = len(self.expected[seq_id]) if num_tokens is None else num_tokens
        self.floor[seq_id] = max(self.floor[seq_id], num_tokens)

    @rule(tail=tokens_strategy, base=st.integers(0, 1000), cut=st.integers(0, 12), computed=st.booleans())
    def allocate(self, tail, base, cut, computed):
        seq_id, prompt = self.new_prompt(tail, base, cut)
        if not self.bm.can_allocate(prompt):
            self.expect_unchanged(OutOfBlocksError, self.bm.allocate, seq_id, prompt)
            return
        cached = self.bm.allocate(seq_id, prompt)
        assert 0 <= cached <= len(prompt) - 1 and cached % self.bm.block_size == 0
        assert cached == 0 or self.bm.enable_prefix_caching
        for group in range(self.bm.num_groups):
            for position, slot in enumerate(self.bm.slot_mapping(seq_id, cached, len(prompt), group), start=cached):
                self.write(slot, kv(prompt, position))
        self.expected[seq_id], self.floor[seq_id] = list(prompt), cached
        if computed:
            self.mark(seq_id)
        self.past_prompts = (self.past_prompts + [prompt])[-16:]

    @rule(tail=st.lists(st.integers(0, 2), min_size=1, max_size=20), base=st.integers(0, 1000),
          cut=st.integers(0, 12), chunk_tokens=st.integers(1, 7), chunks=st.lists(st.integers(1, 7), max_size=8))
    def allocate_in_chunks(self, tail, base, cut, chunk_tokens, chunks):
        """A prompt computed in chunks of at most chunk_tokens, its windowed groups given their blocks chunk by
        chunk (allocate with num_tokens=0, then hold_tokens before each chunk): no group ever holds more than
        max_blocks_held says, and each chunk needs no more than window_blocks_to_come promised. Out of blocks,
        the sequence is dropped (a preemption); the rule ends with the whole prompt computed."""
        bm = self.bm
        seq_id, prompt = self.new_prompt(tail, base, cut)
        if not bm.can_allocate(prompt, num_tokens=0):
            self.expect_unchanged(OutOfBlocksError, bm.allocate, seq_id, prompt, 0)
            return
        start = bm.allocate(seq_id, prompt, num_tokens=0)
        self.expected[seq_id], self.floor[seq_id] = list(prompt), start
        most = bm.max_blocks_held(len(prompt), chunk_tokens, per_group=True)
        sizes = iter(chunks)
        while start < len(prompt):
            end = min(len(prompt), start + min(next(sizes, chunk_tokens), chunk_tokens))
            needed = bm.blocks_to_hold(seq_id, end)
            assert needed <= bm.window_blocks_to_come(seq_id, chunk_tokens)
            if needed > bm.num_free_blocks:
                self.expect_unchanged(OutOfBlocksError, bm.hold_tokens, seq_id, end)
                bm.free(seq_id)
                del self.expected[seq_id]
                return
            bm.hold_tokens(seq_id, end)
            for group, table in enumerate(bm.block_tables(seq_id)):
                assert sum(b != PAD_BLOCK_ID for b in table) <= most[group], (group, table, most)
                for position, slot in enumerate(bm.slot_mapping(seq_id, start, end, group), start=start):
                    self.write(slot, kv(prompt, position))
            self.mark(seq_id, end)
            start = end
        assert bm.window_blocks_to_come(seq_id, chunk_tokens) == 0
        self.past_prompts = (self.past_prompts + [prompt])[-16:]

    @rule(index=st.integers(0, 1000), token=st.integers(0, 2), computed=st.booleans())
    def append_slot(self, index, token, computed):
        seq_id = self.pick(index, swapped_out=False)
        if seq_id is None:
            return
        tokens = self.expected[seq_id]
        slots = self.append(seq_id, token, tokens)
        if slots is None:
            return
        for slot in slots:
            self.write(slot, kv(tokens, len(tokens) - 1))
        if computed:
            self.mark(seq_id)
        if len(tokens) % self.bm.block_size == 0:
            self.past_prompts = (self.past_prompts + [list(tokens)])[-16:]

    @rule(index=st.integers(0, 1000), cut=st.integers(0, 1000))
    def mark_computed(self, index, cut):
        seq_id = self.pick(index, swapped_out=False)
        if seq_id is not None:
            self.mark(seq_id, cut % (len(self.expected[seq_id]) + 1))

    @rule(tail=tokens_strategy, base=st.integers(0, 1000), cut=st.integers(0, 12), index=st.integers(0, 1000),
          tokens=st.lists(st.integers(0, 2), max_size=6))
    def failed_step(self, tail, base, cut, index, tokens):
        """A step that dies half-way: a new prompt and a forked sample are given slots, garbage lands where
        their KV would go, and both are freed without mark_computed (what the engine does on an error)."""
        doomed = []
        seq_id, prompt = self.new_prompt(tail, base, cut)
        if self.bm.can_allocate(prompt):
            cached = self.bm.allocate(seq_id, prompt)
            doomed.append(seq_id)
            for slot in self.slots(seq_id, cached, len(prompt)):
                self.write(slot, GARBAGE)
        parent = self.pick(index, swapped_out=False)
        if parent is not None:
            child, self.next_seq_id = self.next_seq_id, self.next_seq_id + 1
            self.bm.fork(parent, child)
            doomed.append(child)
            child_tokens = list(self.expected[parent])
            for token in tokens:
                slots = self.append(child, token, child_tokens)
                if slots is None:
                    break
                for slot in slots:
                    self.write(slot, GARBAGE)
        for seq_id in doomed:
            self.bm.free(seq_id)

    @rule(index=st.integers(0, 1000))
    def fork(self, index):
        parent = self.pick(index)
        if parent is None:
            return
        child, self.next_seq_id = self.next_seq_id, self.next_seq_id + 1
        self.bm.fork(parent, child)
        self.expected[child], self.floor[child] = list(self.expected[parent]), self.floor[parent]

    @rule(index=st.integers(0, 1000))
    def free(self, index):
        seq_id = self.pick(index)
        if seq_id is None:
            return
        self.bm.free(seq_id)
        del self.expected[seq_id]
        self.expect_unchanged(KeyError, self.bm.free, seq_id)  # double free

    @rule(indices=st.lists(st.integers(0, 1000), min_size=1, max_size=3))
    def swap_out(self, indices):
        group = self.pick_group(indices, swapped_out=False)
        if group is None:
            return
        if not self.bm.can_swap_out(group):
            self.expect_unchanged(OutOfBlocksError, self.bm.swap_out, group)
            return
        mapping = self.bm.swap_out(group)
        assert len({gpu for gpu, _ in mapping}) == len({cpu for _, cpu in mapping}) == len(mapping)
        for kv_block, swap_block in mapping:
            self.copy_block(self.kv_cache, kv_block, self.swap_cache, swap_block)

    @rule(indices=st.lists(st.integers(0, 1000), min_size=1, max_size=3))
    def swap_in(self, indices):
        group = self.pick_group(indices, swapped_out=True)
        if group is None:
            return
        if not self.bm.can_swap_in(group):
            self.expect_unchanged(OutOfBlocksError, self.bm.swap_in, group)
            return
        mapping = self.bm.swap_in(group)
        assert len({cpu for cpu, _ in mapping}) == len({gpu for _, gpu in mapping}) == len(mapping)
        for swap_block, kv_block in mapping:
            self.copy_block(self.swap_cache, swap_block, self.kv_cache, kv_block)
        for seq_id in group:
            self.mark(seq_id)

    @rule(index=st.integers(0, 1000))
    def misuse(self, index):
        seq_id = self.pick(index)
        if seq_id is None:
            return
        unknown = self.next_seq_id
        self.expect_unchanged(ValueError, self.bm.allocate, seq_id, [0])
        self.expect_unchanged(KeyError, self.bm.append_slot, unknown, 0)
        self.expect_unchanged(KeyError, self.bm.fork, unknown, unknown + 1)
        self.expect_unchanged(ValueError, self.bm.fork, seq_id, seq_id)
        self.expect_unchanged(KeyError, self.bm.swap_out, [unknown])
        self.expect_unchanged(ValueError, self.bm.swap_out, [seq_id, seq_id])
        if self.bm.is_swapped_out(seq_id):
            self.expect_unchanged(ValueError, self.bm.swap_out, [seq_id])
            self.expect_unchanged(ValueError, self.bm.append_slot, seq_id, 0)
            self.expect_unchanged(ValueError, self.bm.slot_mapping, seq_id, 0, 1)
        else:
            self.expect_unchanged(ValueError, self.bm.swap_in, [seq_id])
            self.expect_unchanged(ValueError, self.bm.slot_mapping, seq_id, 0, len(self.expected[seq_id]) + 1)
            self.expect_unchanged(ValueError, self.bm.mark_computed, seq_id, len(self.expected[seq_id]) + 1)
            for bad_token in ([1], 1.0, -1, None):
                self.expect_unchanged(ValueError, self.bm.append_slot, seq_id, bad_token)
        for bad_prompt in ([0, [1]], [0, -1], [0, 1.0], [], 3):
            self.expect_unchanged(ValueError, self.bm.allocate, unknown, bad_prompt)
            self.expect_unchanged(ValueError, self.bm.can_allocate, bad_prompt)
        self.expect_unchanged(ValueError, self.bm.can_allocate, [0], -1)

    # ---- invariants ----

    @invariant()
    def blocks_are_accounted_for(self):
        bm = self.bm
        def holders(swapped_out):
            return Counter(b for s in bm.seqs.values() if s.swapped_out == swapped_out for table in s.block_tables
                           for b in table if b != PAD_BLOCK_ID)
        kv_holders, swap_holders = holders(False), holders(True)
        assert [b.ref_count for b in bm.kv_pool.blocks] == [kv_holders[i] for i in range(bm.num_kv_blocks)]
        assert [b.ref_count for b in bm.swap_pool.blocks] == [swap_holders[i] for i in range(bm.num_swap_blocks)]
        assert bm.kv_pool.num_refs == sum(kv_holders.values()) and bm.swap_pool.num_refs == sum(swap_holders.values())

        free, evictable = list(bm.kv_pool.free_block_ids), list(bm.prefix_cache.evictable_block_ids)
        free_swap = list(bm.swap_pool.free_block_ids)
        assert len(set(free)) == len(free) and len(set(free_swap)) == len(free_swap)
        assert not set(free) & set(evictable) and not set(free + evictable) & set(kv_holders)
        assert not set(free_swap) & set(swap_holders)
        assert len(free) + len(evictable) + len(kv_holders) == bm.num_kv_blocks == len(bm.kv_pool.blocks)
        assert len(free_swap) + len(swap_holders) == bm.num_swap_blocks == len(bm.swap_pool.blocks)
        assert bm.num_free_blocks == len(free) + len(evictable)

        # The prefix cache: its dict and its entries agree; plain free blocks are uncached, evictable ones cached.
        entries = bm.prefix_cache.entries
        assert all(entries[b].key == h for h, b in bm.prefix_cache.hash_to_block_id.items())
        assert sorted(bm.prefix_cache.hash_to_block_id.values()) == sorted(entries)
        assert all(b not in entries for b in free)
        assert all(b in entries for b in evictable)
        if not bm.enable_prefix_caching:
            assert not bm.prefix_cache.hash_to_block_id

    def first_visible(self, seq_id, group):
        """The first position of the group's first block that a query still to come can see."""
        window, bs = self.bm.group_windows[group], self.bm.block_size
        return 0 if window is None else max(0, (self.floor[seq_id] - window + 1) // bs) * bs

    @invariant()
    def sequences_read_back_their_tokens(self):
        bm, bs = self.bm, self.bm.block_size
        assert set(bm.seqs) == set(self.expected)
        for seq_id, tokens in self.expected.items():
            for group in range(bm.num_groups):
                table, first = bm.block_table(seq_id, group), self.first_visible(seq_id, group)
                assert len(table) == -(-len(tokens) // bs)
                # exactly the blocks a query still to come can see are held
                assert [b == PAD_BLOCK_ID for b in table] == [i < first // bs for i in range(len(table))], seq_id
                if bm.is_swapped_out(seq_id):
                    read = [self.swap_cache[table[i // bs] * bs + i % bs] for i in range(first, len(tokens))]
                else:
                    read = [self.kv_cache[slot] for slot in bm.slot_mapping(seq_id, first, len(tokens), group)]
                    if first:
                        self.expect_unchanged(ValueError, bm.slot_mapping, seq_id, first - 1, len(tokens), group)
                assert read == [kv(tokens, i) for i in range(first, len(tokens))], (seq_id, group)

    @invariant()
    def cached_blocks_hold_their_tokens(self):
        """Every cached block holds the KV of its tokens, all after one same prefix (never garbage or nothing)."""
        bs = self.bm.block_size
        for block_id, entry in self.bm.prefix_cache.entries.items():
            stored = self.kv_cache[block_id * bs:(block_id + 1) * bs]
            assert all(isinstance(value, tuple) and value != GARBAGE for value in stored), stored
            prefix = stored[0][:-1]
            assert stored == [prefix + entry.token_ids[:i + 1] for i in range(bs)], stored

    @invariant()
    def stats_agree(self):
        bm, bs = self.bm, self.bm.block_size
        stats = bm.stats()
        resident_seqs = [s for s in self.expected if not bm.is_swapped_out(s)]
        used = sum(b.ref_count > 0 for b in bm.kv_pool.blocks)
        assert stats.kv_blocks_used == used and stats.kv_blocks_free == bm.num_kv_blocks - used
        assert stats.kv_blocks_cached == len(bm.prefix_cache.evictable_block_ids)
        assert stats.swap_blocks_used == sum(b.ref_count > 0 for b in bm.swap_pool.blocks)
        assert stats.num_tokens == sum(len(self.expected[s]) for s in resident_seqs)
        assert stats.logical_blocks == sum(b != PAD_BLOCK_ID for s in resident_seqs for t in bm.block_tables(s)
                                           for b in t)
        assert stats.blocks_saved_by_sharing == stats.logical_blocks - used >= 0
        assert sum(stats.kv_blocks_by_attention_type.values()) == used
        windowed = [g for g, w in enumerate(bm.group_windows) if w is not None]
        assert stats.kv_blocks_by_attention_type.get("sliding_window", 0) == len(
            {b for s in resident_seqs for g in windowed for b in bm.block_table(s, g) if b != PAD_BLOCK_ID})
        filled_slots = {slot for s in resident_seqs for g in range(bm.num_groups)
                        for slot in bm.slot_mapping(s, self.first_visible(s, g), len(self.expected[s]), g)}
        assert stats.internal_fragmentation == used * bs - len(filled_slots)
        assert 0.0 <= stats.utilization <= 1.0
        if used:
            assert stats.utilization == pytest.approx(len(filled_slots) / (used * bs))


BlockManagerMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestBlockManagerMachine = BlockManagerMachine.TestCase
