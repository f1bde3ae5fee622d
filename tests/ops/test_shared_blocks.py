"""Shared blocks read once (issue 24, sections 1 and 2), CPU decode: paged_attention finds the partitions that several
rows read in the same physical blocks (csrc/cpu/decode.cpp: find_shared_blocks, on the search of csrc/shared_blocks.h)
and attends each such shared segment once for all of them, each row from its own state, so that a row's output bits
cannot change; that it found them shows in the count of keys read once (paged_attn._C._shared_tokens_saved()).

The batches are trees of sharing, as fork, beam search and prefix caching make them: a 1,300-token prefix (it ends
inside a partition and inside a block) shared by six rows, three of them forking again at 2,100 tokens, tails of their
own of other lengths, one row an exact fork of another (its partially filled last block shared too), and a row that
shares nothing. Every row's output must be bit-identical (torch.equal):
  (a) with the shared blocks copied into distinct blocks of the same bytes (nothing left to share),
  (b) with the search for sharing switched off (PAGED_ATTN_NO_SHARED_BLOCKS=1),
  (c) alone,
  (d) with 1 and 2 threads,
and close to paged_attn.reference.paged_attention in float64; for float32, float16, bfloat16 (the AVX-512 bf16 path
where the CPU has it, and the portable path), a bf16 query over an fp8 cache with scales, GQA and MHA, ALiBi, a
sliding window that ends inside the shared prefix, a soft cap, block sizes 1 to 64; and for the rows of a
variable-length call, whose decode rows of one sequence share all but their last partition. Unused cache slots hold NaN.
"""

import os

import pytest
import torch
from conftest import HAS_AMX, run_on_portable_path
from test_attention import tolerance
from test_batch_invariance import CACHES, FEATURES, HEADS, HEAD_DIM, assert_same_bits, op_kwargs, poisoned

import paged_attn
from paged_attn import _C, reference

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

# Each row: its length and the shared levels it is on, as (level, tokens): tokens [0, n) come from that level.
PREFIX, FORK = 1300, 2100
TREE = [
    (2600, [("prefix", PREFIX), ("fork", FORK)]),
    (2100, [("prefix", PREFIX), ("fork", FORK)]),  # ends where the fork level does
    (2407, [("prefix", PREFIX), ("fork", FORK)]),
    (1301, [("prefix", PREFIX)]),
    (1999, [("prefix", PREFIX), ("twin", 1999)]),
    (1999, [("prefix", PREFIX), ("twin", 1999)]),  # an exact fork of the row before: every block shared
    (1777, []),
]


def make_tree(num_heads, num_kv_heads, query_dtype, cache_dtype, seed, tree=TREE):
    """Per row: (query [num_heads, head_dim], keys and values [length, num_kv_heads, head_dim]); rows on the same
    level hold the same keys and values over the level's tokens."""
    gen = torch.Generator().manual_seed(seed)
    levels = {}

    def draw(n):
        return torch.randn(n, num_kv_heads, HEAD_DIM, generator=gen).to(cache_dtype)

    rows = []
    for length, on in tree:
        keys, values = draw(length), draw(length)
        for level, n in on:  # inner levels last: they overwrite their part of the outer ones
            if level not in levels:
                levels[level] = (keys[:n].clone(), values[:n].clone())
            keys[:n], values[:n] = levels[level]
        rows.append((torch.randn(num_heads, HEAD_DIM, generator=gen).to(query_dtype), keys, values))
    return rows


