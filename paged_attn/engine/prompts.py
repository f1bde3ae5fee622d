"""Prompt normalisation: what ``LLM.generate`` accepts as prompts (a string, token ids as a list, an array or a
tensor, or a list of those; a 2-D array or tensor is one prompt per row), as a list of strings and token-id lists.
Anything ambiguous (a list mixing strings and ids, float ids) raises ValueError."""

from __future__ import annotations

import operator
from typing import Union

import numpy as np
import torch


def prompt_list(prompts) -> list[Union[str, list[int]]]:
    """The prompts of a ``generate`` call as a list of strings and token-id lists."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (torch.Tensor, np.ndarray)):
        if prompts.ndim not in (1, 2):
            raise ValueError(f"a tensor or array of prompts must be 1-D (one prompt) or 2-D (one prompt per row), "
                             f"got shape {tuple(prompts.shape)}")
        return [token_ids(prompts)] if prompts.ndim == 1 else [token_ids(row) for row in prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a string, a list of token ids or a list of prompts, got "
                         f"{type(prompts).__name__}")
    if prompts and all(_is_token_id(item) for item in prompts):
        return [token_ids(prompts)]
    return [item if isinstance(item, str) else token_ids(item) for item in prompts]


def token_ids(prompt) -> list[int]:
    """One prompt of token ids: a list or tuple of ints, or a 1-D integer array or tensor."""
    if isinstance(prompt, (torch.Tensor, np.ndarray)):
        is_int = (not prompt.dtype.is_floating_point and not prompt.dtype.is_complex and prompt.dtype != torch.bool) \
            if isinstance(prompt, torch.Tensor) else np.issubdtype(prompt.dtype, np.integer)
        if prompt.ndim != 1 or not is_int:
            raise ValueError(f"a prompt of token ids must be 1-D and of an integer dtype, got shape "
                             f"{tuple(prompt.shape)} of {prompt.dtype}")
        return [int(t) for t in prompt.tolist()]
    if not isinstance(prompt, (list, tuple)) or not all(_is_token_id(t) for t in prompt):
        raise ValueError(f"each prompt must be a string or a list of integer token ids, got {_describe(prompt)}")
    return [operator.index(t) for t in prompt]


def _is_token_id(value) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return False
    try:
        operator.index(value)
        return True
    except TypeError:
        return False


def _describe(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
