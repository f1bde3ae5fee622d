"""paged_attn.plan_shared_blocks: the host-side plan of shared blocks for the CUDA decode kernel
(csrc/cuda/shared_blocks.cuh), made by the op of csrc/shared_blocks.cpp, checked against a brute force over every pair
of rows, the op's own checks and its fake; and the shared_plan argument
of paged_attention at the door (CPU: checked, not read; CUDA, where a GPU is present: the same outputs). The kernel
itself runs in tests/emulated/test_emulated_kernels.py (test_shared_blocks_*)."""

import functools
import random
from collections import Counter

import pytest
import torch
from conftest import HAS_CUDA_OPS
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from test_attention import make_case, tolerance

import paged_attn
from paged_attn import reference


def tree_tables(seed, num_seqs, block_size, *, width=40):
    """Random block tables with sharing as forks make it: each new row copies a random earlier row's first k
    entries (k random, sometimes 0) and takes fresh blocks after them; random lengths (full blocks and a tail)."""
    rng = random.Random(seed)
    next_block = 0
    tables, lens = [], []
    for s in range(num_seqs):
        num_blocks = rng.randint(1, width)
        shared = rng.randint(0, num_blocks) if s and rng.random() < 0.8 else 0
        parent = tables[rng.randrange(s)] if s else []
        shared = min(shared, len(parent))
        row = parent[:shared] + list(range(next_block, next_block + num_blocks - shared))
        next_block += num_blocks - shared
        tables.append(row + [-1] * (width - len(row)))
        lens.append((num_blocks - 1) * block_size + rng.randint(1, block_size))
    return torch.tensor(tables, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)


def common_blocks(tables, lens, block_size, a, b):
    """The leading full-block entries rows a and b agree on."""
    n = min(int(lens[a]) // block_size, int(lens[b]) // block_size)
    k = 0
    while k < n and tables[a, k] == tables[b, k]:
        k += 1
    return k


def check_plan(plan, tables, lens, block_size, rows_per_task, min_shared_tokens):
    """Every task valid, every row's listings disjoint; where no node is cut (short segments, leftover rows), a
    row's listings cover exactly the blocks it shares with some other row."""
    num_seqs = tables.shape[0]
    assert plan.dtype == torch.int32 and plan.dim() == 2 and plan.shape[1] == 11
    listed = {r: [] for r in range(num_seqs)}
    for ref, first, end, *rows in plan.tolist():
        members = [r for r in rows if r >= 0]
        assert rows[len(members):] == [-1] * (8 - len(members)), "rows, then -1"
        assert 2 <= len(members) <= rows_per_task and ref == members[0]
        assert 0 <= first < end and (end - first) * block_size >= min_shared_tokens
        for r in members:
            assert int(lens[r]) // block_size >= end, "the row's full blocks reach the end of the task"
            assert torch.equal(tables[r, first:end], tables[ref, first:end])
            listed[r].append((first, end))
    for r, ranges in listed.items():
        ranges.sort()
        assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:])), (r, ranges)
    return listed


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_size", [1, 16])
def test_plan_covers_what_rows_share(seed, block_size):
    """MHA (8 rows per task), one block at least: every block a row shares with another row is in exactly one of its
    listings, and no other block is (a forest of 8 random forks, at any depth: no node is cut)."""
    tables, lens = tree_tables(seed, 8, block_size)
    plan = paged_attn.plan_shared_blocks(tables, lens, block_size, min_shared_tokens=block_size)
    listed = check_plan(plan, tables, lens, block_size, 8, block_size)
    for r in range(tables.shape[0]):
        shared = max(common_blocks(tables, lens, block_size, r, s) for s in range(tables.shape[0]) if s != r)
        covered = sorted(b for first, end in listed[r] for b in range(first, end))
        assert covered == list(range(shared)), (r, shared, listed[r])


@pytest.mark.parametrize("num_queries_per_kv, rows_per_task", [(1, 8), (2, 4), (3, 2), (4, 2), (5, 1), (8, 1),
                                                               (10, 1), (16, 1)])
