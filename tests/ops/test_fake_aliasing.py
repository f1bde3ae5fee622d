"""Memory overlap is one rule in every mode: a tensor an op writes shares no byte with another argument (swap_blocks:
no byte of what dst's blocks span), refused with the same error eagerly (the kernels' check, csrc/common.cpp),
under torch.compile(fullgraph=True) and on meta tensors (the fakes' check, paged_attn/fakes.py); views of one
storage that share no byte are accepted in all three."""

import re

import pytest
import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef

import paged_attn

NAN = float("nan")
FP8 = torch.float8_e4m3fn


def on_meta(tree):
    """tree with its tensors on the meta device, views of one storage still views of one (meta) storage."""
    storages = {}

    def to_meta(t):
        storage = t.untyped_storage()
        meta = storages.setdefault(StorageWeakRef(storage), torch.UntypedStorage(storage.nbytes(), device="meta"))
        return torch.empty(0, dtype=t.dtype, device="meta").set_(meta, t.storage_offset(), t.shape, t.stride())

    return pytree.tree_map_only(torch.Tensor, to_meta, tree)


def compiled(op, **options):
    """op under torch.compile(fullgraph=True), with aot_eager unless options say otherwise: functionalization without
    code generation. Functionalized, the kernel runs on a copy of what it writes and cannot see the overlap, so only
    the fake's check, while tracing, stands (the "eager" backend would leave it to the kernel at run time)."""

    def call(*args, **kwargs):
        return op(*args, **kwargs)

    torch._dynamo.reset()  # every case traces the same code: a fresh cache, no recompilation limit
    return torch.compile(call, fullgraph=True, **{"backend": "aot_eager", **options})


# ----------------------------------------------------------------------------------------------------------------
# The calls: each function makes fresh CPU arguments (the same ones every time: fixed seeds) and returns
# (op, args, kwargs).

def cache_op_args(dtype=torch.float32):
    """key, value [3, 2, 32] (float32); key_cache, value_cache [4, 8, 2, 32] of dtype; slot_mapping."""
    gen = torch.Generator().manual_seed(0)
    key, value = (torch.randn(3, 2, 32, generator=gen) for _ in "kv")
    key_cache, value_cache = (torch.randn(4, 8, 2, 32, generator=gen).to(dtype) for _ in "kv")
    return key, value, key_cache, value_cache, torch.tensor([0, 9, 17])


def cache_op(op, change, dtype=torch.float32):
    """op on change(*cache_op_args(dtype)): positional arguments, or (positional, keyword) for fp8 caches' scales."""
    def call():
        args = change(*cache_op_args(dtype))
        return (op, *args) if dtype == FP8 else (op, args, {})
    return call


def with_changes(op, make_args, change):
    """A function giving op on make_args() (by name), each argument named in change replaced, in order, by
    change[name](args)."""
    def call():
        args = make_args()
        for name, make in change.items():
            args[name] = make(args)
        return op, (), args
    return call


def attention_args(dtype):
    """paged_attention's arguments for a decode of two sequences, 4 query heads over 2 kv heads, caches of dtype."""
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, 32, generator=gen)
    key_cache, value_cache = (torch.randn(4, 8, 2, 32, generator=gen).to(dtype) for _ in "kv")
    return dict(out=torch.empty_like(query), query=query, key_cache=key_cache, value_cache=value_cache,
                block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                seq_lens=torch.tensor([5, 9], dtype=torch.int32), scale=0.5, alibi_slopes=torch.rand(4, generator=gen),
                sliding_window=0, logits_soft_cap=0.0)


def attention(dtype=torch.float32, **change):
    return with_changes(torch.ops.paged_attn.paged_attention, lambda: attention_args(dtype), change)


