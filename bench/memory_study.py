"""KV-cache memory waste and concurrency: contiguous reservation against paging (the paper's Figure 2 analogue).

A stream of requests replays, time step by time step, through a fixed KV pool of --pool-slots token slots (by
default 16,384: eight maximum-length requests, about the KV space of a 13B model on a 40 GB GPU):

- max:    a contiguous first-fit allocator reserving --max-len slots per request (Orca (Max) in the paper);
- oracle: a contiguous first-fit allocator reserving exactly prompt + output slots (Orca (Oracle));
- paged:  the real ``paged_attn.BlockManager`` at block sizes 8/16/32/64/128 (vLLM): allocate the prompt,
          ``append_slot`` token by token, ``free`` at the end; when a sequence needs a block and none is free,
          the most recently admitted request is preempted (freed and requeued at the front, as vLLM recomputes).

Time is simple: every request is queued at step 0; at each step requests are admitted first come first served
while memory allows (paged: the prompt's blocks plus a 1% watermark), then every running request generates one
token; a request leaves once it has generated its output. Lengths are log-normal (sigma --sigma, mu set so the
unclipped mean matches the dataset's), clipped to [1, --max-len] and prompt + output <= --max-len:

    sharegpt-like: mean input 161, mean output 338      alpaca-like: mean input 19, mean output 58

The pool's slots are split (time-averaged over the steps while requests wait, i.e. while memory is the limit) into
token states (slots holding a token), reserved (held for tokens a request will still generate), internal
fragmentation (contiguous: slots past the final length that are never used; paged: empty slots of last blocks),
external fragmentation (contiguous: free memory, in holes too small for the next request) and free (paged:
free blocks, any of which fits any request). A simulation of the allocators only; nothing is timed.

    python bench/memory_study.py            # 2000 requests per dataset, a 16,384-slot pool (~10 s)
    python bench/memory_study.py --quick    # 600 requests per dataset, an 8,192-slot pool
"""

from __future__ import annotations

import argparse
import bisect
import math
import os
from collections import deque

from tqdm import tqdm

from common import DATASETS, FIGURES, pyplot, sample_requests, save_figure

from paged_attn import BlockManager

CATEGORIES = ["token states", "reserved", "internal frag.", "external frag.", "free"]
COLORS = ["#2b8a3e", "#f59f00", "#e8590c", "#c92a2a", "#ced4da"]


class FirstFit:
    """A contiguous allocator over [0, size): sorted free holes, first fit, coalescing on free."""

    def __init__(self, size: int):
        self.starts, self.sizes = [0], [size]

    def alloc(self, n: int):
        for i, hole in enumerate(self.sizes):
            if hole >= n:
                start = self.starts[i]
                if hole == n:
                    del self.starts[i], self.sizes[i]
                else:
                    self.starts[i], self.sizes[i] = start + n, hole - n
                return start
        return None

    def free(self, start: int, n: int):
        i = bisect.bisect(self.starts, start)
        if i < len(self.starts) and start + n == self.starts[i]:  # merge with the next hole
            n += self.sizes[i]
            del self.starts[i], self.sizes[i]
        if i > 0 and self.starts[i - 1] + self.sizes[i - 1] == start:  # and with the previous one
            self.sizes[i - 1] += n
        else:
            self.starts.insert(i, start)
            self.sizes.insert(i, n)


class Meter:
    """Time-averaged shares of the pool and concurrency, over the steps where a request is waiting."""

    def __init__(self, pool: int):
        self.pool, self.steps, self.sums, self.running_sum, self.peak = pool, 0, [0] * len(CATEGORIES), 0, 0

    def record(self, parts, running: int):
        assert sum(parts) == self.pool, parts
        self.steps += 1
        self.sums = [s + p for s, p in zip(self.sums, parts)]
        self.running_sum += running
        self.peak = max(self.peak, running)

    def result(self, steps_total: int, preemptions: int = 0) -> dict:
        shares = [s / max(1, self.steps * self.pool) for s in self.sums]
        return dict(zip(CATEGORIES, shares), mean_running=self.running_sum / max(1, self.steps), peak=self.peak,
                    steps=steps_total, steps_saturated=self.steps, preemptions=preemptions)


def run_contiguous(requests, pool: int, max_len: int, oracle: bool) -> dict:
    allocator, queue, running, meter, step = FirstFit(pool), deque(range(len(requests))), {}, Meter(pool), 0
    while queue or running:
        while queue:  # admit first come first served while the next reservation fits in some hole
            prompt, output = requests[queue[0]]
            reserve = prompt + output if oracle else max_len
            start = allocator.alloc(reserve)
            if start is None:
                break
            running[queue.popleft()] = [start, reserve, prompt, prompt + output]  # start, size, length, final
        if queue:
            tokens = sum(r[2] for r in running.values())
            final = sum(r[3] for r in running.values())
            reserved = sum(r[1] for r in running.values())
            record = [tokens, final - tokens, reserved - final, pool - reserved, 0]
            meter.record(record, len(running))
        for rid in list(running):  # one decoding step
            entry = running[rid]
            entry[2] += 1
            if entry[2] == entry[3]:
                allocator.free(entry[0], entry[1])
                del running[rid]
        step += 1
    return meter.result(step)


