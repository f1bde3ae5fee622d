"""``ModelConfig``: a model's shape as the engine reads it, whatever the checkpoint (GGUF, transformers model or
folder), with the parts only some architectures have: Gemma 3's windows, DeepSeek's latent attention (``MLAConfig``),
mixture of experts (``MoEConfig``) and YaRN-scaled RoPE (``YarnConfig``). Plain data; nothing here loads a file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["MLAConfig", "ModelConfig", "MoEConfig", "YarnConfig"]


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): the KV cache holds one row per token of ``kv_lora_rank``
    compressed values (after ``kv_a_layernorm``) and ``qk_rope_head_dim`` RoPE'd key dims, shared by all heads."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: Optional[int]  # None: one q_proj (V2-Lite); else q_a_proj, q_a_layernorm, q_b_proj
    rope_interleave: bool = True  # the rope dims come in interleaved pairs (DeepSeek's checkpoints)

    @property
    def latent_dim(self) -> int:
        """The cache row: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """DeepSeek-V3's mixture of experts: layers from ``first_k_dense_replace`` on route each token to
    ``num_experts_per_tok`` of ``n_routed_experts`` experts (sigmoid scores plus a correction bias, chosen among the
    ``topk_group`` best of ``n_group`` groups), and add ``n_shared_experts`` always-on experts."""

    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int


@dataclass(frozen=True)
class YarnConfig:
    """YaRN RoPE scaling (transformers' ``rope_type: "yarn"``): frequencies interpolated by ``factor`` beyond the
    ``beta_fast``/``beta_slow`` correction range, cos and sin scaled by ``attention_factor``, and (MLA) the softmax
    scale multiplied by ``yarn_mscale(factor, mscale_all_dim) ** 2``."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: Optional[float] = None  # None: from factor, mscale and mscale_all_dim
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # a query's and key's head dim (MLA: qk_nope_head_dim + qk_rope_head_dim)
    vocab_size: int
    max_model_len: int
    rope_theta: float
    rms_norm_eps: float
    eos_token_id: Optional[int] = None
    architecture: str = "llama"  # or "gemma3", "deepseek_v3"
    # Gemma 3: the window of each layer (None: global attention); the RoPE base of the windowed layers; the logit
    # scale is query_pre_attn_scalar ** -0.5
    sliding_windows: tuple[Optional[int], ...] = ()
    local_rope_theta: Optional[float] = None
    query_pre_attn_scalar: Optional[float] = None
    # DeepSeek-V3: latent attention, experts, YaRN
    mla: Optional[MLAConfig] = None
    moe: Optional[MoEConfig] = None
    yarn: Optional[YarnConfig] = None
    tie_word_embeddings: bool = False