def mla_args():
    """mla_attention's arguments for a decode of two sequences, 4 heads, kv_lora_rank 64 + rope_dim 16."""
    gen = torch.Generator().manual_seed(0)
    return dict(out=torch.empty(2, 4, 64), query=torch.randn(2, 4, 80, generator=gen),
                kv_cache=torch.randn(4, 8, 80, generator=gen),
                block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                seq_lens=torch.tensor([5, 9], dtype=torch.int32), kv_lora_rank=64, scale=0.1, lse=torch.empty(2, 4))


def mla(**change):
    return with_changes(torch.ops.paged_attn.mla_attention, mla_args, change)


def merge_args():
    """merge_attention_states' arguments for 3 tokens, 2 heads, head_dim 32."""
    gen = torch.Generator().manual_seed(0)
    out_a, out_b = (torch.randn(3, 2, 32, generator=gen) for _ in "ab")
    lse_a, lse_b = (torch.randn(3, 2, generator=gen) for _ in "ab")
    return dict(out=torch.empty(3, 2, 32), lse=torch.empty(3, 2), out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b)


def merge(**change):
    return with_changes(torch.ops.paged_attn.merge_attention_states, merge_args, change)


def ints(t, n, dtype=torch.int32):
    """n dtype elements read from t's first bytes (an index tensor that overlaps t)."""
    return t.view(-1).view(torch.uint8)[: n * dtype.itemsize].view(dtype)


def packed_halves(num_blocks=4):
    """The K and V halves of vLLM's packed [num_blocks, 8, 2, 2 * 32] K|V cache: interleaved, no byte in common."""
    packed = torch.randn(num_blocks, 8, 2, 2 * 32, generator=torch.Generator().manual_seed(1))
    return packed[..., :32], packed[..., 32:]


def sharing_one_element(num_blocks=4):
    """Two [num_blocks, 8, 2, 32] caches with exactly one element in common: the first's last, the second's first."""
    n = num_blocks * 8 * 2 * 32
    flat = torch.full((2 * n - 1,), NAN)
    return flat[:n].view(num_blocks, 8, 2, 32), flat[n - 1:].view(num_blocks, 8, 2, 32)


def latent_rows_inside_the_cache():
    kv_cache = torch.randn(4, 8, 80, generator=torch.Generator().manual_seed(0))
    return paged_attn.concat_and_cache_mla, (kv_cache[1, :3, :64], torch.randn(3, 16), kv_cache,
                                             torch.tensor([0, 9, 31])), {}


