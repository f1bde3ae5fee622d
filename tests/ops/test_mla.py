"""MLA (multi-head latent attention) on the paged latent cache: concat_and_cache_mla and mla_attention against the
float64 references of paged_attn/reference.py, on random data in a NaN-poisoned cache with shuffled blocks and
garbage past each block table's used entries; DeepSeek-V3's 512 + 64 and small ranks; 1 to 128 heads; block sizes
1 to 64; float32, float16, bfloat16 and fp8 caches; decode, several query tokens per sequence and prefills; lse;
the same bits whatever the batch and the thread count; the errors at the door, the fakes, opcheck and compile."""

import math

import pytest
import torch
from conftest import HAS_CUDA_OPS
from test_attention import tolerance
from test_batch_invariance import poisoned

import paged_attn
from paged_attn import reference

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
GARBAGE = 10**6  # in block-table entries past a sequence's blocks


def latent_cache(rows, block_size, cache_dtype, seed, *, scale=None, spare_blocks=3):
    """Each sequence's latent rows ([L_s, row] float32) written by concat_and_cache_mla into a NaN-poisoned cache
    of shuffled blocks. Returns (kv_cache, block_tables, seq_lens)."""
    gen = torch.Generator().manual_seed(seed)
    row = rows[0].shape[1]
    blocks_per_seq = [-(-r.shape[0] // block_size) for r in rows]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    kv_cache = poisoned((num_blocks, block_size, row), cache_dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(blocks_per_seq) + 2
    block_tables = torch.full((len(rows), width), GARBAGE, dtype=torch.int32)
    first = 0
    input_dtype = torch.bfloat16 if cache_dtype in (E4M3, E5M2) else cache_dtype
    for s, r in enumerate(rows):
        table = perm[first:first + blocks_per_seq[s]]
        first += blocks_per_seq[s]
        block_tables[s, :len(table)] = table.to(torch.int32)
        positions = torch.arange(r.shape[0])
        slots = table[positions // block_size] * block_size + positions % block_size
        x = r.to(input_dtype)
        paged_attn.concat_and_cache_mla(x[:, :-8], x[:, -8:], kv_cache, slots, scale=scale)  # row = their concat
    seq_lens = torch.tensor([r.shape[0] for r in rows], dtype=torch.int32)
    return kv_cache, block_tables, seq_lens


def mla_case(seq_lens, num_heads, rank, rope, block_size, dtype, *, cache_dtype=None, query_tokens=None, seed=0,
             scale=None):
    """Random latent rows and queries; query_tokens: the query rows per sequence (None: one, a decode call)."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randn(n, rank + rope, generator=gen) for n in seq_lens]
    kv_cache, block_tables, lens = latent_cache(rows, block_size, cache_dtype or dtype, seed + 1, scale=scale)
    num_tokens = len(seq_lens) if query_tokens is None else sum(query_tokens)
    query = torch.randn(num_tokens, num_heads, rank + rope, generator=gen).to(dtype)
    qsl = None
    if query_tokens is not None:
        qsl = torch.tensor([0] + list(query_tokens), dtype=torch.int32).cumsum(0).to(torch.int32)
    return query, kv_cache, block_tables, lens, qsl


def check(case, rank, dtype, *, scale=0.07, k_scale=None, return_lse=False, **kwargs):
    query, kv_cache, block_tables, seq_lens, qsl = case
    got = paged_attn.mla_attention(query, kv_cache, block_tables, seq_lens, kv_lora_rank=rank, scale=scale,
                                   query_start_loc=qsl, k_scale=k_scale, return_lse=return_lse, **kwargs)
    want = reference.mla_attention(query, kv_cache, block_tables, seq_lens, kv_lora_rank=rank, scale=scale,
                                   query_start_loc=qsl, compute_dtype=torch.float64, k_scale=k_scale,
                                   return_lse=return_lse)
    if return_lse:
        (got, got_lse), (want, want_lse) = got, want
        torch.testing.assert_close(got_lse.double(), want_lse, rtol=1e-5, atol=1e-4)
    assert got.shape == (query.shape[0], query.shape[1], rank) and got.dtype == query.dtype
    assert not got.isnan().any(), "NaN in the output: an unused (poisoned) slot leaked in"
    torch.testing.assert_close(got.double(), want.double(), **tolerance(dtype))
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rank, rope", [(64, 16), (128, 32)])
@pytest.mark.parametrize("num_heads", [1, 16, 22])
def test_decode_matches_the_reference(dtype, rank, rope, num_heads):
    """Decode over lengths across partitions (512 tokens) and blocks, with an empty sequence."""
    case = mla_case([1, 37, 700, 0, 1100], num_heads, rank, rope, 16, dtype, seed=num_heads)
    out = check(case, rank, dtype)
    assert torch.equal(out[3], torch.zeros_like(out[3])), "a sequence of length 0 gives a zero row"


@pytest.mark.parametrize("block_size", [1, 5, 16, 64])
def test_block_sizes(block_size):
    check(mla_case([3, 130, 600], 8, 64, 16, block_size, torch.bfloat16, seed=block_size), 64, torch.bfloat16)


@pytest.mark.parametrize("num_heads", [16, 128])
def test_deepseek_v3_shape(num_heads):
    """DeepSeek-V3's latent row, 512 + 64, bfloat16, as many heads as a tensor-parallel shard (16) or a whole model
    (128) has."""
    case = mla_case([900, 65], num_heads, 512, 64, 16, torch.bfloat16, seed=3)
    check(case, 512, torch.bfloat16, scale=0.1147, return_lse=True)


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
def test_fp8_latent_cache(cache_dtype):
    """An fp8 latent cache with a scale: written as the nearest fp8 value of x / scale, read back times it."""
    k_scale = torch.tensor([0.05])
    case = mla_case([520, 33], 16, 128, 32, 16, torch.bfloat16, cache_dtype=cache_dtype, scale=k_scale, seed=5)
    check(case, 128, torch.bfloat16, k_scale=k_scale, return_lse=True)


def test_query_start_loc_and_lse():
    """Several query tokens per sequence (speculative decoding, short chunks: the decode kernel's rows) and a
    prefill (the tiled kernel), each causal up to its own position; lse as the reference's."""
    case = mla_case([700, 40, 90, 5], 16, 64, 16, 16, torch.float32, query_tokens=[3, 40, 1, 0], seed=7)
    check(case, 64, torch.float32, return_lse=True, max_query_len=40)


def test_same_bits_in_any_batch_and_thread_count():
    """A row's output bits do not depend on the other rows of the call nor on the thread count."""
    query, kv_cache, block_tables, seq_lens, _ = mla_case([1500, 60, 800], 16, 128, 32, 16, torch.bfloat16, seed=9)
    kwargs = dict(kv_lora_rank=128, scale=0.1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged_attn.mla_attention(query, kv_cache, block_tables, seq_lens, **kwargs)
        torch.set_num_threads(2)
        two = paged_attn.mla_attention(query, kv_cache, block_tables, seq_lens, **kwargs)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    alone = paged_attn.mla_attention(query[:1], kv_cache, block_tables[:1], seq_lens[:1], **kwargs)
    assert torch.equal(alone[0], one[0])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, E4M3, E5M2])
def test_concat_and_cache_mla_writes_the_rows(cache_dtype):
    """kv_c and k_pe as slices of one projection's output (row stride past the row), padding tokens skipped: the
    same cache bytes as the reference's, untouched rows still NaN."""
    gen = torch.Generator().manual_seed(11)
    input_dtype = torch.bfloat16 if cache_dtype in (E4M3, E5M2) else cache_dtype
    projection = torch.randn(6, 200, generator=gen).to(input_dtype)
    kv_c, k_pe = projection[:, :128], projection[:, 150:182]
    slots = torch.tensor([3, -1, 17, 40, 9, -5])
    scale = torch.tensor([0.02]) if cache_dtype in (E4M3, E5M2) else None
    got, want = poisoned((6, 8, 160), cache_dtype), poisoned((6, 8, 160), cache_dtype)
    paged_attn.concat_and_cache_mla(kv_c, k_pe, got, slots, scale=scale)
    reference.concat_and_cache_mla(kv_c, k_pe, want, slots, scale=scale)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert (got.view(torch.uint8) != poisoned((6, 8, 160), cache_dtype).view(torch.uint8)).flatten(2).any(-1).sum() \
        == 4, "exactly the 4 slots written"


def test_swap_blocks_copies_latent_blocks():
    """swap_blocks takes latent caches as any cache: between two, and within one (copy-on-write)."""
    gen = torch.Generator().manual_seed(13)
    src, dst = torch.randn(5, 16, 80, generator=gen), torch.randn(4, 16, 80, generator=gen)
    want = dst.clone()
    reference.swap_blocks(src, want, torch.tensor([[4, 0], [1, 3]]))
    paged_attn.swap_blocks(src, dst, [[4, 0], [1, 3]])
    assert torch.equal(dst, want)
    reference.swap_blocks(src.clone(), src, torch.tensor([[0, 2]]))
    expected = src.clone()
    paged_attn.swap_blocks(src, src, [[2, 4]])
    expected[4] = expected[2]
    assert torch.equal(src, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, E4M3])
def test_copy_blocks_copies_latent_blocks(dtype):
    """copy_blocks with one latent cache per layer (value_caches=[]): every pair in every layer, nothing else; a
    K/V pair and a latent cache are not mixed."""
    gen = torch.Generator().manual_seed(17)
    caches = [torch.randn(6, 16, 80, generator=gen).to(dtype) for _ in range(3)]
    want = [c.clone() for c in caches]
    pairs = torch.tensor([[0, 3], [5, 1], [2, 4]])
    reference.copy_blocks(want, [], pairs)
    paged_attn.copy_blocks(caches, [], pairs)
    assert all(torch.equal(c.view(torch.uint8), w.view(torch.uint8)) for c, w in zip(caches, want))
    with pytest.raises(RuntimeError, match="same number of layers"):
        paged_attn.copy_blocks(caches, caches[:1], pairs)
    with pytest.raises(RuntimeError, match=r"key_caches\[0\] must have shape \[num_blocks, block_size, num_kv_heads"):
        paged_attn.copy_blocks(caches[:1], caches[1:2], pairs)


def error_parts():
    """A valid decode call: (query, kv_cache, block_tables, seq_lens, out)."""
    query, kv_cache, block_tables, seq_lens, _ = mla_case([20, 9], 4, 64, 16, 8, torch.float32, seed=15)
    return query, kv_cache, block_tables, seq_lens, torch.empty(2, 4, 64)


# name: (change of (query, kv_cache, block_tables, seq_lens, out) -> (args, kwargs) of torch.ops.paged_attn.mla_attention,
# message)
ERRORS = {
    "cache rank": (lambda q, c, t, s, o: ((o, q, c[:, :, None], t, s, 64, 0.1), {}),
                   r"kv_cache must have shape \[num_blocks, block_size, kv_lora_rank \+ rope_dim\]"),
    "cache dtype": (lambda q, c, t, s, o: ((o, q, c.double(), t, s, 64, 0.1), {}),
                    "kv_cache must be float32, float16, bfloat16, float8_e4m3fn or float8_e5m2, got Double"),
    "query row": (lambda q, c, t, s, o: ((o, q[..., :64], c, t, s, 64, 0.1), {}),
                  "query must have shape .* with the cache's row of 80, got"),
    "query dtype": (lambda q, c, t, s, o: ((o.half(), q.half(), c, t, s, 64, 0.1), {}),
                    "query and kv_cache must have the same dtype, got Half and Float"),
    "rank too large": (lambda q, c, t, s, o: ((torch.empty(2, 4, 81), q, c, t, s, 81, 0.1), {}),
                       r"kv_lora_rank must be in \[1, 80\]"),
    "rank zero": (lambda q, c, t, s, o: ((torch.empty(2, 4, 0), q, c, t, s, 0, 0.1), {}),
                  r"kv_lora_rank must be in \[1, 80\]"),
    "out shape": (lambda q, c, t, s, o: ((torch.empty(2, 4, 80), q, c, t, s, 64, 0.1), {}),
                  r"out must be a Float tensor of shape \[num_tokens, num_heads, kv_lora_rank\]"),
    "out dtype": (lambda q, c, t, s, o: ((o.half(), q, c, t, s, 64, 0.1), {}), "out must be a Float tensor"),
    "scale on a float cache": (lambda q, c, t, s, o: ((o, q, c, t, s, 64, 0.1), {"k_scale": torch.ones(1)}),
                               "k_scale is given but the cache is Float"),
    "seq_lens rows": (lambda q, c, t, s, o: ((o, q, c, t, s[:1], 64, 0.1), {}), "seq_lens must have num_seqs = 2"),
    "lse shape": (lambda q, c, t, s, o: ((o, q, c, t, s, 64, 0.1), {"lse": torch.empty(2, 3)}),
                  "lse must be a float32 tensor of shape"),
    "out is query": (lambda q, c, t, s, o: ((q[..., :64], q, c, t, s, 64, 0.1), {}), "out must be contiguous|overlap"),
    "block id": (lambda q, c, t, s, o: ((o, q, c, torch.full_like(t, 99), s, 64, 0.1), {}), "block"),
}
REAL_ONLY = {"block id"}  # index values: a fake tensor has none


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_mla_attention_refuses_bad_arguments(name):
    change, message = ERRORS[name]
    args, kwargs = change(*error_parts())
    with pytest.raises(RuntimeError, match=message):
        torch.ops.paged_attn.mla_attention(*args, **kwargs)


@pytest.mark.parametrize("name", sorted(set(ERRORS) - REAL_ONLY))
def test_the_fake_refuses_them_alike(name):
    from torch._subclasses.fake_tensor import FakeTensorMode

    change, message = ERRORS[name]
    args, kwargs = change(*error_parts())
    with pytest.raises(RuntimeError) as real:
        torch.ops.paged_attn.mla_attention(*args, **kwargs)
    with FakeTensorMode() as mode:
        fake_args, fake_kwargs = torch.utils._pytree.tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
        with pytest.raises(RuntimeError) as fake:
            torch.ops.paged_attn.mla_attention(*fake_args, **fake_kwargs)
    assert str(fake.value) == str(real.value)


CACHE_ERRORS = {
    "widths": (lambda c, p, k, s: (c[:, :60], p, k, s), r"kv_c and k_pe hold 60 \+ 16 values per token"),
    "dtypes": (lambda c, p, k, s: (c, p.half(), k, s), "kv_c and k_pe must have the same dtype and device"),
    "cache dtype": (lambda c, p, k, s: (c.half(), p.half(), k, s), "kv_c and kv_cache must have the same dtype"),
    "slots dtype": (lambda c, p, k, s: (c, p, k, s.int()), "slot_mapping must be Long"),
    "slots count": (lambda c, p, k, s: (c, p, k, s[:2]), "slot_mapping must have num_tokens = 3"),
    "slot range": (lambda c, p, k, s: (c, p, k, s + 100), "slot"),
    "cache rank": (lambda c, p, k, s: (c, p, k[:, :, None], s), r"kv_cache must have shape \[num_blocks"),
}


@pytest.mark.parametrize("name", sorted(CACHE_ERRORS))
def test_concat_and_cache_mla_refuses_bad_arguments(name):
    change, message = CACHE_ERRORS[name]
    kv_cache = torch.full((4, 8, 80), math.nan)
    before = kv_cache.clone()
    args = change(torch.randn(3, 64), torch.randn(3, 16), kv_cache, torch.tensor([0, 9, 31]))
    with pytest.raises(RuntimeError, match=message):
        paged_attn.concat_and_cache_mla(*args)
    assert before.isnan().all() and kv_cache.isnan().all(), "nothing written"
    with pytest.raises(RuntimeError, match="fp8|scale"):
        paged_attn.concat_and_cache_mla(torch.randn(3, 64), torch.randn(3, 16), kv_cache, torch.tensor([0, 1, 2]),
                                        scale=torch.ones(1))


def test_wrapper_refuses_bad_scalars():
    query, kv_cache, block_tables, seq_lens, _ = error_parts()
    for kwargs in (dict(kv_lora_rank=81, scale=0.1), dict(kv_lora_rank=64, scale=math.inf),
                   dict(kv_lora_rank=64.0, scale=0.1), dict(kv_lora_rank=64, scale=0.1, max_query_len=3)):
        with pytest.raises(ValueError):
            paged_attn.mla_attention(query, kv_cache, block_tables, seq_lens, **kwargs)


def test_opcheck_and_torch_compile():
    query, kv_cache, block_tables, seq_lens, out = error_parts()
    torch.library.opcheck(torch.ops.paged_attn.mla_attention.default,
                          (out, query, kv_cache, block_tables, seq_lens, 64, 0.1), {"lse": torch.empty(2, 4)})
    torch.library.opcheck(torch.ops.paged_attn.concat_and_cache_mla.default,
                          (torch.randn(2, 64), torch.randn(2, 16), kv_cache.clone(), torch.tensor([3, 60])))

    def step(kv_c, k_pe, cache, slots, q, tables, lens):
        paged_attn.concat_and_cache_mla(kv_c, k_pe, cache, slots)
        return paged_attn.mla_attention(q, cache, tables, lens, kv_lora_rank=64, scale=0.1) * 2

    kv_c, k_pe = torch.randn(2, 64), torch.randn(2, 16)
    slots = torch.tensor([int(block_tables[0, 2]) * 8 + 3, int(block_tables[1, 1]) * 8])
    eager_cache, compiled_cache = kv_cache.clone(), kv_cache.clone()
    torch._dynamo.reset()
    want = step(kv_c, k_pe, eager_cache, slots, query, block_tables, seq_lens)
    got = torch.compile(step, fullgraph=True)(kv_c, k_pe, compiled_cache, slots, query, block_tables, seq_lens)
    assert torch.equal(got, want) and torch.equal(compiled_cache.nan_to_num(7), eager_cache.nan_to_num(7))


# ---------------------------------------------------------------------------------------------------------------
# CUDA (a GPU and the CUDA kernels; the same kernels run in the emulator everywhere: tests/emulated/test_emulated_mla.py)

def to_cuda(case):
    return tuple(None if t is None else t.cuda() for t in case)


@pytest.mark.skipif(not HAS_CUDA_OPS, reason="needs a GPU and the CUDA kernels")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rank, rope, num_heads, block_size", [(512, 64, 16, 64), (512, 64, 128, 16),
                                                               (128, 32, 22, 16), (128, 32, 3, 8)])
