"""paged_attention with query_start_loc: prefills, prefill chunks after a cached prefix, decodes and empty
sequences in one call, against paged_attn.reference (float64) and, for the reference itself, against decode
attention computed row by row.

Tolerances as in test_attention.py: float32 within 1e-5, float16/bfloat16 within 2e-2. Cache slots no sequence
owns, and whole unused blocks, are NaN; block-table entries past a sequence's end hold garbage.
"""

import math

import pytest
import torch
from conftest import DEVICES, run_on_portable_path
from test_attention import GARBAGE, NAN, dense_attention_float64, tolerance
from torch._subclasses.fake_tensor import FakeTensorMode

import paged_attn
from paged_attn import reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (seq_len, query_len) per sequence: a whole prompt, a decode, an empty sequence, a chunk after a cached prefix,
# a prompt of exactly two blocks, a sequence with no query rows, a long chunk over several tiles and partitions.
MIXED = [(37, 37), (50, 1), (0, 0), (70, 13), (32, 32), (5, 0), (300, 120), (33, 1)]
LAYOUTS = ["contiguous", "halves", "packed"]


def make_varlen_case(specs, num_heads, num_kv_heads, head_dim, block_size, dtype, device, layout="contiguous"):
    """Caches holding each sequence's seq_len tokens in scattered blocks (the rest NaN), and query rows for the last
    query_len tokens of each. Returns the op's arguments: query, key_cache, value_cache, block_tables, seq_lens,
    query_start_loc.

    layout "halves": K and V are the [:, 0] and [:, 1] halves of one [num_blocks, 2, ...] allocation; "packed": they
    are the [..., :head_dim] and [..., head_dim:] halves of vLLM's [num_blocks, block_size, num_kv_heads,
    2 * head_dim] cache (head stride 2 * head_dim). Both make the query a slice of a fused QKV tensor."""
    seq_lens = [n for n, _ in specs]
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    max_blocks = max(blocks_per_seq + [1]) + 2
    num_blocks = sum(blocks_per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    num_tokens = sum(q for _, q in specs)
    if layout == "contiguous":
        key_cache = torch.full(shape, NAN, dtype=dtype, device=device)
        value_cache = torch.full(shape, NAN, dtype=dtype, device=device)
        query = torch.randn(num_tokens, num_heads, head_dim, dtype=dtype, device=device)
    else:
        if layout == "halves":
            alloc = torch.full((num_blocks, 2) + shape[1:], NAN, dtype=dtype, device=device)
            key_cache, value_cache = alloc[:, 0], alloc[:, 1]
        else:
            alloc = torch.full(shape[:3] + (2 * head_dim,), NAN, dtype=dtype, device=device)
            key_cache, value_cache = alloc[..., :head_dim], alloc[..., head_dim:]
        qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype, device=device)
        query = qkv[:, :num_heads]
    free = torch.randperm(num_blocks).tolist()
    tables = [[free.pop() for _ in range(n)] for n in blocks_per_seq]
    for table, n in zip(tables, seq_lens):
        for i, block in enumerate(table):
            filled = min(block_size, n - i * block_size)
            key_cache[block, :filled] = torch.randn(filled, num_kv_heads, head_dim, dtype=dtype)
            value_cache[block, :filled] = torch.randn(filled, num_kv_heads, head_dim, dtype=dtype)
    block_tables = torch.tensor([table + [GARBAGE[i % 2]] * (max_blocks - len(table))
                                 for i, table in enumerate(tables)], dtype=torch.int32).reshape(len(specs), max_blocks)
    starts = torch.tensor([0] + [q for _, q in specs], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return (query, key_cache, value_cache, block_tables.to(device), torch.tensor(seq_lens, dtype=torch.int32,
            device=device), starts.to(device))


def attend(case, **kwargs):
    query, key_cache, value_cache, block_tables, seq_lens, starts = case
    return paged_attn.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc=starts,
                                      **kwargs)


def expected(case, **kwargs):
    query, key_cache, value_cache, block_tables, seq_lens, starts = case
    out = reference.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc=starts,
                                    compute_dtype=torch.float64, **kwargs)
    return out.to(query.dtype)


