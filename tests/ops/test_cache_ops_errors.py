"""Bad input raises a clear error that names what is wrong, and leaves the caches untouched."""

import itertools
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import DEVICES, requires_cuda
from hypothesis import given, settings
from hypothesis import strategies as st

import paged_attn
from paged_attn import reference

NAN = float("nan")


def caches(device="cpu", num_blocks=4, block_size=8, num_kv_heads=2, head_dim=32, dtype=torch.float32):
    """NaN-filled key and value caches, each followed in memory by a NaN guard block (see guard): a range check
    that let block id num_blocks through would write there, and fail the test instead of corrupting the heap."""
    shape = (num_blocks + 1, block_size, num_kv_heads, head_dim)
    key_alloc = torch.full(shape, NAN, dtype=dtype, device=device)
    return key_alloc[:num_blocks], torch.full_like(key_alloc, NAN)[:num_blocks]


def guard(cache):
    """The block right after a cache from caches(), in memory."""
    return cache.as_strided(cache.shape[1:], cache.stride()[1:], cache.storage_offset() + len(cache) * cache.stride(0))


def untouched(*caches):
    """Each cache from caches(), and its guard block, is still all NaN."""
    return all(cache.isnan().all() and guard(cache).isnan().all() for cache in caches)


def kv(num_tokens=3, num_kv_heads=2, head_dim=32, dtype=torch.float32, device="cpu"):
    key = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    return key, torch.randn_like(key)


def slots(*values, device="cpu"):
    return torch.tensor(values, dtype=torch.int64, device=device)


# ----------------------------------------------------------------------------------------------------------------
# reshape_and_cache

