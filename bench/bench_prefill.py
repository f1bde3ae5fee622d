"""CPU prefill: paged_attention with query_start_loc against torch's scaled_dot_product_attention(is_causal=True).

One prompt of L tokens (L = 128 ... 4096), 32 query heads / 8 kv heads, head_dim 128, block_size 16: ours reads the
keys and values from a paged cache whose blocks are shuffled; SDPA gets the same keys and values laid out
contiguously ([1, heads, L, head_dim], GQA expanded by enable_gqa). Both produce [L, 32, 128]. The two alternate
within each repeat and the table gives medians and the ratio SDPA time / ours (> 1: ours faster), plus our
TFLOP/s (4 * L^2 / 2 * heads * head_dim causal FLOPs). Outputs are compared before timing.

    GOMP_SPINCOUNT=0 python bench/bench_prefill.py            # fp32 and bf16, L = 128 ... 4096, 5 repeats
    GOMP_SPINCOUNT=0 python bench/bench_prefill.py --quick    # L = 128, 1024; 2 repeats
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from common import describe_host, time_interleaved

import paged_attn

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def make_case(seq_len: int, dtype: torch.dtype):
    num_blocks = -(-seq_len // BLOCK_SIZE)
    query = torch.randn(seq_len, NUM_HEADS, HEAD_DIM, dtype=dtype)
    keys = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    values = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    key_cache = torch.empty(num_blocks + 4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    value_cache = torch.empty_like(key_cache)
    blocks = torch.randperm(num_blocks + 4)[:num_blocks]
    slots = (blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten()[:seq_len]
    paged_attn.reshape_and_cache(keys, values, key_cache, value_cache, slots)
    block_tables = blocks.to(torch.int32)[None]
    seq_lens = torch.tensor([seq_len], dtype=torch.int32)
    starts = torch.tensor([0, seq_len], dtype=torch.int32)

    def ours():
        return paged_attn.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                          query_start_loc=starts, max_query_len=seq_len)

    q, k, v = (x.transpose(0, 1)[None] for x in (query, keys, values))  # [1, heads, L, head_dim]
    k, v = k.contiguous(), v.contiguous()
    q = q.contiguous()

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[0].transpose(0, 1)

    return ours, sdpa


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="128,256,512,1024,2048,4096")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.repeats = "128,1024", 2
    print(f"{describe_host()}; {NUM_HEADS}/{NUM_KV_HEADS} heads, head_dim {HEAD_DIM}, block {BLOCK_SIZE}")
    print(f"{'dtype':>9} {'L':>5} {'ours ms':>9} {'sdpa ms':>9} {'sdpa/ours':>9} {'ours TFLOP/s':>12}")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for seq_len in map(int, args.lengths.split(",")):
            ours, sdpa = make_case(seq_len, dtype)
            tolerance = 1e-4 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(ours(), sdpa(), rtol=tolerance, atol=tolerance)
            seconds = time_interleaved({"ours": ours, "sdpa": sdpa}, args.repeats, warmup=1, alternate=True)
            t_ours, t_sdpa = seconds["ours"], seconds["sdpa"]
            flops = 4 * seq_len * (seq_len + 1) / 2 * NUM_HEADS * HEAD_DIM
            print(f"{dtype_name:>9} {seq_len:>5} {t_ours * 1e3:9.2f} {t_sdpa * 1e3:9.2f} {t_sdpa / t_ours:9.2f} "
                  f"{flops / t_ours / 1e12:12.3f}", flush=True)


if __name__ == "__main__":
    main()
