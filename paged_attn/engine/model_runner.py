"""The model runner: owns the KV cache (the GPU pool and the CPU pool that preempted requests swap to), applies the
cache operations the scheduler decided, builds each step's tensors and runs the model.

The cache holds the model's dtype, or fp8 (``kv_cache_dtype``): e4m3 or e5m2 values with one float32 scale per
layer for keys and one for values (stored = nearest fp8 of ``x / scale``), 1.0 by default (vLLM's default), or
calibrated once on the first step: ``amax(|x|) * KV_SCALE_MARGIN / max_finite`` per layer, from that step's keys and
values, before they are written (a margin for later tokens larger than the first prompts').

The scheduler decides; the runner moves data. A step's cache operations run before its forward pass, in the order
swap in, swap out, copy (copy-on-write), which is the order the scheduler decides them in: so a block a swap-out
frees may be a copy's destination in the same step, and a swap-out may send back a request swapped in earlier in
the same step.
"""

from __future__ import annotations

import itertools
from typing import Optional

import torch

from .. import ops
from ..block_manager import PAD_BLOCK_ID
from .model import Batch, CompiledElementwise, LlamaModel, ModelConfig
from .scheduler import ScheduledStep


KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's torch dtype for an ``LLM(kv_cache_dtype=...)`` value: "auto" is the model's dtype."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, got "
                         f"{kv_cache_dtype!r}")
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


class ModelRunner:
    def __init__(self, model: LlamaModel, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int,
                 kv_cache_dtype: str = "auto", calibrate_kv_scales: bool = False,
                 elementwise: Optional[CompiledElementwise] = None):
        self.model, self.device, self.block_size = model, model.device, block_size
        self.elementwise = elementwise  # this engine's compiled kernels (LLM(torch_compile=True)), or None
        self.cache_dtype = cache_dtype(kv_cache_dtype, model.dtype)
        self.bytes_per_block = kv_bytes_per_block(model.config, block_size, self.cache_dtype)
        self.kv_caches = _allocate_caches(model.config, num_gpu_blocks, block_size, self.cache_dtype, self.device,
                                          False, self.bytes_per_block, "num_gpu_blocks")
        self.cpu_kv_caches = _allocate_caches(model.config, num_cpu_blocks, block_size, self.cache_dtype,
                                              torch.device("cpu"), self.device.type == "cuda", self.bytes_per_block,
                                              "num_cpu_blocks") if num_cpu_blocks else []
        # (k_scale, v_scale) per layer, float32 [1] on the device: fp8 caches only.
        fp8 = KV_CACHE_DTYPES[kv_cache_dtype] is not None
        self.kv_scales = [(torch.ones(1, device=self.device), torch.ones(1, device=self.device))
                          for _ in range(model.config.num_layers)] if fp8 else None
        self.calibrate_pending = calibrate_kv_scales  # until the first step has run (LLM refuses it without fp8)

    def run(self, step: ScheduledStep) -> torch.Tensor:
        """Apply the step's cache operations, then run its forward pass (which writes the KV of its tokens).
        Return float32 logits ``[num_sampling_seqs, vocab_size]``: one row per sequence whose last token was
        computed, in the step's order."""
        self.swap(step.blocks_to_swap_in, to_gpu=True)
        self.swap(step.blocks_to_swap_out, to_gpu=False)
        if step.blocks_to_copy:
            ops.copy_blocks([key for key, _ in self.kv_caches], [value for _, value in self.kv_caches],
                            step.blocks_to_copy)
        calibrate, self.calibrate_pending = self.calibrate_pending, False
        return self.model.forward(self.prepare(step), self.kv_caches, self.kv_scales, calibrate,
                                  elementwise=self.elementwise)

    def swap(self, mapping: list[tuple[int, int]], to_gpu: bool) -> None:
        """Copy blocks between the pools: ``(cpu_block, gpu_block)`` pairs in, ``(gpu_block, cpu_block)`` out."""
        if not mapping:
            return
        for gpu_pair, cpu_pair in zip(self.kv_caches, self.cpu_kv_caches):
            src, dst = (cpu_pair, gpu_pair) if to_gpu else (gpu_pair, cpu_pair)
            ops.swap_blocks(src[0], dst[0], mapping)
            ops.swap_blocks(src[1], dst[1], mapping)

    def prepare(self, step: ScheduledStep) -> Batch:
        """The step's paged metadata: sequence ``s`` computes its tokens ``[num_computed_tokens, + num_new_tokens)``
        and attends over all its tokens up to each one."""
        block_size = self.block_size
        input_ids, positions, slots, query_lens, seq_lens, logits_indices = [], [], [], [], [], []
        num_tokens = 0
        for seq, num_new_tokens, table in zip(step.seqs, step.num_new_tokens, step.block_tables):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new_tokens
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += [table[i // block_size] * block_size + i % block_size for i in range(start, end)]
            query_lens.append(num_new_tokens)
            seq_lens.append(end)
            num_tokens += num_new_tokens
            if end == len(seq.token_ids):  # its last token: the logits of the next one
                logits_indices.append(num_tokens - 1)
        max_blocks = max(map(len, step.block_tables), default=0)
        block_tables = [table + [PAD_BLOCK_ID] * (max_blocks - len(table)) for table in step.block_tables]

        def tensor(values, dtype=torch.int64):
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        return Batch(
            input_ids=tensor(input_ids),
            positions=tensor(positions),
            slot_mapping=tensor(slots),
            block_tables=tensor(block_tables, torch.int32).reshape(len(block_tables), max_blocks),
            seq_lens=tensor(seq_lens, torch.int32),
            query_start_loc=tensor([0, *itertools.accumulate(query_lens)], torch.int32),
            max_query_len=max(query_lens, default=0),
            logits_indices=tensor(logits_indices),
        )


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block: keys and values of block_size tokens, in every layer."""
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * \
        torch.empty((), dtype=dtype).element_size()


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