RESHAPE_ERRORS = {
    "key rank": (lambda k, v, kc, vc, s: (k[0], v[0], kc, vc, s), "key must have shape"),
    "value shape": (lambda k, v, kc, vc, s: (k, v[:2], kc, vc, s), "key and value must have the same shape"),
    "key dtype": (lambda k, v, kc, vc, s: (k.half(), v.half(), kc, vc, s), "key and key_cache must have the same dtype"),
    "cache dtype": (
        lambda k, v, kc, vc, s: (k.double(), v.double(), kc.double(), vc.double(), s),
        "must be float32, float16, bfloat16, float8_e4m3fn or float8_e5m2",
    ),
    "cache rank": (lambda k, v, kc, vc, s: (k, v, kc[0], vc[0], s), "key_cache must have shape"),
    "cache pair": (lambda k, v, kc, vc, s: (k, v, kc, vc[:2], s), "key_cache and value_cache must have the same shape"),
    "head_dim": (lambda k, v, kc, vc, s: (k[..., :16], v[..., :16], kc, vc, s), "but the cache holds"),
    "num_kv_heads": (lambda k, v, kc, vc, s: (k[:, :1], v[:, :1], kc, vc, s), "but the cache holds"),
    "key last dim": (
        lambda k, v, kc, vc, s: (k.transpose(1, 2).contiguous().transpose(1, 2), v, kc, vc, s),
        "must be contiguous in their last dimension",
    ),
    "cache last dim": (
        lambda k, v, kc, vc, s: (k, v, kc.transpose(2, 3).contiguous().transpose(2, 3), vc, s),
        r"key_cache: the last dimension \(head_dim\) must be contiguous",
    ),
    "overlapping blocks": (
        lambda k, v, kc, vc, s: (k, v, kc[:1].expand(4, -1, -1, -1), vc, s),
        "key_cache: its elements must not overlap",
    ),
    "overlapping rows": (
        lambda k, v, kc, vc, s: (k, v, kc.as_strided(kc.shape, (kc.stride(0), 8, 8, 1)), vc, s),
        "key_cache: its elements must not overlap",
    ),
    "slot dtype": (lambda k, v, kc, vc, s: (k, v, kc, vc, s.int()), "slot_mapping must be Long"),
    "slot rank": (lambda k, v, kc, vc, s: (k, v, kc, vc, s[None]), "slot_mapping must have 1 dimension"),
    "slot count": (lambda k, v, kc, vc, s: (k, v, kc, vc, s[:2]), "slot_mapping must have num_tokens = 3"),
    "slot range": (
        lambda k, v, kc, vc, s: (k, v, kc, vc, slots(0, 32, 1, device=s.device)),
        r"slot_mapping\[1\] = 32 is out of range: slots are in \[0, 32\)",
    ),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", RESHAPE_ERRORS)
def test_reshape_and_cache_errors(case, device, validation):
    make_args, message = RESHAPE_ERRORS[case]
    key, value = kv(device=device)
    key_cache, value_cache = caches(device)
    args = make_args(key, value, key_cache, value_cache, slots(0, 9, 17, device=device))
    with pytest.raises(RuntimeError, match=message):
        paged_attn.reshape_and_cache(*args)
    assert untouched(key_cache, value_cache), "a failed call wrote to the cache"


@requires_cuda
def test_reshape_and_cache_device_mismatch():
    key, value = kv()
    key_cache, value_cache = caches("cuda")
    with pytest.raises(RuntimeError, match="key and key_cache must be on the same device"):
        paged_attn.reshape_and_cache(key, value, key_cache, value_cache, slots(0, 1, 2, device="cuda"))
    with pytest.raises(RuntimeError, match="slot_mapping must be on cuda"):
        paged_attn.reshape_and_cache(key.cuda(), value.cuda(), key_cache, value_cache, slots(0, 1, 2))


# ----------------------------------------------------------------------------------------------------------------
# copy_blocks

COPY_ERRORS = {
    "mapping shape": (lambda m: m[:, :1], r"block_mapping must have shape \[num_pairs, 2\]"),
    "mapping dtype": (lambda m: m.int(), "block_mapping must be Long"),
    "source range": (lambda m: torch.tensor([[4, 1]]), r"source block 4 is out of range \[0, 4\)"),
    "negative source": (lambda m: torch.tensor([[-1, 1]]), r"source block -1 is out of range"),
    "destination range": (lambda m: torch.tensor([[0, 7]]), r"destination block 7 is out of range \[0, 4\)"),
    "destination = num_blocks": (lambda m: torch.tensor([[0, 4]]), r"destination block 4 is out of range \[0, 4\)"),
    "duplicate destination": (lambda m: torch.tensor([[0, 2], [1, 2]]), "destination block 2 appears more than once"),
    "destination is source": (lambda m: torch.tensor([[0, 1], [1, 2]]), "block 1 is both a source and a destination"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", COPY_ERRORS)
def test_copy_blocks_errors(case, device, validation):
    make_mapping, message = COPY_ERRORS[case]
    key_cache, value_cache = caches(device)
    key_cache[0] = 1.0
    before = key_cache.clone()
    with pytest.raises(RuntimeError, match=message):
        paged_attn.copy_blocks([key_cache], [value_cache], make_mapping(torch.tensor([[0, 1]])))
    torch.testing.assert_close(key_cache, before, rtol=0, atol=0, equal_nan=True)
    assert untouched(value_cache) and guard(key_cache).isnan().all()


@pytest.mark.parametrize("device", DEVICES)
def test_copy_blocks_layer_errors(device):
    key_cache, value_cache = caches(device)
    other_shape, _ = caches(device, num_blocks=5)
    with pytest.raises(RuntimeError, match=r"same number of layers \(or value_caches none.*\), got 2 and 1"):
        paged_attn.copy_blocks([key_cache, key_cache], [value_cache], [(0, 1)])
    with pytest.raises(RuntimeError, match=r"key_caches\[0\] and key_caches\[1\] must have the same shape"):
        paged_attn.copy_blocks([key_cache, other_shape], [value_cache, value_cache], [(0, 1)])
    with pytest.raises(RuntimeError, match=r"key_caches\[0\] and value_caches\[0\] must have the same dtype"):
        paged_attn.copy_blocks([key_cache], [value_cache.half()], [(0, 1)])
    assert key_cache.isnan().all()


# A block mapping given as a list must be a list of (src_block, dst_block) pairs ([(0, 1, 2, 3)] was once read as
# two pairs); an empty list is no pairs.
BAD_LIST_MAPPINGS = {
    "a 4-tuple": [(0, 1, 2, 3)],
    "a flat pair": [0, 1],
    "a single id": [(0,)],
    "a fractional id": [(0.5, 1)],
    "a bool id": [(True, 1)],
}


@pytest.mark.parametrize("case", BAD_LIST_MAPPINGS)
def test_list_mappings_must_be_pairs(case):
    key_cache, value_cache = caches()
    key_cache[0] = 1.0
    before = key_cache.clone()
    for call in (lambda m: paged_attn.copy_blocks([key_cache], [value_cache], m),
                 lambda m: paged_attn.swap_blocks(key_cache, value_cache, m)):
        with pytest.raises(ValueError, match=r"block_mapping must be a list of \(src_block, dst_block\) integer pairs"):
            call(BAD_LIST_MAPPINGS[case])
        call([])
    torch.testing.assert_close(key_cache, before, rtol=0, atol=0, equal_nan=True)
    assert untouched(value_cache) and guard(key_cache).isnan().all()


# ----------------------------------------------------------------------------------------------------------------
# swap_blocks

SWAP_ERRORS = {
    "block shape": (lambda src, dst, m: (src, dst[:, :4], m), "same per-block shape"),
    "dtype": (lambda src, dst, m: (src.half(), dst, m), "same dtype"),
    "mapping shape": (lambda src, dst, m: (src, dst, m.flatten()), "block_mapping must have 2 dimension"),
    "mapping dtype": (lambda src, dst, m: (src, dst, m.int()), "block_mapping must be Long"),
    "source range": (lambda src, dst, m: (src, dst, torch.tensor([[6, 0]])), r"source block 6 is out of range \[0, 6\)"),
    "destination range": (
        lambda src, dst, m: (src, dst, torch.tensor([[0, 3]])),
        r"destination block 3 is out of range \[0, 3\)",
    ),
    "duplicate destination": (
        lambda src, dst, m: (src, dst, torch.tensor([[0, 1], [2, 1]])),
        "destination block 1 appears more than once",
    ),
    "layouts differ within a block": (
        lambda src, dst, m: (src.transpose(1, 2).contiguous().transpose(1, 2), dst, m),
        "src and dst must have the same strides within a block",
    ),
    "overlapping elements": (
        lambda src, dst, m: (src.as_strided(src.shape, (src.stride(0), 0) + src.stride()[2:]),
                             dst.as_strided(dst.shape, (dst.stride(0), 0) + dst.stride()[2:]), m),
        "must not have overlapping elements within a block",
    ),
    "overlapping block spans": (
        lambda src, dst, m: (src.as_strided(src.shape, (8,) + src.stride()[1:]), dst, m),
        "the block stride must reach past the bytes a block spans",
    ),
    # A block is copied as the bytes it spans: the K half's block 0 spans block 0's V rows but its last, so the V
    # half's block 1 spans block 1's K rows but its first (the probe's case: they were overwritten).
    "K half into V half of one packed cache": (
        lambda src, dst, m: (packed_halves(dst)[0], packed_halves(dst)[1], m),
        "src and dst must not overlap in memory: swap_blocks copies each block as the 1920 bytes it spans"),
    "V half into K half of one packed cache": (
        lambda src, dst, m: (packed_halves(dst)[1], packed_halves(dst)[0], m),
        "src and dst must not overlap in memory: swap_blocks copies each block as the 1920 bytes it spans"),
}


def packed_halves(cache):
    """The K and V halves of cache ([num_blocks, block_size, 2, head_dim], contiguous) read as vLLM's packed
    [num_blocks, block_size, 1, 2 * head_dim] K|V cache."""
    packed = cache.view(cache.shape[0], cache.shape[1], 1, 2 * cache.shape[3])
    return packed[..., : cache.shape[3]], packed[..., cache.shape[3] :]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", SWAP_ERRORS)
def test_swap_blocks_errors(case, device):
    make_args, message = SWAP_ERRORS[case]
    src = torch.randn(6, 8, 2, 32, device=device)
    dst, _ = caches(num_blocks=3)
    with pytest.raises(RuntimeError, match=message):
        paged_attn.swap_blocks(*make_args(src, dst, torch.tensor([[0, 1]])))
    assert untouched(dst)


@requires_cuda
def test_swap_blocks_mapping_on_cuda():
    src, dst = torch.randn(4, 8, 2, 32, device="cuda"), torch.full((4, 8, 2, 32), NAN)
    with pytest.raises(RuntimeError, match="block_mapping must be on cpu"):
        paged_attn.swap_blocks(src, dst, torch.tensor([[0, 1]], device="cuda"))


# ----------------------------------------------------------------------------------------------------------------
# The CUDA validation switch


def test_validation_switch():
    before = paged_attn.validation_enabled()
    try:
        paged_attn.set_validation(True)
        assert paged_attn.validation_enabled()
        paged_attn.set_validation(False)
        assert not paged_attn.validation_enabled()
    finally:
        paged_attn.set_validation(before)


@pytest.mark.parametrize("value,expected", [("1", True), ("0", False), (None, False)])
def test_validation_environment_variable(value, expected):
    env = {k: v for k, v in os.environ.items() if k != "PAGED_ATTN_VALIDATE"}
    if value is not None:
        env["PAGED_ATTN_VALIDATE"] = value
    out = subprocess.run(
        [sys.executable, "-c", "import paged_attn; print(paged_attn.validation_enabled())"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == str(expected)


@requires_cuda
def test_cuda_without_validation():
    # With validation off, the CUDA path skips the host-side index check (no synchronization) and still writes.
    before = paged_attn.validation_enabled()
    paged_attn.set_validation(False)
    key, value = kv(device="cuda")
    key_cache, value_cache = caches("cuda")
    paged_attn.reshape_and_cache(key, value, key_cache, value_cache, slots(0, 9, 17, device="cuda"))
    paged_attn.set_validation(before)
    assert torch.equal(key_cache[1, 1], key[1])


# ----------------------------------------------------------------------------------------------------------------
# Zero-sized dimensions: an empty pool (num_blocks = 0) and empty batches are fine, but a zero block_size,
# num_kv_heads or head_dim (or a query with no heads) is refused at the door by every op. A zero block_size once
# divided by zero and killed the process, so these calls run in one child process: a crash fails the cases it
# reached, not the whole test session.

ZERO_SIZED_SETUP = """
import torch, paged_attn

def caches(num_blocks=4, block_size=8, num_kv_heads=2, head_dim=32):
    key_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim)
    return key_cache, torch.zeros_like(key_cache)

def layers(**dims):  # one layer's caches, as copy_blocks takes them
    key_cache, value_cache = caches(**dims)
    return [key_cache], [value_cache]

def kv(num_kv_heads=2, head_dim=32):
    return torch.zeros(1, num_kv_heads, head_dim), torch.zeros(1, num_kv_heads, head_dim)

def attend(query, key_cache, value_cache):  # the op itself, no wrapper; one empty sequence per query row
    n = query.shape[0]
    torch.ops.paged_attn.paged_attention(torch.empty_like(query), query, key_cache, value_cache,
                                         torch.zeros(n, 1, dtype=torch.int32), torch.zeros(n, dtype=torch.int32),
                                         1.0, None, 0, 0.0)

def attend_wrapped(query, key_cache, value_cache):
    n = query.shape[0]
    return paged_attn.paged_attention(query, key_cache, value_cache, torch.zeros(n, 1, dtype=torch.int32),
                                      torch.zeros(n, dtype=torch.int32))
"""

POSITIVE_DIMS = "block_size, num_kv_heads and head_dim must be positive"
ZERO_SIZED = {
    "reshape_and_cache block_size": (
        "paged_attn.reshape_and_cache(*kv(), *caches(block_size=0), torch.tensor([-1]))", f"key_cache: {POSITIVE_DIMS}"),
    "reshape_and_cache num_kv_heads": (
        "paged_attn.reshape_and_cache(*kv(num_kv_heads=0), *caches(num_kv_heads=0), torch.tensor([0]))",
        f"key_cache: {POSITIVE_DIMS}"),
    "reshape_and_cache head_dim": (
        "paged_attn.reshape_and_cache(*kv(head_dim=0), *caches(head_dim=0), torch.tensor([0]))",
        f"key_cache: {POSITIVE_DIMS}"),
    "copy_blocks block_size": (
        "paged_attn.copy_blocks(*layers(block_size=0), [(0, 1)])", rf"key_caches\[0\]: {POSITIVE_DIMS}"),
    "swap_blocks block shape": (
        "paged_attn.swap_blocks(torch.zeros(4, 0, 2, 32), torch.zeros(4, 0, 2, 32), [(0, 1)])",
        "src and dst must have positive sizes after the block dimension"),
    "paged_attention block_size": ("attend(torch.zeros(1, 4, 32), *caches(block_size=0))", f"key_cache: {POSITIVE_DIMS}"),
    "paged_attention num_kv_heads": (
        "attend(torch.zeros(1, 4, 32), *caches(num_kv_heads=0))", f"key_cache: {POSITIVE_DIMS}"),
    "paged_attention head_dim": ("attend(torch.zeros(1, 4, 0), *caches(head_dim=0))", f"key_cache: {POSITIVE_DIMS}"),
    "paged_attention num_heads": (
        "attend(torch.zeros(1, 0, 32), *caches())", "query must have positive num_heads and head_dim"),
    "paged_attention query head_dim": (
        "attend(torch.zeros(1, 4, 0), *caches())", "query must have positive num_heads and head_dim"),
    "compiled paged_attention block_size": (
        "torch.compile(attend_wrapped, fullgraph=True)(torch.zeros(1, 4, 32), *caches(block_size=0))",
        f"key_cache: {POSITIVE_DIMS}"),
    "compiled reshape_and_cache block_size": (
        "torch.compile(paged_attn.reshape_and_cache, fullgraph=True)(*kv(), *caches(block_size=0), torch.tensor([-1]))",
        f"key_cache: {POSITIVE_DIMS}"),
}

ZERO_SIZED_RUNNER = """
import json, sys
for name, statement in json.loads(sys.argv[1]).items():
    try:
        exec(statement)
        outcome = [name, None, "accepted"]
    except Exception as error:
        outcome = [name, isinstance(error, RuntimeError), f"{type(error).__name__}: {error}"]
    print(json.dumps(outcome), flush=True)
"""


@pytest.fixture(scope="module")
def zero_sized_outcomes():
    statements = {name: statement for name, (statement, _) in ZERO_SIZED.items()}
    child = subprocess.run([sys.executable, "-c", ZERO_SIZED_SETUP + ZERO_SIZED_RUNNER, json.dumps(statements)],
                           capture_output=True, text=True, timeout=600)
    outcomes = {name: (is_runtime_error, message)
                for name, is_runtime_error, message in map(json.loads, child.stdout.splitlines())}
    return outcomes, child


@pytest.mark.parametrize("case", ZERO_SIZED)
def test_zero_sized_dims_are_refused(case, zero_sized_outcomes):
    outcomes, child = zero_sized_outcomes
    assert case in outcomes, f"the child process died (exit code {child.returncode}):\n{child.stderr[-3000:]}"
    is_runtime_error, message = outcomes[case]
    assert is_runtime_error, f"expected a RuntimeError, got {message}"
    assert re.search(ZERO_SIZED[case][1], message), message


def test_zero_sized_child_exits_cleanly(zero_sized_outcomes):
    _, child = zero_sized_outcomes
    assert child.returncode == 0, f"exit code {child.returncode}:\n{child.stderr[-3000:]}"


@pytest.mark.parametrize("device", DEVICES)
def test_empty_pools_and_batches_are_fine(device):
    key_cache, value_cache = caches(device, num_blocks=0)
    key, value = kv(num_tokens=0, device=device)
    paged_attn.reshape_and_cache(key, value, key_cache, value_cache, slots(device=device))
    paged_attn.copy_blocks([key_cache], [value_cache], [])
    paged_attn.swap_blocks(key_cache, key_cache.clone(), torch.empty(0, 2, dtype=torch.int64))
    empty_seqs = torch.zeros(0, dtype=torch.int32, device=device)
    out = paged_attn.paged_attention(torch.zeros(0, 4, 32, device=device), key_cache, value_cache,
                                     torch.zeros(0, 1, dtype=torch.int32, device=device), empty_seqs)
    assert out.shape == (0, 4, 32)
    # An empty pool still serves sequences of length 0 (zero output rows).
    query = torch.randn(2, 4, 32, device=device)
    out = paged_attn.paged_attention(query, key_cache, value_cache, torch.zeros(2, 1, dtype=torch.int32, device=device),
                                     torch.zeros(2, dtype=torch.int32, device=device))
    assert torch.count_nonzero(out) == 0



# ----------------------------------------------------------------------------------------------------------------
# Overlapping arguments: a tensor an op writes (an output) may share no element with any other argument (an input
# it overlaps would be silently overwritten, two caches that overlap corrupt each other, and on CUDA a kernel would
# race with itself); the tensors an op only reads may share memory with each other. The one exception is
# swap_blocks(c, c, ...): src and dst that are exactly the same memory are one cache. Memory is compared element by
# element, not by [min, max) ranges, so interleaved but disjoint layouts are accepted; swap_blocks, which copies
# each block as the run of bytes it spans, compares those runs.


def sharing_one_element(device, num_blocks=4):
    """Two caches whose memory has exactly one element in common: the last of the first, the first of the second."""
    n = num_blocks * 8 * 2 * 32
    flat = torch.full((2 * n - 1,), NAN, device=device)
    return flat[:n].view(num_blocks, 8, 2, 32), flat[n - 1 :].view(num_blocks, 8, 2, 32)


def attention_args(device):
    """The arguments of a small valid paged_attention call, by name (random caches, two sequences)."""
    key_cache, value_cache = (torch.randn(4, 8, 2, 32, device=device) for _ in range(2))
    query = torch.randn(2, 4, 32, device=device)
    return dict(out=torch.empty_like(query), query=query, key_cache=key_cache, value_cache=value_cache,
                block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device),
                seq_lens=torch.tensor([5, 9], dtype=torch.int32, device=device), scale=0.5,
                alibi_slopes=torch.rand(4, device=device), sliding_window=0, logits_soft_cap=0.0)


# Each case: (op, a function of (key, value, key_cache, value_cache, slot_mapping) giving the op's arguments,
# the two arguments the error names). The caches are separate NaN-filled [4, 8, 2, 32] tensors.
CACHE_OP_OVERLAPS = {
    "one tensor as both caches": ("reshape_and_cache", lambda k, v, kc, vc, s: (k, v, kc, kc, s),
                                  "key_cache and value_cache"),
    "caches sharing one element": (
        "reshape_and_cache", lambda k, v, kc, vc, s: (k, v, *sharing_one_element(kc.device), s),
        "key_cache and value_cache"),
    "caches one block apart": ("reshape_and_cache", lambda k, v, kc, vc, s: (k, v, kc[:3], kc[1:], s),
                               "key_cache and value_cache"),
    "key inside key_cache": ("reshape_and_cache", lambda k, v, kc, vc, s: (kc[3, :3], v, kc, vc, s),
                             "key and key_cache"),
    "value inside key_cache": ("reshape_and_cache", lambda k, v, kc, vc, s: (k, kc[0, 5:], kc, vc, s),
                               "value and key_cache"),
    "slot_mapping inside value_cache": (
        "reshape_and_cache", lambda k, v, kc, vc, s: (k, v, kc, vc, vc[0, 0, 0, :6].view(torch.int64)),
        "value_cache and slot_mapping"),
    "one tensor as a layer's two caches": (
        "copy_blocks", lambda k, v, kc, vc, s: ([kc], [kc], torch.tensor([[0, 1]])),
        r"key_caches\[0\] and value_caches\[0\]"),
    "one cache in two layers": (
        "copy_blocks", lambda k, v, kc, vc, s: ([kc, kc.clone()], [vc, kc], torch.tensor([[0, 1]])),
        r"key_caches\[0\] and value_caches\[1\]"),
    "two layers sharing one element": (
        "copy_blocks", lambda k, v, kc, vc, s: (list(sharing_one_element(kc.device)), [vc, vc.clone()],
                                                torch.tensor([[0, 1]])),
        r"key_caches\[0\] and key_caches\[1\]"),
    "dst one block into src": ("swap_blocks", lambda k, v, kc, vc, s: (kc, kc[1:], torch.tensor([[0, 1]])),
                               "src and dst"),
    "dst a prefix of src": ("swap_blocks", lambda k, v, kc, vc, s: (kc, kc[:2], torch.tensor([[3, 1]])),
                            "src and dst"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CACHE_OP_OVERLAPS)
def test_cache_ops_refuse_overlapping_arguments(case, device, validation):
    op, make_args, names = CACHE_OP_OVERLAPS[case]
    key, value = kv(device=device)
    key_cache, value_cache = caches(device)
    args = make_args(key, value, key_cache, value_cache, slots(0, 9, 17, device=device))
    with pytest.raises(RuntimeError, match=f"{names} must not overlap in memory"):
        getattr(paged_attn, op)(*args)
    assert untouched(key_cache, value_cache), "a failed call wrote to the cache"


# Each case: a function of paged_attention's arguments (by name) that makes two of them overlap, and their names.
ATTENTION_OVERLAPS = {
    "out inside value_cache (the probe's case)": (
        lambda a: {**a, "out": a["value_cache"][1, :4].view(2, 4, 32)}, "out and value_cache"),
    "out inside key_cache, shifted by one element": (
        lambda a: {**a, "out": a["key_cache"].flatten()[1:257].view(2, 4, 32)}, "out and key_cache"),
    "out is query": (lambda a: {**a, "out": a["query"]}, "out and query"),
    "block_tables inside out": (
        lambda a: {**a, "block_tables": a["out"].view(torch.int32).flatten()[-4:].view(2, 2)}, "out and block_tables"),
    "alibi_slopes inside out": (lambda a: {**a, "alibi_slopes": a["out"][1, 2, :4]}, "out and alibi_slopes"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ATTENTION_OVERLAPS)
def test_paged_attention_refuses_overlapping_arguments(case, device, validation):
    make_args, names = ATTENTION_OVERLAPS[case]
    args = make_args(attention_args(device))
    before = {name: arg.clone() for name, arg in args.items() if isinstance(arg, torch.Tensor)}
    with pytest.raises(RuntimeError, match=f"{names} must not overlap in memory"):
        torch.ops.paged_attn.paged_attention(**args)
    for name, arg in before.items():
        torch.testing.assert_close(args[name].view(torch.uint8), arg.view(torch.uint8), rtol=0, atol=0,
                                   msg=f"{name} was written")


# A scale is an input of both ops, so both refuse it inside what they write, and both accept one scale tensor as
# k_scale and v_scale. (paged_attention did not check the scales at all: on CUDA the kernel would read a scale
# while writing it.)
SCALE_OVERLAPS = {
    "reshape_and_cache: k_scale inside key_cache": (
        "reshape_and_cache", lambda kc, vc, out: {"k_scale": kc[2, 3, 1, 4:8].view(torch.float32)},
        "key_cache and k_scale"),
    "reshape_and_cache: v_scale inside value_cache": (
        "reshape_and_cache", lambda kc, vc, out: {"v_scale": vc[0, 0, 0, :4].view(torch.float32)},
        "value_cache and v_scale"),
    "paged_attention: k_scale inside out": (
        "paged_attention", lambda kc, vc, out: {"k_scale": out[1, 3, 31:]}, "out and k_scale"),
    "paged_attention: v_scale inside out": (
        "paged_attention", lambda kc, vc, out: {"v_scale": out[0, 0, :1]}, "out and v_scale"),
    "paged_attention: the one scale of both inside out": (
        "paged_attention", lambda kc, vc, out: {"k_scale": out[0, 2, 5:6], "v_scale": out[0, 2, 5:6]},
        "out and k_scale"),
}


def fp8_scale_case(device):
    """(key, value, key_cache, value_cache, slot_mapping, query, out, block_tables, seq_lens): float32 keys, values
    and query, NaN-byte float8_e4m3fn caches; out filled with 1.0 (a valid scale, had it been read as one)."""
    key, value = kv(device=device)
    key_cache, value_cache = (torch.full((4, 8, 2, 32), 0x7F, dtype=torch.uint8, device=device)
                              .view(torch.float8_e4m3fn) for _ in "kv")
    query = torch.randn(2, 4, 32, device=device)
    return (key, value, key_cache, value_cache, slots(0, 9, 17, device=device), query, torch.ones_like(query),
            torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device),
            torch.tensor([5, 9], dtype=torch.int32, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", SCALE_OVERLAPS)
def test_scales_must_not_overlap_what_an_op_writes(case, device, validation):
    op, make_scales, names = SCALE_OVERLAPS[case]
    key, value, key_cache, value_cache, slot_mapping, query, out, block_tables, seq_lens = fp8_scale_case(device)
    tensors = (key_cache, value_cache, out)
    before = [t.view(torch.uint8).clone() for t in tensors]
    with pytest.raises(RuntimeError, match=f"{names} must not overlap in memory"):
        if op == "reshape_and_cache":
            paged_attn.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                                         **make_scales(key_cache, value_cache, out))
        else:
            paged_attn.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, out=out,
                                       **make_scales(key_cache, value_cache, out))
    assert all(torch.equal(t.view(torch.uint8), b) for t, b in zip(tensors, before)), "a failed call wrote"


@pytest.mark.parametrize("device", DEVICES)
def test_read_only_arguments_may_share_memory(device):
    # One scale tensor as both k_scale and v_scale, in both ops.
    key, value, key_cache, value_cache, slot_mapping, query, _, block_tables, seq_lens = fp8_scale_case(device)
    scale = torch.tensor([0.5], device=device)
    expected = [c.clone() for c in (key_cache, value_cache)]
    reference.reshape_and_cache(key, value, *expected, slot_mapping, k_scale=scale, v_scale=scale)
    paged_attn.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale=scale, v_scale=scale)
    for actual, want in zip((key_cache, value_cache), expected):
        assert torch.equal(actual.view(torch.uint8), want.view(torch.uint8))
    key_cache, value_cache = (reference.quantize_fp8(torch.randn(4, 8, 2, 32), torch.float8_e4m3fn).to(device)
                              for _ in "kv")
    out = paged_attn.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, k_scale=scale,
                                     v_scale=scale)
    want = reference.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, k_scale=scale,
                                     v_scale=scale, compute_dtype=torch.float64)
    torch.testing.assert_close(out, want.to(out.dtype), rtol=1e-5, atol=1e-5)

    # One tensor as key and value (or both expanded from one row); one tensor as both caches of paged_attention.
    key_cache, value_cache = caches(device)
    paged_attn.reshape_and_cache(key, key, key_cache, value_cache, slots(0, 9, 17, device=device))
    rows = key[:1].expand(3, -1, -1)
    paged_attn.reshape_and_cache(rows, rows, key_cache, value_cache, slots(1, 2, 3, device=device))
    for cache in (key_cache, value_cache):
        assert torch.equal(cache[0, 0], key[0]) and torch.equal(cache[1, 1], key[1])
        assert torch.equal(cache[2, 1], key[2])
        assert torch.equal(cache[0, 1:4], rows)
    args = attention_args(device)
    args["value_cache"] = args["key_cache"]
    torch.ops.paged_attn.paged_attention(**args)
    want = reference.paged_attention(args["query"], args["key_cache"], args["key_cache"], args["block_tables"],
                                     args["seq_lens"], scale=args["scale"], alibi_slopes=args["alibi_slopes"],
                                     compute_dtype=torch.float64)
    torch.testing.assert_close(args["out"], want.to(args["out"].dtype), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_interleaved_and_adjacent_layouts_are_accepted(device):
    # The [:, 0] and [:, 1] halves of one [num_blocks, 2, ...] allocation interleave but share no element; nor do
    # the query, key and value slices of one fused QKV tensor, rows expanded from different rows, or tensors that
    # merely touch (one ends where the next begins).
    alloc = torch.full((4, 2, 8, 2, 32), NAN, device=device)
    key_cache, value_cache = alloc[:, 0], alloc[:, 1]
    qkv = torch.randn(3, 4 + 2 + 2, 32, device=device)
    query, key, value = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    paged_attn.reshape_and_cache(key, value, key_cache, value_cache, slots(0, 1, 2, device=device))
    assert torch.equal(key_cache[0, :3], key) and torch.equal(value_cache[0, :3], value)
    rows = torch.randn(2, 1, 2, 32, device=device)
    paged_attn.reshape_and_cache(rows[0].expand(3, -1, -1), rows[1].expand(3, -1, -1), key_cache, value_cache,
                                 slots(8, 9, 10, device=device))
    assert torch.equal(key_cache[1, :3], rows[0].expand(3, -1, -1))
    paged_attn.copy_blocks([key_cache], [value_cache], [(0, 2)])
    paged_attn.swap_blocks(key_cache, value_cache, [(2, 3)])  # from one half into the other
    assert torch.equal(value_cache[3, :3], key)

    buffer = torch.empty(3 * 4 * 32 + 4, device=device)  # out, then the ALiBi slopes right after it
    out, alibi_slopes = buffer[:-4].view(3, 4, 32), buffer[-4:].uniform_()
    block_tables = torch.tensor([[0], [1], [0]], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([3, 3, 2], dtype=torch.int32, device=device)
    paged_attn.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes=alibi_slopes,
                               out=out)
    expected = reference.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                         alibi_slopes=alibi_slopes)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_swap_blocks_views_of_one_cache_are_one_cache(device):
    # src and dst that are exactly the same memory (c and c[:]) are one cache, so a destination must not be a source.
    cache = torch.randn(4, 8, 2, 32, device=device)
    with pytest.raises(RuntimeError, match="block 1 is both a source and a destination"):
        paged_attn.swap_blocks(cache, cache[:], [(0, 1), (1, 2)])
    expected = cache.clone()
    expected[1] = cache[0]
    paged_attn.swap_blocks(cache, cache[:], [(0, 1)])
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_swap_blocks_refuses_dst_block_spans_over_what_it_reads(device):
    # swap_blocks copies a block of a packed cache's K half as the bytes from its first K row to the end of its last,
    # the V rows between them included: the K and V halves share no element, but their blocks' spans do.
    packed = torch.randn(4, 8, 2, 2 * 32, device=device)
    k_half, v_half = packed[..., :32], packed[..., 32:]
    before = packed.clone()
    for src, dst in ((k_half, v_half), (v_half, k_half)):
        with pytest.raises(RuntimeError, match="src and dst must not overlap in memory: swap_blocks copies each "
                                               r"block as the 3968 bytes it spans \(from its first element"):
            paged_attn.swap_blocks(src, dst, [(0, 1)])
        assert torch.equal(packed, before), "a refused swap wrote"
    # Spans that merely follow each other are fine: blocks 0-1 of the K half into blocks 2-3 of the V half write
    # the spans of packed blocks 2 and 3 (their V rows, and the K rows between them).
    paged_attn.swap_blocks(k_half[:2], v_half[2:], [(0, 0), (1, 1)])
    assert torch.equal(v_half[2:], before[:2, ..., :32]) and torch.equal(packed[:2], before[:2])
    # The same memory is one cache (as before): its mapping is checked, and the copy is the block's span.
    paged_attn.swap_blocks(k_half, k_half[:], [(0, 3)])
    assert torch.equal(k_half[3], before[0, ..., :32])

    if device == "cpu":  # (block_mapping lives on the CPU)
        # block_mapping between the K rows of dst's block 1: no element of dst, but the copy into block 1 writes it.
        dst = torch.randn(4, 8, 2, 2 * 32)
        mapping = dst[1, 0, 1, 32:36].view(torch.int64).view(1, 2)
        mapping.copy_(torch.tensor([[0, 1]]))
        dst_before = dst.clone()
        with pytest.raises(RuntimeError, match="dst and block_mapping must not overlap in memory"):
            paged_attn.swap_blocks(torch.randn(4, 8, 2, 2 * 32)[..., :32], dst[..., :32], mapping)
        assert torch.equal(dst, dst_before), "a refused swap wrote"


def element_bytes(t):
    """Every byte address t's elements cover, by brute force."""
    element = t.element_size()
    return {t.data_ptr() + sum(i * s for i, s in zip(index, t.stride())) * element + b
            for index in itertools.product(*map(range, t.shape)) for b in range(element)}


@st.composite
def views(draw, storage):
    """A random strided view of storage (any dtype that divides it, sizes 0..4, strides 0..12, rank 0..3)."""
    base = storage.view(draw(st.sampled_from([torch.uint8, torch.float16, torch.float32, torch.int64])))
    rank = draw(st.integers(0, 3))
    sizes = draw(st.lists(st.integers(0, 4), min_size=rank, max_size=rank))
    strides = draw(st.lists(st.integers(0, 12), min_size=rank, max_size=rank))
    extent = sum((n - 1) * s for n, s in zip(sizes, strides) if n > 0)
    return base.as_strided(sizes, strides, draw(st.integers(0, base.numel() - 1 - extent)))


def overlap(a, b):
    """The ops' overlap check, paged_attn._C._tensors_overlap, which takes each tensor's memory as plain numbers."""
    memory = lambda t: (t.data_ptr(), tuple(t.shape), t.stride(), t.element_size())
    return paged_attn._C._tensors_overlap(memory(a), memory(b))


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_tensors_overlap_matches_brute_force(data):
    storage = torch.zeros(1024, dtype=torch.uint8)
    a, b = data.draw(views(storage)), data.draw(views(storage))
    expected = bool(element_bytes(a) & element_bytes(b))
    assert overlap(a, b) == expected
    assert overlap(b, a) == expected


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_tensors_overlap_of_one_lattice_at_two_offsets_matches_brute_force(data):
    # The K and V halves of a packed cache are this case (the O(1) path for nested lattices, and the sweep).
    storage = torch.zeros(1024, dtype=torch.uint8)
    base = storage.view(data.draw(st.sampled_from([torch.uint8, torch.float16, torch.float32])))
    rank = data.draw(st.integers(1, 3))
    sizes = data.draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank))
    strides = data.draw(st.lists(st.integers(1, 24), min_size=rank, max_size=rank))
    extent = sum((n - 1) * s for n, s in zip(sizes, strides))
    a, b = (base.as_strided(sizes, strides, data.draw(st.integers(0, base.numel() - 1 - extent))) for _ in "ab")
    expected = bool(element_bytes(a) & element_bytes(b))
    assert overlap(a, b) == expected
    assert overlap(b, a) == expected


