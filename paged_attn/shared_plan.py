"""plan_shared_blocks: the shared-blocks plan of a decode batch for the CUDA kernel (``paged_attention``'s
``shared_plan``), computed on the host from the batch's block tables by the op of csrc/shared_blocks.cpp, whose
search for shared blocks the CPU kernel also uses (csrc/shared_blocks.h).
"""

from __future__ import annotations

import torch

from .fakes import _is_int


def plan_shared_blocks(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    *,
    num_queries_per_kv: int = 1,
    min_shared_tokens: int = 64,
) -> torch.Tensor:
    """The shared-blocks plan of a decode batch, for :func:`paged_attention`'s ``shared_plan`` (CUDA): which rows
    hold the same physical blocks at the same positions of their block tables, so that the kernel reads those
    blocks once per kv head for all of them. Runs on the host, from tables the caller has there (an engine's
    scheduler, vLLM's CPU-side block tables), so the CUDA launch never copies from the device; move the plan with
    ``.to(device, non_blocking=True)``.

    The rows' full blocks (``seq_lens[s] // block_size``) are sorted by their block-table entries; rows that agree
    on their first ``n`` entries share those blocks. The sorted rows are cut into groups of at most
    ``8 // heads_per_block`` (a task's rows; ``heads_per_block``: the query heads a thread block serves,
    ``num_queries_per_kv`` up to 8, else ``ceil(group / ceil(group / 8))``), where neighbours share the fewest
    blocks (a cut makes both sides read what they share). Each node of a group's prefix tree that two or more of
    its rows reach, and that adds ``min_shared_tokens`` or more tokens to its parent, gives one task: the node's
    block range ``[parent's n, n)`` and its rows. So a row is listed at most 7 times, whatever the depth of the
    tree (the kernel takes 8), and samples of one prompt, beams forked at different steps and requests behind one
    cached system prompt are found in one call, at any depth.

    Args:
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]`` on the CPU, the tables of the call.
        seq_lens: int32 ``[num_seqs]`` on the CPU, the tokens of each sequence (the tables' entries past a row's
            full blocks are not looked at).
        block_size: tokens per block of the cache.
        num_queries_per_kv: ``num_heads // num_kv_heads``. From 5 up (one row per thread block) the kernel saves
            nothing and the plan is empty.
        min_shared_tokens: the least number of tokens a task's range holds (the kernel shares whole split-KV
            partitions, 64 to 512 tokens, inside it).

    Returns:
        int32 ``[num_tasks, 11]`` on the CPU: per task ``(ref, first_block, end_block, row_0, ..., row_7)``, rows
        ``-1`` past the last; ``ref`` is one of the rows, whose table the kernel reads.

    The kernel's rules (``csrc/cuda/shared_blocks.cuh``): a listing of row ``r`` in a task is used where ``r``'s
    place in the task is below ``8 // heads_per_block``, ``r``'s entries over the task's whole partitions equal
    ``ref``'s, ``r``'s length reaches the end of them and its window (if any) covers them, with ALiBi ``r``'s
    length is ``ref``'s (the samples or beams of one prompt; requests of other lengths are served without ALiBi
    only), ``r`` is listed at most 8 times in the plan and no other listing of ``r`` overlaps them. Else the row
    computes those partitions itself. A thread block of a task holds 8 head slots: the blocks are read once per
    task and kv head, so blocks that ``m`` rows hold are read once per group that holds some of them:
    ``ceil(m / (8 // heads_per_block))`` times where the cuts fall between subtrees (one prompt's samples, a chain
    of forks), not ``m``.

    Example::

        plan = paged_attn.plan_shared_blocks(block_tables_cpu, seq_lens_cpu, block_size,
                                             num_queries_per_kv=num_heads // num_kv_heads)
        out = paged_attn.paged_attention(q, key_cache, value_cache, block_tables, seq_lens,
                                         shared_plan=plan.to(q.device, non_blocking=True))
    """
    for name, t, dim in (("block_tables", block_tables, 2), ("seq_lens", seq_lens, 1)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != dim or t.device.type != "cpu":
            raise ValueError(f"{name} must be an int32 CPU tensor with {dim} dimension(s), got "
                             f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))} on "
                             f"{getattr(t, 'device', None)}")
    if seq_lens.shape[0] != block_tables.shape[0]:
        raise ValueError(f"seq_lens must have num_seqs = {block_tables.shape[0]} entries (block_tables' rows), got "
                         f"{seq_lens.shape[0]}")
    for name, value in (("block_size", block_size), ("num_queries_per_kv", num_queries_per_kv),
                        ("min_shared_tokens", min_shared_tokens)):
        if not (_is_int(value) and 1 <= value < 2**63):
            raise ValueError(f"{name} must be a positive integer below 2**63, got {value!r}")
    return torch.ops.paged_attn.plan_shared_blocks(block_tables, seq_lens, block_size, num_queries_per_kv,
                                                   min_shared_tokens)
