"""Shared blocks read once (issue 24 §3): CPU decode over sequences that share their prefix's physical blocks, against
the same op on the same batch with the shared blocks copied into distinct blocks of the same bytes (identical math,
nothing to share), in one run, methods taking turns round by round, medians of the repeats.

Cases (bfloat16 by default, 32 query / 8 kv heads, head dim 128, block size 16; block tables shuffled):

  * ``8x4096+64``: 8 sequences sharing a 4,096-token prefix, each with a 64-token tail of its own;
  * ``64x2048+256``: 64 sequences behind one 2,048-token prefix, each with a 256-token tail of its own;
  * ``64x2304 unrelated``: 64 sequences of 2,304 tokens that share nothing (``shared`` and ``distinct`` are then
    the same batch: the ratio says what looking for sharing costs when there is none);
  * ``8x1488+64``, ``32x448+64``: prefixes that end inside a 512-token partition (the op cuts every row's keys into
    partitions at fixed positions): the rows share that partition up to the prefix's end, then go on alone.

Before timing, the two layouts are checked to give the same output bits (the op is batch-invariant: a sequence's
output does not depend on which physical blocks hold its keys), and against the float64 reference on a few rows.
``off`` is the shared batch with the search for sharing switched off (``PAGED_ATTN_NO_SHARED_BLOCKS=1``: each row
reads every block itself; what the caches alone give). ``bytes ratio`` is the KV bytes the distinct batch reads
over those the shared one needs read once.

``--tiled`` (bfloat16): also the shared batch on the same caches in the tiled layout (``paged_attn.pack_cache``),
checked against the reference, timed in the same rounds; and, where ``bench/dot_peak.c`` builds and runs, each
shared call's share of the vdpbf16ps peak (its products: 3 * head_dim / 32 per query head and key token, q . k
and p * v in two bfloat16 terms; over threads x one core's peak, measured once before the cases).

    GOMP_SPINCOUNT=0 .venv/bin/python bench/bench_shared_prefix.py
    GOMP_SPINCOUNT=0 .venv/bin/python bench/bench_shared_prefix.py --quick
    python bench/bench_shared_prefix.py --device cuda        # on a GPU (scripts/gpu_check.sh)

On CUDA (``--device cuda``) ``shared`` passes the plan of ``paged_attn.plan_shared_blocks`` (made on the host,
outside the timing) and ``off`` is the shared batch without it; the outputs are checked against the reference and
each other within tolerance (split-KV with the plan, maybe single pass without: other bits). Timed with
``torch.cuda.synchronize`` around each call.
"""

from __future__ import annotations

import argparse
import os

import torch

from common import describe_host, time_interleaved, vdpbf16ps_peak

import paged_attn
from paged_attn import reference

CASES = {  # name: (num_seqs, prefix tokens shared by all, own tail tokens)
    "8x4096+64": (8, 4096, 64),
    "64x2048+256": (64, 2048, 256),
    "64x2304 unrelated": (64, 0, 2304),
    "8x1488+64": (8, 1488, 64),  # the prefix ends inside a 512-token partition: shared in part
    "32x448+64": (32, 448, 64),  # a prefix shorter than one partition: shared in part only
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated names of CASES")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    p.add_argument("--quick", action="store_true", help="a quarter of every length, 5 repeats")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--tiled", action="store_true", help="also the tiled layout (bfloat16), and the share of the peak")
    return p.parse_args()


