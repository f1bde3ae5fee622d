"""fp8 KV caches (float8_e4m3fn, float8_e5m2): reshape_and_cache stores the bytes paged_attn.reference.quantize_fp8
gives, paged_attention on fp8 caches equals the reference on the dequantized caches (float64), copy_blocks and
swap_blocks copy the bytes, and bad scales or dtypes raise clear errors.

Stored bytes are compared exactly; a one-ulp difference is allowed only where x / scale lies exactly halfway between
two fp8 values (a rounding boundary), and such cases are counted and bounded. NaN compares equal to NaN whatever its
sign bit. Unused cache memory holds the NaN byte 0x7F (a NaN in both formats) and must come back NaN or untouched.
Attention tolerances are the query dtype's, as in test_attention.py: the kernels read the fp8 values exactly.
"""

import math

import pytest
import torch
from conftest import DEVICES
from test_attention import make_case, tolerance
from test_varlen_attention import MIXED, make_varlen_case
from torch._subclasses.fake_tensor import FakeTensorMode

import paged_attn
from paged_attn import reference

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
QUERY_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NAN_BYTE = 0x7F


def poisoned(shape, dtype, device="cpu"):
    """An fp8 tensor of NaN bytes."""
    return torch.full(shape, NAN_BYTE, dtype=torch.uint8, device=device).view(dtype)


def same_bytes(actual, expected):
    """Where two fp8 tensors hold the same value: equal bytes, or both NaN (the sign of a NaN is free)."""
    a, e = actual.view(torch.uint8).cpu(), expected.view(torch.uint8).cpu()
    both_nan = actual.cpu().float().isnan() & expected.cpu().float().isnan()
    return (a == e) | both_nan


def assert_quantized(actual, x, scale, dtype):
    """actual (fp8) is reference.quantize_fp8(x, dtype, scale) but where x / scale lies exactly halfway between two
    neighbouring fp8 values: there either neighbour is accepted. Returns how many such ties differed."""
    expected = reference.quantize_fp8(x.cpu(), dtype, None if scale is None else scale.cpu())
    match = same_bytes(actual, expected)
    if match.all():
        return 0
    quotient = x.cpu().double() if scale is None else (x.cpu().float() / scale.cpu().float()).double()
    a, e = actual.cpu().double(), expected.double()
    tie = (a - e).abs() > 0
    tie &= ((a + e) / 2 == quotient)  # x / scale exactly halfway between the two
    tie &= (actual.view(torch.uint8).cpu().int() - expected.view(torch.uint8).int()).abs() == 1  # neighbours
    bad = ~match & ~tie
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} stored values differ from quantize_fp8: first at "
                           f"x / scale = {quotient[bad][:4].tolist()}: stored {a[bad][:4].tolist()}, "
                           f"expected {e[bad][:4].tolist()}")
    return int((~match).sum())


# ----------------------------------------------------------------------------------------------------------------
# The reference itself, against values worked out by hand


@pytest.mark.parametrize("dtype,cases", [
    (torch.float8_e4m3fn, [
        (448.0, 0x7E), (464.0, 0x7E), (1e6, 0x7E), (-1e6, 0xFE), (math.inf, 0x7E), (-math.inf, 0xFE),  # saturate
        (0.0, 0x00), (-0.0, 0x80), (2**-9, 0x01), (2**-10, 0x00), (1.5 * 2**-9, 0x02), (0.75 * 2**-9, 0x01),
        (2**-6, 0x08), (7 * 2**-9, 0x07), (1.0, 0x38), (1 + 1 / 16, 0x38), (1 + 3 / 16, 0x3A), (-1 - 3 / 16, 0xBA),
        (1 + 1 / 16 + 2**-20, 0x39), (416.0, 0x7D), (432.0, 0x7E),
    ]),
    (torch.float8_e5m2, [
        (57344.0, 0x7B), (61440.0, 0x7B), (1e9, 0x7B), (-1e9, 0xFB), (math.inf, 0x7B),
        (0.0, 0x00), (-0.0, 0x80), (2**-16, 0x01), (2**-17, 0x00), (1.5 * 2**-16, 0x02), (2**-14, 0x04),
        (1.0, 0x3C), (1.125, 0x3C), (1.375, 0x3E), (-1.375, 0xBE), (1.125 + 2**-20, 0x3D),
    ]),
])
def test_reference_quantize_by_hand(dtype, cases):
    x = torch.tensor([v for v, _ in cases], dtype=torch.float32)
    stored = reference.quantize_fp8(x, dtype).view(torch.uint8).tolist()
    assert stored == [b for _, b in cases], [hex(b) for b in stored]
    nan = reference.quantize_fp8(torch.tensor([math.nan, -math.nan]), dtype)
    assert nan.float().isnan().all()
    scale = torch.tensor([0.25])
    assert reference.dequantize_fp8(reference.quantize_fp8(torch.tensor([0.75]), dtype, scale), scale).item() == 0.75


