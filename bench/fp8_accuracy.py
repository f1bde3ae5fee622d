"""Accuracy of the engine's fp8 KV cache (e4m3, e5m2; scales 1.0 and calibrated) against the float32 cache, on
SmolLM2-135M-Instruct with float32 weights (CPU): teacher-forced top-1 agreement and log-probability error, and
free-running equality; then the format alone (a float32 cache of keys/values rounded to e4m3, e5m2, bfloat16).

The measurement and its method: paged_attn/engine/fp8_accuracy.py (tests/engine/test_fp8_engine.py asserts its
bounds). This script prints its figures as two markdown tables (~4 min on 2 cores).

    GOMP_SPINCOUNT=0 .venv/bin/python bench/fp8_accuracy.py [--max-tokens 64]
"""

from __future__ import annotations

import argparse

import torch

from common import describe_host

from paged_attn.engine import LlamaModel
from paged_attn.engine.fp8_accuracy import measure, measure_format_alone


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    model = LlamaModel.from_gguf(dtype=torch.float32)
    results, _ = measure(model, args.max_tokens)
    print(f"{describe_host()}\n")
    print(f"SmolLM2-135M-Instruct, float32 weights, {results[0].num_prompts} prompts x {args.max_tokens} greedy "
          f"tokens; against the float32 KV cache\n")
    print("| cache | scales | top-1 agreement (teacher-forced) | mean / max abs diff of the chosen token's logprob | "
          "largest float32 top-1 margin where they disagree | free-running outputs equal |")
    print("|---|---|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r.kv_cache_dtype} | {'calibrated' if r.calibrated else '1.0'} | {r.top1_agreement:.2%} of "
              f"{r.steps} | {r.mean_abs_logprob_diff:.4f} / {r.max_abs_logprob_diff:.3f} | "
              f"{r.max_margin_at_disagreement:.3f} | {r.same_outputs}/{r.num_prompts} |")
    print("\nThe format alone: a float32 cache holding rounded keys and values (scale 1.0), teacher-forced\n")
    print("| float32 cache holding | top-1 agreement | mean abs diff of the chosen token's logprob |")
    print("|---|---:|---:|")
    for name, top1, diff in measure_format_alone(model, args.max_tokens):
        print(f"| {name} | {top1:.2%} | {diff:.4f} |")


if __name__ == "__main__":
    main()
