"""Unit tests of the BlockManager: each method, each error, and that every error leaves the state unchanged.

The random interleavings live in test_block_manager_state_machine.py.
"""

import dataclasses

import pytest
import torch
from conftest import snapshot

from paged_attn import prefix_cache
from paged_attn.block_manager import PAD_BLOCK_ID, BlockManager, OutOfBlocksError


def raises_unchanged(bm, error, call, *args, match=None):
    before = snapshot(bm)
    with pytest.raises(error, match=match):
        call(*args)
    assert snapshot(bm) == before


def ref_counts(bm, block_ids):
    return [bm.kv_pool.blocks[b].ref_count for b in block_ids]


def allocate_computed(bm, seq_id, token_ids):
    """allocate, then mark the KV computed, as an engine does once the step that writes it has completed."""
    cached = bm.allocate(seq_id, token_ids)
    bm.mark_computed(seq_id)
    return cached


# ---- construction ----

@pytest.mark.parametrize("args, kwargs", [
    ((0,), {}), ((-1,), {}), ((4, 0), {}), ((4, -2), {}), ((4, 4), {"num_swap_blocks": -1}),
])
def test_bad_constructor_arguments(args, kwargs):
    with pytest.raises(ValueError):
        BlockManager(*args, **kwargs)


def test_new_manager_is_empty():
    bm = BlockManager(8, 4, num_swap_blocks=3)
    assert (bm.num_kv_blocks, bm.block_size, bm.num_swap_blocks) == (8, 4, 3)
    assert bm.num_free_blocks == 8 and bm.num_free_swap_blocks == 3
    stats = bm.stats()
    assert stats.kv_blocks_used == 0 and stats.num_tokens == 0 and stats.utilization == 0.0



def test_the_old_gpu_and_cpu_names_still_work_and_warn():
    """num_gpu_blocks / num_cpu_blocks named a pool that is on the engine's device (often the CPU) and the swap
    space: the keywords and attributes keep working, with a DeprecationWarning."""
    with pytest.warns(DeprecationWarning) as record:
        bm = BlockManager(num_gpu_blocks=8, block_size=4, num_cpu_blocks=3)
    assert sorted(str(w.message) for w in record) == ["num_cpu_blocks is deprecated; use num_swap_blocks",
                                                      "num_gpu_blocks is deprecated; use num_kv_blocks"]
    assert (bm.num_kv_blocks, bm.num_swap_blocks) == (8, 3)
    stats = bm.stats()
    for obj, old, value in [(bm, "num_gpu_blocks", 8), (bm, "num_cpu_blocks", 3), (bm, "num_free_cpu_blocks", 3),
                            (stats, "num_gpu_blocks", 8), (stats, "gpu_blocks_used", 0), (stats, "gpu_blocks_free", 8),
                            (stats, "gpu_blocks_cached", 0), (stats, "cpu_blocks_used", 0),
                            (stats, "gpu_blocks_by_attention_type", {"global": 0})]:
        with pytest.warns(DeprecationWarning, match=f"{old} is deprecated"):
            assert getattr(obj, old) == value
    assert "gpu_blocks_used" not in dataclasses.asdict(stats)
    with pytest.raises(TypeError, match="'num_kv_blocks' and its deprecated name 'num_gpu_blocks'"):
        BlockManager(num_kv_blocks=8, num_gpu_blocks=8)


def test_error_is_a_runtime_error_exported_by_the_package():
    import paged_attn

    assert issubclass(OutOfBlocksError, RuntimeError)
    assert paged_attn.OutOfBlocksError is OutOfBlocksError and paged_attn.BlockManager is BlockManager


# ---- allocate / free ----

