"""CPU paged decode attention: our kernel against the reference, dense SDPA and the machine's memory bandwidth.

Decode attention reads the whole KV cache once per step and does little arithmetic per byte, so the figure of merit
is the effective KV bandwidth: bytes of keys and values read / time. This script reports, side by side and measured
in the same run (methods take turns round by round; each timed run but the reference's follows an untimed one of
the same method; medians of the repeats):

  * ``paged_attn.paged_attention`` (this project's CPU kernel) on a paged cache whose blocks are shuffled;
  * (a) ``paged_attn.reference.paged_attention``, the vectorized pure-PyTorch reference (gather, then attend);
  * (b) ``torch.nn.functional.scaled_dot_product_attention`` on the same keys/values laid out contiguously,
    ``[num_seqs, num_kv_heads, seq_len, head_dim]`` with ``enable_gqa=True`` (what a user would do without paging;
    the layout conversion is not timed);
  * with ``--kv-dtype fp8_e4m3`` (or ``fp8_e5m2``), ``paged_attn.paged_attention`` again on the same keys/values
    quantized into an fp8 cache (scales amax / max finite), timed in the same rounds: the fp8-vs-``--dtype`` ratio
    (the fp8 cache is half the bytes of bfloat16);
  * (c) the machine's memory bandwidth: ``x.sum()`` over a 1 GiB float32 tensor (bytes read / time) and
    ``y.copy_(x)`` (bytes read / time; the bytes written are not counted).

The KV cache must be far larger than the last-level cache for the figures to mean memory bandwidth (the default case
is 512 MiB of keys and values in bfloat16). The outputs are checked against the reference before anything is timed.

Usage::

    GOMP_SPINCOUNT=0 .venv/bin/python bench/bench_cpu_attention.py            # the default case (Llama-3-8B-like)
    GOMP_SPINCOUNT=0 .venv/bin/python bench/bench_cpu_attention.py --quick    # a small smoke run
    GOMP_SPINCOUNT=0 .venv/bin/python bench/bench_cpu_attention.py --dtype float32 --num-seqs 8
    GOMP_SPINCOUNT=0 .venv/bin/python bench/bench_cpu_attention.py --kv-dtype fp8_e4m3  # + fp8 cache vs bf16
    GOMP_SPINCOUNT=0 .venv/bin/python bench/bench_cpu_attention.py --layouts all        # the cache layouts

``--layouts`` (``all`` or a comma-separated list of LAYOUTS' names) times our kernel alone on the same keys/values
held in each cache layout the README lists (contiguous NHD; the halves of one ``[num_blocks, 2, ...]``
allocation; vLLM's packed ``[..., 2 * head_dim]`` halves, NHD (LBNHC) and head-major (LBHNC); head-major HND), in
the same rounds, each checked to give the contiguous cache's bits, and reports each against the contiguous one and
against x.sum()'s read rate timed in the same rounds. ``tiled`` (``paged_attn.pack_cache``, bfloat16 and fp8 only)
sums in another order: it is checked to within a bfloat16 rounding of the contiguous cache's output.

GOMP_SPINCOUNT=0 is recommended: by default OpenMP worker threads spin for a while after each parallel region,
which steals cycles from whatever runs next on a machine with few cores and makes the timings noisy. Other
processes running at the same time skew every figure; ratios within one run are more stable than absolute times.
"""

from __future__ import annotations

import argparse
import math
from typing import Sequence

import torch
import torch.nn.functional as F

from common import (COPY, FP8_DTYPES, READ, dense_layout, describe_host, memory_yardsticks, quantize_fp8_caches,
                    time_interleaved)

import paged_attn
from paged_attn import reference

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
OURS = "paged_attn.paged_attention (ours)"
REFERENCE = "(a) paged_attn.reference.paged_attention"
SDPA = "(b) F.scaled_dot_product_attention, contiguous KV"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--num-heads", type=int, default=32, help="query heads")
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (all sequences alike)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--kv-dtype", choices=["auto"] + sorted(FP8_DTYPES), default="auto",
                        help="auto: the cache in --dtype only; fp8_*: also an fp8 cache of the same keys/values "
                             "(queries in --dtype), timed in the same rounds")
    parser.add_argument("--repeats", type=int, default=10, help="timed repeats of each method (medians reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs of each method first")
    parser.add_argument("--reference-repeats", type=int, default=3,
                        help="timed repeats of the (slow) reference; 0 skips timing it")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--bandwidth-gib", type=float, default=1.0, help="size of the bandwidth-test tensor")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layouts", default=None,
                        help="'all' or a comma-separated list of " + ", ".join(LAYOUTS) + ": time our kernel "
                             "alone on the same cache in each layout, against the contiguous one (nhd)")
    parser.add_argument("--quick", action="store_true",
                        help="small smoke run: 4 sequences x 512 tokens, 3 repeats, 256 MiB bandwidth test")
    args = parser.parse_args()
    if args.quick:
        args.num_seqs, args.seq_len, args.repeats, args.warmup = 4, 512, 3, 1
        args.reference_repeats, args.bandwidth_gib = min(args.reference_repeats, 2), 0.25
    return args


