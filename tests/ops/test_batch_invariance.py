"""Batch invariance of the CPU decode (issue 24, section 2): a query row's output bits depend only on its own query,
keys, values and length.

csrc/cpu/attention.cpp cuts every decode row's keys into partitions at fixed token positions (multiples of 512),
attends each from a fresh online-softmax state and merges them left to right, whatever the batch and the thread
count.
So a sequence's output must be bit-identical (torch.equal):
  (a) alone and in a batch with sequences of other lengths (long and short ones, which once changed how its row was
      split into partitions),
  (b) with its batch reordered,
  (c) with 1 and 2 threads (a few long rows are cut between the threads, and merged afterwards),
  (d) with its blocks at other physical block ids holding the same bytes, or in a strided cache,
  (e) as a decode row of a variable-length call (query_start_loc) beside a prefill, and as a decode call (and a
      prefill's rows alone and beside other sequences);
for float32, bfloat16 (the AVX-512 bf16 path where the CPU has it, and the portable path with AVX-512 switched off),
fp8 caches with scales, GQA and MHA, with ALiBi, a sliding window and a soft cap, block sizes 1 to 64. Every
unused cache slot holds NaN (fp8: the NaN byte) and unused block-table entries hold garbage. Each batch's outputs
are also checked against paged_attn.reference.paged_attention in float64, within test_attention.tolerance.
"""

import pytest
import torch
from conftest import CUDA_SKIP_REASON, HAS_AMX, HAS_CUDA_OPS, run_on_portable_path
from test_attention import tolerance

import paged_attn
from paged_attn import reference

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
NAN_BYTE = 0x7F  # a NaN in both fp8 formats
# id: (query dtype, cache dtype). bf16q ids take the AVX-512 bf16 path where the CPU has it.
CACHES = {
    "float32": (torch.float32, torch.float32),
    "bfloat16": (torch.bfloat16, torch.bfloat16),
    "float16": (torch.float16, torch.float16),
    "bf16q-e4m3": (torch.bfloat16, E4M3),
    "float32q-e5m2": (torch.float32, E5M2),
}
HEADS = {"gqa": (16, 4), "mha": (8, 8)}  # (num_heads, num_kv_heads)
HEAD_DIM = 128
FEATURES = {
    "plain": {},
    "alibi": {"alibi": True},
    "window": {"sliding_window": 700},  # starts inside a partition, and inside a tile, for most lengths
    "soft_cap": {"logits_soft_cap": 20.0},
    "all": {"alibi": True, "sliding_window": 1000, "logits_soft_cap": 30.0, "scale": 0.05},
}
TARGET = 1500
OTHERS = [4000, 37, 9000]


