"""KV memory saved by sharing blocks: parallel sampling, beam search, and a shared system prompt (paper §6.3–6.4).

Requests are drawn as in ``memory_study.py`` (log-normal lengths with the ShareGPT-like and Alpaca-like means) and
run one after another through the real ``paged_attn.BlockManager`` (block size --block-size):

- parallel sampling (n = 2, 4, 6): the prompt is allocated once and ``fork``-ed n - 1 times; each sample then
  appends its own tokens (its own output length, drawn from the dataset) and is freed when done, so the first
  write into the shared last prompt block is a copy-on-write;
- beam search (width 2, 4, 6): at each step the ``width`` new beams pick their parents among the current beams,
  the parent of rank r (best first) with weight --beam-decay ** r, so most continue from the best few; a parent
  chosen c times is ``fork``-ed c - 1 times, every chosen beam appends a token (copy-on-write where its last
  block is shared), and beams chosen by no one are freed. A request runs for its drawn output length.

Saved memory is the paper's: blocks saved by sharing divided by the blocks needed without sharing, summed over
the steps of the generation (a time average): 1 - sum(physical blocks used) / sum(block-table entries), both
read from ``BlockManager.stats()`` after every step.

- shared prefix: every request starts with the same --prefix-len-token system prompt followed by its own prompt
  (dataset lengths, random tokens); --prefix-concurrency requests run at a time (a finished one is replaced from
  the queue); the time-averaged physical blocks in use with prefix caching on and off are compared.

A simulation of the block bookkeeping only; nothing is timed.

    python bench/sharing_study.py            # 200 requests per case (~10 s)
    python bench/sharing_study.py --quick    # 40 requests per case
"""

from __future__ import annotations

import argparse
import os
import random
from collections import deque

from tqdm import tqdm

from common import DATASETS, FIGURES, lognormal_int, pyplot, sample_requests, save_figure
from paged_attn import BlockManager

PAPER = {  # memory saved, Fig. 15 and §6.3 of the paper (OPT-13B; parallel n = 2, 4, 6; beam width 2, 4, 6)
    ("alpaca-like", "parallel"): "6.1-9.8", ("alpaca-like", "beam"): "37.6-55.2",
    ("sharegpt-like", "parallel"): "16.2-30.5", ("sharegpt-like", "beam"): "44.3-66.3",
}
VOCAB = 32000


class Accumulator:
    """Sums, over steps, of the physical blocks in use and the block-table entries (= blocks without sharing)."""

    def __init__(self, bm: BlockManager):
        self.bm, self.used, self.logical = bm, 0, 0

    def record(self):
        s = self.bm.stats()
        self.used += s.kv_blocks_used
        self.logical += s.logical_blocks

    def saved(self) -> float:
        return 1 - self.used / self.logical


def generate_one_token(bm, rng, remaining: dict) -> None:
    """Appends a random token to every sequence of `remaining` (seq_id -> tokens still to generate) and frees
    those that are done."""
    for seq_id in list(remaining):
        bm.append_slot(seq_id, rng.randrange(VOCAB))
        remaining[seq_id] -= 1
        if remaining[seq_id] == 0:
            bm.free(seq_id)
            del remaining[seq_id]


def run_parallel(bm, acc, rng, prompt: int, outputs: list[int]):
    bm.allocate(0, [rng.randrange(VOCAB) for _ in range(prompt)])
    for sample in range(1, len(outputs)):
        bm.fork(0, sample)
    remaining = dict(enumerate(outputs))
    while remaining:
        acc.record()
        generate_one_token(bm, rng, remaining)


def run_beam(bm, acc, rng, prompt: int, output: int, width: int, decay: float):
    bm.allocate(0, [rng.randrange(VOCAB) for _ in range(prompt)])
    beams, next_id = [0], 1  # best first
    for _ in range(output):
        acc.record()
        weights = [decay ** rank for rank in range(len(beams))]
        parents = sorted(rng.choices(range(len(beams)), weights, k=width))  # ranks, best first
        for rank, beam in enumerate(beams):
            if rank not in parents:
                bm.free(beam)
        new_beams = []
        for rank in sorted(set(parents)):
            children = [beams[rank]]
            for _ in range(parents.count(rank) - 1):
                bm.fork(beams[rank], next_id)
                children.append(next_id)
                next_id += 1
            for child in children:
                bm.append_slot(child, rng.randrange(VOCAB))
            new_beams += children
        beams = new_beams
    acc.record()
    for beam in beams:
        bm.free(beam)


def run_prefix(requests, prefix_len: int, concurrency: int, block_size: int, caching: bool, seed: int):
    rng = random.Random(seed)
    system_prompt = [rng.randrange(VOCAB) for _ in range(prefix_len)]
    bm = BlockManager(concurrency * (2 * 2048 + prefix_len) // block_size + 16, block_size,
                      enable_prefix_caching=caching)
    queue, running, used, steps, cached_tokens, prompt_tokens = deque(enumerate(requests)), {}, 0, 0, 0, 0
    while queue or running:
        while queue and len(running) < concurrency:
            rid, (prompt, output) = queue.popleft()
            tokens = system_prompt + [rng.randrange(VOCAB) for _ in range(prompt)]
            cached_tokens += bm.allocate(rid, tokens)
            prompt_tokens += len(tokens)
            running[rid] = output
        used += bm.stats().kv_blocks_used
        steps += 1
        generate_one_token(bm, rng, running)
    return used / steps, cached_tokens / prompt_tokens


