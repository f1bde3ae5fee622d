"""The ops as torch.library citizens: schemas and fake kernels pass opcheck, torch.compile traces them whole."""

import pytest
import test_attention as attention
import test_cache_ops_errors as errors
import test_fake_aliasing as aliasing
import test_fp8 as fp8
import test_merge_attention_states as merge
import test_varlen_attention as varlen
import torch
import torch.utils._pytree as pytree
from conftest import DEVICES
from torch._subclasses.fake_tensor import FakeTensorMode

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


# ----------------------------------------------------------------------------------------------------------------
# The fake kernels (paged_attn/fakes.py) check what the kernels check, with the same exception type and message:
# every error case of the op tests, run once for real on the CPU and once on fake tensors, gives the same error,
# except the cases listed below as real-only, each with why a fake cannot see it; those the fake must let pass.
# Memory overlap is compared by place in a storage (a fake has no address: where a message names one, the fake
# names its offset in its storage; tests/ops/test_fake_aliasing.py holds every mode to the overlap rule).

REAL_ONLY = {
    "strides: the fakes check shapes, dtypes and devices; layouts are checked on the real tensors": {
        ("reshape_and_cache", "key last dim"), ("reshape_and_cache", "cache last dim"),
        ("reshape_and_cache", "overlapping blocks"), ("reshape_and_cache", "overlapping rows"),
        ("swap_blocks", "layouts differ within a block"), ("swap_blocks", "overlapping elements"),
        ("swap_blocks", "overlapping block spans"),
        ("merge_attention_states", "out_a last dim"), ("merge_attention_states", "out last dim"),
        ("merge_attention_states", "out overlaps itself"), ("merge_attention_states", "lse overlaps itself"),
    },
    "index values: a fake tensor has no values": {
        ("reshape_and_cache", "slot range"),
        ("copy_blocks", "source range"), ("copy_blocks", "negative source"), ("copy_blocks", "destination range"),
        ("copy_blocks", "destination = num_blocks"), ("copy_blocks", "duplicate destination"),
        ("copy_blocks", "destination is source"),
        ("swap_blocks", "source range"), ("swap_blocks", "destination range"),
        ("swap_blocks", "duplicate destination"),
        ("paged_attention varlen", "first"), ("paged_attention varlen", "decreasing"),
        ("paged_attention varlen", "last"), ("paged_attention varlen", "too many rows"),
        ("paged_attention varlen", "rows of an empty sequence"), ("paged_attention varlen", "max_query_len"),
        ("paged_attention", "seq too long"), ("paged_attention", "negative length"), ("paged_attention", "block id"),
        ("paged_attention", "block id = num_blocks"), ("paged_attention", "seq one past the table"),
    },
    "scale values: a fake input has no value (one made as a constant while tracing has: tests/ops/test_fp8.py)": {
        ("fp8", "zero k_scale"), ("fp8", "attention NaN v_scale"),
    },
}
REAL_ONLY_CASES = {case: reason for reason, cases in REAL_ONLY.items() for case in cases}


def error_cases():
    """(op, case name) for every error case of tests/ops/test_cache_ops_errors.py, tests/ops/test_attention.py,
    tests/ops/test_fp8.py and tests/ops/test_merge_attention_states.py."""
    cases = [("reshape_and_cache", name) for name in errors.RESHAPE_ERRORS]
    cases += [("copy_blocks", name) for name in errors.COPY_ERRORS]
    cases += [("swap_blocks", name) for name in errors.SWAP_ERRORS]
    cases += [("paged_attention varlen", name) for name in varlen.ERRORS]
    cases += [("fp8", name) for name in fp8.ERRORS]
    cases += [("merge_attention_states", name) for name in merge.ERRORS]
    return cases + [("paged_attention", name) for name in attention.ERRORS]


def error_call(op, name):
    """The wrapper, positional and keyword arguments of one error case, on the CPU."""
    if op == "reshape_and_cache":
        return paged_attn.reshape_and_cache, errors.RESHAPE_ERRORS[name][0](
            *errors.kv(), *errors.caches(), errors.slots(0, 9, 17)), {}
    if op == "copy_blocks":
        key_cache, value_cache = errors.caches()
        return paged_attn.copy_blocks, ([key_cache], [value_cache], errors.COPY_ERRORS[name][0](torch.tensor([[0, 1]]))), {}
    if op == "swap_blocks":
        src, (dst, _) = torch.randn(6, 8, 2, 32), errors.caches(num_blocks=3)
        return paged_attn.swap_blocks, errors.SWAP_ERRORS[name][0](src, dst, torch.tensor([[0, 1]])), {}
    if op == "fp8":
        return fp8.error_call(name)
    if op == "merge_attention_states":
        args, kwargs = merge.ERRORS[name][0](*merge.error_parts())
        return paged_attn.merge_attention_states, args, kwargs
    if op == "paged_attention varlen":
        case = varlen.make_varlen_case(varlen.MIXED, 4, 2, 64, 16, torch.float32, "cpu")
        kwargs = varlen._bad(case, **varlen.ERRORS[name][0])  # query_start_loc (and max_query_len) by keyword
        positional = [kwargs.pop(k) for k in ("query", "key_cache", "value_cache", "block_tables", "seq_lens")]
        return paged_attn.paged_attention, positional, kwargs
    make_args, kwargs, _, _ = attention.ERRORS[name]
    return paged_attn.paged_attention, make_args(*attention.error_case()), kwargs


def error_of(call):
    try:
        call()
    except (RuntimeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return None


@pytest.mark.parametrize("op,name", error_cases())
def test_fakes_give_the_kernels_errors(op, name):
    fn, args, kwargs = error_call(op, name)
    real = error_of(lambda: fn(*args, **kwargs))
    assert real is not None, "not an error case"
    with FakeTensorMode() as mode:
        fake_args, fake_kwargs = pytree.tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
        fake = error_of(lambda: fn(*fake_args, **fake_kwargs))
    if (op, name) in REAL_ONLY_CASES:
        assert fake is None, f"listed as real-only ({REAL_ONLY_CASES[op, name]}), but the fake raises {fake}"
    else:
        assert aliasing.without_addresses(fake) == aliasing.without_addresses(real)


def test_every_real_only_case_is_an_error_case():
    assert set(REAL_ONLY_CASES) <= set(error_cases())


def test_torch_compile_refuses_bad_input_while_tracing():
    key, value, key_cache, value_cache, slot_mapping = small_case("cpu")
    compiled = torch.compile(paged_attn.reshape_and_cache, fullgraph=True)
    with pytest.raises(torch._dynamo.exc.TorchRuntimeError, match="slot_mapping must be Long, got Int"):
        compiled(key, value, key_cache, value_cache, slot_mapping.int())
    with pytest.raises(torch._dynamo.exc.TorchRuntimeError, match="key_cache: block_size, num_kv_heads and head_dim"):
        compiled(key, value, key_cache[:, :0], value_cache[:, :0], slot_mapping)
