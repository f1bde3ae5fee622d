"""The model runner: owns the KV cache (the KV pool on the device, and the swap space on the CPU that preempted
requests swap to), applies the cache operations the scheduler decided, builds each step's tensors and runs the model.

The cache holds the model's dtype, or fp8 (``kv_cache_dtype``): e4m3 or e5m2 values with one float32 scale per
layer for keys and one for values (stored = nearest fp8 of ``x / scale``), 1.0 by default (vLLM's default), or
calibrated once (``calibrate_kv_scales``): ``amax(|x|) * KV_SCALE_MARGIN / max_finite`` per layer (a margin for later
tokens larger than the first prompts'), from the keys and values of the first ``generate`` call's prompts, computed
by a calibration pass before anything is stored (see ``ModelRunner.calibrate_kv_scales``).

The scheduler decides; the runner moves data. A step's cache operations run before its forward pass, in the order
swap in, swap out, copy (copy-on-write), which is the order the scheduler decides them in: so a block a swap-out
frees may be a copy's destination in the same step, and a swap-out may send back a request swapped in earlier in
the same step.

The cache is laid out by KV-cache groups (``KVCacheGroups``): ``layers_per_group`` (key, value) tensor pairs of
``[num_blocks, block_size, num_kv_heads, head_dim]`` (for latent attention, MLA, one latent tensor ``[num_blocks,
block_size, kv_lora_rank + qk_rope_head_dim]`` in place of each pair: ``kv_cache_shapes``), a block id (a page)
naming ``block_size`` tokens of one group's layers in each pair; layer ``i`` uses pair ``layer_pair[i]`` with its
group's slots and block tables. With one group (every layer global) a block holds every layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .. import ops
from ..metadata import paged_metadata
from ..tiled_cache import TILED_DTYPES, tiled_cache_shapes
from .batch import Batch
from .layers import CompiledElementwise
from .loader import ModelConfig
from .model import LlamaModel
from .sequence import Sequence
from .step import ScheduledStep


KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
KV_SCALE_MARGIN = 2.0  # calibrated fp8 scales leave the calibration prompts' largest |x| at half the largest fp8 value
KV_CALIBRATION_TOKENS = 4096  # the calibration pass takes prompts up to this many tokens in all (at least one)


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's torch dtype for an ``LLM(kv_cache_dtype=...)`` value: "auto" is the model's dtype."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, got "
                         f"{kv_cache_dtype!r}")
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


@dataclass(frozen=True)
class KVCacheGroups:
    """How the layers share the paged KV cache (window-aware memory; design: ``WINDOW_MEMORY.md``): the layers are
    split into groups of ``layers_per_group`` layers of one attention type, and every group keeps its own block
    tables and slot mapping over one pool of pages; a page holds ``block_size`` tokens of a group's layers, so a
    windowed group can release the pages that have fallen out of its window while a global one keeps them."""

    windows: tuple[Optional[int], ...]  # per group: None (global) or its sliding window; global groups first
    layer_group: tuple[int, ...]  # per layer: its group
    layer_pair: tuple[int, ...]  # per layer: which of the layers_per_group (key, value) cache tensors it uses
    layers_per_group: int

    @property
    def num_groups(self) -> int:
        return len(self.windows)


def kv_cache_groups(config: ModelConfig, window_aware: bool = True,
                    enable_prefix_caching: bool = False) -> KVCacheGroups:
    """The KV-cache groups of a model: one global group of every layer when all layers are global (Llama), when
    ``window_aware`` is off, or when prefix caching needs a global group and there is none; else, per attention
    type (global, then each window), the type's layers in order, cut into groups of the greatest common divisor of
    the types' layer counts (Gemma 3 270M: 3 global and 15 windowed layers make 6 groups of 3)."""
    num_layers = config.num_layers
    windows = config.sliding_windows or (None,) * num_layers
    kinds = sorted(set(windows), key=lambda window: (window is not None, window or 0))
    if not window_aware or kinds == [None] or (enable_prefix_caching and None not in kinds):
        return KVCacheGroups((None,), (0,) * num_layers, tuple(range(num_layers)), num_layers)
    layers = {kind: [i for i, window in enumerate(windows) if window == kind] for kind in kinds}
    size = math.gcd(*(len(indices) for indices in layers.values()))
    group_windows, layer_group, layer_pair = [], [0] * num_layers, [0] * num_layers
    for kind in kinds:
        for start in range(0, len(layers[kind]), size):
            for pair, layer in enumerate(layers[kind][start:start + size]):
                layer_group[layer], layer_pair[layer] = len(group_windows), pair
            group_windows.append(kind)
    return KVCacheGroups(tuple(group_windows), tuple(layer_group), tuple(layer_pair), size)


