"""Bad input raises a clear error that names what is wrong, and leaves the caches untouched."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import DEVICES, requires_cuda

import paged_attn

NAN = float("nan")


def caches(device="cpu", num_blocks=4, block_size=8, num_kv_heads=2, head_dim=32, dtype=torch.float32):
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), NAN, dtype=dtype, device=device)
    return key_cache, torch.full_like(key_cache, NAN)


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
        "must be float32, float16 or bfloat16",
    ),
    "cache rank": (lambda k, v, kc, vc, s: (k, v, kc[0], vc[0], s), "key_cache must have shape"),
    "cache pair": (lambda k, v, kc, vc, s: (k, v, kc, vc[:2], s), "key_cache and value_cache must have the same shape"),
    "head_dim": (lambda k, v, kc, vc, s: (k[..., :16], v[..., :16], kc, vc, s), "but the cache holds"),
    "num_kv_heads": (lambda k, v, kc, vc, s: (k[:, :1], v[:, :1], kc, vc, s), "but the cache holds"),
    "key last dim": (
        lambda k, v, kc, vc, s: (k.transpose(1, 2).contiguous().transpose(1, 2), v, kc, vc, s),
        "must be contiguous in their last dimension",
    ),
    "cache inner layout": (
        lambda k, v, kc, vc, s: (k, v, kc.transpose(1, 2).contiguous().transpose(1, 2), vc, s),
        "last three dimensions .* must be contiguous",
    ),
    "overlapping blocks": (
        lambda k, v, kc, vc, s: (k, v, kc[:1].expand(4, -1, -1, -1), vc, s),
        "blocks must not overlap",
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
    assert key_cache.isnan().all() and value_cache.isnan().all(), "a failed call wrote to the cache"


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
    assert value_cache.isnan().all()


@pytest.mark.parametrize("device", DEVICES)
def test_copy_blocks_layer_errors(device):
    key_cache, value_cache = caches(device)
    other_shape, _ = caches(device, num_blocks=5)
    with pytest.raises(RuntimeError, match="same number of layers, got 2 and 1"):
        paged_attn.copy_blocks([key_cache, key_cache], [value_cache], [(0, 1)])
    with pytest.raises(RuntimeError, match=r"key_caches\[0\] and key_caches\[1\] must have the same shape"):
        paged_attn.copy_blocks([key_cache, other_shape], [value_cache, value_cache], [(0, 1)])
    with pytest.raises(RuntimeError, match=r"key_caches\[0\] and value_caches\[0\] must have the same dtype"):
        paged_attn.copy_blocks([key_cache], [value_cache.half()], [(0, 1)])
    assert key_cache.isnan().all()


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
    "within a block": (
        lambda src, dst, m: (src.transpose(1, 2).contiguous().transpose(1, 2), dst, m),
        "contiguous within each block",
    ),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", SWAP_ERRORS)
def test_swap_blocks_errors(case, device):
    make_args, message = SWAP_ERRORS[case]
    src = torch.randn(6, 8, 2, 32, device=device)
    dst = torch.full((3, 8, 2, 32), NAN)
    with pytest.raises(RuntimeError, match=message):
        paged_attn.swap_blocks(*make_args(src, dst, torch.tensor([[0, 1]])))
    assert dst.isnan().all()


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
