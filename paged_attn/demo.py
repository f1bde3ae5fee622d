"""A short tour of the cache ops: python -m paged_attn.demo [--device cuda].

Three sequences of different lengths are written into a shared paged KV cache through their block tables, one is
forked with copy-on-write of its partly filled last block, and blocks are swapped out to CPU memory and back.
Each step is checked against the pure-PyTorch reference, and the cache writes are timed.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

import paged_attn
from paged_attn import reference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)

    num_blocks, block_size, num_kv_heads, head_dim = 64, 16, 4, 128
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    value_cache = torch.full_like(key_cache, float("nan"))
    print(f"paged KV cache on {device}: {num_blocks} blocks x {block_size} slots x {num_kv_heads} kv heads x "
          f"{head_dim} ({args.dtype}), {2 * key_cache.numel() * key_cache.element_size() / 2**20:.1f} MiB")

    # 1. Prefill three sequences. Blocks are handed out in a scattered order, as a block manager would.
    seq_lens = [37, 5, 16]
    free_blocks = torch.randperm(num_blocks).tolist()
    block_tables = [[free_blocks.pop() for _ in range(math.ceil(n / block_size))] for n in seq_lens]
    slot_mapping = torch.tensor(
        [table[t // block_size] * block_size + t % block_size for table, n in zip(block_tables, seq_lens)
         for t in range(n)], device=device)
    num_tokens = sum(seq_lens)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    value = torch.randn_like(key)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, expected_k, expected_v, slot_mapping)
    paged_attn.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    check("reshape_and_cache", (key_cache, value_cache), (expected_k, expected_v))
    for seq, (table, n) in enumerate(zip(block_tables, seq_lens)):
        print(f"  sequence {seq}: {n:3d} tokens in blocks {table}")

    # 2. Fork sequence 0 (parallel sampling): the child shares every full block and gets a private copy of the
    #    partly filled last block before it appends its own token there.
    shared, last = block_tables[0][:-1], block_tables[0][-1]
    child_last = free_blocks.pop()
    paged_attn.copy_blocks([key_cache], [value_cache], [(last, child_last)])
    reference.copy_blocks([expected_k], [expected_v], torch.tensor([[last, child_last]]))
    check("copy_blocks", (key_cache, value_cache), (expected_k, expected_v))
    print(f"  fork of sequence 0 shares blocks {shared}, copy-on-write {last} -> {child_last}")

    # 3. Swap sequence 0's blocks out to (pinned, when on CUDA) CPU memory and back into other GPU blocks.
    cpu_cache = torch.empty((8,) + key_cache.shape[1:], dtype=dtype, pin_memory=device.type == "cuda")
    out_mapping = [(block, i) for i, block in enumerate(block_tables[0])]
    paged_attn.swap_blocks(key_cache, cpu_cache, out_mapping)
    new_blocks = [free_blocks.pop() for _ in block_tables[0]]
    paged_attn.swap_blocks(cpu_cache, key_cache, [(i, block) for i, block in enumerate(new_blocks)])
    for old, new in zip(block_tables[0], new_blocks):
        expected_k[new] = expected_k[old]
    if device.type == "cuda":
        torch.cuda.synchronize()
    check("swap_blocks", (key_cache,), (expected_k,))
    print(f"  sequence 0 swapped out to CPU blocks 0..{len(out_mapping) - 1} and back into blocks {new_blocks}")

    # 4. Time a decode-sized write: one token for each of 256 sequences.
    big = torch.empty((4096, block_size, num_kv_heads, head_dim), dtype=dtype, device=device)
    step_key = torch.randn(256, num_kv_heads, head_dim, dtype=dtype, device=device)
    step_slots = torch.randperm(big.shape[0] * block_size, device=device)[:256]
    seconds = median_time(lambda: paged_attn.reshape_and_cache(step_key, step_key, big, big, step_slots), device)
    moved = 4 * step_key.numel() * step_key.element_size()  # read key and value, write both
    print(f"reshape_and_cache, 256 tokens: {seconds * 1e6:.1f} us ({moved / seconds / 1e9:.2f} GB/s moved)")


def check(name: str, actual, expected) -> None:
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=0, atol=0, equal_nan=True)
    print(f"{name}: matches the reference exactly")


def median_time(fn, device: torch.device, repeats: int = 50) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    main()
