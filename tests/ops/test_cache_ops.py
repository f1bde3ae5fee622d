"""reshape_and_cache, copy_blocks and swap_blocks against paged_attn.reference.

These ops only move data, so results must be bit-exact. Every cache starts poisoned with NaN and every region an
op must not touch is checked to still be NaN afterwards; the inputs are random normal numbers (never NaN).
"""

import pytest
import torch
from conftest import DEVICES, HAS_CUDA_OPS, requires_cuda

import paged_attn
from paged_attn import reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_DIMS = [64, 80, 128, 256]
BLOCK_SIZES = [8, 16, 32]
NAN = float("nan")


def assert_identical(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


def make_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype, device, layout):
    """NaN-filled key and value caches, plus the allocation that holds them.

    "contiguous": two separate tensors. "strided": key and value are views [:, 0] and [:, 2] of one
    [num_blocks, 3, block_size, num_kv_heads, head_dim] allocation, so the block dimension has a stride of three
    blocks and the middle third ([:, 1]) must never be written.
    """
    if layout == "contiguous":
        key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), NAN, dtype=dtype, device=device)
        value_cache = torch.full_like(key_cache, NAN)
        return key_cache, value_cache, [key_cache, value_cache]
    alloc = torch.full((num_blocks, 3, block_size, num_kv_heads, head_dim), NAN, dtype=dtype, device=device)
    return alloc[:, 0], alloc[:, 2], [alloc]


def make_kv(num_tokens, num_kv_heads, head_dim, dtype, device, layout, num_heads=None):
    """Random key and value [num_tokens, num_kv_heads, head_dim]; with layout="strided" they are slices of a fused
    QKV projection output [num_tokens, num_heads + 2 * num_kv_heads, head_dim] (strided token dimension)."""
    if layout == "contiguous":
        key = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
        return key, torch.randn_like(key)
    num_heads = num_heads or 2 * num_kv_heads
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype, device=device)
    key = qkv[:, num_heads : num_heads + num_kv_heads]
    value = qkv[:, num_heads + num_kv_heads :]
    assert not key.is_contiguous()
    return key, value


def random_slots(num_tokens, num_blocks, block_size, device, num_padding=3):
    """Distinct random slots in random (non-contiguous) blocks, with num_padding tokens marked -1."""
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[torch.randperm(num_tokens)[:num_padding]] = -1
    return slots.to(device)


def written_mask(slot_mapping, num_blocks, block_size):
    mask = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    slots = slot_mapping.cpu()
    mask[slots[slots >= 0]] = True
    return mask.view(num_blocks, block_size)


