"""The cache ops on strided caches: the K and V halves of vLLM's packed [num_blocks, block_size, num_kv_heads,
2 * head_dim] cache (head stride 2 * head_dim), and a cache with its token and head dimensions transposed in memory.
Each op must touch exactly the elements of its views: everything else stays NaN (or its old value)."""

import pytest
import torch
from conftest import DEVICES

import paged_attn
from paged_attn import reference

NAN = float("nan")
NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 6, 8, 2, 32


def packed(device, dtype=torch.float32):
    """(allocation, key view, value view) of a NaN-filled packed K|V cache."""
    alloc = torch.full((NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, 2 * HEAD_DIM), NAN, dtype=dtype, device=device)
    return alloc, alloc[..., :HEAD_DIM], alloc[..., HEAD_DIM:]


def transposed(device, dtype=torch.float32):
    """A NaN-filled cache whose memory order is [num_blocks, num_kv_heads, block_size, head_dim]."""
    alloc = torch.full((NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM), NAN, dtype=dtype, device=device)
    return alloc, alloc.transpose(1, 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_into_packed_halves(device, dtype):
    alloc, key_cache, value_cache = packed(device, dtype)
    key = torch.randn(5, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    value = torch.randn(5, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    slots = torch.tensor([3, 17, -1, 40, 9], device=device)
    paged_attn.reshape_and_cache(key, value, key_cache, value_cache, slots)
    expected = torch.full_like(alloc, NAN)
    reference.reshape_and_cache(key, value, expected[..., :HEAD_DIM], expected[..., HEAD_DIM:], slots)
    torch.testing.assert_close(alloc, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
def test_reshape_and_cache_into_transposed_cache(device):
    (key_alloc, key_cache), (value_alloc, value_cache) = transposed(device), transposed(device)
    key, value = torch.randn(4, NUM_KV_HEADS, HEAD_DIM, device=device), torch.randn(4, NUM_KV_HEADS, HEAD_DIM,
                                                                                    device=device)
    slots = torch.tensor([0, 9, 47, 20], device=device)
    paged_attn.reshape_and_cache(key, value, key_cache, value_cache, slots)
    expected_key, expected_value = transposed(device)[1], transposed(device)[1]
    reference.reshape_and_cache(key, value, expected_key, expected_value, slots)
    torch.testing.assert_close(key_cache, expected_key, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(value_cache, expected_value, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
def test_copy_blocks_copies_only_its_half(device):
    """Copying blocks of the K view leaves the V rows between them alone (and vice versa)."""
    alloc, key_cache, value_cache = packed(device)
    alloc.copy_(torch.randn_like(alloc))
    value_cache[4] = NAN  # V of the destination block: must stay NaN when only K is copied
    before = alloc.clone()
    paged_attn.copy_blocks([key_cache], [torch.randn_like(value_cache)], [(1, 4), (2, 5)])
    expected = before.clone()
    expected[4, ..., :HEAD_DIM] = before[1, ..., :HEAD_DIM]
    expected[5, ..., :HEAD_DIM] = before[2, ..., :HEAD_DIM]
    torch.testing.assert_close(alloc, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
def test_copy_blocks_transposed_and_packed(device):
    alloc, key_cache, value_cache = packed(device)
    alloc.copy_(torch.randn_like(alloc))
    t_alloc, t_cache = transposed(device)
    t_alloc.copy_(torch.randn_like(t_alloc))
    u_alloc, u_cache = transposed(device)
    u_alloc.copy_(torch.randn_like(u_alloc))
    expected = [c.clone() for c in (key_cache, t_cache, value_cache, u_cache)]
    reference.copy_blocks(expected[:2], expected[2:], torch.tensor([[0, 3], [5, 1]]))
    paged_attn.copy_blocks([key_cache, t_cache], [value_cache, u_cache], [(0, 3), (5, 1)])
    for actual, want in zip((key_cache, t_cache, value_cache, u_cache), expected):
        torch.testing.assert_close(actual, want, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_swap_blocks_of_packed_halves(device):
    """Swapping the K view copies each block's span (K rows and the V rows between them); swapping V as well with
    the same mapping leaves the destination blocks equal to the source blocks, and nothing else changes."""
    src, src_key, src_value = packed(device)
    src.copy_(torch.randn_like(src))
    dst, dst_key, dst_value = packed("cpu")
    mapping = torch.tensor([[0, 2], [3, 5], [4, 0]])
    paged_attn.swap_blocks(src_key, dst_key, mapping)
    paged_attn.swap_blocks(src_value, dst_value, mapping)
    expected = torch.full_like(dst, NAN)
    for s, d in mapping.tolist():
        expected[d] = src[s].cpu()
    torch.testing.assert_close(dst, expected, rtol=0, atol=0, equal_nan=True)


def test_swap_blocks_refuses_mismatched_views():
    src, src_key, _ = packed("cpu")
    dst = torch.empty(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)  # packed rows: other strides than a half
    with pytest.raises(RuntimeError, match="src and dst must have the same strides within a block"):
        paged_attn.swap_blocks(src_key, dst, [(0, 1)])


@pytest.mark.parametrize("device", DEVICES)
def test_attention_reads_transposed_cache(device):
    """paged_attention on a cache whose token and head dimensions are transposed in memory."""
    (k_alloc, key_cache), (v_alloc, value_cache) = transposed(device), transposed(device)
    k_alloc.copy_(torch.randn_like(k_alloc))
    v_alloc.copy_(torch.randn_like(v_alloc))
    query = torch.randn(9, 4, HEAD_DIM, device=device)
    block_tables = torch.tensor([[3, 1, 0], [5, 2, 4]], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([20, 7], dtype=torch.int32, device=device)
    starts = torch.tensor([0, 5, 9], dtype=torch.int32, device=device)
    actual = paged_attn.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc=starts)
    want = reference.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc=starts)
    torch.testing.assert_close(actual, want, rtol=1e-5, atol=1e-5)
