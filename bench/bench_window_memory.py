"""Window-aware paged memory on Gemma 3 270M (issue 26 §2): KV bytes held per request, and throughput at a fixed
KV budget, with ``window_kv_memory`` on (six KV-cache groups of 3 layers; the 5 windowed groups drop blocks that
no later query can see) and off (one block holds all 18 layers and is kept until the request ends).

1. **Held per request.** One request of L random-token prompt tokens (seeded) and 4 new tokens, alone in the
   engine (block size 16, ``max_num_batched_tokens`` 4096: a 16k prompt is computed in 4 chunks). After each step
   the block manager's blocks per attention type are read; the table gives the bytes held at the first decode
   step (the whole prompt is in the cache) and at the peak of the request, as a fraction of the all-layer cache
   (off). The ideal, before rounding to blocks, is ``(3 L + 15 min(L, 512)) / (18 L)``: 27% at 4k, 19% at 16k.
   The windowed groups take their blocks chunk by chunk and release them as chunks complete, so at its peak (a
   chunk of C tokens) a windowed group holds ``ceil((511 + C) / 16) + 1`` blocks, not the whole prompt: the
   ideal peak is ``(3 L + 15 min(L, 511 + C)) / (18 L)``, 40% at 16k with 4,096-token chunks. The last columns:
   how many such requests a pool of ``--budget-requests`` all-layer requests holds at once, by peak.
2. **Throughput at a fixed KV budget.** N requests of P-token random prompts and T new tokens (greedy, ignore
   EOS), the KV pool sized to the same bytes for both (``--budget-requests``: how many all-layer requests of
   P + T tokens it holds). Output tokens/s over the whole call (prefill included), peak running sequences,
   preemptions; on and off take turns, order flipped every repeat, after an untimed warm-up; medians. Each
   setting must give the same tokens every run (a difference stops the script); on and off batch the requests
   differently (more fit at once with it on), and the CPU's bfloat16 matmuls round a row differently in another
   batch, so on random prompts some greedy tokens part ways: the script counts the requests whose tokens agree.
   (Token-for-token equality with transformers, in float32, is what tests/engine/test_engine_gemma3.py proves.)

    GOMP_SPINCOUNT=0 .venv/bin/python bench/bench_window_memory.py           # ~6 min on 2 cores
    GOMP_SPINCOUNT=0 .venv/bin/python bench/bench_window_memory.py --quick   # 4k only, 1 repeat
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from common import describe_host, in_turns, timed_call  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from paged_attn.engine import LLM, SamplingParams, model_path  # noqa: E402
from paged_attn.engine.llm import load_model  # noqa: E402

BLOCK_SIZE = 16


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [2] + [rng.randrange(3, vocab_size) for _ in range(length - 1)]  # BOS, then no special ids


def held_per_request(model, length: int, dtype: torch.dtype) -> dict:
    """Bytes held by one request of ``length`` prompt tokens, per attention type, at its first decode step and at
    its peak, with window_kv_memory on and off."""
    prompt = random_prompt(random.Random(length), length, model.config.vocab_size)
    figures = {}
    for on in (True, False):
        llm = LLM(model, dtype=dtype, block_size=BLOCK_SIZE, window_kv_memory=on, max_model_len=length + 8,
                  num_kv_blocks=(6 if on else 1) * (-(-(length + 8) // BLOCK_SIZE)) + 64)
        scheduler, bpb = llm.scheduler, llm.runner.bytes_per_block
        scheduler.add(llm._make_request(0, prompt, SamplingParams(max_tokens=4, ignore_eos=True)))
        peak, at_decode = 0, None
        while scheduler.has_unfinished():
            step = scheduler.schedule()
            by_type = scheduler.block_manager.stats().kv_blocks_by_attention_type
            held = {kind: blocks * bpb for kind, blocks in by_type.items()}
            peak = max(peak, sum(held.values()))
            if at_decode is None and step.num_decode_tokens > 0:
                at_decode = held
            logits = llm.runner.run(step)
            scheduler.mark_computed(step)
            llm.output_processor.process(step, logits)
        figures[on] = dict(at_decode=at_decode, peak=peak)
    return figures


def throughput(model, dtype, num_requests, prompt_len, new_tokens, budget_requests, repeats) -> dict:
    rng = random.Random(0)
    prompts = [random_prompt(rng, prompt_len, model.config.vocab_size) for _ in range(num_requests)]
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    blocks_per_request = -(-(prompt_len + new_tokens) // BLOCK_SIZE)
    pool = {True: 6 * budget_requests * blocks_per_request, False: budget_requests * blocks_per_request}
    times, tokens, stats = {True: [], False: []}, {}, {}
    for rep in range(repeats + 1):
        for on in in_turns((True, False), rep):
            llm = LLM(model, dtype=dtype, block_size=BLOCK_SIZE, window_kv_memory=on, num_kv_blocks=pool[on],
                      max_model_len=prompt_len + new_tokens + 1)
            outputs, elapsed = timed_call(llm.generate, prompts, params, use_tqdm=False)
            got = [output.outputs[0].token_ids for output in outputs]
            if tokens.setdefault(on, got) != got:
                raise SystemExit(f"two runs with window_kv_memory={on} gave different tokens")
            if rep > 0:
                times[on].append(elapsed)
            stats[on] = llm.stats()
            assert sum(len(t) for t in got) == num_requests * new_tokens
    same = sum(a == b for a, b in zip(tokens[True], tokens[False]))
    return {"same_requests": same} | {on: dict(tok_s=num_requests * new_tokens / statistics.median(times[on]), stats=stats[on],
                     kv_mib=pool[on] * stats[on].bytes_per_block / 2**20) for on in (True, False)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--lengths", default="4096,16384", help="prompt lengths for the held-per-request table")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--budget-requests", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.lengths, args.repeats = "4096", 1
    dtype = getattr(torch, args.dtype)
    model = load_model(model_path("gemma3-270m"), torch.device("cpu"), dtype)
    print(f"# Gemma 3 270M, {args.dtype} KV, block size {BLOCK_SIZE}; {describe_host()}")

    print("\n| prompt tokens | held at first decode, on (global + windowed) | off | on / off | ideal "
          f"| peak on / peak off | requests in a pool of {args.budget_requests}, on / off |")
    print("|---|---|---|---|---|---|---|")
    for length in (int(x) for x in args.lengths.split(",")):
        f = held_per_request(model, length, dtype)
        on, off = f[True]["at_decode"], f[False]["at_decode"]
        ideal = (3 * length + 15 * min(length, 512)) / (18 * length)
        mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
        print(f"| {length} | {mib(sum(on.values()))} ({mib(on.get('global', 0))} + "
              f"{mib(on.get('sliding_window', 0))}) | {mib(sum(off.values()))} | "
              f"{sum(on.values()) / sum(off.values()):.1%} | {ideal:.1%} | "
              f"{f[True]['peak'] / f[False]['peak']:.1%} | "
              f"{args.budget_requests * f[False]['peak'] // f[True]['peak']} / {args.budget_requests} |", flush=True)

    r = throughput(model, dtype, args.requests, args.prompt_len, args.new_tokens, args.budget_requests,
                   args.repeats)
    print(f"\n{args.requests} requests x ({args.prompt_len} prompt + {args.new_tokens} new tokens), greedy; KV pool "
          f"{r[False]['kv_mib']:.0f} MiB (holds {args.budget_requests} all-layer requests); medians of "
          f"{args.repeats}, warm-up excluded\n")
    print("| window_kv_memory | output tok/s | peak running seqs | preemptions | steps |")
    print("|---|---|---|---|---|")
    for on in (True, False):
        s = r[on]["stats"]
        print(f"| {'on' if on else 'off'} | {r[on]['tok_s']:.1f} | {s.peak_running_seqs} | {s.num_preemptions} | "
              f"{s.num_steps} |")
    print(f"\non / off: {r[True]['tok_s'] / r[False]['tok_s']:.2f}x; requests with the same tokens on and off: "
          f"{r['same_requests']} of {args.requests}")


if __name__ == "__main__":
    main()