def test_rows_per_task_follow_the_head_slots(num_queries_per_kv, rows_per_task):
    """A task holds 8 // heads_per_block rows (the kernel's head slots); a lone leftover row is in no task; where a
    thread block holds one row (groups from 5 up) the plan is empty."""
    tables, lens = tree_tables(0, 2, 16)
    tables = tables[[0] * 11]  # 11 rows with one table: one node of 11 rows
    lens = lens[[0] * 11]
    plan = paged_attn.plan_shared_blocks(tables, lens, 16, num_queries_per_kv=num_queries_per_kv,
                                         min_shared_tokens=16)
    if rows_per_task == 1:
        assert plan.shape == (0, 11)
        return
    check_plan(plan, tables, lens, 16, rows_per_task, 16)
    sizes = [int((row[3:] >= 0).sum()) for row in plan]
    expected = [rows_per_task] * (11 // rows_per_task) + ([11 % rows_per_task] if 11 % rows_per_task >= 2 else [])
    assert sizes == expected


def test_short_segments_and_partial_blocks_are_not_listed():
    """A node that adds fewer than min_shared_tokens is not listed (its rows keep the parent's listing); a partially
    filled last block is never shared, even where the entries agree; nothing shared, no task."""
    tables = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 9], [5, 6, 3, 4], [5, 6, 3, 4]], dtype=torch.int32)
    lens = torch.tensor([64, 64, 64, 40], dtype=torch.int32)  # row 3: 2 full blocks, and block 3 partly filled
    plan = paged_attn.plan_shared_blocks(tables, lens, 16, min_shared_tokens=32)  # [2, 3) of rows 0, 1: 16 < 32
    assert plan[:, 1:3].tolist() == [[0, 2]] and sorted(plan[0, 3:7].tolist()) == [0, 1, 2, 3]
    assert plan[0, 0] == plan[0, 3] and plan[0, 7:].tolist() == [-1] * 4
    plan = paged_attn.plan_shared_blocks(tables, lens, 16, min_shared_tokens=16)
    tasks = sorted((first, end, tuple(sorted(r for r in rows if r >= 0))) for _, first, end, *rows in plan.tolist())
    assert tasks == [(0, 2, (0, 1, 2, 3)), (2, 3, (0, 1))]  # rows 2 and 3 agree on block 2: partial for row 3
    unrelated = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=torch.int32)
    assert paged_attn.plan_shared_blocks(unrelated, lens[:2], 16).shape == (0, 11)


# ---------------------------------------------------------------------------------------------------------------
# Deep trees: what the kernel takes of a plan (rule d of csrc/cuda/shared_blocks.cuh), and the K/V blocks it reads.

MAX_ROW_LISTINGS = 8  # csrc/cuda/shared_blocks.cuh: kMaxRowListings


def caterpillar(num_rows=13, step=4, block_size=16, *, deepest_first=False):
    """A chain of forks: row d holds a spine's first step * (d + 1) blocks, then blocks of its own: a partly filled
    one (each row's full blocks a prefix of the next row's: the rows sort shallowest first), or a full one numbered
    above the spine's and a partly filled one (the deepest first)."""
    spine = list(range(step * num_rows))
    width = step * num_rows + 2
    tables, lens = [], []
    for d in range(num_rows):
        own = [len(spine) + 2 * d, len(spine) + 2 * d + 1][:1 + deepest_first]
        row = spine[:step * (d + 1)] + own
        tables.append(row + [-1] * (width - len(row)))
        lens.append((len(row) - 1) * block_size + 1 + (5 * d) % (block_size - 1))
    return torch.tensor(tables, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)


def binary_tree(depth, blocks_per_level=1, block_size=16):
    """2 ** depth rows forked in halves at every level: rows r and r' share blocks_per_level blocks for each leading
    bit of r and r' they agree on, then each row has one block of its own (partly filled)."""
    num_rows = 2 ** depth
    tables = []
    for r in range(num_rows):
        row = []
        for level in range(depth):  # the node of r's first `level + 1` bits
            node = (1 << (level + 1)) - 2 + (r >> (depth - level - 1))
            row += [node * blocks_per_level + b for b in range(blocks_per_level)]
        tables.append(row + [(2 ** (depth + 1)) * blocks_per_level + r])
    lens = [(depth * blocks_per_level) * block_size + 3] * num_rows
    return torch.tensor(tables, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)