class ModelRunner:
    def __init__(self, model: LlamaModel, block_size: int, num_kv_blocks: int, num_swap_blocks: int,
                 kv_cache_dtype: str = "auto", calibrate_kv_scales: bool = False,
                 elementwise: Optional[CompiledElementwise] = None, groups: Optional[KVCacheGroups] = None,
                 tiled_kv_cache: bool = False):
        self.model, self.device, self.block_size = model, model.device, block_size
        self.elementwise = elementwise  # this engine's compiled kernels (LLM(torch_compile=True)), or None
        self.groups = groups or kv_cache_groups(model.config, window_aware=False)
        self.cache_dtype = cache_dtype(kv_cache_dtype, model.dtype)
        if tiled_kv_cache:
            check_tiled_kv_cache(model.config, block_size, self.cache_dtype, self.device)
        self.bytes_per_block = kv_bytes_per_block(model.config, block_size, self.cache_dtype,
                                                  self.groups.layers_per_group)
        # the distinct (key, value) pairs, and per layer the pair it uses
        self.kv_pairs = _allocate_caches(model.config, self.groups.layers_per_group, num_kv_blocks, block_size,
                                         self.cache_dtype, self.device, False, self.bytes_per_block, "num_kv_blocks",
                                         tiled_kv_cache)
        self.kv_caches = [self.kv_pairs[pair] for pair in self.groups.layer_pair]
        self.swap_kv_pairs = _allocate_caches(model.config, self.groups.layers_per_group, num_swap_blocks,
                                              block_size, self.cache_dtype, torch.device("cpu"),
                                              self.device.type == "cuda", self.bytes_per_block,
                                              "num_swap_blocks", tiled_kv_cache) if num_swap_blocks else []
        # (k_scale, v_scale) per layer, float32 [1] on the device: fp8 caches only.
        fp8 = KV_CACHE_DTYPES[kv_cache_dtype] is not None
        self.kv_scales = [(torch.ones(1, device=self.device), torch.ones(1, device=self.device))
                          for _ in range(model.config.num_layers)] if fp8 else None
        self.calibrate_pending = calibrate_kv_scales  # until calibrate_kv_scales has run (LLM refuses it without fp8)
        # Shared blocks: on the CPU the attention op finds them itself; on CUDA a decode step passes a plan per
        # KV-cache group (from the host-side tables: metadata.paged_metadata). PAGED_ATTN_NO_SHARED_BLOCKS set:
        # neither.
        self.plan_shared_blocks = self.device.type == "cuda"

    def run(self, step: ScheduledStep) -> torch.Tensor:
        """Apply the step's cache operations, then run its forward pass (which writes the KV of its tokens).
        Return float32 logits ``[num_sampling_seqs, vocab_size]``: one row per sequence whose last token was
        computed, in the step's order."""
        self.swap(step.blocks_to_swap_in, swap_in=True)
        self.swap(step.blocks_to_swap_out, swap_in=False)
        if step.blocks_to_copy:  # (a latent cache is one tensor per layer: no value caches)
            ops.copy_blocks([pair[0] for pair in self.kv_pairs], [pair[1] for pair in self.kv_pairs if len(pair) > 1],
                            step.blocks_to_copy)
        return self.model.forward(self.prepare(step), self.kv_caches, self.kv_scales, elementwise=self.elementwise)

    def calibrate_kv_scales(self, prompts: list[list[int]]) -> None:
        """Set every layer's fp8 scales from ``prompts`` (the first ``generate`` call's, in order: as many as fit
        KV_CALIBRATION_TOKENS in all, at least the first), before any step of theirs runs; then no longer pending.

        NOTE: calibrating on the first real step would see only what that step holds (one token at a token budget
        of 1, the first chunk of a long prompt) and, for a prompt computed in chunks, would have written the earlier
        chunks' KV with provisional scales. Instead a calibration pass runs first: one forward pass over the whole
        prompts, from token 0, in the model's dtype, into a scratch cache of the model's dtype, collecting amax(|k|)
        and amax(|v|) per layer; nothing reaches the real cache. Every prompt is computed whole in this one pass,
        so each layer's keys and values are exactly those of an unchunked prefill, and the scales do not depend
        on the token budget, the pool or preemption. The scratch cache holds one layer (the pass writes a layer's
        keys and values and attends over them before the next layer's overwrite them), so it costs
        ``tokens * num_kv_heads * head_dim * 2`` elements. The pass costs about one more prefill of those prompts,
        once per engine. The scales come from keys and values computed without fp8 rounding in earlier layers
        (calibrating in the real step saw layer i's input perturbed by layers < i's fp8 cache). Accuracy figures:
        bench/RESULTS.md, "fp8 KV cache in the engine: accuracy against the float32 cache".

        The scales change only once the pass has completed, all together; an exception during the pass leaves
        them as they were. (``LLM.generate`` also undoes a calibration whose call fails: see ``reset_kv_scales``.)
        """
        if not self.calibrate_pending or not prompts:
            return
        chosen, num_tokens = [], 0
        for prompt in prompts:
            if chosen and num_tokens + len(prompt) > KV_CALIBRATION_TOKENS:
                break
            chosen.append(prompt)
            num_tokens += len(prompt)
        step, num_blocks = ScheduledStep(), 0
        for prompt in chosen:
            blocks = -(-len(prompt) // self.block_size)
            step.seqs.append(Sequence(list(prompt), len(prompt)))
            step.num_new_tokens.append(len(prompt))
            step.block_tables.append([list(range(num_blocks, num_blocks + blocks))] * self.groups.num_groups)
            step.reserved_slots.append(None)
            num_blocks += blocks
        cfg = self.model.config
        scratch = tuple(torch.empty((num_blocks,) + shape, dtype=self.model.dtype, device=self.device)
                        for shape in kv_cache_shapes(cfg, self.block_size))
        amax: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.model.forward(self.prepare(step), [scratch] * cfg.num_layers, None, kv_amax=amax,
                           elementwise=self.elementwise)
        fp8_max = torch.finfo(self.cache_dtype).max
        scales = [(_calibrated_scale(k, fp8_max), _calibrated_scale(v, fp8_max)) for k, v in amax]
        for (k_scale, v_scale), (k, v) in zip(self.kv_scales, scales):
            k_scale.fill_(k)
            v_scale.fill_(v)
        self.calibrate_pending = False

    def reset_kv_scales(self) -> None:
        """Back to scales 1.0, calibration pending again (after the call that calibrated them failed)."""
        for k_scale, v_scale in self.kv_scales:
            k_scale.fill_(1.0)
            v_scale.fill_(1.0)
        self.calibrate_pending = True

    def swap(self, mapping: list[tuple[int, int]], swap_in: bool) -> None:
        """Copy blocks between the pools: ``(swap_block, kv_block)`` pairs in, ``(kv_block, swap_block)`` out."""
        if not mapping:
            return
        for kv_pair, swap_pair in zip(self.kv_pairs, self.swap_kv_pairs):
            for kv_tensor, swap_tensor in zip(kv_pair, swap_pair):
                src, dst = (swap_tensor, kv_tensor) if swap_in else (kv_tensor, swap_tensor)
                ops.swap_blocks(src, dst, mapping)

    def prepare(self, step: ScheduledStep) -> Batch:
        """The step's tensors on the device: sequence ``s`` computes its tokens ``[num_computed_tokens,
        + num_new_tokens)`` and attends over all its tokens up to each one, in every KV-cache group through the
        group's block table (the paged metadata: ``metadata.paged_metadata``, built once here)."""
        input_ids, positions, logits_indices = [], [], []
        num_tokens = 0
        for seq, num_new_tokens in zip(step.seqs, step.num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new_tokens
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            num_tokens += num_new_tokens
            if end == len(seq.token_ids):  # its last token: the logits of the next one
                logits_indices.append(num_tokens - 1)
        config = self.model.config
        paged = paged_metadata(step.block_tables, [seq.num_computed_tokens for seq in step.seqs],
                               step.num_new_tokens, step.reserved_slots, self.block_size, self.groups.num_groups,
                               config.num_heads // config.num_kv_heads if self.plan_shared_blocks else None)

        def on_device(tensor):
            return tensor.to(self.device, non_blocking=True)

        return Batch(
            input_ids=on_device(torch.tensor(input_ids, dtype=torch.int64)),
            positions=on_device(torch.tensor(positions, dtype=torch.int64)),
            slot_mapping=on_device(paged.slot_mapping),
            block_tables=on_device(paged.block_tables),
            layer_groups=self.groups.layer_group,
            seq_lens=on_device(paged.seq_lens),
            query_start_loc=on_device(paged.query_start_loc),
            max_query_len=paged.max_query_len,
            logits_indices=on_device(torch.tensor(logits_indices, dtype=torch.int64)),
            shared_plans=None if paged.shared_plans is None else tuple(map(on_device, paged.shared_plans)),
        )


def _calibrated_scale(amax: torch.Tensor, fp8_max: float) -> float:
    """amax * KV_SCALE_MARGIN / the format's largest finite value; 1.0 when amax is 0 or not finite."""
    amax = float(amax)
    return amax * KV_SCALE_MARGIN / fp8_max if math.isfinite(amax) and amax > 0 else 1.0


def kv_cache_shapes(config: ModelConfig, block_size: int, tiled: bool = False) -> tuple[tuple[int, ...], ...]:
    """The shapes of one layer's cache tensors, less the leading ``num_blocks``: keys and values ``[block_size,
    num_kv_heads, head_dim]`` (tiled: the tiled layout's, ``paged_attn/tiled_cache.py``; as many elements), or for
    latent attention (MLA) one latent cache ``[block_size, kv_lora_rank + qk_rope_head_dim]``."""
    if config.mla is not None:
        return ((block_size, config.mla.latent_dim),)
    if tiled:
        key_shape, value_shape = tiled_cache_shapes(1, block_size, config.num_kv_heads, config.head_dim)
        return key_shape[1:], value_shape[1:]
    return ((block_size, config.num_kv_heads, config.head_dim),) * 2


def check_tiled_kv_cache(config: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
    """ValueError unless this engine's KV cache can take the tiled layout (``LLM(tiled_kv_cache=True)``)."""
    if device.type != "cpu" or config.mla is not None or dtype not in TILED_DTYPES:
        raise ValueError(f"tiled_kv_cache needs the CPU, keys and values (not MLA's latent cache) and a bfloat16 or "
                         f"fp8 cache, got {device.type}, {'MLA' if config.mla is not None else 'keys and values'}, "
                         f"{dtype}")
    tiled_cache_shapes(1, block_size, config.num_kv_heads, config.head_dim)  # block_size % 16, head_dim % 32


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype,
                       num_layers: Optional[int] = None) -> int:
    """Bytes of one KV block: the cache tensors' rows of block_size tokens, in ``num_layers`` layers (default: every
    layer; with KV-cache groups, a group's)."""
    return (num_layers or config.num_layers) * sum(math.prod(shape) for shape in kv_cache_shapes(config, block_size)) \
        * torch.empty((), dtype=dtype).element_size()


def mha_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """What one token's keys and values would take in every layer without latent attention: per head a key of
    head_dim and a value of v_head_dim (MLA), or as stored (MHA, GQA)."""
    if config.mla is None:
        return kv_bytes_per_block(config, 1, dtype)
    per_head = config.head_dim + config.mla.v_head_dim
    return config.num_layers * config.num_heads * per_head * torch.empty((), dtype=dtype).element_size()


def _allocate_caches(config: ModelConfig, num_pairs: int, num_blocks: int, block_size: int, dtype: torch.dtype,
                     device: torch.device, pin_memory: bool, bytes_per_block: int, name: str, tiled: bool):
    """``num_pairs`` tuples of one layer's cache tensors (``kv_cache_shapes``: (key_cache, value_cache), or
    (latent_cache,)); a pool that cannot be allocated raises ValueError at once."""
    total = num_blocks * bytes_per_block
    too_big = f"{name}={num_blocks} blocks of {bytes_per_block} bytes ({total / 2**30:.2f} GiB of KV cache)"
    if device.type == "cpu" and not pin_memory:  # untouched pages would be granted lazily and fail much later
        available = _available_cpu_memory()
        if available is not None and total > available:
            raise ValueError(f"{too_big} do not fit the {available / 2**30:.2f} GiB of memory available on the "
                             f"CPU; lower {name} or kv_cache_memory")
    try:
        return [tuple(torch.empty((num_blocks,) + shape, dtype=dtype, device=device, pin_memory=pin_memory)
                      for shape in kv_cache_shapes(config, block_size, tiled))
                for _ in range(num_pairs)]
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
