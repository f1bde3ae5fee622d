"""What the benchmarks share: one timing core, the machine's memory yardsticks, the host they ran on, fp8 caches, and
the request lengths and figures of the studies. Every script in bench/ imports this module and no other script
(bench/ is on ``sys.path`` when a script runs, so ``from common import ...`` works from any working directory).

Timing (each script checks correctness first, then times):

- ``time_interleaved(methods, repeats)``: methods take turns round by round (``alternate=True``: the order flips
  every other round), after ``warmup`` untimed calls of each; medians of the repeats, in seconds;
- ``median_time(fn, repeats)``: one method, after a warm-up;
- ``Timer(device)``: the same with CUDA events on a GPU, the L2 cache flushed before every repeat;
- ``timed_call(fn, ...)``: one call timed as a whole, with its result (a ``generate`` call of an engine);
- ``in_turns(names, round_index)``: the names in order, reversed every other round (for loops that time by hand).

Yardsticks, timed in the same run as what they measure:

- ``memory_yardsticks(gib)``: ``x.sum()`` over a float32 tensor (bytes read / time) and ``y.copy_(x)`` (bytes read /
  time; the bytes written not counted), as ``time_interleaved`` methods named ``READ`` and ``COPY``;
- ``device_copy_bandwidth(timer, device)``: a device-to-device copy, bytes read + written / time;
- ``matmul_tflops(timer, dtype, repeats, device)``: the best square matmul's throughput (the tensor-core limit).

Paged decode cases: ``decode_case(...)`` (random query and caches, blocks scattered) and ``dense_layout(cache,
block_tables, seq_len)`` (a cache's keys or values as the contiguous tensors an unpaged peer takes).

``describe_host()``: one line naming the CPU, its AVX-512 / AVX512_BF16 / AMX flags, CPUs and torch threads, torch,
``GOMP_SPINCOUNT`` and the load average: every script prints it above its figures, so a figure says where it ran.
"""

from __future__ import annotations

import math
import os
import platform
import random
import re
import statistics
import subprocess
import tempfile
import time
from typing import Callable, Dict, Mapping, Sequence, Union

import torch

# ---- timing ----


def _seconds(fn: Callable[[], object], sync: Callable[[], None] | None) -> float:
    if sync is not None:
        sync()
    start = time.perf_counter()
    fn()
    if sync is not None:
        sync()
    return time.perf_counter() - start


def in_turns(names: Sequence[str], round_index: int) -> list[str]:
    """``names`` in order in even rounds, reversed in odd ones (ABBA): a drift in machine load hits both alike."""
    return list(names) if round_index % 2 == 0 else list(names)[::-1]


def time_interleaved(methods: Mapping[str, Callable[[], object]], repeats: Union[int, Mapping[str, int]],
                     warmup: int = 1, settle: Sequence[str] = (), alternate: bool = False,
                     sync: Callable[[], None] | None = None) -> Dict[str, float]:
    """Median seconds of each method (``repeats``: one count for all, or per method; a method with 0 is not timed).

    Each method runs ``warmup`` times untimed first. Then the methods take turns within each round, so that a change
    in machine load hits them all alike (``alternate``: the order flips every other round); a method named in
    ``settle`` runs once untimed right before each timed run, so that it is not timed in the wake of the previous
    method (SDPA, say, slows the next few milliseconds of work down). ``sync`` (e.g. ``torch.cuda.synchronize``)
    runs before and after each timed call."""
    counts = {name: repeats for name in methods} if isinstance(repeats, int) else dict(repeats)
    for fn in methods.values():
        for _ in range(warmup):
            fn()
    times: Dict[str, list] = {name: [] for name in methods}
    for round_index in range(max(counts.values(), default=0)):
        for name in (in_turns(list(methods), round_index) if alternate else methods):
            if round_index >= counts[name]:
                continue
            if name in settle:
                methods[name]()
            times[name].append(_seconds(methods[name], sync))
    return {name: statistics.median(ts) for name, ts in times.items() if ts}


