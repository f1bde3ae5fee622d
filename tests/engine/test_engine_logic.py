"""The engine's own logic on a small random model (conftest's ``tiny_model``, nothing loaded): what ``LLM`` and
``generate`` accept and refuse, and beam search's ranking of finished hypotheses on scripted logits."""

import dataclasses
import math
import time

import numpy as np
import pytest
import torch

from paged_attn.engine import LLM, SamplingParams


@pytest.fixture
def llm(tiny_model):
    return LLM(tiny_model, block_size=4, num_kv_blocks=64)


def token_ids(outputs):
    return [[c.token_ids for c in output.outputs] for output in outputs]


# ---- the constructor ----

@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, torch.float8_e4m3fn, "float32"])
def test_unsupported_dtypes_are_refused_at_construction(tiny_model, dtype):
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16"):
        LLM(tiny_model, dtype=dtype, num_kv_blocks=8)


def test_float16_is_refused_where_this_cpu_cannot_multiply_it(tiny_model, monkeypatch):
    """Where the CPU's matmul path lacks float16, the constructor says so and names what works, instead of failing
    inside the first generate. Simulated by making the probe fail for float16 (whatever this CPU can do)."""
    from paged_attn.engine.model import LlamaModel

    linear = LlamaModel._linear

    def no_half(x, weight):
        if x.dtype == torch.float16:
            raise RuntimeError("fp16 path needs the cpu support avx_ne_convert or avx512_fp16")
        return linear(x, weight)

    monkeypatch.setattr(LlamaModel, "_linear", staticmethod(no_half))
    with pytest.raises(ValueError, match=r"float16 is not supported on cpu.*supported here: float32, bfloat16"):
        LLM(tiny_model, dtype=torch.float16, num_kv_blocks=8)


@pytest.mark.parametrize("device", ["meta", "foo", "cuda:x", 3.5])
def test_unsupported_devices_are_refused(tiny_model, device):
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda"):
        LLM(tiny_model, device=device, num_kv_blocks=8)


def test_kv_reservation_none_is_a_deprecated_spelling_of_paged(tiny_model):
    prompts, params = [[1, 2, 3, 4, 5], [6, 7, 8]], SamplingParams(max_tokens=6, n=2, temperature=1.0, seed=3)
    paged = LLM(tiny_model, block_size=4, num_kv_blocks=64, kv_reservation="paged")
    with pytest.warns(DeprecationWarning, match='"paged"'):
        none = LLM(tiny_model, block_size=4, num_kv_blocks=64, kv_reservation="none")
    assert none.scheduler.reservation.policy == "paged"
    assert token_ids(none.generate(prompts, params, use_tqdm=False)) == \
        token_ids(paged.generate(prompts, params, use_tqdm=False))
    assert none.stats() == paged.stats()


@pytest.mark.parametrize("kv_cache_memory", [0, -1, float("inf"), float("nan"), "1G", True])
def test_kv_cache_memory_must_be_a_positive_finite_number(tiny_model, kv_cache_memory):
    with pytest.raises(ValueError, match="kv_cache_memory must be a positive number of bytes"):
        LLM(tiny_model, kv_cache_memory=kv_cache_memory)



def test_the_old_gpu_and_cpu_block_keywords_still_work_and_warn(tiny_model):
    """num_gpu_blocks / num_cpu_blocks: deprecated names of num_kv_blocks / num_swap_blocks (the pool is on the
    engine's device, often the CPU), still accepted, with a DeprecationWarning; so are EngineStats' old fields."""
    with pytest.warns(DeprecationWarning) as record:
        llm = LLM(tiny_model, block_size=4, num_gpu_blocks=24, num_cpu_blocks=8)
    assert sorted(str(w.message) for w in record) == ["num_cpu_blocks is deprecated; use num_swap_blocks",
                                                      "num_gpu_blocks is deprecated; use num_kv_blocks"]
    stats = llm.stats()
    assert (stats.num_kv_blocks, stats.num_swap_blocks) == (24, 8)
    for old, value in [("num_gpu_blocks", 24), ("num_cpu_blocks", 8), ("gpu_blocks_used", 0),
                       ("peak_gpu_blocks_used", 0)]:
        with pytest.warns(DeprecationWarning, match=f"{old} is deprecated"):
            assert getattr(stats, old) == value
    with pytest.raises(TypeError, match="deprecated name 'num_gpu_blocks'"):
        LLM(tiny_model, num_kv_blocks=8, num_gpu_blocks=8)