# name: (a function giving (op, args, kwargs), the two arguments the error names). Every op, each kind of tensor it
# writes against each kind of argument (an output, a cache, an index tensor, a scale); swap_blocks' two span rules.
RC, CB, SB = paged_attn.reshape_and_cache, paged_attn.copy_blocks, paged_attn.swap_blocks
REFUSED = {
    "reshape_and_cache: one tensor as both caches": (
        cache_op(RC, lambda k, v, kc, vc, s: (k, v, kc, kc, s)), "key_cache and value_cache"),
    "reshape_and_cache: caches sharing one element": (
        cache_op(RC, lambda k, v, kc, vc, s: (k, v, *sharing_one_element(), s)), "key_cache and value_cache"),
    "reshape_and_cache: key inside key_cache": (
        cache_op(RC, lambda k, v, kc, vc, s: (kc[3, :3], v, kc, vc, s)), "key and key_cache"),
    "reshape_and_cache: slot_mapping inside value_cache": (
        cache_op(RC, lambda k, v, kc, vc, s: (k, v, kc, vc, ints(vc[1], 3, torch.int64))),
        "value_cache and slot_mapping"),
    "reshape_and_cache: k_scale inside key_cache": (
        cache_op(RC, lambda k, v, kc, vc, s: ((k, v, kc, vc, s), {"k_scale": kc[2, 3, 1, 4:8].view(torch.float32)}),
                 FP8), "key_cache and k_scale"),
    "copy_blocks: one cache in two layers": (
        cache_op(CB, lambda k, v, kc, vc, s: ([kc, kc.clone()], [vc, kc], torch.tensor([[0, 1]]))),
        "key_caches[0] and value_caches[1]"),
    "copy_blocks: two layers sharing one element": (
        cache_op(CB, lambda k, v, kc, vc, s: (list(sharing_one_element()), [vc, vc.clone()], torch.tensor([[0, 1]]))),
        "key_caches[0] and key_caches[1]"),
    "copy_blocks: block_mapping inside a cache": (
        cache_op(CB, lambda k, v, kc, vc, s: ([kc], [vc], ints(vc[2], 2, torch.int64).view(1, 2))),
        "value_caches[0] and block_mapping"),
    "swap_blocks: dst one block into src": (
        cache_op(SB, lambda k, v, kc, vc, s: (kc, kc[1:], torch.tensor([[0, 1]]))), "src and dst"),
    "swap_blocks: K half into V half of one packed cache": (
        cache_op(SB, lambda k, v, kc, vc, s: (*packed_halves(), torch.tensor([[0, 1]]))), "src and dst"),
    "swap_blocks: block_mapping inside dst's block spans": (
        cache_op(SB, lambda k, v, kc, vc, s: (vc, kc, ints(kc[1, 4], 2, torch.int64).view(1, 2))),
        "dst and block_mapping"),
    "paged_attention: out is query": (attention(out=lambda a: a["query"]), "out and query"),
    "paged_attention: out inside value_cache": (
        attention(out=lambda a: a["value_cache"][1, :4].view(2, 4, 32)), "out and value_cache"),
    "paged_attention: lse inside out": (attention(lse=lambda a: a["out"].view(-1)[:8].view(2, 4)), "out and lse"),
    "paged_attention: block_tables inside out": (
        attention(block_tables=lambda a: ints(a["out"][1], 4).view(2, 2)), "out and block_tables"),
    "paged_attention: alibi_slopes inside out": (
        attention(alibi_slopes=lambda a: a["out"][1, 2, :4]), "out and alibi_slopes"),
    "paged_attention: sinks inside lse": (
        attention(lse=lambda a: torch.empty(2, 4), sinks=lambda a: a["lse"][1]), "lse and sinks"),
    "paged_attention: query_start_loc inside out": (
        attention(query_start_loc=lambda a: ints(a["out"][0, 3], 3)), "out and query_start_loc"),
    "paged_attention: v_scale inside out": (attention(FP8, v_scale=lambda a: a["out"][0, 0, :1]), "out and v_scale"),
    "concat_and_cache_mla: kv_c inside kv_cache": (latent_rows_inside_the_cache, "kv_c and kv_cache"),
    "mla_attention: out inside query": (
        mla(out=lambda a: a["query"].view(-1)[: 2 * 4 * 64].view(2, 4, 64)), "out and query"),
    "mla_attention: lse inside out": (mla(lse=lambda a: a["out"][1, 2, 8:16].view(2, 4)), "out and lse"),
    "merge_attention_states: out is out_a": (merge(out=lambda a: a["out_a"]), "out and out_a"),
    "merge_attention_states: lse is lse_b": (merge(lse=lambda a: a["lse_b"]), "lse and lse_b"),
    "merge_attention_states: lse inside out": (merge(lse=lambda a: a["out"][2, 1, 10:16].view(3, 2)), "out and lse"),
}


def error_of(call):
    try:
        call()
    except RuntimeError as error:
        return error
    return None


def eager_error(case):
    op, args, kwargs = REFUSED[case][0]()
    error = error_of(lambda: op(*args, **kwargs))
    assert error is not None, "the kernel accepts the call"
    return str(error)


def without_addresses(message):
    """A message (or None) with the address in a layout ("... at 0x7f3a..") left out: a fake tensor has none (the fake
    names its offset in its storage instead)."""
    return message and re.sub(r" at (0x[0-9a-f]+|storage offset \d+)", " at ...", message)