def test_cuda_mla_attention_matches_the_reference(dtype, rank, rope, num_heads, block_size):
    """Decode on CUDA (single pass and split-KV: a 2,000-token row beside short ones and an empty one) with lse,
    then several query rows per sequence, against the float64 reference."""
    case = mla_case([1, 37, 2000, 0, 700], num_heads, rank, rope, block_size, dtype, seed=rank + num_heads)
    out = check(to_cuda(case), rank, dtype, scale=0.1147, return_lse=True)
    assert torch.equal(out[3].cpu(), torch.zeros_like(out[3].cpu())), "a sequence of length 0 gives a zero row"
    case = mla_case([700, 40, 90, 5], num_heads, rank, rope, block_size, dtype, query_tokens=[3, 40, 1, 0], seed=2)
    check(to_cuda(case), rank, dtype, return_lse=True, max_query_len=40)


@pytest.mark.skipif(not HAS_CUDA_OPS, reason="needs a GPU and the CUDA kernels")
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32, E4M3, E5M2])
def test_cuda_concat_and_cache_mla_writes_the_cpus_bytes(cache_dtype):
    """concat_and_cache_mla on CUDA writes the CPU op's bytes (fp8: quantized with a scale), padding skipped."""
    generator = torch.Generator().manual_seed(4)
    dtype = torch.bfloat16 if cache_dtype in (E4M3, E5M2) else cache_dtype
    projection = (torch.randn(9, 128 + 8 + 32, generator=generator) * 3).to(dtype)
    kv_c, k_pe = projection[:, :128], projection[:, 136:]
    slots = torch.randperm(20, generator=generator)[:9]
    slots[4] = -1
    scale = torch.tensor([0.37]) if cache_dtype in (E4M3, E5M2) else None
    cpu = poisoned((5, 4, 160), cache_dtype)
    gpu = cpu.cuda()
    paged_attn.concat_and_cache_mla(kv_c, k_pe, cpu, slots, scale=scale)
    paged_attn.concat_and_cache_mla(kv_c.cuda(), k_pe.cuda(), gpu, slots.cuda(),
                                    scale=None if scale is None else scale.cuda())
    assert torch.equal(gpu.cpu().view(torch.uint8), cpu.view(torch.uint8))


