"""The model: Llama weights as plain tensors on one device and dtype, and a compact forward pass that keeps its
keys and values in the paged KV cache (loading the checkpoint and the tokenizer: ``loader.py``; the elementwise
work of its layers: ``layers.py``; the model class of a checkpoint: ``registry.py``).

The forward pass mirrors transformers' ``LlamaForCausalLM`` operation by operation (RMSNorm in float32, RoPE
from the same float32 tables, SwiGLU), with the query/key/value and gate/up projections fused. One step may mix
decodes, prompts and chunks of prompts: each layer writes the new tokens' keys and values with
``reshape_and_cache``, then ``paged_attention`` attends each new token causally over its sequence's cached tokens.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F

from .. import ops
from ..elementwise import add_rms_norm, rms_norm, silu_and_mul
from ..linear import PackedLinearWeight, linear, linear_uses_avx512, pack_linear_weight
from .batch import Batch
from .layers import CompiledElementwise, rope_qkv, rope_tables, serial_elementwise
from .layers import rms_norm as eager_rms_norm
from .layers import silu_mul as eager_silu_mul
from .loader import ModelConfig, Tokenizer, config_from_transformers, default_model_path, load_gguf

__all__ = ["LlamaModel", "SUPPORTED_DTYPES"]


_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # where the device's matmul has them


def _add_then(norm: Callable) -> Callable:
    """``add_rms_norm``'s contract from separate ops: ``(residual + x, norm(residual + x, weight, eps))``."""
    def add_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        hidden = residual + x
        return hidden, norm(hidden, weight, eps)
    return add_norm


