"""A transformers checkpoint folder (``config.json``, ``*.safetensors``, optionally ``tokenizer.json``) as a
``ModelConfig``, float32 weights under transformers' names and a ``Tokenizer``: how a DeepSeek-V3-architecture
model (DeepSeek-V3/R1, V2-Lite-style ``q_lora_rank: null``, Kimi K2's layout) is loaded, from a real download or
from ``save_pretrained`` of a small random model (the tests). Weights stored as bfloat16/float16 are widened;
DeepSeek's fp8 block-quantized weights (``weight`` e4m3 with ``weight_scale_inv`` per 128 x 128 block) are
dequantized as ``weight * weight_scale_inv`` over each block. Reads ``safetensors`` files only (never pickles).

    llm = LLM("/path/to/DeepSeek-V2-Lite-Chat")  # a folder: this loader; a file: a GGUF
"""

from __future__ import annotations

import glob
import json
import os

import torch

from .config import MLAConfig, ModelConfig, MoEConfig, YarnConfig
from .loader import Tokenizer

__all__ = ["config_from_dict", "load_checkpoint"]

SUPPORTED_MODEL_TYPES = ("deepseek_v3",)


def load_checkpoint(folder: str) -> tuple[ModelConfig, dict[str, torch.Tensor], "Tokenizer | None"]:
    """Read a checkpoint folder: its config, its float32 weights, and its tokenizer (None without tokenizer.json)."""
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{folder}: a checkpoint folder needs a config.json")
    with open(config_path) as f:
        hf_config = json.load(f)
    config = config_from_dict(hf_config, where=folder)
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files (pickled .bin checkpoints are not read)")
    from safetensors.torch import load_file

    stored: dict[str, torch.Tensor] = {}
    for path in files:
        stored.update(load_file(path))
    block = (hf_config.get("quantization_config") or {}).get("weight_block_size", [128, 128])
    weights = {name: _dequantized(tensor, stored.get(name + "_scale_inv"), block)
               for name, tensor in stored.items() if not name.endswith("_scale_inv")}
    return config, weights, _tokenizer(folder, config.eos_token_id)


def config_from_dict(hf_config: dict, where: str = "config") -> ModelConfig:
    """The ModelConfig of a transformers ``config.json`` (a dict; ``PretrainedConfig.to_dict()`` gives one)."""
    model_type = hf_config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{where}: checkpoint folders of model_type {', '.join(SUPPORTED_MODEL_TYPES)} are "
                         f"supported, got {model_type!r} (Llama and Gemma 3 load from GGUF files)")
    c = hf_config
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    rope_theta = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"{where}: RoPE scaling {rope_type!r} is not supported (default and yarn are)")
    yarn = None
    if rope_type == "yarn":
        original = rope.get("original_max_position_embeddings") or c["max_position_embeddings"]
        factor = rope.get("factor") or c["max_position_embeddings"] / original
        yarn = YarnConfig(factor=float(factor), original_max_position_embeddings=int(original),
                          beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                          mscale=float(rope.get("mscale") or 0), mscale_all_dim=float(rope.get("mscale_all_dim") or 0),
                          attention_factor=rope.get("attention_factor"), truncate=bool(rope.get("truncate", True)))
    if c.get("attention_bias"):
        raise ValueError(f"{where}: attention_bias is not supported (DeepSeek's checkpoints have none)")
    if c.get("hidden_act", "silu") != "silu" or c.get("topk_method", "noaux_tc") != "noaux_tc" or \
            c.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"{where}: expected hidden_act 'silu' and sigmoid scores with noaux_tc routing "
                         f"(DeepSeek-V3), got {c.get('hidden_act')!r}, {c.get('scoring_func')!r}, "
                         f"{c.get('topk_method')!r}")
    mla = MLAConfig(kv_lora_rank=c["kv_lora_rank"], qk_rope_head_dim=c["qk_rope_head_dim"],
                    qk_nope_head_dim=c["qk_nope_head_dim"], v_head_dim=c["v_head_dim"],
                    q_lora_rank=c.get("q_lora_rank"), rope_interleave=bool(c.get("rope_interleave", True)))
    moe = MoEConfig(n_routed_experts=c["n_routed_experts"], num_experts_per_tok=c["num_experts_per_tok"],
                    moe_intermediate_size=c["moe_intermediate_size"], n_shared_experts=c.get("n_shared_experts") or 0,
                    n_group=c.get("n_group") or 1, topk_group=c.get("topk_group") or 1,
                    norm_topk_prob=bool(c.get("norm_topk_prob", True)),
                    routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
                    first_k_dense_replace=c.get("first_k_dense_replace", 0))
    if moe.n_routed_experts % moe.n_group or moe.topk_group > moe.n_group:
        raise ValueError(f"{where}: n_group ({moe.n_group}) must divide n_routed_experts ({moe.n_routed_experts}) "
                         f"and be at least topk_group ({moe.topk_group})")
    eos = c.get("eos_token_id")
    return ModelConfig(
        num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_heads=c["num_attention_heads"], num_kv_heads=c["num_attention_heads"],
        head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim, vocab_size=c["vocab_size"],
        max_model_len=c["max_position_embeddings"], rope_theta=rope_theta, rms_norm_eps=float(c["rms_norm_eps"]),
        eos_token_id=eos[0] if isinstance(eos, (list, tuple)) else eos, architecture=model_type, mla=mla, moe=moe,
        yarn=yarn, tie_word_embeddings=bool(c.get("tie_word_embeddings", False)))


def _dequantized(tensor: torch.Tensor, scale_inv, block: list[int]) -> torch.Tensor:
    """float32 of a stored tensor; an fp8 one times its per-block ``scale_inv`` ``[ceil(rows / b0),
    ceil(cols / b1)]``."""
    if scale_inv is None:
        return tensor.float()
    rows, cols = tensor.shape
    expanded = scale_inv.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    return tensor.float() * expanded


def _tokenizer(folder: str, eos_token_id):
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    from tokenizers import Tokenizer as Backend

    backend = Backend.from_file(path)
    settings = {}
    if os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
        with open(os.path.join(folder, "tokenizer_config.json")) as f:
            settings = json.load(f)
    bos = settings.get("bos_token")
    bos = bos.get("content") if isinstance(bos, dict) else bos
    bos_id = backend.token_to_id(bos) if bos and settings.get("add_bos_token", False) else None
    return Tokenizer(backend, eos_token_id, settings.get("chat_template"), bos_id)