def test_an_oversized_pool_fails_fast_and_says_why(tiny_model):
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"num_kv_blocks=30000000 blocks .* GiB of KV cache"):
        LLM(tiny_model, num_kv_blocks=30_000_000)
    with pytest.raises(ValueError, match=r"num_swap_blocks=30000000 blocks"):
        LLM(tiny_model, num_kv_blocks=8, num_swap_blocks=30_000_000)
    assert time.perf_counter() - start < 5  # (was: half a minute and ~6 GB of Python lists, then an error)


# ---- prompts ----

def test_prompts_as_arrays_and_tensors_of_token_ids(llm):
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]]
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    expected = token_ids(llm.generate(prompts, params, use_tqdm=False))
    for batch in (np.array(prompts), torch.tensor(prompts), [np.array(p) for p in prompts],
                  [torch.tensor(p, dtype=torch.int32) for p in prompts], [tuple(p) for p in prompts],
                  [[np.int64(t) for t in p] for p in prompts]):
        assert token_ids(llm.generate(batch, params, use_tqdm=False)) == expected
    assert token_ids(llm.generate(np.array(prompts[0]), params, use_tqdm=False)) == expected[:1]
    assert token_ids(llm.generate(torch.tensor(prompts[1]), params, use_tqdm=False)) == expected[1:]
    assert llm.generate([], params, use_tqdm=False) == []


@pytest.mark.parametrize("prompts", [
    [1, "hi"], ["hi", 7], [[1, 2], 3], [1.0, 2.0], [[1, 2.5]], [[1, True]], [[1, None]], [["a", "b"]],
    np.array([1.0, 2.0]), torch.tensor([1.0, 2.0]), torch.tensor([True]), np.zeros((2, 2, 2), dtype=np.int64),
    {1, 2}, 7, None,
], ids=lambda prompts: " ".join(repr(prompts).split())[:40])
def test_ambiguous_prompts_are_refused(llm, prompts):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.scheduler.has_unfinished() and llm.scheduler.block_manager.num_free_blocks == 64