def test_allocate_gives_one_block_per_block_size_tokens():
    bm = BlockManager(8, 4)
    assert bm.allocate("a", range(9)) == 0
    table = bm.block_table("a")
    assert len(table) == 3 and len(set(table)) == 3
    assert bm.num_free_blocks == 5
    assert bm.slot_mapping("a", 0, 9) == [table[i // 4] * 4 + i % 4 for i in range(9)]
    table.append(99)  # block_table returns a copy
    assert len(bm.block_table("a")) == 3


def test_allocate_exact_fit_and_out_of_blocks():
    bm = BlockManager(3, 4)
    assert bm.can_allocate(range(12)) and not bm.can_allocate(range(13))
    assert bm.can_allocate(range(8), keep_free=1) and not bm.can_allocate(range(9), keep_free=1)
    raises_unchanged(bm, OutOfBlocksError, bm.allocate, "a", range(13), match="needs 4 free KV blocks.*only 3")
    bm.allocate("a", range(5))
    assert not bm.can_allocate(range(5))
    raises_unchanged(bm, OutOfBlocksError, bm.allocate, "b", range(5), match="needs 2 .*only 1")
    assert "b" not in bm.seqs


def test_allocate_errors():
    bm = BlockManager(4, 4)
    bm.allocate("a", [1, 2])
    raises_unchanged(bm, ValueError, bm.allocate, "a", [1], match="already exists")
    raises_unchanged(bm, ValueError, bm.allocate, "b", [], match="at least one token")
    with pytest.raises(ValueError):
        bm.can_allocate([])


def test_free_releases_blocks_and_rejects_double_free():
    bm = BlockManager(4, 2)
    bm.allocate(0, range(3))
    bm.free(0)
    assert bm.num_free_blocks == 4 and bm.stats().kv_blocks_used == 0
    raises_unchanged(bm, KeyError, bm.free, 0, match="unknown sequence 0")
    raises_unchanged(bm, KeyError, bm.free, "never")


# ---- append_slot / copy-on-write ----

def test_append_slot_fills_the_last_block_then_takes_a_new_one():
    bm = BlockManager(4, 4)
    bm.allocate(0, range(3))
    first = bm.block_table(0)[0]
    assert bm.can_append_slot(0)
    assert bm.append_slot(0, 3) == (first * 4 + 3, None)
    slot, cow = bm.append_slot(0, 4)
    second = bm.block_table(0)[1]
    assert (slot, cow) == (second * 4, None) and second != first
    assert bm.slot_mapping(0, 3, 5) == [first * 4 + 3, second * 4]
    assert bm.stats().num_tokens == 5


def test_append_slot_out_of_blocks_only_at_a_block_boundary():
    bm = BlockManager(1, 2)
    bm.allocate(0, [7])
    assert bm.can_append_slot(0)
    bm.append_slot(0, 8)  # fills the only block
    assert not bm.can_append_slot(0)
    raises_unchanged(bm, OutOfBlocksError, bm.append_slot, 0, 9, match="needs 1 free KV blocks.*only 0")


def test_append_slot_errors():
    bm = BlockManager(2, 2, num_swap_blocks=2)
    raises_unchanged(bm, KeyError, bm.append_slot, "x", 1)
    with pytest.raises(KeyError):
        bm.can_append_slot("x")
    bm.allocate(0, [1])
    bm.swap_out([0])
    raises_unchanged(bm, ValueError, bm.append_slot, 0, 1, match="swapped out")
    with pytest.raises(ValueError):
        bm.can_append_slot(0)


def test_fork_shares_blocks_and_append_copies_on_write():
    bm = BlockManager(8, 4)
    bm.allocate("parent", range(6))
    bm.fork("parent", "child")
    shared = bm.block_table("parent")
    assert bm.block_table("child") == shared and ref_counts(bm, shared) == [2, 2]
    assert bm.stats().blocks_saved_by_sharing == 2

    slot, cow = bm.append_slot("child", 100)
    src, dst = cow
    assert src == shared[1] and dst not in shared
    assert bm.block_table("child") == [shared[0], dst] and slot == dst * 4 + 2
    assert ref_counts(bm, [shared[0], src, dst]) == [2, 1, 1]
    assert bm.append_slot("parent", 200) == (src * 4 + 2, None)  # the parent now owns its block alone


def test_fork_of_a_full_last_block_needs_no_copy():
    bm = BlockManager(8, 4)
    bm.allocate(0, range(4))
    bm.fork(0, 1)
    slot, cow = bm.append_slot(1, 4)
    assert cow is None and bm.block_table(1)[0] == bm.block_table(0)[0]
    assert slot == bm.block_table(1)[1] * 4


def test_copy_on_write_out_of_blocks():
    bm = BlockManager(1, 4)
    bm.allocate(0, [1, 2])
    bm.fork(0, 1)
    assert not bm.can_append_slot(1)
    raises_unchanged(bm, OutOfBlocksError, bm.append_slot, 1, 3)


def test_fork_errors():
    bm = BlockManager(4, 4)
    bm.allocate(0, [1])
    bm.allocate(1, [2])
    raises_unchanged(bm, KeyError, bm.fork, "missing", 5, match="unknown sequence 'missing'")
    raises_unchanged(bm, ValueError, bm.fork, 0, 1, match="already exists")
    raises_unchanged(bm, ValueError, bm.fork, 0, 0)


def test_free_of_a_forked_sequence_keeps_the_shared_blocks():
    bm = BlockManager(4, 4)
    bm.allocate(0, range(5))
    bm.fork(0, 1)
    bm.free(0)
    assert ref_counts(bm, bm.block_table(1)) == [1, 1] and bm.num_free_blocks == 2


# ---- paged metadata ----

def test_slot_mapping_ranges():
    bm = BlockManager(4, 2)
    bm.allocate(0, range(3))
    assert bm.slot_mapping(0, 1, 1) == [] and len(bm.slot_mapping(0, 0, 3)) == 3
    for start, end in [(-1, 2), (0, 4), (2, 1)]:
        raises_unchanged(bm, ValueError, bm.slot_mapping, 0, start, end, match="out of range")
    raises_unchanged(bm, KeyError, bm.slot_mapping, 1, 0, 1)


def test_block_tables_tensor_is_padded_int32():
    bm = BlockManager(8, 2)
    bm.allocate("a", range(5))
    bm.allocate("b", range(1))
    tables = bm.block_tables_tensor(["a", "b"], "cpu")
    assert tables.dtype == torch.int32 and tables.shape == (2, 3)
    assert tables[0].tolist() == bm.block_table("a")
    assert tables[1].tolist() == bm.block_table("b") + [PAD_BLOCK_ID] * 2
    assert bm.block_tables_tensor(["b", "a"])[0, 1].item() == PAD_BLOCK_ID
    assert bm.block_tables_tensor([]).shape == (0, 0)
    with pytest.raises(KeyError):
        bm.block_tables_tensor(["a", "zzz"])


# ---- prefix caching ----

def test_prefix_cache_hit_shares_full_blocks_only():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    assert allocate_computed(bm, 0, range(10)) == 0
    assert allocate_computed(bm, 1, list(range(9)) + [42]) == 8
    t0, t1 = bm.block_table(0), bm.block_table(1)
    assert t1[:2] == t0[:2] and t1[2] != t0[2]
    assert ref_counts(bm, t0) == [2, 2, 1]


def test_prefix_cache_disabled_never_hits():
    bm = BlockManager(8, 4)
    allocate_computed(bm, 0, range(8))
    assert allocate_computed(bm, 1, range(8)) == 0 and not set(bm.block_table(0)) & set(bm.block_table(1))


def test_fully_cached_prompt_recomputes_its_last_block_in_a_fresh_block():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    allocate_computed(bm, 0, range(8))
    assert allocate_computed(bm, 1, range(8)) == 4  # never the block holding the last token
    t0, t1 = bm.block_table(0), bm.block_table(1)
    assert t1[0] == t0[0] and t1[1] != t0[1]
    assert ref_counts(bm, t1) == [2, 1]  # the block the engine writes has one owner
    assert allocate_computed(bm, 2, range(9)) == 8  # the duplicate did not displace the cached block
    assert bm.block_table(2)[:2] == t0


def test_equal_blocks_at_different_positions_do_not_match():
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    allocate_computed(bm, 0, [5, 5, 5, 5, 1])
    assert allocate_computed(bm, 1, [7, 7, 5, 5, 1]) == 0  # second block equal, but its prefix differs
    assert allocate_computed(bm, 2, [5, 5, 5, 5, 2]) == 4


def test_generated_tokens_become_cacheable():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    allocate_computed(bm, 0, range(6))
    bm.append_slot(0, 6)
    bm.append_slot(0, 7)  # fills the second block
    assert bm.allocate(1, range(9)) == 4  # the second block's KV is not written yet
    bm.mark_computed(0)
    assert allocate_computed(bm, 2, range(9)) == 8
    assert bm.block_table(2)[:2] == bm.block_table(0)


# ---- publication: a block is hit only once its KV is written ----

def test_blocks_are_hit_only_once_marked_computed():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    bm.allocate("a", range(10))  # slots handed out; the KV is not written yet
    assert bm.allocate("b", range(10)) == 0  # (same step: computes its own copy)
    assert bm.stats().kv_blocks_used == 6
    bm.mark_computed("a", 7)  # only the first block is entirely written
    assert bm.allocate("c", range(10)) == 4
    bm.mark_computed("a")
    assert bm.allocate("d", range(10)) == 8
    assert bm.block_table("d")[:2] == bm.block_table("a")[:2]
    bm.mark_computed("b")  # equal content is cached once: b chains onto a's entries
    assert bm.allocate("e", range(10)) == 8 and bm.block_table("e")[:2] == bm.block_table("a")[:2]


def test_a_failed_step_publishes_nothing():
    """The sequences of a step that never completed are freed without mark_computed: their blocks go back to the
    free list, not to the prefix cache, so nobody ever hits KV that was not written."""
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    allocate_computed(bm, "old", range(5))  # [0..3] published
    bm.allocate("aborted", list(range(8)) + [9])  # the step writing [4..7] fails
    bm.fork("old", "sample")
    for token in (4, 5, 6):
        bm.append_slot("sample", token)  # fills [0..3] [4 5 6 ...]: a decode step that fails
    bm.append_slot("sample", 7)
    bm.free("aborted")
    bm.free("sample")
    stats = bm.stats()
    assert stats.kv_blocks_cached == 0 and stats.kv_blocks_used == 2
    assert len(bm.prefix_cache.hash_to_block_id) == 1  # only [0..3], written by a completed step
    assert bm.allocate("next", range(9)) == 4


def test_mark_computed_errors_change_nothing():
    bm = BlockManager(8, 2, num_swap_blocks=4, enable_prefix_caching=True)
    bm.allocate(0, range(5))
    raises_unchanged(bm, KeyError, bm.mark_computed, 1)
    raises_unchanged(bm, ValueError, bm.mark_computed, 0, 6, match="holds 5 tokens")
    for bad in (-1, 2.0, True, "3"):
        raises_unchanged(bm, ValueError, bm.mark_computed, 0, bad)
    bm.swap_out([0])
    raises_unchanged(bm, ValueError, bm.mark_computed, 0, match="swapped out")


# ---- arguments that are not what they should be ----

@pytest.mark.parametrize("args, kwargs", [
    ((8.0,), {}), ((8, 16.0), {}), ((8, True), {}), ((8, "4"), {}), ((8, 4), {"num_swap_blocks": 2.5}),
])
def test_constructor_refuses_non_integers(args, kwargs):
    with pytest.raises(ValueError, match="must be an integer"):
        BlockManager(*args, **kwargs)


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("bad", [[1, [2], 3], [1, 2.0], [1, -1], [True, 1], [1, "2"], [None], "abc", 7])
def test_bad_token_ids_are_refused_before_anything_is_taken(prefix_caching, bad):
    bm = BlockManager(8, 2, enable_prefix_caching=prefix_caching)
    allocate_computed(bm, "a", [1, 2, 3])
    raises_unchanged(bm, ValueError, bm.allocate, "b", bad)
    raises_unchanged(bm, ValueError, bm.can_allocate, bad)
    assert bm.num_free_blocks == 6 and set(bm.seqs) == {"a"}


@pytest.mark.parametrize("bad", [[4], 2.0, -1, None, "4", True])
def test_append_slot_refuses_a_bad_token_and_appends_nothing(bad):
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    bm.allocate("a", [1])  # the next token fills the block, which would hash it
    raises_unchanged(bm, ValueError, bm.append_slot, "a", bad)
    assert bm.append_slot("a", 3) == (bm.block_table("a")[0] * 2 + 1, None)


def test_numpy_and_torch_integers_are_token_ids():
    import numpy as np

    bm = BlockManager(8, 2, enable_prefix_caching=True)
    allocate_computed(bm, "a", np.arange(5))
    assert allocate_computed(bm, "b", torch.arange(5).tolist()) == 4
    assert bm.append_slot("a", np.int64(7))[1] is None and bm.seqs["a"].token_ids[-1] == 7
    assert all(type(t) is int for t in bm.seqs["a"].token_ids)


def test_can_allocate_refuses_a_negative_or_non_integer_keep_free():
    bm = BlockManager(4, 2)
    for bad in (-5, 1.5, None):
        with pytest.raises(ValueError, match="keep_free"):
            bm.can_allocate([1, 2], keep_free=bad)
    assert bm.can_allocate([1, 2], keep_free=3) and not bm.can_allocate([1, 2], keep_free=4)


def test_freed_cached_blocks_stay_reusable_and_count_as_free():
    bm = BlockManager(4, 4, enable_prefix_caching=True)
    allocate_computed(bm, 0, range(9))
    bm.free(0)
    stats = bm.stats()
    assert bm.num_free_blocks == 4 and stats.kv_blocks_cached == 2 and stats.kv_blocks_used == 0
    assert allocate_computed(bm, 1, range(9)) == 8
    assert bm.stats().kv_blocks_cached == 0


def test_evictable_hits_count_against_free_memory():
    bm = BlockManager(3, 2, enable_prefix_caching=True)
    allocate_computed(bm, 0, range(5))
    bm.free(0)  # [0 1] [2 3] cached and evictable, one plain free block
    allocate_computed(bm, "z", [7])  # takes the plain free block
    assert bm.num_free_blocks == 2
    assert not bm.can_allocate([0, 1, 2, 3, 9])  # 2 evictable hits + 1 fresh block
    raises_unchanged(bm, OutOfBlocksError, bm.allocate, 1, [0, 1, 2, 3, 9], match="needs 3 .*only 2")
    bm.free("z")
    assert allocate_computed(bm, 1, [0, 1, 2, 3, 9]) == 4 and bm.num_free_blocks == 0


def test_hits_on_blocks_in_use_need_no_free_memory():
    bm = BlockManager(4, 2, enable_prefix_caching=True)
    allocate_computed(bm, 0, range(5))  # blocks: [0 1] [2 3] [4]; one block left
    assert bm.can_allocate([0, 1, 2, 3, 9])
    assert not bm.can_allocate([0, 1, 2, 3, 9], keep_free=1)  # the hits count, the fresh block does not stay free
    assert allocate_computed(bm, 1, [0, 1, 2, 3, 9]) == 4 and bm.num_free_blocks == 0


def test_plain_free_blocks_are_used_before_cached_ones_and_eviction_is_lru():
    bm = BlockManager(5, 2, enable_prefix_caching=True)
    allocate_computed(bm, "old", [1, 1, 9])
    allocate_computed(bm, "new", [2, 2, 9])
    bm.free("old")
    bm.free("new")  # cached: [1 1] (least recently used), [2 2]; 3 plain free blocks
    allocate_computed(bm, "x", [3, 3, 9])  # takes 2 plain free blocks
    assert bm.stats().kv_blocks_cached == 2
    bm.free("x")  # cached: [1 1], [2 2], [3 3]; 2 plain free blocks
    allocate_computed(bm, "y", [7] * 5)  # 3 blocks: the 2 plain free ones, then evicts [1 1]
    assert bm.stats().kv_blocks_cached == 2
    assert allocate_computed(bm, "b", [2, 2, 9]) == 2  # hits [2 2], and its fresh block evicts [3 3]
    assert bm.stats().kv_blocks_cached == 0
    bm.free("y")
    assert allocate_computed(bm, "a", [1, 1, 9]) == 0


def test_eviction_is_least_recently_used_first():
    bm = BlockManager(3, 2, enable_prefix_caching=True)
    for seq_id, token in [("a", 1), ("b", 2), ("c", 3)]:
        allocate_computed(bm, seq_id, [token, token])  # one full, cached block each
    for seq_id in ["a", "c", "b"]:
        bm.free(seq_id)  # LRU order: [1 1], [3 3], [2 2]
    allocate_computed(bm, "z", [9])  # evicts [1 1]
    assert allocate_computed(bm, "d", [2, 2, 0]) == 2  # hits [2 2]; its fresh block evicts [3 3]
    bm.free("z")
    bm.free("d")
    assert allocate_computed(bm, "e", [1, 1, 0]) == 0


def test_freeing_a_sequence_makes_its_tail_older_than_its_prefix():
    bm = BlockManager(3, 2, enable_prefix_caching=True)
    allocate_computed(bm, "filler", [0])
    allocate_computed(bm, "a", [1, 1, 2, 2])
    bm.free("a")  # cached [2 2] is now less recently used than [1 1]
    allocate_computed(bm, "z", [9])  # evicts [2 2]
    bm.free("filler")
    assert allocate_computed(bm, "b", [1, 1, 5]) == 2


def test_hash_collisions_never_hit(monkeypatch):
    monkeypatch.setattr(prefix_cache, "_block_hash", lambda parent_hash, token_ids: 0)
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    allocate_computed(bm, 0, [1, 1, 3])
    assert allocate_computed(bm, 1, [2, 2, 3]) == 0  # same hash, other tokens
    assert allocate_computed(bm, 2, [1, 1, 4]) == 2  # same hash, same tokens


def test_a_hit_needs_the_exact_parent_not_just_equal_tokens(monkeypatch):
    # A hash that forgets the parent: the block [5 5] after [1 1] collides with [5 5] after [2 2].
    monkeypatch.setattr(prefix_cache, "_block_hash", lambda parent_hash, token_ids: hash(token_ids))
    bm = BlockManager(12, 2, enable_prefix_caching=True)
    allocate_computed(bm, 0, [1, 1, 5, 5, 0])
    allocate_computed(bm, 1, [2, 2, 0])
    assert allocate_computed(bm, 2, [2, 2, 5, 5, 0]) == 2  # [2 2] hits; [5 5] is cached, but after [1 1]
    assert allocate_computed(bm, 3, [1, 1, 5, 5, 0]) == 4


# ---- swapping ----

def test_swap_out_and_in_a_forked_group_moves_shared_blocks_once():
    bm = BlockManager(6, 2, num_swap_blocks=6)
    bm.allocate(0, range(5))
    bm.fork(0, 1)
    bm.append_slot(1, 7)  # copy-on-write: 2 shared blocks plus a last block each
    gpu_tables = {s: bm.block_table(s) for s in (0, 1)}
    assert bm.can_swap_out([0, 1])
    mapping = bm.swap_out([0, 1])
    assert len(mapping) == 4 and sorted(g for g, _ in mapping) == sorted(set(sum(gpu_tables.values(), [])))
    to_cpu = dict(mapping)
    for s in (0, 1):
        assert bm.is_swapped_out(s) and bm.block_table(s) == [to_cpu[b] for b in gpu_tables[s]]
    assert bm.block_table(0)[:2] == bm.block_table(1)[:2]  # still shared, on the CPU
    assert bm.num_free_blocks == 6 and bm.num_free_swap_blocks == 2
    assert bm.stats().swap_blocks_used == 4 and bm.stats().num_tokens == 0

    assert bm.can_swap_in([1, 0])
    back = dict(bm.swap_in([1, 0]))
    assert len(back) == 4 and bm.num_free_swap_blocks == 6
    for s in (0, 1):
        assert not bm.is_swapped_out(s) and bm.block_table(s) == [back[to_cpu[b]] for b in gpu_tables[s]]
    assert ref_counts(bm, bm.block_table(0)) == [2, 2, 1]
    assert bm.slot_mapping(1, 5, 6) == [bm.block_table(1)[2] * 2 + 1]


def test_swapping_part_of_a_sharing_group_copies_the_shared_block():
    bm = BlockManager(4, 2, num_swap_blocks=4)
    bm.allocate(0, range(4))
    bm.fork(0, 1)
    mapping = bm.swap_out([1])
    assert [g for g, _ in mapping] == bm.block_table(0) and ref_counts(bm, bm.block_table(0)) == [1, 1]


def test_swap_out_of_memory_and_errors():
    bm = BlockManager(4, 2, num_swap_blocks=1)
    bm.allocate(0, range(3))
    bm.allocate(1, range(1))
    assert not bm.can_swap_out([0])
    raises_unchanged(bm, OutOfBlocksError, bm.swap_out, [0], match="needs 2 free swap blocks, but only 1")
    raises_unchanged(bm, KeyError, bm.swap_out, [1, "zzz"])
    raises_unchanged(bm, ValueError, bm.swap_out, [1, 1], match="duplicate")
    raises_unchanged(bm, ValueError, bm.swap_in, [1], match="not swapped out")
    assert bm.swap_out([]) == []
    bm.swap_out([1])
    raises_unchanged(bm, ValueError, bm.swap_out, [1], match="already swapped out")
    raises_unchanged(bm, ValueError, bm.slot_mapping, 1, 0, 1, match="swapped out")
    raises_unchanged(bm, ValueError, bm.block_tables_tensor, [0, 1])
    with pytest.raises(ValueError):
        bm.can_swap_out([1])


def test_swap_in_out_of_memory():
    bm = BlockManager(2, 2, num_swap_blocks=2)
    bm.allocate(0, range(4))
    bm.swap_out([0])
    bm.allocate(1, [5])
    assert not bm.can_swap_in([0])
    raises_unchanged(bm, OutOfBlocksError, bm.swap_in, [0], match="needs 2 free KV blocks, but only 1")
    bm.free(1)
    assert bm.can_swap_in([0]) and len(bm.swap_in([0])) == 2


def test_fork_and_free_while_swapped_out():
    bm = BlockManager(2, 2, num_swap_blocks=2)
    bm.allocate(0, range(3))
    bm.swap_out([0])
    bm.fork(0, 1)
    assert bm.is_swapped_out(1) and [bm.swap_pool.blocks[b].ref_count for b in bm.block_table(1)] == [2, 2]
    bm.free(0)
    bm.free(1)
    assert bm.num_free_swap_blocks == 2 and bm.num_free_blocks == 2


def test_swapped_out_cached_blocks_stay_hittable_and_swap_in_recaches():
    bm = BlockManager(4, 2, num_swap_blocks=4, enable_prefix_caching=True)
    allocate_computed(bm, 0, range(5))
    bm.swap_out([0])
    assert bm.stats().kv_blocks_cached == 2  # the GPU copies of [0 1] [2 3] are still valid
    assert allocate_computed(bm, 1, [0, 1, 2, 3, 8]) == 4
    bm.free(1)
    allocate_computed(bm, 2, [9] * 8)  # evicts both cached blocks
    bm.free(2)
    bm.swap_in([0])
    assert not set(bm.prefix_cache.hash_to_block_id.values()) & set(bm.block_table(0))  # copied in, not yet marked computed
    bm.mark_computed(0)
    assert allocate_computed(bm, 4, [0, 1, 2, 3, 8]) == 4  # published again after swap_in
    assert bm.block_table(4)[:2] == bm.block_table(0)[:2]


# ---- accounting ----

def test_stats_report_sharing_and_fragmentation():
    bm = BlockManager(10, 4, num_swap_blocks=2)
    bm.allocate(0, range(6))  # 2 blocks, 2 empty slots in the last
    bm.fork(0, 1)  # shares both blocks, the same last block
    bm.allocate(2, range(8))  # 2 full blocks
    stats = bm.stats()
    assert stats.kv_blocks_used == 4 and stats.kv_blocks_free == 6 and stats.kv_blocks_cached == 0
    assert stats.num_tokens == 20 and stats.logical_blocks == 6 and stats.blocks_saved_by_sharing == 2
    assert stats.internal_fragmentation == 2 and stats.utilization == pytest.approx(14 / 16)
    bm.append_slot(1, 0)  # copy-on-write: two last blocks now, with 2 and 1 empty slots
    stats = bm.stats()
    assert stats.kv_blocks_used == 5 and stats.internal_fragmentation == 3
    assert stats.blocks_saved_by_sharing == 1 and stats.utilization == pytest.approx(17 / 20)


# ---- KV-cache groups: windowed groups release the blocks no later query can see ----

def test_a_windowed_group_releases_blocks_once_no_later_query_sees_them():
    bm = BlockManager(32, 4, group_windows=(None, 6))  # group 1: window 6
    bm.allocate(0, list(range(1, 14)))  # 13 tokens: 4 blocks in each group
    assert [len(table) for table in bm.block_tables(0)] == [4, 4] and bm.num_free_blocks == 24
    bm.mark_computed(0, 8)  # queries from position 8 on see 3 ..: block 0 (tokens 0-3) is still read
    assert PAD_BLOCK_ID not in bm.block_table(0, 1)
    bm.mark_computed(0, 9)  # from 9 on: 4 ..: block 0 is dead
    assert bm.block_table(0, 1)[0] == PAD_BLOCK_ID and PAD_BLOCK_ID not in bm.block_table(0, 1)[1:]
    bm.mark_computed(0)  # from 13 on: positions 8 .. ; blocks 0 and 1 are dead
    assert bm.block_table(0, 1)[:2] == [PAD_BLOCK_ID] * 2 and PAD_BLOCK_ID not in bm.block_table(0)
    assert bm.stats().kv_blocks_by_attention_type == {"global": 4, "sliding_window": 2}
    assert bm.num_free_blocks == 26 and bm.num_blocks_held([0]) == 6
    with pytest.raises(ValueError, match="released"):
        bm.slot_mapping(0, 7, 9, group=1)
    assert bm.slot_mapping(0, 8, 13, group=1) == [bm.block_table(0, 1)[i // 4] * 4 + i % 4 for i in range(8, 13)]
    for token in (14, 15, 16, 17):  # positions 13 .. 15 fill block 3; position 16 opens block 4 in both groups
        slots, cows = bm.append_slots(0, token)
        assert cows == [] and len(slots) == 2
    assert [len(table) for table in bm.block_tables(0)] == [5, 5]
    bm.mark_computed(0)  # from 17 on: positions 12 ..; block 2 is dead too
    assert bm.block_table(0, 1)[:3] == [PAD_BLOCK_ID] * 3
    bm.free(0)
    assert bm.num_free_blocks == 32 and bm.stats().kv_blocks_used == 0


def test_a_windowed_group_takes_its_blocks_chunk_by_chunk():
    """allocate(..., num_tokens=0) gives the global group every block and the windowed one none; hold_tokens before
    each chunk of 4 gives it the chunk's, mark_computed after releases those out of the window: it never holds
    more than max_blocks_held (ceil((6 - 1 + 4) / 4) + 1 = 4 of the prompt's 5)."""
    bm = BlockManager(32, 4, group_windows=(None, 6))
    prompt = list(range(1, 21))  # 20 tokens: 5 blocks
    assert bm.max_blocks_held(20, 4, per_group=True) == [5, 4] and bm.max_blocks_held(20, 4) == 9
    assert bm.max_blocks_held(20, 100, per_group=True) == [5, 5] and bm.max_blocks_held(3, 1) == 2
    assert bm.can_allocate(prompt, keep_free=27, num_tokens=0) and not bm.can_allocate(prompt, keep_free=27)
    raises_unchanged(bm, ValueError, bm.allocate, 0, prompt, 21, match="num_tokens must be <= the 20 tokens")
    assert bm.allocate(0, prompt, num_tokens=0) == 0
    assert bm.block_tables(0)[1] == [] and bm.num_free_blocks == 27
    assert bm.window_blocks_to_come(0, 4) == 4
    held = []
    for start in range(0, 20, 4):
        assert bm.blocks_to_hold(0, start + 4) <= bm.window_blocks_to_come(0, 4)
        bm.hold_tokens(0, start + 4)
        assert bm.slot_mapping(0, start, start + 4, group=1)  # the chunk's slots exist
        held.append(sum(b != PAD_BLOCK_ID for b in bm.block_table(0, 1)))
        bm.mark_computed(0, start + 4)
    assert held == [1, 2, 3, 3, 3] and max(held) <= 4
    assert len(bm.block_table(0, 1)) == 5 and bm.window_blocks_to_come(0, 4) == 0
    raises_unchanged(bm, ValueError, bm.hold_tokens, 0, 21, match="num_tokens must be <= the sequence's 20")
    bm.free(0)
    assert bm.num_free_blocks == 32


def test_append_slots_copies_on_write_in_every_group():
    bm = BlockManager(16, 4, group_windows=(None, 4, 4))
    bm.allocate(0, [1, 2, 3, 4, 5])
    bm.mark_computed(0)
    bm.fork(0, 1)
    raises_unchanged(bm, ValueError, bm.append_slot, 1, 9, match="append_slots")
    shared = [table[-1] for table in bm.block_tables(0)]
    slots, cows = bm.append_slots(1, 9)
    assert [src for src, _ in cows] == shared and len({dst for _, dst in cows}) == 3
    assert [table[-1] for table in bm.block_tables(1)] == [dst for _, dst in cows]
    assert slots == [dst * 4 + 1 for _, dst in cows]
    assert ref_counts(bm, shared) == [1, 1, 1]
    for seq_id in (0, 1):
        bm.free(seq_id)
    assert bm.num_free_blocks == 16


def test_fork_and_swap_keep_the_released_entries_released():
    bm = BlockManager(24, 4, num_swap_blocks=24, group_windows=(None, 4))
    bm.allocate(0, list(range(1, 11)))  # 10 tokens, 3 blocks per group
    bm.mark_computed(0)  # from 10 on: positions 7 ..: group 1 releases block 0
    bm.fork(0, 1)
    assert bm.block_tables(1) == bm.block_tables(0) and bm.block_table(1, 1)[0] == PAD_BLOCK_ID
    before = bm.block_tables(0)
    mapping = bm.swap_out([0, 1])
    assert len(mapping) == 5 and bm.num_free_swap_blocks == 19  # 3 + 2 distinct blocks, moved once
    assert bm.block_table(0, 1)[0] == PAD_BLOCK_ID and bm.block_tables(0) == bm.block_tables(1)
    bm.swap_in([0, 1])
    after = bm.block_tables(0)
    assert [[b == PAD_BLOCK_ID for b in table] for table in after] == [[b == PAD_BLOCK_ID for b in table]
                                                                      for table in before]
    assert bm.block_tables(1) == after and bm.num_free_blocks == 19 and bm.num_free_swap_blocks == 24
    for seq_id in (0, 1):
        bm.free(seq_id)
    assert bm.num_free_blocks == 24


def test_a_prefix_hit_needs_the_windowed_groups_blocks_in_its_window():
    """Group 0's chain still holds a 16-token prefix, but the windowed group's blocks of it were evicted: no query
    after the prefix could read its window, so nothing of it is a hit."""
    tokens = list(range(1, 17))
    bm = BlockManager(40, 4, enable_prefix_caching=True, group_windows=(None, 4))
    allocate_computed(bm, "a", tokens + [100])
    bm.free("a")
    assert bm.cached_prefix_length(tokens + [200]) == 16  # 4 blocks; group 1 needs block 3 only (positions 13 ..)
    assert bm.allocate("b", tokens + [300]) == 16  # holds group 0's blocks 0-3 and group 1's block 3
    for token in (301, 302, 303, 304):
        bm.append_slots("b", token)
    bm.mark_computed("b")  # from 21 on: positions 18 ..: "b" lets go of group 1's block 3 (still cached)
    free = bm.num_free_blocks
    assert free % 2 == 0
    bm.allocate("c", [7] * (free // 2 * 4))  # takes every free block: evicts group 1's cached blocks 0-3
    assert bm.num_free_blocks == 0 and bm.stats().kv_blocks_cached == 0
    assert bm.cached_prefix_length(tokens + [200]) == 0
    for seq_id in ("b", "c"):
        bm.free(seq_id)
    assert bm.cached_prefix_length(tokens + [200]) == 0
