"""paged_attention(..., return_lse=True) on the CPU (issue 24, section 1): each row's natural-log log-sum-exp of its
final logits, float32 [num_tokens, num_heads], -inf for a row that sees no key; with merge_attention_states, partial
results over disjoint key ranges (a cascade: a shared prefix, then each sequence's own blocks) merge into the full
one.

Against paged_attn.reference.paged_attention(return_lse=True) in float64 for decode and variable-length calls
(decode rows and tiled prefill rows), every feature (GQA, ALiBi, window, soft cap, fp8 caches with scales); the
output's bits do not change when the lse is asked for, and the lse's bits are batch-invariant too; bad lse
tensors are refused with the same message by the kernel and the fake.
"""

import math

import pytest
import torch
import torch.utils._pytree as pytree
from conftest import run_on_portable_path
from test_attention import tolerance
from test_batch_invariance import CACHES, FEATURES, HEADS, HEAD_DIM, assert_same_bits, lay_out, make_seqs, op_kwargs
from torch._subclasses.fake_tensor import FakeTensorMode

import paged_attn
from paged_attn import reference

def lse_tolerance(dtype):  # the logits are float32 for every dtype; half-type inputs round the query and keys
    return dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-4, atol=2e-3)


@pytest.mark.parametrize("features", sorted(FEATURES))
@pytest.mark.parametrize("cache", ["float32", "bfloat16", "float16", "bf16q-e4m3", "float32q-e5m2"])
def test_decode_lse_matches_the_reference(cache, features):
    query_dtype, cache_dtype = CACHES[cache]
    num_heads, num_kv_heads = HEADS["gqa"]
    kwargs = op_kwargs(FEATURES[features], num_heads, cache_dtype)
    seqs = make_seqs([1500, 37, 3000, 1], num_heads, num_kv_heads, HEAD_DIM, query_dtype, cache_dtype, 1)
    case = lay_out(seqs, 16, 2)
    out, lse = paged_attn.paged_attention(*case, return_lse=True, **kwargs)
    assert lse.dtype == torch.float32 and lse.shape == (4, num_heads)
    expected_out, expected_lse = reference.paged_attention(*case, compute_dtype=torch.float64, return_lse=True,
                                                           **kwargs)
    torch.testing.assert_close(out, expected_out.to(out.dtype), **tolerance(out.dtype))
    torch.testing.assert_close(lse.double(), expected_lse, **lse_tolerance(query_dtype))
    assert_same_bits(paged_attn.paged_attention(*case, **kwargs), out, "out with return_lse vs without")
    # The lse is batch-invariant as the output is: the 3,000-token sequence alone.
    _, alone_lse = paged_attn.paged_attention(*lay_out(seqs[2:3], 16, 3), return_lse=True, **kwargs)
    assert_same_bits(alone_lse[0], lse[2], "lse alone vs in the batch")


@pytest.mark.parametrize("features", ["plain", "alibi", "window", "all"])
@pytest.mark.parametrize("cache", ["float32", "bfloat16", "bf16q-e4m3"])
def test_varlen_lse_matches_the_reference(cache, features):
    """A 40-token prefill (tiled prefill kernel), a 3-token chunk (decode-kernel rows) and a decode."""
    query_dtype, cache_dtype = CACHES[cache]
    num_heads, num_kv_heads = HEADS["gqa"]
    kwargs = op_kwargs(FEATURES[features], num_heads, cache_dtype)
    seqs = make_seqs([1200, 900, 2000], num_heads, num_kv_heads, HEAD_DIM, query_dtype, cache_dtype, 4)
    _, key_cache, value_cache, block_tables, seq_lens = lay_out(seqs, 16, 5)
    query = torch.randn(40 + 3 + 1, num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(6)).to(query_dtype)
    qsl = torch.tensor([0, 40, 43, 44], dtype=torch.int32)
    case = (query, key_cache, value_cache, block_tables, seq_lens)
    out, lse = paged_attn.paged_attention(*case, query_start_loc=qsl, return_lse=True, **kwargs)
    expected_out, expected_lse = reference.paged_attention(*case, query_start_loc=qsl, compute_dtype=torch.float64,
                                                           return_lse=True, **kwargs)
    torch.testing.assert_close(out, expected_out.to(out.dtype), **tolerance(out.dtype))
    torch.testing.assert_close(lse.double(), expected_lse, **lse_tolerance(query_dtype))
    assert_same_bits(paged_attn.paged_attention(*case, query_start_loc=qsl, **kwargs), out,
                     "out with return_lse vs without")


