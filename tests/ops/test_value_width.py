"""paged_attention with values of a width of their own (head_dim_v != head_dim; CPU): MLA's prefill (keys of 192 =
128 + 64, values of 128) and any other pair, against the float64 reference, in NaN-poisoned caches; decode, and
variable-length calls whose prompts then run on the decode kernel; lse; the same bits whatever the batch; GQA and
MHA; float32, float16, bfloat16 and fp8; CUDA refuses it clearly."""

import pytest
import torch
from conftest import HAS_CUDA_OPS
from test_attention import make_case, tolerance

import paged_attn
from paged_attn import reference

PAIRS = [(192, 128), (64, 32), (32, 96)]  # (head_dim, head_dim_v)


def widths_case(seq_lens, num_heads, num_kv_heads, pair, dtype, *, block_size=16, query_tokens=None, seed=0):
    """make_case's cache cut to keys [..., :head_dim] and values [..., :head_dim_v] (strided views); one query per
    sequence, or query_tokens per sequence with query_start_loc."""
    head_dim, head_dim_v = pair
    torch.manual_seed(seed)
    query, key_cache, value_cache, block_tables, lens = make_case(seq_lens, num_heads, num_kv_heads,
                                                                  max(pair), block_size, dtype, "cpu")
    qsl = None
    if query_tokens is not None:
        query = torch.randn(sum(query_tokens), num_heads, max(pair)).to(dtype)
        qsl = torch.tensor([0] + list(query_tokens)).cumsum(0).to(torch.int32)
    return query[..., :head_dim], key_cache[..., :head_dim], value_cache[..., :head_dim_v], block_tables, lens, qsl


def check(case, dtype, **kwargs):
    query, key_cache, value_cache, block_tables, lens, qsl = case
    got, got_lse = paged_attn.paged_attention(query, key_cache, value_cache, block_tables, lens, query_start_loc=qsl,
                                              return_lse=True, **kwargs)
    want, want_lse = reference.paged_attention(query, key_cache, value_cache, block_tables, lens, query_start_loc=qsl,
                                               compute_dtype=torch.float64, return_lse=True, **kwargs)
    assert got.shape == query.shape[:2] + value_cache.shape[3:] and got.dtype == query.dtype
    assert not got.isnan().any(), "NaN in the output: an unused (poisoned) slot leaked in"
    torch.testing.assert_close(got.double(), want.double(), **tolerance(dtype))
    torch.testing.assert_close(got_lse.double(), want_lse, rtol=1e-5, atol=1e-4)
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pair", PAIRS, ids=[f"{k}-{v}" for k, v in PAIRS])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa4"])
def test_decode(dtype, pair, heads):
    check(widths_case([1, 70, 600, 0], *heads, pair, dtype, seed=sum(pair)), dtype, scale=0.09)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompts_chunks_and_decodes(dtype):
    """A prompt of 40 tokens (the decode kernel takes its rows), a chunk of 3, a decode and an empty query."""
    case = widths_case([40, 530, 77, 9], 8, 2, (192, 128), dtype, query_tokens=[40, 3, 1, 0], seed=3)
    check(case, dtype, scale=0.07, sliding_window=300, logits_soft_cap=20.0)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_caches(cache_dtype):
    query, key_cache, value_cache, block_tables, lens, qsl = widths_case([300, 21], 8, 2, (192, 128), torch.bfloat16,
                                                                         seed=5)
    k_scale, v_scale = torch.tensor([0.02]), torch.tensor([0.03])
    key8 = reference.quantize_fp8(key_cache, cache_dtype, k_scale)
    value8 = reference.quantize_fp8(value_cache, cache_dtype, v_scale)
    check((query, key8, value8, block_tables, lens, qsl), torch.bfloat16, k_scale=k_scale, v_scale=v_scale)


def test_same_bits_alone_and_in_a_batch():
    query, key_cache, value_cache, block_tables, lens, _ = widths_case([1200, 33, 700], 8, 2, (192, 128),
                                                                       torch.bfloat16, seed=7)
    batch = paged_attn.paged_attention(query, key_cache, value_cache, block_tables, lens)
    alone = paged_attn.paged_attention(query[2:], key_cache, value_cache, block_tables[2:], lens[2:])
    assert torch.equal(batch[2:], alone)


def test_out_must_have_the_value_width():
    query, key_cache, value_cache, block_tables, lens, _ = widths_case([10], 4, 2, (64, 32), torch.float32)
    with pytest.raises(RuntimeError, match=r"out must be a Float tensor of shape \[1, 4, 32\]"):
        paged_attn.paged_attention(query, key_cache, value_cache, block_tables, lens, out=torch.empty(1, 4, 64))


@pytest.mark.skipif(not HAS_CUDA_OPS, reason="needs a GPU and the CUDA kernels")
def test_cuda_says_not_yet():
    case = [t.cuda() for t in widths_case([10], 4, 2, (64, 32), torch.float16)[:5]]
    with pytest.raises(RuntimeError, match="not on CUDA yet"):
        paged_attn.paged_attention(*case)
