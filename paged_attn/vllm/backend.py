"""vLLM attention backend on paged_attn's ops (vLLM 0.32; imported only by vLLM, through paged_attn.vllm.register).

vLLM hands each attention layer one cache tensor with K and V packed in the last dimension: logically
``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``, laid out in memory as the resolved ``KVCacheLayout``
says (``vllm/v1/kv_cache_interface.py``, ``create_kv_cache_views``). Our ops take
``[num_blocks, block_size, num_kv_heads, head_dim]`` with any strides but the last, so K and V are the two halves
of the last dimension with the middle dimensions swapped: no copy, in either layout. We prefer LBNHC (a block's
rows token-major, each token's heads side by side, as our kernels read them); LBHNC works too.

Per step: ``do_kv_cache_update`` writes the step's keys and values with ``reshape_and_cache`` (slot -1 = padding,
skipped), then ``forward`` runs ``paged_attention`` once over the whole mixed batch of prefills, prefill chunks and
decodes, with ``query_start_loc``.
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

import paged_attn  # noqa: F401  (loads the extension: torch.ops.paged_attn)

logger = logging.getLogger("paged_attn.vllm")

# Calls of PagedAttnImpl.forward with a batch in this process (the profiling run's calls without one excluded):
# how tests see that the backend really ran, in every worker (``LLM.collective_rpc``).
forward_calls = 0

# Block sizes and head dims of our CUDA kernels (csrc/cuda/attention.cpp, csrc/cuda/launch_plan.h); the CPU kernels
# take any.
CUDA_BLOCK_SIZES = [32, 16, 8]
CUDA_HEAD_DIMS = [32, 64, 80, 96, 112, 120, 128, 192, 256]
CUDA_FP8_HEAD_DIMS = [32, 64, 80, 96, 112, 128, 192, 256]  # Fp8AttentionHeadDims: whole 16-byte rows of fp8


def _on_cuda() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cuda_alike()


def _on_rocm() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_rocm()


# ROCm is refused: vLLM's "fp8" there is float8_e4m3fnuz on MI300 (vllm/platforms/rocm.py, fp8_dtype), which our
# kernels would read as e4m3fn (another exponent bias; 0x80 is NaN, not -0), and setup.py builds GPU kernels only
# for CUDA torch (torch.version.cuda), so a ROCm tensor would find no kernel anyway.
ROCM_REASON = "paged_attn's vLLM backend does not run on ROCm (its fp8 caches are e4m3fn, ROCm's fp8 is e4m3fnuz)"

# A cache in a floating dtype must hold the model's dtype: our ops read a non-fp8 cache only in the query's dtype.
FLOAT_CACHE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def cache_dtype_reason(dtype: torch.dtype, kv_cache_dtype: Optional[str]) -> Optional[str]:
    """Why a model of ``dtype`` cannot run on a cache of ``kv_cache_dtype`` with our ops, or None when it can."""
    cache = FLOAT_CACHE_DTYPES.get(kv_cache_dtype or "auto")
    if cache is not None and cache != dtype:
        return (f"kv_cache_dtype {kv_cache_dtype} needs a {kv_cache_dtype} model, got {dtype} (paged_attn reads a "
                f"float cache in the model's dtype only: use 'auto' or an fp8 cache)")
    return None


class PagedAttnBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.float16, torch.bfloat16]
    # "float16" / "bfloat16" only for a model of that dtype (supports_combination and the builder check it).
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"]

    @staticmethod
    def get_name() -> str:
        # The attention layer looks this up in AttentionBackendEnum: it must name a member.
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type["PagedAttnImpl"]:
        return PagedAttnImpl

    @staticmethod
    def get_builder_cls() -> type["PagedAttnMetadataBuilder"]:
        return PagedAttnMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return list(CUDA_BLOCK_SIZES) if _on_cuda() else [MultipleOf(1)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(CUDA_HEAD_DIMS) if _on_cuda() else []  # empty: any

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_sink(cls) -> bool:
        # Attention sinks (gpt-oss): the op takes them on the CPU and on CUDA.
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        # Our op takes the batch's row count and max_query_len from the host (num_actual_tokens, the CPU
        # max_query_len) and requires query_start_loc[-1] == the row count; a batch trimmed on the device (adaptive
        # verification) does not meet that.
        return False

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse,
                             use_mm_prefix, device_capability) -> Optional[str]:
        if _on_rocm():
            return ROCM_REASON
        if _on_cuda() and (kv_cache_dtype or "").startswith("fp8") and head_size not in CUDA_FP8_HEAD_DIMS:
            return f"head_size {head_size} not supported with an fp8 cache on CUDA"
        return cache_dtype_reason(dtype, kv_cache_dtype)


@dataclass
class PagedAttnMetadata:
    num_actual_tokens: int  # query rows of this step, padding excluded
    max_query_len: int
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs], this step's tokens included
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    slot_mapping: torch.Tensor  # int64 [num_tokens], -1 for padding


class PagedAttnMetadataBuilder(AttentionMetadataBuilder[PagedAttnMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # vLLM's CPU platform takes the backend without validate_configuration, and the impl is not told the
        # model's dtype or head_size_v: the builder, made when the engine sets up its KV cache, is where the cache
        # spec and the model meet, before the first step.
        head_size, head_size_v = kv_cache_spec.head_size, kv_cache_spec.head_size_v
        if head_size_v != head_size:
            raise NotImplementedError(
                f"paged_attn's vLLM backend needs keys and values of one head size, got head_size {head_size} and "
                f"head_size_v {head_size_v} (layers {', '.join(layer_names)})")
        model_config = getattr(vllm_config, "model_config", None)
        cache_dtype = kv_cache_spec.dtype  # uint8 for an fp8 cache (vllm/utils/torch_utils.py)
        if model_config is not None and cache_dtype not in (torch.uint8, model_config.dtype):
            raise NotImplementedError(
                f"paged_attn's vLLM backend reads a {cache_dtype} KV cache only with a {cache_dtype} model, got "
                f"{model_config.dtype}: use kv_cache_dtype 'auto' or an fp8 cache (layers {', '.join(layer_names)})")

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> PagedAttnMetadata:
        m = common_attn_metadata
        if m.causal is not True:  # False, or a per-request tensor
            raise NotImplementedError(f"paged_attn's vLLM backend supports causal attention only, got causal="
                                      f"{m.causal!r}")
        num_seqs = m.num_reqs
        return PagedAttnMetadata(
            num_actual_tokens=m.num_actual_tokens,
            max_query_len=m.max_query_len,
            query_start_loc=m.query_start_loc[: num_seqs + 1],
            seq_lens=m.seq_lens[:num_seqs],
            block_tables=m.block_table_tensor[:num_seqs],
            slot_mapping=m.slot_mapping,
        )


def split_kv_cache(kv_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's packed ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` cache as our K and V caches,
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` views (no copy)."""
    key_cache = kv_cache[..., :head_dim].transpose(1, 2)
    value_cache = kv_cache[..., head_dim:].transpose(1, 2)
    return key_cache, value_cache