def make_paged_cache(args: argparse.Namespace, dtype: torch.dtype, generator: torch.Generator):
    """Keys/values of every sequence in a paged cache whose blocks are handed out in random order."""
    blocks_per_seq = math.ceil(args.seq_len / args.block_size)
    num_blocks = args.num_seqs * blocks_per_seq
    shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_dim)
    key_cache = torch.randn(shape, generator=generator).to(dtype)
    value_cache = torch.randn(shape, generator=generator).to(dtype)
    block_ids = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    block_tables = block_ids.view(args.num_seqs, blocks_per_seq)
    seq_lens = torch.full((args.num_seqs,), args.seq_len, dtype=torch.int32)
    if args.seq_len % args.block_size:  # poison the unused tail slots of each sequence's last block
        last_blocks = block_tables[:, -1].long()
        key_cache[last_blocks, args.seq_len % args.block_size:] = float("nan")
        value_cache[last_blocks, args.seq_len % args.block_size:] = float("nan")
    query = torch.randn(args.num_seqs, args.num_heads, args.head_dim, generator=generator).to(dtype)
    return query, key_cache, value_cache, block_tables, seq_lens


def _packed(key_cache: torch.Tensor, value_cache: torch.Tensor, head_major: bool):
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    if head_major:  # [num_blocks, num_kv_heads, block_size, 2 * head_dim]
        packed = torch.cat([key_cache, value_cache], dim=-1).transpose(1, 2).contiguous().transpose(1, 2)
    else:  # [num_blocks, block_size, num_kv_heads, 2 * head_dim]
        packed = torch.cat([key_cache, value_cache], dim=-1)
    return packed[..., :head_dim], packed[..., head_dim:]


# name: (description, function (key_cache, value_cache) -> the same keys/values as views in that layout)
LAYOUTS = {
    "nhd": ("contiguous [num_blocks, block_size, num_kv_heads, head_dim]", lambda k, v: (k, v)),
    "kv_halves": ("[:, 0] and [:, 1] of one [num_blocks, 2, block_size, num_kv_heads, head_dim]",
                  lambda k, v: tuple(torch.stack([k, v], dim=1).unbind(1))),
    "packed_nhd": ("vLLM's packed LBNHC halves: [num_blocks, block_size, num_kv_heads, 2 * head_dim]",
                   lambda k, v: _packed(k, v, head_major=False)),
    "hnd": ("head-major: [num_blocks, num_kv_heads, block_size, head_dim].transpose(1, 2), keys and values",
            lambda k, v: (k.transpose(1, 2).contiguous().transpose(1, 2),
                          v.transpose(1, 2).contiguous().transpose(1, 2))),
    "packed_hnd": ("vLLM's packed LBHNC halves: [num_blocks, num_kv_heads, block_size, 2 * head_dim]",
                   lambda k, v: _packed(k, v, head_major=True)),
    "tiled": ("tiled for the dot-product units (paged_attn.pack_cache; bfloat16 or fp8)",
              lambda k, v: paged_attn.pack_cache(k, v)),
}
# Layouts whose kernel sums in another order: their outputs are checked against the contiguous cache's within one
# bfloat16 rounding, not bit for bit.
OTHER_SUM_ORDER = {"tiled"}