def test_tensors_overlap_examples():
    alloc = torch.zeros(5, 2, 8, 2, 32)
    assert not overlap(alloc[:, 0], alloc[:, 1]) and overlap(alloc[:, 0], alloc[1:, 0])
    assert overlap(alloc[:, 0], alloc.flatten()[8 * 2 * 32 - 1 :])  # one element, the last of block 0's key half
    qkv = torch.zeros(7, 12, 64)
    assert not overlap(qkv[:, 8:10], qkv[:, 10:]) and overlap(qkv[:, 8:11], qkv[:, 10:])
    assert not overlap(alloc, torch.zeros_like(alloc)) and not overlap(alloc[:0], alloc)
    matrix = torch.zeros(6, 6)
    assert not overlap(matrix[:, ::2], matrix[:, 1::2]) and overlap(matrix[:, ::2], matrix[:, 2::3])
    assert not overlap(matrix[0, :1].expand(4, 6), matrix[1:])
    # vLLM's packed K|V cache, [num_blocks, block_size, num_kv_heads, 2 * head_dim]: K and V halves, and misaligned.
    packed = torch.zeros(6, 4, 3, 2 * 8)
    assert not overlap(packed[..., :8], packed[..., 8:]) and overlap(packed[..., :9], packed[..., 8:])
    assert overlap(packed[..., :8], packed[..., 4:12]) and not overlap(packed[1:, ..., :8], packed[:-1, ..., 8:])
    assert overlap(packed.transpose(1, 2)[..., :8], packed.flatten()[-9:-8])  # the last row's last K element
    assert not overlap(packed.transpose(1, 2)[..., :8], packed.flatten()[-8:])  # its V half


