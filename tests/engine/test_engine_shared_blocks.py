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
    llm = LLM(model, dtype=dtype, block_size=4, num_gpu_blocks=256, enable_prefix_caching=prefix_caching)
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
