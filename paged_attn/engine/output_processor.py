"""Output processing: turn a step's logits into tokens (sampling or a beam-search step), decide when each
sequence ends (a stop token, a stop string: ``stop_strings``, or its length), and build the ``RequestOutput`` of
each finished request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from . import sampling
from .sampling import SamplingParams, sample
from .stop_strings import completes_stop, cut_at_stop
from .scheduler import Scheduler
from .step import ScheduledStep
from .sequence import Request, Sequence
from .stats import StatsCollector


@dataclass
class CompletionOutput:
    index: int
    text: Optional[str]  # None without a tokenizer; cut at a stop string (SamplingParams.stop)
    token_ids: list[int]  # ends with the EOS / stop token, or the token that completed a stop string
    cumulative_logprob: float  # sum of the model's log-probabilities of the tokens (temperature 1, unfiltered)
    finish_reason: str  # "stop" (EOS, a stop token or a stop string) or "length"
    stop_reason: Union[int, str, None] = None  # the stop token id or stop string; None for EOS and length


@dataclass
class RequestOutput:
    request_id: int
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # best first (beam score, else cumulative log-probability)


class OutputProcessor:
    """Extends the sequences of a step's sampling requests by one token each (forking the ``n`` samples from the
    prompt's sequence, or the next beams from their parents, through the scheduler's blocks), frees the sequences
    that end and counts the tokens it samples in ``stats``."""

    def __init__(self, scheduler: Scheduler, stats: StatsCollector, eos_token_id: Optional[int], max_model_len: int,
                 tokenizer=None):
        self.scheduler, self.stats = scheduler, stats
        self.eos_token_id, self.max_model_len = eos_token_id, max_model_len
        self.tokenizer = tokenizer  # for stop strings

    def process(self, step: ScheduledStep, logits: torch.Tensor) -> list[Request]:
        """Sample for the step's sampling requests from their float32 ``logits [num_sampling_seqs, vocab_size]``
        (rows in the step's order); return the requests that finished."""
        logprobs, greedy_ids, greedy_logprobs = sampling.greedy_logprobs(logits)
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
                self._set_stop_reason(seq, params)
                self.scheduler.free(seq)
                request.finished.append(seq)
        self.stats.record_generated(len(token_ids))
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
            can_finish, can_continue = rank < width and not was_full, len(candidates) < width
            if not (can_finish or can_continue):  # (no use for it either way: no detokenizing for stop strings)
                continue
            parent, token_id = beams[index // vocab_size], index % vocab_size
            token_ids = parent.token_ids + [token_id]
            stop_string = params.stop and completes_stop(self.tokenizer, token_ids[parent.num_prompt_tokens:],
                                                         params.stop)
            if token_id in stop_ids or stop_string or at_max_length:
                if can_finish:
                    finished = Sequence(token_ids, parent.num_prompt_tokens, score, score=score / length,
                                        finish_reason="stop" if token_id in stop_ids or stop_string else "length")
                    self._set_stop_reason(finished, params)
                    request.finished.append(finished)
            else:
                candidates.append((parent, Sequence(token_ids, parent.num_prompt_tokens, score)))
        request.finished = sorted(request.finished, key=lambda seq: seq.score, reverse=True)[:width]
        done = len(request.finished) >= width or at_max_length or not candidates
        for parent, child in [] if done else candidates:
            self.scheduler.fork(parent, child)
        for seq in beams:
            self.scheduler.free(seq)
        self.stats.record_generated(len(beams))
        request.forked = True
        request.seqs = [] if done else [child for _, child in candidates]

    def _stop_ids(self, params: SamplingParams) -> set[int]:
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos and self.eos_token_id is not None:
            stop_ids.add(self.eos_token_id)
        return stop_ids

    def _finish_reason(self, seq: Sequence, params: SamplingParams) -> Optional[str]:
        if seq.token_ids[-1] in self._stop_ids(params):
            return "stop"
        if params.stop and completes_stop(self.tokenizer, seq.output_token_ids, params.stop):
            return "stop"
        if len(seq.output_token_ids) >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    def _set_stop_reason(self, seq: Sequence, params: SamplingParams) -> None:
        """A finished sequence's stop_reason (the stop token id, or the stop string with its text cut there)."""
        if seq.finish_reason != "stop":
            return
        if seq.token_ids[-1] in params.stop_token_ids:
            seq.stop_reason = seq.token_ids[-1]
        elif params.stop and seq.token_ids[-1] not in self._stop_ids(params):
            cut = cut_at_stop(self.tokenizer, seq.output_token_ids, params.stop, params.include_stop_str_in_output)
            if cut is not None:
                seq.stop_reason, seq.text = cut


def request_output(request: Request, tokenizer) -> RequestOutput:
    """The finished request's completions, best first, decoded by ``tokenizer`` when there is one."""
    if request.params.beam_width > 1:
        ranked = request.finished  # sorted by beam score
    else:
        ranked = sorted(request.finished, key=lambda seq: seq.cumulative_logprob, reverse=True)
    completions = [
        CompletionOutput(index, seq.text if seq.text is not None else
                         tokenizer.decode(seq.output_token_ids) if tokenizer else None,
                         seq.output_token_ids, seq.cumulative_logprob, seq.finish_reason, seq.stop_reason)
        for index, seq in enumerate(ranked)
    ]
    return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions)
