"""Paged decode attention on CUDA: effective KV bandwidth against the device's own copy bandwidth.

For Llama-3-8B-like shapes (32 query heads, 8 kv heads, head dim 128, bf16, block 16) at several batch sizes and
context lengths, it reports the kernel's time, its effective bandwidth (bytes of K and V read / time), that as a
fraction of the device-to-device copy bandwidth measured in the same run, and the time of
torch.nn.functional.scaled_dot_product_attention on the same keys/values laid out contiguously (what a user would
do without paging; the layout conversion is not timed). The L2 cache is flushed before every timed call.
Correctness is checked against paged_attn.reference on a few sequences of each case before timing.

    python bench/bench_cuda_attention.py                    # the full grid (H200: about a minute)
    python bench/bench_cuda_attention.py --quick            # a small smoke run
    python bench/bench_cuda_attention.py --device cpu --quick   # runs the same code on the CPU (no GPU needed)
    python bench/bench_cuda_attention.py --kv-dtype fp8_e4m3 --batch-sizes 64,256 --contexts 2048,8192

With --kv-dtype fp8_e4m3 (or fp8_e5m2) each case is also run on the same keys/values quantized into an fp8 cache
(scales amax / max finite; queries stay --dtype), checked against the reference on its dequantized values, and timed
in the same run: its time, its bandwidth counting fp8 bytes, that as a fraction of the copy bandwidth, and how many
times faster it is than the --dtype cache.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from common import (FP8_DTYPES, Timer, decode_case, dense_layout, describe_host, device_copy_bandwidth,
                    quantize_fp8_caches)

import paged_attn
from paged_attn import reference


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,8,64,256")
    parser.add_argument("--contexts", default="512,2048,8192,32768")
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--kv-dtype", default="auto", choices=["auto", *FP8_DTYPES],
                        help="auto: the cache in --dtype only; fp8_*: also an fp8 cache of the same keys/values")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--max-kv-gib", type=float, default=40.0, help="skip cases whose KV cache is larger")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="batch 1,8 x context 512,2048, 5 repeats")
    args = parser.parse_args()
    if args.quick:
        args.batch_sizes, args.contexts, args.repeats = "1,8", "512,2048", 5
    return args


def main():
    args = parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    timer = Timer(device)
    copy_bw = device_copy_bandwidth(timer, device, args.repeats)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"# paged_attention on {name}: {args.num_heads} heads, {args.num_kv_heads} kv heads, head dim "
          f"{args.head_dim}, block {args.block_size}, {args.dtype}")
    print(f"# {describe_host()}")
    print(f"# device copy bandwidth (read + write): {copy_bw / 1e9:.0f} GB/s\n")
    fp8 = FP8_DTYPES.get(args.kv_dtype)
    fp8_header = (f" {args.kv_dtype} us | GB/s (fp8 bytes) | % of copy | {args.kv_dtype} vs {args.dtype} |"
                  if fp8 else "")
    print("| batch | context | KV MiB | paged_attention us | GB/s | % of copy | SDPA (contiguous) us | speed-up |"
          + fp8_header)
    print("|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|---:|" if fp8 else ""))
    for batch in map(int, args.batch_sizes.split(",")):
        for context in map(int, args.contexts.split(",")):
            elem = torch.tensor([], dtype=dtype).element_size()
            kv_bytes = 2 * batch * context * args.num_kv_heads * args.head_dim * elem
            if kv_bytes > args.max_kv_gib * 2**30:
                print(f"| {batch} | {context} | {kv_bytes / 2**20:.0f} | skipped (> --max-kv-gib) | | | | |")
                continue
            case = decode_case(batch, context, args.num_heads, args.num_kv_heads, args.head_dim, args.block_size,
                               device, dtype)
            few = tuple(t[:2] if i in (0, 3, 4) else t for i, t in enumerate(case))
            torch.testing.assert_close(paged_attn.paged_attention(*few), reference.paged_attention(*few),
                                       rtol=2e-2, atol=2e-2)
            out = torch.empty_like(case[0])
            seconds = timer(lambda: paged_attn.paged_attention(*case, out=out), args.repeats)
            fp8_columns = ""
            if fp8:
                caches, scales = quantize_fp8_caches(case[1], case[2], fp8)
                fp8_case = (case[0], *caches, case[3], case[4])
                fp8_kwargs = dict(k_scale=scales[0], v_scale=scales[1])
                few8 = tuple(t[:2] if i in (0, 3, 4) else t for i, t in enumerate(fp8_case))
                torch.testing.assert_close(paged_attn.paged_attention(*few8, **fp8_kwargs),
                                           reference.paged_attention(*few8, **fp8_kwargs), rtol=2e-2, atol=2e-2)
                fp8_seconds = timer(lambda: paged_attn.paged_attention(*fp8_case, out=out, **fp8_kwargs),
                                    args.repeats)
                fp8_bandwidth = kv_bytes // elem / fp8_seconds
                fp8_columns = (f" {fp8_seconds * 1e6:.1f} | {fp8_bandwidth / 1e9:.0f} | "
                               f"{100 * fp8_bandwidth / copy_bw:.0f}% | {seconds / fp8_seconds:.2f}x |")
                del fp8_case, caches

            # The peer: SDPA over the same keys/values gathered into contiguous [batch, heads, context, dim].
            query, key_cache, value_cache, block_tables, _ = case
            keys, values = (dense_layout(cache, block_tables, context) for cache in (key_cache, value_cache))
            del case, key_cache, value_cache
            q = query[:, :, None, :]
            sdpa_seconds = timer(lambda: F.scaled_dot_product_attention(q, keys, values, enable_gqa=True),
                                 args.repeats)
            del keys, values
            bandwidth = kv_bytes / seconds
            print(f"| {batch} | {context} | {kv_bytes / 2**20:.0f} | {seconds * 1e6:.1f} | {bandwidth / 1e9:.0f} | "
                  f"{100 * bandwidth / copy_bw:.0f}% | {sdpa_seconds * 1e6:.1f} | {sdpa_seconds / seconds:.2f}x |"
                  + fp8_columns)
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
