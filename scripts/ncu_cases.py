"""Two CUDA paged_attention launches for Nsight Compute (scripts/gpu_check.sh profiles them with ncu).

Llama-3-8B-like shapes (32 query heads, 8 kv heads, head dim 128, bfloat16, block 16, shuffled blocks):
  * batch 128 x 4,096 tokens: the single-pass kernel (1,024 thread blocks, one per sequence and kv head: two
    waves of 132 SMs x 4 resident blocks on an H200, as short as any split's, so no split);
  * batch 1 x 32,768 tokens: split-KV (64 partitions of 512 tokens, one per thread block: 512 blocks, one wave)
    and the reduce kernel.
Each case runs twice (the first launch of a kernel includes its module load); ncu records every launch.

    ncu --clock-control none -k regex:paged_attention python scripts/ncu_cases.py
"""

import torch

import paged_attn


def case(num_seqs, seq_len, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16):
    blocks_per_seq = -(-seq_len // block_size)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, dtype=dtype, device="cuda")
    value_cache = torch.randn(shape, dtype=dtype, device="cuda")
    block_tables = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(num_seqs, blocks_per_seq)
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device="cuda")
    query = torch.randn(num_seqs, num_heads, head_dim, dtype=dtype, device="cuda")
    return query, key_cache, value_cache, block_tables, seq_lens


def main():
    torch.manual_seed(0)
    for num_seqs, seq_len in [(128, 4096), (1, 32768)]:
        inputs = case(num_seqs, seq_len)
        for _ in range(2):
            paged_attn.paged_attention(*inputs)
        torch.cuda.synchronize()
        kv_bytes = 2 * inputs[1].numel() * inputs[1].element_size()
        print(f"batch {num_seqs} x {seq_len} tokens: {kv_bytes / 2**20:.0f} MiB of keys and values")


if __name__ == "__main__":
    main()