@pytest.mark.parametrize("case", REFUSED)
def test_the_kernel_refuses_it(case):
    assert f"{REFUSED[case][1]} must not overlap in memory" in eager_error(case)


@pytest.mark.parametrize("case", REFUSED)
def test_torch_compile_refuses_it_while_tracing(case):
    op, args, kwargs = REFUSED[case][0]()
    error = error_of(lambda: compiled(op)(*args, **kwargs))
    assert isinstance(error, torch._dynamo.exc.TorchRuntimeError), f"not refused while tracing: {error!r}"
    assert without_addresses(eager_error(case)) in without_addresses(str(error))


# swap_blocks takes CPU and CUDA tensors only: meta tensors are refused before memory is compared.
ON_META = [case for case in REFUSED if not case.startswith("swap_blocks")]


@pytest.mark.parametrize("case", ON_META)
def test_meta_tensors_refuse_it(case):
    op, args, kwargs = on_meta(REFUSED[case][0]())
    error = error_of(lambda: op(*args, **kwargs))
    assert error is not None, "the fake accepts the call"
    assert without_addresses(str(error)) == without_addresses(eager_error(case))


# ----------------------------------------------------------------------------------------------------------------
# Views of one storage that share no byte: interleaved (the halves of a [num_blocks, 2, ...] allocation, the K and V
# halves of vLLM's packed cache), side by side (slices of one fused QKV tensor, outputs carved from one buffer), or
# touching (one ends where the next begins). Each returns (op, args, kwargs) and the arguments the op writes.

def interleaved_caches():
    gen = torch.Generator().manual_seed(0)
    alloc = torch.randn(4, 2, 8, 2, 32, generator=gen)
    qkv = torch.randn(3, 4 + 2 + 2, 32, generator=gen)
    key_cache, value_cache = alloc[:, 0], alloc[:, 1]
    return (paged_attn.reshape_and_cache, (qkv[:, 4:6], qkv[:, 6:], key_cache, value_cache, torch.tensor([0, 9, 17])),
            {}), (key_cache, value_cache)


def packed_cache_copy():
    key_cache, value_cache = packed_halves()
    return (paged_attn.copy_blocks, ([key_cache], [value_cache], torch.tensor([[0, 2], [1, 3]])), {}), \
        (key_cache, value_cache)


def swap_between_halves():
    alloc = torch.randn(4, 2, 8, 2, 32, generator=torch.Generator().manual_seed(0))
    src, dst = alloc[:, 0], alloc[:, 1]
    return (paged_attn.swap_blocks, (src, dst, torch.tensor([[0, 1], [2, 3]])), {}), (dst,)


def outputs_from_one_buffer():
    # out, then lse, then the ALiBi slopes right after them; the caches the halves of a packed cache; the query a
    # slice of a fused QKV tensor.
    gen = torch.Generator().manual_seed(0)
    buffer = torch.empty(2 * 4 * 32 + 2 * 4 + 4)
    out, lse = buffer[:256].view(2, 4, 32), buffer[256:264].view(2, 4)
    alibi_slopes = buffer[264:].uniform_(generator=gen)
    key_cache, value_cache = packed_halves()
    query = torch.randn(2, 4 + 2 + 2, 32, generator=gen)[:, :4]
    args = dict(out=out, query=query, key_cache=key_cache, value_cache=value_cache,
                block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                seq_lens=torch.tensor([5, 9], dtype=torch.int32), scale=0.5, alibi_slopes=alibi_slopes,
                sliding_window=0, logits_soft_cap=0.0, lse=lse)
    return (torch.ops.paged_attn.paged_attention, (), args), (out, lse)


def merge_in_one_buffer():
    gen = torch.Generator().manual_seed(0)
    outs, lses = torch.randn(3, 3, 2, 32, generator=gen), torch.randn(3, 2, 3, generator=gen)
    out_a, out_b, out = outs  # [3, 2, 32] each, side by side
    lse_a, lse_b, lse = lses.unbind(2)  # [3, 2] each, interleaved
    return (paged_attn.merge_attention_states, (out_a, lse_a, out_b, lse_b), dict(out=out, lse=lse)), (out, lse)


