"""The CUDA kernels' launch plans (csrc/cuda/launch_plan.h) through the test hook paged_attn._C._launch_plan.

The plans are plain C++, built into every extension (no GPU, no CUDA kernels needed); the CUDA launchers and the
emulated kernel tests launch with the same functions, so what is checked here is what runs there.
"""

import re

import numpy
import pytest
import torch

from paged_attn import _C

INT32_MAX = 2**31 - 1
MAX_GRID_YZ = 65535
PARTITION_SIZE = 512  # kPartitionSize


def attention_plan(num_seqs=1, num_heads=32, num_kv_heads=32, max_blocks_per_seq=64, block_size=16,
                   sliding_window=0, num_sms=132, blocks_per_sm=4, partition_tokens=None, num_shared_tasks=None,
                   batch_invariant=False):
    sizes = [num_seqs, num_heads, num_kv_heads, max_blocks_per_seq, block_size, sliding_window, num_sms,
             blocks_per_sm]
    if partition_tokens is not None or num_shared_tasks is not None or batch_invariant:
        sizes.append(PARTITION_SIZE if partition_tokens is None else partition_tokens)
    if num_shared_tasks is not None or batch_invariant:
        sizes.append(num_shared_tasks or 0)
    if batch_invariant:
        sizes.append(1)
    return _C._launch_plan("paged_attention", *sizes)


