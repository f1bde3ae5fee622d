"""Exception safety of the engine: whatever fails inside ``generate``, and wherever, the engine ends clean.

An exception (KeyboardInterrupt, an error in the forward pass, the sampler, a cache op, the block manager) is
injected at chosen calls of each point where a step can fail: a step computing prompt tokens, a step decoding, one
whose decode fills a block, half-way through the forward pass (some layers' KV written, not the others), the
sampler, a swap out or in, a copy-on-write, a fork of samples or beams, and running out of blocks. After each, the
engine must hold no request and no block, its prefix cache must hold no block whose KV was not written (the cache
starts as NaN, so an unwritten block shows), and its next ``generate`` must give exactly what a fresh engine gives.

The configurations cover prefix caching, swapping and recomputation, with and without chunked prefill. The model is
a small random Llama built in place (conftest's ``tiny_model``), on the CPU.
"""

import random
import threading
from contextlib import contextmanager

import pytest
import torch

from paged_attn import OutOfBlocksError, ops
from paged_attn.engine import LLM, SamplingParams
from paged_attn.engine import output_processor as output_processor_module

BLOCK_SIZE = 4


class Injected(RuntimeError):
    pass


# Six requests sharing a 13-token prefix (3 full blocks of 4): greedy, seeded sampling with n=2 (forks and
# copy-on-write), beam search (forks every step), a stop token.
PREFIX = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]
PROMPTS = [PREFIX + tail for tail in ([30], [31, 32, 33, 34, 35], [36, 37], [38] * 9, [40, 41, 42], [43])]
PARAMS = [SamplingParams(max_tokens=9, ignore_eos=True),
          SamplingParams(max_tokens=8, n=2, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True),
          SamplingParams(max_tokens=7, beam_width=2, ignore_eos=True),
          SamplingParams(max_tokens=10),
          SamplingParams(max_tokens=6, n=2, temperature=0.7, seed=4),
          SamplingParams(max_tokens=8, stop_token_ids=[5, 9])]

CONFIGS = {
    "plain": dict(num_kv_blocks=64),
    "prefix": dict(num_kv_blocks=64, enable_prefix_caching=True),
    "prefix+swap": dict(num_kv_blocks=22, num_swap_blocks=32, enable_prefix_caching=True, admission_headroom=0),
    "prefix+recompute": dict(num_kv_blocks=22, enable_prefix_caching=True, admission_headroom=0),
    # chunked prefill: prompts of 14 to 22 tokens computed 10 tokens a step (decodes included)
    "chunked+prefix+swap": dict(num_kv_blocks=22, num_swap_blocks=32, enable_prefix_caching=True,
                                admission_headroom=0, max_num_batched_tokens=10, max_num_seqs=10),
    "chunked+prefix+recompute": dict(num_kv_blocks=22, enable_prefix_caching=True, admission_headroom=0,
                                     max_num_batched_tokens=10, max_num_seqs=10),
}


def make_llm(model, config):
    llm = LLM(model, block_size=BLOCK_SIZE, **config)
    for key_cache, value_cache in llm.runner.kv_caches:  # unwritten KV reads as NaN
        key_cache.fill_(float("nan"))
        value_cache.fill_(float("nan"))
    return llm


