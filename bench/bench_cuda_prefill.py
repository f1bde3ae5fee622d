"""Prefill on CUDA: paged_attention with query_start_loc (the tensor-core kernel) in TFLOP/s, against the bf16
matmul throughput torch.matmul reaches on the same GPU in the same run, and against SDPA (FlashAttention) on the
same keys/values laid out contiguously.

Cases (32 query heads, 8 kv heads, head dim 128, bf16, block 16 unless told otherwise):
  prefill   one 4096-token prompt (the target: >= 50% of the matmul throughput; issue 23)
  chunk     a 1024-token chunk after a cached 3072-token prefix
  mixed     the 4096-token prompt and 64 decodes of 2048 tokens in one call (max_query_len given: no sync)
FLOPs count the causal work only: 4 * num_heads * head_dim * (keys each query row attends to), summed.
Correctness is checked against SDPA (float32 reference on a slice for the mixed case) before timing; times are
medians of CUDA-event timings after a warm-up, with the L2 cache flushed before each.

With --kv-dtype fp8_e4m3 (or fp8_e5m2) each case also runs on the same keys/values quantized into an fp8 cache
(scales amax / max finite): the same tensor-core kernel, which converts the fp8 values into its shared memory;
checked against SDPA on the dequantized keys/values, and timed in the same run.

    python bench/bench_cuda_prefill.py            # about 20 s on an H200
    python bench/bench_cuda_prefill.py --quick --kv-dtype fp8_e4m3
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from common import FP8_DTYPES, Timer, describe_host, matmul_tflops, quantize_fp8_caches

import paged_attn
from paged_attn import reference


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    parser.add_argument("--kv-dtype", default="auto", choices=["auto", *FP8_DTYPES],
                        help="auto: the cache in --dtype only; fp8_*: also an fp8 cache of the same keys/values")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="5 repeats")
    args = parser.parse_args()
    if args.quick:
        args.repeats = 5
    return args


def make_case(specs, args, dtype):
    """specs: (seq_len, query_len) per sequence. Keys/values in scattered blocks; the query rows are the last
    query_len tokens of each sequence."""
    blocks = [math.ceil(n / args.block_size) for n, _ in specs]
    num_blocks = sum(blocks)
    shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_dim)
    key_cache = torch.randn(shape, dtype=dtype, device="cuda")
    value_cache = torch.randn(shape, dtype=dtype, device="cuda")
    perm = torch.randperm(num_blocks, device="cuda").to(torch.int32)
    width = max(blocks)
    block_tables = torch.zeros(len(specs), width, dtype=torch.int32, device="cuda")
    at = 0
    for s, n in enumerate(blocks):
        block_tables[s, :n] = perm[at:at + n]
        at += n
    seq_lens = torch.tensor([n for n, _ in specs], dtype=torch.int32, device="cuda")
    starts = torch.tensor([0] + [q for _, q in specs], dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda()
    query = torch.randn(int(starts[-1]), args.num_heads, args.head_dim, dtype=dtype, device="cuda")
    return query, key_cache, value_cache, block_tables, seq_lens, starts


def causal_flops(specs, args) -> float:
    keys = sum(sum(n - q + i + 1 for i in range(q)) for n, q in specs)
    return 4.0 * args.num_heads * args.head_dim * keys


def fp8_case(case, fp8):
    """The case with its caches quantized into fp8 (scales amax / max finite), the scales, and the case with the
    dequantized caches (what SDPA gets for the check)."""
    query, key_cache, value_cache, block_tables, seq_lens, starts = case
    caches, scales = quantize_fp8_caches(key_cache, value_cache, fp8)
    dequantized = [reference.dequantize_fp8(c, s, query.dtype) for c, s in zip(caches, scales)]
    return ((query, *caches, block_tables, seq_lens, starts), scales,
            (query, *dequantized, block_tables, seq_lens, starts))


def sdpa_sequence(case, seq, args):
    """SDPA of one sequence's query rows on its keys/values gathered contiguously: (call, expected rows)."""
    query, key_cache, value_cache, block_tables, seq_lens, starts = case
    n, first, last = int(seq_lens[seq]), int(starts[seq]), int(starts[seq + 1])
    gather = lambda cache: cache[block_tables[seq].long()].flatten(0, 1)[:n].transpose(0, 1)[None]
    keys, values = gather(key_cache), gather(value_cache)  # [1, kv_heads, n, dim]
    q = query[first:last].transpose(0, 1)[None]  # [1, heads, q, dim]
    # causal with the queries at the end: a bottom-right aligned mask
    mask = torch.arange(n, device="cuda")[None, :] <= torch.arange(n - (last - first), n, device="cuda")[:, None]
    call = lambda: F.scaled_dot_product_attention(q, keys, values, attn_mask=None if n == last - first else mask,
                                                  is_causal=n == last - first, enable_gqa=True)
    return call, (first, last)