def make_seqs(lengths, num_heads, num_kv_heads, head_dim, query_dtype, cache_dtype, seed):
    """Per sequence: (query [num_heads, head_dim], keys and values [length, num_kv_heads, head_dim]) in the query and
    cache dtypes (fp8: quantized from normal samples, as the cache would hold them)."""
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for length in lengths:
        query = torch.randn(num_heads, head_dim, generator=gen).to(query_dtype)
        keys = torch.randn(length, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
        values = torch.randn(length, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
        seqs.append((query, keys, values))
    return seqs


def poisoned(shape, dtype):
    if dtype in (E4M3, E5M2):
        return torch.full(shape, NAN_BYTE, dtype=torch.uint8).view(dtype)
    return torch.full(shape, float("nan"), dtype=dtype)


def lay_out(seqs, block_size, seed, *, spare_blocks=5, strided=False):
    """The sequences in a NaN-poisoned paged cache, in blocks shuffled by `seed`: (query, key_cache, value_cache,
    block_tables, seq_lens). strided: the caches are the halves of one [num_blocks, 2, ...] allocation."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [keys.shape[0] for _, keys, _ in seqs]
    num_kv_heads, head_dim = seqs[0][1].shape[1:]
    cache_dtype = seqs[0][1].dtype
    blocks_per_seq = [-(-n // block_size) for n in lengths]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if strided:
        alloc = poisoned((num_blocks, 2) + shape[1:], cache_dtype)
        key_cache, value_cache = alloc[:, 0], alloc[:, 1]
    else:
        key_cache, value_cache = poisoned(shape, cache_dtype), poisoned(shape, cache_dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_seq + [1]) + 3
    block_tables = torch.full((len(seqs), width), -1, dtype=torch.int32)
    block_tables[1::2] = 10**6  # garbage past each sequence's blocks
    for s, (_, keys, values) in enumerate(seqs):
        table = torch.tensor([free.pop() for _ in range(blocks_per_seq[s])], dtype=torch.int64)
        block_tables[s, : len(table)] = table.to(torch.int32)
        tokens = torch.arange(keys.shape[0])
        # fp8 tensors support no index_put: write their bytes.
        key_cache.view(torch.uint8 if cache_dtype in (E4M3, E5M2) else cache_dtype)[
            table[tokens // block_size], tokens % block_size
        ] = keys.view(torch.uint8) if cache_dtype in (E4M3, E5M2) else keys
        value_cache.view(torch.uint8 if cache_dtype in (E4M3, E5M2) else cache_dtype)[
            table[tokens // block_size], tokens % block_size
        ] = values.view(torch.uint8) if cache_dtype in (E4M3, E5M2) else values
    query = torch.stack([q for q, _, _ in seqs])
    return query, key_cache, value_cache, block_tables, torch.tensor(lengths, dtype=torch.int32)


def op_kwargs(features, num_heads, cache_dtype):
    kwargs = {k: v for k, v in features.items() if k != "alibi"}
    if features.get("alibi"):
        # Gentle slopes: in float32, slope * (t - p) itself is rounded to about |slope * (t - p)| 2^-24, which at
        # 9,000 tokens' distance and a slope of 0.3 is already 1e-4 (in the reference's float64 not).
        kwargs["alibi_slopes"] = -torch.linspace(1e-4, 2e-3, num_heads)
    if cache_dtype in (E4M3, E5M2):
        kwargs.update(k_scale=torch.tensor([0.75]), v_scale=torch.tensor([1.25]))
    return kwargs


def decode(seqs, block_size, seed, kwargs, *, threads=None, strided=False, check_reference=True, device="cpu"):
    """The decode outputs of the sequences laid out with `seed`, with `threads` threads (None: as set)."""
    case = tuple(t.to(device) for t in lay_out(seqs, block_size, seed, strided=strided))
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        out = paged_attn.paged_attention(*case, **kwargs)
    finally:
        torch.set_num_threads(old_threads)
    assert not out.isnan().any(), "NaN in the output: an unused (poisoned) slot leaked in"
    if check_reference:
        expected = reference.paged_attention(*case, compute_dtype=torch.float64, **kwargs)
        torch.testing.assert_close(out, expected.to(out.dtype), **tolerance(out.dtype))
    return out


def assert_same_bits(actual, expected, what):
    assert torch.equal(actual, expected), (
        f"{what}: the bits differ (max abs difference {(actual.double() - expected.double()).abs().max().item():.3g})"
    )


def check_alone_and_in_batches(cache, heads, features, block_size=16, device="cpu"):
    query_dtype, cache_dtype = CACHES[cache]
    num_heads, num_kv_heads = HEADS[heads]
    kwargs = op_kwargs(FEATURES[features], num_heads, cache_dtype)
    target, *others = make_seqs([TARGET] + OTHERS, num_heads, num_kv_heads, HEAD_DIM, query_dtype, cache_dtype, 0)
    alone = decode([target], block_size, 1, kwargs, check_reference=False, device=device)[0]
    # (a) in a batch of 4; (b) reordered, and in a batch of 3; (d) at other physical blocks (other seeds).
    batches = {
        "in a batch of 4": ([others[0], target, others[1], others[2]], 1),
        "in the batch reordered": ([others[2], others[1], others[0], target], 2),
        "in a batch of 3": ([others[2], target, others[1]], 3),
        "at other physical blocks": ([target], 4),
        "beside two copies of itself": ([target, target, target], 5),
    }
    for what, (seqs, seed) in batches.items():
        # The reference once, on the batch that holds every sequence (the others must give the same bits).
        out = decode(seqs, block_size, seed, kwargs, check_reference=what == "in a batch of 4", device=device)
        for i, seq in enumerate(seqs):
            if seq is target:
                assert_same_bits(out[i], alone, f"sequence of {TARGET} tokens alone vs {what} (row {i})")


@pytest.mark.parametrize("features", sorted(FEATURES))
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("cache", sorted(CACHES))
def test_same_bits_alone_and_in_any_batch(cache, heads, features):
    check_alone_and_in_batches(cache, heads, features)


@pytest.mark.skipif(not HAS_CUDA_OPS, reason=CUDA_SKIP_REASON)
@pytest.mark.parametrize("features", ["plain", "all"])
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("cache", sorted(CACHES))
def test_cuda_same_bits_alone_and_in_any_batch_when_batch_invariant(cache, heads, features):
    """On CUDA with paged_attn.set_batch_invariant(True): (a), (b) and (d), on tensor cores (float16, bfloat16) and
    CUDA cores (float32, fp8); the tables' widths and the plans' slots differ between the batches (the emulated
    suite also varies the SM count)."""
    paged_attn.set_batch_invariant(True)
    try:
        check_alone_and_in_batches(cache, heads, features, device="cuda")
    finally:
        paged_attn.set_batch_invariant(False)


@pytest.mark.parametrize("block_size", [1, 5, 16, 32, 64])
def test_same_bits_for_every_block_size(block_size):
    check_alone_and_in_batches("bfloat16", "gqa", "all", block_size)


def check_thread_counts(cache, heads, features):
    """(c): 3 beams of about 2,000 tokens, and one long row, with 1 and 2 threads (the long row is cut between the
    2 threads), and each sequence alone with 1 thread."""
    query_dtype, cache_dtype = CACHES[cache]
    num_heads, num_kv_heads = HEADS[heads]
    kwargs = op_kwargs(FEATURES[features], num_heads, cache_dtype)
    beams = make_seqs([2000, 2001, 1999], num_heads, num_kv_heads, HEAD_DIM, query_dtype, cache_dtype, 7)
    one = decode(beams, 16, 1, kwargs, threads=1)
    two = decode(beams, 16, 1, kwargs, threads=2, check_reference=False)
    assert_same_bits(two, one, "3 beams, 2 threads vs 1")
    for i, beam in enumerate(beams):
        assert_same_bits(decode([beam], 16, 2, kwargs, threads=2, check_reference=False)[0], one[i],
                         f"beam {i} alone with 2 threads vs in the batch with 1")
    (long_seq,) = make_seqs([16000 + 5], num_heads, num_kv_heads, HEAD_DIM, query_dtype, cache_dtype, 8)
    one = decode([long_seq], 16, 1, kwargs, threads=1)
    two = decode([long_seq], 16, 3, kwargs, threads=2, check_reference=False)
    assert_same_bits(two, one, "a 16,005-token row, 2 threads vs 1")
    short = make_seqs([300, 40], num_heads, num_kv_heads, HEAD_DIM, query_dtype, cache_dtype, 9)
    two = decode([short[0], long_seq, short[1]], 16, 4, kwargs, threads=2, check_reference=False)
    assert_same_bits(two[1], one[0], "a 16,005-token row between short ones, 2 threads vs alone with 1")


@pytest.mark.parametrize("features", ["plain", "all"])
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("cache", sorted(CACHES))
def test_same_bits_with_one_or_two_threads(cache, heads, features):
    check_thread_counts(cache, heads, features)


@pytest.mark.parametrize("features", ["plain", "all"])
def test_same_bits_in_a_strided_cache(features):
    """(d): the halves of one [num_blocks, 2, ...] allocation (vLLM's layout) give the contiguous caches' bits."""
    num_heads, num_kv_heads = HEADS["gqa"]
    kwargs = op_kwargs(FEATURES[features], num_heads, torch.bfloat16)
    seqs = make_seqs([TARGET] + OTHERS, num_heads, num_kv_heads, HEAD_DIM, torch.bfloat16, torch.bfloat16, 11)
    contiguous = decode(seqs, 16, 1, kwargs)
    assert_same_bits(decode(seqs[:1], 16, 2, kwargs, strided=True)[0], contiguous[0], "strided cache, alone")


@pytest.mark.parametrize("features", ["plain", "window", "all"])
@pytest.mark.parametrize("cache", ["float32", "bfloat16", "bf16q-e4m3"])
def test_varlen_decode_rows_have_the_decode_bits(cache, features):
    """(e): a sequence's last 2 query tokens in a variable-length call beside a 40-token prefill and a decode (these
    rows take the decode kernel, at their own positions) give the bits of decode calls of the sequence cut to each
    position, alone."""
    query_dtype, cache_dtype = CACHES[cache]
    num_heads, num_kv_heads = HEADS["gqa"]
    kwargs = op_kwargs(FEATURES[features], num_heads, cache_dtype)
    prefill, target, other = make_seqs([3000, TARGET, 5000], num_heads, num_kv_heads, HEAD_DIM, query_dtype,
                                       cache_dtype, 13)
    gen = torch.Generator().manual_seed(14)
    prefill_queries = torch.randn(40, num_heads, HEAD_DIM, generator=gen).to(query_dtype)
    target_queries = torch.randn(2, num_heads, HEAD_DIM, generator=gen).to(query_dtype)
    _, key_cache, value_cache, block_tables, seq_lens = lay_out([prefill, target, other], 16, 15)
    query = torch.cat([prefill_queries, target_queries, other[0][None]])
    query_start_loc = torch.tensor([0, 40, 42, 43], dtype=torch.int32)
    out = paged_attn.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                     query_start_loc=query_start_loc, **kwargs)
    expected = reference.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                         query_start_loc=query_start_loc, compute_dtype=torch.float64, **kwargs)
    torch.testing.assert_close(out, expected.to(out.dtype), **tolerance(out.dtype))
    old_threads = torch.get_num_threads()
    torch.set_num_threads(1 if old_threads > 1 else 2)
    try:
        other_threads = paged_attn.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                                   query_start_loc=query_start_loc, **kwargs)
    finally:
        torch.set_num_threads(old_threads)
    assert_same_bits(other_threads, out, "a variable-length call with 1 thread vs 2")
    _, keys, values = target
    for i, length in enumerate([TARGET - 1, TARGET]):
        alone = decode([(target_queries[i], keys[:length], values[:length])], 16, 16 + i, kwargs)[0]
        assert_same_bits(out[40 + i], alone, f"varlen row at position {length - 1} vs a decode of length {length}")
    assert_same_bits(out[42], decode([other], 16, 18, kwargs)[0], "varlen decode row vs a decode call")
    # The prefill's rows (the tiled prefill kernel) do not depend on the other sequences either.
    _, key_cache, value_cache, block_tables, seq_lens = lay_out([prefill], 16, 19)
    alone = paged_attn.paged_attention(prefill_queries, key_cache, value_cache, block_tables, seq_lens,
                                       query_start_loc=torch.tensor([0, 40], dtype=torch.int32), **kwargs)
    assert_same_bits(out[:40], alone, "a prefill's rows alone vs beside other sequences")


def test_portable_path_when_avx512_is_switched_off():
    """The bf16 ids again on the portable (AVX2) path."""
    run_on_portable_path(
        "import test_batch_invariance as t\n"
        "for heads in ('gqa', 'mha'):\n"
        "    t.check_alone_and_in_batches('bfloat16', heads, 'all')\n"
        "    t.check_alone_and_in_batches('bf16q-e4m3', heads, 'window')\n"
        "    t.check_thread_counts('bfloat16', heads, 'all')\n"
    )


@pytest.mark.skipif(not HAS_AMX, reason="no AMX-BF16 here: the opt-in AMX path cannot run")
def test_amx_path():
    """The bf16 ids again on the opt-in AMX path (PAGED_ATTN_AMX=1)."""
    run_on_portable_path(
        "import test_batch_invariance as t\n"
        "for heads in ('gqa', 'mha'):\n"
        "    t.check_alone_and_in_batches('bfloat16', heads, 'all')\n"
        "    t.check_alone_and_in_batches('bf16q-e4m3', heads, 'window')\n"
        "    t.check_thread_counts('bfloat16', heads, 'all')\n",
        switch="PAGED_ATTN_AMX",
    )