def test_sampling_params_must_match_the_prompts(llm):
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate([[1, 2]], [SamplingParams(), SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate([[1, 2]], {"max_tokens": 2}, use_tqdm=False)


# ---- beam search ranks finished hypotheses by log-probability / output length ----

def scripted_forward(distributions, default):
    """A stand-in for the model's forward: the next-token log-probabilities depend only on the last token."""
    def forward(batch, kv_caches, *args, **kwargs):
        last = batch.input_ids[batch.logits_indices].tolist()
        rows = [distributions.get(token, default) for token in last]
        return torch.tensor(rows, dtype=torch.float32)
    return forward


def test_beam_search_ranks_finished_hypotheses_by_output_length(llm, monkeypatch):
    """Two hypotheses end: "EOS" after 1 token (log-prob -1.0, score -1.0) and "A EOS" after 2 (log-prob -1.5,
    score -0.75). Dividing by the output length ranks "A EOS" first; dividing by prompt + output length (10 + n)
    would rank "EOS" first (-1.0 / 11 > -1.5 / 12)."""
    vocab, eos, a, b, prompt_end = llm.config.vocab_size, llm.config.eos_token_id, 1, 2, 50
    junk = -1e4  # every other token: never chosen, never ranked above a real hypothesis

    def logprobs(**probs):
        row = [junk] * vocab
        for token, p in probs.items():
            row[int(token[1:])] = math.log(p)
        return row

    p_eos_first = math.exp(-1.0)
    p_eos_after_a = math.exp(-1.5 - math.log(1 - p_eos_first))
    distributions = {prompt_end: logprobs(**{f"t{eos}": p_eos_first, f"t{a}": 1 - p_eos_first}),
                     a: logprobs(**{f"t{eos}": p_eos_after_a, f"t{b}": 1 - p_eos_after_a})}
    monkeypatch.setattr(llm.model, "forward", scripted_forward(distributions, logprobs(**{f"t{b}": 1.0})))
    prompt = list(range(41, 50)) + [prompt_end]  # 10 tokens
    output = llm.generate([prompt], SamplingParams(max_tokens=5, beam_width=2), use_tqdm=False)[0]
    finished = [(c.token_ids, round(c.cumulative_logprob, 4), c.finish_reason) for c in output.outputs]
    assert finished == [([a, eos], -1.5, "stop"), ([eos], -1.0, "stop")]
    scores = [c.cumulative_logprob / len(c.token_ids) for c in output.outputs]
    assert scores == pytest.approx([-0.75, -1.0], abs=1e-4)
    assert llm.scheduler.block_manager.num_free_blocks == 64


# ---- prefix sharing inside a burst of requests ----

def test_requests_sharing_a_prefix_with_one_being_computed_wait_one_step_and_share_it(tiny_model):
    """A block enters the prefix cache only once its KV is written, so a request whose prompt shares full blocks
    with a prompt admitted to the same step is held back one step: then it hits them instead of computing copies."""
    prefix = list(range(20, 33))  # 13 tokens: 3 full blocks of 4
    prompts = [prefix + [40 + i, 50 + i] for i in range(4)] + [[60, 61, 62, 63, 64, 65]]
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    plain = LLM(tiny_model, block_size=4, num_kv_blocks=64)
    expected = token_ids(plain.generate(prompts, params, use_tqdm=False))
    llm = LLM(tiny_model, block_size=4, num_kv_blocks=64, enable_prefix_caching=True)
    prefills = []  # per step: (request id, tokens computed) of each sequence in prefill
    schedule = llm.scheduler.schedule

    def record():
        step = schedule()
        prefilling = {seq.seq_id: request.request_id for request in llm.scheduler.running if not request.prefilled
                      for seq in request.seqs}
        prefills.append([(prefilling[seq.seq_id], num_new_tokens)
                         for seq, num_new_tokens in zip(step.seqs, step.num_new_tokens) if seq.seq_id in prefilling])
        return step

    llm.scheduler.schedule = record
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected
    # the first prompt alone; then the rest, each computing only its own 3 tokens (the unrelated one all 6)
    assert [step for step in prefills if step] == [[(0, 15)], [(1, 3), (2, 3), (3, 3), (4, 6)]]
    stats = llm.stats()
    assert stats.prefix_cache_hit_tokens == 3 * 12 and stats.peak_blocks_saved_by_sharing == 3 * 3
    assert stats.num_prefill_tokens == 15 + 3 * 3 + 6


# ---- chunked prefill ----

def test_the_token_budget_must_cover_a_decode_of_every_running_sequence(tiny_model):
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8\) must be at least max_num_seqs \(16\)"):
        LLM(tiny_model, num_kv_blocks=8, max_num_batched_tokens=8, max_num_seqs=16)


@pytest.mark.parametrize("config", [
    dict(),
    dict(enable_prefix_caching=True),
    dict(num_kv_blocks=44, num_swap_blocks=64, admission_headroom=0),
    dict(num_kv_blocks=44, admission_headroom=0),
], ids=["chunked", "chunked+prefix_caching", "chunked+swap", "chunked+recompute"])
def test_chunked_prefill_changes_no_token(tiny_model, config):
    """Prompts of up to 43 tokens computed 8 tokens a step (decodes included), with parallel sampling (which forks
    only once the prompt's last token is computed), beam search, prefix caching and preemption (the small pools
    preempt requests half-way through their prompts): the same tokens as prompts computed whole."""
    prompts = [list(range(10 + i, 50 + i)) for i in range(3)] + [list(range(60, 70)), list(range(10, 53))]
    params = [SamplingParams(max_tokens=16, n=3, temperature=1.0, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=16, beam_width=2, ignore_eos=True),
              SamplingParams(max_tokens=16, ignore_eos=True),
              SamplingParams(max_tokens=16, n=2, temperature=0.8, seed=2),
              SamplingParams(max_tokens=16, ignore_eos=True)]
    expected = token_ids(LLM(tiny_model, block_size=4, num_kv_blocks=128).generate(prompts, params, use_tqdm=False))
    llm = LLM(tiny_model, block_size=4, max_num_batched_tokens=8, max_num_seqs=8, **{"num_kv_blocks": 128, **config})
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected
    stats = llm.stats()
    assert stats.num_mixed_steps > 0
    assert stats.num_preemptions > 0 if "admission_headroom" in config else stats.num_preemptions == 0
    if config.get("enable_prefix_caching"):  # the last prompt shares 40 tokens with the first
        assert stats.prefix_cache_hit_tokens > 0
    assert llm.scheduler.block_manager.num_free_blocks == llm.scheduler.block_manager.num_kv_blocks


# ---- torch_compile ----

def test_torch_compile_runs_large_steps_compiled_with_the_same_tokens(tiny_model):
    """torch_compile=True: steps of >= 128 tokens take the compiled elementwise kernels, smaller ones stay eager,
    and greedy outputs equal the eager engine's."""
    from paged_attn.engine import LlamaModel

    prompts = [[(7 * i + 3 * j) % 100 + 1 for j in range(40 + i)] for i in range(4)]  # 166 prompt tokens
    params = SamplingParams(max_tokens=12)
    eager = LLM(LlamaModel(tiny_model.config, tiny_model.state_dict()), block_size=4, num_kv_blocks=128)
    model = LlamaModel(tiny_model.config, tiny_model.state_dict())
    compiled = LLM(model, block_size=4, num_kv_blocks=128, torch_compile=True)
    calls = []

    def counted(fn):
        def call(*args):
            calls.append(args[0].shape[0])
            return fn(*args)
        return call

    kernels = compiled.runner.elementwise
    compiled.runner.elementwise = dataclasses.replace(kernels, rms_norm=counted(kernels.rms_norm),
                                                      rope_qkv=counted(kernels.rope_qkv),
                                                      silu_mul=counted(kernels.silu_mul))
    expected, actual = eager.generate(prompts, params, use_tqdm=False), compiled.generate(prompts, params,
                                                                                          use_tqdm=False)
    assert token_ids(actual) == token_ids(expected)
    for a, e in zip(actual, expected):
        assert a.outputs[0].cumulative_logprob == pytest.approx(e.outputs[0].cumulative_logprob, abs=1e-4)
    assert calls and min(calls) >= 128, "the prefill step should run compiled, the decode steps eager"


def test_fused_elementwise_against_the_eager_ops(tiny_model, monkeypatch):
    """LlamaModel.fused_elementwise: the layers' norms and gating through the fused ops (the default) give the eager
    code's greedy tokens and log-probabilities within float32 rounding; False runs the eager ops and no fused one."""
    from paged_attn import elementwise
    from paged_attn.engine import LlamaModel
    from paged_attn.engine import model as model_module

    prompts = [[(5 * i + 2 * j) % 100 + 1 for j in range(9 + 7 * i)] for i in range(3)]
    params = SamplingParams(max_tokens=10)
    fused_model = LlamaModel(tiny_model.config, tiny_model.state_dict())
    eager_model = LlamaModel(tiny_model.config, tiny_model.state_dict())
    eager_model.fused_elementwise = False
    fused = LLM(fused_model, block_size=4, num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
    calls = []
    for name in ("rms_norm", "add_rms_norm", "silu_and_mul"):
        monkeypatch.setattr(model_module, name, lambda *a, _name=name: calls.append(_name) or
                            getattr(elementwise, _name)(*a))
    eager = LLM(eager_model, block_size=4, num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
    assert not calls
    assert token_ids(fused) == token_ids(eager)
    for f, e in zip(fused, eager):
        assert f.outputs[0].cumulative_logprob == pytest.approx(e.outputs[0].cumulative_logprob, abs=1e-4)
    LLM(fused_model, block_size=4, num_kv_blocks=64).generate(prompts[:1], params, use_tqdm=False)
    assert {"rms_norm", "add_rms_norm", "silu_and_mul"} <= set(calls)


def test_torch_compile_is_the_engines_own_not_the_shared_models(tiny_model, monkeypatch):
    """LLM(model, torch_compile=True) compiles for that engine only: another LLM on the same LlamaModel (its
    weights shared) stays eager. (torch.compile is replaced by a recorder here: nothing is compiled.)"""
    from paged_attn.engine import LlamaModel

    compiled_calls = []

    def recording_compile(fn, **kwargs):
        def call(*args):
            compiled_calls.append(fn.__name__)
            return fn(*args)
        return call

    monkeypatch.setattr(torch, "compile", recording_compile)
    prompts = [[(7 * i + 3 * j) % 100 + 1 for j in range(40 + i)] for i in range(4)]  # 166 prompt tokens
    params = SamplingParams(max_tokens=2)
    model = LlamaModel(tiny_model.config, tiny_model.state_dict())
    compiled = LLM(model, block_size=4, num_kv_blocks=128, torch_compile=True)
    eager = LLM(model, block_size=4, num_kv_blocks=128)
    assert eager.model is compiled.model is model  # shared, not copied
    expected = eager.generate(prompts, params, use_tqdm=False)
    assert compiled_calls == [], "an engine built without torch_compile ran compiled kernels"
    assert token_ids(compiled.generate(prompts, params, use_tqdm=False)) == token_ids(expected)
    assert compiled_calls, "the torch_compile engine's prefill step should run compiled"


def test_the_runners_paged_metadata_is_the_block_managers(tiny_model):
    """A step's slot mapping and block tables, as the runner builds them, are what the block manager's public
    methods give for the same sequences (one arithmetic for both): a chunked prefill and a decode next to it."""
    llm = LLM(tiny_model, block_size=4, num_kv_blocks=64, max_num_batched_tokens=12, max_num_seqs=4)
    scheduler, manager = llm.scheduler, llm.scheduler.block_manager
    for request_id, prompt in enumerate([[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]):
        scheduler.add(llm._make_request(request_id, prompt, SamplingParams(max_tokens=4)))
    try:
        for _ in range(3):
            step = scheduler.schedule()
            batch = llm.runner.prepare(step)
            expected = [slot for seq, n in zip(step.seqs, step.num_new_tokens)
                        for slot in manager.slot_mapping(seq.seq_id, seq.num_computed_tokens,
                                                         seq.num_computed_tokens + n)]
            assert batch.slot_mapping.tolist() == [expected]  # one KV-cache group
            assert torch.equal(batch.block_tables[0], manager.block_tables_tensor([seq.seq_id for seq in step.seqs]))
            assert batch.block_tables.shape[0] == 1 and batch.layer_groups == (0,) * llm.config.num_layers
            scheduler.mark_computed(step)
            llm.output_processor.process(step, torch.zeros(len(batch.logits_indices), llm.config.vocab_size))
    finally:
        scheduler.abort_all()


def test_tiled_kv_cache_gives_the_row_major_caches_tokens():
    """LLM(tiled_kv_cache=True) keeps keys and values in the tiled layout. A float32 model over an fp8 cache takes
    the unpacking path (float32 queries): the same log-probabilities as the row-major cache, bit for bit, with prefix
    caching reusing a shared prompt's blocks. A bfloat16 model decodes on the tiled kernel (its sums in another
    order): the same greedy tokens, log-probabilities within bfloat16 rounding."""
    from conftest import tiny_llama

    model = tiny_llama(head_dim=32)
    prefix = [(3 * j) % 97 + 1 for j in range(37)]
    prompts = [prefix + [(5 * i + 2 * j) % 100 + 1 for j in range(3 + 9 * i)] for i in range(3)] + [[11, 12, 13]]
    params = SamplingParams(max_tokens=12)

    def run(**kwargs):
        llm = LLM(model, block_size=16, num_kv_blocks=64, **kwargs)
        caches = llm.runner.kv_caches[0]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return outputs, caches

    tiled, (key, value) = run(kv_cache_dtype="fp8_e4m3", enable_prefix_caching=True, tiled_kv_cache=True)
    row_major, _ = run(kv_cache_dtype="fp8_e4m3", enable_prefix_caching=True)
    assert key.shape[1:] == (2, 1, 16, 16, 2) and value.shape[1:] == (2, 8, 32, 2), "the caches are not tiled"
    assert token_ids(tiled) == token_ids(row_major)
    assert [o.outputs[0].cumulative_logprob for o in tiled] == [o.outputs[0].cumulative_logprob for o in row_major]

    tiled, _ = run(dtype=torch.bfloat16, tiled_kv_cache=True)
    row_major, _ = run(dtype=torch.bfloat16)
    assert token_ids(tiled) == token_ids(row_major)
    for t, r in zip(tiled, row_major):
        assert t.outputs[0].cumulative_logprob == pytest.approx(r.outputs[0].cumulative_logprob, abs=0.05)


def test_tiled_kv_cache_refuses_what_it_cannot_tile(tiny_model):
    """A float32 cache, a block size that is not a multiple of 16 and a head_dim that is not one of 32: ValueError
    before anything runs."""
    from conftest import tiny_llama

    with pytest.raises(ValueError, match="bfloat16 or fp8"):
        LLM(tiny_llama(head_dim=32), block_size=16, num_kv_blocks=8, tiled_kv_cache=True)
    with pytest.raises(ValueError, match="multiple of 16"):
        LLM(tiny_llama(head_dim=32), block_size=8, num_kv_blocks=8, kv_cache_dtype="fp8_e4m3", tiled_kv_cache=True)
    with pytest.raises(ValueError, match="multiple of 32"):
        LLM(tiny_model, block_size=16, num_kv_blocks=8, kv_cache_dtype="fp8_e4m3", tiled_kv_cache=True)
