"""The engine with the CPU op's reading of shared blocks once (the default) and without it
(``PAGED_ATTN_NO_SHARED_BLOCKS=1``, read by the op on every call): the op gives the same bits either way, so the
same requests must give the same tokens and the same log-probabilities, to the last bit. On the small random
Llama of conftest (nothing loaded); blocks of 4 tokens, so that the samples and requests share many of them."""

import pytest
import torch

from paged_attn.engine import LLM, SamplingParams

SWITCH = "PAGED_ATTN_NO_SHARED_BLOCKS"


def generate(model, dtype, prompts, params, prefix_caching, monkeypatch, sharing):
    if sharing:
        monkeypatch.delenv(SWITCH, raising=False)
    else:
        monkeypatch.setenv(SWITCH, "1")
    llm = LLM(model, dtype=dtype, block_size=4, num_kv_blocks=256, enable_prefix_caching=prefix_caching)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.delenv(SWITCH, raising=False)
    completions = [(c.token_ids, c.cumulative_logprob) for output in outputs for c in output.outputs]
    return completions, llm.stats()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_shared_blocks_on_and_off_give_the_same_tokens(tiny_model, dtype, monkeypatch):
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 101, (41,), generator=generator).tolist()
    system = torch.randint(0, 101, (32,), generator=generator).tolist()
    cases = [  # n = 4 samples forking one prompt's blocks; 4 requests behind a prefix-cached system prompt
        ([prompt], SamplingParams(max_tokens=24, n=4, temperature=1.0, seed=11, ignore_eos=True), False),
        ([system + torch.randint(0, 101, (9,), generator=generator).tolist() for _ in range(4)],
         SamplingParams(max_tokens=24, ignore_eos=True), True),
    ]
    for prompts, params, prefix_caching in cases:
        on, stats = generate(tiny_model, dtype, prompts, params, prefix_caching, monkeypatch, sharing=True)
        off, _ = generate(tiny_model, dtype, prompts, params, prefix_caching, monkeypatch, sharing=False)
        assert stats.peak_blocks_saved_by_sharing >= 3 * 8  # the decode steps did have shared blocks to read
        assert len(on) == 4 and all(len(tokens) == 24 for tokens, _ in on)
        assert on == off  # tokens and cumulative log-probabilities, exactly


def test_decode_steps_pass_shared_plans(tiny_model, monkeypatch):
    """The engine's CUDA path (a plan of paged_attn.plan_shared_blocks per KV-cache group on every decode step),
    run on the CPU, whose op checks a plan and does not read it: with the runner's plan_shared_blocks on, every
    decode call gets a plan whose tasks list the samples of the shared prompt, a step with a prompt in it gets
    none, PAGED_ATTN_NO_SHARED_BLOCKS switches the plans off, and the tokens are those without plans."""
    from paged_attn import ops

    prompt = torch.randint(0, 101, (70,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(max_tokens=12, n=4, temperature=1.0, seed=7, ignore_eos=True)
    plain = LLM(tiny_model, block_size=4, num_kv_blocks=256).generate([prompt], params, use_tqdm=False)
    seen = []
    attention = ops.paged_attention

    def spy(*args, **kwargs):
        seen.append((kwargs.get("query_start_loc") is None, kwargs.get("shared_plan")))
        return attention(*args, **kwargs)

    monkeypatch.setattr(ops, "paged_attention", spy)
    for switch_off in (False, True):
        if switch_off:
            monkeypatch.setenv(SWITCH, "1")
        seen.clear()
        llm = LLM(tiny_model, block_size=4, num_kv_blocks=256)
        llm.runner.plan_shared_blocks = True
        outputs = llm.generate([prompt], params, use_tqdm=False)
        assert [c.token_ids for c in outputs[0].outputs] == [c.token_ids for c in plain[0].outputs]
        decodes = [plan for decode, plan in seen if decode]
        assert decodes and all(plan is None for decode, plan in seen if not decode)
        if switch_off:
            assert all(plan is None for plan in decodes)
            continue
        for plan in decodes:
            assert plan is not None and plan.dtype == torch.int32 and plan.shape[1] == 11
        # the 4 samples behind the prompt's 17 full blocks (68 tokens: above the plan's least 64)
        assert any(plan.shape[0] >= 1 and sorted(plan[0, 3:7].tolist()) == [0, 1, 2, 3] for plan in decodes)
