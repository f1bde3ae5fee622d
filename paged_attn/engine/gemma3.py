"""Gemma 3 (e.g. the 270M model): the Llama model's machinery (weights on one device and dtype, fused and oneDNN-
packed projections, RoPE tables, the paged KV cache) with Gemma 3's layer.

The forward pass mirrors transformers' ``Gemma3ForCausalLM`` operation by operation: embeddings scaled by
sqrt(hidden_size) in the model's dtype; RMSNorm in float32 times ``1 + weight``, before and after attention and
before and after the MLP; each head's query and key RMS-normed before RoPE; GELU (tanh) gating; logits scaled by
``query_pre_attn_scalar ** -0.5``. Layers take turns: most attend over a sliding window (``paged_attention``'s
``sliding_window``: the query at position p sees positions p - window + 1 .. p, as transformers' sliding mask) with
RoPE of base ``local_rope_theta``, every 6th attends globally with base ``rope_theta`` (``config.sliding_windows``).
The engine's KV cache puts the windowed layers in KV-cache groups of their own
(``model_runner.kv_cache_groups``), whose pages are released once they fall out of the window of every query still
to come.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .batch import Batch
from .layers import normalized, rotate, serial_elementwise
from .model import LlamaModel

__all__ = ["Gemma3Model"]


class Gemma3Model(LlamaModel):
    """Gemma 3 weights on one device and dtype, and the forward pass over the paged KV cache."""

    ARCHITECTURE, MODEL_TYPE = "gemma3", "gemma3_text"
    NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
             "self_attn.q_norm", "self_attn.k_norm")

    def __init__(self, config, weights, tokenizer=None, device="cpu", dtype=None, use_onednn=True, packed_linear=True):
        if config.architecture != self.ARCHITECTURE or len(config.sliding_windows) != config.num_layers:
            raise ValueError(f"expected a Gemma 3 config with a window (or None) per layer, got architecture "
                             f"{config.architecture!r} and {len(config.sliding_windows)} windows for "
                             f"{config.num_layers} layers")
        super().__init__(config, weights, tokenizer, device, dtype, use_onednn, packed_linear)
        self.local_rope_cos, self.local_rope_signed_sin = self._rope_tables(config.local_rope_theta)
        # as transformers: a float32 scalar, cast to the model's dtype
        self.embed_scale = torch.tensor(config.hidden_size ** 0.5).to(device=self.device, dtype=self.dtype)
        self.scale = config.query_pre_attn_scalar ** -0.5

    @torch.inference_mode()
    def forward(self, batch: Batch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                kv_scales: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None,
                kv_amax: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None,
                elementwise=None) -> torch.Tensor:
        """As ``LlamaModel.forward``; ``elementwise`` (compiled kernels of Llama's layer) is not supported."""
        if elementwise is not None:
            raise ValueError("torch_compile (compiled elementwise kernels) is supported for Llama models only")
        cfg = self.config
        num_tokens = batch.input_ids.shape[0]
        positions = batch.positions
        # (cos, signed sin) [num_tokens, 1, head_dim] of the global layers (False) and the windowed ones (True)
        ropes = {False: (self.rope_cos[positions].unsqueeze(1), self.rope_signed_sin[positions].unsqueeze(1)),
                 True: (self.local_rope_cos[positions].unsqueeze(1),
                        self.local_rope_signed_sin[positions].unsqueeze(1))}
        eps, heads, windows = cfg.rms_norm_eps, (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim), cfg.sliding_windows
        serial = serial_elementwise(self.device, num_tokens)
        hidden = F.embedding(batch.input_ids, self.embed_tokens) * self.embed_scale
        for i, (layer, window) in enumerate(zip(self.layers, windows)):
            with serial:
                x = _rms_norm(hidden, layer["input_layernorm"], eps)
            qkv = self._linear(x, layer["qkv_proj"])
            with serial:
                q, k, v = _qk_norm_rope(qkv, layer["self_attn.q_norm"], layer["self_attn.k_norm"],
                                        *ropes[window is not None], *heads, eps)
            attn = self._attend(batch, batch.layer_groups[i], q, k, v, kv_caches[i],
                                kv_scales[i] if kv_scales is not None else None, kv_amax, scale=self.scale,
                                sliding_window=window)
            o = self._linear(attn, layer["o_proj"])
            with serial:
                hidden = hidden + _rms_norm(o, layer["post_attention_layernorm"], eps)
                x = _rms_norm(hidden, layer["pre_feedforward_layernorm"], eps)
            gate_up = self._linear(x, layer["gate_up_proj"])
            with serial:
                gate, up = gate_up.chunk(2, dim=-1)
                x = F.gelu(gate, approximate="tanh") * up
            down = self._linear(x, layer["down_proj"])
            with serial:
                hidden = hidden + _rms_norm(down, layer["post_feedforward_layernorm"], eps)
        with serial:
            hidden = _rms_norm(hidden[batch.logits_indices], self.norm, eps)
        return self._linear(hidden, self.lm_head).float()


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: the weight is an offset from 1, applied in float32 before the cast back."""
    return (normalized(x, eps) * (1.0 + weight.float())).to(x.dtype)


def _qk_norm_rope(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor,
                  signed_sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused projection's output as q, k (each head RMS-normed, then rotated) and v (a view of qkv)."""
    num_tokens = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = rotate(_rms_norm(q.view(num_tokens, num_heads, head_dim), q_norm, eps), cos, signed_sin)
    k = rotate(_rms_norm(k.view(num_tokens, num_kv_heads, head_dim), k_norm, eps), cos, signed_sin)
    return q, k, v.view(num_tokens, num_kv_heads, head_dim)