def _on_storage(view: torch.Tensor) -> torch.Tensor:
    """``view`` as a tensor on the same memory that references only the storage. A view keeps its base tensor
    (``_base``) alive, and PyTorch keeps that tensor's Python object with it, so a weak reference to the cache
    would never fire. Made outside inference mode, so that the ops may write it in either mode (vLLM's steps run in
    inference mode; an inference tensor cannot be written outside it)."""
    with torch.inference_mode(False):
        return torch.empty(0, dtype=view.dtype, device=view.device).set_(
            view.untyped_storage(), view.storage_offset(), view.shape, view.stride())


def _forget_views(impl: "PagedAttnImpl"):
    """The callback of the weak reference to ``impl``'s cache tensor: drops the views of that tensor's memory (held
    weakly itself, so that the reference does not keep ``impl`` alive)."""
    impl_ref = weakref.ref(impl)

    def forget(dead: weakref.ref) -> None:
        impl = impl_ref()
        if impl is not None and impl._split_ref is dead:
            impl._split = impl._split_key = impl._split_ref = None

    return forget


# vLLM allocates an fp8 cache as uint8 (vllm/utils/torch_utils.py); "fp8" is e4m3 on the CPU and on NVIDIA GPUs.
FP8_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


class PagedAttnImpl(AttentionImpl[PagedAttnMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: Optional[int] = None,
                 alibi_slopes: Optional[list[float]] = None, sliding_window: Optional[int] = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: Optional[float] = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: Optional[str] = None,
                 sinks: Optional[torch.Tensor] = None) -> None:
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"paged_attn's vLLM backend supports decoder attention only, got {attn_type}")
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise ValueError(f"sinks must have shape [num_heads] = [{num_heads}] (this rank's heads), got "
                             f"{list(sinks.shape)}")
        if _on_rocm():
            raise NotImplementedError(ROCM_REASON)
        if kv_cache_dtype not in PagedAttnBackend.supported_kv_cache_dtypes:
            raise NotImplementedError(f"paged_attn's vLLM backend does not support kv_cache_dtype={kv_cache_dtype!r} "
                                      f"(supported: {', '.join(PagedAttnBackend.supported_kv_cache_dtypes)})")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.alibi_slopes = None if alibi_slopes is None else torch.tensor(alibi_slopes, dtype=torch.float32)
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap or None  # vLLM passes 0 for "none" in places
        self.kv_cache_dtype = kv_cache_dtype
        self.fp8_dtype = FP8_CACHE_DTYPES.get(kv_cache_dtype)  # None: the cache holds the model's dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        # The layer's sinks parameter itself (vLLM loads the weights into it after this), passed to every call;
        # the op converts float16/bfloat16 to float32 exactly.
        self.sinks = sinks
        # Our K/V views of the last cache tensor seen, the key of the memory they view, and a weak reference to
        # that tensor (its callback drops the views when vLLM drops the cache): see _caches.
        self._split: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._split_key: Optional[tuple] = None
        self._split_ref: Optional[weakref.ref] = None

    def _caches(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Our key and value caches on vLLM's packed one. vLLM hands every call of a layer the same tensor, so the
        views are made once (four view ops a call otherwise: at batch 1 they cost more than the attention).

        They are kept by the memory they view, not by the tensor object: a ``kv_cache.set_(...)`` onto new memory
        changes the key and gets new views, and the old ones are let go. The views reference only the storage
        (not ``kv_cache``, nor the tensor it is a view of), and ``kv_cache`` only weakly: when vLLM drops it, the
        callback drops the views, so a dropped cache is freed."""
        key = (kv_cache.data_ptr(), kv_cache.untyped_storage().data_ptr(), kv_cache.shape, kv_cache.stride(),
               kv_cache.dtype, kv_cache.device)
        if key != self._split_key:
            self._split = self._split_key = self._split_ref = None  # the old views go first
            typed = kv_cache if self.fp8_dtype is None else kv_cache.view(self.fp8_dtype)
            self._split = tuple(_on_storage(view) for view in split_kv_cache(typed, self.head_size))
            self._split_key = key
        if self._split_ref is None or self._split_ref() is not kv_cache:
            self._split_ref = weakref.ref(kv_cache, _forget_views(self))
        return self._split

    def _scales(self, layer) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The layer's fp8 scales (float32 tensors of one element on the cache's device, vLLM's ``_k_scale`` /
        ``_v_scale``: 1.0 unless the checkpoint or vLLM's calibration set them); none for other caches."""
        if self.fp8_dtype is None:
            return None, None
        return layer._k_scale, layer._v_scale

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if self.kv_sharing_target_layer_name is not None:
            return  # this layer reads another layer's cache, which that layer writes
        key_cache, value_cache = self._caches(kv_cache)
        num_tokens = slot_mapping.shape[0]
        if key.shape[0] != num_tokens:
            key, value = key[:num_tokens], value[:num_tokens]
        # The op itself (its checks are the C++ ones): the Python wrapper's argument checks are for callers'
        # values, and these are vLLM's.
        k_scale, v_scale = self._scales(layer)
        torch.ops.paged_attn.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale=k_scale,
                                               v_scale=v_scale)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: Optional[PagedAttnMetadata], output: torch.Tensor,
                output_scale: Optional[torch.Tensor] = None,
                output_block_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """query: ``[num_tokens, num_heads, head_dim]``; output: ``[num_tokens, num_heads, head_dim]``, written."""
        global forward_calls
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("paged_attn's vLLM backend does not support fused output quantization")
        if attn_metadata is None:  # the profiling run
            return output
        if forward_calls == 0:
            logger.info("paged_attn vLLM backend: first forward in pid %d (%s)", os.getpid(), query.device)
        forward_calls += 1
        if self.alibi_slopes is not None and self.alibi_slopes.device != query.device:
            self.alibi_slopes = self.alibi_slopes.to(query.device)
        n = attn_metadata.num_actual_tokens
        key_cache, value_cache = self._caches(kv_cache)
        out = output.view(-1, self.num_heads, self.head_size)
        if out.shape[0] != n:  # padded rows (CUDA graphs, tensor parallel) stay unwritten
            out = out[:n]
        if query.shape[0] != n:
            query = query[:n]
        k_scale, v_scale = self._scales(layer)
        torch.ops.paged_attn.paged_attention(
            out, query, key_cache, value_cache, attn_metadata.block_tables, attn_metadata.seq_lens, self.scale,
            self.alibi_slopes, self.sliding_window or 0, self.logits_soft_cap or 0.0, attn_metadata.query_start_loc,
            attn_metadata.max_query_len, k_scale=k_scale, v_scale=v_scale, sinks=self.sinks)
        return output
