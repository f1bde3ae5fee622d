"""Small CUDA cases of every op, for compute-sanitizer (scripts/gpu_check.sh runs it under memcheck and racecheck).

Each case is checked against paged_attn.reference, so the run also fails on a wrong result. Covers both
paged_attention decode paths (single pass: many sequences; split-KV: one long sequence), GQA groups above and below
the 8 query heads a thread block serves, every dtype, a strided cache view, padding slots and copy/swap of blocks;
with query_start_loc, the tensor-core kernel next to the decode kernel (float16/bfloat16) and the decode kernel for
every row (float32), on vLLM's packed K|V cache; the tensor-core decode with a shared-blocks plan (and a garbage one);
MLA: concat_and_cache_mla and mla_attention (decode single pass and split-KV, several query rows per sequence).
"""

import torch

import paged_attn
from paged_attn import reference


def attention_case(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype):
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    alloc = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, dtype=dtype, device="cuda")
    key_cache, value_cache = alloc[:, 0], alloc[:, 1]
    perm = torch.randperm(num_blocks).tolist()
    width = max(blocks_per_seq) + 1
    tables = [[perm.pop() for _ in range(n)] + [-1] * (width - n) for n in blocks_per_seq]
    block_tables = torch.tensor(tables, dtype=torch.int32, device="cuda")
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    query = torch.randn(len(seq_lens), num_heads, head_dim, dtype=dtype, device="cuda")
    return query, key_cache, value_cache, block_tables, seq_lens_t


