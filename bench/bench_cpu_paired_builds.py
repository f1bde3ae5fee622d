"""Paired timing of two builds of paged_attn's CPU decode: the same case, old and new build, turn by turn.

Two builds of the extension cannot be loaded into one process (both register ``paged_attn::paged_attention``), so
this script starts one long-lived worker process per build (``PYTHONPATH`` = the folder holding that build's
``paged_attn`` package), each holding the same decode case (same seed: same keys, values, shuffled block tables),
and asks them in turn, in ABBA order, for the median of ``--calls`` calls, ``--rounds`` times. Adjacent measurements
see about the same machine load, so the paired ratios new / old are steadier than two separate runs of
bench_cpu_attention.py; the median ratio and its quartiles are printed per case.

Note: on a shared machine the ratio still moves from one pair of worker processes to the next (memory placement,
load): run it several times (``--runs``) and compare against an A/A run (the same build twice) before reading a
difference of a few percent.

Usage::

    cp -r paged_attn /tmp/old_build/   # the build before the change (with its _C*.so)
    GOMP_SPINCOUNT=0 .venv/bin/python bench/bench_cpu_paired_builds.py /tmp/old_build . \\
        --cases 32x4096xbfloat16,1x16384xbfloat16 --rounds 60 --runs 5 [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

from common import describe_host, in_turns, median_time  # bench/ is on the path of the workers too


def serve(num_seqs: int, seq_len: int, dtype_name: str, threads: int) -> None:
    """The worker: builds the case, then per line on stdin times that many calls and prints their median seconds."""
    import torch

    import paged_attn

    if threads:
        torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    num_heads, num_kv_heads, head_dim, block_size = 32, 8, 128, 16
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-seq_len // block_size)
    num_blocks = num_seqs * blocks_per_seq
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    block_tables = torch.randperm(num_blocks, generator=gen).to(torch.int32).reshape(num_seqs, blocks_per_seq)
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32)
    query = torch.randn(num_seqs, num_heads, head_dim, generator=gen).to(dtype)
    out = torch.empty_like(query)

    def call():
        paged_attn.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, out=out)

    for _ in range(3):
        call()
    print("ready", flush=True)
    for line in sys.stdin:
        print(median_time(call, int(line), warmup=0), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", help="folder holding the old build's paged_attn package")
    parser.add_argument("new", help="folder holding the new build's paged_attn package")
    parser.add_argument("--cases", default="32x4096xbfloat16,1x16384xbfloat16,4x16384xbfloat16",
                        help="comma-separated NUM_SEQSxSEQ_LENxDTYPE (32 query / 8 kv heads, head dim 128, block 16)")
    parser.add_argument("--rounds", type=int, default=60, help="paired measurements per run")
    parser.add_argument("--calls", type=int, default=1, help="calls per measurement (their median)")
    parser.add_argument("--runs", type=int, default=1, help="runs, each with a fresh pair of worker processes")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads in the workers (0: default)")
    args = parser.parse_args()
    builds = {"old": os.path.abspath(args.old), "new": os.path.abspath(args.new)}
    print(describe_host(), flush=True)
    for case in args.cases.split(","):
        seqs, length, dtype = case.split("x")
        kv_bytes = int(seqs) * int(length) * 8 * 128 * 2 * (4 if dtype == "float32" else 2)
        run_medians = []
        for run in range(args.runs):
            procs = {}
            for name, path in builds.items():
                procs[name] = subprocess.Popen(
                    [sys.executable, __file__, "--serve", seqs, length, dtype, str(args.threads)],
                    env=dict(os.environ, PYTHONPATH=path), cwd="/", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    text=True)
                if procs[name].stdout.readline().strip() != "ready":
                    raise SystemExit(f"the {name} worker ({path}) did not start")
            times = {"old": [], "new": []}
            for r in range(args.rounds):
                for name in in_turns(["old", "new"], r):
                    procs[name].stdin.write(f"{args.calls}\n")
                    procs[name].stdin.flush()
                    times[name].append(float(procs[name].stdout.readline()))
            for proc in procs.values():
                proc.stdin.close()
                proc.wait()
            ratios = sorted(n / o for n, o in zip(times["new"], times["old"]))
            old_ms, new_ms = statistics.median(times["old"]) * 1e3, statistics.median(times["new"]) * 1e3
            quartile = lambda f: ratios[int(f * (len(ratios) - 1))]  # noqa: E731
            run_medians.append(statistics.median(ratios))
            print(f"{case} run {run + 1}: old {old_ms:.2f} ms ({kv_bytes / old_ms / 1e6:.1f} GB/s), "
                  f"new {new_ms:.2f} ms ({kv_bytes / new_ms / 1e6:.1f} GB/s); new/old median {run_medians[-1]:.3f}, "
                  f"quartiles {quartile(0.25):.3f}-{quartile(0.75):.3f}", flush=True)
        if args.runs > 1:
            print(f"{case}: median over {args.runs} runs of the runs' median new/old: "
                  f"{statistics.median(run_medians):.3f} (runs: {', '.join(f'{m:.3f}' for m in run_medians)})")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
    else:
        main()