# ----------------------------------------------------------------------------------------------------------------
# reshape_and_cache


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache(dtype, head_dim, block_size, layout, device):
    num_tokens, num_kv_heads, num_blocks = 45, 3, 11
    key, value = make_kv(num_tokens, num_kv_heads, head_dim, dtype, device, layout)
    key_cache, value_cache, allocs = make_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype, device, layout)
    slot_mapping = random_slots(num_tokens, num_blocks, block_size, device)

    expected = [a.clone() for a in allocs]
    if layout == "contiguous":
        reference.reshape_and_cache(key, value, expected[0], expected[1], slot_mapping)
    else:
        reference.reshape_and_cache(key, value, expected[0][:, 0], expected[0][:, 2], slot_mapping)
    paged_attn.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    for actual, want in zip(allocs, expected):
        assert_identical(actual, want)

    written = written_mask(slot_mapping, num_blocks, block_size).to(device)
    for cache, source in ((key_cache, key), (value_cache, value)):
        assert not cache[written].isnan().any()
        assert cache[~written].isnan().all(), "a slot that no token maps to was written"
        # Explicitly: token i's rows sit in slot slot_mapping[i].
        i = int((slot_mapping >= 0).nonzero()[0])
        slot = int(slot_mapping[i])
        assert torch.equal(cache[slot // block_size, slot % block_size], source[i])
    if layout == "strided":
        assert allocs[0][:, 1].isnan().all(), "the gap between the key and value views was written"


@pytest.mark.parametrize("device", DEVICES)
def test_reshape_and_cache_gqa_fused_and_all_padding(device):
    # A fused QKV projection of a GQA model (num_heads = 8, num_kv_heads = 2), one token per slot of a single block.
    key, value = make_kv(16, 2, 64, torch.float16, device, "strided", num_heads=8)
    key_cache, value_cache, _ = make_caches(4, 16, 2, 64, torch.float16, device, "contiguous")
    slot_mapping = torch.arange(32, 48, device=device)
    paged_attn.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    assert torch.equal(key_cache[2], key) and torch.equal(value_cache[2], value)
    assert key_cache[[0, 1, 3]].isnan().all()

    # Only padding: nothing is written. No tokens at all: nothing happens.
    before = key_cache.clone()
    paged_attn.reshape_and_cache(key, value, key_cache, value_cache, torch.full((16,), -1, device=device))
    empty = key[:0]
    paged_attn.reshape_and_cache(empty, empty, key_cache, value_cache, torch.empty(0, dtype=torch.int64, device=device))
    assert_identical(key_cache, before)


# ----------------------------------------------------------------------------------------------------------------
# copy_blocks


def random_block_mapping(num_blocks, num_pairs):
    """(src, dst) pairs over distinct random blocks: destinations distinct and never sources."""
    blocks = torch.randperm(num_blocks)[: 2 * num_pairs]
    return torch.stack([blocks[:num_pairs], blocks[num_pairs:]], dim=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks(dtype, head_dim, block_size, layout, device):
    num_layers, num_blocks, num_kv_heads, num_pairs = 3, 24, 2, 7
    key_caches, value_caches, allocs = [], [], []
    for _ in range(num_layers):
        key_cache, value_cache, layer_allocs = make_caches(
            num_blocks, block_size, num_kv_heads, head_dim, dtype, device, layout
        )
        # Random data in the even blocks; the odd blocks stay NaN-poisoned.
        key_cache[::2] = torch.randn_like(key_cache[::2])
        value_cache[::2] = torch.randn_like(value_cache[::2])
        key_caches.append(key_cache)
        value_caches.append(value_cache)
        allocs += layer_allocs
    block_mapping = random_block_mapping(num_blocks, num_pairs)

    expected = [a.clone() for a in allocs]
    reference.copy_blocks(key_caches_of(expected, layout), value_caches_of(expected, layout), block_mapping)
    paged_attn.copy_blocks(key_caches, value_caches, block_mapping)
    for actual, want in zip(allocs, expected):
        assert_identical(actual, want)

    # Each destination now holds its source; every other poisoned (odd) block is still all NaN.
    poisoned = torch.zeros(num_blocks, dtype=torch.bool)
    poisoned[1::2] = True
    poisoned[block_mapping[:, 1]] = False
    for cache in key_caches + value_caches:
        for src, dst in block_mapping.tolist():
            assert_identical(cache[dst], cache[src])
        assert cache[poisoned.to(device)].isnan().all()
    if layout == "strided":
        for alloc in allocs:
            assert alloc[:, 1].isnan().all(), "the gap between the key and value views was written"


def key_caches_of(allocs, layout):
    return allocs[0::2] if layout == "contiguous" else [a[:, 0] for a in allocs]


def value_caches_of(allocs, layout):
    return allocs[1::2] if layout == "contiguous" else [a[:, 2] for a in allocs]


@pytest.mark.parametrize("device", DEVICES)
def test_copy_blocks_many_layers_and_list_mapping(device):
    # More layers than one CUDA launch carries (128), and the mapping as a plain list of pairs.
    key_caches = [torch.randn(6, 8, 1, 32, device=device) for _ in range(130)]
    value_caches = [torch.randn(6, 8, 1, 32, device=device) for _ in range(130)]
    expected_k = [c.clone() for c in key_caches]
    expected_v = [c.clone() for c in value_caches]
    reference.copy_blocks(expected_k, expected_v, torch.tensor([[0, 5], [2, 3]]))
    paged_attn.copy_blocks(key_caches, value_caches, [(0, 5), (2, 3)])
    for actual, want in zip(key_caches + value_caches, expected_k + expected_v):
        assert_identical(actual, want)
    # Nothing to copy: no error, nothing changes.
    paged_attn.copy_blocks(key_caches, value_caches, torch.empty(0, 2, dtype=torch.int64))
    paged_attn.copy_blocks([], [], [(0, 1)])
    for actual, want in zip(key_caches, expected_k):
        assert_identical(actual, want)


@requires_cuda
def test_copy_blocks_mapping_on_device():
    key_caches = [torch.randn(8, 16, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2)]
    value_caches = [torch.randn_like(c) for c in key_caches]
    expected_k = [c.clone() for c in key_caches]
    expected_v = [c.clone() for c in value_caches]
    mapping = torch.tensor([[1, 6], [3, 0]])
    reference.copy_blocks(expected_k, expected_v, mapping)
    paged_attn.copy_blocks(key_caches, value_caches, mapping.cuda())
    for actual, want in zip(key_caches + value_caches, expected_k + expected_v):
        assert_identical(actual, want)


@requires_cuda
def test_copy_blocks_cpu_mapping_may_be_overwritten_at_once():
    # A pinned CPU mapping used to be uploaded asynchronously from the caller's own memory (pin_memory() returns
    # the tensor itself when it is already pinned): overwriting it right after the call changed the copy.
    key_caches = [torch.randn(8, 16, 2, 64, device="cuda")]
    value_caches = [torch.randn_like(key_caches[0])]
    expected_k, expected_v = [key_caches[0].clone()], [value_caches[0].clone()]
    mapping = torch.tensor([[1, 6], [3, 0]]).pin_memory()
    reference.copy_blocks(expected_k, expected_v, mapping)
    torch.cuda._sleep(50_000_000)  # keep the stream busy, so that the upload runs after the overwrite below
    paged_attn.copy_blocks(key_caches, value_caches, mapping)
    mapping.copy_(torch.tensor([[2, 7], [4, 5]]))
    torch.cuda.synchronize()
    assert_identical(key_caches[0], expected_k[0])
    assert_identical(value_caches[0], expected_v[0])


@requires_cuda
def test_copy_blocks_with_a_device_mapping_is_captured_in_a_cuda_graph():
    # A mapping on the caches' device is read by the kernel when it runs, so a captured copy_blocks replays with
    # the mapping's contents at replay time. (A CPU mapping is not capturable; neither is validation mode.)
    key_caches = [torch.randn(8, 16, 2, 64, device="cuda") for _ in range(2)]
    value_caches = [torch.randn_like(c) for c in key_caches]
    mapping = torch.tensor([[1, 6], [3, 0]], device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph, as torch.cuda.graph requires
        paged_attn.copy_blocks(key_caches, value_caches, mapping)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attn.copy_blocks(key_caches, value_caches, mapping)
    mapping.copy_(torch.tensor([[2, 7], [4, 5]]))
    for cache in key_caches + value_caches:
        cache.copy_(torch.randn_like(cache))
    expected_k = [c.clone() for c in key_caches]
    expected_v = [c.clone() for c in value_caches]
    reference.copy_blocks(expected_k, expected_v, mapping.cpu())
    graph.replay()
    torch.cuda.synchronize()
    for actual, want in zip(key_caches + value_caches, expected_k + expected_v):
        assert_identical(actual, want)


@requires_cuda
def test_cuda_cache_ops_refuse_a_zero_block_size():
    # check_cache refuses it at the door on every backend: the kernels divide by block_size.
    key_cache = torch.empty(4, 0, 2, 64, device="cuda")
    value_cache = torch.empty_like(key_cache)
    key = torch.randn(3, 2, 64, device="cuda")
    message = "block_size, num_kv_heads and head_dim must be positive"
    with pytest.raises(RuntimeError, match=message):
        torch.ops.paged_attn.reshape_and_cache(key, key.clone(), key_cache, value_cache,
                                               torch.zeros(3, dtype=torch.int64, device="cuda"))
    with pytest.raises(RuntimeError, match=message):
        torch.ops.paged_attn.copy_blocks([key_cache], [value_cache], torch.tensor([[0, 1]]))


# ----------------------------------------------------------------------------------------------------------------
# swap_blocks

SWAP_DEVICE_PAIRS = [
    ("cpu", "cpu"),
    pytest.param("cuda", "cpu", marks=requires_cuda),
    pytest.param("cpu", "cuda", marks=requires_cuda),
    pytest.param("cuda", "cuda", marks=requires_cuda),
]


@pytest.mark.parametrize("src_device,dst_device", SWAP_DEVICE_PAIRS)
@pytest.mark.parametrize("pinned", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_blocks(dtype, layout, pinned, src_device, dst_device):
    if pinned and not HAS_CUDA_OPS:
        pytest.skip("pinned memory needs a CUDA GPU")
    num_src_blocks, num_dst_blocks, block_size, num_kv_heads, head_dim = 20, 14, 16, 2, 80

    def alloc(num_blocks, device):
        pin = pinned and device == "cpu"
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        if layout == "strided":
            shape = (num_blocks, 2) + shape[1:]
        full = torch.full(shape, NAN, dtype=dtype, pin_memory=pin).to(device) if not pin else torch.full(
            shape, NAN, dtype=dtype
        ).pin_memory()
        return full, (full if layout == "contiguous" else full[:, 1])

    src_alloc, src = alloc(num_src_blocks, src_device)
    src.copy_(torch.randn(src.shape, dtype=dtype))
    dst_alloc, dst = alloc(num_dst_blocks, dst_device)
    # Runs of consecutive ids (3,4,5 -> 10,11,12 and 7,8 -> 1,2) mixed with single pairs, in shuffled order.
    pairs = [(3, 10), (4, 11), (5, 12), (19, 0), (7, 1), (8, 2), (0, 13), (12, 5)]
    block_mapping = torch.tensor(pairs)[torch.randperm(len(pairs))]

    expected = dst_alloc.clone()
    expected_view = expected if layout == "contiguous" else expected[:, 1]
    reference.swap_blocks(src, expected_view, block_mapping)
    paged_attn.swap_blocks(src, dst, block_mapping)
    if "cuda" in (src_device, dst_device):
        torch.cuda.synchronize()
    assert_identical(dst_alloc, expected)
    written = torch.zeros(num_dst_blocks, dtype=torch.bool)
    written[block_mapping[:, 1]] = True
    assert not dst[written.to(dst_device)].isnan().any()
    assert dst[(~written).to(dst_device)].isnan().all()
    if layout == "strided":
        assert dst_alloc[:, 0].isnan().all()


@pytest.mark.parametrize("device", DEVICES)
def test_swap_blocks_within_one_cache_and_empty(device):
    cache = torch.randn(10, 8, 2, 32, device=device)
    expected = cache.clone()
    reference.swap_blocks(expected.clone(), expected, torch.tensor([[0, 9], [1, 8]]))
    paged_attn.swap_blocks(cache, cache, [(0, 9), (1, 8)])
    assert_identical(cache, expected)
    paged_attn.swap_blocks(cache, cache, torch.empty(0, 2, dtype=torch.int64))
    assert_identical(cache, expected)


@pytest.mark.skipif(not HAS_CUDA_OPS or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_swap_blocks_between_two_gpus_is_ordered_on_both_devices():
    # The copies run on the source device's current stream; they must wait for the work already queued on the
    # destination device's current stream, and that stream's later work must wait for them.
    src = torch.randn(6, 16, 2, 64, device="cuda:0")
    dst = torch.zeros(6, 16, 2, 64, device="cuda:1")
    with torch.cuda.device(1):
        torch.cuda._sleep(50_000_000)
        dst.fill_(1.0)  # queued on cuda:1 behind the sleep: the swap must not be overwritten by it
    with torch.cuda.device(0):
        paged_attn.swap_blocks(src, dst, torch.tensor([[0, 3], [5, 1]]))
    with torch.cuda.device(1):
        seen = dst.clone()  # queued on cuda:1 right after the swap: it must see the copied blocks
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    assert_identical(seen[3], src[0].to("cuda:1"))
    assert_identical(seen[1], src[5].to("cuda:1"))
    assert (seen[[0, 2, 4, 5]] == 1.0).all()


# ----------------------------------------------------------------------------------------------------------------
# CPU: work large enough to be split over threads (ops move >= 1 MiB per task; the tests above fit in one task)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_cpu_cache_ops_split_over_threads(cache_dtype):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        num_tokens, num_kv_heads, head_dim, block_size, num_blocks = 4096, 4, 128, 16, 400  # 16 MiB of float32 k/v
        key, value = make_kv(num_tokens, num_kv_heads, head_dim, torch.float32, "cpu", "strided")
        key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), NAN).to(cache_dtype)
        value_cache = torch.full_like(key_cache, NAN)
        slot_mapping = random_slots(num_tokens, num_blocks, block_size, "cpu", num_padding=100)
        expected = [key_cache.clone(), value_cache.clone()]
        reference.reshape_and_cache(key, value, *expected, slot_mapping)
        paged_attn.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        assert_identical(key_cache.float(), expected[0].float())
        assert_identical(value_cache.float(), expected[1].float())

        # copy_blocks over 4 layers x 100 pairs x (key, value) of 32 KiB float32 blocks; swap_blocks of 100 blocks
        caches = [(key_cache.clone(), value_cache.clone()) for _ in range(4)]
        mapping = random_block_mapping(num_blocks, 100)
        expected = [(k.clone(), v.clone()) for k, v in caches]
        reference.copy_blocks([k for k, _ in expected], [v for _, v in expected], mapping)
        paged_attn.copy_blocks([k for k, _ in caches], [v for _, v in caches], mapping)
        for (k, v), (k_want, v_want) in zip(caches, expected):
            assert_identical(k.float(), k_want.float())
            assert_identical(v.float(), v_want.float())
        dst = torch.full_like(key_cache, NAN)
        paged_attn.swap_blocks(key_cache, dst, mapping)
        assert_identical(dst[mapping[:, 1]].float(), key_cache[mapping[:, 0]].float())
        untouched = torch.ones(num_blocks, dtype=torch.bool)
        untouched[mapping[:, 1]] = False
        assert dst[untouched].float().isnan().all()
    finally:
        torch.set_num_threads(threads)
