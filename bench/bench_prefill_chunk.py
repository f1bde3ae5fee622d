"""CPU prefill chunk after a long cached prefix: a chunk of C rows against C decode rows on the same prefix.

A chunk of C query tokens (C = 2 by default) after a prefix of P tokens (P = 4k, 16k, 60k), bfloat16 cache, 32 query
heads / 8 kv heads, head_dim 128, block_size 16 (blocks shuffled), with and without a sliding window:
paged_attention with query_start_loc (rows at positions P ... P + C - 1; chunks of 4 rows or more take the tiled
prefill kernel, shorter ones the decode kernel row by row) against one decode call of C sequences sharing the
prefix's block table, of lengths P + 1 ... P + C (the same rows). The outputs are compared first; the two calls
alternate within each repeat and the table gives medians and chunk / decode.

    GOMP_SPINCOUNT=0 python bench/bench_prefill_chunk.py                    # C = 2; P = 4096,16384,61440; 7 repeats
    GOMP_SPINCOUNT=0 python bench/bench_prefill_chunk.py --chunk 4          # the tiled kernel
    GOMP_SPINCOUNT=0 python bench/bench_prefill_chunk.py --prefixes 4096 --repeats 3
"""

from __future__ import annotations

import argparse

import torch

from common import describe_host, time_interleaved

import paged_attn

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def make_calls(prefix: int, window: int | None, chunk_len: int = 2):
    seq_len = prefix + chunk_len
    num_blocks = -(-seq_len // BLOCK_SIZE)
    key_cache = torch.randn(num_blocks + 4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    value_cache = torch.randn_like(key_cache)
    table = torch.randperm(num_blocks + 4)[:num_blocks].to(torch.int32)
    query = torch.randn(chunk_len, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    kwargs = {} if window is None else {"sliding_window": window}
    chunk_args = (query, key_cache, value_cache, table[None], torch.tensor([seq_len], dtype=torch.int32))
    starts = torch.tensor([0, chunk_len], dtype=torch.int32)
    decode_args = (query, key_cache, value_cache, table[None].expand(chunk_len, -1).contiguous(),
                   torch.arange(prefix + 1, seq_len + 1, dtype=torch.int32))

    def chunk():
        return paged_attn.paged_attention(*chunk_args, query_start_loc=starts, max_query_len=chunk_len, **kwargs)

    def decode():
        return paged_attn.paged_attention(*decode_args, **kwargs)

    return chunk, decode


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefixes", default="4096,16384,61440")
    parser.add_argument("--windows", default="none,4096,16")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--chunk", type=int, default=2, help="query rows of the chunk")
    args = parser.parse_args()
    print(f"{describe_host()}; {NUM_HEADS}/{NUM_KV_HEADS} heads, head_dim {HEAD_DIM}, block {BLOCK_SIZE}, "
          f"bfloat16, chunk of {args.chunk} rows")
    print(f"{'prefix':>7} {'window':>6} {'chunk ms':>9} {f'{args.chunk} decode ms':>11} {'chunk/decode':>12}")
    for prefix in map(int, args.prefixes.split(",")):
        for window_name in args.windows.split(","):
            window = None if window_name == "none" else int(window_name)
            chunk, decode = make_calls(prefix, window, args.chunk)
            torch.testing.assert_close(chunk(), decode(), rtol=2e-2, atol=2e-2)  # (and the warm-up)
            seconds = time_interleaved({"chunk": chunk, "decode": decode}, args.repeats, warmup=0, alternate=True)
            t_chunk, t_decode = seconds["chunk"], seconds["decode"]
            print(f"{prefix:>7} {window_name:>6} {t_chunk * 1e3:9.2f} {t_decode * 1e3:11.2f} {t_chunk / t_decode:12.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