def run_paged(requests, pool: int, block_size: int, watermark: float = 0.01) -> dict:
    num_blocks = pool // block_size
    bm, meter = BlockManager(num_blocks, block_size), Meter(num_blocks * block_size)
    queue, running, step, preemptions = deque(range(len(requests))), {}, 0, 0  # running: rid -> tokens left
    min_free = math.ceil(watermark * num_blocks)
    while queue or running:
        while queue:
            prompt, output = requests[queue[0]]
            if bm.num_free_blocks - math.ceil(prompt / block_size) < min_free:
                break
            rid = queue.popleft()
            bm.allocate(rid, [0] * prompt)
            running[rid] = output
        if queue:
            s = bm.stats()
            used = s.kv_blocks_used * block_size
            meter.record([s.num_tokens, 0, s.internal_fragmentation, 0, meter.pool - used], len(running))
        for rid in list(running):
            if rid not in running:  # preempted earlier in this step
                continue
            while not bm.can_append_slot(rid):  # out of blocks: preempt the latest request (recompute later)
                victim, _ = running.popitem()
                bm.free(victim)
                queue.appendleft(victim)
                preemptions += 1
                if victim == rid:
                    break
            if rid not in running:
                continue
            bm.append_slot(rid, 0)
            running[rid] -= 1
            if running[rid] == 0:
                bm.free(rid)
                del running[rid]
        step += 1
    return meter.result(step, preemptions)


def plot(results: dict, datasets: list[str]):
    plt = pyplot()
    fig, axes = plt.subplots(1, len(datasets), figsize=(6.5 * len(datasets), 4.2), squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        systems = list(results[dataset])
        left = [0.0] * len(systems)
        for category, color in zip(CATEGORIES, COLORS):
            widths = [100 * results[dataset][name][category] for name in systems]
            ax.barh(systems, widths, left=left, color=color, label=category, edgecolor="white", linewidth=0.5)
            for y, (x0, w) in enumerate(zip(left, widths)):
                if category == "token states":
                    ax.text(x0 + w + 1 if w < 12 else x0 + w / 2, y, f"{w:.1f}%", va="center",
                            ha="left" if w < 12 else "center", fontsize=8, color="black" if w < 12 else "white",
                            bbox=dict(facecolor="white", edgecolor="none", pad=1) if w < 12 else None)
            left = [a + b for a, b in zip(left, widths)]
        ax.invert_yaxis()
        ax.set_xlim(0, 100)
        ax.set_xlabel("share of the KV pool (%)")
        ax.set_title(f"{dataset}: where the KV memory goes")
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=len(CATEGORIES), frameon=False)
    save_figure(fig, "memory_waste.png", rect=(0, 0.08, 1, 1))

    fig, axes = plt.subplots(1, len(datasets), figsize=(6.5 * len(datasets), 3.8), squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        systems = list(results[dataset])
        means = [results[dataset][name]["mean_running"] for name in systems]
        bars = ax.bar(systems, means, color=["#868e96", "#495057"] + ["#1c7ed6"] * (len(systems) - 2))
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_ylabel("concurrent requests (mean while queued)")
        ax.set_title(f"{dataset}: requests sharing one KV pool")
        ax.tick_params(axis="x", rotation=30)
        ax.margins(y=0.12)
    save_figure(fig, "concurrency.png")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", default=",".join(DATASETS))
    parser.add_argument("--num-requests", type=int, default=2000, help="requests per dataset")
    parser.add_argument("--pool-slots", type=int, default=16384, help="KV pool size in token slots")
    parser.add_argument("--max-len", type=int, default=2048, help="maximum sequence length (max reservation)")
    parser.add_argument("--block-sizes", default="8,16,32,64,128")
    parser.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of the lengths")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--quick", action="store_true", help="600 requests per dataset, an 8,192-slot pool")
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.pool_slots = 600, 8192
    datasets = args.datasets.split(",")
    block_sizes = [int(b) for b in args.block_sizes.split(",")]

    results = {}
    runs = [(d, s) for d in datasets for s in ["max", "oracle"] + [f"paged-{b}" for b in block_sizes]]
    requests = {d: sample_requests(d, args.num_requests, args.seed, args.sigma, args.max_len) for d in datasets}
    for dataset, system in tqdm(runs, desc="replaying", unit="run"):
        reqs = requests[dataset]
        if system == "max" or system == "oracle":
            result = run_contiguous(reqs, args.pool_slots, args.max_len, oracle=system == "oracle")
        else:
            result = run_paged(reqs, args.pool_slots, int(system.split("-")[1]))
        results.setdefault(dataset, {})[system] = result
        if result["steps_saturated"] == 0:
            print(f"warning: {dataset} {system} never ran out of memory (every request fit at once); "
                  "its shares are 0: use more requests or a smaller pool")

    print(f"\npool {args.pool_slots} token slots, {args.num_requests} requests per dataset queued at step 0, "
          f"lengths log-normal sigma {args.sigma} clipped to {args.max_len}, seed {args.seed}")
    for dataset in datasets:
        reqs = requests[dataset]
        mean_in = sum(p for p, _ in reqs) / len(reqs)
        mean_out = sum(o for _, o in reqs) / len(reqs)
        print(f"\n{dataset}: mean input {mean_in:.1f}, mean output {mean_out:.1f} tokens (sampled)\n")
        header = ["system"] + [f"{c} %" for c in CATEGORIES] + \
            ["concurrent (mean)", "concurrent (peak)", "steps to drain", "preemptions"]
        print("| " + " | ".join(header) + " |\n|---|" + "---:|" * (len(header) - 1))
        for system, r in results[dataset].items():
            cells = [system] + [f"{100 * r[c]:.1f}" for c in CATEGORIES] + \
                [f"{r['mean_running']:.1f}", str(r["peak"]), str(r["steps"]), str(r["preemptions"])]
            print("| " + " | ".join(cells) + " |")
    if not args.no_plots:
        plot(results, datasets)
        print(f"\nplots: {os.path.relpath(FIGURES)}/memory_waste.png, concurrency.png")


if __name__ == "__main__":
    main()
