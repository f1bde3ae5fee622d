"""The serving engine on every device, on a small randomly initialized transformers Llama (nothing downloaded).

This is how the engine's CUDA path (paged_attention, reshape_and_cache, copy_blocks and swap_blocks on the GPU,
with the model's forward around them) is checked on a GPU machine without the GGUF model package. Greedy tokens
are checked against transformers by teacher forcing: feeding the prompt and our tokens to transformers' forward,
each of our tokens must be its argmax up to a small tolerance (random weights make near-ties likely, so an exact
token-for-token comparison would test rounding, not the engine).
"""

import importlib.util

import pytest
import torch

from conftest import DEVICES

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="needs transformers (pip install -r requirements-dev.txt)")

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def hf_model():
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.2,
        tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(1234)
    return transformers.LlamaForCausalLM(config).to(torch.float32).eval()


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (3, 17, 40, 29, 64, 9)]


def assert_greedy(hf_model, device, prompt, tokens, atol=1e-3):
    """Every token of ours is transformers' argmax (within atol) given the prompt and our earlier tokens."""
    assert len(tokens) == MAX_TOKENS
    ids = torch.tensor([prompt + tokens], device=device)
    with torch.inference_mode():
        logits = hf_model(ids).logits[0, len(prompt) - 1:-1].float()  # the logits that chose each of our tokens
    chosen = logits.gather(-1, torch.tensor(tokens, device=device)[:, None]).squeeze(-1)
    gap = logits.max(-1).values - chosen
    assert gap.max().item() <= atol, f"token {gap.argmax().item()} is {gap.max().item():.3g} below the argmax"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", [
    dict(num_kv_blocks=256),  # (by default a CUDA engine takes half the GPU's free memory)
    # (admission_headroom=0: admit whenever a prompt fits, so that the small pool overflows)
    dict(block_size=8, num_kv_blocks=14, num_swap_blocks=32, admission_headroom=0),  # preemption by swapping
    dict(block_size=8, num_kv_blocks=14, admission_headroom=0),  # preemption by recomputation
], ids=["default", "swap", "recompute"])
def test_engine_greedy_matches_transformers(hf_model, prompts, device, config):
    from paged_attn.engine import LLM, SamplingParams

    model = hf_model.to(device)
    llm = LLM(model, device=device, dtype=torch.float32, **config)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert_greedy(model, device, prompt, output.outputs[0].token_ids)
    stats = llm.stats()
    if config.get("block_size"):
        assert stats.num_preemptions > 0
        assert (stats.num_swapped_out if config.get("num_swap_blocks") else stats.num_recomputed) > 0
    assert stats.kv_blocks_used == 0 and not llm.scheduler.block_manager.seqs


@pytest.mark.parametrize("device", DEVICES)
def test_engine_parallel_sampling_copies_on_write(hf_model, prompts, device):
    """n samples share the prompt's blocks and copy the shared partial block (copy_blocks) when they diverge. Each
    sample's log-probability, computed by the engine from its own KV, must equal transformers' by teacher forcing."""
    from paged_attn.engine import LLM, SamplingParams

    model = hf_model.to(device)
    llm = LLM(model, device=device, dtype=torch.float32, block_size=8, num_kv_blocks=64)
    prompt = prompts[2][:-3]  # 37 tokens: 4 full blocks of 8 shared, and a partial one copied on write
    output = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, n=3, temperature=1.0, seed=7,
                                                   ignore_eos=True), use_tqdm=False)[0]
    assert llm.stats().peak_blocks_saved_by_sharing >= 2 * (len(prompt) // 8)
    samples = [c.token_ids for c in output.outputs]
    assert len({tuple(s) for s in samples}) == 3, "the samples must diverge for copy-on-write to matter"
    for completion in output.outputs:
        ids = torch.tensor([prompt + completion.token_ids], device=device)
        with torch.inference_mode():
            logprobs = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1].double(), dim=-1)
        expected = logprobs.gather(-1, ids[0, len(prompt):, None]).sum().item()
        assert completion.cumulative_logprob == pytest.approx(expected, abs=1e-3)
    assert llm.stats().kv_blocks_used == 0


def test_small_cpu_steps_run_elementwise_work_on_one_thread(hf_model, prompts, monkeypatch):
    """Steps of fewer than SERIAL_ELEMENTWISE_TOKENS tokens run norms, RoPE, SiLU and residual adds on one thread
    and the projections on all of torch's; larger steps run everything on all; the outputs are the same bit for bit
    (elementwise ops and row-wise reductions do not depend on the thread count) and the thread count is restored."""
    from paged_attn.engine import LLM, SamplingParams
    from paged_attn.engine import layers

    monkeypatch.setattr(torch, "set_num_threads", torch.set_num_threads)  # restored after the test
    torch.set_num_threads(2)
    model = hf_model.to("cpu")
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)

    def run(serial_below):
        monkeypatch.setattr(layers, "SERIAL_ELEMENTWISE_TOKENS", serial_below)
        llm = LLM(model, dtype=torch.float32, num_kv_blocks=256)
        steps = []  # per step: (tokens, thread counts seen by set_num_threads, thread counts of the projections)
        set_threads, linear, forward = torch.set_num_threads, llm.model._linear, llm.model.forward

        def spy_set(n):
            steps[-1][1].append(n)
            set_threads(n)

        def spy_linear(x, weight):
            steps[-1][2].append(torch.get_num_threads())
            return linear(x, weight)

        def spy_forward(batch, *args, **kwargs):
            steps.append((batch.input_ids.shape[0], [], []))
            return forward(batch, *args, **kwargs)

        monkeypatch.setattr(torch, "set_num_threads", spy_set)
        monkeypatch.setattr(llm.model, "_linear", spy_linear)
        monkeypatch.setattr(llm.model, "forward", spy_forward)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        monkeypatch.setattr(torch, "set_num_threads", set_threads)
        assert torch.get_num_threads() == 2
        return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in outputs], steps

    never, steps = run(0)
    assert all(not threads for _, threads, _ in steps)
    below_100, steps = run(100)
    assert never == below_100
    prefill, *decodes = steps
    assert prefill[0] == sum(map(len, prompts)) >= 100 and not prefill[1]
    for num_tokens, threads, projection_threads in decodes:
        assert num_tokens <= len(prompts) and set(threads) == {1, 2} and threads.count(1) == threads.count(2)
        assert projection_threads and set(projection_threads) == {2}
