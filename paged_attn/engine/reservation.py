"""The ``kv_reservation`` policy: how much KV memory the scheduler promises a request at admission.

``kv_reservation`` picks how KV memory is promised to requests. ``"paged"`` (the default): blocks are taken
as tokens arrive and a request holds only what it has written. The other two emulate the contiguous allocators
the paper compares against (Orca): at admission a request reserves room for its worst case, for every one of its
sequences (no sharing), and that room stays unavailable to others until it finishes; ``"max_tokens"`` reserves
prompt + max_tokens tokens (an oracle when max_tokens is the true output length), ``"max_model_len"`` the model's
whole context. The blocks themselves are still paged and the kernels are the same, so the policies differ only
in how many requests fit at once; and since reserved room needs no contiguous run here, the emulation is kinder
to them than a real contiguous allocator (no external fragmentation).
"""

from __future__ import annotations

from typing import Callable

from .sampling import SamplingParams
from .sequence import Request

KV_RESERVATIONS = ("paged", "max_tokens", "max_model_len")


class KVReservation:
    """A ``kv_reservation`` policy over a pool of blocks of ``block_size`` tokens in ``num_groups`` KV-cache groups,
    for sequences of at most ``max_model_len`` tokens."""

    def __init__(self, policy: str, max_model_len: int, blocks_held: Callable[[int], int]):
        if policy not in KV_RESERVATIONS:
            raise ValueError(f"kv_reservation must be one of {KV_RESERVATIONS}, got {policy!r}")
        self.policy, self.max_model_len = policy, max_model_len
        self.blocks_held = blocks_held  # the most blocks a sequence of n tokens holds at once, all groups counted

    def max_blocks(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The most blocks a request can ever hold at once (every sequence counted, none shared), and what it
        reserves under a kv_reservation policy (windowed KV-cache groups hold only what their queries see:
        ``BlockManager.max_blocks_held``)."""
        max_len = self.max_model_len if self.policy == "max_model_len" else \
            min(num_prompt_tokens + params.max_tokens, self.max_model_len)
        return params.num_seqs * self.blocks_held(max_len)

    def unused_blocks(self, running: list[Request], block_manager) -> int:
        """Blocks that the running requests have reserved but not yet taken from ``block_manager`` (0 when
        paged)."""
        if self.policy == "paged":
            return 0
        unused = 0
        for request in running:
            held = block_manager.num_blocks_held(seq.seq_id for seq in request.seqs)
            unused += max(0, self.max_blocks(len(request.prompt_token_ids), request.params) - held)
        return unused