def check_rows_of_logit_0():
    """Rows whose n visible keys all have logit 0 (scale 0, random queries and keys) have lse log(n): exactly 0 for
    one key, since exp(0) is 1 exactly on every path. Decode rows (sequences of 1 and 5 tokens) and the rows of a
    20-token prompt (the tiled prefill kernel), float32 / float16 / bfloat16 at head dims 64 (the AVX-512 bf16 path
    where the CPU has it) and 80 (the portable one)."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for head_dim in (64, 80):
            gen = torch.Generator().manual_seed(head_dim)
            key_cache = torch.randn(8, 16, 2, head_dim, generator=gen).to(dtype)
            value_cache = torch.randn(8, 16, 2, head_dim, generator=gen).to(dtype)
            block_tables = torch.randperm(8, generator=gen).to(torch.int32).view(4, 2)
            seq_lens = torch.tensor([1, 5, 20, 1], dtype=torch.int32)
            query = torch.randn(23, 4, head_dim, generator=gen).to(dtype)
            qsl = torch.tensor([0, 1, 2, 22, 23], dtype=torch.int32)
            _, lse = paged_attn.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale=0.0,
                                                query_start_loc=qsl, return_lse=True)
            seen = torch.tensor([1, 5] + list(range(1, 21)) + [1], dtype=torch.float32)
            for row in (0, 2, 22):  # one key each: a decode row, the prompt's first row, a decode row
                assert torch.equal(lse[row], torch.zeros(4)), (dtype, head_dim, row, lse[row])
            torch.testing.assert_close(lse, seen.log()[:, None].expand(23, 4), rtol=1e-6, atol=0)


def test_rows_of_logit_0_have_lse_log_n_exactly_0_for_one_key():
    check_rows_of_logit_0()


def test_rows_of_logit_0_on_the_portable_path():
    run_on_portable_path("import test_return_lse; test_return_lse.check_rows_of_logit_0()")


def test_a_row_that_sees_no_key_has_lse_minus_inf():
    num_heads, num_kv_heads = HEADS["mha"]
    seqs = make_seqs([0, 20], num_heads, num_kv_heads, HEAD_DIM, torch.float32, torch.float32, 7)
    out, lse = paged_attn.paged_attention(*lay_out(seqs, 16, 8), return_lse=True)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.equal(lse[0], torch.full_like(lse[0], -math.inf))
    assert torch.isfinite(lse[1]).all()


@pytest.mark.parametrize("cache", ["float32", "bfloat16"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_cascade_of_a_shared_prefix_and_own_blocks_merges_into_the_full_result(cache, block_size):
    """Four sequences on one 1,024-token prefix: attention over the prefix's blocks (a call with the prefix's
    table and length) and over each sequence's own blocks (a table of those, their length), merged by
    merge_attention_states, is the full attention, and its lse the full lse."""
    query_dtype, cache_dtype = CACHES[cache]
    num_heads, num_kv_heads = HEADS["gqa"]
    prefix = 1024
    lengths = [prefix + 300, prefix + 1, prefix + 777, prefix + 64]
    seqs = make_seqs(lengths, num_heads, num_kv_heads, HEAD_DIM, query_dtype, cache_dtype, 9)
    shared_keys, shared_values = seqs[0][1][:prefix], seqs[0][2][:prefix]
    for _, keys, values in seqs:
        keys[:prefix], values[:prefix] = shared_keys, shared_values
    case = lay_out(seqs, block_size, 10)
    query, key_cache, value_cache, block_tables, seq_lens = case
    full_out, full_lse = paged_attn.paged_attention(*case, return_lse=True)
    prefix_blocks = prefix // block_size
    own_tables = torch.full_like(block_tables, -1)
    own_tables[:, : block_tables.shape[1] - prefix_blocks] = block_tables[:, prefix_blocks:]
    out_a, lse_a = paged_attn.paged_attention(query, key_cache, value_cache, block_tables,
                                              torch.full_like(seq_lens, prefix), return_lse=True)
    out_b, lse_b = paged_attn.paged_attention(query, key_cache, value_cache, own_tables, seq_lens - prefix,
                                              return_lse=True)
    merged, merged_lse = paged_attn.merge_attention_states(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(merged, full_out, **tolerance(full_out.dtype))
    torch.testing.assert_close(merged_lse, full_lse, rtol=1e-5, atol=1e-4)
    expected_out, expected_lse = reference.paged_attention(*case, compute_dtype=torch.float64, return_lse=True)
    torch.testing.assert_close(merged, expected_out.to(merged.dtype), **tolerance(merged.dtype))
    torch.testing.assert_close(merged_lse.double(), expected_lse, **lse_tolerance(query_dtype))


def op_args_case():
    """The op's positional arguments for a small float32 GQA decode of 16 query heads (for tests of its checks)."""
    num_heads, num_kv_heads = HEADS["gqa"]
    seqs = make_seqs([50, 20], num_heads, num_kv_heads, HEAD_DIM, torch.float32, torch.float32, 11)
    query, key_cache, value_cache, block_tables, seq_lens = lay_out(seqs, 16, 12)
    return (torch.empty_like(query), query, key_cache, value_cache, block_tables, seq_lens, HEAD_DIM**-0.5, None, 0,
            0.0)


