"""Sequences and requests: what the engine knows about each prompt it serves, and each completion it grows.

A ``Request`` is one prompt with its ``SamplingParams``; its sequences (``Sequence``) are the completions it grows
at once (one, ``n`` parallel samples, or ``beam_width`` beams), which share the prompt's KV blocks through
``fork``. Each sequence's ``token_ids`` are its prompt plus every token sampled so far, and the first
``num_computed_tokens`` of them have their KV in the cache.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from .sampling import SamplingParams

_seq_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    token_ids: list[int]
    num_prompt_tokens: int
    cumulative_logprob: float = 0.0
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_computed_tokens: int = 0  # leading tokens whose KV is in the cache
    finish_reason: Optional[str] = None
    score: float = 0.0  # beam search: cumulative log-probability / length
    stop_reason: Union[int, str, None] = None  # the stop token id or stop string that ended it (None: EOS, length)
    text: Optional[str] = None  # ended by a stop string: its text, cut there (else decoded from its tokens)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass(eq=False)
class Request:
    request_id: int  # arrival order: a lower id is older
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    seqs: list[Sequence] = field(default_factory=list)  # live (running, swapped or waiting) sequences
    finished: list[Sequence] = field(default_factory=list)
    forked: bool = False  # whether the prompt's sequence has been fanned out into n samples / beams
    prefilled: bool = False  # every token allocated at admission is computed: the request decodes

    def __post_init__(self):
        if not self.seqs:
            self.seqs = [Sequence(list(self.prompt_token_ids), len(self.prompt_token_ids))]