@pytest.mark.skipif(not HAS_CUDA_OPS, reason="needs a GPU and the CUDA kernels")
@pytest.mark.parametrize("what, message", [
    ("float32", "mla_attention on CUDA takes float16 and bfloat16"),
    ("fp8", "fp8 latent caches are not on CUDA yet"),
    ("rank", r"kv_lora_rank \+ rope_dim = 64 \+ 16 has no kernel \(instantiated: 512 \+ 64, 128 \+ 32\)"),
    ("block size", "block_size 24 is not supported"),
])
def test_cuda_mla_attention_says_what_it_does_not_serve(what, message):
    dtype = torch.float32 if what == "float32" else torch.bfloat16
    rank, rope = (64, 16) if what == "rank" else (128, 32)
    case = mla_case([20, 9], 4, rank, rope, 24 if what == "block size" else 8, dtype,
                    cache_dtype=E4M3 if what == "fp8" else None, seed=15)
    query, kv_cache, block_tables, seq_lens, _ = to_cuda(case)
    k_scale = torch.ones(1, device="cuda") if what == "fp8" else None
    with pytest.raises(RuntimeError, match=message):
        paged_attn.mla_attention(query, kv_cache, block_tables, seq_lens, kv_lora_rank=rank, scale=0.1,
                                 k_scale=k_scale)