class LlamaModel:
    """Llama weights on one device and dtype, and the forward pass over the paged KV cache."""

    ARCHITECTURE, MODEL_TYPE = "llama", "llama"  # GGUF general.architecture, transformers model_type
    NORMS = ("input_layernorm", "post_attention_layernorm")  # each layer's norm weights (transformers' names)
    # The layers' residual adds, norms and SiLU gating through ops.add_rms_norm, rms_norm and silu_and_mul (one pass
    # each; in float32 within a few ulps of the eager code); False: torch's eager ops, bit for bit transformers' (and
    # vLLM's) order of operations. Steps that take torch_compile's kernels use those either way.
    fused_elementwise = True

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], tokenizer: Optional[Tokenizer] = None,
                 device: Union[str, torch.device] = "cpu", dtype: Optional[torch.dtype] = None, use_onednn: bool = True,
                 packed_linear: bool = True):
        self._place(config, tokenizer, device, dtype, use_onednn, packed_linear)

        def get(name):
            return weights[name].to(device=self.device, dtype=self.dtype)

        self.embed_tokens = get("model.embed_tokens.weight")
        self.norm = get("model.norm.weight")
        self.tie_word_embeddings = "lm_head.weight" not in weights
        self.lm_head = self.embed_tokens if self.tie_word_embeddings else get("lm_head.weight")
        self.layers = []
        for i in range(config.num_layers):
            prefix = f"model.layers.{i}."
            layer = {name: get(prefix + name + ".weight") for name in self.NORMS}
            layer.update({
                "qkv_proj": torch.cat([get(prefix + f"self_attn.{p}_proj.weight") for p in "qkv"]),
                "o_proj": get(prefix + "self_attn.o_proj.weight"),
                "gate_up_proj": torch.cat([get(prefix + "mlp.gate_proj.weight"), get(prefix + "mlp.up_proj.weight")]),
                "down_proj": get(prefix + "mlp.down_proj.weight"),
            })
            self.layers.append(layer)
        self.rope_cos, self.rope_signed_sin = self._rope_tables(config.rope_theta)
        # NOTE: on the CPU, matmuls on weights packed once run these small-batch projections several times faster
        # than the default F.linear (MKL sgemm), and ops.linear's AVX-512 micro-kernels 1.08-1.41x faster than oneDNN's
        # blocked layout: figures in bench/RESULTS.md, "Serving engine" and "The projections on packed weights".
        # The embedding stays dense for lookups.
        self.lm_head = self._pack(self.lm_head)
        for layer in self.layers:
            for name in _PROJECTIONS:
                layer[name] = self._pack(layer[name])

    def _place(self, config: ModelConfig, tokenizer, device, dtype: Optional[torch.dtype], use_onednn: bool,
               packed_linear: bool = True) -> None:
        """The model's config, tokenizer, device and dtype (float32 on the CPU, bfloat16 elsewhere by default), and
        whether its projections run on packed weights (use_onednn), and on ops.linear's where it runs (packed_linear;
        else oneDNN's); raises ValueError for a dtype the device cannot run."""
        self.config, self.tokenizer = config, tokenizer
        self.device = torch.device(device)
        self.dtype = dtype or (torch.float32 if self.device.type == "cpu" else torch.bfloat16)
        self.use_onednn = use_onednn and self.device.type == "cpu" and torch.backends.mkldnn.is_available()
        self.packed_linear = packed_linear
        self.check_dtype(self.device, self.dtype, use_onednn)

    def _pack(self, weight: torch.Tensor):
        """A projection's weight packed once for the CPU's matmul (with use_onednn), else as it is: for
        ops.linear's AVX-512 micro-kernels where they run (float32 and bfloat16), else in oneDNN's blocked layout."""
        if not self.use_onednn:
            return weight
        if self.packed_linear and weight.dtype in (torch.float32, torch.bfloat16) and linear_uses_avx512():
            return pack_linear_weight(weight)
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)

    @staticmethod
    def _dense(weight) -> torch.Tensor:
        """A weight as a plain tensor (unpacked from its packed layout)."""
        if isinstance(weight, PackedLinearWeight):
            return weight.dense()
        return weight.to_dense() if weight.is_mkldnn else weight

    def _rope_tables(self, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and signed sin tables ``[max_model_len, head_dim]`` for base ``theta``, in the model's dtype."""
        return rope_tables(theta, self.config.head_dim, self.config.max_model_len, self.device, self.dtype)

    @staticmethod
    def _linear(x: torch.Tensor, weight) -> torch.Tensor:
        if isinstance(weight, PackedLinearWeight):
            return linear(x, weight)
        if weight.is_mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
        return F.linear(x, weight)

    @classmethod
    def check_dtype(cls, device: torch.device, dtype, use_onednn: bool = True) -> None:
        """Raise ValueError unless the forward pass can run in ``dtype`` on ``device``: one of SUPPORTED_DTYPES,
        and a small projection through the same matmul path as the model's must run."""
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {_names(SUPPORTED_DTYPES)}, got {dtype}")
        error = cls._matmul_error(device, dtype, use_onednn)
        if error is not None:
            supported = [d for d in SUPPORTED_DTYPES if cls._matmul_error(device, d, use_onednn) is None]
            raise ValueError(f"dtype {_names([dtype])} is not supported on {device} by this machine ({error}); "
                             f"supported here: {_names(supported)}")

    @classmethod
    def _matmul_error(cls, device: torch.device, dtype: torch.dtype, use_onednn: bool) -> Optional[str]:
        try:
            weight = torch.ones(16, 16, dtype=dtype, device=device)
            if use_onednn and device.type == "cpu" and torch.backends.mkldnn.is_available():
                weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            cls._linear(torch.ones(2, 16, dtype=dtype, device=device), weight)
        except RuntimeError as error:
            return str(error).splitlines()[0]
        return None

    @classmethod
    def from_gguf(cls, path: Optional[str] = None, device="cpu", dtype=None, use_onednn=True) -> "LlamaModel":
        """This class's model from a GGUF (``registry.load_model`` picks the class from the file)."""
        path = path or default_model_path()
        config, weights, tokenizer = load_gguf(path)
        if config.architecture != cls.ARCHITECTURE:
            raise ValueError(f"{path}: a {config.architecture!r} GGUF, not {cls.ARCHITECTURE!r} (load_model picks the "
                             f"model class from the file)")
        return cls(config, weights, tokenizer, device, dtype, use_onednn)

    @classmethod
    def from_transformers(cls, hf_model, tokenizer=None, device="cpu", dtype=None, use_onednn=True) -> "LlamaModel":
        if getattr(hf_model.config, "model_type", None) != cls.MODEL_TYPE:
            raise ValueError(f"expected a transformers model of model_type {cls.MODEL_TYPE!r}, got "
                             f"{getattr(hf_model.config, 'model_type', None)!r}")
        weights = dict(hf_model.state_dict())
        if getattr(hf_model.config, "tie_word_embeddings", False):
            weights.pop("lm_head.weight", None)
        return cls(cls._config_from_transformers(hf_model.config), weights, tokenizer, device, dtype, use_onednn)

    @staticmethod
    def _config_from_transformers(hf_config) -> ModelConfig:
        return config_from_transformers(hf_config)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under transformers' names (projections unpacked and unfused)."""
        dense = self._dense
        cfg = self.config
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        weights = {"model.embed_tokens.weight": self.embed_tokens, "model.norm.weight": self.norm}
        if not self.tie_word_embeddings:
            weights["lm_head.weight"] = dense(self.lm_head)
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}."
            q, k, v = dense(layer["qkv_proj"]).split([q_size, kv_size, kv_size])
            gate, up = dense(layer["gate_up_proj"]).chunk(2)
            weights.update({prefix + name + ".weight": layer[name] for name in self.NORMS})
            weights.update({
                prefix + "self_attn.q_proj.weight": q, prefix + "self_attn.k_proj.weight": k,
                prefix + "self_attn.v_proj.weight": v, prefix + "self_attn.o_proj.weight": dense(layer["o_proj"]),
                prefix + "mlp.gate_proj.weight": gate, prefix + "mlp.up_proj.weight": up,
                prefix + "mlp.down_proj.weight": dense(layer["down_proj"]),
            })
        return weights

    @torch.inference_mode()
    def forward(self, batch: Batch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                kv_scales: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None,
                kv_amax: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None,
                elementwise: Optional[CompiledElementwise] = None) -> torch.Tensor:
        """Run one step; return float32 logits ``[len(logits_indices), vocab_size]`` of the rows named there.
        ``kv_scales``: per layer (k_scale, v_scale) of fp8 caches (float32 ``[1]``). ``kv_amax``: a list to which
        each layer appends (amax(|k|), amax(|v|)) of this step's keys and values (float32 0-d tensors; the fp8
        calibration pass, see ``model_runner``). ``elementwise``: compiled elementwise kernels
        (``layers.compile_elementwise``), used for steps of at least their ``min_tokens``; the model stays eager."""
        cfg = self.config
        num_tokens = batch.input_ids.shape[0]
        cos = self.rope_cos[batch.positions].unsqueeze(1)  # [num_tokens, 1, head_dim]
        signed_sin = self.rope_signed_sin[batch.positions].unsqueeze(1)
        if elementwise is not None and num_tokens >= elementwise.min_tokens:
            norm, rope, gated = elementwise.rms_norm, elementwise.rope_qkv, elementwise.silu_mul
            add_norm = _add_then(norm)
        elif self.fused_elementwise:  # the residual add and the norms, SiLU and the gating product in one pass each
            norm, add_norm, rope, gated = rms_norm, add_rms_norm, rope_qkv, silu_and_mul
        else:
            norm, rope, gated = eager_rms_norm, rope_qkv, eager_silu_mul
            add_norm = _add_then(norm)
        final_norm = rms_norm if self.fused_elementwise else eager_rms_norm  # a few rows: never compiled
        eps, heads = cfg.rms_norm_eps, (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        serial = serial_elementwise(self.device, num_tokens)
        hidden = F.embedding(batch.input_ids, self.embed_tokens)
        with serial:
            x = norm(hidden, self.layers[0]["input_layernorm"], eps)
        for i, layer in enumerate(self.layers):
            qkv = self._linear(x, layer["qkv_proj"])
            with serial:
                q, k, v = rope(qkv, cos, signed_sin, *heads)
            attn = self._attend(batch, batch.layer_groups[i], q, k, v, kv_caches[i],
                                kv_scales[i] if kv_scales is not None else None, kv_amax)
            o = self._linear(attn, layer["o_proj"])
            with serial:
                hidden, x = add_norm(o, hidden, layer["post_attention_layernorm"], eps)
            gate_up = self._linear(x, layer["gate_up_proj"])
            with serial:
                x = gated(gate_up)
            down = self._linear(x, layer["down_proj"])
            if i + 1 < len(self.layers):  # the residual add and the next layer's input norm
                with serial:
                    hidden, x = add_norm(down, hidden, self.layers[i + 1]["input_layernorm"], eps)
        with serial:
            hidden = final_norm((hidden + down)[batch.logits_indices], self.norm, eps)
        return self._linear(hidden, self.lm_head).float()

    @staticmethod
    def _attend(batch: Batch, group: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], kv_scale: Optional[tuple[torch.Tensor, torch.Tensor]],
                kv_amax: Optional[list], **options) -> torch.Tensor:
        """One layer's attention: write the step's keys and values into the layer's cache (through its KV-cache
        ``group``'s slots), then attend each query over its sequence (``options``: ``paged_attention``'s scale, sliding_window). ``[num_tokens, num_heads *
        head_dim]``."""
        key_cache, value_cache = kv_cache
        k_scale, v_scale = kv_scale if kv_scale is not None else (None, None)
        if kv_amax is not None:
            kv_amax.append((k.abs().amax().float(), v.abs().amax().float()))
        ops.reshape_and_cache(k, v, key_cache, value_cache, batch.slot_mapping[group], k_scale=k_scale, v_scale=v_scale)
        # decode form when every sequence feeds one token (the same attention, without query_start_loc)
        varlen = batch.max_query_len > 1
        attn = ops.paged_attention(q, key_cache, value_cache, batch.block_tables[group], batch.seq_lens,
                                   query_start_loc=batch.query_start_loc if varlen else None,
                                   max_query_len=batch.max_query_len if varlen else None,
                                   k_scale=k_scale, v_scale=v_scale,
                                   shared_plan=batch.shared_plans[group] if batch.shared_plans and not varlen else None,
                                   **options)
        return attn.flatten(1)


def _names(dtypes) -> str:
    return ", ".join(str(dtype).replace("torch.", "") for dtype in dtypes)
