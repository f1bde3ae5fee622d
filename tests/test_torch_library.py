"""The ops as torch.library citizens: schemas and fake kernels pass opcheck, torch.compile traces them whole."""

import pytest
import torch
from conftest import DEVICES

import paged_attn
from paged_attn import reference


def small_case(device):
    key_cache = torch.randn(6, 8, 2, 32, device=device)
    value_cache = torch.randn_like(key_cache)
    key = torch.randn(5, 2, 32, device=device)
    value = torch.randn_like(key)
    slot_mapping = torch.tensor([3, -1, 17, 40, 9], device=device)
    return key, value, key_cache, value_cache, slot_mapping


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_reshape_and_cache(device):
    torch.library.opcheck(torch.ops.paged_attn.reshape_and_cache.default, small_case(device))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_copy_blocks(device):
    _, _, key_cache, value_cache, _ = small_case(device)
    args = ([key_cache, key_cache.clone()], [value_cache, value_cache.clone()], torch.tensor([[0, 3], [4, 1]]))
    torch.library.opcheck(torch.ops.paged_attn.copy_blocks.default, args)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_swap_blocks(device):
    src = torch.randn(6, 8, 2, 32, device=device)
    dst = torch.randn(4, 8, 2, 32)
    torch.library.opcheck(torch.ops.paged_attn.swap_blocks.default, (src, dst, torch.tensor([[0, 3], [5, 1]])))


def write_then_copy(key, value, key_cache, value_cache, slot_mapping, block_mapping, cpu_cache):
    paged_attn.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    paged_attn.copy_blocks([key_cache], [value_cache], block_mapping)
    paged_attn.swap_blocks(key_cache, cpu_cache, block_mapping)
    return key_cache.sum() + value_cache.sum()


def test_torch_compile_fullgraph():
    key, value, key_cache, value_cache, slot_mapping = small_case("cpu")
    block_mapping = torch.tensor([[0, 4], [2, 5]])
    cpu_cache = torch.zeros_like(key_cache)
    expected = [t.clone() for t in (key_cache, value_cache, cpu_cache)]
    reference.reshape_and_cache(key, value, expected[0], expected[1], slot_mapping)
    reference.copy_blocks([expected[0]], [expected[1]], block_mapping)
    reference.swap_blocks(expected[0], expected[2], block_mapping)

    compiled = torch.compile(write_then_copy, fullgraph=True)
    total = compiled(key, value, key_cache, value_cache, slot_mapping, block_mapping, cpu_cache)
    for actual, want in zip((key_cache, value_cache, cpu_cache), expected):
        torch.testing.assert_close(actual, want, rtol=0, atol=0)
    torch.testing.assert_close(total, expected[0].sum() + expected[1].sum())
