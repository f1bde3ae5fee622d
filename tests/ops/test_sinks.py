"""paged_attention(..., sinks=S) on the CPU (issue 25): attention sinks as gpt-oss uses them. Head h's softmax
also counts S[h] as a logit without a value vector, unscaled, outside the soft cap, ALiBi and the window, once per
row: out = sum_t e^(x_t - M) v_t / (e^(S[h] - M) + sum_t e^(x_t - M)), M over the logits and the sink.

Against paged_attn.reference.paged_attention(sinks=...) in float64 (itself checked here against openai/gpt-oss's
torch/model.py sdpa, written out) for decode rows of several 512-token partitions (a sink added per partition, or
dropped, fails), tiled prefill rows and chunk rows, every feature and cache dtype, the AVX-512 and portable paths;
the bits stay batch-invariant with sinks (alone, 1 or 2 threads, shared blocks or distinct copies); -inf sinks give
the bits of no sinks; +inf and huge sinks give zeros, never NaN; float16/bfloat16 sinks are converted exactly; the lse
counts the sink, so a cascade that passes the sinks to one part merges into the full result; bad sinks are refused
by the kernel and the fake with one message.
"""

import math

import pytest
import torch
import torch.utils._pytree as pytree
from conftest import run_on_portable_path
from test_attention import tolerance
from test_batch_invariance import CACHES, FEATURES, HEADS, HEAD_DIM, assert_same_bits, lay_out, make_seqs, op_kwargs
from test_return_lse import op_args_case, lse_tolerance, op_error
from torch._subclasses.fake_tensor import FakeTensorMode

import paged_attn
from paged_attn import reference

LENGTHS = [1500, 37, 3000, 1]  # 3,000 tokens: six 512-token partitions of the decode kernel


def make_sinks(num_heads, seed):
    """Sinks of the logits' size (the logits here are about N(0, 1)): each matters, none takes all."""
    return torch.empty(num_heads).uniform_(-1.0, 4.0, generator=torch.Generator().manual_seed(seed))


