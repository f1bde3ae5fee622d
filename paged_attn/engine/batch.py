"""``Batch``: one step's inputs as a model's forward pass reads them, on the model's device.

The model runner builds it (``ModelRunner.prepare``) and the models take it; it sits below both, so that the
models never import the runner that drives them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class Batch:
    """Sequence ``s`` feeds its last ``q_s`` tokens (rows ``query_start_loc[s]:query_start_loc[s + 1]``, ``q_s`` >= 1)
    and attends over its first ``seq_lens[s]``. Layer ``i`` writes and reads the cache through its KV-cache group's
    ``slot_mapping`` and ``block_tables`` (``layer_groups[i]``; see ``model_runner.KVCacheGroups``)."""

    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    slot_mapping: torch.Tensor  # int64 [num_groups, num_tokens]
    block_tables: torch.Tensor  # int32 [num_groups, num_seqs, max_blocks]; -1 (PAD_BLOCK_ID): none or released
    layer_groups: tuple[int, ...]  # per layer: its KV-cache group
    seq_lens: torch.Tensor  # int32 [num_seqs]: tokens in the cache once this step's are written
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    max_query_len: int  # the largest q_s
    logits_indices: torch.Tensor  # int64 [num_sampling_seqs]: rows whose next-token logits are wanted
    shared_plans: Optional[tuple[torch.Tensor, ...]] = None  # CUDA decode steps: per group, plan_shared_blocks
