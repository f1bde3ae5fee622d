"""paged_attention against paged_attn.reference.paged_attention, and the reference against dense float64 attention.

Tolerances (stated once, used everywhere): float32 within rtol = atol = 1e-5; float16 and bfloat16 within
rtol = atol = 2e-2 (the kernels accumulate in float32 like the reference; the rest is the output's rounding).
Inputs are random normal; cache slots that no sequence reads, and whole unused blocks, are NaN; block-table
entries past a sequence's end hold garbage (-1 and huge ids).
"""

import math

import numpy as np
import pytest
import torch
from conftest import DEVICES, HAS_CUDA_OPS, requires_cuda, run_on_portable_path

import paged_attn
from paged_attn import reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_DIMS = [32, 64, 80, 96, 112, 120, 128, 192, 256]
NAN = float("nan")
GARBAGE = [-1, 10**6]  # written into unused block-table entries


def tolerance(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def make_case(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, *, layout="contiguous",
              repeat_blocks=False, spare_blocks=3):
    """A paged KV cache holding len(seq_lens) sequences in random, scattered blocks, and one query per sequence.

    layout="strided": the caches are the [:, 0] and [:, 1] halves of one [num_blocks, 2, ...] allocation and the
    query is a slice of a fused QKV tensor. repeat_blocks: some full blocks are shared between two sequences and
    one sequence holds the same block twice.
    """
    num_seqs = len(seq_lens)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    max_blocks_per_seq = max(blocks_per_seq + [1]) + 2
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if layout == "contiguous":
        key_cache = torch.full(shape, NAN, dtype=dtype, device=device)
        value_cache = torch.full(shape, NAN, dtype=dtype, device=device)
        query = torch.randn(num_seqs, num_heads, head_dim, dtype=dtype, device=device)
    else:
        alloc = torch.full((num_blocks, 2) + shape[1:], NAN, dtype=dtype, device=device)
        key_cache, value_cache = alloc[:, 0], alloc[:, 1]
        qkv = torch.randn(num_seqs, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype, device=device)
        query = qkv[:, :num_heads]

    free = torch.randperm(num_blocks).tolist()
    tables = [[free.pop() for _ in range(n)] for n in blocks_per_seq]
    if repeat_blocks:
        full = [i for i, n in enumerate(seq_lens) if n >= 2 * block_size]  # sequences whose first block is full
        if len(full) >= 2:
            tables[full[1]][0] = tables[full[0]][0]  # two sequences share a block
        long = [i for i, n in enumerate(seq_lens) if n >= 3 * block_size]
        if long:
            tables[long[0]][1] = tables[long[0]][0]  # one sequence holds a block twice
    block_tables = torch.tensor(
        [table + [GARBAGE[i % 2]] * (max_blocks_per_seq - len(table)) for i, table in enumerate(tables)],
        dtype=torch.int32,
    ).reshape(num_seqs, max_blocks_per_seq)
    for table, n in zip(tables, seq_lens):
        for i, block in enumerate(table):
            filled = min(block_size, n - i * block_size)
            if key_cache[block, 0, 0, 0].isnan():  # a shared block is filled once
                key_cache[block, :filled] = torch.randn(filled, num_kv_heads, head_dim, dtype=dtype)
                value_cache[block, :filled] = torch.randn(filled, num_kv_heads, head_dim, dtype=dtype)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    return query, key_cache, value_cache, block_tables.to(device), seq_lens_t.to(device)


def dense_attention_float64(query, key_cache, value_cache, block_tables, seq_lens, *, scale=None,
                            alibi_slopes=None, sliding_window=None, logits_soft_cap=None):
    """Attention written out per sequence and per head, in float64, on keys/values gathered token by token."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    out = torch.zeros(num_seqs, num_heads, head_dim, dtype=torch.float64)
    for s in range(num_seqs):
        length = int(seq_lens[s])
        first = 0 if sliding_window is None else max(0, length - sliding_window)
        tokens = list(range(first, length))
        if not tokens:
            continue
        for h in range(num_heads):
            kv_head = h // (num_heads // num_kv_heads)
            keys = torch.stack([key_cache[int(block_tables[s, t // block_size]), t % block_size, kv_head]
                                for t in tokens]).cpu().double()
            values = torch.stack([value_cache[int(block_tables[s, t // block_size]), t % block_size, kv_head]
                                  for t in tokens]).cpu().double()
            logits = keys @ query[s, h].cpu().double() * scale
            if logits_soft_cap is not None:
                logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
            if alibi_slopes is not None:
                logits += float(alibi_slopes[h]) * (torch.tensor(tokens, dtype=torch.float64) - (length - 1))
            out[s, h] = torch.softmax(logits, dim=0) @ values
    return out


def check(case, dtype, **kwargs):
    expected = reference.paged_attention(*case, **kwargs)
    actual = paged_attn.paged_attention(*case, **kwargs)
    assert actual.dtype == dtype and actual.shape == case[0].shape
    assert not actual.isnan().any(), "NaN in the output: an unused (poisoned) slot leaked in"
    torch.testing.assert_close(actual, expected, **tolerance(dtype))
    return actual


# ----------------------------------------------------------------------------------------------------------------
# The reference itself


@pytest.mark.parametrize(
    "features",
    [{}, {"alibi": True}, {"sliding_window": 7}, {"logits_soft_cap": 5.0}, {"alibi": True, "sliding_window": 20,
                                                                            "logits_soft_cap": 30.0, "scale": 0.3}],
)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (4, 1)])
def test_reference_matches_dense_float64(num_heads, num_kv_heads, features):
    case = make_case([1, 16, 37, 0, 50], num_heads, num_kv_heads, 32, 16, torch.float64, "cpu", repeat_blocks=True)
    kwargs = dict(features)
    if kwargs.pop("alibi", False):
        kwargs["alibi_slopes"] = torch.rand(num_heads) * 0.5
    expected = dense_attention_float64(*case, **kwargs)
    actual = reference.paged_attention(*case, **kwargs, compute_dtype=torch.float64)
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------------------------------
# The kernels


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_head_dims_and_dtypes(dtype, head_dim, device):
    case = make_case([1, 16, 45, 130], 8, 2, head_dim, 16, dtype, device)
    check(case, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [1, 5, 8, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_sizes_and_lengths(dtype, block_size, device):
    if device == "cuda" and block_size not in (8, 16, 32):
        pytest.skip("CUDA supports block sizes 8, 16 and 32")
    # Length 1, exact multiples of the block size, partial last blocks, and lengths around 512-token partitions.
    seq_lens = [1, block_size, 3 * block_size, 3 * block_size + 1, 511, 512, 513, 1100]
    check(make_case(seq_lens, 4, 2, 64, block_size, dtype, device), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 8), (32, 8), (9, 3), (8, 1), (16, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mha_gqa_mqa(dtype, num_heads, num_kv_heads, device):
    check(make_case([3, 64, 100], num_heads, num_kv_heads, 64, 16, dtype, device), dtype)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 8), (9, 3), (8, 1), (16, 1), (24, 4)])
def test_cpu_bfloat16_group_sizes(num_heads, num_kv_heads):
    # On CPUs with AVX512_BF16, bfloat16 takes a path that serves a kv head's query heads in tiles of up to 4.
    check(make_case([3, 64, 100], num_heads, num_kv_heads, 64, 16, torch.bfloat16, "cpu"), torch.bfloat16)


def check_bfloat16_is_as_exact_as_float32_math(head_dim, tiled=False):
    """Stricter than the half-type tolerance: every path must compute in float32 (the AVX-512 bf16 path splits p
    into two bf16 terms for that), so the bf16 output is the reference's to within one bf16 unit in the last
    place, plus 1e-5 for the order of the float32 sums. Rounding p to a single bf16 misses this by ~2e-3.
    tiled: the op reads the caches packed (paged_attn.pack_cache), the reference the row-major ones."""
    case = make_case([1, 17, 300, 1000, 77], 32, 8, head_dim, 16, torch.bfloat16, "cpu")
    query, key_cache, value_cache, block_tables, seq_lens = case
    caches = paged_attn.pack_cache(key_cache, value_cache) if tiled else (key_cache, value_cache)
    actual = paged_attn.paged_attention(query, *caches, block_tables, seq_lens).float()
    expected = reference.paged_attention(*case).float()
    ulp = torch.exp2(torch.floor(torch.log2(expected.abs().clamp_min(1e-30))) - 7)  # bf16 keeps 8 bits
    excess = ((actual - expected).abs() - ulp).max().item()
    assert excess <= 1e-5, f"{excess:.3g} beyond one bf16 ulp"


@pytest.mark.parametrize("head_dim", [64, 128])
def test_cpu_bfloat16_is_as_exact_as_float32_math(head_dim):
    # NOTE: this checks the AVX-512 bf16 path only where the CPU has AVX512_BF16 (the path is picked at run time);
    # elsewhere it checks the portable AVX2 path again. It is the only test of the AVX-512 path's exactness, so a
    # change to that path must be tested on such a CPU. The AVX2 path's exactness is checked on every CPU by
    # test_cpu_avx2_path_when_avx512_is_switched_off.
    check_bfloat16_is_as_exact_as_float32_math(head_dim)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("sliding_window", [None, 1, 7, 100, 5000])
@pytest.mark.parametrize("logits_soft_cap", [None, 2.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_alibi_window_soft_cap(dtype, logits_soft_cap, sliding_window, alibi, device):
    num_heads = 8
    case = make_case([1, 9, 150, 700], num_heads, 4, 128, 16, dtype, device)
    alibi_slopes = torch.rand(num_heads, device=device) * 0.2 if alibi else None
    # A large scale makes the soft cap bite.
    check(case, dtype, scale=1.0 if logits_soft_cap else None, alibi_slopes=alibi_slopes,
          sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_views_repeated_blocks_and_empty_sequences(dtype, device):
    case = make_case([40, 0, 64, 1, 0, 333], 12, 4, 80, 16, dtype, device, layout="strided", repeat_blocks=True)
    out = check(case, dtype)
    assert torch.count_nonzero(out[1]) == 0 and torch.count_nonzero(out[4]) == 0, "seq_len 0 must give zeros"


@pytest.mark.parametrize("device", DEVICES)
def test_long_single_sequence_and_out_argument(device):
    # One sequence, long context: the kernels split it across threads / thread blocks and merge the parts.
    case = make_case([4099], 32, 8, 128, 16, torch.bfloat16, device)
    out = torch.full_like(case[0], NAN)
    result = paged_attn.paged_attention(*case, out=out)
    assert result is out
    torch.testing.assert_close(out, reference.paged_attention(*case), **tolerance(torch.bfloat16))


@pytest.mark.parametrize("device", DEVICES)
def test_large_batch(device):
    seq_lens = torch.randint(1, 300, (70,)).tolist()
    check(make_case(seq_lens, 8, 2, 128, 16, torch.float16, device), torch.float16)


@pytest.mark.parametrize("device", DEVICES)
def test_block_tables_much_wider_than_the_sequences(device):
    # Split-KV sizes its partitions from the table's width: most partitions of these sequences hold no token (past
    # seq_len, or before the window). They must cost nothing and contribute nothing.
    query, key_cache, value_cache, block_tables, seq_lens = make_case([1, 30, 2000], 8, 8, 64, 16, torch.bfloat16,
                                                                      device)
    wide = torch.full((3, 400), -1, dtype=torch.int32, device=device)
    wide[:, : block_tables.shape[1]] = block_tables
    for window in [None, 600]:
        check((query, key_cache, value_cache, wide, seq_lens), torch.bfloat16, sliding_window=window)


@pytest.mark.parametrize("device", DEVICES)
def test_sliding_window_larger_than_any_sequence_means_all_tokens(device):
    # The op takes an int64 window; CUDA used to narrow it to int (2**32 + 5 became 5).
    case = make_case([1, 40, 700], 8, 2, 64, 16, torch.float32, device)
    expected = paged_attn.paged_attention(*case)
    for window in [700, 2**31, 2**32 + 5, 2**40]:
        torch.testing.assert_close(paged_attn.paged_attention(*case, sliding_window=window), expected, rtol=0, atol=0)


@requires_cuda
@pytest.mark.parametrize("seq_len", [600, 150_000])
def test_cuda_split_kv_many_partitions(seq_len):
    # One sequence, so split-KV: on 132 SMs, 10 partitions of 64 tokens, and 469 to 1,172 of 128 to 320 tokens (the
    # reduce kernel takes them 256 at a time; its shared memory used to grow with the partition count).
    case = make_case([seq_len], 2, 1, 32, 32, torch.float32, "cuda")
    check(case, torch.float32)


@requires_cuda
def test_cuda_float32_results_are_the_same_bits_every_run():
    # The row groups' partial sums are added in a fixed order (they were added with shared-memory atomics).
    for seq_lens in ([5, 300, 1000, 77], [4099]):  # single pass and split-KV
        case = make_case(seq_lens, 16, 4, 128, 16, torch.float32, "cuda")
        first = paged_attn.paged_attention(*case)
        for _ in range(5):
            assert torch.equal(paged_attn.paged_attention(*case), first)


@requires_cuda
def test_cuda_invalid_seq_lens_are_clamped_without_validation():
    # Without validation nothing checks seq_lens on CUDA; the kernels read a length past the table's capacity as
    # the capacity (never past the sequence's row of the block table) and a negative one as 0.
    num_blocks, block_size, max_blocks = 40, 16, 6
    key_cache = torch.randn(num_blocks, block_size, 2, 64, device="cuda")
    value_cache = torch.randn_like(key_cache)
    query = torch.randn(3, 4, 64, device="cuda")
    block_tables = torch.randint(0, num_blocks, (3, max_blocks), dtype=torch.int32, device="cuda")
    capacity = max_blocks * block_size
    seq_lens = torch.tensor([capacity + 100, -3, 2**31 - 1], dtype=torch.int32, device="cuda")
    before = paged_attn.validation_enabled()
    paged_attn.set_validation(False)
    try:
        actual = paged_attn.paged_attention(query, key_cache, value_cache, block_tables, seq_lens)
    finally:
        paged_attn.set_validation(before)
    clamped = seq_lens.clamp(0, capacity)
    expected = reference.paged_attention(query, key_cache, value_cache, block_tables, clamped)
    torch.testing.assert_close(actual, expected, **tolerance(torch.float32))


def test_no_sequences():
    case = make_case([], 4, 2, 64, 16, torch.float32, "cpu")
    assert paged_attn.paged_attention(*case).shape == (0, 4, 64)


# ----------------------------------------------------------------------------------------------------------------
# The teaching reference


def test_teaching_executor_agrees_after_layout_conversion():
    case = make_case([1, 17, 64, 90], 6, 3, 64, 16, torch.float32, "cpu")
    query, key_cache, value_cache, block_tables, seq_lens = case
    executor = reference.PagedAttentionExecutor.from_nhd(key_cache, value_cache)
    expected = paged_attn.paged_attention(*case)
    actual = executor.forward(query, block_tables, seq_lens)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# torch.library, torch.compile and CUDA graphs


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    query, key_cache, value_cache, block_tables, seq_lens = make_case([5, 20], 4, 2, 64, 16, torch.float32, device)
    for cache in (key_cache, value_cache):
        cache.nan_to_num_(0.5)  # opcheck compares whole tensors, NaN != NaN
    out = torch.empty_like(query)
    alibi = torch.rand(4, device=device)
    torch.library.opcheck(
        torch.ops.paged_attn.paged_attention.default,
        (out, query, key_cache, value_cache, block_tables, seq_lens, 0.125, alibi, 0, 0.0),
    )


def test_torch_compile_fullgraph():
    case = make_case([5, 33], 4, 2, 64, 16, torch.float32, "cpu")

    def attend(query, key_cache, value_cache, block_tables, seq_lens):
        return paged_attn.paged_attention(query * 2, key_cache, value_cache, block_tables, seq_lens).sum(-1)

    compiled = torch.compile(attend, fullgraph=True)
    expected = reference.paged_attention(case[0] * 2, *case[1:]).sum(-1)
    torch.testing.assert_close(compiled(*case), expected, rtol=1e-5, atol=1e-5)


def test_torch_compile_dynamic_scalars():
    # With dynamic=True the scalars are symbolic while tracing: the wrapper's and the fake's checks must trace them.
    case = make_case([5, 33], 4, 2, 64, 16, torch.float32, "cpu")

    def attend(sliding_window, logits_soft_cap, scale, *case):
        return paged_attn.paged_attention(*case, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                                          scale=scale)

    compiled = torch.compile(attend, fullgraph=True, dynamic=True)
    for scalars in [(3, 2.0, 0.3), (7, 4.0, 0.1)]:
        torch.testing.assert_close(compiled(*scalars, *case), attend(*scalars, *case), rtol=1e-5, atol=1e-5)


@requires_cuda
def test_cuda_graph_capture_and_replay():
    query, key_cache, value_cache, block_tables, seq_lens = make_case(
        [1, 700, 3000], 8, 2, 128, 16, torch.bfloat16, "cuda")
    out = torch.empty_like(query)
    paged_attn.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, out=out)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attn.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, out=out)
    query.copy_(torch.randn_like(query))
    seq_lens.copy_(torch.tensor([1, 650, 2999], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    expected = reference.paged_attention(query, key_cache, value_cache, block_tables, seq_lens)
    torch.testing.assert_close(out, expected, **tolerance(torch.bfloat16))


# ----------------------------------------------------------------------------------------------------------------
# Errors


def error_case(device="cpu"):
    return make_case([5, 20], 4, 2, 64, 16, torch.float32, device)


def with_entry(t, row, col, value):
    """A copy of t with t[row, col] (or t[row] when col is None) set to value."""
    t = t.clone()
    t[row if col is None else (row, col)] = value
    return t


ERRORS = {
    "query rank": (lambda q, k, v, t, s: (q[0], k, v, t, s), {}, ValueError, "query must have shape"),
    "no heads": (lambda q, k, v, t, s: (q[:, :0], k, v, t, s), {}, ValueError, "positive num_heads and head_dim"),
    "query head_dim 0": (lambda q, k, v, t, s: (q[..., :0], k, v, t, s), {}, ValueError,
                         "positive num_heads and head_dim"),
    "query dtype": (lambda q, k, v, t, s: (q.half(), k, v, t, s), {}, RuntimeError, "same dtype"),
    "head_dim": (lambda q, k, v, t, s: (q[..., :32], k, v, t, s), {}, RuntimeError, "head_dim 32 but the cache"),
    "head ratio": (lambda q, k, v, t, s: (q[:, :3], k, v, t, s), {}, RuntimeError,
                   r"num_heads \(3\) must be a multiple of num_kv_heads \(2\)"),
    "cache pair": (lambda q, k, v, t, s: (q, k, v[:, :8], t, s), {}, RuntimeError,
                   r"must have the same dtype, device and \[num_blocks, block_size, num_kv_heads\]"),
    "value dtype": (lambda q, k, v, t, s: (q, k, v.double(), t, s), {}, RuntimeError,
                    "value_cache must be float32, float16, bfloat16"),
    "out width": (lambda q, k, v, t, s: (q, k, v[..., :16], t, s), {"out": torch.empty(2, 4, 64)}, RuntimeError,
                  r"out must be a Float tensor of shape \[\d+, \d+, 16\]"),
    "table dtype": (lambda q, k, v, t, s: (q, k, v, t.long(), s), {}, RuntimeError, "block_tables must be Int"),
    "table rows": (lambda q, k, v, t, s: (q, k, v, t[:1], s), {}, RuntimeError, "block_tables must have num_seqs"),
    "lens dtype": (lambda q, k, v, t, s: (q, k, v, t, s.long()), {}, RuntimeError, "seq_lens must be Int"),
    "lens count": (lambda q, k, v, t, s: (q, k, v, t, s[:1]), {}, RuntimeError, "seq_lens must have num_seqs"),
    "seq too long": (lambda q, k, v, t, s: (q, k, v, t, torch.full_like(s, 10**4)), {}, RuntimeError,
                     r"seq_lens\[0\] = 10000 is out of range"),
    "negative length": (lambda q, k, v, t, s: (q, k, v, t, -s), {}, RuntimeError, r"seq_lens\[0\] = -5"),
    "block id": (lambda q, k, v, t, s: (q, k, v, torch.full_like(t, 999), s), {}, RuntimeError,
                 r"block_tables\[0, 0\] = 999 is out of range"),
    "block id = num_blocks": (lambda q, k, v, t, s: (q, k, v, with_entry(t, 1, 1, k.shape[0]), s), {}, RuntimeError,
                              r"block_tables\[1, 1\] = 6 is out of range \[0, 6\) \(sequence 1 has 20 tokens\)"),
    "seq one past the table": (lambda q, k, v, t, s: (q, k, v, t, with_entry(s, 1, None, t.shape[1] * 16 + 1)), {},
                               RuntimeError, r"seq_lens\[1\] = 65 is out of range \[0, 64\]"),
    "alibi shape": (lambda q, k, v, t, s: (q, k, v, t, s), {"alibi_slopes": torch.ones(3)}, RuntimeError,
                    "alibi_slopes must have num_heads = 4"),
    "alibi dtype": (lambda q, k, v, t, s: (q, k, v, t, s), {"alibi_slopes": torch.ones(4).double()}, RuntimeError,
                    "alibi_slopes must be Float"),
    "window": (lambda q, k, v, t, s: (q, k, v, t, s), {"sliding_window": 0}, ValueError, "sliding_window"),
    "soft cap": (lambda q, k, v, t, s: (q, k, v, t, s), {"logits_soft_cap": -1.0}, ValueError, "logits_soft_cap"),
    "infinite soft cap": (lambda q, k, v, t, s: (q, k, v, t, s), {"logits_soft_cap": math.inf}, ValueError,
                          "logits_soft_cap must be positive and finite"),
    "NaN soft cap": (lambda q, k, v, t, s: (q, k, v, t, s), {"logits_soft_cap": NAN}, ValueError,
                     "logits_soft_cap must be positive and finite"),
    "infinite scale": (lambda q, k, v, t, s: (q, k, v, t, s), {"scale": -math.inf}, ValueError, "scale must be finite"),
    "NaN scale": (lambda q, k, v, t, s: (q, k, v, t, s), {"scale": NAN}, ValueError, "scale must be finite"),
    "fractional window": (lambda q, k, v, t, s: (q, k, v, t, s), {"sliding_window": 3.7}, ValueError,
                          "sliding_window must be a positive integer"),
    "float window": (lambda q, k, v, t, s: (q, k, v, t, s), {"sliding_window": 3.0}, ValueError,
                     "sliding_window must be a positive integer"),
    "bool window": (lambda q, k, v, t, s: (q, k, v, t, s), {"sliding_window": True}, ValueError,
                    "sliding_window must be a positive integer"),
    "window past int64": (lambda q, k, v, t, s: (q, k, v, t, s), {"sliding_window": 2**63}, ValueError,
                          r"sliding_window must be a positive integer number of tokens \(at most 2\*\*63 - 1: the op "
                          r"takes an int64\) or None, got 9223372036854775808"),
    "out shape": (lambda q, k, v, t, s: (q, k, v, t, s), {"out": torch.empty(2, 4, 32)}, RuntimeError,
                  "out must be a Float tensor of shape"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ERRORS)
def test_errors(case, device, validation):
    make_args, kwargs, error, message = ERRORS[case]
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with pytest.raises(error, match=message):
        paged_attn.paged_attention(*make_args(*error_case(device)), **kwargs)


@pytest.mark.parametrize("device", DEVICES)
def test_sequences_filling_their_block_table(device):
    # The boundary the range checks must let through: seq_len = max_blocks_per_seq * block_size, reading every
    # entry of the table, and the last block id, num_blocks - 1.
    query, key_cache, value_cache, block_tables, seq_lens = make_case([5, 32], 4, 2, 64, 16, torch.float32, device)
    case = (query, key_cache, value_cache, with_entry(block_tables[:, :2], 0, 0, key_cache.shape[0] - 1), seq_lens)
    key_cache[-1, :5] = torch.randn(5, 2, 64)
    value_cache[-1, :5] = torch.randn(5, 2, 64)
    check(case, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale,logits_soft_cap,message", [
    (math.inf, 0.0, "scale must be finite, got inf"),
    (NAN, 0.0, "scale must be finite, got nan"),
    (1.0, math.inf, "logits_soft_cap must be positive and finite"),
    (1.0, NAN, "logits_soft_cap must be positive and finite"),
])
def test_op_refuses_non_finite_scalars(scale, logits_soft_cap, message, device):
    # The op itself, without the Python wrapper's checks: anyone can call torch.ops.paged_attn.paged_attention.
    query, key_cache, value_cache, block_tables, seq_lens = error_case(device)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.paged_attn.paged_attention(torch.empty_like(query), query, key_cache, value_cache, block_tables,
                                             seq_lens, scale, None, 0, logits_soft_cap)


def test_integer_window_types_are_accepted():
    # Any integer type but bool, numpy's too (a float such as 3.7 is refused: it used to become 3 silently).
    case = error_case()
    expected = reference.paged_attention(*case, sliding_window=3)
    for window in (3, np.int64(3)):
        torch.testing.assert_close(paged_attn.paged_attention(*case, sliding_window=window), expected)


@requires_cuda
@pytest.mark.parametrize("head_dim,block_size,message", [(48, 16, "head_dim 48 is not supported"),
                                                          (64, 5, "block_size 5 is not supported")])
def test_cuda_unsupported_sizes(head_dim, block_size, message):
    case = make_case([5], 4, 2, head_dim, block_size, torch.float16, "cuda")
    with pytest.raises(RuntimeError, match=message):
        paged_attn.paged_attention(*case)


def test_cpu_avx2_path_when_avx512_is_switched_off():
    # On a CPU with AVX512_BF16, bfloat16 takes an AVX-512 path picked at run time; PAGED_ATTN_NO_AVX512=1 forces
    # the AVX2 path (what CPUs without AVX-512 run), so both are tested here. The choice is made once per process.
    script = (
        "import torch, paged_attn\n"
        "from paged_attn import reference\n"
        "from test_attention import make_case, check_bfloat16_is_as_exact_as_float32_math\n"
        "torch.manual_seed(0)\n"
        "for heads, kv_heads, head_dim, block_size in [(32, 8, 128, 16), (9, 3, 64, 5), (16, 1, 256, 8)]:\n"
        "    case = make_case([1, 17, 300, 1100], heads, kv_heads, head_dim, block_size, torch.bfloat16, 'cpu')\n"
        "    torch.testing.assert_close(paged_attn.paged_attention(*case), reference.paged_attention(*case),\n"
        "                               rtol=2e-2, atol=2e-2)\n"
        "for head_dim in (64, 128):\n"
        "    check_bfloat16_is_as_exact_as_float32_math(head_dim)\n"
    )
    run_on_portable_path(script)
