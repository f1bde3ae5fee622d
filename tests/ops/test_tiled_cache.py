"""The tiled cache layout (issue 50, paged_attn/tiled_cache.py): pack_cache / unpack_cache, and the CPU ops on a
tiled pair.

- pack_cache places each element where the layout's index formula says, unpack_cache reads it back from there, and
  the round trip is bit-exact (bfloat16 and fp8 bit patterns, NaN payloads included) from row-major caches of any
  strides; bad input is a ValueError.
- The cache ops on a tiled pair leave the bits that pack_cache gives of the same op on row-major caches
  (reshape_and_cache, fp8 with scales too; copy_blocks); swap_blocks copies tiled blocks as it copies any.
- paged_attention on a tiled pair against paged_attn.reference.paged_attention in float64 with
  test_attention.tolerance, for every feature (decode and query_start_loc, GQA, ALiBi, windows, soft cap, sinks,
  lse, fp8 caches with scales, rows sharing blocks), the bfloat16 accuracy contract, batch invariance, on the
  AVX-512 and the portable path.
- Errors: the kernels and the fakes refuse a mixed pair and a broken tiled one alike; opcheck and torch.compile.

Inputs are random (never zeros); every cache slot no sequence owns holds NaN (fp8: the NaN byte) before packing, so
it is NaN in the tiled pair too, and unused block-table entries hold garbage. Tiled caches are made by pack_cache
from the row-major cases of the other op tests (make_case, make_varlen_case, lay_out, lay_out_shared), whose own
values the references read.
"""

import re

import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree
from conftest import HAS_AMX, requires_cuda, run_on_portable_path
from test_attention import NAN, check_bfloat16_is_as_exact_as_float32_math, make_case, tolerance
from test_batch_invariance import (CACHES, FEATURES, HEAD_DIM, HEADS, assert_same_bits, lay_out, make_seqs, op_kwargs,
                                   poisoned)
from test_cache_ops import make_kv, random_block_mapping, random_slots
from test_fake_aliasing import on_meta, without_addresses
from test_fp8 import to_fp8
from test_return_lse import lse_tolerance
from test_shared_blocks import lay_out_shared, make_tree
from test_sinks import make_sinks
from test_torch_library import error_of
from test_varlen_attention import make_varlen_case
from torch._subclasses.fake_tensor import FakeTensorMode

import paged_attn
from paged_attn import _C, reference, tiled_cache

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TILED_DTYPES = [torch.bfloat16, E4M3, E5M2]
# (block_size, num_kv_heads, head_dim): block sizes 16, 32, 64; head dims 32 to 256; 1, 2 and 8 kv heads
SHAPES = [(16, 1, 32), (32, 2, 64), (64, 8, 128), (16, 8, 256), (32, 1, 256), (64, 2, 32)]


def raw(t):
    """t's bits as integers of its element's width (NaN payloads, -0 and fp8 bytes compare as they are)."""
    return t.view(torch.uint8 if t.element_size() == 1 else torch.int16)


def assert_same_bytes(actual, expected, what="tiled caches"):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.equal(raw(actual), raw(expected)), f"{what}: the bits differ"


def random_bits(shape, dtype):
    """Random bit patterns of the dtype: NaNs with payloads, infinities, -0 and subnormals among them."""
    if dtype == torch.bfloat16:
        return torch.randint(-2**15, 2**15, shape, dtype=torch.int16).view(dtype)
    return torch.randint(0, 256, shape, dtype=torch.uint8).view(dtype)


def packed(case):
    """A case (query, key_cache, value_cache, ...) with its caches packed: the same values, tiled."""
    query, key_cache, value_cache, *rest = case
    return (query, *paged_attn.pack_cache(key_cache, value_cache), *rest)


def in_one_allocation(key_tiled, value_tiled, gap=64):
    """The tiled pair moved into one allocation, block by block: [key block | value block | gap of NaN], so both block
    strides are larger than a block and the pair interleaves in one storage without a common byte (as vLLM keeps K
    and V blocks side by side). Returns (key, value, allocation)."""
    num_blocks = key_tiled.shape[0]
    key_numel, value_numel = key_tiled[0].numel(), value_tiled[0].numel()
    alloc = poisoned((num_blocks, key_numel + value_numel + gap), key_tiled.dtype)
    key = alloc[:, :key_numel].unflatten(1, key_tiled.shape[1:])
    value = alloc[:, key_numel:key_numel + value_numel].unflatten(1, value_tiled.shape[1:])
    raw(key).copy_(raw(key_tiled))
    raw(value).copy_(raw(value_tiled))
    return key, value, alloc


def gap_is_poisoned(alloc, gap=64):
    return raw(alloc[:, -gap:]).eq(raw(poisoned((1,), alloc.dtype))).all()


def with_threads(n, fn):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(old)


# ----------------------------------------------------------------------------------------------------------------
# The layout in PyTorch: shapes, the index formula, pack / unpack


def test_tiled_cache_shapes():
    assert paged_attn.tiled_cache_shapes(10, 16, 2, 64) == ((10, 2, 1, 32, 16, 2), (10, 2, 8, 64, 2))
    assert paged_attn.tiled_cache_shapes(0, 64, 8, 256) == ((0, 8, 4, 128, 16, 2), (0, 8, 32, 256, 2))
    assert paged_attn.tiled_cache_shapes(np.int64(3), 32, 1, 32) == ((3, 1, 2, 16, 16, 2), (3, 1, 16, 32, 2))
    for sizes, message in [((4, 8, 2, 64), "block_size that is a multiple of 16, got 8"),
                           ((4, 24, 2, 64), "multiple of 16, got 24"),
                           ((4, 16, 2, 48), "head_dim that is a multiple of 32, got 48"),
                           ((4, 16, 0, 64), "positive block_size, num_kv_heads and head_dim"),
                           ((-1, 16, 2, 64), "num_blocks >= 0"),
                           ((4, 16.0, 2, 64), "integer sizes"),
                           ((4, 16, True, 64), "integer sizes")]:
        with pytest.raises(ValueError, match=message):
            paged_attn.tiled_cache_shapes(*sizes)


