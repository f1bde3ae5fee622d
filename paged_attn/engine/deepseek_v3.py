"""DeepSeek-V3 (and the models of its architecture: DeepSeek-R1, V2-Lite-style ``q_lora_rank: null``, Kimi K2):
multi-head latent attention over a latent paged KV cache, and a mixture of experts, on the Llama model's machinery
(weights on one device and dtype, oneDNN-packed projections, ``check_dtype``).

The forward pass mirrors transformers' ``DeepseekV3ForCausalLM`` operation by operation: RMSNorm in float32; the
query through ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj`` (or one ``q_proj``); ``kv_a_proj_with_mqa`` gives each
token's compressed KV (normed by ``kv_a_layernorm``) and one RoPE'd key part shared by all heads; RoPE on
interleaved pairs, with YaRN's frequencies and ``mscale`` in the softmax scale; dense SwiGLU MLPs in the first
``first_k_dense_replace`` layers, then experts (``moe``). Each layer writes the step's latent rows with
``concat_and_cache_mla``, one row of ``kv_lora_rank + qk_rope_head_dim`` per token; attention: ``mla_layer``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .batch import Batch
from .checkpoint import config_from_dict
from .config import ModelConfig
from .layers import rms_norm, rotary_half_tables, rotate_pairs, serial_elementwise, silu_mul, \
    yarn_get_mscale, yarn_inv_freq
from .mla_layer import mla_attend
from .model import LlamaModel
from .moe import MoE

__all__ = ["DeepseekV3Model"]


class DeepseekV3Model(LlamaModel):
    """DeepSeek-V3-architecture weights on one device and dtype, and the forward pass over the latent KV cache."""

    ARCHITECTURE, MODEL_TYPE = "deepseek_v3", "deepseek_v3"
    NORMS = ("input_layernorm", "post_attention_layernorm", "self_attn.kv_a_layernorm")

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], tokenizer=None, device="cpu",
                 dtype: Optional[torch.dtype] = None, use_onednn: bool = True, packed_linear: bool = True):
        if config.mla is None or config.moe is None:
            raise ValueError("expected a DeepSeek-V3 config (with its latent attention and experts)")
        self._place(config, tokenizer, device, dtype, use_onednn, packed_linear)
        mla, moe = config.mla, config.moe

        def get(name, dtype=self.dtype):
            if name not in weights:
                raise ValueError(f"the checkpoint has no tensor {name!r}")
            return weights[name].to(device=self.device, dtype=dtype)

        self.embed_tokens = get("model.embed_tokens.weight")
        self.norm = get("model.norm.weight")
        self.tie_word_embeddings = "lm_head.weight" not in weights
        self.lm_head = self._pack(self.embed_tokens if self.tie_word_embeddings else get("lm_head.weight"))
        self.layers = []
        for i in range(config.num_layers):
            prefix = f"model.layers.{i}."
            attn = prefix + "self_attn."
            layer = {name: get(prefix + name + ".weight") for name in self.NORMS}
            # the projections of x into the query's input and the latent row, fused
            first = "q_a_proj" if mla.q_lora_rank is not None else "q_proj"
            layer["q_kv_a_proj"] = self._pack(torch.cat([get(attn + first + ".weight"),
                                                         get(attn + "kv_a_proj_with_mqa.weight")]))
            if mla.q_lora_rank is not None:
                layer["self_attn.q_a_layernorm"] = get(attn + "q_a_layernorm.weight")
                layer["q_b_proj"] = self._pack(get(attn + "q_b_proj.weight"))
            kv_b = get(attn + "kv_b_proj.weight")  # [num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]
            w_uk, w_uv = kv_b.view(config.num_heads, -1, mla.kv_lora_rank).split(
                [mla.qk_nope_head_dim, mla.v_head_dim], dim=1)
            layer["w_uk"] = w_uk.contiguous()  # [num_heads, qk_nope_head_dim, kv_lora_rank]
            layer["w_uv_t"] = w_uv.transpose(1, 2).contiguous()  # [num_heads, kv_lora_rank, v_head_dim]
            layer["kv_b_proj"] = self._pack(kv_b)
            layer["o_proj"] = self._pack(get(attn + "o_proj.weight"))
            if i < moe.first_k_dense_replace:
                layer["mlp"] = self._mlp(get, prefix + "mlp.")
            else:
                mlp = prefix + "mlp."
                layer["mlp"] = MoE(
                    moe, gate=get(mlp + "gate.weight", torch.float32),
                    bias=get(mlp + "gate.e_score_correction_bias", torch.float32),
                    experts=self._experts(weights, get, mlp + "experts."),
                    shared=self._mlp(get, mlp + "shared_experts.") if moe.n_shared_experts else None,
                    linear=self._linear)
            self.layers.append(layer)
        # RoPE: one angle per pair of the qk_rope_head_dim dims; YaRN scales cos/sin and the softmax scale
        if config.yarn is None:
            inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, mla.qk_rope_head_dim, 2, dtype=torch.float) /
                                                    mla.qk_rope_head_dim))
            factor, mscale = 1.0, 1.0
        else:
            inv_freq, factor = yarn_inv_freq(config.rope_theta, mla.qk_rope_head_dim, config.yarn)
            mscale = yarn_get_mscale(config.yarn.factor, config.yarn.mscale_all_dim) \
                if config.yarn.mscale_all_dim else 1.0
        self.rope_cos, self.rope_sin = rotary_half_tables(inv_freq, factor, config.max_model_len, self.device,
                                                          self.dtype)
        self.scale = config.head_dim ** -0.5 * mscale * mscale
        # ``mla_layer``'s choice between the absorbed and the up-projected form (None: by its cost model)
        self.upproject_min_query_len: Optional[int] = None

    def _mlp(self, get, prefix: str) -> dict[str, torch.Tensor]:
        """A SwiGLU MLP's weights: gate and up fused, and down."""
        gate_up = torch.cat([get(prefix + "gate_proj.weight"), get(prefix + "up_proj.weight")])
        return {"gate_up_proj": self._pack(gate_up),
                "down_proj": self._pack(get(prefix + "down_proj.weight"))}

    def _experts(self, weights, get, prefix: str) -> list[dict[str, torch.Tensor]]:
        """The routed experts' MLPs, from a checkpoint's per-expert tensors (``experts.{e}.gate_proj.weight``, ...)
        or from transformers' fused ones in memory (``experts.gate_up_proj`` ``[experts, 2 * moe_intermediate_size,
        hidden_size]``, gate rows first, and ``experts.down_proj``)."""
        if prefix + "gate_up_proj" in weights:
            gate_up, down = get(prefix + "gate_up_proj"), get(prefix + "down_proj")
            return [{"gate_up_proj": self._pack(gate_up[e]), "down_proj": self._pack(down[e])}
                    for e in range(self.config.moe.n_routed_experts)]
        return [self._mlp(get, f"{prefix}{e}.") for e in range(self.config.moe.n_routed_experts)]

    @staticmethod
    def _config_from_transformers(hf_config) -> ModelConfig:
        return config_from_dict(hf_config.to_dict())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under transformers' names (projections unpacked and unfused)."""
        dense = self._dense

        def mlp(prefix, weights):
            gate, up = dense(weights["gate_up_proj"]).chunk(2)
            return {prefix + "gate_proj.weight": gate, prefix + "up_proj.weight": up,
                    prefix + "down_proj.weight": dense(weights["down_proj"])}

        mla = self.config.mla
        weights = {"model.embed_tokens.weight": self.embed_tokens, "model.norm.weight": self.norm}
        if not self.tie_word_embeddings:
            weights["lm_head.weight"] = dense(self.lm_head)
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}."
            attn = prefix + "self_attn."
            weights.update({prefix + name + ".weight": layer[name] for name in self.NORMS})
            q_name = "q_a_proj" if mla.q_lora_rank is not None else "q_proj"
            q_kv_a = dense(layer["q_kv_a_proj"])
            q, kv_a = q_kv_a.split([q_kv_a.shape[0] - mla.latent_dim, mla.latent_dim])
            weights.update({attn + q_name + ".weight": q, attn + "kv_a_proj_with_mqa.weight": kv_a,
                            attn + "kv_b_proj.weight": dense(layer["kv_b_proj"]),
                            attn + "o_proj.weight": dense(layer["o_proj"])})
            if mla.q_lora_rank is not None:
                weights[attn + "q_a_layernorm.weight"] = layer["self_attn.q_a_layernorm"]
                weights[attn + "q_b_proj.weight"] = dense(layer["q_b_proj"])
            if isinstance(layer["mlp"], MoE):
                moe = layer["mlp"]
                weights[prefix + "mlp.gate.weight"] = moe.gate
                weights[prefix + "mlp.gate.e_score_correction_bias"] = moe.bias
                for e, expert in enumerate(moe.experts):
                    weights.update(mlp(f"{prefix}mlp.experts.{e}.", expert))
                if moe.shared is not None:
                    weights.update(mlp(prefix + "mlp.shared_experts.", moe.shared))
            else:
                weights.update(mlp(prefix + "mlp.", layer["mlp"]))
        return weights

    @torch.inference_mode()
    def forward(self, batch: Batch, kv_caches: list[tuple[torch.Tensor, ...]],
                kv_scales: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None,
                kv_amax: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None,
                elementwise=None) -> torch.Tensor:
        """As ``LlamaModel.forward``; ``kv_caches[i]`` is ``(latent_cache,)``, ``[num_blocks, block_size,
        kv_lora_rank + qk_rope_head_dim]``, and an fp8 cache uses the first scale of ``kv_scales[i]``."""
        if elementwise is not None:
            raise ValueError("torch_compile (compiled elementwise kernels) is supported for Llama models only")
        cfg, mla = self.config, self.config.mla
        num_tokens = batch.input_ids.shape[0]
        cos, sin = self.rope_cos[batch.positions].unsqueeze(1), self.rope_sin[batch.positions].unsqueeze(1)
        eps = cfg.rms_norm_eps
        serial = serial_elementwise(self.device, num_tokens)
        q_input = mla.q_lora_rank if mla.q_lora_rank is not None else cfg.num_heads * cfg.head_dim
        hidden = F.embedding(batch.input_ids, self.embed_tokens)
        for i, layer in enumerate(self.layers):
            with serial:
                x = rms_norm(hidden, layer["input_layernorm"], eps)
            q, latent = self._linear(x, layer["q_kv_a_proj"]).split([q_input, mla.latent_dim], dim=-1)
            if mla.q_lora_rank is not None:
                with serial:
                    q = rms_norm(q, layer["self_attn.q_a_layernorm"], eps)
                q = self._linear(q, layer["q_b_proj"])
            with serial:
                q_nope, q_pe = q.view(num_tokens, cfg.num_heads, cfg.head_dim).split(
                    [mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
                q_pe = rotate_pairs(q_pe, cos, sin, mla.rope_interleave)
                kv_c = rms_norm(latent[:, :mla.kv_lora_rank], layer["self_attn.kv_a_layernorm"], eps)
                k_pe = rotate_pairs(latent[:, None, mla.kv_lora_rank:], cos, sin, mla.rope_interleave)[:, 0]
            k_scale = kv_scales[i][0] if kv_scales is not None else None
            if kv_amax is not None:
                amax = torch.maximum(kv_c.abs().amax(), k_pe.abs().amax()).float()
                kv_amax.append((amax, amax))
            attn = mla_attend(self, layer, batch, batch.layer_groups[i], q_nope, q_pe, kv_c, k_pe, kv_caches[i][0],
                              k_scale)
            o = self._linear(attn, layer["o_proj"])
            with serial:
                hidden = hidden + o
                x = rms_norm(hidden, layer["post_attention_layernorm"], eps)
            if isinstance(layer["mlp"], MoE):
                mlp_out = layer["mlp"](x)
            else:
                mlp_out = self._linear(silu_mul(self._linear(x, layer["mlp"]["gate_up_proj"])),
                                       layer["mlp"]["down_proj"])
            with serial:
                hidden = hidden + mlp_out
        with serial:
            hidden = rms_norm(hidden[batch.logits_indices], self.norm, eps)
        return self._linear(hidden, self.lm_head).float()