def ceil_div(a, b):
    return -(-a // b)


# launch_plan.h's model of a split-KV launch, in token-times (one thread block streaming one token of its kv head):
# a partition costs its tokens plus OVERHEAD, the reduce kernel REDUCE; partitions are multiples of 64 tokens up to
# 512 (k / 8 of kPartitionSize).
OVERHEAD, REDUCE = PARTITION_SIZE // 16, PARTITION_SIZE // 8
SIZES = [PARTITION_SIZE * k // 8 for k in range(1, 9)]


def modelled_time(base, slots, max_context, size, partitions, z, context=None):
    """The time of a launch of base thread blocks per partition slot on slots, for sequences of `context` tokens
    (default: the table's width, max_context): the single pass (partitions == 1) or z slots looping over partitions
    of `size` tokens; the blocks of partitions past the sequences return at once."""
    context = max_context if context is None else context
    if partitions == 1:
        return ceil_div(base, slots) * (context + OVERHEAD)
    used = max(ceil_div(context, size), 1)
    active = min(z, used)
    return ceil_div(base * active, slots) * ceil_div(used, active) * (size + OVERHEAD) + REDUCE


def fills_waves(blocks, slots):
    """A single wave, or a last wave at least 90% full."""
    return blocks <= slots or blocks % slots == 0 or 10 * (blocks % slots) >= 9 * slots


# ----------------------------------------------------------------------------------------------------------------
# Group variants (a thread block's registers are sized for 1, 4 or 8 query heads) and thread blocks per head group


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,variant,blocks,per_block",
    [
        (32, 32, 1, 1, 1),  # MHA: the 1-head variant
        (32, 16, 4, 1, 2),  # groups 2-4: the 4-head variant
        (9, 3, 4, 1, 3),
        (32, 8, 4, 1, 4),  # GQA-4
        (40, 8, 8, 1, 5),  # groups 5-8: the 8-head variant
        (64, 8, 8, 1, 8),
        (10, 1, 8, 2, 5),  # larger groups: balanced parts of at most 8 heads
        (16, 1, 8, 2, 8),
        (17, 1, 8, 3, 6),
        (24, 1, 8, 3, 8),
    ],
)
def test_group_variant_and_blocks_per_group(num_heads, num_kv_heads, variant, blocks, per_block):
    plan = attention_plan(num_seqs=64, num_heads=num_heads, num_kv_heads=num_kv_heads, num_sms=1, blocks_per_sm=1)
    assert plan["error"] is None
    group = num_heads // num_kv_heads
    assert (plan["group_size"], plan["group_variant"], plan["blocks_per_group"], plan["heads_per_block"]) == (
        group, variant, blocks, per_block)
    assert plan["heads_per_block"] <= plan["group_variant"]
    assert (blocks - 1) * per_block < group <= blocks * per_block  # every head in exactly one thread block
    assert plan["grid"] == (64, num_kv_heads * blocks, 1)  # 64 waves or more on one slot: single pass
    assert plan["threads"] == 128 and plan["shared_bytes"] == 0


# ----------------------------------------------------------------------------------------------------------------
# Single pass or split-KV, the partition slots (grid.z) and the partitions


def test_single_pass_when_its_waves_are_full():
    # GQA-4 at 4k context (8 partitions), 132 SMs x 4 blocks = 528 slots: 66 sequences are exactly one wave.
    plan = attention_plan(num_seqs=66, num_heads=32, num_kv_heads=8, max_blocks_per_seq=256)
    assert plan["num_partitions"] == 1 and plan["partition_size"] == 256 * 16 == plan["max_context"]
    assert plan["grid"] == (66, 8, 1)
    # 65 sequences: 520 of 528 slots for the whole pass; no split does better in whole partitions
    assert attention_plan(num_seqs=65, num_heads=32, num_kv_heads=8, max_blocks_per_seq=256)["num_partitions"] == 1
    # 132 sequences: two full waves
    assert attention_plan(num_seqs=132, num_heads=32, num_kv_heads=8, max_blocks_per_seq=256)["grid"][2] == 1


def test_split_kv_fills_the_last_wave():
    # The case: GQA-4, batch 70, 4k: 560 blocks for 528 slots. A single pass takes two waves of the whole
    # context, the second 6% full (8,256 token-times). 16 partitions of 256 tokens, one per slot: 8,960 blocks in 17
    # waves, the last 97% full (4,960); 8 slots of 512-token partitions took as long (9 waves of partitions), but their
    # last wave of blocks was 6% full.
    plan = attention_plan(num_seqs=70, num_heads=32, num_kv_heads=8, max_blocks_per_seq=256)
    assert (plan["num_partitions"], plan["partition_size"], plan["grid"]) == (16, 256, (70, 8, 16))
    assert fills_waves(560 * 16, 528) and not fills_waves(560 * 8, 528)
    assert modelled_time(560, 528, 4096, 256, 16, 16) == 17 * (256 + OVERHEAD) + REDUCE == 4960
    assert modelled_time(560, 528, 4096, 512, 8, 8) == 4960 < modelled_time(560, 528, 4096, 4096, 1, 1) == 8256
    assert plan["reduce_grid"] == (70, 32, 1)
    # Half a wave of blocks: two slots, each block four partitions: one wave of 4 partitions' time, not 8.
    plan = attention_plan(num_seqs=33, num_heads=32, num_kv_heads=8, max_blocks_per_seq=256)
    assert (plan["num_partitions"], plan["grid"]) == (8, (33, 8, 2))


def test_split_kv_when_few_sequences_and_long_tables():
    # Batch 2, GQA-4, 1,600 tokens: 16 blocks on 528 slots. 25 partitions of 64 tokens in 400 blocks, one wave: 160
    # token-times, against 608 for 4 partitions of 512.
    plan = attention_plan(num_seqs=2, num_heads=32, num_kv_heads=8, max_blocks_per_seq=100, block_size=16)
    assert (plan["num_partitions"], plan["partition_size"]) == (25, 64)
    assert plan["grid"] == (2, 8, 25) and plan["reduce_grid"] == (2, 32, 1)
    assert modelled_time(16, 528, 1600, 64, 25, 25) == 160 < modelled_time(16, 528, 1600, 512, 4, 4) == 608


def test_padded_tables_launch_no_more_slots_than_fill_the_gpu():
    # Batch 8, GQA-4, a table padded to 32k: 64 partitions, but 8 slots x 64 blocks fill the 528 slots once; each
    # block loops over its 8 partitions (1 when the sequences are 4k long: no empty block). Before: 64 slots, 4096
    # blocks, 87% of them without a token at 4k.
    plan = attention_plan(num_seqs=8, num_heads=32, num_kv_heads=8, max_blocks_per_seq=2048)
    assert (plan["num_partitions"], plan["grid"]) == (64, (8, 8, 8))
    # Batch 1, MHA, 128k: 256 partitions in 16 slots of 32 blocks (one wave), 16 partitions each.
    plan = attention_plan(num_seqs=1, num_heads=32, num_kv_heads=32, max_blocks_per_seq=8192)
    assert (plan["num_partitions"], plan["grid"]) == (256, (1, 32, 16))


def test_tables_no_longer_than_a_partition_stay_single_pass():
    # 512 tokens: 8 partitions of 64 would be faster for a full table, but for sequences of 64 tokens (an eighth of
    # it) they pay the reduce for nothing, so the single pass stays.
    plan = attention_plan(num_seqs=1, max_blocks_per_seq=32, block_size=16)
    assert plan["num_partitions"] == 1
    assert attention_plan(num_seqs=1, max_blocks_per_seq=4, block_size=16)["num_partitions"] == 1  # 64: no split


def test_partition_tokens_option():
    # The emulated tests take small partitions to get many from short sequences.
    plan = attention_plan(num_seqs=1, max_blocks_per_seq=70, block_size=16, partition_tokens=4)
    assert (plan["num_partitions"], plan["partition_size"]) == (280, 4)
    assert plan["grid"][2] <= 280


@pytest.mark.parametrize(
    "max_blocks_per_seq,block_size",
    [(MAX_GRID_YZ * PARTITION_SIZE // 32, 32), (MAX_GRID_YZ * PARTITION_SIZE // 32 + 1, 32), (2**26, 32),
     (2**40, 16)],
)
def test_partitions_fit_grid_z_whatever_the_table_width(max_blocks_per_seq, block_size):
    # Partitions grow (in whole multiples of 64 tokens) beyond kMaxGridYZ of them, so the scratch stays bounded,
    # and the reduce kernel needs no shared memory per partition.
    plan = attention_plan(max_blocks_per_seq=max_blocks_per_seq, block_size=block_size)
    max_context = min(max_blocks_per_seq * block_size, INT32_MAX)
    assert plan["error"] is None and plan["max_context"] == max_context
    partitions, size = plan["num_partitions"], plan["partition_size"]
    assert partitions <= MAX_GRID_YZ and 1 <= plan["grid"][2] <= partitions
    assert size % 64 == 0
    assert (partitions - 1) * size < max_context <= partitions * size
    assert plan["shared_bytes"] == 0


# The table: batch x context x heads x resident blocks per SM, on 132 SMs (an H100 / H200).
TABLE_BATCHES = list(range(1, 17)) + [24, 31, 32, 33, 48, 63, 64, 65, 66, 67, 70, 96, 100, 127, 128, 129, 130, 131,
                                      132, 133, 200, 255, 256, 257, 263, 264, 300, 384, 400, 500, 511, 512]
TABLE_CONTEXTS = [1, 15, 16, 511, 512, 513, 1000, 4096, 4097, 32768, 131072]
TABLE_HEADS = {"MHA": (32, 32), "GQA-4": (32, 8), "GQA-8": (64, 8), "MQA": (16, 1)}
TABLE_SMS = 132


def best_plan(base, slots, max_context, sizes, short_limit=None):
    """By brute force over every grid.z: the plan launch_plan.h's rule picks among the single pass and the
    partitions of `sizes`: the least time for a full table, among those no slower than short_limit for sequences an
    eighth of the table's width; on equal time full waves first, then the fewest blocks, then the fewest partitions.
    Returns (time, short_time, full, size, partitions, z)."""
    best = None
    for size in [max_context] + [s for s in sizes if 2 <= ceil_div(max_context, s) <= MAX_GRID_YZ]:
        partitions = 1 if size == max_context else ceil_div(max_context, size)
        zs = numpy.arange(1, partitions + 1, dtype=numpy.int64)
        if partitions == 1:
            times = numpy.array([modelled_time(base, slots, max_context, size, 1, 1)])
            shorts = numpy.array([modelled_time(base, slots, max_context, size, 1, 1, max_context // 8)])
        else:
            times = -(-base * zs // slots) * -(-partitions // zs) * (size + OVERHEAD) + REDUCE
            used = max(ceil_div(max_context // 8, size), 1)
            active = numpy.minimum(zs, used)
            shorts = -(-base * active // slots) * -(-used // active) * (size + OVERHEAD) + REDUCE
        blocks = base * zs
        full = (blocks <= slots) | (blocks % slots == 0) | (10 * (blocks % slots) >= 9 * slots)
        allowed = numpy.ones_like(full) if short_limit is None else shorts <= short_limit
        if not allowed.any():
            continue
        order = numpy.lexsort((zs, ~full, times))  # time, then full, then z
        order = order[allowed[order]]
        i = order[0]
        c = (int(times[i]), int(shorts[i]), bool(full[i]), size, partitions, int(zs[i]))
        if best is None or (c[0], not c[2], c[5], c[4]) < (best[0], not best[2], best[5], best[4]):
            best = c
    return best


# The table: batch x context x heads x resident blocks per SM, on 132 SMs (an H100 / H200).
TABLE_BATCHES = list(range(1, 17)) + [24, 31, 32, 33, 48, 63, 64, 65, 66, 67, 70, 96, 100, 127, 128, 129, 130, 131,
                                      132, 133, 200, 255, 256, 257, 263, 264, 300, 384, 400, 500, 511, 512]
TABLE_CONTEXTS = [1, 15, 16, 511, 512, 513, 1000, 4096, 4097, 32768, 131072]
TABLE_HEADS = {"MHA": (32, 32), "GQA-4": (32, 8), "GQA-8": (64, 8), "MQA": (16, 1)}
TABLE_SMS = 132


@pytest.mark.parametrize("blocks_per_sm", [1, 2, 3, 4])
@pytest.mark.parametrize("heads", list(TABLE_HEADS), ids=list(TABLE_HEADS))
def test_plans_fill_whole_waves(heads, blocks_per_sm):
    """For every batch and context of the table: the grid is within CUDA's limits, grid.z <= num_partitions, the
    partitions (multiples of 64 tokens up to 512) cover the table, and the plan is the one the model's rule picks,
    found here by brute force over every grid.z (launch_plan.h tries O(sqrt P) of them): the least modelled time
    for a full table among the plans no slower than the 512-token plan for sequences an eighth as long (a padded
    table), with full waves (a single wave of thread blocks or a last wave 90% full) wherever a plan of the same
    time has them. It is never slower than the 512-token plan, in either case.

    The literal rule "a single wave or a last wave 90% full" holds in 4,836 of the 8,448 cells. In 1,548 no plan of
    the model has it (contexts of one partition, or block counts whose waves no split fills); in the other 2,064
    every plan that has it is slower by the model (median 8%, up to 2.8x), or slower than the 512-token plan for
    sequences an eighth of the table's width."""
    num_heads, num_kv_heads = TABLE_HEADS[heads]
    slots = TABLE_SMS * blocks_per_sm
    block_size = 16
    checked = split = 0
    for num_seqs in TABLE_BATCHES:
        for context in TABLE_CONTEXTS:
            max_blocks = ceil_div(context, block_size)
            plan = attention_plan(num_seqs, num_heads, num_kv_heads, max_blocks, block_size, 0, TABLE_SMS,
                                  blocks_per_sm)
            what = f"{heads} batch {num_seqs} context {context} blocks_per_sm {blocks_per_sm}: {plan}"
            assert plan["error"] is None, what
            blocks = ceil_div(num_heads // num_kv_heads, 8)
            base = num_seqs * num_kv_heads * blocks  # thread blocks per partition slot
            grid_x, grid_y, grid_z = plan["grid"]
            assert (grid_x, grid_y) == (num_seqs, num_kv_heads * blocks), what
            max_context = max_blocks * block_size
            partitions, size = plan["num_partitions"], plan["partition_size"]
            assert 1 <= grid_z <= min(partitions, MAX_GRID_YZ), what
            if partitions > 1:
                split += 1
                assert size in SIZES and partitions == ceil_div(max_context, size), what
                assert plan["reduce_grid"] == (num_seqs, num_heads, 1), what
            else:
                assert grid_z == 1 and size >= max_context, what
            time = modelled_time(base, slots, max_context, size, partitions, grid_z)
            short = modelled_time(base, slots, max_context, size, partitions, grid_z, max_context // 8)
            filled = fills_waves(base * grid_z, slots)
            if ceil_div(base, slots) >= 64:  # 64 waves or more: the single pass, its last wave under 1/64 of it
                assert partitions == 1, what
                continue
            old = best_plan(base, slots, max_context, [PARTITION_SIZE])
            new = best_plan(base, slots, max_context, SIZES, short_limit=old[1])
            assert time == new[0] and short <= old[1], (what, new, old)
            assert filled or not new[2], (what, new)  # full waves wherever a plan of the least time has them
            assert time <= old[0], what  # never slower than the 512-token plan
            checked += 1
    assert checked > 0 and split > 0


# ----------------------------------------------------------------------------------------------------------------
# Grid limits


def test_many_sequences_are_launched_on_grid_x():
    plan = attention_plan(num_seqs=70000)
    assert plan["error"] is None and plan["grid"][0] == 70000


@pytest.mark.parametrize(
    "sizes,message",
    [
        (dict(num_seqs=2**31), "grid.x = num_seqs = 2147483648 is outside [1, 2147483647]"),
        (dict(num_heads=70000, num_kv_heads=70000), "grid.y = num_kv_heads * blocks_per_group = 70000 is outside"),
        (dict(num_heads=16 * 40000, num_kv_heads=40000), "grid.y = num_kv_heads * blocks_per_group = 80000 is outside"),
        (dict(num_heads=65536, num_kv_heads=8192), "grid.y = num_heads = 65536 is outside [1, 65535]"),
    ],
)
def test_grid_limits_are_errors(sizes, message):
    assert message in attention_plan(**sizes)["error"]


# ----------------------------------------------------------------------------------------------------------------
# The sliding window, and the context the kernels clamp seq_lens to


@pytest.mark.parametrize(
    "window,expected",
    [(0, 0), (1, 1), (1023, 1023), (1024, 0), (5000, 0), (2**31, 0), (2**32 + 5, 0), (2**40, 0)],
)
def test_sliding_window_covering_the_table_means_all_tokens(window, expected):
    # max_context = 64 * 16 = 1024. Before, the window was narrowed to int: 2**32 + 5 became 5.
    assert attention_plan(sliding_window=window)["sliding_window"] == expected


def test_max_context_is_the_table_capacity_at_most_int32_max():
    assert attention_plan(max_blocks_per_seq=10, block_size=8)["max_context"] == 80
    assert attention_plan(max_blocks_per_seq=0)["max_context"] == 0
    assert attention_plan(max_blocks_per_seq=0)["partition_size"] == 1


@pytest.mark.parametrize(
    "sizes",
    [dict(num_kv_heads=0), dict(block_size=0), dict(num_heads=6, num_kv_heads=4), dict(num_seqs=0),
     dict(num_sms=0), dict(blocks_per_sm=0), dict(num_sms=2**21), dict(blocks_per_sm=2**21),
     dict(partition_tokens=0), dict(sliding_window=-1)],
)
def test_invalid_sizes_are_errors_not_divisions_by_zero(sizes):
    assert attention_plan(**sizes)["error"].startswith("invalid sizes")


# ----------------------------------------------------------------------------------------------------------------
# The tensor-core kernel of paged_attention with query_start_loc (plan_varlen_attention)

VARLEN_HEAD_DIMS = [64, 80, 96, 128, 256]


def varlen_plan(num_seqs=4, num_tokens=100, num_heads=32, num_kv_heads=8, head_dim=128, element_bytes=2,
                max_blocks_per_seq=64, block_size=16, sliding_window=0):
    return _C._launch_plan("paged_attention_varlen", num_seqs, num_tokens, num_heads, num_kv_heads, head_dim,
                           element_bytes, max_blocks_per_seq, block_size, sliding_window)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,blocks,heads,tokens",
    [
        (32, 32, 1, 1, 64),  # MHA: 64 tokens of one head per tile
        (32, 8, 1, 4, 16),  # GQA-4: 16 tokens x 4 heads
        (6, 2, 1, 3, 21),  # 63 of the 64 rows used
        (64, 8, 1, 8, 8),
        (64, 1, 1, 64, 1),  # one token of 64 heads
        (80, 1, 2, 40, 1),  # two thread blocks of 40 heads
        (128, 1, 2, 64, 1),
    ],
)
def test_varlen_tiles(num_heads, num_kv_heads, blocks, heads, tokens):
    plan = varlen_plan(num_seqs=5, num_tokens=1000, num_heads=num_heads, num_kv_heads=num_kv_heads)
    assert plan["error"] is None
    assert (plan["blocks_per_group"], plan["heads_per_tile"], plan["tokens_per_tile"]) == (blocks, heads, tokens)
    group = num_heads // num_kv_heads
    assert (blocks - 1) * heads < group <= blocks * heads and heads * tokens <= 64
    assert plan["grid"] == (1000 // tokens + 5, num_kv_heads * blocks, 1) and plan["threads"] == 128


def tiles_of_each_row(starts, tokens_per_tile):
    """The kernel's mapping (varlen_tile in varlen_attention_kernels.cuh), run for every thread block of grid.x:
    row -> the tiles that serve it."""
    num_seqs, num_tokens = len(starts) - 1, starts[-1]
    grid_x = num_tokens // tokens_per_tile + num_seqs
    served = {}
    for block in range(grid_x):
        x = grid_x - 1 - block
        seq = max(s for s in range(num_seqs) if starts[s] // tokens_per_tile + s <= x)  # the binary search
        first_token = (x - (starts[seq] // tokens_per_tile + seq)) * tokens_per_tile
        count = starts[seq + 1] - starts[seq]
        for token in range(first_token, min(first_token + tokens_per_tile, count)):
            served.setdefault(starts[seq] + token, []).append(block)
    return served


@pytest.mark.parametrize("tokens_per_tile", [1, 8, 21, 64])
def test_varlen_grid_serves_every_row_once_without_reading_query_start_loc(tokens_per_tile):
    """grid.x = num_tokens / tokens_per_tile + num_seqs is enough for any split of the tokens into sequences
    (so the launcher never copies query_start_loc to the host), and every row is served by exactly one tile."""
    generator = torch.Generator().manual_seed(tokens_per_tile)
    for _ in range(50):
        num_seqs = int(torch.randint(1, 9, (), generator=generator))
        lengths = torch.randint(0, 150, (num_seqs,), generator=generator)
        lengths[torch.rand(num_seqs, generator=generator) < 0.3] = 0
        starts = [0] + torch.cumsum(lengths, 0).tolist()
        served = tiles_of_each_row(starts, tokens_per_tile)
        assert sorted(served) == list(range(starts[-1]))
        assert all(len(blocks) == 1 for blocks in served.values())


def test_varlen_shared_memory():
    sizes = {head_dim: varlen_plan(head_dim=head_dim)["shared_bytes"] for head_dim in VARLEN_HEAD_DIMS}
    # launch_plan.h's varlen_smem: Q [64][D + 8], two stages of K and V [N][D + 8] (bf16), the key rows of two
    # steps (16 bytes per key), each row's position and slope
    for head_dim, keys in ((128, 64), (256, 16)):
        assert varlen_plan(head_dim=head_dim)["key_tile"] == keys
        assert sizes[head_dim] == (64 + 4 * keys) * (head_dim + 8) * 2 + 2 * keys * 16 + 2 * 64 * 4
    assert sizes[128] == 89600 and sizes[256] == 68608
    assert all(size <= 99 * 1024 for size in sizes.values())  # what sm_86 and sm_89 allow a block to opt in to


@pytest.mark.parametrize(
    "sizes,message",
    [
        (dict(head_dim=120), "head_dim 120 has no tensor-core kernel (instantiated: 64, 80, 96, 128, 256)"),
        (dict(head_dim=32), "head_dim 32 has no tensor-core kernel"),
        (dict(element_bytes=4), "takes float16 and bfloat16"),
        (dict(block_size=64), "block_size 64 is not supported (supported: 8, 16, 32)"),
        (dict(num_heads=70000, num_kv_heads=70000), "grid.y = num_kv_heads * blocks_per_group = 70000 is outside"),
        (dict(num_seqs=0), "invalid sizes"),
        (dict(num_heads=6, num_kv_heads=4), "invalid sizes"),
    ],
)
def test_varlen_errors(sizes, message):
    assert message in varlen_plan(**sizes)["error"]


def test_varlen_window_and_context_as_decode():
    assert varlen_plan(sliding_window=100)["sliding_window"] == 100
    assert varlen_plan(sliding_window=1024)["sliding_window"] == 0  # covers the table: no window
    assert varlen_plan(max_blocks_per_seq=2**40)["max_context"] == INT32_MAX


# ----------------------------------------------------------------------------------------------------------------
# Cache ops: no launch with zero threads, no grid past its limits


def test_reshape_and_cache_plan():
    assert _C._launch_plan("reshape_and_cache", 5, 2, 8) == dict(grid=(5, 1, 1), threads=32, shared_bytes=0,
                                                                  error=None)
    assert _C._launch_plan("reshape_and_cache", 5, 8, 40)["threads"] == 320
    assert _C._launch_plan("reshape_and_cache", 5, 64, 64)["threads"] == 512
    assert "grid.x = num_tokens" in _C._launch_plan("reshape_and_cache", 2**31, 2, 8)["error"]
    assert _C._launch_plan("reshape_and_cache", 5, 0, 8)["error"] == "num_kv_heads and head_dim must be positive"


def test_copy_blocks_plan():
    plan = _C._launch_plan("copy_blocks", 3, 128, 1000)
    assert plan == dict(grid=(3, 128, 2), threads=512, shared_bytes=0, error=None)
    empty = _C._launch_plan("copy_blocks", 3, 2, 0)
    assert empty["error"] == "blocks must not be empty" and empty["threads"] == 32
    assert _C._launch_plan("copy_blocks", 3, 129, 8)["error"] == "at most 128 layers per launch"
    assert "grid.x = num_pairs" in _C._launch_plan("copy_blocks", 2**31, 1, 8)["error"]


def test_unknown_kernel():
    with pytest.raises(TypeError, match="unknown kernel"):
        _C._launch_plan("nope", 1)


@pytest.mark.parametrize("num_seqs, max_blocks_per_seq", [(1024, 256), (8, 260), (64, 144)])
def test_shared_tasks_take_split_kv(num_seqs, max_blocks_per_seq):
    """With the tasks of a shared-blocks plan the launch is split-KV (a task writes its rows' partition records):
    grid.x = num_seqs + the tasks, the reduce's over the sequences only; a batch that fills many waves, single pass
    without tasks, is split with them; without tasks the plan is the usual one."""
    usual = attention_plan(num_seqs, 32, 8, max_blocks_per_seq)
    plan = attention_plan(num_seqs, 32, 8, max_blocks_per_seq, num_shared_tasks=5)
    assert usual["num_shared_tasks"] == 0 and plan["error"] is None
    assert plan["num_partitions"] > 1 and plan["num_shared_tasks"] == 5
    assert plan["grid"][0] == num_seqs + 5 and plan["reduce_grid"][0] == num_seqs
    assert plan["grid"][1:] == (usual["grid"][1], plan["grid"][2]) and plan["grid"][2] <= plan["num_partitions"]
    if usual["num_partitions"] > 1:  # already split: the same partitions (the tasks do not change the model)
        assert (plan["partition_size"], plan["grid"][2]) == (usual["partition_size"], usual["grid"][2])


def test_shared_tasks_dropped_without_a_split():
    """A table of one partition (or at most 64 tokens) cannot be split: single pass, and no task is launched."""
    plan = attention_plan(8, 32, 8, 4, num_shared_tasks=3)
    assert plan["num_partitions"] == 1 and plan["num_shared_tasks"] == 0 and plan["grid"][0] == 8
    assert attention_plan(8, 32, 8, 64, num_shared_tasks=-1)["error"] is not None


def test_batch_invariant_plans_cut_every_row_at_the_same_positions():
    """set_batch_invariant: whatever the batch, the table's width and the GPU, partitions of 512 tokens (so a row's
    partitions start at the same tokens), always split-KV (two partitions at least: a row's records always go
    through the reduce), at most one wave of slots (which changes no result). Without it the same calls take the
    single pass or other partition sizes."""
    default_plans = set()
    for num_seqs in (1, 3, 64, 1000):
        for max_blocks_per_seq in (1, 20, 64, 300):
            for num_sms, blocks_per_sm in ((132, 4), (8, 1), (1, 1)):
                for num_heads, num_kv_heads in ((32, 32), (32, 8), (64, 8)):
                    sizes = dict(num_seqs=num_seqs, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                 max_blocks_per_seq=max_blocks_per_seq, num_sms=num_sms, blocks_per_sm=blocks_per_sm)
                    plan = attention_plan(**sizes, batch_invariant=True)
                    context = max_blocks_per_seq * 16
                    assert plan["error"] is None, plan
                    assert plan["partition_size"] == PARTITION_SIZE, plan
                    assert plan["num_partitions"] == max(2, ceil_div(context, PARTITION_SIZE)), plan
                    base = plan["grid"][0] * plan["grid"][1]
                    assert 1 <= plan["grid"][2] <= min(plan["num_partitions"],
                                                       max(1, num_sms * blocks_per_sm // base)), plan
                    assert plan["reduce_grid"] == (num_seqs, num_heads, 1)
                    default = attention_plan(**sizes)
                    default_plans.add((default["num_partitions"] > 1, default["partition_size"]))
    assert (False, 16) in default_plans and len({size for split, size in default_plans if split}) > 1


def test_batch_invariant_plans_keep_shared_tasks_and_grow_only_past_the_grid():
    plan = attention_plan(num_seqs=8, max_blocks_per_seq=20, num_shared_tasks=5, batch_invariant=True)
    assert plan["num_shared_tasks"] == 5 and plan["grid"][0] == 8 + 5 and plan["num_partitions"] == 2
    # past MAX_GRID_YZ partitions of 512 tokens (33.5M) they grow in whole multiples, as every plan's do
    plan = attention_plan(max_blocks_per_seq=(MAX_GRID_YZ * PARTITION_SIZE) // 16, batch_invariant=True)
    assert (plan["partition_size"], plan["num_partitions"]) == (PARTITION_SIZE, MAX_GRID_YZ)
    plan = attention_plan(max_blocks_per_seq=(MAX_GRID_YZ * PARTITION_SIZE) // 16 + 1, batch_invariant=True)
    assert plan["partition_size"] == 2 * PARTITION_SIZE and plan["num_partitions"] <= MAX_GRID_YZ


def test_batch_invariant_switch():
    import paged_attn

    assert paged_attn.batch_invariant() is False
    paged_attn.set_batch_invariant(True)
    try:
        assert paged_attn.batch_invariant() is True
    finally:
        paged_attn.set_batch_invariant(False)
    assert paged_attn.batch_invariant() is False


# ---------------------------------------------------------------------------------------------------------------
# mla_attention (csrc/cuda/mla_plan.h): plan_attention's partitions over thread blocks of 16 heads.

def mla_plan(num_items=4, num_heads=128, rank=512, rope=64, max_blocks_per_seq=64, block_size=64, num_sms=132,
             blocks_per_sm=2, partition_tokens=512, batch_invariant=0):
    return _C._launch_plan("mla_attention", num_items, num_heads, rank, rope, max_blocks_per_seq, block_size, num_sms,
                           blocks_per_sm, partition_tokens, batch_invariant)


@pytest.mark.parametrize("num_heads, blocks, per_block", [(1, 1, 1), (16, 1, 16), (20, 2, 10), (40, 3, 14),
                                                          (128, 8, 16)])
def test_mla_heads_in_blocks_of_16(num_heads, blocks, per_block):
    """ceil(heads / 16) thread blocks per item, the heads split evenly; the reduce over every head; DeepSeek-V3's
    row takes 94,720 bytes of shared memory (Q, two stages of 32 rows, P: under sm_86/89's 99 KiB)."""
    plan = mla_plan(num_heads=num_heads)
    assert plan["error"] is None
    assert (plan["grid"][1], plan["heads_per_block"], plan["threads"]) == (blocks, per_block, 128)
    assert plan["shared_bytes"] == 2 * (16 * 584 + 2 * 32 * 584 + 16 * 40) == 94720
    if plan["num_partitions"] > 1:
        assert plan["reduce_grid"] == (4, num_heads, 1)


def test_mla_partitions_as_paged_attention_for_the_same_blocks():
    """The partitions and slots are plan_attention's for as many thread blocks per item (head tiles as kv heads)."""
    for items, heads, width in [(1, 128, 512), (64, 16, 128), (256, 128, 16)]:
        plan = mla_plan(num_items=items, num_heads=heads, max_blocks_per_seq=width)
        tiles = -(-heads // 16)
        same = attention_plan(num_seqs=items, num_heads=tiles, num_kv_heads=tiles, max_blocks_per_seq=width,
                              block_size=64, num_sms=132, blocks_per_sm=2)
        assert (plan["num_partitions"], plan["partition_size"], plan["grid"]) == \
            (same["num_partitions"], same["partition_size"], same["grid"])
    invariant = mla_plan(num_items=1, max_blocks_per_seq=8, batch_invariant=1)
    assert (invariant["num_partitions"], invariant["partition_size"]) == (2, 512)


@pytest.mark.parametrize("sizes, message", [
    (dict(rank=64, rope=16), r"kv_lora_rank \+ rope_dim = 64 \+ 16 has no kernel \(instantiated: 512 \+ 64, 128 \+ 32\)"),
    (dict(block_size=24), "block_size 24 is not supported"),
    (dict(block_size=4), "block_size 4 is not supported"),
    (dict(num_items=0), "invalid sizes"),
])
def test_mla_errors(sizes, message):
    assert re.search(message, mla_plan(**sizes)["error"])
