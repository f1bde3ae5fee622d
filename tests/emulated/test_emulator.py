"""The CPU emulator of the CUDA device API (tests/emulated/simt.h), through its self-test program.

tests/emulated/selftest.cpp is compiled with g++ three times into build/emulated/ (plain; AddressSanitizer with
UndefinedBehaviorSanitizer; ThreadSanitizer), again only when its sources, flags or compiler change. Each test runs
one of its cases in one build and thread order:
  - cases that must pass do so in every build and order (under TSan: no race reported for synchronized code);
  - shuffles and conversions are checked here against a model of PTX shfl.sync and against torch;
  - errors must be caught: by the emulator (exit status 3 and a message naming the block, threads and call sites)
    or by a sanitizer (its report).
"""

import fcntl
import hashlib
import math
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
EMULATED = ROOT / "tests" / "emulated"
BUILD_DIR = ROOT / "build" / "emulated"
CXX = os.environ.get("CXX", "g++")


def cuda_include_dir():
    """The CUDA toolkit's include directory (under CUDA_HOME, CUDA_PATH or /usr/local/cuda), or None."""
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "include" / "cuda_fp16.h").is_file():
            return Path(home) / "include"
    return None


CUDA_INCLUDE = cuda_include_dir()
pytestmark = [
    pytest.mark.skipif(CUDA_INCLUDE is None, reason="CUDA toolkit headers not found (set CUDA_HOME)"),
    pytest.mark.skipif(shutil.which(CXX) is None, reason=f"no C++ compiler ({CXX})"),
]

# -g1: line tables, enough for the sanitizers' file:line reports (full -g made the kernels driver's builds
# ~35% slower: 441 s against 321 s on the AMD EPYC, 2026-12-06)
COMMON_FLAGS = ["-std=c++17", "-O1", "-g1", "-Wall", "-Wextra", "-Wno-unknown-pragmas"]  # see simt.h
BUILDS = {
    "plain": [],
    "asan": ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"],
    "tsan": ["-fsanitize=thread"],
}
ORDERS = [("forward", 0), ("reverse", 0), ("random", 1)]

# A sanitizer's report (ASan's one-time "doesn't fully support makecontext/swapcontext" warning is not one).
SANITIZER_REPORT = re.compile(r"AddressSanitizer|LeakSanitizer|ThreadSanitizer|runtime error")