def plot(sharing: dict, prefix: dict, datasets: list[str]):
    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    cases = list(next(iter(sharing.values())))
    width = 0.8 / len(datasets)
    for i, dataset in enumerate(datasets):
        xs = [j + (i - (len(datasets) - 1) / 2) * width for j in range(len(cases))]
        bars = ax.bar(xs, [100 * sharing[dataset][case] for case in cases], width, label=dataset)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks(range(len(cases)), [f"{kind}\n{'n' if kind == 'parallel' else 'width'} = {k}"
                                      for kind, k in cases])
    ax.set_ylabel("KV blocks saved vs no sharing (%)")
    ax.set_title("parallel sampling and beam search (fork + copy-on-write)")
    ax.legend(frameon=False)
    ax.margins(y=0.12)

    labels = list(prefix)
    xs = range(len(labels))
    off = [prefix[label]["off"] for label in labels]
    on = [prefix[label]["on"] for label in labels]
    ax2.bar([x - 0.2 for x in xs], off, 0.4, label="prefix caching off", color="#868e96")
    bars = ax2.bar([x + 0.2 for x in xs], on, 0.4, label="prefix caching on", color="#1c7ed6")
    ax2.bar_label(bars, labels=[f"-{100 * (1 - a / b):.0f}%" for a, b in zip(on, off)], fontsize=8)
    ax2.set_xticks(list(xs), labels)
    ax2.set_ylabel("KV blocks in use (time average)")
    ax2.set_title("shared system prompt")
    ax2.legend(frameon=False)
    ax2.margins(y=0.12)
    save_figure(fig, "sharing.png")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", default=",".join(DATASETS))
    parser.add_argument("--num-requests", type=int, default=200, help="requests per case")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--widths", default="2,4,6", help="parallel samples n and beam widths")
    parser.add_argument("--beam-decay", type=float, default=0.5,
                        help="weight of the parent of rank r is decay**r (smaller: beams converge faster)")
    parser.add_argument("--prefix-len", type=int, default=512, help="tokens of the shared system prompt")
    parser.add_argument("--prefix-concurrency", default="8,32", help="requests running at a time")
    parser.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of the lengths")
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--quick", action="store_true", help="40 requests per case")
    args = parser.parse_args()
    if args.quick:
        args.num_requests = 40
    datasets = args.datasets.split(",")
    widths = [int(w) for w in args.widths.split(",")]
    concurrencies = [int(c) for c in args.prefix_concurrency.split(",")]
    cases = [(kind, k) for kind in ["parallel", "beam"] for k in widths]

    sharing, prefix = {}, {}
    runs = [(d, case) for d in datasets for case in cases]
    runs += [(d, ("prefix", c)) for d in datasets for c in concurrencies]
    for dataset, (kind, k) in tqdm(runs, desc="simulating", unit="case"):
        requests = sample_requests(dataset, args.num_requests, args.seed, args.sigma, args.max_len)
        rng = random.Random(f"{dataset}-{kind}-{k}-{args.seed}")
        if kind == "prefix":
            budget = args.max_len - args.prefix_len  # keep system prompt + prompt + output within max_len
            requests = [(min(p, budget - 1), min(o, budget - min(p, budget - 1))) for p, o in requests]
            off, _ = run_prefix(requests, args.prefix_len, k, args.block_size, False, args.seed)
            on, hit = run_prefix(requests, args.prefix_len, k, args.block_size, True, args.seed)
            prefix[f"{dataset}\n{k} at a time"] = {"dataset": dataset, "concurrency": k, "off": off, "on": on,
                                                   "hit": hit}
            continue
        bm = BlockManager(k * args.max_len // args.block_size + 2 * k + 8, args.block_size)
        acc = Accumulator(bm)
        mean_out = DATASETS[dataset][1]
        for prompt, output in requests:
            if kind == "parallel":
                outputs = [output] + [lognormal_int(rng, mean_out, args.sigma, args.max_len - prompt)
                                      for _ in range(k - 1)]
                run_parallel(bm, acc, rng, prompt, outputs)
            else:
                run_beam(bm, acc, rng, prompt, output, k, args.beam_decay)
        assert not bm.seqs and bm.num_free_blocks == bm.num_kv_blocks
        sharing.setdefault(dataset, {})[(kind, k)] = acc.saved()

    print(f"\nblock size {args.block_size}, {args.num_requests} requests per case, lengths log-normal sigma "
          f"{args.sigma} clipped to {args.max_len}, beam parent weight {args.beam_decay}**rank, seed {args.seed}\n")
    print("| dataset | case | KV blocks saved vs no sharing | paper (Fig. 15, range over 2/4/6) |")
    print("|---|---|---:|---:|")
    for dataset in datasets:
        for (kind, k), saved in sharing[dataset].items():
            label = f"parallel sampling, n = {k}" if kind == "parallel" else f"beam search, width = {k}"
            print(f"| {dataset} | {label} | {100 * saved:.1f}% | {PAPER.get((dataset, kind), '')}% |")
    print(f"\nshared system prompt of {args.prefix_len} tokens, then the dataset's prompt and output\n")
    print("| dataset | requests at a time | blocks in use, caching off | caching on | saved | prompt tokens cached |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in prefix.values():
        print(f"| {row['dataset']} | {row['concurrency']} | {row['off']:.1f} | {row['on']:.1f} | "
              f"{100 * (1 - row['on'] / row['off']):.1f}% | {100 * row['hit']:.1f}% |")
    if not args.no_plots:
        plot(sharing, prefix, datasets)
        print(f"\nplot: {os.path.relpath(FIGURES)}/sharing.png")


if __name__ == "__main__":
    main()