def median_time(fn: Callable[[], object], repeats: int, warmup: int = 1,
                sync: Callable[[], None] | None = None) -> float:
    """Median seconds of ``repeats`` timed calls of ``fn`` after ``warmup`` untimed ones."""
    return time_interleaved({"fn": fn}, repeats, warmup, sync=sync)["fn"]


def timed_call(fn: Callable, *args, **kwargs):
    """``(fn(*args, **kwargs), seconds)``: one call timed as a whole (wall time)."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


class Timer:
    """Median seconds of a callable on ``device``: on CUDA by events around each call, with the L2 cache flushed
    (256 MiB written) before each repeat; elsewhere by ``median_time``. ``warmup`` untimed calls come first (a
    second one also after lazy initialization)."""

    def __init__(self, device: torch.device, warmup: int = 1):
        self.device, self.warmup = device, warmup
        self.flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=device) if device.type == "cuda" else None

    def __call__(self, fn: Callable[[], object], repeats: int) -> float:
        if self.device.type != "cuda":
            return median_time(fn, repeats, self.warmup)
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(repeats):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)


# ---- yardsticks ----

READ = "(c) memory read: x.sum(), float32"
COPY = "(c) memory copy: y.copy_(x), bytes read"


def memory_yardsticks(gib: float = 1.0, generator: torch.Generator | None = None):
    """``({READ: x.sum(), COPY: y.copy_(x)}, bytes each reads)`` over a float32 tensor of ``gib`` GiB: the rate this
    machine reads memory at, to time in the same rounds as a kernel (it must be far larger than the last-level
    cache to mean memory bandwidth)."""
    numel = int(gib * 2**30) // 4
    big = torch.randn(numel, generator=generator)
    big_copy = torch.empty_like(big)
    return {READ: lambda: big.sum(), COPY: lambda: big_copy.copy_(big)}, numel * 4


def device_copy_bandwidth(timer: Timer, device: torch.device, repeats: int) -> float:
    """A device-to-device copy of 2 GiB (1 GiB on the CPU), counted as bytes read + bytes written per second."""
    size = (2 if device.type == "cuda" else 1) * 2**30
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * size / timer(lambda: dst.copy_(src), repeats)


def vdpbf16ps_peak() -> float | None:
    """What one core issues of 512-bit vdpbf16ps per second (``bench/dot_peak.c``, compiled with the system's C
    compiler into a temporary directory and run once, about 5 s), or None where there is no compiler or no
    AVX512_BF16. The arithmetic ceiling of the AVX-512 bf16 decode: it runs on these alone."""
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dot_peak.c")
    with tempfile.TemporaryDirectory() as tmp:
        binary = os.path.join(tmp, "dot_peak")
        try:
            subprocess.run(["cc", "-O2", "-o", binary, source], check=True, capture_output=True)
            out = subprocess.run([binary], capture_output=True, text=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return None
    match = re.search(r"vdpbf16ps zmm, 12 chains: ([0-9.]+) G/s per core", out)
    return float(match.group(1)) * 1e9 if match else None


def matmul_tflops(timer: Timer, dtype: torch.dtype, repeats: int, device: torch.device,
                  sizes: Sequence[int] = (4096, 8192)) -> float:
    """The best of a few square matmul sizes: the device's practical dense throughput for this dtype, TFLOP/s."""
    best = 0.0
    for n in sizes:
        a = torch.randn(n, n, dtype=dtype, device=device)
        b = torch.randn(n, n, dtype=dtype, device=device)
        seconds = timer(lambda: torch.matmul(a, b), repeats)
        best = max(best, 2 * n**3 / seconds / 1e12)
    return best


# ---- paged decode cases ----


def decode_case(batch: int, context: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                device: torch.device, dtype: torch.dtype):
    """Random query and caches, each sequence's ``context`` tokens in blocks scattered over the cache:
    ``(query, key_cache, value_cache, block_tables, seq_lens)``."""
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, dtype=dtype, device=device)
    value_cache = torch.randn(shape, dtype=dtype, device=device)
    block_tables = torch.randperm(num_blocks, device=device, dtype=torch.int64).to(torch.int32)
    block_tables = block_tables.view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query = torch.randn(batch, num_heads, head_dim, dtype=dtype, device=device)
    return query, key_cache, value_cache, block_tables, seq_lens


