"""Accuracy of an fp8 KV cache on the real model (SmolLM2-135M-Instruct, float32 weights, CPU), against the float32
cache.

For each prompt (the main job's six and ten more, chat-formatted), the float32-cache engine generates greedily
(``ignore_eos``). Then each cache variant is measured two ways:

- teacher-forced: the prompt and that float32 output are fed in one pass through the variant's cache (keys and
  values are written to the cache first and read back from it, as in decoding), and at every generated position
  the variant's argmax is compared with the float32 cache's argmax of the same pass, and the log-probability of the
  token the float32 cache chose is compared (mean absolute difference);
- free-running: the variant's engine generates greedily itself; how many outputs equal the float32 cache's token
  for token.

Variants: fp8 e4m3 and e5m2, scales 1.0 (vLLM's default) and calibrated (from the first call's prompts).

Then the format alone, without the fp8 kernels: a float32 cache holding keys and values rounded to a narrower
format before they are written (``rounded_kv``), teacher-forced the same way: e4m3 keys and values, keys only,
values only, e5m2, and bfloat16 for scale. Where e4m3 in the fp32 cache agrees as often as the fp8 cache, the
loss is the format's, not the kernels'.

``measure`` and ``measure_format_alone`` return the figures; bench/fp8_accuracy.py prints them as tables (~4 min),
tests/engine/test_fp8_engine.py asserts their bounds::

    GOMP_SPINCOUNT=0 .venv/bin/python bench/fp8_accuracy.py [--max-tokens 64]
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import torch

EXTRA_PROMPTS = [
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "Write a Python function that reverses a string.",
    "What are the main differences between a cat and a dog as pets?",
    "Translate 'good morning, how are you?' into French.",
    "List four ways to save energy at home.",
    "Why do leaves change colour in autumn?",
    "Describe a sunrise over the mountains.",
    "What is the boiling point of water at sea level, in Celsius and Fahrenheit?",
    "Give a short definition of machine learning.",
    "Write two lines of a poem about rain.",
]
VARIANTS = [("fp8_e4m3", False), ("fp8_e4m3", True), ("fp8_e5m2", False), ("fp8_e5m2", True)]
# (name, key format, value format) of a float32 cache holding rounded keys and values; None: not rounded
ROUNDINGS = [("e4m3 keys and values", torch.float8_e4m3fn, torch.float8_e4m3fn),
             ("e4m3 keys only", torch.float8_e4m3fn, None), ("e4m3 values only", None, torch.float8_e4m3fn),
             ("e5m2 keys and values", torch.float8_e5m2, torch.float8_e5m2),
             ("bfloat16 keys and values", torch.bfloat16, torch.bfloat16)]


@dataclass
class Accuracy:
    kv_cache_dtype: str
    calibrated: bool
    steps: int  # generated positions compared, over all prompts
    top1_agreement: float  # fraction of steps where the variant's argmax is the float32 cache's
    mean_abs_logprob_diff: float  # of the float32 cache's chosen token
    max_abs_logprob_diff: float
    max_margin_at_disagreement: float  # the float32 cache's top-1 minus top-2 logprob, largest where they disagree
    same_outputs: int  # free-running greedy outputs equal to the float32 cache's, token for token
    num_prompts: int


def prompts(model) -> list[list[int]]:
    from paged_attn.__main__ import DEFAULT_PROMPTS

    return [model.tokenizer.encode(model.tokenizer.apply_chat_template(p)) for p in DEFAULT_PROMPTS + EXTRA_PROMPTS]


def greedy(llm, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    from paged_attn.engine import SamplingParams

    outputs = llm.generate(prompt_ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@torch.inference_mode()
def teacher_forced_logprobs(llm, token_ids: list[int], num_prompt_tokens: int) -> torch.Tensor:
    """float32 log-probabilities ``[len(token_ids) - num_prompt_tokens, vocab]`` of the tokens after the prompt,
    from one pass over all of ``token_ids`` through ``llm``'s KV cache (its blocks from 0 on; ``llm`` must be idle
    and without prefix caching) and its current fp8 scales."""
    from paged_attn.engine.batch import Batch

    runner, n = llm.runner, len(token_ids)
    num_blocks = math.ceil(n / runner.block_size)
    if num_blocks > len(runner.kv_caches[0][0]):
        raise ValueError(f"{n} tokens do not fit the cache's {len(runner.kv_caches[0][0])} blocks")
    device = runner.device
    batch = Batch(
        input_ids=torch.tensor(token_ids, device=device), positions=torch.arange(n, device=device),
        # one KV-cache group (the model has no windowed layers); blocks 0, 1, ... in order: slot i holds token i
        slot_mapping=torch.arange(n, device=device).view(1, -1),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device).view(1, 1, -1),
        layer_groups=(0,) * llm.model.config.num_layers,
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device), max_query_len=n,
        logits_indices=torch.arange(num_prompt_tokens - 1, n - 1, device=device))
    return torch.log_softmax(llm.model.forward(batch, runner.kv_caches, runner.kv_scales), dim=-1)


def _round(x: torch.Tensor, dtype) -> torch.Tensor:
    """x rounded to ``dtype`` and back (fp8: what an fp8 cache stores and reads, scale 1.0)."""
    from paged_attn import reference

    if dtype is None:
        return x
    if dtype.itemsize == 1:
        return reference.dequantize_fp8(reference.quantize_fp8(x, dtype), dtype=x.dtype)
    return x.to(dtype).to(x.dtype)


@contextlib.contextmanager
def rounded_kv(key_dtype, value_dtype):
    """While active, the engine's forward rounds the keys / values it writes to the KV cache to these formats (a
    float32 cache then holds exactly those values): the format's rounding without the fp8 kernels."""
    from paged_attn import ops
    from paged_attn.engine import model as model_module

    def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, **kwargs):
        ops.reshape_and_cache(_round(key, key_dtype), _round(value, value_dtype), key_cache, value_cache,
                              slot_mapping, **kwargs)

    model_module.ops = SimpleNamespace(reshape_and_cache=reshape_and_cache, paged_attention=ops.paged_attention)
    try:
        yield
    finally:
        model_module.ops = ops


