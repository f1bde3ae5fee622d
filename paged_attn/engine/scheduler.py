"""The scheduler's policy: which requests run each step, how many tokens each, and what is preempted.

Every step is one forward pass over a mixed batch, as in vLLM v1: first each running request that decodes gets one
token per sequence (its slot reserved, preempting the newest requests if blocks run out), then requests whose
prefill is under way continue it, then waiting requests are admitted; each prefill takes as many of its remaining
tokens as the step's budget (``max_num_batched_tokens``) leaves, so a long prompt is computed in chunks over
several steps. A request's sequences are scheduled, swapped and preempted together.

Admission (or re-admission after preemption by recomputation) allocates blocks for all of a request's tokens,
prefix-cache hits counted as computed; the request is then in *prefill* until every one of them is computed. With
windowed KV-cache groups, those groups are given their blocks chunk by chunk, before the step that computes the
chunk (``hold_tokens``), so that they hold only what the chunk's queries see; admission keeps free what every
prefill under way may still take there (``window_blocks_to_come``), and a chunk that finds too few free blocks
is cut to fit, newer prefills preempted if none of it fits. It
samples only in the step that computes the last token of each of its sequences (a chunk that ends earlier gives no
token); from then on it decodes, and the slots of each newly sampled token are reserved (``append_slots``) when the
step that writes its KV is scheduled. How much KV memory admission promises a request is ``kv_reservation``'s
policy (``reservation.py``).

The scheduler decides and hands each step over as a ``ScheduledStep`` (``step.py``). Once the step's forward pass
has completed, ``mark_computed`` advances the sequences, publishes the blocks written so far to the prefix cache
and releases the blocks of windowed KV-cache groups that no query still to come can see; if anything fails before
that, ``abort_all`` drops every request and no unwritten block is ever published.

"""

from __future__ import annotations

from collections import deque
from typing import Optional

from ..block_manager import BlockManager
from .sampling import SamplingParams
from .reservation import KVReservation
from .sequence import Request, Sequence
from .step import ScheduledStep