def lay_out_shared(rows, block_size, seed, *, share=True, spare_blocks=4):
    """The rows in a NaN-poisoned paged cache, blocks shuffled by `seed`. share: a block whose tokens are the same
    tokens of the same levels in several rows (whole blocks, or a last block filled alike) is one physical block;
    otherwise each row has its own blocks. Returns (query, key_cache, value_cache, block_tables, seq_lens)."""
    gen = torch.Generator().manual_seed(seed)
    cache_dtype = rows[0][1].dtype
    num_kv_heads = rows[0][1].shape[1]
    # A block's identity: which bytes it holds (compared as bytes, so fp8 and NaN-free floats alike).
    ids, blocks, tables = {}, [], []
    for r, (_, keys, values) in enumerate(rows):
        table = []
        for b in range(-(-keys.shape[0] // block_size)):
            k, v = keys[b * block_size:(b + 1) * block_size], values[b * block_size:(b + 1) * block_size]
            key = (b, k.view(torch.uint8).numpy().tobytes(), v.view(torch.uint8).numpy().tobytes()) if share \
                else (r, b)
            if key not in ids:
                ids[key] = len(blocks)
                blocks.append((k, v))
            table.append(ids[key])
        tables.append(table)
    num_blocks = len(blocks) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, HEAD_DIM)
    key_cache, value_cache = poisoned(shape, cache_dtype), poisoned(shape, cache_dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    raw = (lambda t: t.view(torch.uint8)) if cache_dtype in (E4M3, E5M2) else (lambda t: t)
    for i, (k, v) in enumerate(blocks):
        raw(key_cache)[perm[i], : k.shape[0]] = raw(k)
        raw(value_cache)[perm[i], : v.shape[0]] = raw(v)
    width = max(len(t) for t in tables) + 2
    block_tables = torch.full((len(rows), width), 10**6, dtype=torch.int32)
    for r, table in enumerate(tables):
        block_tables[r, : len(table)] = perm[torch.tensor(table)].to(torch.int32)
    query = torch.stack([q for q, _, _ in rows])
    seq_lens = torch.tensor([keys.shape[0] for _, keys, _ in rows], dtype=torch.int32)
    return query, key_cache, value_cache, block_tables, seq_lens


def run(case, kwargs, *, threads=None, sharing=True):
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    if not sharing:
        os.environ["PAGED_ATTN_NO_SHARED_BLOCKS"] = "1"
    try:
        out = paged_attn.paged_attention(*case, **kwargs)
    finally:
        torch.set_num_threads(old_threads)
        os.environ.pop("PAGED_ATTN_NO_SHARED_BLOCKS", None)
    assert not out.isnan().any(), "NaN in the output: an unused (poisoned) slot leaked in"
    return out


def check_tree(cache, heads, features, block_size=16, *, threads=(1, 2), seed=0):
    query_dtype, cache_dtype = CACHES[cache]
    num_heads, num_kv_heads = HEADS[heads]
    kwargs = op_kwargs(FEATURES[features], num_heads, cache_dtype)
    rows = make_tree(num_heads, num_kv_heads, query_dtype, cache_dtype, seed)
    shared_case = lay_out_shared(rows, block_size, seed + 1)
    tables = shared_case[3]
    assert len(set(tables[:6, 0].tolist())) == 1, "the layout must share the prefix's first block"
    before = _C._shared_tokens_saved()
    out = run(shared_case, kwargs, threads=threads[-1])
    assert _C._shared_tokens_saved() > before, "no shared segment found: every row read the shared prefix itself"
    expected = reference.paged_attention(*shared_case, compute_dtype=torch.float64, **kwargs)
    torch.testing.assert_close(out, expected.to(out.dtype), **tolerance(out.dtype))
    distinct_case = lay_out_shared(rows, block_size, seed + 2, share=False)
    before = _C._shared_tokens_saved()
    assert_same_bits(run(distinct_case, kwargs, threads=threads[0]), out, "shared blocks vs distinct copies")
    assert_same_bits(run(shared_case, kwargs, threads=threads[0], sharing=False), out,
                     "the search for sharing on vs off")
    assert _C._shared_tokens_saved() == before, "distinct blocks, or the search off, cannot share"
    for t in threads[:-1]:
        assert_same_bits(run(shared_case, kwargs, threads=t), out, f"{threads[-1]} threads vs {t}")
    for r in (0, 4, 6):
        alone = run(lay_out_shared(rows[r:r + 1], block_size, seed + 3 + r), kwargs)
        assert_same_bits(alone[0], out[r], f"row {r} alone vs in the tree")


@pytest.mark.parametrize("features", sorted(FEATURES))
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("cache", ["float32", "bfloat16", "float16", "bf16q-e4m3"])
def test_shared_blocks_give_the_bits_of_distinct_ones(cache, heads, features):
    check_tree(cache, heads, features)


@pytest.mark.parametrize("block_size", [1, 5, 8, 32, 64])
def test_shared_blocks_for_every_block_size(block_size):
    check_tree("bfloat16", "gqa", "all", block_size)


def test_many_rows_on_one_prefix_make_several_segments():
    """40 rows behind one 1,024-token prefix (two whole partitions; more rows than a shared segment holds), own
    100-token tails, and 2 rows of the set on 3 threads: the segments are cut, each reads the partition once, the
    bits stay."""
    tree = [(1124, [("prefix", 1024)])] * 40
    rows = make_tree(8, 2, torch.bfloat16, torch.bfloat16, 21, tree)
    case = lay_out_shared(rows, 16, 22)
    kwargs = {}
    before = _C._shared_tokens_saved()
    run(case, kwargs, threads=1)
    # On one thread: per partition, 3 segments of 14, 13 and 13 rows, each reading the partition's 512 keys once.
    assert _C._shared_tokens_saved() - before == 2 * (40 - 3) * 512
    out = run(case, kwargs, threads=3)
    expected = reference.paged_attention(*case, compute_dtype=torch.float64)
    torch.testing.assert_close(out, expected.to(out.dtype), **tolerance(out.dtype))
    assert_same_bits(run(case, kwargs, threads=1, sharing=False), out, "40 rows, sharing on (3 threads) vs off")
    assert_same_bits(run(lay_out_shared(rows, 16, 23, share=False), kwargs, threads=2), out, "distinct copies")


@pytest.mark.parametrize("features", ["plain", "window", "all"])
@pytest.mark.parametrize("cache", ["float32", "bfloat16", "bf16q-e4m3"])
def test_varlen_rows_share_their_sequence_and_prefix(cache, features):
    """A variable-length call: two sequences on one 1,300-token prefix, each with 3 query tokens (decode-kernel
    rows, which share every partition but the last with each other), and a 40-token prefill on the same prefix. Each
    decode row gives the bits of a decode call of its sequence cut to its position, alone; the prefill rows those of
    the prefill alone; all close to the float64 reference."""
    query_dtype, cache_dtype = CACHES[cache]
    num_heads, num_kv_heads = HEADS["gqa"]
    kwargs = op_kwargs(FEATURES[features], num_heads, cache_dtype)
    tree = [(1900, [("prefix", PREFIX)]), (2345, [("prefix", PREFIX)]), (1340, [("prefix", PREFIX)])]
    rows = make_tree(num_heads, num_kv_heads, query_dtype, cache_dtype, 31, tree)
    _, key_cache, value_cache, block_tables, seq_lens = lay_out_shared(rows, 16, 32)
    gen = torch.Generator().manual_seed(33)
    query = torch.randn(3 + 3 + 40, num_heads, HEAD_DIM, generator=gen).to(query_dtype)
    query_start_loc = torch.tensor([0, 3, 6, 46], dtype=torch.int32)
    case = (query, key_cache, value_cache, block_tables, seq_lens)
    before = _C._shared_tokens_saved()
    out = paged_attn.paged_attention(*case, query_start_loc=query_start_loc, **kwargs)
    assert _C._shared_tokens_saved() > before, "the decode rows' common prefix was not found"
    expected = reference.paged_attention(*case, query_start_loc=query_start_loc, compute_dtype=torch.float64,
                                         **kwargs)
    torch.testing.assert_close(out, expected.to(out.dtype), **tolerance(out.dtype))
    for s in range(2):
        _, keys, values = rows[s]
        length = keys.shape[0]
        for i in range(3):
            n = length - 2 + i
            alone = run(lay_out_shared([(query[3 * s + i], keys[:n], values[:n])], 16, 34 + i), kwargs)
            assert_same_bits(out[3 * s + i], alone[0], f"sequence {s}'s row at position {n - 1} vs alone")
    _, keys, values = rows[2]
    _, kc, vc, bt, sl = lay_out_shared([rows[2]], 16, 40)
    alone = paged_attn.paged_attention(query[6:], kc, vc, bt, sl,
                                       query_start_loc=torch.tensor([0, 40], dtype=torch.int32), **kwargs)
    assert_same_bits(out[6:], alone, "the prefill's rows beside the shared decode rows vs alone")


def test_portable_path_when_avx512_is_switched_off():
    """The bf16 ids again on the portable (AVX2) path."""
    run_on_portable_path(
        "import test_shared_blocks as t\n"
        "for heads in ('gqa', 'mha'):\n"
        "    t.check_tree('bfloat16', heads, 'all')\n"
        "    t.check_tree('bf16q-e4m3', heads, 'window')\n"
    )


@pytest.mark.skipif(not HAS_AMX, reason="no AMX-BF16 here: the opt-in AMX path cannot run")
def test_amx_path():
    """The bf16 trees again on the opt-in AMX path (PAGED_ATTN_AMX=1): every row's bits shared, on distinct copies,
    alone and on 1 or 2 threads, within the reference's tolerance."""
    run_on_portable_path(
        "import test_shared_blocks as t\n"
        "for heads in ('gqa', 'mha'):\n"
        "    for features in ('all', 'plain'):\n"
        "        t.check_tree('bfloat16', heads, features)\n"
        "    t.check_tree('bf16q-e4m3', heads, 'window')\n"
        "t.check_tree('bfloat16', 'gqa', 'soft_cap', block_size=8)\n",
        switch="PAGED_ATTN_AMX",
    )


def wide_group_case():
    """A tree of rows with 24 query heads on one kv head (the AMX path's products take 16 heads, then 8)."""
    rows = make_tree(24, 1, torch.bfloat16, torch.bfloat16, seed=5)
    return rows, lay_out_shared(rows, 16, 6), op_kwargs(FEATURES["all"], 24, torch.bfloat16)


def check_wide_group(path):
    """The wide group's output (saved to `path`) within the reference's tolerance and the same bits on distinct
    copies of the blocks."""
    rows, case, kwargs = wide_group_case()
    out = run(case, kwargs)
    expected = reference.paged_attention(*case, compute_dtype=torch.float64, **kwargs).to(out.dtype)
    torch.testing.assert_close(out, expected, **tolerance(out.dtype))
    assert_same_bits(run(lay_out_shared(rows, 16, 7, share=False), kwargs), out, "shared blocks vs distinct copies")
    torch.save(out, path)


@pytest.mark.skipif(not HAS_AMX, reason="no AMX-BF16 here: the opt-in AMX path cannot run")
def test_amx_path_is_taken_when_asked(tmp_path):
    """With PAGED_ATTN_AMX=1 the bf16 decode takes the AMX path: other bits than the AVX-512 path here (its sums
    come in another order), both within the reference's tolerance, shared or not; 24 heads per kv head: a group
    wider than one tile product."""
    check_wide_group(tmp_path / "avx512.pt")
    run_on_portable_path(f"import test_shared_blocks as t\nt.check_wide_group({str(tmp_path / 'amx.pt')!r})\n",
                         switch="PAGED_ATTN_AMX")
    avx512, amx = torch.load(tmp_path / "avx512.pt"), torch.load(tmp_path / "amx.pt")
    assert not torch.equal(avx512, amx), "the same bits with PAGED_ATTN_AMX=1: the AMX path did not run"