def check(case, **kwargs):
    actual = attend(case, **kwargs)
    dtype = case[0].dtype
    assert actual.dtype == dtype and actual.shape == case[0].shape
    assert not actual.isnan().any(), "NaN in the output: an unused (poisoned) slot leaked in"
    torch.testing.assert_close(actual, expected(case, **kwargs), **tolerance(dtype))
    return actual


def alibi(num_heads, device):
    return torch.rand(num_heads, device=device) * 0.5


# ----------------------------------------------------------------------------------------------------------------
# The reference itself: row by row, a query at position p is decode attention over the first p + 1 tokens.


@pytest.mark.parametrize("features", [{}, {"alibi": True, "sliding_window": 9, "logits_soft_cap": 4.0}])
def test_reference_equals_decode_attention_row_by_row(features):
    specs = [(21, 21), (30, 7), (9, 1), (4, 0)]
    case = make_varlen_case(specs, 4, 2, 32, 8, torch.float32, "cpu")
    query, key_cache, value_cache, block_tables, _, starts = case
    kwargs = {k: v for k, v in features.items() if k != "alibi"}
    slopes = alibi(4, "cpu") if features.get("alibi") else None
    # one decode "sequence" per query row: the row's sequence's block table, length position + 1
    row_tables, row_lens = [], []
    for seq, (seq_len, query_len) in enumerate(specs):
        for i in range(query_len):
            row_tables.append(block_tables[seq])
            row_lens.append(seq_len - query_len + i + 1)
    dense = dense_attention_float64(query, key_cache, value_cache, torch.stack(row_tables), torch.tensor(row_lens),
                                    alibi_slopes=slopes, **kwargs)
    ours = reference.paged_attention(query, key_cache, value_cache, block_tables, case[4], query_start_loc=starts,
                                     alibi_slopes=slopes, compute_dtype=torch.float64, **kwargs)
    torch.testing.assert_close(ours.double(), dense, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# The op


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_mixed_batch(device, dtype, heads, head_dim):
    check(make_varlen_case(MIXED, *heads, head_dim, 16, dtype, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads,head_dim", [((4, 2), 72), ((64, 1), 32), ((3, 3), 40)],
                         ids=["head_dim 72", "64 heads per kv head", "head_dim 40"])
def test_odd_shapes(device, heads, head_dim):
    """Head dims that are not a multiple of 16 (the CPU's portable micro-kernels) and a group larger than a query
    tile's rows (a tile is then one position's whole group)."""
    check(make_varlen_case(MIXED, *heads, head_dim, 16, torch.float32, device, "packed"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_block_sizes_and_cache_layouts(device, block_size, layout):
    check(make_varlen_case(MIXED, 8, 2, 64, block_size, torch.bfloat16, device, layout))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "features",
    [{"alibi": True}, {"sliding_window": 7}, {"sliding_window": 64}, {"logits_soft_cap": 5.0}, {"scale": 0.3},
     {"alibi": True, "sliding_window": 20, "logits_soft_cap": 30.0, "scale": 0.2}],
    ids=["alibi", "window7", "window64", "softcap", "scale", "all"])
def test_features(device, dtype, features):
    case = make_varlen_case(MIXED, 8, 2, 64, 16, dtype, device, "packed")
    kwargs = dict(features)
    if kwargs.pop("alibi", False):
        kwargs["alibi_slopes"] = alibi(8, device)
    check(case, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_token_per_sequence_is_exactly_decode(device, dtype):
    """query_start_loc = arange: the same output, bit for bit, as the decode call without it."""
    case = make_varlen_case([(n, 1) for n in (1, 17, 64, 200, 3)], 8, 2, 128, 16, dtype, device, "halves")
    query, key_cache, value_cache, block_tables, seq_lens, _ = case
    decode = paged_attn.paged_attention(query, key_cache, value_cache, block_tables, seq_lens)
    assert torch.equal(attend(case), decode)


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_in_chunks_equals_prefill_at_once(device):
    """A 150-token prompt attended at once, or as chunks of 40 after its cached prefix, gives the same rows."""
    whole = make_varlen_case([(150, 150)], 8, 2, 64, 16, torch.float32, device)
    query, key_cache, value_cache, block_tables, seq_lens, _ = whole
    at_once = attend(whole)
    for start in range(0, 150, 40):
        end = min(150, start + 40)
        chunk = (query[start:end], key_cache, value_cache, block_tables, torch.tensor([end], dtype=torch.int32,
                 device=device), torch.tensor([0, end - start], dtype=torch.int32, device=device))
        torch.testing.assert_close(attend(chunk), at_once[start:end], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_random_mixes(device):
    generator = torch.Generator().manual_seed(1)
    for _ in range(12):
        num_seqs = int(torch.randint(1, 7, (), generator=generator))
        specs = []
        for _ in range(num_seqs):
            seq_len = int(torch.randint(0, 260, (), generator=generator))
            query_len = int(torch.randint(0, seq_len + 1, (), generator=generator)) if seq_len else 0
            specs.append((seq_len, query_len))
        block_size = [8, 16, 32][int(torch.randint(0, 3, (), generator=generator))]
        layout = LAYOUTS[int(torch.randint(0, 3, (), generator=generator))]
        check(make_varlen_case(specs, 8, 4, 64, block_size, torch.bfloat16, device, layout),
              sliding_window=int(torch.randint(1, 100, (), generator=generator)))


@pytest.mark.parametrize("device", DEVICES)
def test_max_query_len_and_out(device):
    case = make_varlen_case(MIXED, 4, 2, 64, 16, torch.float32, device)
    out = torch.full_like(case[0], NAN).contiguous()
    result = attend(case, max_query_len=120, out=out)
    assert result is out
    torch.testing.assert_close(out, expected(case), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(attend(case, max_query_len=500), out, rtol=0, atol=0)  # a loose bound is fine


def test_compiles_fullgraph():
    case = make_varlen_case(MIXED, 4, 2, 64, 16, torch.float32, "cpu")

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(query, key_cache, value_cache, block_tables, seq_lens, starts):
        return paged_attn.paged_attention(query * 2, key_cache, value_cache, block_tables, seq_lens,
                                          query_start_loc=starts, max_query_len=120) + 1

    query, *rest = case
    torch.testing.assert_close(f(*case), attend((query * 2, *rest), max_query_len=120) + 1)


# ----------------------------------------------------------------------------------------------------------------
# A NaN or inf in one key or value row reaches exactly the rows that can see that token: a masked key's
# probability is 0, but 0 * NaN = NaN, so it must not be multiplied in at all.

POISON_SEQ_LEN, POISON_QUERY_LEN, POISON_BLOCK = 70, 40, 16  # rows at positions 30 ... 69; the last block 6/16 full
# Tokens to poison: after rows (causal) and, with a window of 8, before rows' windows (token 20 is before every
# row's window: the first row, at 30, sees 23 ... 30). None: the last block's unused slots.
POISON_TOKENS = {None: [31, 47, 64, 69, None], 8: [20, 40, 60, 69, None]}
FP8_BYTES = {  # the bit patterns of NaN and +-inf where the format has them
    torch.float8_e4m3fn: {"nan": 0x7F},
    torch.float8_e5m2: {"nan": 0x7F, "inf": 0x7C, "-inf": 0xFC},
}
POISONS = {"nan": NAN, "inf": math.inf, "-inf": -math.inf}


def sees(position, token, window):
    """Whether the query row at `position` sees `token` (its causal range, shortened by the window)."""
    first = 0 if window is None else max(0, position - window + 1)
    return first <= token <= position


def poisoned_case(cache_dtype, head_dim, where, poison, token, query_len):
    """One sequence (POISON_SEQ_LEN tokens, the last query_len of them query rows, 4 query heads over 2 kv heads) whose key or value (`where`) at `token`, kv head 0, holds `poison` in one element; token None: every
    unused slot of the last block, all heads, holds it. fp8 caches are quantized from float32 ones with scales."""
    is_fp8 = cache_dtype in FP8_BYTES
    case = make_varlen_case([(POISON_SEQ_LEN, query_len)], 4, 2, head_dim, POISON_BLOCK,
                            torch.float32 if is_fp8 else cache_dtype, "cpu")
    query, key_cache, value_cache, block_tables, seq_lens, starts = case
    scales = {}
    if is_fp8:
        query = query.bfloat16()
        scales = dict(k_scale=torch.tensor([0.5]), v_scale=torch.tensor([2.0]))
        key_cache = reference.quantize_fp8(key_cache, cache_dtype, scales["k_scale"])
        value_cache = reference.quantize_fp8(value_cache, cache_dtype, scales["v_scale"])
    cache = key_cache if where == "key" else value_cache
    target = cache.view(torch.uint8) if is_fp8 else cache
    value = FP8_BYTES[cache_dtype][poison] if is_fp8 else POISONS[poison]
    if token is None:
        last = int(block_tables[0, (POISON_SEQ_LEN - 1) // POISON_BLOCK])
        target[last, POISON_SEQ_LEN % POISON_BLOCK:] = value
    else:
        target[int(block_tables[0, token // POISON_BLOCK]), token % POISON_BLOCK, 0, 3] = value
    return (query, key_cache, value_cache, block_tables, seq_lens, starts), scales


def check_poison_reaches_only_rows_that_see_it(cache_dtype, head_dim, where, poison, window,
                                               query_len=POISON_QUERY_LEN, tokens=POISON_TOKENS):
    kwargs = {} if window is None else {"sliding_window": window}
    for token in tokens[window]:
        case, scales = poisoned_case(cache_dtype, head_dim, where, poison, token, query_len)
        actual = attend(case, **kwargs, **scales)
        query, key_cache, value_cache, block_tables, seq_lens, starts = case
        if scales:  # the reference reads the dequantized caches
            key_cache = reference.dequantize_fp8(key_cache, scales["k_scale"], torch.float64)
            value_cache = reference.dequantize_fp8(value_cache, scales["v_scale"], torch.float64)
        want = reference.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc=starts,
                                         compute_dtype=torch.float64, **kwargs).to(query.dtype)
        positions = range(POISON_SEQ_LEN - query_len, POISON_SEQ_LEN)
        blind = [i for i, p in enumerate(positions) if token is None or not sees(p, token, window)]
        seeing = [i for i in range(query_len) if i not in blind]
        where_ = f"{where} of token {token} = {poison}"
        assert actual[blind].isfinite().all(), (
            f"{where_}: rows {[i for i in blind if not actual[i].isfinite().all()]} cannot see it and are not finite")
        if poison == "nan" and seeing:  # kv head 0 serves query heads 0 and 1
            assert actual[seeing, :2].isnan().any(-1).all(), f"{where_}: a row that sees it lost the NaN"
        torch.testing.assert_close(actual, want, equal_nan=True, **tolerance(query.dtype), msg=lambda m: f"{where_}: {m}")


POISON_GRID = [(dtype, poison) for dtype in DTYPES for poison in POISONS] + [
    (dtype, poison) for dtype, patterns in FP8_BYTES.items() for poison in patterns]


@pytest.mark.parametrize("cache_dtype,poison", POISON_GRID, ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.parametrize("where", ["key", "value"])
@pytest.mark.parametrize("window", [None, 8], ids=["causal", "window8"])
@pytest.mark.parametrize("head_dim", [64, 40], ids=["head_dim 64", "head_dim 40"])
def test_nan_and_inf_reach_only_the_rows_that_see_them(cache_dtype, poison, where, window, head_dim):
    """Planted just after rows (causal), just before rows' windows, and in a partial block's unused slots; head_dim
    64 takes the AVX-512 micro-kernels where the CPU has AVX-512F, 40 the portable ones."""
    check_poison_reaches_only_rows_that_see_it(cache_dtype, head_dim, where, poison, window)


def test_nan_and_inf_reach_only_the_rows_that_see_them_on_the_portable_path():
    """The same grid with PAGED_ATTN_NO_AVX512=1 (what CPUs without AVX-512 run; chosen once per process)."""
    script = (
        "import test_varlen_attention as t\n"
        "for cache_dtype, poison in t.POISON_GRID:\n"
        "    for where in ('key', 'value'):\n"
        "        for window in (None, 8):\n"
        "            t.check_poison_reaches_only_rows_that_see_it(cache_dtype, 64, where, poison, window)\n"
    )
    run_on_portable_path(script)


@pytest.mark.parametrize("cache_dtype,poison", [
    (torch.bfloat16, "nan"), (torch.float32, "inf"),
    (torch.float8_e5m2, "-inf")], ids=["bfloat16-nan", "float32-inf", "e5m2--inf"])
@pytest.mark.parametrize("query_len", [2, 3, 4])
@pytest.mark.parametrize("window", [None, 8], ids=["causal", "window8"])
def test_nan_and_inf_in_short_chunks(cache_dtype, poison, query_len, window):
    """Chunks of a few rows (below 4 the CPU runs them through its decode kernel, row by row): token 69 is seen by
    the last row only; with a window of 8, 61 by the rows at 61 ... 68, 50 by none."""
    for where in ("key", "value"):
        check_poison_reaches_only_rows_that_see_it(cache_dtype, 64, where, poison, window, query_len,
                                                   {None: [67, 69, None], 8: [50, 61, 69, None]})


def test_a_nan_value_reaches_only_the_rows_after_it():
    """The issue's case: four query rows at positions 6 ... 9; only the last sees token 9, whose value is NaN."""
    torch.manual_seed(0)
    key_cache, value_cache, query = torch.randn(1, 16, 1, 64), torch.randn(1, 16, 1, 64), torch.randn(4, 1, 64)
    value_cache[0, 9] = NAN
    out = paged_attn.paged_attention(query, key_cache, value_cache, torch.tensor([[0]], dtype=torch.int32),
                                     torch.tensor([10], dtype=torch.int32),
                                     query_start_loc=torch.tensor([0, 4], dtype=torch.int32))
    assert out[:3].isfinite().all() and out[3].isnan().all()


# ----------------------------------------------------------------------------------------------------------------
# Malformed query_start_loc (and friends): a clear error, nothing written.


def _bad(case, **changes):
    query, key_cache, value_cache, block_tables, seq_lens, starts = case
    args = dict(query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                seq_lens=seq_lens, query_start_loc=starts)
    args.update({k: v(args[k]) if callable(v) else v for k, v in changes.items()})
    return args


def _loc(values, dtype=torch.int32):
    return lambda starts: torch.tensor(values, dtype=dtype, device=starts.device)


# MIXED has 8 sequences and 174 query rows; starts = [0, 37, 38, 38, 51, 83, 83, 203, 204]
ERRORS = {
    "dtype": (dict(query_start_loc=lambda s: s.long()), "query_start_loc must be Int"),
    "rank": (dict(query_start_loc=lambda s: s[None]), "query_start_loc must have 1 dimension"),
    "empty": (dict(query_start_loc=lambda s: s[:0]), "query_start_loc must have num_seqs \\+ 1 entries"),
    "length": (dict(query_start_loc=lambda s: s[:-1]), "block_tables must have num_seqs = 7 \\(query_start_loc"),
    "first": (dict(query_start_loc=_loc([1, 37, 38, 38, 51, 83, 83, 203, 204])), "query_start_loc\\[0\\] must be 0"),
    "decreasing": (dict(query_start_loc=_loc([0, 37, 36, 38, 51, 83, 83, 203, 204])),
                   "query_start_loc must be non-decreasing"),
    "last": (dict(query_start_loc=_loc([0, 37, 38, 38, 51, 83, 83, 203, 203])),
             "query_start_loc\\[-1\\] must be num_tokens = 204"),
    "too many rows": (dict(query_start_loc=_loc([0, 38, 38, 38, 51, 83, 83, 203, 204])),
                      "sequence 0 has 38 query tokens .* seq_lens\\[0\\] = 37"),
    "rows of an empty sequence": (dict(query_start_loc=_loc([0, 36, 38, 39, 51, 83, 83, 203, 204])),
                                  "sequence 2 has 1 query tokens .* seq_lens\\[2\\] = 0"),
    "max_query_len": (dict(max_query_len=119), "sequence 6 has 120 query tokens, more than max_query_len = 119"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ERRORS)
def test_malformed_query_start_loc(device, name, validation):
    case = make_varlen_case(MIXED, 4, 2, 64, 16, torch.float32, device)
    changes, message = ERRORS[name]
    args = _bad(case, **changes)
    out = torch.full_like(case[0], 7.0).contiguous()
    with pytest.raises(RuntimeError, match=message):
        torch.ops.paged_attn.paged_attention(out, args["query"], args["key_cache"], args["value_cache"],
                                             args["block_tables"], args["seq_lens"], 0.125, None, 0, 0.0,
                                             args["query_start_loc"], changes.get("max_query_len"))
    assert (out == 7.0).all(), "the op wrote its output before refusing the call"


def test_wrapper_refuses_bad_max_query_len():
    case = make_varlen_case([(4, 4)], 4, 2, 64, 16, torch.float32, "cpu")
    query, key_cache, value_cache, block_tables, seq_lens, starts = case
    with pytest.raises(ValueError, match="max_query_len is given without query_start_loc"):
        paged_attn.paged_attention(query, key_cache, value_cache, block_tables[:0], seq_lens[:0], max_query_len=4)
    for bad in (-1, 2.5, True, 2**63, 2**64):  # 2**64 got past the wrapper, to torch's "Unable to cast" of int64
        with pytest.raises(ValueError, match=r"max_query_len must be a non-negative integer \(at most 2\*\*63 - 1: "
                                             r"the op takes an int64\) or None, got "):
            attend(case, max_query_len=bad)
    torch.testing.assert_close(attend(case, max_query_len=2**63 - 1), attend(case), rtol=0, atol=0)
    # The op itself (torch.ops, no wrapper) takes any int64, and says what is wrong with a negative one, as its fake
    # does; torch's schema refuses an int past int64 before either runs.
    out = torch.empty_like(query)
    args = (out, query, key_cache, value_cache, block_tables, seq_lens, 0.125, None, 0, 0.0, starts)
    with pytest.raises(RuntimeError, match="max_query_len must be >= 0, got -1"):
        torch.ops.paged_attn.paged_attention(*args, -1)
    with FakeTensorMode() as mode, pytest.raises(RuntimeError, match="max_query_len must be >= 0, got -1"):
        torch.ops.paged_attn.paged_attention(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                               for a in args), -1)


def test_fake_kernel_checks_query_start_loc():
    """Under torch.compile a query_start_loc of the wrong dtype or length fails at trace time."""
    case = make_varlen_case(MIXED, 4, 2, 64, 16, torch.float32, "cpu")

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(query, key_cache, value_cache, block_tables, seq_lens, starts):
        return paged_attn.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                          query_start_loc=starts)

    query, key_cache, value_cache, block_tables, seq_lens, starts = case
    with pytest.raises(Exception, match="query_start_loc must be Int"):
        f(query, key_cache, value_cache, block_tables, seq_lens, starts.long())
    with pytest.raises(Exception, match="block_tables must have num_seqs = "):
        f(query, key_cache, value_cache, block_tables, seq_lens, starts[:-1])


# ----------------------------------------------------------------------------------------------------------------
# Window-aware memory: a windowed layer's blocks that no query row can see are released, their entries -1.


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("decode", [False, True], ids=["varlen", "decode"])
def test_released_blocks_before_every_rows_window_are_never_read(device, block_size, decode):
    """The engine's windowed KV-cache groups release the blocks before the window of a sequence's first query row
    and set their table entries to -1 (PAD_BLOCK_ID). Over such tables the op gives the reference's output over
    the intact ones, reading neither the entries nor the blocks: the caches are views one block into a NaN
    allocation (block -1 is NaN), the released blocks are NaN too, and several sequences hold -1 at the same
    positions (which must not pass for a block they share)."""
    window = 40
    specs = [(300, 1), (301, 1), (45, 1), (200, 1)] if decode else \
        [(300, 1), (301, 37), (90, 90), (45, 1), (200, 130), (0, 0)]
    query, key_cache, value_cache, block_tables, seq_lens, starts = make_varlen_case(specs, 8, 2, 64, block_size,
                                                                                     torch.bfloat16, device)
    options = dict(sliding_window=window) if decode else \
        dict(sliding_window=window, query_start_loc=starts)
    want = reference.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                     compute_dtype=torch.float64, **options).to(query.dtype)
    caches = []
    for cache in (key_cache, value_cache):
        padded = torch.full((cache.shape[0] + 1,) + cache.shape[1:], NAN, dtype=cache.dtype, device=device)
        padded[1:] = cache
        caches.append(padded[1:])  # block -1 is padded[0]: NaN
    released = block_tables.clone()
    num_released = 0
    for s, (seq_len, query_len) in enumerate(specs):
        first_visible = max(0, seq_len - query_len - window + 1) // block_size
        for block in range(first_visible):
            for cache in caches:
                cache[released[s, block]] = NAN
            released[s, block] = -1
            num_released += 1
    assert num_released > 20
    out = paged_attn.paged_attention(query, *caches, released, seq_lens, **options)
    assert not out.isnan().any(), "a released block or entry was read"
    torch.testing.assert_close(out, want, **tolerance(torch.bfloat16))