@pytest.mark.parametrize("dtype", TILED_DTYPES, ids=str)
def test_pack_and_unpack_place_each_element_by_the_formula(dtype):
    # The formula written out (tiled_cache.py): key (b, o, g, d) at [b, g, o // 16, d // 2, o % 16, d % 2], value at
    # [b, g, o // 2, d, o % 2]. Both directions are checked against it on their own, so that a permutation wrong
    # the same way in pack and unpack (a round trip cannot see it) fails here.
    num_blocks, block_size, num_kv_heads, head_dim = 3, 32, 2, 64
    b, o, g, d = torch.meshgrid(*(torch.arange(n) for n in (num_blocks, block_size, num_kv_heads, head_dim)),
                                indexing="ij")
    key_cache, value_cache = random_bits((num_blocks, block_size, num_kv_heads, head_dim), dtype), random_bits(
        (num_blocks, block_size, num_kv_heads, head_dim), dtype)
    key_tiled, value_tiled = paged_attn.pack_cache(key_cache, value_cache)
    assert torch.equal(raw(key_tiled)[b, g, o // 16, d // 2, o % 16, d % 2], raw(key_cache))
    assert torch.equal(raw(value_tiled)[b, g, o // 2, d, o % 2], raw(value_cache))
    # unpack from tiled tensors that pack did not make
    key_shape, value_shape = paged_attn.tiled_cache_shapes(num_blocks, block_size, num_kv_heads, head_dim)
    key_tiled, value_tiled = random_bits(key_shape, dtype), random_bits(value_shape, dtype)
    key_cache, value_cache = paged_attn.unpack_cache(key_tiled, value_tiled)
    assert torch.equal(raw(key_cache), raw(key_tiled)[b, g, o // 16, d // 2, o % 16, d % 2])
    assert torch.equal(raw(value_cache), raw(value_tiled)[b, g, o // 2, d, o % 2])


@pytest.mark.parametrize("layout", ["contiguous", "head-major", "halves"])
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("dtype", TILED_DTYPES, ids=str)
def test_pack_unpack_round_trip_is_bit_exact(dtype, block_size, num_kv_heads, head_dim, layout):
    num_blocks = 5
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if layout == "contiguous":
        key_cache, value_cache = random_bits(shape, dtype), random_bits(shape, dtype)
    elif layout == "head-major":  # token and head dimensions transposed: [num_blocks, num_kv_heads, block_size, ...]
        key_cache = random_bits((num_blocks, num_kv_heads, block_size, head_dim), dtype).transpose(1, 2)
        value_cache = random_bits((num_blocks, num_kv_heads, block_size, head_dim), dtype).transpose(1, 2)
        assert num_kv_heads == 1 or not key_cache.is_contiguous()
    else:  # the halves of one [num_blocks, 2, ...] allocation
        alloc = random_bits((num_blocks, 2) + shape[1:], dtype)
        key_cache, value_cache = alloc[:, 0], alloc[:, 1]
    key_tiled, value_tiled = paged_attn.pack_cache(key_cache, value_cache)
    key_shape, value_shape = paged_attn.tiled_cache_shapes(*shape)
    assert (key_tiled.shape, value_tiled.shape) == (key_shape, value_shape)
    assert key_tiled.dtype == value_tiled.dtype == dtype
    assert key_tiled.is_contiguous() and value_tiled.is_contiguous()
    tiled_cache.check_tiled_pair(key_tiled, value_tiled)
    key_back, value_back = paged_attn.unpack_cache(key_tiled, value_tiled)
    assert key_back.is_contiguous() and value_back.is_contiguous()
    assert_same_bytes(key_back, key_cache.contiguous(), "keys after pack and unpack")
    assert_same_bytes(value_back, value_cache.contiguous(), "values after pack and unpack")
    # A tiled pair with larger block strides unpacks to the same caches.
    key_spread, value_spread, _ = in_one_allocation(key_tiled, value_tiled)
    assert key_spread.stride(0) > key_spread[0].numel()
    assert_same_bytes(paged_attn.unpack_cache(key_spread, value_spread)[0], key_back, "from one allocation")
    assert_same_bytes(paged_attn.unpack_cache(key_spread, value_spread)[1], value_back, "from one allocation")


def test_pack_makes_new_tensors_and_takes_an_empty_pool():
    key_cache = torch.randn(2, 16, 1, 32).bfloat16()
    value_cache = torch.randn(2, 16, 1, 32).bfloat16()
    key_tiled, value_tiled = paged_attn.pack_cache(key_cache, value_cache)
    for tiled, cache in ((key_tiled, key_cache), (value_tiled, value_cache)):
        assert tiled.untyped_storage().data_ptr() != cache.untyped_storage().data_ptr()
    key_back, _ = paged_attn.unpack_cache(key_tiled, value_tiled)
    assert key_back.untyped_storage().data_ptr() != key_tiled.untyped_storage().data_ptr()
    empty = paged_attn.pack_cache(key_cache[:0], value_cache[:0])
    assert [t.shape for t in empty] == [(0, 1, 1, 16, 16, 2), (0, 1, 8, 32, 2)]
    assert [t.shape for t in paged_attn.unpack_cache(*empty)] == [(0, 16, 1, 32)] * 2


def test_is_tiled_and_the_logical_view():
    key_tiled, value_tiled = paged_attn.pack_cache(torch.randn(3, 32, 2, 64).bfloat16(),
                                                   torch.randn(3, 32, 2, 64).bfloat16())
    assert paged_attn.is_tiled(key_tiled) and paged_attn.is_tiled(value_tiled)
    assert not paged_attn.is_tiled(torch.empty(3, 32, 2, 64)) and not paged_attn.is_tiled(torch.empty(3, 32, 80))
    key_spread, value_spread, _ = in_one_allocation(key_tiled, value_tiled)
    for cache in (key_tiled, value_tiled, key_spread, value_spread):
        view = tiled_cache.logical_view(cache)
        assert view.shape == (3, 32, 2, 64) and view.stride() == (cache.stride(0), 128, 64, 1)
        # exactly the tiled cache's bytes: the same first element, the same last one, one block a contiguous run
        assert view.data_ptr() == cache.data_ptr() and view[0].is_contiguous() and view[0].numel() == cache[0].numel()
        assert view[-1, -1, -1, -1].data_ptr() == cache[-1].flatten()[-1].data_ptr()
    with FakeTensorMode() as mode:  # and on fake and meta tensors
        assert tiled_cache.logical_view(mode.from_tensor(value_spread)).stride() == (value_spread.stride(0), 128, 64, 1)
    assert tiled_cache.logical_view(key_tiled.to("meta")).shape == (3, 32, 2, 64)
    with pytest.raises(ValueError, match="a tiled cache has 6 dims"):
        tiled_cache.logical_view(torch.empty(3, 32, 2, 64))


def broken_tiled_pairs():
    """name: (key_cache, value_cache, the start of check_tiled_pair's message): one broken rule each."""
    key_tiled, value_tiled = paged_attn.pack_cache(torch.randn(4, 16, 2, 64).bfloat16(),
                                                   torch.randn(4, 16, 2, 64).bfloat16())
    rows = torch.randn(4, 16, 2, 64).bfloat16()
    return {
        "tiled key, row-major value": (key_tiled, rows, "key_cache and value_cache must have one layout"),
        "row-major key, tiled value": (rows, value_tiled, "key_cache and value_cache must have one layout"),
        "swapped": (value_tiled, key_tiled, "key_cache and value_cache must have one layout"),
        "float32": (key_tiled.float(), value_tiled.float(), "a tiled cache must be bfloat16, float8_e4m3fn or "
                    "float8_e5m2 .* got torch.float32"),
        "float16": (key_tiled.half(), value_tiled.half(), "a tiled cache must be bfloat16"),
        "mixed dtypes": (key_tiled, value_tiled.to(E4M3), "must have the same dtype, got torch.bfloat16 and"),
        "sizes disagree": (key_tiled, value_tiled[:, :1], "must describe one cache"),
        "tile of 8 tokens": (key_tiled.reshape(4, 2, 2, 32, 8, 2), value_tiled, "must describe one cache"),
        "head_dim 48": (torch.zeros(4, 2, 1, 24, 16, 2).bfloat16(), torch.zeros(4, 2, 8, 48, 2).bfloat16(),
                        "head_dim a multiple of 32"),
        "no kv heads": (key_tiled[:, :0], value_tiled[:, :0], "needs num_kv_heads, block_size and head_dim positive"),
        "key not contiguous in a block": (key_tiled.transpose(3, 4).contiguous().transpose(3, 4), value_tiled,
                                          "key_cache: a tiled cache must be contiguous within each block"),
        "value block stride too small": (key_tiled, value_tiled.as_strided(value_tiled.shape, (
            value_tiled.stride(0) // 2,) + value_tiled.stride()[1:]), "value_cache: the block stride must reach past"),
    }


@pytest.mark.parametrize("name", sorted(broken_tiled_pairs()))
def test_unpack_refuses_what_is_not_a_tiled_pair(name):
    key_cache, value_cache, message = broken_tiled_pairs()[name]
    with pytest.raises(ValueError, match=message):
        paged_attn.unpack_cache(key_cache, value_cache)


def test_pack_refuses_what_it_cannot_tile():
    good = torch.randn(4, 16, 2, 64).bfloat16()
    cases = {
        "float32": ((good.float(), good.float()), "must be bfloat16, float8_e4m3fn or float8_e5m2, got torch.float32"),
        "float16": ((good.half(), good.half()), "got torch.float16"),
        "block_size 8": ((good[:, :8], good[:, :8]), "block_size that is a multiple of 16, got 8"),
        "head_dim 48": ((good[..., :48], good[..., :48]), "head_dim that is a multiple of 32, got 48"),
        "mismatched shapes": ((good, good[:, :, :1]), "must have the same shape, dtype and device"),
        "mismatched dtypes": ((good, good.to(E5M2)), "must have the same shape, dtype and device"),
        "already tiled": (paged_attn.pack_cache(good, good), "pack_cache takes row-major caches"),
        "3 dims": ((good[0], good[0]), "pack_cache takes row-major caches"),
    }
    for name, (args, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            paged_attn.pack_cache(*args)


# ----------------------------------------------------------------------------------------------------------------
# The references on a tiled pair: the same results as on the row-major caches they pack


def test_the_references_take_a_tiled_pair():
    query, key_cache, value_cache, block_tables, seq_lens = make_case([1, 17, 40, 0], 8, 2, 64, 16, torch.bfloat16,
                                                                      "cpu", repeat_blocks=True)
    key_tiled, value_tiled = paged_attn.pack_cache(key_cache, value_cache)
    for kwargs in ({}, {"sliding_window": 9, "alibi_slopes": torch.rand(8), "return_lse": True}):
        expected = reference.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, **kwargs)
        actual = reference.paged_attention(query, key_tiled, value_tiled, block_tables, seq_lens, **kwargs)
        for a, e in zip(pytree.tree_leaves(actual), pytree.tree_leaves(expected)):
            assert torch.equal(a, e)
    key, value = make_kv(9, 2, 64, torch.bfloat16, "cpu", "strided")
    slots = random_slots(9, key_cache.shape[0], 16, "cpu")
    reference.reshape_and_cache(key, value, key_cache, value_cache, slots)
    key_spread, value_spread, alloc = in_one_allocation(key_tiled, value_tiled)
    reference.reshape_and_cache(key, value, key_spread, value_spread, slots)
    for actual, expected in zip((key_spread, value_spread), paged_attn.pack_cache(key_cache, value_cache)):
        assert_same_bytes(actual, expected, "reference.reshape_and_cache")
    assert gap_is_poisoned(alloc), "written between the blocks"
    mapping = random_block_mapping(key_cache.shape[0], 3)
    reference.copy_blocks([key_cache], [value_cache], mapping)
    reference.copy_blocks([key_spread], [value_spread], mapping)
    for actual, expected in zip((key_spread, value_spread), paged_attn.pack_cache(key_cache, value_cache)):
        assert_same_bytes(actual, expected, "reference.copy_blocks")
    with pytest.raises(ValueError, match="must have one layout"):
        reference.paged_attention(query, key_tiled, value_cache, block_tables, seq_lens)


# ----------------------------------------------------------------------------------------------------------------
# The cache ops on a tiled pair (the C++ kernels)


@pytest.mark.parametrize("layout", ["contiguous", "one allocation"])
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(16, 2, 64), (32, 1, 128), (64, 8, 32)])
@pytest.mark.parametrize("cache_dtype,key_dtype", [(torch.bfloat16, torch.bfloat16), (E4M3, torch.float32),
                                                   (E4M3, torch.bfloat16), (E5M2, torch.float16),
                                                   (E5M2, torch.bfloat16)], ids=str)
def test_reshape_and_cache_writes_the_packed_row_major_bits(cache_dtype, key_dtype, block_size, num_kv_heads,
                                                            head_dim, layout):
    num_blocks, num_tokens = 7, 40
    key, value = make_kv(num_tokens, num_kv_heads, head_dim, key_dtype, "cpu", "strided")  # slices of a fused QKV
    key_cache = poisoned((num_blocks, block_size, num_kv_heads, head_dim), cache_dtype)
    value_cache = poisoned((num_blocks, block_size, num_kv_heads, head_dim), cache_dtype)
    key_tiled, value_tiled = paged_attn.pack_cache(key_cache, value_cache)
    if layout == "one allocation":
        key_tiled, value_tiled, alloc = in_one_allocation(key_tiled, value_tiled)
    slots = random_slots(num_tokens, num_blocks, block_size, "cpu")  # random order, 3 padding tokens (-1)
    scales = {"k_scale": torch.tensor([0.37]), "v_scale": torch.tensor([2.5])} if cache_dtype in (E4M3, E5M2) else {}
    paged_attn.reshape_and_cache(key, value, key_cache, value_cache, slots, **scales)
    paged_attn.reshape_and_cache(key, value, key_tiled, value_tiled, slots, **scales)
    for actual, expected in zip((key_tiled, value_tiled), paged_attn.pack_cache(key_cache, value_cache)):
        assert_same_bytes(actual, expected, "reshape_and_cache into tiled caches vs row-major ones, packed")
    # Explicitly: the slots no token maps to are still NaN, token i's row is in slot slots[i].
    key_back, value_back = paged_attn.unpack_cache(key_tiled, value_tiled)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    written = written.view(num_blocks, block_size)
    for cache, source, scale in ((key_back, key, scales.get("k_scale")), (value_back, value, scales.get("v_scale"))):
        assert cache[~written].float().isnan().all(), "a slot that no token maps to was written"
        assert not cache[written].float().isnan().any()
        i = int((slots >= 0).nonzero()[0])
        stored = cache[int(slots[i]) // block_size, int(slots[i]) % block_size].float()
        want = source[i] if cache_dtype == torch.bfloat16 else reference.quantize_fp8(source[i], cache_dtype, scale)
        assert torch.equal(stored, want.float())
    if layout == "one allocation":
        assert gap_is_poisoned(alloc), "written between the blocks"


@pytest.mark.parametrize("layout", ["contiguous", "one allocation"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, E4M3], ids=str)
def test_copy_blocks_copies_tiled_blocks(dtype, layout):
    num_blocks, block_size, num_kv_heads, head_dim = 12, 32, 2, 64
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    row_major, tiled, allocs = [], [], []
    for _ in range(2):  # layers
        key_cache, value_cache = poisoned(shape, dtype), poisoned(shape, dtype)
        for cache in (key_cache, value_cache):  # random data in the even blocks; the odd blocks stay NaN
            cache[::2] = torch.randn(cache[::2].shape).to(dtype)
        row_major.append((key_cache, value_cache))
        key_tiled, value_tiled = paged_attn.pack_cache(key_cache, value_cache)
        if layout == "one allocation":
            key_tiled, value_tiled, alloc = in_one_allocation(key_tiled, value_tiled)
            allocs.append(alloc)
        tiled.append((key_tiled, value_tiled))
    mapping = random_block_mapping(num_blocks, 4)
    paged_attn.copy_blocks([k for k, _ in row_major], [v for _, v in row_major], mapping)
    paged_attn.copy_blocks([k for k, _ in tiled], [v for _, v in tiled], mapping)
    for (key_tiled, value_tiled), (key_cache, value_cache) in zip(tiled, row_major):
        for actual, expected in zip((key_tiled, value_tiled), paged_attn.pack_cache(key_cache, value_cache)):
            assert_same_bytes(actual, expected, "copy_blocks on tiled caches vs row-major ones, packed")
        for src, dst in mapping.tolist():
            assert_same_bytes(key_tiled[dst], key_tiled[src], "a copied block")
    assert all(gap_is_poisoned(alloc) for alloc in allocs), "written between the blocks"


@pytest.mark.parametrize("dtype", TILED_DTYPES, ids=str)
def test_swap_blocks_copies_tiled_blocks(dtype):
    block_size, num_kv_heads, head_dim = 32, 2, 64
    key_src, value_src = paged_attn.pack_cache(random_bits((9, block_size, num_kv_heads, head_dim), dtype),
                                               random_bits((9, block_size, num_kv_heads, head_dim), dtype))
    key_src, value_src, _ = in_one_allocation(key_src, value_src)  # src with a larger block stride than dst's
    key_dst, value_dst = paged_attn.pack_cache(poisoned((6, block_size, num_kv_heads, head_dim), dtype),
                                               poisoned((6, block_size, num_kv_heads, head_dim), dtype))
    mapping = torch.tensor([[3, 0], [4, 1], [8, 5], [0, 3]])[torch.randperm(4)]
    for src, dst in ((key_src, key_dst), (value_src, value_dst)):
        expected = raw(dst).clone()
        reference.swap_blocks(raw(src), expected, mapping)
        paged_attn.swap_blocks(src, dst, mapping)
        assert torch.equal(raw(dst), expected)
        assert raw(dst[2]).eq(raw(poisoned((1,), dtype))).all() and raw(dst[4]).eq(raw(poisoned((1,), dtype))).all()
    key_back, value_back = paged_attn.unpack_cache(key_dst, value_dst)  # still a tiled pair
    assert_same_bytes(key_back[0], paged_attn.unpack_cache(key_src, value_src)[0][3], "block 3 swapped to 0")


# ----------------------------------------------------------------------------------------------------------------
# paged_attention on a tiled pair

LENGTHS = [0, 1, 15, 16, 17, 100, 600, 1100]  # 600, 1100: two and three 512-token partitions
# (seq_len, query_len): nothing to do, one-token prompt, a whole prompt (prefill kernel), a decode, a 3-token chunk
# (decode-kernel rows), a prompt of 100, a 40-token chunk after a cached prefix, a decode at 1100.
VARLEN = [(0, 0), (1, 1), (15, 15), (16, 1), (17, 3), (100, 100), (600, 40), (1100, 1)]
# name: how the case differs from a bfloat16 decode of 8 query heads over 2 kv heads, head_dim 128, block_size 16.
ATTENTION = {
    "bf16": {},
    "block_size 32, head_dim 64": {"block_size": 32, "head_dim": 64},
    "group 1": {"heads": (4, 4), "head_dim": 64},
    "group 2": {"heads": (4, 2), "head_dim": 64},
    "group 5": {"heads": (10, 2), "head_dim": 64},
    "group 8": {"heads": (16, 2), "head_dim": 64},
    "alibi": {"alibi": True},
    "window 7": {"sliding_window": 7},
    "window 100": {"sliding_window": 100},  # starts at 1000 for the 1100-token row: not a multiple of 16
    "window 700": {"sliding_window": 700, "block_size": 32},  # starts inside a partition
    "soft cap": {"logits_soft_cap": 2.0, "scale": 1.0},  # a large scale makes the cap bite
    "sinks and lse": {"sinks": True, "return_lse": True},
    "everything": {"alibi": True, "sliding_window": 300, "logits_soft_cap": 30.0, "scale": 0.1, "sinks": True,
                   "return_lse": True, "heads": (10, 2)},
    "one allocation": {"one_allocation": True, "heads": (8, 1)},
    "e4m3, bf16 query": {"cache": E4M3},
    "e4m3, f32 query, everything": {"cache": E4M3, "query": torch.float32, "alibi": True, "sliding_window": 100,
                                    "logits_soft_cap": 30.0, "sinks": True, "return_lse": True},
    "e5m2, f16 query": {"cache": E5M2, "query": torch.float16, "block_size": 32},
    "e5m2, bf16 query, window": {"cache": E5M2, "sliding_window": 7, "heads": (16, 2), "head_dim": 64},
    "varlen": {"varlen": True},
    "varlen, everything": {"varlen": True, "alibi": True, "sliding_window": 50, "logits_soft_cap": 30.0,
                           "sinks": True, "return_lse": True, "heads": (10, 2), "block_size": 32},
    "varlen, e4m3": {"varlen": True, "cache": E4M3, "head_dim": 64},
    "varlen, e5m2, f32 query, window": {"varlen": True, "cache": E5M2, "query": torch.float32, "sliding_window": 20},
}


def attention_case(name, seed=0):
    """The row-major case (query, key_cache, value_cache, block_tables, seq_lens), the op's keyword arguments, and
    whether the tiled pair goes into one allocation."""
    spec = ATTENTION[name]
    num_heads, num_kv_heads = spec.get("heads", (8, 2))
    head_dim, block_size = spec.get("head_dim", 128), spec.get("block_size", 16)
    cache_dtype = spec.get("cache", torch.bfloat16)
    make_dtype = torch.bfloat16 if cache_dtype == torch.bfloat16 else torch.float32
    torch.manual_seed(seed)
    kwargs = {k: spec[k] for k in ("sliding_window", "logits_soft_cap", "scale", "return_lse") if k in spec}
    if spec.get("varlen"):
        *case, kwargs["query_start_loc"] = make_varlen_case(VARLEN, num_heads, num_kv_heads, head_dim, block_size,
                                                            make_dtype, "cpu")
    else:  # repeat_blocks: rows share a block, a row holds one block twice
        case = list(make_case(LENGTHS, num_heads, num_kv_heads, head_dim, block_size, make_dtype, "cpu",
                              repeat_blocks=True))
    if cache_dtype != torch.bfloat16:
        kwargs.update(k_scale=torch.tensor([0.05]), v_scale=torch.tensor([0.2]))
        case[1:3] = to_fp8(case[1:3], cache_dtype, (kwargs["k_scale"], kwargs["v_scale"]))
    case[0] = case[0].to(spec.get("query", torch.bfloat16))
    if spec.get("alibi"):
        kwargs["alibi_slopes"] = torch.rand(num_heads) * 0.2
    if spec.get("sinks"):
        kwargs["sinks"] = make_sinks(num_heads, seed)
    return tuple(case), kwargs, spec.get("one_allocation", False)


def check_attention(name):
    case, kwargs, one_allocation = attention_case(name)
    query, key_cache, value_cache, block_tables, seq_lens = case
    key_tiled, value_tiled = paged_attn.pack_cache(key_cache, value_cache)
    if one_allocation:
        key_tiled, value_tiled, _ = in_one_allocation(key_tiled, value_tiled)
    actual = paged_attn.paged_attention(query, key_tiled, value_tiled, block_tables, seq_lens, **kwargs)
    expected = reference.paged_attention(*case, compute_dtype=torch.float64, **kwargs)
    if kwargs.get("return_lse"):
        (actual, lse), (expected, expected_lse) = actual, expected
        assert lse.dtype == torch.float32 and lse.shape == query.shape[:2]
        torch.testing.assert_close(lse.double(), expected_lse, **lse_tolerance(query.dtype))
    assert actual.dtype == query.dtype and actual.shape == query.shape
    assert not actual.isnan().any(), "NaN in the output: an unused (poisoned) slot leaked in"
    torch.testing.assert_close(actual, expected.to(query.dtype), **tolerance(query.dtype))


@pytest.mark.parametrize("name", ATTENTION)
def test_paged_attention_on_a_tiled_pair_matches_the_reference(name):
    check_attention(name)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, E4M3], ids=str)
def test_tokens_before_the_window_are_never_read(cache_dtype):
    """A window that starts at an odd lane of its tile (and at lane 0 and mid-tile): the tokens before it share the
    window's first tile and token pair in the tiled layout, and hold NaN and inf here; the output must be the
    reference's on the clean cache, so no such token is multiplied, not even by a weight of 0."""
    lengths, window = [100, 1100, 64, 37], 37  # windows start at 63 (lane 15), 1063 (lane 7), 27 (lane 11), 0
    torch.manual_seed(3)
    query, key_cache, value_cache, block_tables, seq_lens = make_case(lengths, 8, 2, 64, 16, torch.bfloat16, "cpu")
    scales = {}
    if cache_dtype != torch.bfloat16:
        scales = {"k_scale": torch.tensor([0.05]), "v_scale": torch.tensor([0.2])}
        key_cache, value_cache = to_fp8((key_cache, value_cache), cache_dtype, (scales["k_scale"], scales["v_scale"]))
    expected = reference.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, sliding_window=window,
                                         compute_dtype=torch.float64, **scales)
    dirty_key, dirty_value = key_cache.clone(), value_cache.clone()
    bad = [float("nan"), float("inf") if cache_dtype == torch.bfloat16 else float("nan")]
    for s, length in enumerate(lengths):
        for t in range(max(0, length - window)):  # every token before the window (make_case: no block shared here)
            block, offset = block_tables[s, t // 16].item(), t % 16
            dirty_key[block, offset] = bad[t % 2]
            dirty_value[block, offset] = bad[(t + 1) % 2]
    actual = paged_attn.paged_attention(query, *paged_attn.pack_cache(dirty_key, dirty_value), block_tables, seq_lens,
                                        sliding_window=window, **scales)
    assert not actual.isnan().any() and not actual.isinf().any(), "a token before the window was multiplied"
    torch.testing.assert_close(actual, expected.to(query.dtype), **tolerance(query.dtype))


def test_paged_attention_on_a_tiled_pair_with_out():
    case, _, _ = attention_case("bf16")
    out = torch.full_like(case[0], NAN)
    assert paged_attn.paged_attention(*packed(case), out=out) is out
    torch.testing.assert_close(out, reference.paged_attention(*case), **tolerance(torch.bfloat16))


@pytest.mark.parametrize("cache", ["bfloat16", "bf16q-e4m3"])
def test_rows_sharing_blocks_of_a_tiled_pair_get_the_bits_of_distinct_copies(cache):
    """The CPU kernel finds the blocks several rows read (test_shared_blocks.py's tree of forks) in a tiled pair too,
    reads them once, and every row keeps the bits it has with the blocks copied apart."""
    query_dtype, cache_dtype = CACHES[cache]
    num_heads, num_kv_heads = HEADS["gqa"]
    kwargs = op_kwargs(FEATURES["all"], num_heads, cache_dtype)
    rows = make_tree(num_heads, num_kv_heads, query_dtype, cache_dtype, 0)
    shared_case = packed(lay_out_shared(rows, 16, 1))
    before = _C._shared_tokens_saved()
    out = paged_attn.paged_attention(*shared_case, **kwargs)
    assert _C._shared_tokens_saved() > before, "no shared segment found: every row read the shared prefix itself"
    assert not out.isnan().any(), "NaN in the output: an unused (poisoned) slot leaked in"
    expected = reference.paged_attention(*shared_case, compute_dtype=torch.float64, **kwargs)
    torch.testing.assert_close(out, expected.to(out.dtype), **tolerance(out.dtype))
    distinct = paged_attn.paged_attention(*packed(lay_out_shared(rows, 16, 2, share=False)), **kwargs)
    assert_same_bits(distinct, out, "shared blocks vs distinct copies, tiled")


@pytest.mark.parametrize("head_dim", [64, 128])
def test_bfloat16_on_a_tiled_pair_is_as_exact_as_float32_math(head_dim):
    check_bfloat16_is_as_exact_as_float32_math(head_dim, tiled=True)


def check_batch_invariance(cache):
    """A row's bits on a tiled pair: alone with 1 thread, in a batch with 2, in another batch (reordered, the row
    twice) with 1, at other physical blocks each time."""
    query_dtype, cache_dtype = CACHES[cache]
    num_heads, num_kv_heads = HEADS["gqa"]
    kwargs = op_kwargs(FEATURES["all"], num_heads, cache_dtype)
    target, long_row, short_row = make_seqs([1300, 2100, 37], num_heads, num_kv_heads, HEAD_DIM, query_dtype,
                                            cache_dtype, 21)

    def decode(seqs, seed, threads):
        case = packed(lay_out(seqs, 16, seed))
        out = with_threads(threads, lambda: paged_attn.paged_attention(*case, **kwargs))
        assert not out.isnan().any(), "NaN in the output: an unused (poisoned) slot leaked in"
        return out, case

    alone, _ = decode([target], 1, 1)
    batch, case = decode([long_row, target, short_row], 2, 2)
    expected = reference.paged_attention(*case, compute_dtype=torch.float64, **kwargs)
    torch.testing.assert_close(batch, expected.to(batch.dtype), **tolerance(batch.dtype))
    reordered, _ = decode([short_row, target, long_row, target], 3, 1)
    assert_same_bits(batch[1], alone[0], "alone with 1 thread vs in a batch with 2")
    assert_same_bits(reordered[1], alone[0], "alone vs in another batch")
    assert_same_bits(reordered[3], alone[0], "alone vs its copy in another batch")
    assert_same_bits(decode([long_row], 4, 1)[0][0], batch[0], "the long row alone with 1 thread vs in the batch")


@pytest.mark.parametrize("cache", ["bfloat16", "bf16q-e4m3"])
def test_a_rows_bits_on_a_tiled_pair_do_not_depend_on_the_batch_or_threads(cache):
    check_batch_invariance(cache)


PATH_SCRIPT = (
    "import test_tiled_cache as t\n"
    "for name in ('bf16', 'group 5', 'everything', 'e4m3, bf16 query', 'varlen, everything'):\n"
    "    t.check_attention(name)\n"
    "for head_dim in (64, 128):\n"
    "    t.check_bfloat16_is_as_exact_as_float32_math(head_dim, tiled=True)\n"
    "t.check_batch_invariance('bfloat16')\n"
)


def test_portable_path_when_avx512_is_switched_off():
    run_on_portable_path(PATH_SCRIPT)


@pytest.mark.skipif(not HAS_AMX, reason="no AMX-BF16 here: the opt-in AMX path cannot run")
def test_amx_switch():
    run_on_portable_path(PATH_SCRIPT, switch="PAGED_ATTN_AMX")


# ----------------------------------------------------------------------------------------------------------------
# Errors: the kernels and the fakes alike


def error_case():
    """A small valid call on a tiled pair: key, value, key_tiled, value_tiled, the row-major caches, slots, query,
    block_tables, seq_lens."""
    key_cache, value_cache = torch.randn(4, 16, 2, 64).bfloat16(), torch.randn(4, 16, 2, 64).bfloat16()
    key_tiled, value_tiled = paged_attn.pack_cache(key_cache, value_cache)
    return dict(key=torch.randn(3, 2, 64).bfloat16(), value=torch.randn(3, 2, 64).bfloat16(), kt=key_tiled,
                vt=value_tiled, kr=key_cache, vr=value_cache, slots=torch.tensor([0, 17, 40]),
                query=torch.randn(2, 4, 64).bfloat16(), tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                lens=torch.tensor([5, 20], dtype=torch.int32))


def overlapping_pair(c):
    """A tiled pair whose value cache starts inside the key cache's last block."""
    key_numel, value_numel = c["kt"].numel(), c["vt"].numel()
    flat = torch.randn(key_numel + value_numel).bfloat16()
    return flat[:key_numel].view(c["kt"].shape), flat[key_numel - 8:key_numel - 8 + value_numel].view(c["vt"].shape)


def reshape(c, **change):
    args = {k: c[k] for k in ("key", "value")} | {"key_cache": c["kt"], "value_cache": c["vt"]} | change
    return paged_attn.reshape_and_cache, (args["key"], args["value"], args["key_cache"], args["value_cache"],
                                          c["slots"]), {}


def attend(c, **change):
    args = {"query": c["query"], "key_cache": c["kt"], "value_cache": c["vt"]} | change
    return paged_attn.paged_attention, (args["query"], args["key_cache"], args["value_cache"], c["tables"],
                                        c["lens"]), {}


ONE_LAYOUT = "key_cache and value_cache must have one layout: both tiled"
# name: (the call on error_case()'s tensors, its message)
ERRORS = {
    "reshape: tiled key, row-major value": (lambda c: reshape(c, value_cache=c["vr"]), ONE_LAYOUT),
    "reshape: row-major key, tiled value": (lambda c: reshape(c, key_cache=c["kr"]), ONE_LAYOUT),
    "attention: tiled key, row-major value": (lambda c: attend(c, value_cache=c["vr"]), ONE_LAYOUT),
    "attention: row-major key, tiled value": (lambda c: attend(c, key_cache=c["kr"]), ONE_LAYOUT),
    "attention: key and value swapped": (lambda c: attend(c, key_cache=c["vt"], value_cache=c["kt"]), ONE_LAYOUT),
    "copy_blocks: a layer of one tiled, one row-major": (lambda c: (
        paged_attn.copy_blocks, ([c["kt"], c["kr"]], [c["vt"], c["vt"].clone()], torch.tensor([[0, 1]])), {}),
        ONE_LAYOUT),
    "copy_blocks: a tiled cache alone": (lambda c: (paged_attn.copy_blocks, ([c["kt"]], [], torch.tensor([[0, 1]])),
                                                    {}),
                                         r"key_caches\[0\] must have shape \[num_blocks, block_size, num_kv_heads, "
                                         r"head_dim\] \(a tiled cache, from pack_cache, is read by the CPU ops only"),
    "reshape: float32 tiled": (lambda c: reshape(c, key=c["key"].float(), value=c["value"].float(),
                                                 key_cache=c["kt"].float(), value_cache=c["vt"].float()),
                               "a tiled cache must be bfloat16, float8_e4m3fn or float8_e5m2 .*, got Float"),
    "attention: float16 tiled": (lambda c: attend(c, query=c["query"].half(), key_cache=c["kt"].half(),
                                                  value_cache=c["vt"].half()), "a tiled cache must be bfloat16"),
    "attention: mixed dtypes": (lambda c: attend(c, value_cache=c["vt"].to(E4M3)),
                                "key_cache and value_cache must have the same dtype, got BFloat16 and Float8_e4m3fn"),
    "reshape: sizes disagree": (lambda c: reshape(c, value_cache=c["vt"][:, :1]), "must describe one cache"),
    "attention: head_dim 48": (lambda c: attend(c, query=c["query"][..., :48],
                                                key_cache=torch.zeros(4, 2, 1, 24, 16, 2).bfloat16(),
                                                value_cache=torch.zeros(4, 2, 8, 48, 2).bfloat16()),
                               "head_dim a multiple of 32"),
    "reshape: key not contiguous in a block": (lambda c: reshape(c, key_cache=c["kt"].transpose(3, 4).contiguous()
                                                                 .transpose(3, 4)),
                                               "key_cache: a tiled cache must be contiguous within each block"),
    "attention: value blocks overlap": (lambda c: attend(c, value_cache=c["vt"].as_strided(
        c["vt"].shape, (c["vt"].stride(0) // 2,) + c["vt"].stride()[1:])),
        "value_cache: the block stride must reach past a block's elements"),
    "reshape: the caches overlap": (lambda c: reshape(c, **dict(zip(("key_cache", "value_cache"),
                                                                    overlapping_pair(c)))),
                                    "key_cache and value_cache must not overlap in memory"),
    "reshape: key head_dim": (lambda c: reshape(c, key=c["key"][..., :32], value=c["value"][..., :32]),
                              r"but the cache holds \[num_kv_heads, head_dim\] = \[2, 64\]"),
    "attention: query head_dim": (lambda c: attend(c, query=c["query"][..., :32]),
                                  "query has head_dim 32 but the cache has head_dim 64"),
    "attention: kv heads": (lambda c: attend(c, query=c["query"][:, :3]),
                            r"num_heads \(3\) must be a multiple of num_kv_heads \(2\)"),
    "concat_and_cache_mla: a tiled cache": (lambda c: (paged_attn.concat_and_cache_mla, (
        torch.randn(3, 48).bfloat16(), torch.randn(3, 16).bfloat16(), c["kt"], c["slots"]), {}),
        r"kv_cache must have shape \[num_blocks, block_size, kv_lora_rank \+ rope_dim\]"),
    "mla_attention: a tiled cache": (lambda c: (paged_attn.mla_attention, (c["query"], c["vt"], c["tables"],
                                                                           c["lens"]),
                                                {"kv_lora_rank": 32, "scale": 0.1}),
                                     r"kv_cache must have shape \[num_blocks, block_size, kv_lora_rank \+ rope_dim\]"),
}


def fake_error(name):
    fn, args, kwargs = ERRORS[name][0](error_case())
    with FakeTensorMode() as mode:
        fake_args, fake_kwargs = pytree.tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
        return error_of(lambda: fn(*fake_args, **fake_kwargs))


@pytest.mark.parametrize("name", ERRORS)
def test_the_fake_refuses_it(name):
    error = fake_error(name)
    assert error is not None and error.startswith("RuntimeError: "), error
    assert re.search(ERRORS[name][1], error), error


@pytest.mark.parametrize("name", ERRORS)
def test_the_kernel_refuses_it_as_the_fake_does(name):
    c = error_case()
    fn, args, kwargs = ERRORS[name][0](c)
    before = [raw(t).clone() for t in (c["kt"], c["vt"])]
    real = error_of(lambda: fn(*args, **kwargs))
    assert real is not None and real.startswith("RuntimeError: "), real
    assert without_addresses(real) == without_addresses(fake_error(name))
    assert all(torch.equal(raw(t), b) for t, b in zip((c["kt"], c["vt"]), before)), "a refused call wrote"


def test_the_fakes_take_a_tiled_pair_on_the_cpu_and_on_meta():
    c = error_case()
    key_spread, value_spread, _ = in_one_allocation(c["kt"], c["vt"])
    calls = [reshape(c), reshape(c, key_cache=key_spread, value_cache=value_spread), attend(c),
             (paged_attn.copy_blocks, ([c["kt"], key_spread], [c["vt"], value_spread], torch.tensor([[0, 1]])), {}),
             (paged_attn.swap_blocks, (c["kt"], c["kt"].clone(), torch.tensor([[0, 1]])), {})]
    for fn, args, kwargs in calls:
        with FakeTensorMode() as mode:
            result = fn(*pytree.tree_map_only(torch.Tensor, mode.from_tensor, args), **kwargs)
        if fn is paged_attn.paged_attention:
            assert result.shape == (2, 4, 64) and result.dtype == torch.bfloat16
        meta_result = fn(*on_meta(args), **kwargs) if fn is not paged_attn.swap_blocks else None
        if fn is paged_attn.paged_attention:
            assert meta_result.shape == (2, 4, 64) and meta_result.device.type == "meta"


def test_the_fakes_refuse_a_tiled_pair_on_cuda():
    # A fake tensor keeps its device: the CUDA kernels (where dispatch goes) take no tiled cache.
    c = error_case()
    with FakeTensorMode(allow_non_fake_inputs=False):
        cuda = {k: torch.empty(v.shape, dtype=v.dtype, device="cuda") for k, v in c.items()}
        for fn, args, kwargs in (reshape(cuda), attend(cuda)):
            with pytest.raises(RuntimeError, match=r"key_cache must have shape \[num_blocks, block_size, "
                                                   r"num_kv_heads, head_dim\] \(a tiled cache, from pack_cache, is "
                                                   r"read by the CPU ops only, with both caches tiled\)"):
                fn(*args, **kwargs)


@requires_cuda
def test_cuda_ops_refuse_tiled_caches():
    c = {k: v.cuda() for k, v in error_case().items()}
    for fn, args, kwargs in (reshape(c), attend(c)):
        with pytest.raises(RuntimeError, match="is read by the CPU ops only"):
            fn(*args, **kwargs)


def test_torch_compile_refuses_a_mixed_pair_while_tracing():
    c = error_case()
    torch._dynamo.reset()
    compiled = torch.compile(paged_attn.reshape_and_cache, fullgraph=True, backend="aot_eager")
    with pytest.raises(torch._dynamo.exc.TorchRuntimeError, match=ONE_LAYOUT):
        compiled(c["key"], c["value"], c["kt"], c["vr"], c["slots"])


# ----------------------------------------------------------------------------------------------------------------
# torch.library: opcheck and torch.compile on tiled caches


def test_opcheck_with_tiled_caches():
    c = error_case()  # random caches, no NaN (opcheck compares whole tensors)
    torch.library.opcheck(torch.ops.paged_attn.reshape_and_cache.default,
                          (c["key"], c["value"], c["kt"], c["vt"], c["slots"]))
    torch.library.opcheck(torch.ops.paged_attn.copy_blocks.default,
                          ([c["kt"], c["kt"].clone()], [c["vt"], c["vt"].clone()], torch.tensor([[0, 3], [2, 1]])))
    torch.library.opcheck(torch.ops.paged_attn.swap_blocks.default, (c["kt"], c["kt"].clone()[:3],
                                                                     torch.tensor([[0, 2], [3, 1]])))
    torch.library.opcheck(torch.ops.paged_attn.paged_attention.default,
                          (torch.empty_like(c["query"]), c["query"], c["kt"], c["vt"], c["tables"], c["lens"], 0.125,
                           torch.rand(4), 0, 0.0))


def test_torch_compile_fullgraph_on_tiled_caches():
    c = error_case()
    mapping = torch.tensor([[1, 0]])

    def write_copy_attend(key, value, key_cache, value_cache, slots, query, tables, lens):
        paged_attn.reshape_and_cache(key, value, key_cache, value_cache, slots)
        paged_attn.copy_blocks([key_cache], [value_cache], mapping)
        return paged_attn.paged_attention(query, key_cache, value_cache, tables, lens) * 2

    expected_caches = [c["kt"].clone(), c["vt"].clone()]
    reference.reshape_and_cache(c["key"], c["value"], *expected_caches, c["slots"])
    reference.copy_blocks(expected_caches[:1], expected_caches[1:], mapping)
    expected = reference.paged_attention(c["query"], *expected_caches, c["tables"], c["lens"]) * 2
    torch._dynamo.reset()
    compiled = torch.compile(write_copy_attend, fullgraph=True)
    actual = compiled(*(c[k] for k in ("key", "value", "kt", "vt", "slots", "query", "tables", "lens")))
    torch.testing.assert_close(actual, expected, **tolerance(torch.bfloat16))
    assert_same_bytes(c["kt"], expected_caches[0], "the key cache, compiled vs the reference")
    assert_same_bytes(c["vt"], expected_caches[1], "the value cache, compiled vs the reference")