def bench_layouts(args: argparse.Namespace, names: Sequence[str], query, key_cache, value_cache, block_tables,
                  seq_lens) -> None:
    """Our kernel on each layout's copy of the same cache, in the same rounds, with the machine's read rate (x.sum())
    as the yardstick; the outputs must be the contiguous cache's bits (OTHER_SUM_ORDER: within a bfloat16 rounding)."""
    kv_bytes = 2 * args.num_seqs * args.seq_len * args.num_kv_heads * args.head_dim * key_cache.element_size()
    expected = paged_attn.paged_attention(query, key_cache, value_cache, block_tables, seq_lens)
    methods, caches = {}, {}
    for name in names:
        k, v = LAYOUTS[name][1](key_cache, value_cache)
        actual = paged_attn.paged_attention(query, k, v, block_tables, seq_lens)
        if name in OTHER_SUM_ORDER:
            err = (actual.float() - expected.float()).abs().max().item()
            if not err <= 2**-7 * max(1.0, expected.float().abs().max().item()):
                raise SystemExit(f"layout {name} is {err:.3g} off the contiguous cache's output")
        elif not torch.equal(actual, expected):
            raise SystemExit(f"layout {name} gives other bits than the contiguous cache")
        caches[name] = (k, v, torch.empty_like(query))
        methods[name] = (lambda k=k, v=v, out=caches[name][2]:
                         paged_attn.paged_attention(query, k, v, block_tables, seq_lens, out=out))
    yardsticks, read_bytes = memory_yardsticks(args.bandwidth_gib, torch.Generator().manual_seed(args.seed))
    methods[READ] = yardsticks[READ]
    seconds = time_interleaved(methods, {name: args.repeats for name in methods}, args.warmup, settle=list(methods))
    read_rate = read_bytes / seconds[READ]
    base = seconds.get("nhd", seconds[names[0]])
    print(f"## CPU paged decode attention by cache layout: {args.num_seqs} seqs x {args.seq_len} tokens, "
          f"{args.num_heads} query heads / {args.num_kv_heads} kv heads, head_dim {args.head_dim}, "
          f"block {args.block_size}, {args.dtype}")
    print(f"\n{describe_host()}\n\nKV cache {kv_bytes / 2**20:.0f} MiB per layout; medians of {args.repeats} "
          f"repeats; every layout gives the contiguous cache's bits (tiled: within a bfloat16 rounding); "
          f"x.sum() read {read_rate / 1e9:.1f} GB/s in the same rounds\n")
    print("| layout | strides (key cache, elements) | time (ms) | GB/s | of x.sum()'s rate | time / contiguous |")
    print("|---|---|---:|---:|---:|---:|")
    for name in names:
        stride = tuple(caches[name][0].stride())
        rate = kv_bytes / seconds[name]
        print(f"| {name}: {LAYOUTS[name][0]} | {stride} | {seconds[name] * 1e3:.2f} "
              f"| {rate / 1e9:.1f} | {rate / read_rate:.0%} | {seconds[name] / base:.2f} |")


