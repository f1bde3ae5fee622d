"""NaN and inf in the KV cache, on every CPU decode path (issue 27, findings 1 and 7).

A decode row of a sequence of length L with sliding window W sees tokens [max(0, L - W), L). Everything else a
cache holds may be anything, NaN and inf included, and must not reach the row: the tokens before its window, the
unused slots of its partially filled last block, the tokens past L (block-table entries past the end that point at
real, poisoned blocks), the unused tail of the kernel's 16-token tile (L not a multiple of 16), and, where a long
row's 512-token partitions are merged (and cut between threads), the same around the partition boundaries.
Conversely a NaN the row does see makes its output NaN, and an inf value it sees makes that output element inf (as
in the reference: the AVX-512 bf16 path once gave NaN, from a bf16 weight of 0 times the inf value).

Each case is checked against paged_attn.reference.paged_attention in float64 (which sums over exactly the visible
keys), within the query dtype's tolerance (test_attention.tolerance), NaN matching NaN and inf matching inf.

The paths, by query and cache dtype (csrc/cpu/attention.cpp picks one per call):
  - AVX-512 bf16: bfloat16 query over a bfloat16, float8_e4m3fn or float8_e5m2 cache, head_dim a multiple of 32,
    where the CPU has AVX512_BF16 (elsewhere these ids run the portable path);
  - portable (at::vec): float32 and float16, bfloat16 with head_dim 80, fp8 caches under a float32 or float16
    query, and every "bf16q" id again with PAGED_ATTN_NO_AVX512=1 (test_portable_path_when_avx512_is_switched_off).
"""

import math
import os
import subprocess
import sys

import pytest
import torch
from test_attention import tolerance

import paged_attn
from paged_attn import reference

NAN, INF = float("nan"), float("inf")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

# id: (query dtype, cache dtype, head_dim). Ids with "bf16q" take the AVX-512 bf16 path where the CPU has it.
PATHS = {
    "bf16q-bf16": (torch.bfloat16, torch.bfloat16, 64),
    "bf16q-e4m3": (torch.bfloat16, E4M3, 64),
    "bf16q-e5m2": (torch.bfloat16, E5M2, 64),
    "float32": (torch.float32, torch.float32, 64),
    "float16": (torch.float16, torch.float16, 64),
    "bfloat16-head_dim80": (torch.bfloat16, torch.bfloat16, 80),  # not a multiple of 32: the portable path
    "float32q-e4m3": (torch.float32, E4M3, 64),
    "float16q-e5m2": (torch.float16, E5M2, 80),
}
SEQ_LENS = [1, 7, 16, 20, 33, 50, 100]  # partial tiles and blocks, exact multiples, one token
HEADS = [(4, 4), (8, 2), (6, 1)]  # MHA, GQA (group 4), MQA (group 6: head passes of 4 and 2)


def fp8_scales(cache_dtype):
    if cache_dtype in (E4M3, E5M2):
        return dict(k_scale=torch.tensor([0.75]), v_scale=torch.tensor([1.25]))
    return {}


def poison_value(cache_dtype, value):
    """`value` in the cache's dtype; float8_e4m3fn has no inf, so there inf is its NaN byte."""
    if cache_dtype == E4M3 and math.isinf(value):
        value = NAN
    return torch.tensor(value).to(cache_dtype)


