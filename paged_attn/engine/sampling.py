"""Sampling parameters and the token sampler (greedy, temperature, top-k, top-p)."""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional, Union

import torch

SAMPLING_EPS = 1e-5  # temperatures below this are greedy, as in vLLM (its _SAMPLING_EPS)


@dataclass(frozen=True)
class SamplingParams:
    """How to continue one prompt. Immutable: ``dataclasses.replace`` makes a validated copy.

    A temperature below ``SAMPLING_EPS`` (such as the default 0) is greedy. ``n > 1`` samples ``n`` completions
    that share the prompt's KV blocks; ``beam_width > 1`` is beam search (deterministic; like transformers'
    ``num_beams`` with ``early_stopping=True, length_penalty=1.0``). A completion ends at the EOS token (unless
    ``ignore_eos``), at one of ``stop_token_ids`` (both kept as its last token), when its text contains one of the
    ``stop`` strings (a string or a list of non-empty strings; the text is cut before it, after it with
    ``include_stop_str_in_output``: ``stop_strings``), or after ``max_tokens`` tokens.
    ``seed`` makes the request's sampling reproducible whatever else is in the batch. Bad values raise
    ValueError, wrong types too (a float count, a bool for a number, a NaN temperature).
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    n: int = 1
    beam_width: int = 1
    stop_token_ids: Optional[Iterable[int]] = None  # stored as a tuple
    ignore_eos: bool = False
    seed: Optional[int] = None
    stop: Union[str, Iterable[str], None] = None  # stored as a tuple
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        for name in ("max_tokens", "top_k", "n", "beam_width"):
            object.__setattr__(self, name, _int(name, getattr(self, name)))
        if self.seed is not None:
            object.__setattr__(self, "seed", _int("seed", self.seed))
        for name in ("temperature", "top_p"):
            object.__setattr__(self, name, _finite_float(name, getattr(self, name)))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        stop_token_ids = self.stop_token_ids
        if stop_token_ids is None:
            stop_token_ids = ()
        elif isinstance(stop_token_ids, (str, bytes)) or not isinstance(stop_token_ids, Iterable):
            raise ValueError(f"stop_token_ids must be an iterable of token ids such as [2], got "
                             f"{type(stop_token_ids).__name__} {stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(_int("stop_token_ids", i) for i in stop_token_ids))
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        if isinstance(stop, bytes) or not isinstance(stop, Iterable):
            raise ValueError(f"stop must be a string or a list of strings, got {type(stop).__name__} {stop!r}")
        stop = tuple(stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        object.__setattr__(self, "stop", stop)
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(f"include_stop_str_in_output must be a bool, got {self.include_stop_str_in_output!r}")

        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (below {SAMPLING_EPS} is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.n < 1 or self.beam_width < 1:
            raise ValueError(f"n and beam_width must be at least 1, got n={self.n}, beam_width={self.beam_width}")
        if self.n > 1 and self.beam_width > 1:
            raise ValueError(f"n > 1 (parallel sampling) cannot be combined with beam search "
                             f"(beam_width={self.beam_width}); use beam_width alone for several beams")
        if any(token_id < 0 for token_id in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {list(self.stop_token_ids)}")
        if self.seed is not None and not -2**63 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [-2**63, 2**64) (torch.Generator's range), got {self.seed}")

    @property
    def is_greedy(self) -> bool:
        """Whether the request takes the most likely token (temperature below SAMPLING_EPS)."""
        return self.temperature < SAMPLING_EPS

    @property
    def num_seqs(self) -> int:
        """Sequences the request runs at once: its ``n`` samples or its ``beam_width`` beams."""
        return max(self.n, self.beam_width)

    @property
    def width(self) -> int:
        """Deprecated alias of ``num_seqs``."""
        warnings.warn("SamplingParams.width is deprecated; use num_seqs", DeprecationWarning, stacklevel=2)
        return self.num_seqs


def _int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def _finite_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {type(value).__name__} {value!r}")
    return float(value)


def greedy_logprobs(logits: torch.Tensor) -> tuple[torch.Tensor, list[int], list[float]]:
    """The step's work on its float32 ``logits [num_rows, vocab_size]`` that every request needs: the log-probabilities,
    and each row's greedy token and its log-probability (as Python lists)."""
    logprobs = torch.log_softmax(logits, dim=-1)
    greedy = logprobs.argmax(dim=-1)
    return logprobs, greedy.tolist(), logprobs.gather(-1, greedy[:, None]).squeeze(-1).tolist()


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """Draw one token per row of float32 ``logits [num_rows, vocab_size]``; greedy params take the argmax."""
    if params.is_greedy:  # dividing by a temperature that rounds to 0 would give NaN probabilities
        return logits.argmax(dim=-1)
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        # NOTE: keep the smallest prefix whose probability reaches top_p: a token is dropped when the tokens
        # before it already hold top_p (summed in float64), to within SAMPLING_EPS so that a sum exactly at
        # top_p that rounds just below it (0.5 from the logits of 0.5, 0.4, 0.1) still counts. The most likely
        # token always stays.
        probs = sorted_logits.double().softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= params.top_p - SAMPLING_EPS
        drop[:, 0] = False
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)