def main():
    args = parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    timer = Timer(torch.device("cuda"), warmup=2)
    peak = matmul_tflops(timer, dtype, args.repeats, torch.device("cuda"))
    print(f"# paged_attention prefill on {torch.cuda.get_device_name()}: {args.num_heads} heads, {args.num_kv_heads} "
          f"kv heads, head dim {args.head_dim}, block {args.block_size}, {args.dtype}")
    print(f"# {describe_host()}")
    print(f"# torch.matmul {args.dtype} throughput in this run: {peak:.0f} TFLOP/s\n")
    fp8 = FP8_DTYPES.get(args.kv_dtype)
    fp8_header = f" {args.kv_dtype} cache ms | TFLOP/s | {args.kv_dtype} vs {args.dtype} |" if fp8 else ""
    print("| case | query rows | paged_attention ms | TFLOP/s | % of matmul | SDPA (contiguous) ms | SDPA TFLOP/s |"
          + fp8_header)
    print("|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|" if fp8 else ""))
    cases = {
        "prefill 4096": [(4096, 4096)],
        "chunk 1024 after 3072": [(4096, 1024)],
        "prefill 4096 + 64 decodes of 2048": [(4096, 4096)] + [(2048, 1)] * 64,
    }
    for name, specs in cases.items():
        case = make_case(specs, args, dtype)
        max_query_len = max(q for _, q in specs)
        out = torch.empty_like(case[0])
        run = lambda: paged_attn.paged_attention(*case[:5], query_start_loc=case[5], max_query_len=max_query_len,
                                                 out=out)
        run()
        sdpa, (first, last) = sdpa_sequence(case, 0, args)
        expected = sdpa()[0].transpose(0, 1)
        torch.testing.assert_close(out[first:last], expected, rtol=2e-2, atol=2e-2)
        seconds = timer(run, args.repeats)
        sdpa_seconds = timer(sdpa, args.repeats)
        flops = causal_flops(specs, args)
        sdpa_flops = causal_flops(specs[:1], args)
        tflops = flops / seconds / 1e12
        fp8_columns = ""
        if fp8:
            quantized, (k_scale, v_scale), dequantized = fp8_case(case, fp8)
            run_fp8 = lambda: paged_attn.paged_attention(*quantized[:5], query_start_loc=quantized[5],
                                                         max_query_len=max_query_len, out=out, k_scale=k_scale,
                                                         v_scale=v_scale)
            run_fp8()
            expected = sdpa_sequence(dequantized, 0, args)[0]()[0].transpose(0, 1)
            torch.testing.assert_close(out[first:last], expected, rtol=2e-2, atol=2e-2)
            fp8_seconds = timer(run_fp8, args.repeats)
            fp8_tflops = flops / fp8_seconds / 1e12
            fp8_columns = f" {fp8_seconds * 1e3:.3f} | {fp8_tflops:.0f} | {seconds / fp8_seconds:.2f}x |"
            del quantized, dequantized
        print(f"| {name} | {case[0].shape[0]} | {seconds * 1e3:.3f} | {tflops:.0f} | {100 * tflops / peak:.0f}% | "
              f"{sdpa_seconds * 1e3:.3f} | {sdpa_flops / sdpa_seconds / 1e12:.0f} |" + fp8_columns)
        del case, out
        torch.cuda.empty_cache()
    print("\n(SDPA runs the first sequence only; target: the 4096-token prefill at >= 30% of matmul)")


if __name__ == "__main__":
    main()