def gpt_oss_sdpa(q, k, v, s, sm_scale, sliding_window=0):
    """openai/gpt-oss torch/model.py's sdpa (one sequence, all its tokens queries), as published, in float64."""
    n_tokens, n_heads, q_mult, d_head = q.shape
    k = k[:, :, None, :].expand(-1, -1, q_mult, -1)
    v = v[:, :, None, :].expand(-1, -1, q_mult, -1)
    s = s.reshape(n_heads, q_mult, 1, 1).expand(-1, -1, n_tokens, -1)
    mask = torch.triu(q.new_full((n_tokens, n_tokens), -float("inf")), diagonal=1)
    if sliding_window > 0:
        mask += torch.tril(mask.new_full((n_tokens, n_tokens), -float("inf")), diagonal=-sliding_window)
    qk = torch.einsum("qhmd,khmd->hmqk", q, k) * sm_scale + mask[None, None, :, :]
    w = torch.softmax(torch.cat([qk, s], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("hmqk,khmd->qhmd", w, v).reshape(n_tokens, n_heads * q_mult, d_head)


@pytest.mark.parametrize("window", [0, 24])
def test_the_reference_is_gpt_oss_sdpa(window):
    num_heads, num_kv_heads, head_dim, n = 8, 2, 64, 60
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(n, num_heads, head_dim, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(n, num_kv_heads, head_dim, generator=gen, dtype=torch.float64) for _ in range(2))
    sinks = make_sinks(num_heads, 2).double()
    block_size = 16
    pad = k.new_zeros(-n % block_size, num_kv_heads, head_dim)
    key_cache, value_cache = (torch.cat([x, pad]).reshape(-1, block_size, num_kv_heads, head_dim) for x in (k, v))
    block_tables = torch.arange(key_cache.shape[0], dtype=torch.int32)[None]
    out = reference.paged_attention(q, key_cache, value_cache, block_tables, torch.tensor([n], dtype=torch.int32),
                                    query_start_loc=torch.tensor([0, n], dtype=torch.int32), scale=0.125,
                                    sliding_window=window or None, compute_dtype=torch.float64, sinks=sinks)
    expected = gpt_oss_sdpa(q.reshape(n, num_kv_heads, num_heads // num_kv_heads, head_dim), k, v, sinks, 0.125,
                            window)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("features", sorted(FEATURES))
@pytest.mark.parametrize("cache", ["float32", "bfloat16", "float16", "bf16q-e4m3", "float32q-e5m2"])
def test_decode_with_sinks_matches_the_reference(cache, features):
    query_dtype, cache_dtype = CACHES[cache]
    num_heads, num_kv_heads = HEADS["gqa"]
    kwargs = op_kwargs(FEATURES[features], num_heads, cache_dtype)
    sinks = make_sinks(num_heads, 3)
    seqs = make_seqs(LENGTHS, num_heads, num_kv_heads, HEAD_DIM, query_dtype, cache_dtype, 1)
    case = lay_out(seqs, 16, 2)
    out, lse = paged_attn.paged_attention(*case, sinks=sinks, return_lse=True, **kwargs)
    expected_out, expected_lse = reference.paged_attention(*case, compute_dtype=torch.float64, sinks=sinks,
                                                           return_lse=True, **kwargs)
    torch.testing.assert_close(out, expected_out.to(out.dtype), **tolerance(out.dtype))
    torch.testing.assert_close(lse.double(), expected_lse, **lse_tolerance(query_dtype))
    without = reference.paged_attention(*case, compute_dtype=torch.float64, **kwargs)
    assert (expected_out - without).abs().max() > 0.05, "the sinks must matter in this case"
    assert_same_bits(paged_attn.paged_attention(*case, sinks=sinks, **kwargs), out, "out with return_lse vs without")
    # batch-invariant with sinks: the 3,000-token sequence alone, with 1 and with 2 threads
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            alone, alone_lse = paged_attn.paged_attention(*lay_out(seqs[2:3], 16, 3), sinks=sinks, return_lse=True,
                                                          **kwargs)
            assert_same_bits(alone[0], out[2], f"a row alone with {n} thread(s) vs in the batch")
            assert_same_bits(alone_lse[0], lse[2], f"its lse alone with {n} thread(s) vs in the batch")
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("features", ["plain", "alibi", "window", "all"])
@pytest.mark.parametrize("cache", ["float32", "bfloat16", "bf16q-e4m3"])
def test_varlen_with_sinks_matches_the_reference(cache, features):
    """A 40-token prefill (tiled prefill kernel), a 3-token chunk (decode-kernel rows) and a decode."""
    query_dtype, cache_dtype = CACHES[cache]
    num_heads, num_kv_heads = HEADS["gqa"]
    kwargs = op_kwargs(FEATURES[features], num_heads, cache_dtype)
    sinks = make_sinks(num_heads, 4)
    seqs = make_seqs([1200, 900, 2000], num_heads, num_kv_heads, HEAD_DIM, query_dtype, cache_dtype, 4)
    _, key_cache, value_cache, block_tables, seq_lens = lay_out(seqs, 16, 5)
    query = torch.randn(40 + 3 + 1, num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(6)).to(query_dtype)
    qsl = torch.tensor([0, 40, 43, 44], dtype=torch.int32)
    case = (query, key_cache, value_cache, block_tables, seq_lens)
    out, lse = paged_attn.paged_attention(*case, query_start_loc=qsl, sinks=sinks, return_lse=True, **kwargs)
    expected_out, expected_lse = reference.paged_attention(*case, query_start_loc=qsl, compute_dtype=torch.float64,
                                                           sinks=sinks, return_lse=True, **kwargs)
    torch.testing.assert_close(out, expected_out.to(out.dtype), **tolerance(out.dtype))
    torch.testing.assert_close(lse.double(), expected_lse, **lse_tolerance(query_dtype))


@pytest.mark.parametrize("cache", ["float32", "bfloat16"])
def test_minus_inf_sinks_are_no_sinks_bit_for_bit(cache):
    query_dtype, cache_dtype = CACHES[cache]
    num_heads, num_kv_heads = HEADS["gqa"]
    seqs = make_seqs(LENGTHS, num_heads, num_kv_heads, HEAD_DIM, query_dtype, cache_dtype, 7)
    case = lay_out(seqs, 16, 8)
    qsl = torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32)
    for kwargs in ({}, {"query_start_loc": qsl}):
        plain, plain_lse = paged_attn.paged_attention(*case, return_lse=True, **kwargs)
        out, lse = paged_attn.paged_attention(*case, sinks=torch.full((num_heads,), -math.inf), return_lse=True,
                                              **kwargs)
        assert_same_bits(out, plain, "sinks of -inf vs none")
        assert_same_bits(lse, plain_lse, "their lse")


def test_extreme_sinks_give_zeros_never_nan():
    """+inf takes the whole softmax (out 0, lse +inf); 1e30 and 88.8 (whose exp overflows float32) nearly all of it;
    -1e30 nothing; and a sink beside a row that sees no key (seq_len 0) leaves it 0 with lse = the sink."""
    num_heads, num_kv_heads = HEADS["mha"]
    seqs = make_seqs([700, 0, 1300], num_heads, num_kv_heads, HEAD_DIM, torch.float32, torch.float32, 9)
    case = lay_out(seqs, 16, 10)
    sinks = torch.tensor([math.inf, 1e30, 88.8, -1e30, -math.inf, 0.5, 3.0, math.inf])
    for kwargs in ({}, {"query_start_loc": torch.tensor([0, 1, 1, 3], dtype=torch.int32)}):
        query = case[0] if not kwargs else torch.cat([case[0][:1], case[0][2:], case[0][2:]])
        args = (query,) + case[1:]
        out, lse = paged_attn.paged_attention(*args, sinks=sinks, return_lse=True, **kwargs)
        expected, expected_lse = reference.paged_attention(*args, compute_dtype=torch.float64, sinks=sinks,
                                                           return_lse=True, **kwargs)
        assert not out.isnan().any() and not lse.isnan().any()
        torch.testing.assert_close(out, expected.float(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(lse.double(), expected_lse, rtol=1e-5, atol=1e-4)
        assert torch.equal(out[:, [0, 7]], torch.zeros_like(out[:, [0, 7]]))
        assert torch.equal(lse[:, 0], torch.full_like(lse[:, 0], math.inf))
        if not kwargs:  # the decode row of the empty sequence
            assert torch.equal(out[1], torch.zeros_like(out[1]))
            assert torch.equal(lse[1], sinks)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_sinks_are_converted_exactly(dtype):
    num_heads, num_kv_heads = HEADS["gqa"]
    seqs = make_seqs(LENGTHS, num_heads, num_kv_heads, HEAD_DIM, torch.bfloat16, torch.bfloat16, 11)
    case = lay_out(seqs, 16, 12)
    sinks = make_sinks(num_heads, 13).to(dtype)
    assert_same_bits(paged_attn.paged_attention(*case, sinks=sinks),
                     paged_attn.paged_attention(*case, sinks=sinks.float()), f"{dtype} sinks vs float32")


@pytest.mark.parametrize("cache", ["float32", "bfloat16"])
def test_sinks_over_shared_blocks_keep_the_bits_of_distinct_copies(cache):
    """Four rows on one 2,100-token prefix (in the same physical blocks, read once) against the same rows on
    distinct copies of its blocks: the sink is added once per row, not per shared segment."""
    query_dtype, cache_dtype = CACHES[cache]
    num_heads, num_kv_heads = HEADS["gqa"]
    sinks = make_sinks(num_heads, 14)
    prefix, block_size = 2100 // 16 * 16, 16
    seqs = make_seqs([prefix + 5, prefix + 300, prefix + 1, prefix + 64], num_heads, num_kv_heads, HEAD_DIM,
                     query_dtype, cache_dtype, 15)
    for _, keys, values in seqs[1:]:
        keys[:prefix], values[:prefix] = seqs[0][1][:prefix], seqs[0][2][:prefix]
    distinct = lay_out(seqs, block_size, 16)
    query, key_cache, value_cache, block_tables, seq_lens = distinct
    shared_tables = block_tables.clone()
    shared_tables[1:, : prefix // block_size] = block_tables[0, : prefix // block_size]
    out = paged_attn.paged_attention(query, key_cache, value_cache, shared_tables, seq_lens, sinks=sinks)
    assert_same_bits(out, paged_attn.paged_attention(*distinct, sinks=sinks), "shared blocks vs distinct copies")
    expected = reference.paged_attention(*distinct, compute_dtype=torch.float64, sinks=sinks)
    torch.testing.assert_close(out, expected.to(out.dtype), **tolerance(out.dtype))


def test_cascade_with_the_sinks_in_one_part_merges_into_the_full_result():
    num_heads, num_kv_heads = HEADS["gqa"]
    prefix, block_size = 1024, 16
    seqs = make_seqs([prefix + 300, prefix + 1, prefix + 777], num_heads, num_kv_heads, HEAD_DIM, torch.float32,
                     torch.float32, 17)
    for _, keys, values in seqs[1:]:
        keys[:prefix], values[:prefix] = seqs[0][1][:prefix], seqs[0][2][:prefix]
    case = lay_out(seqs, block_size, 18)
    query, key_cache, value_cache, block_tables, seq_lens = case
    sinks = make_sinks(num_heads, 19)
    full_out, full_lse = paged_attn.paged_attention(*case, sinks=sinks, return_lse=True)
    own_tables = torch.full_like(block_tables, -1)
    own_tables[:, : block_tables.shape[1] - prefix // block_size] = block_tables[:, prefix // block_size:]
    out_a, lse_a = paged_attn.paged_attention(query, key_cache, value_cache, block_tables,
                                              torch.full_like(seq_lens, prefix), sinks=sinks, return_lse=True)
    out_b, lse_b = paged_attn.paged_attention(query, key_cache, value_cache, own_tables, seq_lens - prefix,
                                              return_lse=True)
    merged, merged_lse = paged_attn.merge_attention_states(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(merged, full_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged_lse, full_lse, rtol=1e-5, atol=1e-4)


SINK_ERRORS = {  # name: (sinks, the expected message's start, whether the fake can see it)
    "int32": (torch.zeros(16, dtype=torch.int32),
              "sinks must be float32, float16 or bfloat16 (one logit per query head), got Int", True),
    "float64": (torch.zeros(16, dtype=torch.float64),
                "sinks must be float32, float16 or bfloat16 (one logit per query head), got Double", True),
    "one per kv head": (torch.zeros(4), "sinks must have shape [num_heads] = [16], got [4]", True),
    "two dimensions": (torch.zeros(1, 16), "sinks must have shape [num_heads] = [16], got [1, 16]", True),
    "scalar": (torch.tensor(0.0), "sinks must have shape [num_heads] = [16], got []", True),
    "wrong device": (torch.zeros(16, device="meta"), "sinks must be on the query's device cpu, got meta", False),
    "NaN": (torch.tensor([0.0] * 5 + [math.nan] + [0.0] * 10),
            "sinks must not be NaN (-inf: no sink for that head), got NaN for head 5", False),
}


@pytest.mark.parametrize("name", sorted(SINK_ERRORS))
def test_bad_sinks_are_refused_by_the_kernel_and_the_fake(name):
    sinks, message, fake_sees_it = SINK_ERRORS[name]
    args = op_args_case()
    real = op_error(args, sinks=sinks)
    assert real is not None and real.startswith(message), real
    if not fake_sees_it:  # values, and a device the fake mode cannot mix, need the real tensors
        return
    with FakeTensorMode() as mode:
        fake_args, fake_sinks = pytree.tree_map_only(torch.Tensor, mode.from_tensor, (args, sinks))
        assert op_error(fake_args, sinks=fake_sinks) == real


def test_opcheck_with_sinks():
    args = op_args_case()
    torch.library.opcheck(torch.ops.paged_attn.paged_attention.default, args,
                          {"sinks": make_sinks(16, 22), "lse": torch.empty(args[1].shape[:2])})


def test_portable_path_when_avx512_is_switched_off():
    """The bf16 ids again on the portable (AVX2) path."""
    run_on_portable_path(
        "import test_sinks as t\n"
        "t.test_decode_with_sinks_matches_the_reference('bfloat16', 'all')\n"
        "t.test_decode_with_sinks_matches_the_reference('bf16q-e4m3', 'window')\n"
        "t.test_varlen_with_sinks_matches_the_reference('bfloat16', 'all')\n"
        "t.test_sinks_over_shared_blocks_keep_the_bits_of_distinct_copies('bfloat16')\n"
    )


PAGED_CALLS = []


def paged_gpt_oss_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, sliding_window=None,
                            s_aux=None, **kwargs):
    """transformers' attention interface on our op: the layer's keys and values (after RoPE) go through
    reshape_and_cache into a NaN-poisoned paged cache of shuffled blocks, the prompt's rows through the
    variable-length op and its last row once more as a decode; the layer's sinks and window are passed on."""
    PAGED_CALLS.append((module.layer_idx, sliding_window, s_aux is not None))
    batch, num_heads, n, head_dim = query.shape
    num_kv_heads, block_size = key.shape[1], 16
    gen = torch.Generator().manual_seed(module.layer_idx)
    num_blocks = -(-n // block_size) + 3
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), math.nan, dtype=key.dtype)
    value_cache = torch.full_like(key_cache, math.nan)
    table = torch.randperm(num_blocks, generator=gen)[: -(-n // block_size)].to(torch.int32)
    tokens = torch.arange(n)
    slots = table[tokens // block_size].long() * block_size + tokens % block_size
    outs = []
    for b in range(batch):
        paged_attn.reshape_and_cache(key[b].transpose(0, 1), value[b].transpose(0, 1), key_cache, value_cache,
                                     slots)
        q = query[b].transpose(0, 1).contiguous()
        args = (key_cache, value_cache, table[None], torch.tensor([n], dtype=torch.int32))
        kwargs = dict(scale=scaling, sliding_window=sliding_window, sinks=s_aux)
        out = paged_attn.paged_attention(q, *args, query_start_loc=torch.tensor([0, n], dtype=torch.int32), **kwargs)
        last = paged_attn.paged_attention(q[-1:], *args, **kwargs)
        torch.testing.assert_close(last[0], out[-1], rtol=1e-5, atol=1e-5)
        outs.append(out)
    return torch.stack(outs), None


def test_a_tiny_random_gpt_oss_gives_transformers_logits_through_the_op():
    """A tiny random GptOssForCausalLM (a sliding-window layer of 8 tokens and a full one, both with sinks):
    transformers' eager attention against the same model on our op."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("transformers.models.gpt_oss")
    config = transformers.GptOssConfig(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                                       vocab_size=128, hidden_size=64, intermediate_size=64, head_dim=16,
                                       num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                                       layer_types=["sliding_attention", "full_attention"],
                                       max_position_embeddings=256)
    torch.manual_seed(23)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(1.0, 1.0)  # sinks of the logits' size, so that they matter
    tokens = torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(24))
    transformers.AttentionInterface.register("paged_attn_test", paged_gpt_oss_attention)
    with torch.no_grad():
        model.set_attn_implementation("eager")
        expected = model(tokens).logits
        model.set_attn_implementation("paged_attn_test")
        PAGED_CALLS.clear()
        logits = model(tokens).logits
        assert PAGED_CALLS == [(0, 8, True), (1, None, True)]
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-math.inf)
        without = model(tokens).logits
    assert (expected - without).abs().max() > 1e-3, "the sinks must matter in this model"
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)