def dense_layout(cache: torch.Tensor, block_tables: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[num_blocks, block_size, num_kv_heads, head_dim] paged -> [num_seqs, num_kv_heads, seq_len, head_dim]."""
    num_seqs = block_tables.shape[0]
    gathered = cache[block_tables.long()]  # [num_seqs, blocks_per_seq, block_size, num_kv_heads, head_dim]
    gathered = gathered.flatten(1, 2)[:, :seq_len]  # [num_seqs, seq_len, num_kv_heads, head_dim]
    return gathered.transpose(1, 2).contiguous().view(num_seqs, cache.shape[2], seq_len, cache.shape[3])


# ---- the host ----


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``/proc/cpuinfo``; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return set()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        name = ""
    return name or platform.processor() or platform.machine()


def describe_host() -> str:
    """One line: the CPU and the flags the CPU kernels pick their path by (AVX-512, AVX512_BF16, AMX), CPUs, torch
    threads, torch version, GOMP_SPINCOUNT and the load average."""
    flags = cpu_flags()
    has = lambda *names: "yes" if all(n in flags for n in names) else "no"  # noqa: E731
    load = f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "?"
    return (f"host: {cpu_model()} ({platform.machine()}; AVX-512 {has('avx512f')}, AVX512_BF16 {has('avx512_bf16')},"
            f" AMX {has('amx_bf16', 'amx_tile')}), {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, "
            f"torch {torch.__version__}, GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}, load average {load}")


# ---- fp8 caches ----

FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}  # --kv-dtype


def quantize_fp8_caches(key_cache: torch.Tensor, value_cache: torch.Tensor, fp8: torch.dtype):
    """The caches quantized into ``fp8`` with the scales amax / max finite (NaN-poisoned slots ignored):
    ``([key_cache, value_cache], [k_scale, v_scale])``, the scales float32 ``[1]``."""
    from paged_attn import reference

    scales = [(c.to(torch.float32, copy=True).nan_to_num_().abs_().amax() / torch.finfo(fp8).max).reshape(1)
              for c in (key_cache, value_cache)]
    return [reference.quantize_fp8(c, fp8, s) for c, s in zip((key_cache, value_cache), scales)], scales


# ---- the studies: request lengths and figures ----

DATASETS = {"sharegpt-like": (161, 338), "alpaca-like": (19, 58)}  # mean input, mean output tokens
FIGURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "figures")


def lognormal_int(rng: random.Random, mean: float, sigma: float, high: int) -> int:
    """A log-normal integer with the given mean (before clipping), clipped to [1, high]."""
    return min(high, max(1, round(rng.lognormvariate(math.log(mean) - sigma ** 2 / 2, sigma))))


def sample_requests(dataset: str, num: int, seed: int, sigma: float = 1.0, max_len: int = 2048):
    """``num`` (prompt_len, output_len) pairs of a DATASETS entry, log-normal, with prompt + output <= max_len."""
    rng = random.Random(f"{dataset}-{seed}")
    mean_in, mean_out = DATASETS[dataset]
    requests = []
    for _ in range(num):
        prompt = lognormal_int(rng, mean_in, sigma, max_len - 1)
        requests.append((prompt, lognormal_int(rng, mean_out, sigma, max_len - prompt)))
    return requests


def pyplot():
    """matplotlib's pyplot, drawing to files (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, name: str, **tight_layout) -> None:
    """Lay out ``fig``, write it to bench/figures/``name`` and close it."""
    fig.tight_layout(**tight_layout)
    os.makedirs(FIGURES, exist_ok=True)
    fig.savefig(os.path.join(FIGURES, name), dpi=120, bbox_inches="tight")
    pyplot().close(fig)