def listings(plan):
    """row -> [(task, place, first_block, end_block)] of the plan."""
    found = {}
    for task, (_, first, end, *rows) in enumerate(plan.tolist()):
        for place, r in enumerate(rows):
            if r >= 0:
                found.setdefault(r, []).append((task, place, first, end))
    return found


def modelled_reads(plan, tables, lens, block_size, rows_per_task, partition_blocks=1):
    """The K/V reads of the CUDA kernel with the plan, per kv head, as a Counter of (partition, its physical blocks):
    the kernel takes a listing of a row where its place fits the task's rows_per_task, the row's length reaches the
    end of the task's partitions and its entries there equal the reference's, it is listed at most 8 times and no
    other listing of it overlaps (rules a-d of csrc/cuda/shared_blocks.cuh); a task with a listing taken reads its
    whole partitions once (through its reference's table), a row the partitions of its own that no listing taken
    covers. partition_blocks: the split-KV partition in blocks (1: a block is a partition)."""
    def task_range(first, end):
        return -(-first // partition_blocks), end // partition_blocks

    def key(row, p, num_blocks):
        return p, tuple(tables[row, p * partition_blocks:min((p + 1) * partition_blocks, num_blocks)].tolist())

    plan_rows = plan.tolist()
    taken = set()  # the tasks with a listing taken
    covered = {r: set() for r in range(tables.shape[0])}
    for r, mine in listings(plan).items():
        for task, place, first, end in mine if len(mine) <= MAX_ROW_LISTINGS else []:
            begin, stop = task_range(first, end)
            ref = plan_rows[task][0]
            others = [task_range(f, e) for t, pl, f, e in mine if (t, pl) != (task, place)]
            if (begin < stop and place < rows_per_task and int(lens[r]) >= stop * partition_blocks * block_size
                    and torch.equal(tables[r, begin * partition_blocks:stop * partition_blocks],
                                    tables[ref, begin * partition_blocks:stop * partition_blocks])
                    and not any(b < e and b < stop and begin < e for b, e in others)):
                taken.add(task)
                covered[r].update(range(begin, stop))
    reads = Counter()
    for task in taken:
        ref, first, end = plan_rows[task][:3]
        begin, stop = task_range(first, end)
        for p in range(begin, stop):
            reads[key(ref, p, stop * partition_blocks)] += 1
    for r in range(tables.shape[0]):
        num_blocks = -(-int(lens[r]) // block_size)
        for p in range(-(-num_blocks // partition_blocks)):
            if p not in covered[r]:
                reads[key(r, p, num_blocks)] += 1
    return reads


def fewest_reads(tables, lens, block_size, rows_per_task):
    """The least reads of any plan whose tasks hold rows of one group, over the cuts of the rows (sorted by their
    full blocks' entries) into groups of at most rows_per_task consecutive rows: a group reads each full block its
    rows hold behind the same entries once, a row its partly filled last block itself (the groups' reads counted
    directly, the least over the cuts found by recursion)."""
    full = [int(n) // block_size for n in lens]
    order = sorted((r for r in range(tables.shape[0]) if full[r]), key=lambda r: (tables[r, :full[r]].tolist(), r))
    partial = sum(int(n) % block_size != 0 for n in lens)

    @functools.lru_cache(maxsize=None)
    def group_reads(i, j):
        return len({tuple(tables[r, :b + 1].tolist()) for r in order[i:j] for b in range(full[r])})

    @functools.lru_cache(maxsize=None)
    def least(j):  # the rows before sorted row j
        return 0 if j == 0 else min(least(i) + group_reads(i, j) for i in range(max(0, j - rows_per_task), j))

    return least(len(order)) + partial


def fewest_possible_reads(tables, lens, block_size, rows_per_task, partition_blocks=1):
    """The reads of the rows' partitions, per kv head, where every partition that m rows hold whole is read
    ceil(m / rows_per_task) times (once per task of rows_per_task of them) and every other one once: a Counter as
    modelled_reads' (partition_blocks as there)."""
    held, partial = Counter(), Counter()
    for r in range(tables.shape[0]):
        num_blocks = -(-int(lens[r]) // block_size)
        for p in range(-(-num_blocks // partition_blocks)):
            key = p, tuple(tables[r, p * partition_blocks:min((p + 1) * partition_blocks, num_blocks)].tolist())
            (held if int(lens[r]) >= (p + 1) * partition_blocks * block_size else partial)[key] += 1
    return Counter({key: -(-m // rows_per_task) for key, m in held.items()}) + partial


def check_deep_plan(plan, tables, lens, block_size, rows_per_task, min_shared_tokens):
    """Valid, disjoint listings (check_plan), no row listed more than rows_per_task - 1 (< 8) times; returns the
    listings."""
    check_plan(plan, tables, lens, block_size, rows_per_task, min_shared_tokens)
    found = listings(plan)
    most = max((len(v) for v in found.values()), default=0)
    assert most <= rows_per_task - 1 < MAX_ROW_LISTINGS, {r: len(v) for r, v in found.items()}
    return found


@pytest.mark.parametrize("num_queries_per_kv, rows_per_task", [(1, 8), (2, 4), (4, 2)])
@pytest.mark.parametrize("shape", ["caterpillar", "caterpillar_deepest_first", "caterpillar_24", "binary_depth_10"])
def test_deep_trees_keep_their_sharing(shape, num_queries_per_kv, rows_per_task):
    """A chain of forks (row d leaves the shared prefix after 4 (d + 1) blocks; 13 rows, or 24, sorted deepest or
    shallowest first) and a binary tree of 1024 rows, 10 levels deep: the plan lists no row more often than the
    kernel takes (a plan of the whole tree listed the deepest rows once per level, 9 to 12 times, and the kernel
    then used none of their listings), lists every row (each shares its first blocks with another) but, with 4 or 2
    rows per task, one of 13 left over, the shallowest (it reads its 4 shared blocks itself: ceil(13 / k) reads of
    them either way), and with the plan the kernel reads each shared block ceil(m / rows_per_task) times for the m
    rows that hold it, and each other block once."""
    if shape == "binary_depth_10":
        tables, lens = binary_tree(10)
    else:
        tables, lens = caterpillar(24 if shape == "caterpillar_24" else 13,
                                   deepest_first=shape == "caterpillar_deepest_first")
    plan = paged_attn.plan_shared_blocks(tables, lens, 16, num_queries_per_kv=num_queries_per_kv,
                                         min_shared_tokens=16)
    found = check_deep_plan(plan, tables, lens, 16, rows_per_task, 16)
    num_rows = tables.shape[0]
    left_over = {0} if shape.startswith("caterpillar") and num_rows % rows_per_task == 1 else set()
    assert set(range(num_rows)) - set(found) == left_over
    reads = modelled_reads(plan, tables, lens, 16, rows_per_task)
    expected = fewest_possible_reads(tables, lens, 16, rows_per_task)
    assert reads == expected, {key: (reads[key], expected[key]) for key in reads | expected
                               if reads[key] != expected[key]}


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("num_queries_per_kv, rows_per_task", [(1, 8), (2, 4)])
def test_random_trees_read_the_fewest_blocks_of_any_cut(seed, num_queries_per_kv, rows_per_task):
    """24 rows of random forks, chains of forks among them: no row listed more often than the kernel takes, and the
    kernel's modelled reads with the plan are the fewest of any cut of the sorted rows into groups of rows_per_task
    (tasks hold rows of one group: so a row is in at most rows_per_task - 1 nodes of two rows or more)."""
    rng = random.Random(seed)
    tables, lens = tree_tables(seed, 24, 16)
    for _ in range(rng.randint(0, 2)):  # a chain of forks: rows a, b, c... each a fork of the one before, deeper
        rows = rng.sample(range(24), 6)
        for depth, (a, b) in enumerate(zip(rows, rows[1:]), 1):
            n = min(int(lens[a]) // 16, 2 * depth)
            tables[b, :n] = tables[a, :n]
            lens[b] = max(int(lens[b]), (n + 1) * 16 + 1)
            tables[b, n:] = torch.arange(10_000 + b * 40 + n, 10_000 + b * 40 + 40, dtype=torch.int32)  # its own
    plan = paged_attn.plan_shared_blocks(tables, lens, 16, num_queries_per_kv=num_queries_per_kv,
                                         min_shared_tokens=16)
    check_deep_plan(plan, tables, lens, 16, rows_per_task, 16)
    reads = modelled_reads(plan, tables, lens, 16, rows_per_task)
    assert sum(reads.values()) == fewest_reads(tables, lens, 16, rows_per_task)


@pytest.mark.parametrize("bad", ["dtype", "device_meta", "dims", "rows", "block_size", "group", "min_tokens",
                                 "huge"])
def test_plan_rejects_bad_arguments(bad):
    tables, lens = tree_tables(1, 4, 16)
    args = dict(block_tables=tables, seq_lens=lens, block_size=16)
    if bad == "dtype":
        args["block_tables"] = tables.long()
    elif bad == "device_meta":
        args["seq_lens"] = lens.to("meta")
    elif bad == "dims":
        args["seq_lens"] = lens[None]
    elif bad == "rows":
        args["seq_lens"] = lens[:3]
    elif bad == "block_size":
        args["block_size"] = 0
    elif bad == "group":
        args["num_queries_per_kv"] = 1.5
    elif bad == "huge":
        args["min_shared_tokens"] = 2**63  # past int64: a ValueError that names it, not an OverflowError
    else:
        args["min_shared_tokens"] = -1
    with pytest.raises(ValueError):
        paged_attn.plan_shared_blocks(**args)


OP_ERRORS = {  # the op's own checks, for callers of torch.ops.paged_attn.plan_shared_blocks: (change, message)
    "tables dtype": (lambda t, l: (t.long(), l, 16, 1, 16), "block_tables must be Int"),
    "lens dims": (lambda t, l: (t, l[None], 16, 1, 16), "seq_lens must have 1 dimension"),
    "lens on meta": (lambda t, l: (t, l.to("meta"), 16, 1, 16), "seq_lens must be on cpu"),
    "rows": (lambda t, l: (t, l[:3], 16, 1, 16), "seq_lens must have num_seqs = 4 entries"),
    "block size": (lambda t, l: (t, l, 0, 1, 16), "must be positive, got 0, 1 and 16"),
    "group": (lambda t, l: (t, l, 16, -2, 16), "must be positive, got 16, -2 and 16"),
}


@pytest.mark.parametrize("name", sorted(OP_ERRORS))
def test_op_and_its_fake_refuse_bad_arguments_alike(name):
    """The op's checks at the door, and its fake kernel's (paged_attn/fakes.py), with the same message."""
    change, message = OP_ERRORS[name]
    tables, lens = tree_tables(1, 4, 16)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.paged_attn.plan_shared_blocks(*change(tables, lens))
    with FakeTensorMode(shape_env=ShapeEnv()) as mode, pytest.raises(RuntimeError, match=message):
        fake = [mode.from_tensor(t, static_shapes=True) for t in (tables, lens)]
        torch.ops.paged_attn.plan_shared_blocks(*change(*fake))


def test_op_passes_opcheck_and_traces_under_torch_compile():
    """The op's schema and fake (a data-dependent number of tasks) pass opcheck; a compiled call, with
    data-dependent output shapes captured, gives the eager plan."""
    tables, lens = tree_tables(2, 12, 16)
    torch.library.opcheck(torch.ops.paged_attn.plan_shared_blocks.default, (tables, lens, 16, 1, 16))
    eager = paged_attn.plan_shared_blocks(tables, lens, 16, min_shared_tokens=16)
    assert eager.shape[0] > 0
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        compiled = torch.compile(lambda t, l: paged_attn.plan_shared_blocks(t, l, 16, min_shared_tokens=16) * 1,
                                 fullgraph=True)
        assert torch.equal(compiled(tables, lens), eager)


def shared_decode_case(dtype, device, num_heads=8, num_kv_heads=2):
    """Eight rows: six behind a 160-token prompt (three of them forked again up to 256 tokens), two alone."""
    query, key_cache, value_cache, tables, lens = make_case([300, 290, 270, 200, 180, 161, 90, 40], num_heads,
                                                            num_kv_heads, 64, 16, dtype, device)
    for row in range(1, 6):
        tables[row, :10] = tables[0, :10]
    for row in (1, 2):
        tables[row, :16] = tables[0, :16]
    return query, key_cache, value_cache, tables, lens


def test_cpu_checks_the_plan_and_does_not_read_it():
    """On the CPU the plan is checked for its shape, dtype and device, and otherwise not read (the kernel finds the
    sharing itself): the same bits with a plan, an empty one or garbage; a plan of the wrong shape is an error."""
    query, key_cache, value_cache, tables, lens = shared_decode_case(torch.float32, "cpu")
    plain = paged_attn.paged_attention(query, key_cache, value_cache, tables, lens)
    plan = paged_attn.plan_shared_blocks(tables, lens, 16, num_queries_per_kv=4)
    assert plan.shape[0] > 0
    for given in (plan, plan[:0], torch.randint(-9, 99, (5, 11), dtype=torch.int32)):
        out = paged_attn.paged_attention(query, key_cache, value_cache, tables, lens, shared_plan=given)
        assert torch.equal(out, plain)
    for bad, message in ((plan[:, :10].contiguous(), r"shared_plan must be a contiguous int32 tensor of shape"),
                         (plan.long(), r"shared_plan must be Int"),
                         (plan.t().contiguous().t(), r"shared_plan must be a contiguous"),
                         (plan[0], r"shared_plan must have 2 dimension")):
        with pytest.raises(RuntimeError, match=message):
            paged_attn.paged_attention(query, key_cache, value_cache, tables, lens, shared_plan=bad)


def test_plan_traces_under_torch_compile():
    """The fake kernel takes the plan (and checks it as the op does)."""
    query, key_cache, value_cache, tables, lens = shared_decode_case(torch.float32, "cpu")
    plan = paged_attn.plan_shared_blocks(tables, lens, 16, num_queries_per_kv=4)
    out = torch.empty_like(query)
    torch.library.opcheck(torch.ops.paged_attn.paged_attention.default,
                          (out, query, key_cache, value_cache, tables, lens, 0.125, None, 0, 0.0),
                          {"shared_plan": plan})


@pytest.mark.skipif(not HAS_CUDA_OPS, reason="needs a GPU and the CUDA kernels")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa4"])
def test_cuda_decode_with_a_plan(dtype, heads):
    """On a GPU: the tensor-core decode with the plan, right against the float64 reference; a plan of other
    tables (rows moved) still right."""
    query, key_cache, value_cache, tables, lens = shared_decode_case(dtype, "cuda", *heads)
    plan = paged_attn.plan_shared_blocks(tables.cpu(), lens.cpu(), 16, num_queries_per_kv=heads[0] // heads[1],
                                         min_shared_tokens=16)
    expected = reference.paged_attention(query, key_cache, value_cache, tables, lens, compute_dtype=torch.float64)
    for given in (plan, plan[:, [0, 1, 2, 4, 3, 5, 6, 7, 8, 9, 10]].flip(0).contiguous()):
        out = paged_attn.paged_attention(query, key_cache, value_cache, tables, lens, shared_plan=given.cuda())
        torch.testing.assert_close(out.double(), expected.double(), **tolerance(dtype))
    moved = tables[[1, 0, 6, 3, 4, 5, 2, 7]]
    moved_lens = lens[[1, 0, 6, 3, 4, 5, 2, 7]]
    out = paged_attn.paged_attention(query, key_cache, value_cache, moved, moved_lens, shared_plan=plan.cuda())
    expected = reference.paged_attention(query, key_cache, value_cache, moved, moved_lens,
                                         compute_dtype=torch.float64)
    torch.testing.assert_close(out.double(), expected.double(), **tolerance(dtype))