def make_case(num_seqs: int, prefix: int, tail: int, args: argparse.Namespace, dtype: torch.dtype, seed: int):
    """Caches, query and the two block tables (shared prefix blocks; the same bytes in distinct blocks)."""
    g = torch.Generator().manual_seed(seed)
    bs = args.block_size
    if prefix % bs:
        raise ValueError(f"the prefix ({prefix}) must be whole blocks of {bs}")
    prefix_blocks, tail_blocks = prefix // bs, -(-tail // bs)
    # Physical blocks: the prefix once, each sequence's tail, then every sequence's own copy of the prefix.
    num_blocks = prefix_blocks + num_seqs * tail_blocks + num_seqs * prefix_blocks
    shape = (num_blocks, bs, args.num_kv_heads, args.head_dim)
    key_cache = torch.randn(shape, generator=g).to(dtype)
    value_cache = torch.randn(shape, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)  # physical ids, shuffled
    prefix_ids = perm[:prefix_blocks]
    tail_ids = perm[prefix_blocks:prefix_blocks + num_seqs * tail_blocks].view(num_seqs, tail_blocks)
    copy_ids = perm[prefix_blocks + num_seqs * tail_blocks:].view(num_seqs, prefix_blocks)
    for s in range(num_seqs):
        key_cache[copy_ids[s]] = key_cache[prefix_ids]
        value_cache[copy_ids[s]] = value_cache[prefix_ids]
    shared = torch.cat([prefix_ids.expand(num_seqs, prefix_blocks), tail_ids], dim=1).to(torch.int32).contiguous()
    distinct = torch.cat([copy_ids, tail_ids], dim=1).to(torch.int32).contiguous()
    seq_lens = torch.full((num_seqs,), prefix + tail, dtype=torch.int32)
    query = torch.randn(num_seqs, args.num_heads, args.head_dim, generator=g).to(dtype)
    return query, key_cache, value_cache, shared, distinct, seq_lens


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    repeats = 5 if args.quick else args.repeats
    print(f"{describe_host()}; {args.dtype}, {args.num_heads}/{args.num_kv_heads} heads, head dim {args.head_dim}, "
          f"block size {args.block_size}; medians of {repeats}")
    peak = vdpbf16ps_peak() if args.tiled else None
    if args.tiled:
        print(f"vdpbf16ps peak: {peak / 1e9:.2f} G/s per core x {torch.get_num_threads()} threads" if peak
              else "vdpbf16ps peak: not measured (no C compiler or no AVX512_BF16)")
    tiled_columns = f" {'tiled ms':>9} {'rm/tiled':>9} {'peak rm':>8} {'peak tiled':>11}" if args.tiled else ""
    print(f"{'case':<20} {'shared ms':>10} {'distinct ms':>12} {'speed-up':>9} {'off ms':>8} {'vs off':>7} "
          f"{'bytes ratio':>12}{tiled_columns}")
    for seed, name in enumerate(args.cases.split(",")):
        num_seqs, prefix, tail = CASES[name]
        if args.quick:  # a quarter, in whole blocks
            prefix, tail = prefix // 4 // args.block_size * args.block_size, max(args.block_size, tail // 4)
        query, key_cache, value_cache, shared, distinct, seq_lens = make_case(num_seqs, prefix, tail, args, dtype,
                                                                              seed)
        if args.device == "cuda":
            cuda_case(name, args, num_seqs, prefix, tail, repeats, query, key_cache, value_cache, shared, distinct,
                      seq_lens)
            continue
        out_shared = paged_attn.paged_attention(query, key_cache, value_cache, shared, seq_lens)
        out_distinct = paged_attn.paged_attention(query, key_cache, value_cache, distinct, seq_lens)
        if not torch.equal(out_shared, out_distinct):
            raise SystemExit(f"{name}: shared and distinct blocks gave different bits")
        rows = [0, num_seqs - 1]
        expected = reference.paged_attention(query[rows], key_cache, value_cache, shared[rows], seq_lens[rows])
        err = (out_shared[rows].double() - expected.double()).abs().max().item()
        if not err <= (2e-2 if dtype != torch.float32 else 1e-4):
            raise SystemExit(f"{name}: max abs error {err:.3g} against the float64 reference")
        def unshared():  # the shared tables, the search for sharing off: what the cache alone gives
            os.environ["PAGED_ATTN_NO_SHARED_BLOCKS"] = "1"
            try:
                paged_attn.paged_attention(query, key_cache, value_cache, shared, seq_lens, out=out_off)
            finally:
                del os.environ["PAGED_ATTN_NO_SHARED_BLOCKS"]

        out_off = torch.empty_like(out_shared)
        unshared()
        if not torch.equal(out_off, out_shared):
            raise SystemExit(f"{name}: the search for sharing on and off gave different bits")
        methods = {
            "shared": lambda: paged_attn.paged_attention(query, key_cache, value_cache, shared, seq_lens,
                                                         out=out_shared),
            "distinct": lambda: paged_attn.paged_attention(query, key_cache, value_cache, distinct, seq_lens,
                                                           out=out_distinct),
            "off": unshared,
        }
        if args.tiled:
            key_tiled, value_tiled = paged_attn.pack_cache(key_cache, value_cache)
            out_tiled = paged_attn.paged_attention(query, key_tiled, value_tiled, shared, seq_lens)
            err = (out_tiled[rows].double() - expected.double()).abs().max().item()
            if not err <= 2e-2:
                raise SystemExit(f"{name}: tiled: max abs error {err:.3g} against the float64 reference")
            methods["tiled"] = lambda: paged_attn.paged_attention(query, key_tiled, value_tiled, shared, seq_lens,
                                                                  out=out_tiled)
        times = time_interleaved(methods, repeats)
        bytes_ratio = num_seqs * (prefix + tail) / (prefix + num_seqs * tail)
        tiled = ""
        if args.tiled:
            products = 3 * args.head_dim / 32 * args.num_heads * num_seqs * (prefix + tail)
            share = lambda t: f"{products / t / (peak * torch.get_num_threads()):.0%}" if peak else "-"  # noqa: E731
            tiled = (f" {times['tiled'] * 1e3:>9.2f} {times['shared'] / times['tiled']:>8.2f}x "
                     f"{share(times['shared']):>8} {share(times['tiled']):>11}")
        print(f"{name:<20} {times['shared'] * 1e3:>10.2f} {times['distinct'] * 1e3:>12.2f} "
              f"{times['distinct'] / times['shared']:>8.2f}x {times['off'] * 1e3:>8.2f} "
              f"{times['off'] / times['shared']:>6.2f}x {bytes_ratio:>11.2f}x{tiled}", flush=True)