# ----------------------------------------------------------------------------------------------------------------
# An argument on the meta device next to real caches dispatches to the op's fake kernel (meta wins), which must
# refuse it as the kernel would, not silently do nothing (or, for paged_attention, leave `out` unwritten).

META = "meta"
META_ARGUMENTS = {
    "reshape_and_cache: slot_mapping": (
        lambda kc, vc: paged_attn.reshape_and_cache(*kv(), kc, vc, slots(0, 9, 17, device=META)),
        "slot_mapping must be on cpu, got meta"),
    "reshape_and_cache: key and value": (
        lambda kc, vc: paged_attn.reshape_and_cache(*kv(device=META), kc, vc, slots(0, 9, 17)),
        "key and key_cache must be on the same device, got meta and cpu"),
    "copy_blocks: block_mapping": (
        lambda kc, vc: paged_attn.copy_blocks([kc], [vc], torch.tensor([[0, 1]], device=META)),
        "block_mapping must be on the CPU or on the caches' device cpu, got meta"),
    "copy_blocks: a layer's value cache": (
        lambda kc, vc: paged_attn.copy_blocks([kc], [vc.to(META)], [(0, 1)]),
        r"key_caches\[0\] and value_caches\[0\] must be on the same device, got cpu and meta"),
    "swap_blocks: block_mapping": (
        lambda kc, vc: paged_attn.swap_blocks(kc, vc, torch.tensor([[0, 1]], device=META)),
        "block_mapping must be on cpu, got meta"),
    "swap_blocks: dst": (lambda kc, vc: paged_attn.swap_blocks(kc, vc.to(META), [(0, 1)]),
                         "swap_blocks supports CPU and CUDA tensors, got meta"),
    "paged_attention: block_tables": (
        lambda kc, vc: attend_with(kc, vc, block_tables=META), "block_tables must be on cpu, got meta"),
    "paged_attention: seq_lens": (lambda kc, vc: attend_with(kc, vc, seq_lens=META), "seq_lens must be on cpu, got meta"),
    "paged_attention: alibi_slopes": (
        lambda kc, vc: attend_with(kc, vc, alibi_slopes=META), "alibi_slopes must be on cpu, got meta"),
    "paged_attention: out": (lambda kc, vc: attend_with(kc, vc, out=META), r"out must be a Float tensor .* on meta"),
}