def check_close(name: str, actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> float:
    err = (actual.double() - expected.double()).abs().max().item()
    tol = 1e-5 * max(1.0, expected.double().abs().max().item()) if dtype == torch.float32 else 2e-2
    if not (err <= tol):
        raise SystemExit(f"{name} disagrees with the reference: max abs error {err:.3g} > {tol:.3g}")
    return err


def main() -> None:
    args = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    generator = torch.Generator().manual_seed(args.seed)
    query, key_cache, value_cache, block_tables, seq_lens = make_paged_cache(args, dtype, generator)
    if args.layouts is not None:
        names = ([name for name in LAYOUTS if name != "tiled" or args.dtype == "bfloat16"] if args.layouts == "all"
                 else args.layouts.split(","))
        unknown = [name for name in names if name not in LAYOUTS]
        if unknown:
            raise SystemExit(f"unknown layouts {unknown}; known: {', '.join(LAYOUTS)}")
        bench_layouts(args, names, query, key_cache, value_cache, block_tables, seq_lens)
        return
    keys = dense_layout(key_cache, block_tables, args.seq_len)
    values = dense_layout(value_cache, block_tables, args.seq_len)
    query_4d = query.unsqueeze(2)  # [num_seqs, num_heads, 1, head_dim]
    out = torch.empty_like(query)
    kv_bytes = 2 * args.num_seqs * args.seq_len * args.num_kv_heads * args.head_dim * key_cache.element_size()

    # Correctness first: the kernel against the reference on a few sequences (the reference on the whole batch
    # is timed below, but comparing is enough on a slice) and against SDPA on all of them.
    check = slice(0, min(args.num_seqs, 2))
    ours = paged_attn.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, out=out)
    expected = reference.paged_attention(query[check], key_cache, value_cache, block_tables[check], seq_lens[check])
    err_ref = check_close("paged_attn.paged_attention", ours[check], expected, dtype)
    sdpa_out = F.scaled_dot_product_attention(query_4d, keys, values, enable_gqa=True).squeeze(2)
    err_sdpa = check_close("scaled_dot_product_attention", sdpa_out, ours, dtype)

    fp8_name, fp8_bytes = None, 0
    if args.kv_dtype != "auto":
        fp8 = FP8_DTYPES[args.kv_dtype]
        fp8_name = f"paged_attn.paged_attention, {args.kv_dtype} cache (ours)"
        (key_fp8, value_fp8), (k_scale, v_scale) = quantize_fp8_caches(key_cache, value_cache, fp8)
        out_fp8 = torch.empty_like(query)
        fp8_bytes = kv_bytes // key_cache.element_size()
        ours_fp8 = paged_attn.paged_attention(query, key_fp8, value_fp8, block_tables, seq_lens, out=out_fp8,
                                              k_scale=k_scale, v_scale=v_scale)
        expected_fp8 = reference.paged_attention(query[check], key_fp8, value_fp8, block_tables[check],
                                                 seq_lens[check], k_scale=k_scale, v_scale=v_scale)
        err_fp8 = check_close(fp8_name, ours_fp8[check], expected_fp8, dtype)

    yardsticks, yardstick_bytes = memory_yardsticks(args.bandwidth_gib, generator)
    methods = {
        OURS: lambda: paged_attn.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, out=out),
        **({fp8_name: lambda: paged_attn.paged_attention(query, key_fp8, value_fp8, block_tables, seq_lens,
                                                         out=out_fp8, k_scale=k_scale, v_scale=v_scale)}
           if fp8_name else {}),
        REFERENCE: lambda: reference.paged_attention(query, key_cache, value_cache, block_tables, seq_lens),
        SDPA: lambda: F.scaled_dot_product_attention(query_4d, keys, values, enable_gqa=True),
        **yardsticks,
    }
    repeats = {name: args.repeats for name in methods}
    repeats[REFERENCE] = args.reference_repeats
    if args.reference_repeats == 0:
        del methods[REFERENCE]
    seconds = time_interleaved(methods, repeats, args.warmup, settle=[name for name in methods if name != REFERENCE])

    bytes_read = {name: kv_bytes for name in methods}
    bytes_read[READ] = bytes_read[COPY] = yardstick_bytes
    if fp8_name:
        bytes_read[fp8_name] = fp8_bytes
    bandwidth = {name: bytes_read[name] / seconds[name] / 1e9 for name in seconds}

    print(f"## CPU paged decode attention: {args.num_seqs} seqs x {args.seq_len} tokens, {args.num_heads} query heads"
          f" / {args.num_kv_heads} kv heads, head_dim {args.head_dim}, block {args.block_size}, {args.dtype}")
    print(f"\n{describe_host()}\n\nKV cache {kv_bytes / 2**20:.0f} MiB, bandwidth tensor "
          f"{yardstick_bytes / 2**20:.0f} MiB; "
          f"medians of {args.repeats} repeats ({args.reference_repeats} for the reference); "
          f"max abs error vs reference {err_ref:.2g}, vs SDPA {err_sdpa:.2g}"
          + (f", fp8 cache vs reference on its dequantized values {err_fp8:.2g}" if fp8_name else "") + "\n")
    print("| method | time (ms) | GB/s (KV bytes, or bytes read, / time) | % of read bandwidth (c, sum) "
          "| % of copy bandwidth (c, copy) | ours is ... x faster |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in seconds:
        speedup = f"{seconds[name] / seconds[OURS]:.1f}" if name in (REFERENCE, SDPA) else ""
        print(f"| {name} | {seconds[name] * 1e3:.2f} | {bandwidth[name]:.1f} "
              f"| {100 * bandwidth[name] / bandwidth[READ]:.0f}% | {100 * bandwidth[name] / bandwidth[COPY]:.0f}% "
              f"| {speedup} |")
    if fp8_name:
        print(f"\n{args.kv_dtype} cache vs {args.dtype} cache: {seconds[OURS] / seconds[fp8_name]:.2f}x faster "
              f"({seconds[fp8_name] * 1e3:.2f} ms vs {seconds[OURS] * 1e3:.2f} ms; KV bytes "
              f"{fp8_bytes / 2**20:.0f} MiB vs {kv_bytes / 2**20:.0f} MiB)")

if __name__ == "__main__":
    main()