LSE_ERRORS = {  # name: (lse from out, the expected message's start)
    "float64 lse": (lambda out: torch.empty(out.shape[:2], dtype=torch.float64),
                    "lse must be a float32 tensor of shape [num_tokens, num_heads] = [2, 16] on cpu, got Double"),
    "wrong shape": (lambda out: torch.empty(out.shape[0], out.shape[1] + 1),
                    "lse must be a float32 tensor of shape [num_tokens, num_heads] = [2, 16] on cpu, got Float "
                    "[2, 17]"),
    "transposed": (lambda out: torch.empty(out.shape[1], out.shape[0]).t(), "lse must be contiguous"),
    "lse inside out": (lambda out: out.view(-1)[: out.shape[0] * out.shape[1]].view(out.shape[:2]),
                       "out and lse must not overlap in memory"),
}


def op_error(args, **kwargs):
    """The op's error message for positional args (op_args_case) and keyword arguments, or None."""
    try:
        torch.ops.paged_attn.paged_attention(*args, **kwargs)
    except RuntimeError as error:
        return str(error)
    return None


@pytest.mark.parametrize("name", sorted(LSE_ERRORS))
def test_bad_lse_is_refused_by_the_kernel_and_the_fake(name):
    make_lse, message = LSE_ERRORS[name]
    args = op_args_case()
    lse = make_lse(args[0])
    real = op_error(args, lse=lse)
    assert real is not None and real.startswith(message), real
    with FakeTensorMode() as mode:
        fake_args, fake_lse = pytree.tree_map_only(torch.Tensor, mode.from_tensor, (args, lse))
        assert op_error(fake_args, lse=fake_lse) == real


def test_opcheck_with_lse():
    args = op_args_case()
    lse = torch.empty(args[1].shape[:2])
    torch.library.opcheck(torch.ops.paged_attn.paged_attention.default, args, {"lse": lse})