def attend_with(key_cache, value_cache, **on_meta):
    """paged_attention over the given caches, with the arguments named in on_meta moved to that device."""
    args = {**attention_args("cpu"), "key_cache": key_cache, "value_cache": value_cache}
    args.update({name: args[name].to(device) for name, device in on_meta.items()})
    torch.ops.paged_attn.paged_attention(**args)


@pytest.mark.parametrize("case", META_ARGUMENTS)
def test_meta_arguments_next_to_real_caches_are_refused(case):
    call, message = META_ARGUMENTS[case]
    key_cache, value_cache = caches()
    with pytest.raises(RuntimeError, match=message):
        call(key_cache, value_cache)
    assert untouched(key_cache, value_cache)


def test_all_meta_calls_propagate_shapes():
    # Everything on the meta device (no real tensor anywhere) is a valid shape-only call of the fake kernels.
    key_cache, value_cache = caches(META)
    paged_attn.reshape_and_cache(*kv(device=META), key_cache, value_cache, slots(0, 9, 17, device=META))
    paged_attn.copy_blocks([key_cache], [value_cache], torch.tensor([[0, 1]], device=META))
    args = {name: arg.to(META) if isinstance(arg, torch.Tensor) else arg for name, arg in attention_args("cpu").items()}
    torch.ops.paged_attn.paged_attention(**args)