def build_programs(name, source, builds, flags, sources):
    """Compiles `source` once per build (extra flags in builds[build]) into BUILD_DIR/NAME-BUILD-HASH, the hash over
    the compiler, the flags and `sources`, so a program is rebuilt only when one of them changes; at most two
    compilers run at a time, and one process at a time builds `name`. Returns build -> program; fails the test
    session's fixture when a compile fails."""
    compiler = subprocess.run([CXX, "--version"], capture_output=True, check=True).stdout
    contents = b"".join(path.read_bytes() for path in sources)

    def command(build, output):
        return [CXX, *flags, *builds[build], f"-I{CUDA_INCLUDE}", str(source), "-o", str(output)]

    programs = {}
    for build in builds:
        key = compiler + contents + " ".join(command(build, "")).encode()
        programs[build] = BUILD_DIR / f"{name}-{build}-{hashlib.sha256(key).hexdigest()[:16]}"
    BUILD_DIR.mkdir(parents=True, exist_ok=True)

    def build_one(build):
        program = programs[build]
        partial = program.with_name(program.name + ".partial")
        result = subprocess.run(command(build, partial), capture_output=True, text=True)
        if result.returncode != 0:
            return f"{' '.join(command(build, partial))}\n{result.stderr[-8000:]}"
        os.replace(partial, program)
        for stale in BUILD_DIR.glob(f"{name}-{build}-*"):
            if stale != program:
                stale.unlink()
        return None

    # (one compile of each program even when pytest-xdist workers ask at once: the others wait for it here)
    with open(BUILD_DIR / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        missing = [build for build in builds if not programs[build].exists()]
        with ThreadPoolExecutor(max_workers=2) as pool:
            failures = [failure for failure in pool.map(build_one, missing) if failure]
    if failures:
        pytest.fail(f"compiling {source.name} failed:\n" + "\n".join(failures))
    return programs


# The kernel headers selftest.cpp includes (mma.cuh and cp_async.cuh, and theirs): a change rebuilds it.
SELFTEST_INCLUDES = [ROOT / "csrc" / "cuda" / name for name in ("mma.cuh", "cp_async.cuh", "device.cuh", "grid.h")]


@pytest.fixture(scope="session")
def selftest():
    """build name -> path of the self-test program."""
    sources = sorted(path for path in EMULATED.iterdir() if path.is_file()) + SELFTEST_INCLUDES
    return build_programs("selftest", EMULATED / "selftest.cpp", BUILDS, COMMON_FLAGS, sources)


def run(program, case, order="forward", seed=0, stdin=None):
    return subprocess.run([str(program), case, order, str(seed)], input=stdin, capture_output=True, text=True,
                          timeout=300)


def describe(result):
    return f"exit status {result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-6000:]}"


def assert_clean_pass(result):
    assert result.returncode == 0 and not SANITIZER_REPORT.search(result.stderr), describe(result)


# ---------------------------------------------------------------------------------------------------------------
# Cases that must pass, in every build and thread order.

PASSING = ["votes", "block_reduce", "uneven_warps", "shared_poison", "atomics", "alignment", "syncwarp_exchange",
           "wmma", "mma", "cp_async"]


@pytest.mark.parametrize("order,seed", ORDERS)
@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("case", PASSING)
def test_case_passes(selftest, case, build, order, seed):
    assert_clean_pass(run(selftest[build], case, order, seed))


def shuffle_source(kind, lane, operand, width):
    """The lane whose value `lane` receives, as the CUDA Programming Guide describes the shuffles: the warp is cut
    into segments of `width` lanes; idx takes source lane `operand - lane` (the kernel's per-lane choice) modulo
    width within the segment; up and down move by `operand` lanes and keep their own value when that leaves the
    segment; xor may reach earlier segments but not later ones. PTX uses an operand's low 5 bits."""
    base = lane - lane % width
    if kind == "idx":
        return base + (operand - lane) % width
    delta = operand % 32
    if kind == "up":
        return lane - delta if lane - delta >= base else lane
    if kind == "down":
        return lane + delta if lane + delta < base + width else lane
    return lane ^ delta if (lane ^ delta) < base + width else lane


@pytest.mark.parametrize("build,order,seed", [("plain", *o) for o in ORDERS] + [("asan", "random", 2),
                                                                                  ("tsan", "random", 3)])
def test_shuffles_match_the_documented_semantics(selftest, build, order, seed):
    result = run(selftest[build], "shuffles", order, seed)
    assert_clean_pass(result)
    outcomes = {"values": 0, "errors": 0}
    for line in result.stdout.splitlines():
        head, _, tail = line.partition(": ")
        value_type, kind, width, mask, operand = head.split()
        width, mask, operand = int(width), int(mask, 16), int(operand)
        sources = {tid: tid - tid % 32 + shuffle_source(kind, tid % 32, operand, width)
                   for tid in range(64) if mask >> (tid % 32) & 1}
        if any(not mask >> (source % 32) & 1 for source in sources.values()):
            # Reading a lane outside the mask is undefined in CUDA: the emulator reports it.
            assert tail.startswith("error ") and "which is not in the mask" in tail, line
            outcomes["errors"] += 1
        else:
            assert tail.split() == [str(sources.get(tid, -1)) for tid in range(64)], line
            outcomes["values"] += 1
    assert outcomes["values"] >= 500 and outcomes["errors"] >= 50, outcomes


@pytest.mark.parametrize("build", BUILDS)
def test_launch_limits(selftest, build):
    result = run(selftest[build], "launch_limits")
    assert_clean_pass(result)  # the limits themselves (1024 threads, 64 in z, 227 KiB of shared memory) pass
    messages = dict(line.split(": ", 1) for line in result.stdout.splitlines())
    expected = {
        "block_1025": "invalid launch: block (1025,1,1)",
        "block_32x32x2": "invalid launch: block (32,32,2)",
        "block_z_65": "invalid launch: block (1,1,65)",
        "grid_x_2^31": "invalid launch: grid (2147483648,1,1)",
        "grid_y_65536": "invalid launch: grid (1,65536,1)",
        "grid_z_65536": "invalid launch: grid (1,1,65536)",
        "grid_x_0": "invalid launch: grid (0,1,1)",
        "dynamic_shared": "232449 bytes of dynamic shared memory (at most 232448)",
        "static_shared": "49156 bytes static (at most 49152)",
        "static_plus_dynamic": "32768 bytes static (at most 49152) + 199681 bytes dynamic (at most 232448 in all)",
    }
    assert messages.keys() == expected.keys(), result.stdout
    for name, fragment in expected.items():
        assert fragment in messages[name], (name, messages[name])


def test_read_of_unwritten_shared_memory_is_nan(selftest):
    result = run(selftest["plain"], "uninitialized_shared")
    assert_clean_pass(result)
    assert math.isnan(float(result.stdout.split()[-1])), result.stdout


def order_results(result):
    assert_clean_pass(result)
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    return [int(x) for x in lines["winners"].split()], [int(x) for x in lines["positions"].split()]


def test_result_that_depends_on_thread_order_differs_between_orders(selftest):
    # Every thread writes one shared slot; after the barrier the block reads the last writer.
    forward = order_results(run(selftest["plain"], "order", "forward"))
    reverse = order_results(run(selftest["plain"], "order", "reverse"))
    assert forward == ([63] * 5, [0, 1, 2, 3, 4])
    assert reverse == ([0] * 5, [4, 3, 2, 1, 0])
    randoms = [order_results(run(selftest["plain"], "order", "random", seed)) for seed in (1, 2, 3)]
    for winners, positions in randoms:
        assert sorted(positions) == [0, 1, 2, 3, 4] and all(0 <= w < 64 for w in winners)
    assert len({str(r) for r in randoms}) == 3, randoms  # seeds give different orders...
    assert order_results(run(selftest["plain"], "order", "random", 2)) == randoms[1]  # ...reproducibly


# ---------------------------------------------------------------------------------------------------------------
# Host conversions of cuda_fp16.h, cuda_bf16.h and cuda_fp8.h (compiled by g++) against torch.

def hex_columns(text):
    return np.array([[int(field, 16) for field in line.split()[-3:]] for line in text.splitlines()], dtype=np.int64)


def float_sweep():
    """float32 bit patterns: every half and bfloat16 rounding tie (both signs) with its neighbours, specials, and
    random patterns."""
    halves = torch.arange(0, 0x7C00, dtype=torch.int32).to(torch.int16).view(torch.float16).double()
    half_ties = torch.cat([(halves[:-1] + halves[1:]) / 2, torch.tensor([65520.0], dtype=torch.float64)])
    half_ties = half_ties.float().view(torch.int32).to(torch.int64)  # exact: 12 significant bits
    bf16_ties = (torch.arange(0, 0x7F80, dtype=torch.int64) << 16) | 0x8000
    ties = torch.cat([half_ties, bf16_ties])
    around = torch.cat([ties - 1, ties, ties + 1])
    specials = torch.tensor([0x0, 0x1, 0x7FFFFF, 0x800000, 0x3F800000, 0x7F7FFFFF, 0x7F800000, 0x7FC00000, 0x7F800001],
                            dtype=torch.int64)
    random = torch.randint(0, 2**32, (50000,), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    positive = torch.cat([around, specials])
    return torch.cat([positive, positive | 0x80000000, random]).numpy().astype(np.uint32)


def torch_bits(x, dtype, as_float32=False):
    """The bits of x converted to dtype (or converted and back to float32), as int64."""
    y = x.to(dtype)
    if as_float32:
        y = y.float()
    ints = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[y.dtype.itemsize]
    return y.view(ints).numpy().astype(np.int64) & (2 ** (8 * y.dtype.itemsize) - 1)


def is_nan(bits, dtype):
    """Whether each bit pattern (int64) of a dtype value is a NaN."""
    ints = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[dtype.itemsize]
    return torch.isnan(torch.from_numpy(bits).to(ints).view(dtype).float()).numpy()


def test_host_conversions_round_like_torch(selftest):
    bits = float_sweep()
    result = run(selftest["plain"], "conversions", stdin="\n".join(f"{b:08x}" for b in bits))
    assert_clean_pass(result)
    columns = np.array([[int(field, 16) for field in line.split()] for line in result.stdout.splitlines()],
                       dtype=np.int64)
    assert columns.shape == (len(bits), 7) and (columns[:, 0] == bits).all()
    x = torch.from_numpy(bits.view(np.float32).copy())
    nan_in = torch.isnan(x).numpy()
    checks = [  # (conversion, its column, the dtype of its bits, torch's bits)
        ("__float2half_rn", 1, torch.float16, torch_bits(x, torch.float16)),
        ("__float2bfloat16_rn", 2, torch.bfloat16, torch_bits(x, torch.bfloat16)),
        ("__half2float(__float2half_rn)", 3, torch.float32, torch_bits(x, torch.float16, as_float32=True)),
        ("__bfloat162float(__float2bfloat16_rn)", 4, torch.float32, torch_bits(x, torch.bfloat16, as_float32=True)),
        ("__nv_cvt_float_to_fp8 e4m3 satfinite", 5, torch.float8_e4m3fn, torch_bits(x, torch.float8_e4m3fn)),
        ("__nv_cvt_float_to_fp8 e5m2", 6, torch.float8_e5m2, torch_bits(x, torch.float8_e5m2)),
    ]
    for name, column, dtype, want in checks:
        got = columns[:, column]
        # NaN in, NaN out, and only then; NaN payloads differ (torch makes 0x7e00 of a half NaN, CUDA 0x7fff).
        assert (is_nan(got, dtype) == nan_in).all(), name
        wrong = np.nonzero((got != want) & ~nan_in)[0]
        assert wrong.size == 0, f"{name}: {wrong.size} values differ, e.g. " + ", ".join(
            f"{bits[i]:08x} -> {got[i]:x} (torch {want[i]:x})" for i in wrong[:5])


def test_host_decodes_match_torch(selftest):
    result = run(selftest["plain"], "decodes")
    assert_clean_pass(result)
    lines = result.stdout.splitlines()
    halves = hex_columns("\n".join(line for line in lines if line.startswith("h ")))
    fp8 = hex_columns("\n".join(line for line in lines if line.startswith("f8 ")))
    assert (halves[:, 0] == np.arange(65536)).all() and (fp8[:, 0] == np.arange(256)).all()
    for decoded, column, dtype, out_dtype in [(halves, 1, torch.float16, torch.float32),
                                              (halves, 2, torch.bfloat16, torch.float32),
                                              (fp8, 1, torch.float8_e4m3fn, torch.float16),
                                              (fp8, 2, torch.float8_e5m2, torch.float16)]:
        patterns = decoded[:, 0]
        want = torch_bits(torch.from_numpy(patterns).to({2: torch.int16, 1: torch.uint8}[dtype.itemsize])
                          .view(dtype).to(out_dtype), out_dtype)
        nan_in = is_nan(patterns, dtype)
        got = decoded[:, column]
        assert (is_nan(got, out_dtype) == nan_in).all(), dtype
        assert (got[~nan_in] == want[~nan_in]).all(), dtype


# ---------------------------------------------------------------------------------------------------------------
# Errors the emulator reports: exit status 3, a message naming the block, the threads and the call sites.

EMULATOR_ERRORS = {
    "barrier_skipped": ["divergent __syncthreads"],
    "barrier_two_sites": ["divergent __syncthreads"],
    "barrier_early_return": ["__syncthreads() at", "exit"],
    "shuffle_divergent": ["__shfl_xor_sync(mask 0xffffffff) at", "exit"],
    "different_collectives": ["__shfl_xor_sync(mask 0xffffffff) at", "__shfl_down_sync(mask 0xffffffff) at"],
    "mismatched_masks": ["__shfl_xor_sync(mask 0xffffffff) at"],
    "collective_vs_barrier": ["__syncthreads() at", "__shfl_xor_sync(mask 0xffffffff) at"],
    "read_outside_mask": ["which is not in the mask", "__shfl_down_sync(mask 0x0000ffff)"],
    "mask_without_self": ["leaves out its own lane 3"],
    "bad_width": ["__shfl_xor_sync", "width 12"],
    "partial_warp_full_mask": ["names lanes past the end of the block (warp 1 has 16 lanes)"],
    "wmma_divergent": ["wmma::load_matrix_sync(mask 0xffffffff) at", "exit"],
    "wmma_pointer_mismatch": ["wmma::load_matrix_sync(mask 0xffffffff) at", "every lane must pass the same"],
    "wmma_misaligned": ["wmma::load_matrix_sync(mask 0xffffffff) at", "which is not 256-bit aligned"],
    "wmma_bad_ldm": ["wmma::load_matrix_sync(mask 0xffffffff) at", "ldm 12, which is not a multiple of 16 bytes"],
    "wmma_fill_nonuniform": ["wmma::fill_fragment(mask 0xffffffff) at", "with another value than"],
    "wmma_mma_vs_shuffle": ["wmma::mma_sync(mask 0xffffffff) at", "__shfl_xor_sync(mask 0xffffffff) at"],
    "mma_divergent": ["mma_m16n8k16(mask 0xffffffff) at", "exit"],
    "ldmatrix_misaligned": ["calls ldmatrix_x4 at", "which is not 16 bytes of this block's shared memory at a 16-byte "
                            "aligned address"],
    "ldmatrix_global": ["calls ldmatrix_x4 at", "which is not 16 bytes of this block's shared memory"],
    "ldmatrix_trans_mismatch": ["ldmatrix_x4(mask 0xffffffff) at", "ldmatrix_x4_trans(mask 0xffffffff) at"],
    "ldmatrix_pending": ["calls ldmatrix_x4 at", "where the cp.async of thread", "has not completed"],
    "cp_async_misaligned": ["calls cp_async_16 at", "with the destination", "16-byte aligned address"],
    "cp_async_not_shared": ["calls cp_async_16 at", "which is not 16 bytes of this block's shared memory"],
    "cp_async_twice": ["calls cp_async_16 at", "where the cp.async of thread", "has not completed (no wait between)"],
}
# Cases whose message must name two different call sites.
TWO_SITES = {"barrier_skipped", "barrier_two_sites", "different_collectives", "collective_vs_barrier",
             "wmma_mma_vs_shuffle", "ldmatrix_trans_mismatch", "ldmatrix_pending", "cp_async_twice"}


@pytest.mark.parametrize("build,order,seed", [("plain", *o) for o in ORDERS] + [("asan", "random", 2),
                                                                                  ("tsan", "random", 3)])
@pytest.mark.parametrize("case", EMULATOR_ERRORS)
def test_emulator_reports_error(selftest, case, build, order, seed):
    result = run(selftest[build], case, order, seed)
    assert result.returncode == 3 and not SANITIZER_REPORT.search(result.stderr), describe(result)
    message = result.stderr
    assert re.search(r"simt::Error: simt: block \(\d+,0,0\): .*thread \d+", message), message
    for fragment in EMULATOR_ERRORS[case]:
        assert fragment in message, (fragment, message)
    sites = set(re.findall(r"selftest\.cpp:(\d+)", message))
    assert len(sites) == (2 if case in TWO_SITES else 1), message


# ---------------------------------------------------------------------------------------------------------------
# Errors a sanitizer reports.

SANITIZER_CATCHES = {
    "shared_out_of_bounds": ("asan", ["ERROR: AddressSanitizer: heap-buffer-overflow",
                                      "0 bytes to the right of 128-byte region", "in shared_out_of_bounds_kernel"]),
    "dynamic_out_of_bounds": ("asan", ["ERROR: AddressSanitizer: heap-buffer-overflow",
                                       "in dynamic_out_of_bounds_kernel"]),
    "stack_out_of_bounds": ("asan", ["ERROR: AddressSanitizer: stack-buffer-overflow",
                                     "'local' (line", "in stack_out_of_bounds_kernel"]),
    "shared_index_out_of_bounds": ("asan", ["runtime error: index 32 out of bounds for type 'float [32]'"]),
    "misaligned_load": ("asan", ["runtime error:", "misaligned address",
                                 "'const struct uint4', which requires 16 byte alignment"]),
    "race": ("tsan", ["WARNING: ThreadSanitizer: data race", "in race_kernel"]),
    "race_over_shuffle": ("tsan", ["WARNING: ThreadSanitizer: data race", "in race_over_shuffle_kernel"]),
    "order": ("tsan", ["WARNING: ThreadSanitizer: data race", "in last_writer_kernel"]),
    # A read of a cp.async destination before the wait: poisoned, and the report lists the copy not waited for.
    "cp_async_early_read": ("asan", ["ERROR: AddressSanitizer: use-after-poison", "in cp_async_early_read_kernel",
                                     "simt: cp.async copies pending at this report",
                                     "selftest.cpp:", "not yet waited for"]),
    # Another lane's completed copy read without a __syncwarp after its wait: the read races with the copy's landing,
    # written by that lane's wait (complete_copies).
    "cp_async_race": ("tsan", ["WARNING: ThreadSanitizer: data race", "cp_async_race_kernel", "complete_copies"]),
    # A copy started into a slot another lane still reads before the barrier: the read races with the copy's start.
    "cp_async_overwrite_race": ("tsan", ["WARNING: ThreadSanitizer: data race", "cp_async_overwrite_race_kernel",
                                         "simt::cp_async_16"]),
}


@pytest.mark.parametrize("order,seed", ORDERS)
@pytest.mark.parametrize("case", SANITIZER_CATCHES)
def test_sanitizer_reports_error(selftest, case, order, seed):
    build, fragments = SANITIZER_CATCHES[case]
    result = run(selftest[build], case, order, seed)
    assert result.returncode != 0, describe(result)
    for fragment in fragments:
        assert fragment in result.stderr, (fragment, describe(result))
    if build == "tsan":  # the racing CUDA threads are named
        assert re.search(r"Thread T\d+ 'thread \d+ \(\d+,0,0\) of block \(\d+,0,0\)'", result.stderr), describe(result)


def test_plain_shared_declaration_is_refused(tmp_path):
    """A plain __shared__ variable would be one copy per emulated thread: it must not compile."""
    source = tmp_path / "plain_shared.cpp"
    source.write_text('#include "simt.h"\n__global__ void k() { __shared__ float x[4]; x[0] = 0; }\n')
    result = subprocess.run([CXX, *COMMON_FLAGS, f"-I{CUDA_INCLUDE}", f"-I{EMULATED}", "-fsyntax-only", str(source)],
                            capture_output=True, text=True)
    assert result.returncode != 0 and "use PA_SHARED / PA_EXTERN_SHARED" in result.stderr, result.stderr
