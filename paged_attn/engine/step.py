"""``ScheduledStep``: one step as the scheduler hands it over to the rest of the engine.

The ``ModelRunner`` applies the cache operations it asks for (swap in, swap out, copy-on-write) and builds its
tensors from it (the paged metadata from its block tables and reserved slots); the ``OutputProcessor`` samples for
its sampling requests; the ``StatsCollector`` counts what it did (prefill tokens, decodes, preemptions,
prefix-cache hits): the scheduler itself keeps no statistics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .sequence import Request, Sequence


@dataclass
class ScheduledStep:
    """One step as the scheduler decided it: the cache operations to apply first (swap in, swap out, copy, in
    that order), then, for each scheduled sequence, its next ``num_new_tokens`` tokens to compute."""

    seqs: list[Sequence] = field(default_factory=list)  # a request's sequences are adjacent
    num_new_tokens: list[int] = field(default_factory=list)  # per sequence, from its num_computed_tokens on
    block_tables: list[list[list[int]]] = field(default_factory=list)  # per sequence, per KV-cache group
    # per sequence: the slot of its new token in each KV-cache group as the block manager reserved it (decodes),
    # or None (prefill chunks: the runner's paged metadata computes them from block_tables)
    reserved_slots: list[Optional[list[int]]] = field(default_factory=list)
    sampling_requests: list[Request] = field(default_factory=list)  # those whose every last token is computed
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (swap_block, kv_block)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (kv_block, swap_block)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src_block, dst_block)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    # what the step did, for the engine's statistics
    num_swapped_out: int = 0  # requests preempted by swapping out
    num_recomputed: int = 0  # requests preempted by dropping their KV, to recompute
    prefix_cache_hit_tokens: int = 0  # tokens of admitted requests found in the prefix cache
    num_running_seqs: int = 0  # sequences of the running requests once the step is scheduled