def packed_varlen_case(specs, num_heads, num_kv_heads, head_dim, block_size, dtype):
    """(seq_len, query_len) per sequence, caches as the halves of one packed [..., 2 * head_dim] allocation."""
    blocks_per_seq = [-(-n // block_size) for n, _ in specs]
    num_blocks = sum(blocks_per_seq) + 2
    alloc = torch.randn(num_blocks, block_size, num_kv_heads, 2 * head_dim, dtype=dtype, device="cuda")
    key_cache, value_cache = alloc[..., :head_dim], alloc[..., head_dim:]
    perm = torch.randperm(num_blocks).tolist()
    width = max(blocks_per_seq) + 1
    tables = [[perm.pop() for _ in range(n)] + [-1] * (width - n) for n in blocks_per_seq]
    block_tables = torch.tensor(tables, dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([n for n, _ in specs], dtype=torch.int32, device="cuda")
    starts = torch.tensor([0] + [q for _, q in specs], dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda()
    query = torch.randn(int(starts[-1]), num_heads, head_dim, dtype=dtype, device="cuda")
    return (query, key_cache, value_cache, block_tables, seq_lens), starts


def main():
    torch.manual_seed(0)
    tolerance = dict(rtol=2e-2, atol=2e-2)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        # (seq_lens, num_heads, num_kv_heads): single pass with an empty sequence; split-KV with a 16-head group
        # (two thread blocks per kv head); an odd GQA ratio.
        for seq_lens, num_heads, num_kv_heads in (([1, 17, 300, 0], 8, 2), ([5000], 16, 1), ([40, 600], 9, 3)):
            case = attention_case(seq_lens, num_heads, num_kv_heads, 128, 16, dtype)
            slopes = torch.rand(num_heads, device="cuda") * 0.1
            for kwargs in ({}, {"alibi_slopes": slopes, "sliding_window": 1000, "logits_soft_cap": 30.0}):
                torch.testing.assert_close(paged_attn.paged_attention(*case, **kwargs),
                                           reference.paged_attention(*case, **kwargs), **tolerance)

        # shared blocks (float16/bfloat16, tensor-core decode): 5 rows behind a 640-token prompt, 2 forking again,
        # with the host's plan and with a plan of random integers (checked in the kernel: still right)
        if dtype != torch.float32:
            case = list(attention_case([700, 900, 650, 800, 641, 300], 8, 8, 128, 16, dtype))
            tables = case[3]
            tables[1:5, :40] = tables[0, :40]
            tables[1, 40:44] = tables[3, 40:44]
            plan = paged_attn.plan_shared_blocks(tables.cpu(), case[4].cpu(), 16)
            garbage = torch.randint(-2, 60, (6, plan.shape[1]), dtype=torch.int32)
            for given in (plan, garbage):
                torch.testing.assert_close(paged_attn.paged_attention(*case, shared_plan=given.cuda()),
                                           reference.paged_attention(*case), **tolerance)

        # query_start_loc: a prompt, a chunk after a prefix, a decode, a sequence without rows; packed K|V cache
        specs = [(150, 150), (200, 70), (90, 1), (30, 0)]
        case, starts = packed_varlen_case(specs, 8, 2, 128, 16, dtype)
        for kwargs in ({}, {"sliding_window": 40, "alibi_slopes": torch.rand(8, device="cuda") * 0.1}):
            torch.testing.assert_close(paged_attn.paged_attention(*case, query_start_loc=starts, **kwargs),
                                       reference.paged_attention(*case, query_start_loc=starts, **kwargs),
                                       **tolerance)

        # MLA (float16/bfloat16): every latent row written by concat_and_cache_mla (projection slices, a padding
        # token skipped), decode over a short and a 3,000-token row (split-KV), then one query row per sequence
        # through query_start_loc
        if dtype != torch.float32:
            projection = torch.randn(3201, 128 + 8 + 32, dtype=dtype, device="cuda")
            slots = torch.cat([torch.randperm(200 * 16), torch.tensor([-1])]).cuda()
            kv_cache = torch.full((200, 16, 160), float("nan"), dtype=dtype, device="cuda")
            paged_attn.concat_and_cache_mla(projection[:, :128], projection[:, 136:], kv_cache, slots)
            expected = torch.full_like(kv_cache, float("nan"))
            reference.concat_and_cache_mla(projection[:, :128], projection[:, 136:], expected, slots)
            assert torch.equal(kv_cache, expected)
            block_tables = torch.zeros(2, 190, dtype=torch.int32, device="cuda")
            block_tables[0, :5] = torch.tensor([3, 9, 27, 55, 100], dtype=torch.int32)
            block_tables[1, :188] = torch.randperm(200)[:188].to(torch.int32)
            seq_lens = torch.tensor([70, 3000], dtype=torch.int32, device="cuda")
            query = torch.randn(2, 20, 160, dtype=dtype, device="cuda")
            for starts in (None, torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")):
                got = paged_attn.mla_attention(query, kv_cache, block_tables, seq_lens, kv_lora_rank=128, scale=0.1,
                                               query_start_loc=starts)
                want = reference.mla_attention(query, kv_cache, block_tables, seq_lens, kv_lora_rank=128,
                                               scale=0.1, query_start_loc=starts)
                torch.testing.assert_close(got, want, **tolerance)

        key = torch.randn(7, 2, 64, dtype=dtype, device="cuda")
        key_cache = torch.randn(6, 16, 2, 64, dtype=dtype, device="cuda")
        value_cache = torch.randn_like(key_cache)
        slots = torch.tensor([0, 5, -1, 40, 17, 95, 3], device="cuda")
        expected = [key_cache.clone(), value_cache.clone()]
        reference.reshape_and_cache(key, key, *expected, slots)
        paged_attn.reshape_and_cache(key, key, key_cache, value_cache, slots)
        torch.testing.assert_close(key_cache, expected[0], rtol=0, atol=0)
        reference.copy_blocks([expected[0]], [expected[1]], torch.tensor([[0, 4], [2, 5]]))
        paged_attn.copy_blocks([key_cache], [value_cache], torch.tensor([[0, 4], [2, 5]], device="cuda"))
        torch.testing.assert_close(value_cache, expected[1], rtol=0, atol=0)
        cpu_cache = torch.zeros(4, 16, 2, 64, dtype=dtype).pin_memory()
        paged_attn.swap_blocks(key_cache, cpu_cache, [(1, 0), (2, 1), (3, 2)])
        torch.cuda.synchronize()
        torch.testing.assert_close(cpu_cache[:3], key_cache[1:4].cpu(), rtol=0, atol=0)
    print("all sanitizer cases match the reference")


if __name__ == "__main__":
    main()