def cuda_case(name, args, num_seqs, prefix, tail, repeats, query, key_cache, value_cache, shared, distinct,
              seq_lens) -> None:
    """One case on CUDA: the shared batch with the host's plan, without it, and the distinct batch."""
    plan = paged_attn.plan_shared_blocks(shared, seq_lens, args.block_size,
                                         num_queries_per_kv=args.num_heads // args.num_kv_heads).cuda()
    query, key_cache, value_cache, shared, distinct, seq_lens = (
        t.cuda() for t in (query, key_cache, value_cache, shared, distinct, seq_lens))
    out = {k: torch.empty_like(query) for k in ("shared", "off", "distinct")}
    methods = {
        "shared": lambda: paged_attn.paged_attention(query, key_cache, value_cache, shared, seq_lens,
                                                     out=out["shared"], shared_plan=plan),
        "distinct": lambda: paged_attn.paged_attention(query, key_cache, value_cache, distinct, seq_lens,
                                                       out=out["distinct"]),
        "off": lambda: paged_attn.paged_attention(query, key_cache, value_cache, shared, seq_lens, out=out["off"]),
    }
    for fn in methods.values():
        fn()
    rows = [0, num_seqs - 1]
    expected = reference.paged_attention(query[rows], key_cache, value_cache, shared[rows], seq_lens[rows])
    for k, o in out.items():
        err = (o[rows].double() - expected.double()).abs().max().item()
        if not err <= (2e-2 if query.dtype != torch.float32 else 1e-4):
            raise SystemExit(f"{name} ({k}): max abs error {err:.3g} against the float64 reference")
    times = time_interleaved(methods, repeats, sync=torch.cuda.synchronize)
    bytes_ratio = num_seqs * (prefix + tail) / (prefix + num_seqs * tail)
    print(f"{name:<20} {times['shared'] * 1e3:>10.3f} {times['distinct'] * 1e3:>12.3f} "
          f"{times['distinct'] / times['shared']:>8.2f}x {times['off'] * 1e3:>8.3f} "
          f"{times['off'] / times['shared']:>6.2f}x {bytes_ratio:>11.2f}x  ({plan.shape[0]} tasks)", flush=True)


if __name__ == "__main__":
    main()
