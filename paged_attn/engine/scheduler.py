"""Sequences, requests and the iteration-level scheduler that owns the paged KV cache.

Every step is either a prefill (newly admitted or recomputed requests) or a decode (one token for every running
sequence). A request's sequences are scheduled, swapped and preempted together. Each sequence's ``token_ids``
are its prompt plus every token sampled so far; the block manager holds all of them but the last, whose slot is
reserved (``append_slot``) when the step that writes its KV is scheduled. Every cache operation the manager asks
for (copy-on-write, swap out, swap in) is applied as soon as it is returned, so it always precedes the step's
writes. Once the step's forward pass has completed, ``mark_computed`` publishes the blocks it filled to the
prefix cache; if anything fails before that, ``abort_all`` drops every request and no unwritten block is ever
published.

``kv_reservation`` picks how KV memory is promised to requests. ``"none"`` (paged, the default): blocks are taken
as tokens arrive and a request holds only what it has written. The other two emulate the contiguous allocators
the paper compares against (Orca): at admission a request reserves room for its worst case, for every one of its
sequences (no sharing), and that room stays unavailable to others until it finishes; ``"max_tokens"`` reserves
prompt + max_tokens tokens (an oracle when max_tokens is the true output length), ``"max_model_len"`` the model's
whole context. The blocks themselves are still paged and the kernels are the same, so the policies differ only
in how many requests fit at once; and since reserved room needs no contiguous run here, the emulation is kinder
to them than a real contiguous allocator (no external fragmentation).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import torch

from .. import ops
from ..block_manager import BlockManager
from .model import Batch, ModelConfig
from .sampling import SamplingParams

_seq_ids = itertools.count()
KV_RESERVATIONS = ("none", "max_tokens", "max_model_len")


@dataclass(eq=False)
class Sequence:
    token_ids: list[int]
    num_prompt_tokens: int
    cumulative_logprob: float = 0.0
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_cached_tokens: int = 0  # at admission: leading tokens whose KV was already in the cache
    slot: int = -1  # decode: where the last token's KV goes
    finish_reason: Optional[str] = None
    score: float = 0.0  # beam search: cumulative log-probability / length

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass(eq=False)
class Request:
    request_id: int  # arrival order: a lower id is older
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    seqs: list[Sequence] = field(default_factory=list)  # live (running, swapped or waiting) sequences
    finished: list[Sequence] = field(default_factory=list)
    forked: bool = False  # whether the prompt's sequence has been fanned out into n samples / beams

    def __post_init__(self):
        if not self.seqs:
            self.seqs = [Sequence(list(self.prompt_token_ids), len(self.prompt_token_ids))]


@dataclass(frozen=True)
class EngineStats:
    """KV-cache figures since the last ``generate`` began (peaks over its steps) and now."""

    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    bytes_per_block: int  # key and value, all layers
    gpu_blocks_used: int  # now
    peak_gpu_blocks_used: int
    peak_tokens: int  # tokens stored (counted per sequence) at the peak
    utilization_at_peak: float  # slots holding a token / slots in used blocks, at the peak
    peak_blocks_saved_by_sharing: int  # block-table entries minus physical blocks (fork, prefix hits)
    num_preemptions: int
    num_swapped_out: int
    num_recomputed: int
    prefix_cache_hit_tokens: int
    num_prefill_tokens: int  # tokens computed by prefill steps (prompts, recomputation)
    num_generated_tokens: int
    num_decode_steps: int
    peak_running_seqs: int  # sequences in one step, at most


class Scheduler:
    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype, block_size: int,
                 num_gpu_blocks: int, num_cpu_blocks: int, enable_prefix_caching: bool, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, kv_reservation: str = "none",
                 admission_headroom: int = 0):
        if kv_reservation not in KV_RESERVATIONS:
            raise ValueError(f"kv_reservation must be one of {KV_RESERVATIONS}, got {kv_reservation!r}")
        self.device, self.block_size = device, block_size
        self.kv_reservation, self.max_model_len = kv_reservation, max_model_len
        self.admission_headroom = admission_headroom  # free blocks per running sequence that admission leaves
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.bytes_per_block = kv_bytes_per_block(config, block_size, dtype)
        # The cache tensors come first: an oversized pool fails here, at once, before the manager's bookkeeping.
        self.kv_caches = _allocate_caches(config, num_gpu_blocks, block_size, dtype, device, False,
                                          self.bytes_per_block, "num_gpu_blocks")
        self.cpu_kv_caches = _allocate_caches(config, num_cpu_blocks, block_size, dtype, torch.device("cpu"),
                                              device.type == "cuda", self.bytes_per_block, "num_cpu_blocks") \
            if num_cpu_blocks else []
        self.manager = BlockManager(num_gpu_blocks, block_size, num_cpu_blocks=num_cpu_blocks,
                                    enable_prefix_caching=enable_prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # oldest first
        self.swapped: list[Request] = []  # oldest first
        self.reset_stats()

    # ---- bookkeeping ----

    def reset_stats(self) -> None:
        self.peak = self.manager.stats()
        self.peak_saved = self.peak.blocks_saved_by_sharing
        self.num_preemptions = self.num_swapped_out = self.num_recomputed = 0
        self.prefix_cache_hit_tokens = self.num_prefill_tokens = self.num_generated_tokens = 0
        self.num_decode_steps = self.peak_running_seqs = 0

    def stats(self) -> EngineStats:
        now = self.manager.stats()
        return EngineStats(
            block_size=self.block_size, num_gpu_blocks=now.num_gpu_blocks,
            num_cpu_blocks=self.manager.num_cpu_blocks, bytes_per_block=self.bytes_per_block,
            gpu_blocks_used=now.gpu_blocks_used, peak_gpu_blocks_used=self.peak.gpu_blocks_used,
            peak_tokens=self.peak.num_tokens, utilization_at_peak=self.peak.utilization,
            peak_blocks_saved_by_sharing=self.peak_saved, num_preemptions=self.num_preemptions,
            num_swapped_out=self.num_swapped_out, num_recomputed=self.num_recomputed,
            prefix_cache_hit_tokens=self.prefix_cache_hit_tokens, num_prefill_tokens=self.num_prefill_tokens,
            num_generated_tokens=self.num_generated_tokens, num_decode_steps=self.num_decode_steps,
            peak_running_seqs=self.peak_running_seqs,
        )

    def _record_peak(self) -> None:
        self.peak_running_seqs = max(self.peak_running_seqs, self._running_seqs())
        now = self.manager.stats()
        if now.gpu_blocks_used > self.peak.gpu_blocks_used:
            self.peak = now
        self.peak_saved = max(self.peak_saved, now.blocks_saved_by_sharing)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def max_blocks(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The most blocks a request can ever hold, and what it reserves under a kv_reservation policy."""
        max_len = self.max_model_len if self.kv_reservation == "max_model_len" else \
            min(num_prompt_tokens + params.max_tokens, self.max_model_len)
        return params.width * self.blocks_for(max_len)

    def _reserved_unused_blocks(self) -> int:
        """Blocks that running requests have reserved but not yet taken (0 when paged)."""
        if self.kv_reservation == "none":
            return 0
        unused = 0
        for request in self.running:
            held = {block for seq in request.seqs for block in self.manager.block_table(seq.seq_id)}
            unused += max(0, self.max_blocks(len(request.prompt_token_ids), request.params) - len(held))
        return unused

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        self.manager.fork(parent.seq_id, child.seq_id)

    def free(self, seq: Sequence) -> None:
        self.manager.free(seq.seq_id)

    def finish(self, request: Request) -> None:
        self.running.remove(request)

    def mark_computed(self, requests: list[Request]) -> None:
        """The step's forward pass has written the KV of every token of these requests' sequences: publish
        their full blocks to the prefix cache."""
        for request in requests:
            for seq in request.seqs:
                self.manager.mark_computed(seq.seq_id)

    def abort_all(self) -> None:
        """Drop every request and free its blocks (after an error). Blocks of the failed step were never
        published, so they return to the free list; published ones keep their (written) KV in the prefix cache."""
        self.waiting.clear()
        self.running.clear()
        self.swapped.clear()
        manager = self.manager
        try:
            for seq_id in list(manager.seqs):
                manager.free(seq_id)
            consistent = manager.num_free_blocks == manager.num_gpu_blocks and \
                manager.num_free_cpu_blocks == manager.num_cpu_blocks
        except Exception:  # the error interrupted the manager itself (e.g. KeyboardInterrupt mid-call)
            consistent = False
        if not consistent:  # start over with an empty manager (and prefix cache) rather than trust its state
            self.manager = BlockManager(manager.num_gpu_blocks, manager.block_size,
                                        num_cpu_blocks=manager.num_cpu_blocks,
                                        enable_prefix_caching=manager.enable_prefix_caching)

    # ---- scheduling ----

    def schedule(self) -> tuple[list[Request], Batch]:
        """Pick the next step: swapped requests come back first, then new ones are prefilled, else decode."""
        self._swap_in()
        if not self.swapped:
            admitted = self._admit()
            if admitted:
                self._record_peak()
                return admitted, self._prefill_batch(admitted)
        scheduled = self._reserve_decode_slots()
        if not scheduled:
            raise RuntimeError("scheduler is stuck: requests are waiting but none can run")
        self.num_decode_steps += 1
        self._record_peak()
        return scheduled, self._decode_batch(scheduled)

    def _running_width(self) -> int:
        return sum(request.params.width for request in self.running)

    def _running_seqs(self) -> int:
        return sum(len(request.seqs) for request in self.running)

    def _swap_in(self) -> None:
        while self.swapped:
            request = self.swapped[0]
            seq_ids = [seq.seq_id for seq in request.seqs]
            if self.running:  # leave room for every sequence's next token, or it would be swapped right back
                num_blocks = len({block for seq_id in seq_ids for block in self.manager.block_table(seq_id)})
                if (num_blocks + self._running_seqs() + len(seq_ids) > self.manager.num_free_blocks
                        or self._running_width() + request.params.width > self.max_num_seqs):
                    return
            mapping = self.manager.swap_in(seq_ids)
            for (gpu_key, gpu_value), (cpu_key, cpu_value) in zip(self.kv_caches, self.cpu_kv_caches):
                ops.swap_blocks(cpu_key, gpu_key, mapping)
                ops.swap_blocks(cpu_value, gpu_value, mapping)
            self.swapped.pop(0)
            self._add_running(request)

    def _can_admit(self, request: Request) -> bool:
        if self.kv_reservation != "none":
            free = self.manager.num_free_blocks - self._reserved_unused_blocks()
            return self.max_blocks(len(request.prompt_token_ids), request.params) <= free
        # While others run, leave admission_headroom free blocks per running sequence (the request's own included)
        # for their next tokens: otherwise new prompts fill the pool, the running sequences soon preempt them
        # again, and each preemption by recomputation redoes a prefill.
        keep_free = self.admission_headroom * (self._running_seqs() + len(request.seqs)) if self.running else 0
        if len(request.seqs) == 1:
            return self.manager.can_allocate(request.seqs[0].token_ids, keep_free)  # counts prefix-cache hits
        # recomputing a request with several sequences: each is allocated on its own (hits can only help)
        needed = sum(self.blocks_for(len(seq.token_ids)) for seq in request.seqs)
        return needed + keep_free <= self.manager.num_free_blocks

    def _admit(self) -> list[Request]:
        admitted, num_tokens = [], 0
        while self.waiting:
            request = self.waiting[0]
            new_tokens = sum(len(seq.token_ids) for seq in request.seqs)
            if admitted and num_tokens + new_tokens > self.max_num_batched_tokens:
                break
            if self.running and self._running_width() + request.params.width > self.max_num_seqs:
                break
            if not self._can_admit(request):
                break
            if admitted and self._shares_blocks_being_computed(request, admitted):
                break  # next step, its prefix is in the cache: it shares those blocks instead of computing them
            for seq in request.seqs:
                seq.num_cached_tokens = self.manager.allocate(seq.seq_id, seq.token_ids)
                self.prefix_cache_hit_tokens += seq.num_cached_tokens
                num_tokens += len(seq.token_ids) - seq.num_cached_tokens
            self.waiting.popleft()
            self._add_running(request)
            admitted.append(request)
        return admitted

    def _shares_blocks_being_computed(self, request: Request, admitted: list[Request]) -> bool:
        """Whether the request's prompt has more full blocks in common with a prompt admitted to this step than the
        prefix cache holds for it. Blocks enter the cache only once written (after this step), so admitted now it
        would compute and hold copies of them; admitted one step later, it hits them."""
        if not self.manager.enable_prefix_caching:
            return False
        for seq in request.seqs:
            tokens = seq.token_ids
            cached = self.manager.cached_prefix_length(tokens)
            hittable = (len(tokens) - 1) // self.block_size * self.block_size  # never the last token's block
            for other in (other_seq.token_ids for other_request in admitted for other_seq in other_request.seqs):
                common = _common_prefix_length(tokens, other) // self.block_size * self.block_size
                if min(common, hittable) > cached:
                    return True
        return False

    def _can_append(self, request: Request) -> bool:
        if len(request.seqs) == 1:
            return self.manager.can_append_slot(request.seqs[0].seq_id)
        return len(request.seqs) <= self.manager.num_free_blocks  # each may need a new or copied block

    def _reserve_decode_slots(self) -> list[Request]:
        """Reserve the slot of every running sequence's last token, preempting the newest requests if needed."""
        pending, self.running = self.running, []
        while pending:
            request = pending.pop(0)
            while not self._can_append(request) and pending:
                self._preempt(pending.pop())
            if not self._can_append(request) and self.running:
                self._preempt(request)
                continue
            # (alone, a request always fits: LLM rejects any request the whole pool could not hold)
            cows = []
            for seq in request.seqs:
                seq.slot, cow = self.manager.append_slot(seq.seq_id, seq.token_ids[-1])
                if cow is not None:
                    cows.append(cow)
            if cows:
                ops.copy_blocks([key for key, _ in self.kv_caches], [value for _, value in self.kv_caches], cows)
            self.running.append(request)
        return list(self.running)

    def _preempt(self, request: Request) -> None:
        """Swap the request's sequences out to CPU blocks if there is room, else drop their KV to recompute."""
        self.num_preemptions += 1
        seq_ids = [seq.seq_id for seq in request.seqs]
        if self.cpu_kv_caches and self.manager.can_swap_out(seq_ids):
            mapping = self.manager.swap_out(seq_ids)
            for (gpu_key, gpu_value), (cpu_key, cpu_value) in zip(self.kv_caches, self.cpu_kv_caches):
                ops.swap_blocks(gpu_key, cpu_key, mapping)
                ops.swap_blocks(gpu_value, cpu_value, mapping)
            self.swapped.append(request)
            self.swapped.sort(key=lambda r: r.request_id)
            self.num_swapped_out += 1
        else:
            for seq_id in seq_ids:
                self.manager.free(seq_id)
            self.waiting.appendleft(request)  # victims go newest first, so the oldest ends up in front
            self.num_recomputed += 1

    def _add_running(self, request: Request) -> None:
        self.running.append(request)
        self.running.sort(key=lambda r: r.request_id)

    # ---- paged metadata (the one place it is built) ----

    def _prefill_batch(self, requests: list[Request]) -> Batch:
        seqs = [seq for request in requests for seq in request.seqs]
        input_ids, positions, slots, query_lens, context_lens = [], [], [], [], []
        for seq in seqs:
            start, end = seq.num_cached_tokens, len(seq.token_ids)
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += self.manager.slot_mapping(seq.seq_id, start, end)
            query_lens.append(end - start)
            context_lens.append(start)
        self.num_prefill_tokens += sum(query_lens)
        return self._batch(True, seqs, input_ids, positions, slots, query_lens, context_lens)

    def _decode_batch(self, requests: list[Request]) -> Batch:
        seqs = [seq for request in requests for seq in request.seqs]
        return self._batch(False, seqs, [seq.token_ids[-1] for seq in seqs],
                           [len(seq.token_ids) - 1 for seq in seqs], [seq.slot for seq in seqs],
                           [1] * len(seqs), [len(seq.token_ids) - 1 for seq in seqs])

    def _batch(self, is_prefill, seqs, input_ids, positions, slots, query_lens, context_lens) -> Batch:
        def tensor(values, dtype=torch.int64):
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        ends = list(itertools.accumulate(query_lens))
        return Batch(
            is_prefill=is_prefill,
            input_ids=tensor(input_ids),
            positions=tensor(positions),
            slot_mapping=tensor(slots),
            block_tables=self.manager.block_tables_tensor([seq.seq_id for seq in seqs], self.device),
            seq_lens=tensor([len(seq.token_ids) for seq in seqs], torch.int32),
            query_lens=query_lens,
            context_lens=context_lens,
            logits_indices=tensor([end - 1 for end in ends]),
        )


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block: keys and values of block_size tokens, in every layer."""
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * \
        torch.empty((), dtype=dtype).element_size()


def _common_prefix_length(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _allocate_caches(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                     device: torch.device, pin_memory: bool, bytes_per_block: int, name: str):
    """One (key_cache, value_cache) pair per layer, ``[num_blocks, block_size, num_kv_heads, head_dim]`` each;
    a pool that cannot be allocated raises ValueError at once."""
    total = num_blocks * bytes_per_block
    too_big = f"{name}={num_blocks} blocks of {bytes_per_block} bytes ({total / 2**30:.2f} GiB of KV cache)"
    if device.type == "cpu" and not pin_memory:  # untouched pages would be granted lazily and fail much later
        available = _available_cpu_memory()
        if available is not None and total > available:
            raise ValueError(f"{too_big} do not fit the {available / 2**30:.2f} GiB of memory available on the "
                             f"CPU; lower {name} or kv_cache_memory")
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    try:
        return [(torch.empty(shape, dtype=dtype, device=device, pin_memory=pin_memory),
                 torch.empty(shape, dtype=dtype, device=device, pin_memory=pin_memory))
                for _ in range(config.num_layers)]
    except (RuntimeError, MemoryError) as error:  # torch.OutOfMemoryError is a RuntimeError
        raise ValueError(f"{too_big} cannot be allocated on {device}: {error}") from None


def _available_cpu_memory() -> Optional[int]:
    """MemAvailable from /proc/meminfo in bytes, or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
