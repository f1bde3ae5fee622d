"""DeepSeek-V3's mixture of experts as one callable: the router (sigmoid scores plus a correction bias, the best
``num_experts_per_tok`` experts among the best ``topk_group`` of ``n_group`` groups), the routed experts (a plain
loop over the experts that some token chose) and the shared experts. It mirrors transformers'
``DeepseekV3MoE`` operation by operation: the router in float32, each expert's output times its weight in
float32, added into the token's row in the model's dtype, experts in ascending order."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .config import MoEConfig
from .layers import silu_mul

__all__ = ["MoE"]


class MoE:
    def __init__(self, config: MoEConfig, gate: torch.Tensor, bias: torch.Tensor, experts: list[dict],
                 shared: Optional[dict], linear: Callable):
        self.config = config
        self.gate = gate  # float32 [n_routed_experts, hidden_size]
        self.bias = bias  # float32 [n_routed_experts]: e_score_correction_bias, added for the choice only
        self.experts = experts  # per expert {"gate_up_proj", "down_proj"}
        self.shared = shared  # the shared experts as one MLP, or None
        self.linear = linear

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's chosen experts (int64 ``[num_tokens, num_experts_per_tok]``) and their weights (float32)."""
        cfg = self.config
        num_tokens = x.shape[0]
        scores = F.linear(x.float(), self.gate).sigmoid()
        choice = scores + self.bias
        group_scores = choice.view(num_tokens, cfg.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
        groups = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, groups, 1)
        expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, cfg.n_routed_experts // cfg.n_group).reshape(
            num_tokens, -1)
        choice = choice.masked_fill(~expert_mask.bool(), float("-inf"))
        chosen = torch.topk(choice, k=cfg.num_experts_per_tok, dim=-1, sorted=False)[1]
        weights = scores.gather(1, chosen)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return chosen, weights * cfg.routed_scaling_factor

    def mlp(self, x: torch.Tensor, weights: dict) -> torch.Tensor:
        return self.linear(silu_mul(self.linear(x, weights["gate_up_proj"])), weights["down_proj"])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``[num_tokens, hidden_size]`` -> the routed experts' weighted sum plus the shared experts'."""
        chosen, weights = self.route(x)
        out = torch.zeros_like(x)
        for expert in torch.unique(chosen).tolist():
            tokens, slot = torch.where(chosen == expert)
            y = self.mlp(x[tokens], self.experts[expert]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out if self.shared is None else out + self.mlp(x, self.shared)