# ----------------------------------------------------------------------------------------------------------------
# reshape_and_cache


SPECIALS = [0.0, -0.0, math.nan, math.inf, -math.inf, 1 + 1 / 16, 1.125, 2**-10, 1.5 * 2**-9, 1e5, -1e5]


def spread_values(shape, dtype, device):
    """Random values over many binades (subnormals to saturation at the scales used)."""
    x = torch.randn(shape) * torch.pow(10.0, torch.empty(shape).uniform_(-4, 3.5))
    return x.to(dtype).to(device)


def plant_specials(key, value):
    """Special values into the first rows of key and value ([num_tokens, num_kv_heads, head_dim] views), in place:
    +-0, NaN, +-inf, exact ties of both formats (unscaled), values past saturation."""
    specials = torch.tensor(SPECIALS)
    key[0, 0, :len(specials)] = specials.to(key.dtype)
    value[0, -1, :len(specials)] = (-specials).to(value.dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", QUERY_DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "packed"])
def test_reshape_and_cache_stores_quantized_bytes(device, cache_dtype, dtype, layout):
    num_blocks, block_size, num_kv_heads, head_dim = 6, 16, 2, 64
    if layout == "contiguous":
        key_cache = poisoned((num_blocks, block_size, num_kv_heads, head_dim), cache_dtype, device)
        value_cache = poisoned((num_blocks, block_size, num_kv_heads, head_dim), cache_dtype, device)
        key = spread_values((40, num_kv_heads, head_dim), dtype, device)
        value = spread_values((40, num_kv_heads, head_dim), dtype, device)
    else:  # vLLM's packed K|V cache, keys and values slices of a fused QKV tensor
        alloc = poisoned((num_blocks, block_size, num_kv_heads, 2 * head_dim), cache_dtype, device)
        key_cache, value_cache = alloc[..., :head_dim], alloc[..., head_dim:]
        qkv = spread_values((40, 3 * num_kv_heads, head_dim), dtype, device)
        key, value = qkv[:, num_kv_heads:2 * num_kv_heads], qkv[:, 2 * num_kv_heads:]
    plant_specials(key, value)
    slots = torch.randperm(num_blocks * block_size)[:40]
    slots[7::7] = -1  # padding (token 0, with the special values, is written)
    slots = slots.to(device)
    k_scale = torch.tensor([0.37], device=device)
    v_scale = torch.tensor([2.5], device=device)
    paged_attn.reshape_and_cache(key, value, key_cache, value_cache, slots, k_scale=k_scale, v_scale=v_scale)

    keep = slots.cpu() >= 0
    blocks, offsets = slots.cpu()[keep] // block_size, slots.cpu()[keep] % block_size
    ties = assert_quantized(key_cache.cpu()[blocks, offsets], key.cpu()[keep], k_scale, cache_dtype)
    ties += assert_quantized(value_cache.cpu()[blocks, offsets], value.cpu()[keep], v_scale, cache_dtype)
    assert ties <= 4, f"{ties} ties rounded the other way"
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots.cpu()[keep]] = True
    for cache in (key_cache, value_cache):
        rest = cache.cpu().reshape(num_blocks * block_size, -1)[~written]
        assert (rest.view(torch.uint8) == NAN_BYTE).all(), "a slot that was not written changed"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", FP8)