def generate(llm):
    return [[c.token_ids for c in output.outputs] for output in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


@pytest.fixture(scope="module")
def expected(model):
    """What a fresh engine gives, per configuration (and that the tight pools really preempt)."""
    results = {}
    for name, config in CONFIGS.items():
        llm = make_llm(model, config)
        results[name] = generate(llm)
        stats = llm.stats()
        assert (stats.num_preemptions > 0) == (config["num_kv_blocks"] < 64), name
        assert (stats.num_swapped_out > 0) == ("num_swap_blocks" in config), name
        if "max_num_batched_tokens" in config:
            assert stats.num_mixed_steps > 0, name  # prompt chunks next to decodes
    assert len({str(r) for r in results.values()}) == 1  # paging policy never changes a token
    return results


# ---- injection points: each wraps a call and raises at its k-th matching call ----

class Point:
    def __init__(self, llm, name):
        self.llm, self.name, self.calls, self.fire_at, self.fired = llm, name, 0, None, False

    def hit(self, error):
        """Count a matching call; raise ``error`` if it is the chosen one."""
        self.calls += 1
        if self.calls == self.fire_at:
            self.fired = True
            raise error


def query_lens(batch):
    return batch.query_start_loc[1:] - batch.query_start_loc[:-1]


def computes_a_prompt(batch, kv_caches, *scales):  # (a prompt, a chunk of one or a recomputation)
    return bool((query_lens(batch) > 1).any())


def decodes(batch, kv_caches, *scales):
    return bool((query_lens(batch) == 1).any())


def is_decode_filling_a_block(batch, kv_caches, *scales):
    return bool(((query_lens(batch) == 1) & (batch.seq_lens % BLOCK_SIZE == 0)).any())


# name -> (where: (object, attribute) of the engine to patch, which calls count, what is raised)
def points(llm):
    scheduler, model = llm.scheduler, llm.model
    cpu_caches = {t.data_ptr() for pair in llm.runner.swap_kv_pairs for t in pair}
    return {
        "prefill": ((model, "forward"), computes_a_prompt, KeyboardInterrupt()),
        "decode": ((model, "forward"), decodes, Injected("decode")),
        "block_fill": ((model, "forward"), is_decode_filling_a_block, Injected("a decode step that fills a block")),
        # raised after the call: a layer's KV is written, the next layers' are not
        "mid_forward": ((ops, "reshape_and_cache"), None, KeyboardInterrupt()),
        "sampler": ((output_processor_module, "sample"), lambda *args: True, Injected("sampler")),
        "swap_out": ((ops, "swap_blocks"), lambda src, dst, mapping: dst.data_ptr() in cpu_caches, Injected("out")),
        "swap_in": ((ops, "swap_blocks"), lambda src, dst, mapping: src.data_ptr() in cpu_caches, Injected("in")),
        "copy_on_write": ((ops, "copy_blocks"), lambda *args: True, Injected("copy_on_write")),
        "fork": ((scheduler, "fork"), lambda *args: True, Injected("fork")),
        "out_of_blocks": ((scheduler.block_manager, "append_slots"), lambda *args: True, OutOfBlocksError("injected")),
    }


POINTS = ["prefill", "decode", "block_fill", "mid_forward", "sampler", "swap_out", "swap_in", "copy_on_write",
          "fork", "out_of_blocks"]


@contextmanager
def inject(monkeypatch, llm, name, fire_at=None):
    """Patch the engine at point ``name``; with ``fire_at``, raise its error at that matching call. Yields the
    Point, whose ``calls`` counts the matching calls."""
    point = Point(llm, name)
    point.fire_at = fire_at
    (owner, attribute), matches, error = points(llm)[name]
    call = getattr(owner, attribute)

    def patched(*args, **kwargs):
        if matches is None:  # raise after the call
            result = call(*args, **kwargs)
            point.hit(error)
            return result
        if matches(*args):
            point.hit(error)
        return call(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(owner, attribute, patched)
        yield point


def assert_clean(llm):
    scheduler = llm.scheduler
    manager = scheduler.block_manager
    assert not scheduler.waiting and not scheduler.running and not scheduler.swapped
    assert not manager.seqs
    assert manager.num_free_blocks == manager.num_kv_blocks
    assert manager.num_free_swap_blocks == manager.num_swap_blocks
    assert llm.stats().kv_blocks_used == 0
    for block_id in manager.prefix_cache.hash_to_block_id.values():  # every cached block holds written KV in every layer
        for key_cache, value_cache in llm.runner.kv_caches:
            assert torch.isfinite(key_cache[block_id]).all() and torch.isfinite(value_cache[block_id]).all(), block_id


@pytest.mark.parametrize("config_name", list(CONFIGS))
@pytest.mark.parametrize("point", POINTS)
def test_generate_recovers_from_an_exception_anywhere(model, expected, monkeypatch, config_name, point):
    config = CONFIGS[config_name]
    probe = make_llm(model, config)
    with inject(monkeypatch, probe, point) as counter:
        assert generate(probe) == expected[config_name]
    if counter.calls == 0:  # e.g. no swapping without CPU blocks
        assert point in ("swap_out", "swap_in") and "num_swap_blocks" not in config
        return
    # the first call, the last and one at random (seeded by the case)
    rng = random.Random(f"{config_name}/{point}")
    for fire_at in sorted({1, counter.calls, rng.randint(1, counter.calls)}):
        llm = make_llm(model, config)
        with inject(monkeypatch, llm, point, fire_at) as injected:
            with pytest.raises(type(points(llm)[point][2])):
                generate(llm)
        assert injected.fired, (point, fire_at)
        assert_clean(llm)
        assert generate(llm) == expected[config_name], (point, fire_at)
        assert_clean(llm)


def test_prefix_cache_survives_an_interrupted_prefill(model, expected, monkeypatch):
    """The reported case: a prompt interrupted inside its prefill, then asked again, must not hit unwritten KV."""
    llm = make_llm(model, CONFIGS["prefix"])
    with inject(monkeypatch, llm, "mid_forward", fire_at=1), pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[:1], PARAMS[:1], use_tqdm=False)
    assert not llm.scheduler.block_manager.prefix_cache.hash_to_block_id
    assert llm.generate(PROMPTS[:1], PARAMS[:1], use_tqdm=False)[0].outputs[0].token_ids == expected["plain"][0][0]
    assert llm.stats().prefix_cache_hit_tokens == 0
    again = llm.generate(PROMPTS[:1], PARAMS[:1], use_tqdm=False)  # now written: hit, and the same tokens
    assert again[0].outputs[0].token_ids == expected["plain"][0][0]
    assert llm.stats().prefix_cache_hit_tokens == 12


def test_concurrent_generate_calls_run_one_after_another(model, expected):
    llm = make_llm(model, CONFIGS["prefix"])
    results, errors = {}, []

    def run(index):
        try:
            results[index] = generate(llm)
        except BaseException as error:  # noqa: BLE001 (reported below)
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert [results[i] for i in range(3)] == [expected["prefix"]] * 3
    assert_clean(llm)


# ---- what else "as if the call had never been made" covers: the engine's generator, request ids, fp8 scales ----

UNSEEDED = [SamplingParams(max_tokens=6, n=2, temperature=1.0, ignore_eos=True),
            SamplingParams(max_tokens=5, temperature=0.8, top_k=20, ignore_eos=True)]


def outputs_of(results):
    return [[(c.token_ids, c.cumulative_logprob) for c in output.outputs] for output in results]


@pytest.mark.parametrize("point, fire_at", [("sampler", 3), ("decode", 2), ("mid_forward", 5)])
def test_an_interrupted_call_leaves_the_engines_generator_as_it_was(model, monkeypatch, point, fire_at):
    """Unseeded requests draw from the engine's generator (LLM(seed=...)): a failed call must not have advanced it,
    nor used up request ids, so the next call samples and numbers exactly what a fresh engine's would."""
    fresh = make_llm(model, CONFIGS["plain"])
    expected = fresh.generate(PROMPTS[:2], UNSEEDED, use_tqdm=False)
    llm = make_llm(model, CONFIGS["plain"])
    with inject(monkeypatch, llm, point, fire_at) as injected, pytest.raises(type(points(llm)[point][2])):
        llm.generate(PROMPTS[:2], UNSEEDED, use_tqdm=False)
    assert injected.fired
    got = llm.generate(PROMPTS[:2], UNSEEDED, use_tqdm=False)
    assert outputs_of(got) == outputs_of(expected)
    assert [o.request_id for o in got] == [o.request_id for o in expected]


FP8_CONFIGS = {
    "fp8": dict(num_kv_blocks=64, enable_prefix_caching=True, kv_cache_dtype="fp8_e4m3", calibrate_kv_scales=True),
    "fp8+chunked": dict(num_kv_blocks=64, enable_prefix_caching=True, kv_cache_dtype="fp8_e4m3",
                        calibrate_kv_scales=True, max_num_batched_tokens=10, max_num_seqs=10),
}


def kv_scales(llm):
    return [(k.item(), v.item()) for k, v in llm.runner.kv_scales]


# (a forward pass computing prompt tokens: the first, the second; a layer's cache write: the first, the third; the
# first decode step; the first sampling)
@pytest.mark.parametrize("point, fire_at", [("prefill", 1), ("prefill", 2), ("mid_forward", 1), ("mid_forward", 3),
                                            ("decode", 1), ("sampler", 1)])
@pytest.mark.parametrize("config_name", list(FP8_CONFIGS))
def test_an_interrupted_call_leaves_fp8_calibration_to_the_next_call(model, monkeypatch, config_name, point,
                                                                     fire_at):
    """The call that calibrates the fp8 scales either completes, and fixes them, or fails and leaves the engine
    uncalibrated (scales 1.0, no prefix-cache entry written with its scales): the next call, on other prompts,
    calibrates from its own prompts and gives exactly what a fresh engine gives."""
    config = FP8_CONFIGS[config_name]
    first, then = (PROMPTS[:3], PARAMS[:3]), (PROMPTS[3:], PARAMS[3:])
    fresh = make_llm(model, config)
    expected = fresh.generate(*then, use_tqdm=False)
    assert all(scales != (1.0, 1.0) for scales in kv_scales(fresh))
    llm = make_llm(model, config)
    with inject(monkeypatch, llm, point, fire_at) as injected, pytest.raises(type(points(llm)[point][2])):
        llm.generate(*first, use_tqdm=False)
    assert injected.fired
    assert kv_scales(llm) == [(1.0, 1.0)] * model.config.num_layers
    assert not llm.scheduler.block_manager.prefix_cache.hash_to_block_id
    got = llm.generate(*then, use_tqdm=False)
    assert kv_scales(llm) == kv_scales(fresh)
    assert outputs_of(got) == outputs_of(expected)