def mla_in_one_buffer():
    gen = torch.Generator().manual_seed(0)
    buffer = torch.empty(2 * 4 * 64 + 2 * 4)
    out, lse = buffer[:512].view(2, 4, 64), buffer[512:].view(2, 4)
    kv_cache, query = torch.randn(4, 8, 80, generator=gen), torch.randn(2, 4, 80, generator=gen)
    args = dict(out=out, query=query, kv_cache=kv_cache, block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                seq_lens=torch.tensor([5, 9], dtype=torch.int32), kv_lora_rank=64, scale=0.1, lse=lse)
    return (torch.ops.paged_attn.mla_attention, (), args), (out, lse)


def latent_rows_next_to_the_cache():
    gen = torch.Generator().manual_seed(0)
    buffer = torch.randn(4 * 8 * 80 + 3 * 80, generator=gen)  # the cache, then the projection right after it
    kv_cache, projection = buffer[:2560].view(4, 8, 80), buffer[2560:].view(3, 80)
    return (paged_attn.concat_and_cache_mla, (projection[:, :64], projection[:, 64:], kv_cache,
                                              torch.tensor([0, 9, 31])), {}), (kv_cache,)


ACCEPTED = {
    "reshape_and_cache: interleaved caches, key and value slices of one QKV tensor": interleaved_caches,
    "copy_blocks: the K and V halves of a packed cache": packed_cache_copy,
    "swap_blocks: from one half of an allocation into the other": swap_between_halves,
    "paged_attention: out, lse and alibi_slopes from one buffer, packed caches": outputs_from_one_buffer,
    "merge_attention_states: inputs and outputs from one buffer each": merge_in_one_buffer,
    "mla_attention: out and lse from one buffer": mla_in_one_buffer,
    "concat_and_cache_mla: the rows right after the cache": latent_rows_next_to_the_cache,
}


def run_accepted(case, run):
    """Runs the case eagerly and with run(op) in place of op on arguments made alike; asserts that what the op
    writes has the same bits."""
    (op, args, kwargs), want = ACCEPTED[case]()
    op(*args, **kwargs)
    (op, args, kwargs), got = ACCEPTED[case]()
    run(op)(*args, **kwargs)
    for g, w in zip(got, want):
        assert torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8))


@pytest.mark.parametrize("case", ACCEPTED)
def test_torch_compile_accepts_views_that_share_no_byte(case):
    run_accepted(case, compiled)


@pytest.mark.parametrize("case", [case for case in ACCEPTED if not case.startswith("swap_blocks")])
def test_meta_tensors_accept_views_that_share_no_byte(case):
    op, args, kwargs = on_meta(ACCEPTED[case]()[0])
    op(*args, **kwargs)


# ----------------------------------------------------------------------------------------------------------------
# Inductor, and dynamic shapes: with symbolic sizes the fake decides on the sizes of the inputs being traced.

def test_inductor_refuses_and_accepts_alike():
    op, args, kwargs = merge(out=lambda a: a["out_a"])()
    with pytest.raises(torch._dynamo.exc.TorchRuntimeError, match="out and out_a must not overlap in memory"):
        compiled(op, backend="inductor")(*args, **kwargs)
    run_accepted("merge_attention_states: inputs and outputs from one buffer each",
                 lambda op: compiled(op, backend="inductor"))


def test_dynamic_shapes_are_checked_on_the_traced_sizes():
    op, args, kwargs = attention(out=lambda a: a["query"])()
    with pytest.raises(torch._dynamo.exc.TorchRuntimeError, match="out and query must not overlap in memory"):
        compiled(op, dynamic=True)(*args, **kwargs)
    run_accepted("paged_attention: out, lse and alibi_slopes from one buffer, packed caches",
                 lambda op: compiled(op, dynamic=True))