def make_poisoned_case(seq_lens, num_heads, num_kv_heads, head_dim, block_size, query_dtype, cache_dtype, poison,
                       sliding_window=None, extra_blocks=2):
    """Caches whose every slot is `poison` (NaN, inf or -inf) but the ones a decode row sees: random values in
    the sequences' tokens inside their windows. Each block table lists `extra_blocks` more real (poisoned) blocks
    past the sequence's end, and blocks are scattered. Returns (args, kwargs) for paged_attention."""
    blocks_per_seq = [math.ceil(n / block_size) + extra_blocks for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    fill = poison_value(cache_dtype, poison)
    key_cache = fill.expand(shape).clone()
    value_cache = fill.expand(shape).clone()
    free = torch.randperm(num_blocks).tolist()
    tables = [[free.pop() for _ in range(n)] for n in blocks_per_seq]
    for table, n in zip(tables, seq_lens):
        first = 0 if sliding_window is None else max(0, n - sliding_window)
        for t in range(first, n):
            block, offset = table[t // block_size], t % block_size
            key_cache[block, offset] = torch.randn(num_kv_heads, head_dim).to(cache_dtype)
            value_cache[block, offset] = torch.randn(num_kv_heads, head_dim).to(cache_dtype)
    width = max(blocks_per_seq)
    block_tables = torch.tensor([table + [table[-1]] * (width - len(table)) for table in tables], dtype=torch.int32)
    query = torch.randn(len(seq_lens), num_heads, head_dim).to(query_dtype)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    kwargs = dict(sliding_window=sliding_window, **fp8_scales(cache_dtype))
    return [query, key_cache, value_cache, block_tables, seq_lens], kwargs


def check_against_reference(args, kwargs, *, expect_finite):
    actual = paged_attn.paged_attention(*args, **kwargs)
    expected = reference.paged_attention(*args, compute_dtype=torch.float64, **kwargs)
    if expect_finite:
        bad = ~actual.isfinite()
        assert not bad.any(), (f"{int(bad.sum())} non-finite outputs (sequences "
                               f"{sorted(set(bad.nonzero()[:, 0].tolist()))}): a slot outside the window leaked in")
    torch.testing.assert_close(actual, expected.to(actual.dtype), equal_nan=True, **tolerance(args[0].dtype))
    return actual


@pytest.fixture
def threads(request):
    """torch.set_num_threads(n) for the test (which thread takes which of a row's partitions depends on the count)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(saved)


# ----------------------------------------------------------------------------------------------------------------
# Finding 1: what a row does not see never reaches it


@pytest.mark.parametrize("sliding_window", [None, 12])
@pytest.mark.parametrize("block_size", [16, 32, 5])
@pytest.mark.parametrize("poison", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("heads", HEADS, ids=[f"{h}q{k}kv" for h, k in HEADS])
@pytest.mark.parametrize("path", PATHS)
def test_poison_outside_the_visible_range_never_reaches_a_row(path, heads, poison, block_size, sliding_window):
    query_dtype, cache_dtype, head_dim = PATHS[path]
    args, kwargs = make_poisoned_case(SEQ_LENS, *heads, head_dim, block_size, query_dtype, cache_dtype, poison,
                                      sliding_window)
    check_against_reference(args, kwargs, expect_finite=True)


@pytest.mark.parametrize("threads", [4], indirect=True)
@pytest.mark.parametrize("sliding_window", [None, 2500])
@pytest.mark.parametrize("poison", [NAN, INF], ids=["nan", "inf"])
@pytest.mark.parametrize("path", PATHS)
def test_poison_outside_the_visible_range_with_split_partitions(path, poison, sliding_window, threads):
    # Two long sequences on 4 threads: each is cut into 512-token partitions, and between threads, and the
    # partitions merged (the cache holds more than 2 MiB of keys and values even in fp8, so that the kernel uses more
    # than one thread); lengths and window leave partial tiles, partitions and blocks at both ends.
    query_dtype, cache_dtype, head_dim = PATHS[path]
    args, kwargs = make_poisoned_case([3001, 4100], 16, 4, head_dim, 16, query_dtype, cache_dtype, poison,
                                      sliding_window)
    check_against_reference(args, kwargs, expect_finite=True)


@pytest.mark.parametrize("where", ["key", "value"])
@pytest.mark.parametrize("path", PATHS)
def test_a_visible_nan_gives_nan(path, where):
    # A NaN in one element of one visible row of kv head 1 of sequence 2: a key's NaN makes that kv head's query
    # heads NaN in every element, a value's in that element only; other sequences and heads stay finite.
    query_dtype, cache_dtype, head_dim = PATHS[path]
    args, kwargs = make_poisoned_case([5, 40, 37], 8, 2, head_dim, 16, query_dtype, cache_dtype, NAN)
    cache = args[1] if where == "key" else args[2]
    block_tables = args[3]
    token, element = 21, 3
    cache[block_tables[2, token // 16], token % 16, 1, element] = poison_value(cache_dtype, NAN)
    out = check_against_reference(args, kwargs, expect_finite=False)
    nan = out.isnan()
    expected = torch.zeros_like(nan)
    if where == "key":
        expected[2, 4:] = True
    else:
        expected[2, 4:, element] = True
    assert torch.equal(nan, expected), f"NaN at {nan.nonzero().tolist()[:8]}..."


# ----------------------------------------------------------------------------------------------------------------
# Finding 7: a visible inf value reads as inf on every path


INF_PATHS = [path for path, (_, cache_dtype, _) in PATHS.items() if cache_dtype != E4M3]  # e4m3fn has no inf


@pytest.mark.parametrize("sign", [1, -1], ids=["+inf", "-inf"])
@pytest.mark.parametrize("seq_len,token", [(1, 0), (2, 1), (2, 0), (17, 16), (17, 3), (40, 39), (64, 31)])
@pytest.mark.parametrize("path", INF_PATHS)
def test_a_visible_inf_value_gives_inf(path, seq_len, token, sign):
    # The inf is at the row's max-logit token too (seq_len 1): its weight is exactly 1, whose bf16 split has a low
    # part of 0, and 0 * inf is NaN. Tokens past seq_len and unused slots hold NaN.
    query_dtype, cache_dtype, head_dim = PATHS[path]
    args, kwargs = make_poisoned_case([seq_len, 9], 8, 2, head_dim, 16, query_dtype, cache_dtype, NAN)
    element = 5
    args[2][args[3][0, token // 16], token % 16, 0, element] = poison_value(cache_dtype, sign * INF)
    out = check_against_reference(args, kwargs, expect_finite=False)
    assert (out[0, :4, element] == sign * INF).all(), out[0, :4, element]
    out[0, :4, element] = 0
    assert out.isfinite().all()


@pytest.mark.parametrize("threads", [4], indirect=True)
@pytest.mark.parametrize("path", INF_PATHS)
def test_a_visible_inf_value_gives_inf_with_split_partitions(path, threads):
    query_dtype, cache_dtype, head_dim = PATHS[path]
    # One sequence on 4 threads: cut between them, an inf in the first, a middle and the last partition.
    args, kwargs = make_poisoned_case([6001], 16, 4, head_dim, 16, query_dtype, cache_dtype, NAN)
    for token, element in [(0, 1), (3500, 2), (6000, 3)]:
        args[2][args[3][0, token // 16], token % 16, 1, element] = poison_value(cache_dtype, INF)
    out = check_against_reference(args, kwargs, expect_finite=False)
    assert (out[0, 4:8, 1:4] == INF).all()


# ----------------------------------------------------------------------------------------------------------------
# The portable path for bfloat16 queries, on a CPU that would take the AVX-512 one


def test_portable_path_when_avx512_is_switched_off():
    # PAGED_ATTN_NO_AVX512=1 makes the process take the portable path for every call (the choice is made once
    # per process), so the "bf16q" cases above run again in a child process that way.
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PAGED_ATTN_NO_AVX512="1")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k",
                             "bf16q and not switched_off", os.path.abspath(__file__)],
                            env=env, cwd=tests_dir, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
