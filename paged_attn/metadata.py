"""Host-side paged metadata: the one place that turns block tables into what the kernels read.

Token ``i`` of a sequence lives at slot ``block_table[i // block_size] * block_size + i % block_size`` (the
``slot_mapping`` of ``reshape_and_cache``); block tables are padded with ``PAD_BLOCK_ID`` into the int32
``block_tables`` of ``paged_attention``; on CUDA, a decode step's shared blocks are planned on the host
(``ops.plan_shared_blocks``). ``paged_metadata`` builds all of a step's at once, on the CPU, from the block tables
and the slots the block manager already reserved (cache layout: see ``paged_attn/ops.py``).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from . import ops

PAD_BLOCK_ID = -1  # fills the rows of block tables past a sequence's last block, and entries released


def token_slots(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
    """Cache slots of token positions ``[start, end)`` of a sequence with this block table."""
    return [block_table[i // block_size] * block_size + i % block_size for i in range(start, end)]


def block_tables_tensor(tables: list[list[int]], max_blocks: Optional[int] = None) -> torch.Tensor:
    """int32 ``[len(tables), max_blocks]`` block tables on the CPU (default width: the longest table), each row
    padded with ``PAD_BLOCK_ID`` (the ``block_tables`` of ``paged_attention``). Filled row by row through NumPy:
    converting a nested list with ``torch.tensor`` costs several times more."""
    max_blocks = max(map(len, tables), default=0) if max_blocks is None else max_blocks
    rows = np.full((len(tables), max_blocks), PAD_BLOCK_ID, dtype=np.int32)
    for row, table in zip(rows, tables):
        row[:len(table)] = table
    return torch.from_numpy(rows)


@dataclass
class PagedMetadata:
    """One step's paged metadata on the CPU: sequence ``s`` writes its new tokens (rows
    ``query_start_loc[s]:query_start_loc[s + 1]``) and attends over its first ``seq_lens[s]``, in each KV-cache
    group through the group's slots and block tables."""

    slot_mapping: torch.Tensor  # int64 [num_groups, num_tokens]
    block_tables: torch.Tensor  # int32 [num_groups, num_seqs, max_blocks]; PAD_BLOCK_ID: none or released
    seq_lens: torch.Tensor  # int32 [num_seqs]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    max_query_len: int
    shared_plans: Optional[tuple[torch.Tensor, ...]] = None  # decode steps, when asked: per group, the plan


def paged_metadata(block_tables: list[list[list[int]]], starts: list[int], query_lens: list[int],
                   reserved_slots: list[Optional[list[int]]], block_size: int, num_groups: int,
                   num_queries_per_kv: Optional[int] = None) -> PagedMetadata:
    """The metadata of a step whose sequence ``s`` computes its tokens ``[starts[s], starts[s] + query_lens[s])``
    with ``block_tables[s]`` (one table per KV-cache group). ``reserved_slots[s]``: the slot of its one new token in
    each group, as the block manager reserved it (a decode), or None (computed here from the tables).
    ``num_queries_per_kv``: plan the shared blocks of a decode step (every ``query_lens`` 1) with this GQA ratio,
    unless PAGED_ATTN_NO_SHARED_BLOCKS is set (read every step, as the op reads it); None: no plans."""
    slots: list[list[int]] = [[] for _ in range(num_groups)]
    seq_lens = []
    for tables, start, query_len, reserved in zip(block_tables, starts, query_lens, reserved_slots):
        for group, table in enumerate(tables):
            slots[group] += [reserved[group]] if reserved is not None else \
                token_slots(table, block_size, start, start + query_len)
        seq_lens.append(start + query_len)
    max_blocks = max((len(table) for seq_tables in block_tables for table in seq_tables), default=0)
    tables = [block_tables_tensor([seq_tables[group] for seq_tables in block_tables], max_blocks)
              for group in range(num_groups)]  # (a windowed group's table can be shorter: given chunk by chunk)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    max_query_len = max(query_lens, default=0)
    shared_plans = None
    if num_queries_per_kv is not None and max_query_len == 1 and "PAGED_ATTN_NO_SHARED_BLOCKS" not in os.environ:
        shared_plans = tuple(ops.plan_shared_blocks(table, lens, block_size, num_queries_per_kv=num_queries_per_kv)
                             for table in tables)
    num_tokens = sum(query_lens)
    return PagedMetadata(
        slot_mapping=torch.tensor(list(itertools.chain.from_iterable(slots)), dtype=torch.int64)
        .view(num_groups, num_tokens),
        block_tables=torch.stack(tables),
        seq_lens=lens,
        query_start_loc=torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32),
        max_query_len=max_query_len,
        shared_plans=shared_plans,
    )
