"""Sampling parameters and the token sampler (greedy, temperature, top-k, top-p)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class SamplingParams:
    """How to continue one prompt.

    ``temperature == 0`` is greedy. ``n > 1`` samples ``n`` completions that share the prompt's KV blocks;
    ``beam_width > 1`` is beam search (deterministic; like transformers' ``num_beams`` with
    ``early_stopping=True, length_penalty=1.0``). A completion ends at the EOS token (unless ``ignore_eos``), at
    one of ``stop_token_ids`` (both kept as its last token), or after ``max_tokens`` tokens. ``seed`` makes the
    request's sampling reproducible whatever else is in the batch.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    n: int = 1
    beam_width: int = 1
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    seed: Optional[int] = None

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.n < 1 or self.beam_width < 1:
            raise ValueError(f"n and beam_width must be at least 1, got n={self.n}, beam_width={self.beam_width}")
        if self.n > 1 and self.beam_width > 1:
            raise ValueError(f"n > 1 (parallel sampling) cannot be combined with beam search "
                             f"(beam_width={self.beam_width}); use beam_width alone for several beams")
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def width(self) -> int:
        """Sequences the request runs at once."""
        return max(self.n, self.beam_width)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """Draw one token per row of float32 ``logits [num_rows, vocab_size]`` (temperature > 0)."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs > params.top_p  # keep the smallest prefix reaching top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)