def test_reshape_and_cache_default_scale_and_boundaries(device, cache_dtype):
    """Without scales (1.0): every rounding boundary between two fp8 values, just below, on and just above it,
    and the saturation edge; each value written once as a key and once, negated, as a value."""
    all_bytes = torch.arange(256, dtype=torch.uint8).view(cache_dtype).float()
    finite = all_bytes[all_bytes.isfinite() & (all_bytes >= 0)].unique().sort().values.double()
    mids = (finite[1:] + finite[:-1]) / 2
    x = torch.cat([mids, torch.nextafter(mids.float(), torch.tensor(0.0)).double(),
                   torch.nextafter(mids.float(), torch.tensor(1e9)).double(), finite]).float()
    x = torch.cat([x, torch.tensor([finite[-1] * 1.1, finite[-1] * 2, torch.finfo(torch.float32).max, math.nan])])
    x = x.float()
    head_dim = 16
    x = torch.cat([x, torch.ones((-len(x)) % head_dim)]).reshape(-1, 1, head_dim)
    num_tokens = len(x)
    block_size = 16
    num_blocks = (num_tokens + block_size - 1) // block_size
    key_cache = poisoned((num_blocks, block_size, 1, head_dim), cache_dtype, device)
    value_cache = poisoned((num_blocks, block_size, 1, head_dim), cache_dtype, device)
    paged_attn.reshape_and_cache(x.to(device), (-x).to(device), key_cache, value_cache,
                                 torch.arange(num_tokens, device=device))
    ties = assert_quantized(key_cache.reshape(-1, 1, head_dim)[:num_tokens], x, None, cache_dtype)
    ties += assert_quantized(value_cache.reshape(-1, 1, head_dim)[:num_tokens], -x, None, cache_dtype)
    assert ties <= len(mids) // 20, f"{ties} ties rounded the other way"


# ----------------------------------------------------------------------------------------------------------------
# paged_attention


def to_fp8(caches, dtype, scales):
    """fp8 copies of caches, laid out exactly like them (same strides and storage offsets, sharing one storage where
    they share one), quantized with their scales; every other byte of the storage is the NaN byte. NaN-poisoned
    slots of the originals stay NaN."""
    storages, out = {}, []
    for cache, scale in zip(caches, scales):
        key = cache.untyped_storage().data_ptr()
        if key not in storages:
            n = cache.untyped_storage().nbytes() // cache.element_size()
            storages[key] = poisoned((n,), dtype, cache.device)
        view = storages[key].as_strided(cache.shape, cache.stride(), cache.storage_offset())
        view.copy_(reference.quantize_fp8(cache, dtype, scale))
        out.append(view)
    return out


def check_fp8(query, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale, **kwargs):
    actual = paged_attn.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, k_scale=k_scale,
                                        v_scale=v_scale, **kwargs)
    keys = reference.dequantize_fp8(key_cache, k_scale, torch.float64)
    values = reference.dequantize_fp8(value_cache, v_scale, torch.float64)
    expected = reference.paged_attention(query, keys, values, block_tables, seq_lens, compute_dtype=torch.float64,
                                         **kwargs).to(query.dtype)
    assert actual.dtype == query.dtype and actual.shape == query.shape
    assert not actual.isnan().any(), "NaN in the output: an unused (poisoned) slot leaked in"
    torch.testing.assert_close(actual, expected, **tolerance(query.dtype))
    return actual