def compare(llm, prompt_ids, outputs, reference_logprobs) -> tuple[int, int, torch.Tensor, float]:
    """Teacher-forced through ``llm``'s cache along ``outputs``: (steps whose argmax is the reference's, steps,
    |d logprob| of the chosen token at every step, the reference's largest top-1 margin where they disagree)."""
    same, steps, diffs, margin = 0, 0, [], 0.0
    for p, o, ref in zip(prompt_ids, outputs, reference_logprobs):
        logprobs = teacher_forced_logprobs(llm, p + o, len(p))
        agree = logprobs.argmax(-1) == ref.argmax(-1)
        same += int(agree.sum())
        steps += len(o)
        top2 = ref.topk(2, dim=-1).values
        margin = max([margin] + (top2[:, 0] - top2[:, 1])[~agree].tolist())
        chosen = torch.tensor(o).unsqueeze(1)
        diffs.append((logprobs.gather(1, chosen) - ref.gather(1, chosen)).abs().squeeze(1))
    return same, steps, torch.cat(diffs), margin


def measure_format_alone(model, max_tokens: int = 64, roundings=ROUNDINGS) -> list[tuple[str, float, float]]:
    """(name, top-1 agreement, mean |d logprob|) of a float32 cache holding rounded keys and values, teacher-forced
    along the float32 cache's greedy output."""
    from paged_attn.engine import LLM

    prompt_ids = prompts(model)
    llm = LLM(model)
    outputs = greedy(llm, prompt_ids, max_tokens)
    reference_logprobs = [teacher_forced_logprobs(llm, p + o, len(p)) for p, o in zip(prompt_ids, outputs)]
    results = []
    for name, key_dtype, value_dtype in roundings:
        with rounded_kv(key_dtype, value_dtype):
            same, steps, diffs, _ = compare(llm, prompt_ids, outputs, reference_logprobs)
        results.append((name, same / steps, float(diffs.mean())))
    return results


def measure(model, max_tokens: int = 64, variants=VARIANTS,
            prompt_ids: Optional[list[list[int]]] = None) -> tuple[list[Accuracy], list[list[int]]]:
    """The float32 cache's greedy outputs, then every variant's agreement with them (``prompt_ids``: token ids, by
    default the chat prompts above)."""
    from paged_attn.engine import LLM

    prompt_ids = prompt_ids or prompts(model)
    reference = LLM(model)
    outputs = greedy(reference, prompt_ids, max_tokens)
    reference_logprobs = [teacher_forced_logprobs(reference, p + o, len(p)) for p, o in zip(prompt_ids, outputs)]
    del reference
    results = []
    for kv_cache_dtype, calibrated in variants:
        llm = LLM(model, kv_cache_dtype=kv_cache_dtype, calibrate_kv_scales=calibrated)
        free = greedy(llm, prompt_ids, max_tokens)  # first: this call's prompts calibrate the scales
        same, steps, diffs, margin = compare(llm, prompt_ids, outputs, reference_logprobs)
        results.append(Accuracy(kv_cache_dtype, calibrated, steps, same / steps, float(diffs.mean()),
                                float(diffs.max()), margin, sum(a == b for a, b in zip(free, outputs)),
                                len(prompt_ids)))
    return results, outputs
