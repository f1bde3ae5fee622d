"""The engine's host work per decode step as the batch grows (issue 54): it must stay flat per sequence, growing no
faster than the step's kernels. Fails loudly (exit status 1) where it does.

SmolLM2-135M-Instruct (float32 by default), prompts of 20-120 random tokens, greedy, ``ignore_eos``, 64 new tokens,
batch 1 / 8 / 32 / 64 (how many at once). Every decode step of two generates per batch (after a warm-up) is timed
whole and in parts: the *kernels* are the model's forward pass and the sampling work on the logits that every request
needs (``sampling.greedy_logprobs``: log-softmax, argmax); the *host* work is the rest of the step (scheduling, the
block manager, the paged metadata, stats, Python per sequence). Medians over the steps. The check: at every batch b,
host(b) / host(1) <= TOLERANCE * kernels(b) / kernels(1): the host's share of a step may not grow with the batch
(TOLERANCE leaves room for noise between runs on a shared machine, not for a trend).

    GOMP_SPINCOUNT=0 .venv/bin/python bench/bench_host_overhead.py                    # ~2 min on 2 cores
    GOMP_SPINCOUNT=0 .venv/bin/python bench/bench_host_overhead.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

from common import describe_host

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from paged_attn.engine import LLM, SamplingParams, sampling  # noqa: E402

TOLERANCE = 1.25


class StepTimer:
    """Times each engine step whole, and the kernels' part of it (the forward pass and the logits' sampling work)."""

    def __init__(self, llm: LLM):
        self.kernels = 0.0
        self.llm = llm
        model = llm.runner.model
        forward, greedy_logprobs = model.forward, sampling.greedy_logprobs

        def timed(function):
            def call(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return function(*args, **kwargs)
                finally:
                    self.kernels += time.perf_counter() - start
            return call

        model.forward = timed(forward)
        sampling.greedy_logprobs = timed(greedy_logprobs)

    def decode_steps(self, prompts: list[list[int]], params: SamplingParams, first_id: int) -> list[tuple[float, float]]:
        """(step seconds, kernel seconds) of every step after the first (the prefill) of one generate."""
        for i, prompt in enumerate(prompts):
            self.llm.scheduler.add(self.llm._make_request(first_id + i, prompt, params))
        steps = []
        while self.llm.scheduler.has_unfinished():
            self.kernels = 0.0
            start = time.perf_counter()
            self.llm._step()
            steps.append((time.perf_counter() - start, self.kernels))
        return steps[1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    llm = LLM("smollm2-135m", dtype=getattr(torch, args.dtype), block_size=32)
    rng = random.Random(0)
    vocab_size = llm.model.config.vocab_size
    prompts = [[rng.randrange(3, vocab_size) for _ in range(rng.randrange(20, 121))] for _ in range(max(batch_sizes))]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    timer = StepTimer(llm)
    print(f"# SmolLM2-135M, {args.dtype}, block size 32, {args.max_tokens} new tokens; {describe_host()}\n")
    print("| batch | step ms | kernels ms | host ms | host share | host us per sequence |")
    print("|---:|---:|---:|---:|---:|---:|")
    rows, first_id = {}, 0
    for batch in batch_sizes:
        timer.decode_steps(prompts[:batch], SamplingParams(max_tokens=4, ignore_eos=True), first_id)  # warm-up
        steps = []
        for _ in range(2):
            first_id += 1000
            steps += timer.decode_steps(prompts[:batch], params, first_id)
        step = statistics.median(s for s, _ in steps)
        kernels = statistics.median(k for _, k in steps)
        host = statistics.median(s - k for s, k in steps)
        rows[batch] = (kernels, host)
        print(f"| {batch} | {step * 1e3:.2f} | {kernels * 1e3:.2f} | {host * 1e3:.2f} | {host / step:.1%} | "
              f"{host / batch * 1e6:.0f} |", flush=True)
    base_kernels, base_host = rows[batch_sizes[0]]
    failed = [batch for batch, (kernels, host) in rows.items()
              if host / base_host > TOLERANCE * kernels / base_kernels]
    for batch in failed:
        kernels, host = rows[batch]
        print(f"FAIL: at batch {batch} the host work grew {host / base_host:.2f}x over batch {batch_sizes[0]}, the "
              f"kernels {kernels / base_kernels:.2f}x (allowed: {TOLERANCE} x the kernels' growth)", file=sys.stderr)
    if failed:
        raise SystemExit(1)
    print(f"\nhost work grows no faster than the kernels (within {TOLERANCE}x) at batch {', '.join(map(str, rows))}")


if __name__ == "__main__":
    main()