def scales(device):
    return torch.tensor([0.05], device=device), torch.tensor([0.2], device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", QUERY_DTYPES)
@pytest.mark.parametrize("seq_lens,head_dim", [([5, 33, 100, 17, 1, 64], 128), ([700], 128), ([40, 300, 9], 80)],
                         ids=["single pass", "split", "head_dim 80"])
def test_decode(device, cache_dtype, dtype, seq_lens, head_dim):
    query, key_cache, value_cache, block_tables, lens = make_case(seq_lens, 8, 2, head_dim, 16, torch.float32,
                                                                  device)
    k_scale, v_scale = scales(device)
    key_cache, value_cache = to_fp8((key_cache, value_cache), cache_dtype, (k_scale, v_scale))
    check_fp8(query.to(dtype), key_cache, value_cache, block_tables, lens, k_scale, v_scale)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("features", [
    {"alibi": True}, {"sliding_window": 20}, {"logits_soft_cap": 5.0},
    {"alibi": True, "sliding_window": 40, "logits_soft_cap": 30.0, "scale": 0.2}])
def test_decode_features(device, cache_dtype, features):
    query, key_cache, value_cache, block_tables, lens = make_case([5, 600, 100, 17], 8, 4, 64, 16, torch.float32,
                                                                  device, layout="strided")
    k_scale, v_scale = scales(device)
    key_cache, value_cache = to_fp8((key_cache, value_cache), cache_dtype, (k_scale, v_scale))
    kwargs = dict(features)
    if kwargs.pop("alibi", False):
        kwargs["alibi_slopes"] = torch.rand(8, device=device) * 0.5
    check_fp8(query.bfloat16(), key_cache, value_cache, block_tables, lens, k_scale, v_scale, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype,layout,features", [
    (torch.bfloat16, "contiguous", {}),
    (torch.float16, "packed", {}),
    (torch.float32, "halves", {}),
    (torch.bfloat16, "packed", {"alibi": True, "sliding_window": 20, "logits_soft_cap": 30.0}),
])
def test_varlen(device, cache_dtype, dtype, layout, features):
    query, key_cache, value_cache, block_tables, lens, starts = make_varlen_case(MIXED, 8, 2, 64, 16, torch.float32,
                                                                                 device, layout)
    k_scale, v_scale = scales(device)
    key_cache, value_cache = to_fp8((key_cache, value_cache), cache_dtype, (k_scale, v_scale))
    kwargs = dict(features)
    if kwargs.pop("alibi", False):
        kwargs["alibi_slopes"] = torch.rand(8, device=device) * 0.5
    check_fp8(query.to(dtype), key_cache, value_cache, block_tables, lens, k_scale, v_scale, query_start_loc=starts,
              **kwargs)


