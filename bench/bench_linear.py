"""paged_attn.ops.linear (weights packed once for the CPU's dot-product units) against oneDNN's prepacked matmul
(``torch.ops.mkldnn._linear_pointwise`` on ``_reorder_linear_weight``, what the engine used before), on
SmolLM2-135M's projections.

- ``--mode model``: all 121 projections of the model in one pass (30 layers x qkv, o, gate_up, down, and the
  vocabulary head): the weights stream from memory, as in a decode step; GB/s of weights read.
- ``--mode layer``: one layer's four projections, in cache: bound by arithmetic; GFLOP/s.

Medians of interleaved passes (ours, oneDNN, ours, ...) in one process. Run from the repository root::

    GOMP_SPINCOUNT=0 .venv/bin/python bench/bench_linear.py --mode model --rows 1,8,32,64
    GOMP_SPINCOUNT=0 .venv/bin/python bench/bench_linear.py --mode layer --rows 8,64,512,2048
"""

import argparse
import statistics
import time

import torch

from paged_attn import ops

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out_features, in_features): qkv, o, gate_up, down
HEAD = (49152, 576)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["model", "layer"], default="model")
    parser.add_argument("--rows", default="1,8,32,64")
    parser.add_argument("--dtype", default="bfloat16,float32")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    shapes = LAYER * 30 + [HEAD] if args.mode == "model" else LAYER
    print(f"linear uses AVX-512: {ops.linear_uses_avx512()}, {torch.get_num_threads()} threads, mode {args.mode}")
    for dtype in [getattr(torch, d) for d in args.dtype.split(",")]:
        weights = [torch.randn(n, k).to(dtype) for n, k in shapes]
        ours = [ops.pack_linear_weight(w) for w in weights]
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
        del weights
        nbytes = sum(n * k for n, k in shapes) * dtype.itemsize
        for rows in [int(r) for r in args.rows.split(",")]:
            x = {k: torch.randn(rows, k).to(dtype) for k in {k for _, k in shapes}}
            times = {"ours": [], "oneDNN": []}
            for _ in range(args.repeats):
                for name in times:
                    start = time.perf_counter()
                    if name == "ours":
                        for (n, k), w in zip(shapes, ours):
                            ops.linear(x[k], w)
                    else:
                        for (n, k), w in zip(shapes, onednn):
                            torch.ops.mkldnn._linear_pointwise(x[k], w, None, "none", [], "")
                    times[name].append(time.perf_counter() - start)
            a, b = statistics.median(times["ours"]), statistics.median(times["oneDNN"])
            flop = sum(2 * rows * n * k for n, k in shapes)
            rate = (lambda t: f"{nbytes / t / 1e9:5.1f} GB/s") if args.mode == "model" else (
                lambda t: f"{flop / t / 1e9:5.0f} GFLOP/s")
            print(f"{str(dtype)[6:]:9s} rows {rows:5d}: ours {a * 1e3:8.2f} ms ({rate(a)}), oneDNN {b * 1e3:8.2f} ms "
                  f"({rate(b)}), oneDNN / ours {b / a:.2f}", flush=True)


if __name__ == "__main__":
    main()
