"""vLLM MLA attention backend on paged_attn's latent-cache ops (vLLM 0.32, CPU; imported only by vLLM, through
paged_attn.vllm.register with ``PAGED_ATTN_VLLM=1``).

It subclasses vLLM's own CPU MLA backend (``vllm/v1/attention/backends/mla/cpu_mla.py``), which builds on vLLM's MLA
scaffolding (``MLACommonBackend``/``MLACommonImpl``: the model's layer absorbs ``W_UK`` into the decode queries,
applies ``W_UV`` after, and up-projects the latent rows for prompts). Ours replaces the two parts that touch the
latent cache ``[num_blocks, block_size, kv_lora_rank + rope_dim]``:

- ``do_kv_cache_update``: ``concat_and_cache_mla`` (slot -1 = padding, skipped; fp8 caches with the layer's scale);
- ``forward_mqa`` (decode): ``mla_attention``, each latent row read once for all heads, with the lse.

Prompts keep vLLM's own MHA path (its CPU prefill backend over the step's up-projected keys and values). Where
vLLM's platform allows it, this backend takes any head size (576 for DeepSeek-V3, small ranks for tests) and any
block size; vLLM's CPU platform (``vllm/platforms/cpu.py``) nevertheless forces ``block_size=16`` and turns chunked
prefill and prefix caching off for MLA models on hosts without AMX, and picks ``AMX_MLA`` (not overridden here) on
hosts with AMX.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl

import paged_attn  # noqa: F401  (loads the extension: torch.ops.paged_attn)
from paged_attn.vllm import backend as _mha_backend


class PagedAttnMLABackend(CPUMLABackend):
    # (fp8 latent caches: our ops take them, this backend not yet: vLLM hands the cache update a uint8 view)
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any kv_lora_rank + rope_dim

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [MultipleOf(1)]

    @classmethod
    def supports_block_size(cls, block_size) -> bool:
        return True

    @staticmethod
    def get_name() -> str:
        return "CPU_MLA"  # the slot it takes (the attention layer looks the name up in AttentionBackendEnum)

    @staticmethod
    def get_impl_cls() -> type["PagedAttnMLAImpl"]:
        return PagedAttnMLAImpl


class PagedAttnMLAImpl(CPUMLAImpl):
    can_return_lse_for_decode: bool = True

    def forward_mqa(self, q, kv_c_and_k_pe_cache: torch.Tensor, attn_metadata, layer):
        """q: the absorbed decode queries ``[num_decode_tokens, num_heads, kv_lora_rank + rope_dim]`` (or its two
        parts); returns ``([num_decode_tokens, num_heads, kv_lora_rank], lse [num_decode_tokens, num_heads])``."""
        assert attn_metadata.decode is not None
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        _mha_backend.forward_calls += 1
        decode = attn_metadata.decode
        return paged_attn.mla_attention(q, kv_c_and_k_pe_cache, decode.block_table.to(torch.int32),
                                        decode.seq_lens.to(torch.int32), kv_lora_rank=self.kv_lora_rank,
                                        scale=self.scale, return_lse=True)

    def do_kv_cache_update(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, kv_cache_dtype: str, k_scale: torch.Tensor) -> None:
        """kv_c_normed ``[num_tokens, kv_lora_rank]``, k_pe ``[num_tokens, 1, rope_dim]``, written at
        ``slot_mapping`` (-1: padding, skipped)."""
        if kv_cache.numel() == 0:
            return
        paged_attn.concat_and_cache_mla(kv_c_normed, k_pe.squeeze(1), kv_cache, slot_mapping.long())