@pytest.mark.parametrize("device", DEVICES)
def test_scales_matter(device):
    """The same bytes read with other scales: the logits scale with k_scale and the output with v_scale."""
    query, key_cache, value_cache, block_tables, lens = make_case([50, 20], 4, 2, 64, 16, torch.float32, device)
    k_scale, v_scale = scales(device)
    key_cache, value_cache = to_fp8((key_cache, value_cache), torch.float8_e4m3fn, (k_scale, v_scale))
    base = check_fp8(query.bfloat16(), key_cache, value_cache, block_tables, lens, k_scale, v_scale)
    doubled_v = check_fp8(query.bfloat16(), key_cache, value_cache, block_tables, lens, k_scale, 2 * v_scale)
    torch.testing.assert_close(doubled_v, 2 * base)
    check_fp8(query.bfloat16(), key_cache, value_cache, block_tables, lens, 3 * k_scale, v_scale)
    default = paged_attn.paged_attention(query, key_cache, value_cache, block_tables, lens)
    expected = reference.paged_attention(query, key_cache.double(), value_cache.double(), block_tables, lens,
                                         compute_dtype=torch.float64).float()
    torch.testing.assert_close(default, expected, **tolerance(torch.float32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", FP8)
def test_write_then_attend(device, cache_dtype):
    """reshape_and_cache into fp8 caches, then decode over them: the reference quantizes and attends the same way."""
    num_blocks, block_size, num_kv_heads, head_dim, seq_len = 8, 16, 2, 64, 70
    key = torch.randn(seq_len, num_kv_heads, head_dim, dtype=torch.bfloat16, device=device)
    value = torch.randn_like(key)
    query = torch.randn(1, 8, head_dim, dtype=torch.bfloat16, device=device)
    k_scale, v_scale = scales(device)
    key_cache = poisoned((num_blocks, block_size, num_kv_heads, head_dim), cache_dtype, device)
    value_cache = poisoned((num_blocks, block_size, num_kv_heads, head_dim), cache_dtype, device)
    table = [6, 1, 3, 0, 7]
    slots = torch.tensor([table[t // block_size] * block_size + t % block_size for t in range(seq_len)],
                         device=device)
    paged_attn.reshape_and_cache(key, value, key_cache, value_cache, slots, k_scale=k_scale, v_scale=v_scale)
    block_tables = torch.tensor([table + [-1]], dtype=torch.int32, device=device)
    lens = torch.tensor([seq_len], dtype=torch.int32, device=device)
    out = paged_attn.paged_attention(query, key_cache, value_cache, block_tables, lens, k_scale=k_scale,
                                     v_scale=v_scale)
    keys = reference.dequantize_fp8(reference.quantize_fp8(key, cache_dtype, k_scale), k_scale, torch.float64)
    values = reference.dequantize_fp8(reference.quantize_fp8(value, cache_dtype, v_scale), v_scale, torch.float64)
    dense = torch.softmax(torch.einsum("hd,thd->ht", query[0].double(), keys.repeat_interleave(4, 1))
                          * head_dim**-0.5, dim=-1)
    expected = torch.einsum("ht,thd->hd", dense, values.repeat_interleave(4, 1))
    torch.testing.assert_close(out[0].double(), expected, **tolerance(torch.bfloat16))


# ----------------------------------------------------------------------------------------------------------------
# copy_blocks, swap_blocks: bytes


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", FP8)
def test_copy_and_swap_blocks_copy_bytes(device, cache_dtype):
    shape = (6, 16, 2, 64)
    caches = [torch.randint(0, 256, shape, dtype=torch.uint8, device=device).view(cache_dtype) for _ in range(4)]
    expected = [c.view(torch.uint8).clone() for c in caches]
    mapping = torch.tensor([[0, 3], [5, 1]])
    paged_attn.copy_blocks(caches[:2], caches[2:], mapping)
    reference.copy_blocks(expected[:2], expected[2:], mapping)
    for actual, want in zip(caches, expected):
        assert torch.equal(actual.view(torch.uint8), want)
    dst = poisoned((4,) + shape[1:], cache_dtype)
    paged_attn.swap_blocks(caches[0], dst, torch.tensor([[2, 0], [4, 3]]))
    assert torch.equal(dst[0].view(torch.uint8), caches[0][2].view(torch.uint8).cpu())
    assert torch.equal(dst[3].view(torch.uint8), caches[0][4].view(torch.uint8).cpu())
    assert (dst[1:3].view(torch.uint8) == NAN_BYTE).all()


# ----------------------------------------------------------------------------------------------------------------
# Errors (tests/ops/test_torch_library.py also runs each through the fake kernels)


def fp8_case():
    """A small fp8 case: (key, value, key_cache, value_cache, slot_mapping, query, block_tables, seq_lens)."""
    key, value = torch.randn(3, 2, 32), torch.randn(3, 2, 32)
    key_cache, value_cache = poisoned((4, 8, 2, 32), torch.float8_e4m3fn), poisoned((4, 8, 2, 32), torch.float8_e4m3fn)
    return (key, value, key_cache, value_cache, torch.tensor([0, 9, 17]), torch.randn(2, 4, 32),
            torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([5, 9], dtype=torch.int32))


ONE = torch.tensor([1.0])
# name: (op, lambda of fp8_case()'s tensors returning (args, kwargs), message)
ERRORS = {
    "scale with float cache": ("reshape_and_cache", lambda k, v, kc, vc, s, q, t, l: (
        (k, v, torch.zeros(4, 8, 2, 32), torch.zeros(4, 8, 2, 32), s), {"k_scale": ONE}),
        "k_scale is given but the cache is Float: scales apply only to fp8 caches"),
    "scale dtype": ("reshape_and_cache", lambda k, v, kc, vc, s, q, t, l: (
        (k, v, kc, vc, s), {"v_scale": ONE.double()}), "v_scale must be a float32 tensor of one element"),
    "scale shape": ("reshape_and_cache", lambda k, v, kc, vc, s, q, t, l: (
        (k, v, kc, vc, s), {"k_scale": torch.ones(2)}), "k_scale must be a float32 tensor of one element"),
    "fp8 key": ("reshape_and_cache", lambda k, v, kc, vc, s, q, t, l: (
        (k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn), kc, vc, s), {}),
        r"key must be float32, float16 or bfloat16 with an fp8 cache \(Float8_e4m3fn\), got Float8_e4m3fn"),
    "double key": ("reshape_and_cache", lambda k, v, kc, vc, s, q, t, l: ((k.double(), v.double(), kc, vc, s), {}),
                   "key must be float32, float16 or bfloat16 with an fp8 cache"),
    "mixed fp8 caches": ("reshape_and_cache", lambda k, v, kc, vc, s, q, t, l: (
        (k, v, kc, vc.view(torch.float8_e5m2), s), {}), "key_cache and value_cache must have the same dtype"),
    "attention scale with float cache": ("paged_attention", lambda k, v, kc, vc, s, q, t, l: (
        (q, torch.zeros(4, 8, 2, 32), torch.zeros(4, 8, 2, 32), t, l), {"v_scale": ONE}),
        "v_scale is given but the cache is Float"),
    "attention scale shape": ("paged_attention", lambda k, v, kc, vc, s, q, t, l: (
        (q, kc, vc, t, l), {"k_scale": ONE[:0]}), "k_scale must be a float32 tensor of one element"),
    "fp8 query": ("paged_attention", lambda k, v, kc, vc, s, q, t, l: ((q.to(torch.float8_e5m2), kc, vc, t, l), {}),
                  "query must be float32, float16 or bfloat16 with an fp8 cache"),
    # Scale values (the kernels read them; the fakes cannot, test_bad_scale_values_at_trace_time)
    "zero k_scale": ("reshape_and_cache", lambda k, v, kc, vc, s, q, t, l: (
        (k, v, kc, vc, s), {"k_scale": torch.tensor([0.0])}), "k_scale must be finite and nonzero, got 0:"),
    "attention NaN v_scale": ("paged_attention", lambda k, v, kc, vc, s, q, t, l: (
        (q, kc, vc, t, l), {"v_scale": torch.tensor([math.nan])}), "v_scale must be finite and nonzero, got nan"),
}


def error_call(name):
    op, make, _ = ERRORS[name]
    args, kwargs = make(*fp8_case())
    return getattr(paged_attn, op), args, kwargs


@pytest.mark.parametrize("name", ERRORS)
def test_errors(name):
    fn, args, kwargs = error_call(name)
    caches = [t for t in args if t.dtype in FP8]
    before = [c.view(torch.uint8).clone() for c in caches]
    with pytest.raises(RuntimeError, match=ERRORS[name][2]):
        fn(*args, **kwargs)
    assert all(torch.equal(c.view(torch.uint8), b) for c, b in zip(caches, before)), "a failed call wrote"


BAD_SCALES = [0.0, -0.0, math.nan, math.inf, -math.inf]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", BAD_SCALES, ids=str)
@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
def test_zero_and_non_finite_scales_are_refused(device, bad, which, validation):
    # A scale of 0 stored 0 as NaN and everything else as +-448; inf stored zeros that read back NaN.
    key, value, key_cache, value_cache, slot_mapping, query, block_tables, seq_lens = (
        t.to(device) for t in fp8_case())
    good = torch.tensor([0.5], device=device)
    scales = {"k_scale": good, "v_scale": good, which: torch.tensor([bad], device=device)}
    message = f"{which} must be finite and nonzero, got {bad:g}: an fp8 cache stores x as"
    before = [c.view(torch.uint8).clone() for c in (key_cache, value_cache)]
    with pytest.raises(RuntimeError, match=message):
        paged_attn.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, **scales)
    assert all(torch.equal(c.view(torch.uint8), b) for c, b in zip((key_cache, value_cache), before)), "it wrote"
    key_cache, value_cache = (reference.quantize_fp8(torch.randn(4, 8, 2, 32), torch.float8_e4m3fn).to(device)
                              for _ in "kv")
    out = torch.full_like(query, 7.0)
    with pytest.raises(RuntimeError, match=message):
        paged_attn.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, out=out, **scales)
    assert (out == 7.0).all(), "it wrote"


@pytest.mark.parametrize("bad", BAD_SCALES, ids=str)
def test_bad_scale_values_at_trace_time(bad):
    """A fake kernel cannot read an input's value (the kernel checks it when it runs), but a scale made as a
    constant in the traced code carries its value, and is refused while tracing, with the kernel's message."""
    key, value, key_cache, value_cache, slot_mapping, query, block_tables, seq_lens = fp8_case()
    message = f"k_scale must be finite and nonzero, got {bad:g}: an fp8 cache stores x as"

    def write(key, value, key_cache, value_cache, slot_mapping):
        paged_attn.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale=torch.tensor([bad]))

    def attend(query, key_cache, value_cache, block_tables, seq_lens):
        return paged_attn.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                          k_scale=torch.tensor([bad]))

    for fn, args in ((write, (key, value, key_cache, value_cache, slot_mapping)),
                     (attend, (query, key_cache, value_cache, block_tables, seq_lens))):
        with pytest.raises(RuntimeError, match=message):  # the kernel
            fn(*args)
        with FakeTensorMode() as mode, pytest.raises(RuntimeError, match=message):  # the fake, on fake inputs
            fn(*(mode.from_tensor(t) for t in args))
        torch._dynamo.reset()
        with pytest.raises(torch._dynamo.exc.TorchRuntimeError, match=message):  # torch.compile, while tracing
            torch.compile(fn, fullgraph=True, backend="aot_eager")(*args)
    # An input's value is not known to the fake: the call traces, and the kernel refuses it when it runs.
    k_scale = torch.tensor([bad])
    with FakeTensorMode() as mode:
        paged_attn.reshape_and_cache(*(mode.from_tensor(t) for t in (key, value, key_cache, value_cache, slot_mapping)),
                                     k_scale=mode.from_tensor(k_scale))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    # NOTE: opcheck's test_schema compares tensors with arithmetic torch does not implement for fp8; the fake kernel
    # and AOT dispatch tests run.
    utils = ("test_faketensor", "test_aot_dispatch_dynamic")
    key, value, key_cache, value_cache, slots, query, tables, lens = fp8_case()
    k_scale, v_scale = scales(device)
    to = lambda t: t.to(device)  # noqa: E731
    torch.library.opcheck(torch.ops.paged_attn.reshape_and_cache.default,
                          tuple(map(to, (key, value, key_cache, value_cache, slots))),
                          {"k_scale": k_scale, "v_scale": v_scale}, test_utils=utils)
    paged_attn.reshape_and_cache(*map(to, (key, value)), to(key_cache), to(value_cache), to(slots))
    key_cache = reference.quantize_fp8(torch.randn(4, 8, 2, 32), torch.float8_e4m3fn).to(device)
    value_cache = reference.quantize_fp8(torch.randn(4, 8, 2, 32), torch.float8_e4m3fn).to(device)
    query = to(query).bfloat16()
    torch.library.opcheck(torch.ops.paged_attn.paged_attention.default,
                          (torch.empty_like(query), query, key_cache, value_cache, to(tables), to(lens), 0.2, None, 0,
                           0.0), {"k_scale": k_scale, "v_scale": v_scale}, test_utils=utils)