class Scheduler:
    """Decides each step (``schedule``) and keeps the requests' queues and blocks (``block_manager``); the engine
    runs the step and reports back (``mark_computed``, ``fork``, ``free``, ``finish``)."""

    def __init__(self, block_size: int, num_kv_blocks: int, num_swap_blocks: int, enable_prefix_caching: bool,
                 max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, kv_reservation: str = "paged",
                 admission_headroom: int = 0, group_windows: tuple = (None,)):
        self.block_size = block_size
        self.admission_headroom = admission_headroom  # free blocks per running sequence that admission leaves
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        # one block table per KV-cache group (None: global, or the group's sliding window; model_runner.kv_cache_groups)
        self.block_manager = BlockManager(num_kv_blocks, block_size, num_swap_blocks=num_swap_blocks,
                                          enable_prefix_caching=enable_prefix_caching, group_windows=group_windows)
        self.num_groups = self.block_manager.num_groups
        self.reservation = KVReservation(kv_reservation, max_model_len, self.max_blocks_held)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # oldest first
        self.swapped: list[Request] = []  # oldest first

    # ---- bookkeeping ----

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def max_blocks_held(self, num_tokens: int) -> int:
        """The most blocks a sequence of num_tokens holds at once, its prompt chunked by the step's token budget."""
        return self.block_manager.max_blocks_held(num_tokens, self.max_num_batched_tokens)

    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise ValueError for a request that could never run: too many sequences, or more blocks than the pool."""
        if params.num_seqs > self.max_num_seqs:
            raise ValueError(f"n / beam_width of {params.num_seqs} exceeds max_num_seqs={self.max_num_seqs}")
        needed = self.reservation.max_blocks(num_prompt_tokens, params)
        if needed > self.block_manager.num_kv_blocks:
            raise ValueError(
                f"request can never fit in the KV cache: {params.num_seqs} sequence(s) of up to "
                f"{needed // params.num_seqs} blocks of {self.block_size} tokens (in {self.num_groups} KV-cache "
                f"group(s), kv_reservation={self.reservation.policy!r}) need {needed} blocks, but the cache has "
                f"{self.block_manager.num_kv_blocks}; raise num_kv_blocks / kv_cache_memory or lower max_tokens")

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        self.block_manager.fork(parent.seq_id, child.seq_id)
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: Sequence) -> None:
        self.block_manager.free(seq.seq_id)

    def finish(self, request: Request) -> None:
        self.running.remove(request)

    def mark_computed(self, step: ScheduledStep) -> None:
        """The step's forward pass has written the KV of its tokens: advance every scheduled sequence and publish
        its full blocks written so far to the prefix cache; windowed KV-cache groups release the blocks that have
        fallen out of the window of every query still to come."""
        for seq, num_new_tokens in zip(step.seqs, step.num_new_tokens):
            seq.num_computed_tokens += num_new_tokens
            self.block_manager.mark_computed(seq.seq_id, seq.num_computed_tokens)
        for request in step.sampling_requests:
            request.prefilled = True

    def abort_all(self, drop_prefix_cache: bool = False) -> None:
        """Drop every request and free its blocks (after an error). Blocks of the failed step were never
        published, so they return to the free list; published ones keep their (written) KV in the prefix cache,
        unless ``drop_prefix_cache``."""
        self.waiting.clear()
        self.running.clear()
        self.swapped.clear()
        manager = self.block_manager
        try:
            for seq_id in list(manager.seqs):
                manager.free(seq_id)
            consistent = manager.num_free_blocks == manager.num_kv_blocks and \
                manager.num_free_swap_blocks == manager.num_swap_blocks
        except Exception:  # the error interrupted the manager itself (e.g. KeyboardInterrupt mid-call)
            consistent = False
        if not consistent or drop_prefix_cache:  # start over with an empty manager (and prefix cache)
            self.block_manager = BlockManager(manager.num_kv_blocks, manager.block_size,
                                              num_swap_blocks=manager.num_swap_blocks,
                                              enable_prefix_caching=manager.enable_prefix_caching,
                                              group_windows=manager.group_windows)

    # ---- scheduling ----

    def schedule(self) -> ScheduledStep:
        """Pick the next step: swapped requests come back first; then one token for each decoding sequence, the
        next chunk of each prefill under way, and new requests while the token budget and max_num_seqs allow."""
        step = ScheduledStep()
        self._swap_in(step)
        self._schedule_decodes(step)
        for request in list(self.running):
            if not request.prefilled and request in self.running and self._budget(step) > 0:
                self._schedule_prefill(step, request)
        if not self.swapped:
            self._admit(step)
        if not step.seqs:
            raise RuntimeError("scheduler is stuck: requests are waiting but none can run")
        step.num_running_seqs = self._running_seqs()
        return step

    def _budget(self, step: ScheduledStep) -> int:
        return self.max_num_batched_tokens - step.num_decode_tokens - step.num_prefill_tokens

    def _running_seqs_promised(self) -> int:
        """Sequences the running requests may run at once (n or beam_width each), whether or not all are live."""
        return sum(request.params.num_seqs for request in self.running)

    def _running_seqs(self) -> int:
        return sum(len(request.seqs) for request in self.running)

    def _swap_in(self, step: ScheduledStep) -> None:
        while self.swapped:
            request = self.swapped[0]
            seq_ids = [seq.seq_id for seq in request.seqs]
            if self.running:  # leave room for every sequence's next token, or it would be swapped right back
                num_blocks = self.block_manager.num_blocks_held(seq_ids)
                headroom = (self._running_seqs() + len(seq_ids)) * self.num_groups
                if (num_blocks + headroom > self.block_manager.num_free_blocks
                        or self._running_seqs_promised() + request.params.num_seqs > self.max_num_seqs):
                    return
            step.blocks_to_swap_in += self.block_manager.swap_in(seq_ids)
            self.swapped.pop(0)
            self._add_running(request)

    def _can_append(self, request: Request) -> bool:
        if len(request.seqs) == 1:
            return self.block_manager.can_append_slot(request.seqs[0].seq_id)
        # each may need a new or copied block in every group
        return len(request.seqs) * self.num_groups <= self.block_manager.num_free_blocks

    def _schedule_decodes(self, step: ScheduledStep) -> None:
        """Reserve the slot of every decoding sequence's new token, preempting the newest requests if needed."""
        pending, self.running = self.running, []
        while pending:
            request = pending.pop(0)
            if request.prefilled:
                while not self._can_append(request) and pending:
                    self._preempt(pending.pop(), step)
                if not self._can_append(request) and self.running:
                    self._preempt(request, step)
                    continue
                # (alone, a request always fits: LLM rejects any request the whole pool could not hold)
                reserved_slots = []
                for seq in request.seqs:
                    slots, cows = self.block_manager.append_slots(seq.seq_id, seq.token_ids[-1])
                    step.blocks_to_copy += cows
                    reserved_slots.append(slots)
                self._add_to_step(step, request, [1] * len(request.seqs), reserved_slots)
                step.num_decode_tokens += len(request.seqs)
            self.running.append(request)

    def _schedule_prefill(self, step: ScheduledStep, request: Request) -> None:
        """The request's next chunk: all its remaining tokens if they fit the step's budget, else as many as fit
        but never a sequence's last token (a request samples only once each of its sequences has computed it)."""
        remaining = [len(seq.token_ids) - seq.num_computed_tokens for seq in request.seqs]
        budget = self._budget(step)
        if sum(remaining) <= budget:
            chunk = remaining
        else:
            chunk = []
            for num_tokens in remaining:
                chunk.append(min(num_tokens - 1, budget))
                budget -= chunk[-1]
        chunk = self._fit_chunk(step, request, chunk)
        for seq, num_tokens in zip(request.seqs, chunk):  # windowed groups: the chunk's blocks
            self.block_manager.hold_tokens(seq.seq_id, seq.num_computed_tokens + num_tokens)
        self._add_to_step(step, request, chunk)
        step.num_prefill_tokens += sum(chunk)

    def _fit_chunk(self, step: ScheduledStep, request: Request, chunk: list[int]) -> list[int]:
        """The chunk cut to the blocks its windowed groups can take now (the newest prefills preempted while none
        of it fits; at worst it waits a step). Cut, it never holds a sequence's last token."""
        while True:
            free, fitted = self.block_manager.num_free_blocks, []
            for seq, num_tokens in zip(request.seqs, chunk):
                start = seq.num_computed_tokens
                end = start + num_tokens
                while end > start and self.block_manager.blocks_to_hold(seq.seq_id, end) > free:
                    end = max(start, (end - 1) // self.block_size * self.block_size)  # a block less in each group
                free -= self.block_manager.blocks_to_hold(seq.seq_id, end)
                fitted.append(end - start)
            newer = [other for other in self.running if other.request_id > request.request_id and not other.prefilled]
            if any(fitted) or not newer:
                break
            self.running.remove(newer[-1])
            self._preempt(newer[-1], step)
        if fitted != chunk:
            fitted = [min(num_tokens, len(seq.token_ids) - seq.num_computed_tokens - 1)
                      for seq, num_tokens in zip(request.seqs, fitted)]
        return fitted

    def _add_to_step(self, step: ScheduledStep, request: Request, num_new_tokens: list[int],
                     reserved_slots: Optional[list[list[int]]] = None) -> None:
        """Schedule the request's sequences for these numbers of new tokens (``reserved_slots``: per sequence, its
        decode token's slots that ``append_slots`` reserved)."""
        for index, (seq, num_tokens) in enumerate(zip(request.seqs, num_new_tokens)):
            if num_tokens:
                step.seqs.append(seq)
                step.num_new_tokens.append(num_tokens)
                step.block_tables.append(self.block_manager.block_tables(seq.seq_id))
                step.reserved_slots.append(None if reserved_slots is None else reserved_slots[index])
        if all(seq.num_computed_tokens + num_tokens == len(seq.token_ids)
               for seq, num_tokens in zip(request.seqs, num_new_tokens)):
            step.sampling_requests.append(request)

    def _can_admit(self, request: Request) -> bool:
        if self.reservation.policy != "paged":
            free = self.block_manager.num_free_blocks - self.reservation.unused_blocks(self.running, self.block_manager)
            return self.reservation.max_blocks(len(request.prompt_token_ids), request.params) <= free
        # While others run, leave admission_headroom free blocks per running sequence (the request's own included)
        # for their next tokens: otherwise new prompts fill the pool, the running sequences soon preempt them
        # again, and each preemption by recomputation redoes a prefill.
        keep_free = self.admission_headroom * self.num_groups * (self._running_seqs() + len(request.seqs)) \
            if self.running else 0
        # and what the prefills under way and this one may still take in windowed groups, their chunks to come
        keep_free += self._window_blocks_to_come() + sum(
            self.max_blocks_held(len(seq.token_ids)) - self._global_blocks(len(seq.token_ids)) for seq in request.seqs)
        if len(request.seqs) == 1:  # counts prefix-cache hits
            return self.block_manager.can_allocate(request.seqs[0].token_ids, keep_free, num_tokens=0)
        # recomputing a request with several sequences: each is allocated on its own (hits can only help)
        needed = sum(self._global_blocks(len(seq.token_ids)) for seq in request.seqs)
        return needed + keep_free <= self.block_manager.num_free_blocks

    def _global_blocks(self, num_tokens: int) -> int:
        """The blocks a new sequence of num_tokens takes at once in the global groups (windowed ones: chunk by
        chunk)."""
        return self.blocks_for(num_tokens) * sum(window is None for window in self.block_manager.group_windows)

    def _window_blocks_to_come(self) -> int:
        return sum(self.block_manager.window_blocks_to_come(seq.seq_id, self.max_num_batched_tokens)
                   for request in self.running if not request.prefilled for seq in request.seqs
                   if not self.block_manager.is_swapped_out(seq.seq_id))

    def _admit(self, step: ScheduledStep) -> None:
        while self.waiting and self._budget(step) > 0:
            request = self.waiting[0]
            if self.running and self._running_seqs_promised() + request.params.num_seqs > self.max_num_seqs:
                break
            if not self._can_admit(request):
                break
            if self._shares_blocks_being_computed(request):
                break  # later, its prefix is in the cache: it shares those blocks instead of computing them
            for seq in request.seqs:
                seq.num_computed_tokens = self.block_manager.allocate(seq.seq_id, seq.token_ids, num_tokens=0)
                step.prefix_cache_hit_tokens += seq.num_computed_tokens
            self.waiting.popleft()
            self._add_running(request)
            self._schedule_prefill(step, request)

    def _shares_blocks_being_computed(self, request: Request) -> bool:
        """Whether the request's prompt has more full blocks in common with a prefill under way (this step's
        included) than the prefix cache holds for it. Blocks enter the cache only once written, so admitted now
        it would compute and hold copies of them; admitted once they are written, it hits them."""
        if not self.block_manager.enable_prefix_caching:
            return False
        computing = [seq.token_ids for other in self.running if not other.prefilled for seq in other.seqs]
        for seq in request.seqs if computing else []:
            tokens = seq.token_ids
            cached = self.block_manager.cached_prefix_length(tokens)
            hittable = (len(tokens) - 1) // self.block_size * self.block_size  # never the last token's block
            for other in computing:
                common = _common_prefix_length(tokens, other) // self.block_size * self.block_size
                if min(common, hittable) > cached:
                    return True
        return False

    def _preempt(self, request: Request, step: ScheduledStep) -> None:
        """Swap the request's sequences out to swap blocks if there is room, else drop their KV to recompute."""
        seq_ids = [seq.seq_id for seq in request.seqs]
        if self.block_manager.num_swap_blocks and self.block_manager.can_swap_out(seq_ids):
            step.blocks_to_swap_out += self.block_manager.swap_out(seq_ids)
            self.swapped.append(request)
            self.swapped.sort(key=lambda r: r.request_id)
            step.num_swapped_out += 1
        else:
            for seq in request.seqs:
                self.block_manager.free(seq.seq_id)
                seq.num_computed_tokens = 0
            request.prefilled = False
            self.waiting.appendleft(request)  # victims go newest first, so the oldest ends up in front
            step.num_recomputed += 1

    def _add_running(self, request: Request) -> None:
        self.running.append(request)
        self.running.sort(key=lambda r: r.request_id)


def _common_prefix_length(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
