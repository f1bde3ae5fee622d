"""scripts/sass_report.py, the SASS performance report: its parts on hand-written SASS whose counts are known by
construction, its model against hand-computed figures, and the whole report on small kernels compiled here for
sm_90 (skipped without nvcc and cuobjdump), whose loads, loops, registers, shared and local memory are known."""

import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("sass_report", ROOT / "scripts" / "sass_report.py")
sass_report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sass_report)
import ptxas_report  # noqa: E402  (sass_report put scripts/ on the path)


def listing(body):
    """A cuobjdump -sass listing of one function from "addr: instruction" lines (addresses in hex)."""
    lines = ["\tcode for sm_90", "\t\tFunction : kernel"]
    for line in body.strip().splitlines():
        address, text = line.split(":", 1)
        lines.append(f"        /*{int(address, 16):04x}*/                   {text.strip()} ;   /* 0x000000 */")
        lines.append("                                                          /* 0x000fe2 */")
    return sass_report.parse_sass("\n".join(lines))["kernel"]


# A kernel with an outer loop [0x20, 0xd0] around an inner one [0x40, 0x90] that loads two 16-byte vectors and a
# 4-byte value (a block-table entry, say) per iteration; a second loop [0x100, 0x130] (two back edges to one header) with a 64-bit load; the
# end-of-code trap (a branch to itself) is no loop.
NESTED = """
00: MOV R1, c[0x0][0x28]
10: ISETP.GE.AND P0, PT, R0, 0x1, PT
20: MOV R2, RZ
30: IMAD.WIDE R4, R2, 0x10, R8
40: LDG.E.128.CONSTANT R12, desc[UR4][R4.64]
50: LDG.E.128 R16, desc[UR4][R4.64+0x200]
60: LDG.E R20, desc[UR4][R6.64]
70: FFMA R24, R12, R16, R24
80: FADD R25, R20, R25
90: @!P0 BRA 0x40
a0: SHFL.BFLY PT, R3, R24, 0x1, 0x1f
b0: HMMA.16816.F32.BF16 R28, R12, R16, R28
c0: IADD3 R2, R2, 0x1, RZ
d0: @P1 BRA 0x20
e0: STG.E desc[UR4][R10.64], R24
f0: MOV R3, RZ
100: LDG.E.64 R26, desc[UR4][R4.64]
110: @P2 BRA 0x100
120: FADD R3, R26, R3
130: @P3 BRA 0x100
140: EXIT
150: BRA 0x150
"""


def test_loops_are_found_from_backward_branches_and_innermost_kept():
    instructions = listing(NESTED)
    loops = sass_report.find_loops(instructions)
    spans = [(instructions[a].address, instructions[b].address) for a, b in loops]
    assert spans == [(0x40, 0x90), (0x100, 0x130)]  # not the outer [0x20, 0xd0], not the trap at 0x150
    inner = sass_report.analyse_loop(instructions[loops[0][0]:loops[0][1] + 1])
    assert inner.instructions == 6
    assert inner.loads == {"LDG.128": 2, "LDG.32": 1}
    assert inner.bytes_per_lane == 32  # the vectors: scalar loads cost instructions, not streamed bytes
    assert inner.per_16_bytes == pytest.approx(6 * 16 / 32)
    # R12..R15 and R16..R19 are both loaded before the FFMA reads them
    assert inner.in_flight_per_lane == 32
    second = sass_report.analyse_loop(instructions[loops[1][0]:loops[1][1] + 1])
    assert second.instructions == 4 and second.loads == {"LDG.64": 1} and second.bytes_per_lane == 8


def test_loops_with_only_scalar_loads_are_not_streaming():
    body = listing("""
        00: LDG.E R4, desc[UR4][R2.64]
        10: IMNMX R5, R4, R5, PT
        20: @P0 BRA 0x0
    """)
    loop = sass_report.analyse_loop(body)
    assert loop.loads == {"LDG.32": 1} and loop.bytes_per_lane == 0 and loop.in_flight_per_lane == 0


def test_counts_of_hmma_shuffles_shared_and_generic_accesses():
    body = listing("""
        00: LDG.E.128 R4, desc[UR4][R2.64]
        10: LDS.128 R8, [R0]
        20: LDSM.16.M88.4 R12, [R1]
        30: STS [R0], R4
        40: LD.E R16, desc[UR4][R2.64]
        50: ST.E desc[UR4][R2.64], R16
        60: HMMA.16816.F32.BF16 R20, R12, R8, R20
        70: HMMA.16816.F32.BF16 R24, R12, R10, R24
        80: SHFL.BFLY PT, R3, R20, 0x1, 0x1f
        90: @P0 BRA 0x0
    """)
    loop = sass_report.analyse_loop(body)
    assert (loop.hmma, loop.shuffles, loop.shared, loop.generic) == (2, 1, 3, 2)
    assert loop.loads == {"LDG.128": 1} and loop.bytes_per_lane == 16  # generic loads are counted apart


def test_in_flight_across_the_back_edge_software_pipelining():
    # Each iteration uses the vector loaded by the previous one, then loads the next two: at the peak (after the
    # second load) 32 B are in flight, carried over the back edge.
    body = listing("""
        00: FFMA R20, R4, R8, R20
        10: FFMA R21, R5, R9, R21
        20: LDG.E.128 R4, desc[UR4][R2.64]
        30: LDG.E.128 R8, desc[UR4][R2.64+0x10]
        40: IADD3 R2, R2, 0x20, RZ
        50: @P0 BRA 0x0
    """)
    assert sass_report.bytes_in_flight(body) == 32
    # used at once: one vector at a time
    body = listing("""
        00: LDG.E.128 R4, desc[UR4][R2.64]
        10: FADD R20, R4, R20
        20: LDG.E.128 R8, desc[UR4][R2.64+0x10]
        30: FADD R21, R11, R21
        40: @P0 BRA 0x0
    """)
    assert sass_report.bytes_in_flight(body) == 16


def test_in_flight_of_cp_async_groups():
    # Double buffering: issue tile t+1 (two 16-byte copies, one group), then wait until one group is left in
    # flight: at the peak two groups, 64 B.
    double = """
        00: LDGSTS.E.BYPASS.128 [R10], desc[UR4][R2.64]
        10: LDGSTS.E.BYPASS.128 [R10+0x800], desc[UR4][R2.64+0x10]
        20: LDGDEPBAR
        30: DEPBAR.LE SB0, 0x1
        40: LDS.128 R4, [R11]
        50: @P0 BRA 0x0
    """
    loop = sass_report.analyse_loop(listing(double))
    assert loop.loads == {"LDGSTS.128": 2} and loop.bytes_per_lane == 32 and loop.in_flight_per_lane == 64
    # waiting for everything (a single buffer): one group
    assert sass_report.bytes_in_flight(listing(double.replace("DEPBAR.LE SB0, 0x1", "DEPBAR.LE SB0, 0x0"))) == 32


def test_occupancy_on_sm90():
    assert sass_report.occupancy(193, 128, 0) == (2, "registers")  # 6,400 registers per warp: 10 warps
    assert sass_report.occupancy(64, 128, 0) == (8, "registers")
    assert sass_report.occupancy(32, 128, 0) == (16, "warps")
    assert sass_report.occupancy(16, 32, 0) == (32, "blocks")
    assert sass_report.occupancy(32, 1024, 0) == (2, "warps")
    assert sass_report.occupancy(32, 128, 100 * 1024) == (2, "shared memory")  # 101 KB per block of 228 KB
    assert sass_report.occupancy(32, 128, 56 * 1024)[0] == 4  # 57 KB: 4 blocks fill 228 KB exactly


def test_issue_ceiling_matches_the_review_of_the_decode_kernel():
    # issue 22: K / V loops at 95 / 74 (MHA), 178 / 104 (GQA-4), 287 / 145 (GQA-8) instructions per 16 B
    # cap the kernel at about 133%, 79% and 52% of 4.8 TB/s
    assert sass_report.issue_ceiling((95 + 74) / 2) == pytest.approx(1.32, abs=0.01)
    assert sass_report.issue_ceiling((178 + 104) / 2) == pytest.approx(0.79, abs=0.01)
    assert sass_report.issue_ceiling((287 + 145) / 2) == pytest.approx(0.52, abs=0.01)
    # 512 B per warp instruction (one LDG.128 per lane and nothing else) would be 4 x 512 x 132 x 1.98e9 / 4.8e12
    assert sass_report.issue_ceiling(1.0) == pytest.approx(4 * 512 * 132 * 1.98e9 / 4.8e12)


def test_prefill_targets_take_the_main_loop_of_the_listed_variants():
    def loop(instructions, hmma, generic=0):
        return sass_report.Loop(0, 16 * instructions, instructions, {"LDGSTS.128": 8}, generic, 40, hmma, 4, 128, 128)

    def kernel(name, loops, blocks=2, local=0):
        k = sass_report.Kernel(name, 128, local, 0, 0, 128, loops)
        k.blocks_per_sm = blocks
        return k

    rows = sass_report.prefill_targets([
        kernel("varlen_attention_kernel<bf16, bf16, 64>", [loop(900, 64), loop(420, 64)]),  # main: 15.2%
        kernel("varlen_attention_kernel<half, half, 128>", [loop(600, 128, generic=2)], blocks=1, local=8),
        kernel("varlen_attention_kernel<bf16, bf16, 256>", [loop(430, 64)]),                # 14.9%
        kernel("varlen_attention_kernel<half, half, 256>", [loop(300, 0)]),                 # no HMMA loop
        kernel("varlen_attention_kernel<bf16, bf16, 80>", [loop(900, 8)]),                  # not targeted
        kernel("varlen_attention_kernel<bf16, unsigned char, 128>", [loop(900, 8)]),        # fp8: not targeted
    ])
    assert [(k.name, main and main.instructions, failed) for k, main, failed in rows] == [
        ("varlen_attention_kernel<bf16, bf16, 64>", 420, []),
        ("varlen_attention_kernel<half, half, 128>", 600,
         ["generic loads/stores", "blocks per SM", "local memory"]),
        ("varlen_attention_kernel<bf16, bf16, 256>", 430, ["HMMA share"]),
        ("varlen_attention_kernel<half, half, 256>", None, ["HMMA share", "generic loads/stores"]),
    ]


def test_decode_targets_are_checked_for_the_listed_variants():
    def kernel(name, ceiling, in_flight, local=0):
        k = sass_report.Kernel(name, 64, local, 0, 0, 128, [])
        k.ceiling, k.in_flight_per_sm = ceiling, in_flight
        return k

    rows = sass_report.decode_targets([
        kernel("decode_mma_kernel<bf16, 128>", 1.6, 40 * 1024),
        kernel("decode_mma_kernel<half, 128>", 1.4, 16 * 1024, local=8),
        kernel("decode_mma_kernel<bf16, 64>", 0.5, 0),                      # other head dims: not targeted
        kernel("paged_attention_kernel<bf16, bf16, 128, 8>", 0.5, 0),       # the CUDA-core kernel: not targeted
        kernel("paged_attention_kernel<float, float, 128, 1>", 0.5, 0),     # float32 queries: not targeted
        kernel("paged_attention_kernel<bf16, Fp8, 128, 1>", 0.5, 0),        # fp8 caches: not targeted
    ])
    assert [(k.name, failed) for k, failed in rows] == [
        ("decode_mma_kernel<bf16, 128>", []),
        ("decode_mma_kernel<half, 128>", ["issue ceiling", "bytes in flight", "local memory"]),
    ]


# ---------------------------------------------------------------------------------------------------------------
# The whole report on kernels compiled for sm_90.

KERNELS = r"""
#include <cuda_pipeline.h>
#include <mma.h>
#include <cuda_bf16.h>

// one 16-byte load per lane per iteration
extern "C" __global__ void __launch_bounds__(128) sum128(const float4* __restrict__ x, float* out, int n) {
  float acc = 0.f;
#pragma unroll 1
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const float4 v = x[i];
    acc += v.x + v.y + v.z + v.w;
  }
  out[threadIdx.x] = acc;
}

// only the inner loop is innermost; one 8-byte load per iteration
extern "C" __global__ void __launch_bounds__(256) nested(const float2* __restrict__ x, float* out, int n, int m) {
  float acc = 0.f;
#pragma unroll 1
  for (int j = 0; j < m; ++j) {
#pragma unroll 1
    for (int i = threadIdx.x; i < n; i += 32) acc += x[i + j * n].x * x[i + j * n].y;
    acc *= 0.5f;
  }
  out[threadIdx.x] = acc;
}

// a dynamically indexed array: 1 KB of local memory per thread
extern "C" __global__ void __launch_bounds__(64) local_array(const int* idx, float* out, int n) {
  float a[256];
#pragma unroll 1
  for (int i = 0; i < n; ++i) a[i & 255] = out[i];
  out[threadIdx.x] = a[idx[threadIdx.x] & 255];
}

// 48 KB of static shared memory: 4 blocks of (48 + 1) KB fit in 228 KB
extern "C" __global__ void __launch_bounds__(128) shared48k(float* out) {
  __shared__ float buf[12288];
  for (int i = threadIdx.x; i < 12288; i += 128) buf[i] = i;
  __syncthreads();
  out[threadIdx.x] = buf[12287 - threadIdx.x];
}

// double-buffered cp.async: the next tile's copy is in flight while the current one is read
extern "C" __global__ void __launch_bounds__(128) cp_async_double(const float4* __restrict__ x, float* out,
                                                                    int tiles) {
  __shared__ float4 buf[2][128];
  float acc = 0.f;
  __pipeline_memcpy_async(&buf[0][threadIdx.x], &x[threadIdx.x], 16);
  __pipeline_commit();
#pragma unroll 1
  for (int t = 0; t < tiles; ++t) {
    __pipeline_memcpy_async(&buf[(t + 1) & 1][threadIdx.x], &x[(t + 1) * 128 + threadIdx.x], 16);
    __pipeline_commit();
    __pipeline_wait_prior(1);
    const float4 v = buf[t & 1][threadIdx.x];
    acc += v.x + v.y + v.z + v.w;
  }
  out[threadIdx.x] = acc;
}

// one 16x16x16 bfloat16 product per iteration (two HMMA.16816 on sm_90) and a 16-byte load
extern "C" __global__ void __launch_bounds__(32) mma_loop(const __nv_bfloat16* a, const __nv_bfloat16* b,
                                                          const float4* __restrict__ x, float* c, int steps) {
  using namespace nvcuda;
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> fc;
  wmma::fill_fragment(fc, 0.f);
  wmma::load_matrix_sync(fa, a, 16);
  wmma::load_matrix_sync(fb, b, 16);
  float acc = 0.f;
#pragma unroll 1
  for (int s = 0; s < steps; ++s) {
    wmma::mma_sync(fc, fa, fb, fc);
    const float4 v = x[s * 32 + threadIdx.x];
    acc += v.x * v.y + v.z * v.w;
  }
  wmma::store_matrix_sync(c, fc, 16, wmma::mem_row_major);
  c[threadIdx.x + 256] = acc;
}
"""


def nvcc():
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    path = os.path.join(home, "bin", "nvcc")
    return path if os.path.exists(path) else shutil.which("nvcc")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    if not nvcc():
        pytest.skip("no nvcc to compile the kernels")
    try:
        sass_report.find_cuobjdump()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    directory = tmp_path_factory.mktemp("sass")
    source = directory / "kernels.cu"
    source.write_text(KERNELS)
    cubin = directory / "kernels.cubin"
    result = subprocess.run([nvcc(), "-cubin", "-arch=sm_90", "-O3", "-Xptxas", "-v", str(source), "-o", str(cubin)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    kernels = {k.name: k for k in sass_report.report(str(cubin))}
    return kernels, ptxas_report.parse(result.stderr.splitlines()), cubin


def test_compiled_registers_and_memory_match_ptxas(compiled):
    kernels, ptxas, _ = compiled
    assert set(kernels) == {"sum128", "nested", "local_array", "shared48k", "cp_async_double", "mma_loop"}
    for name, k in kernels.items():
        regs, stores, loads, smem, stack = ptxas[(name, "sm_90")]
        assert (k.registers, k.static_shared, k.local_bytes) == (regs, smem, stack), name
    assert kernels["local_array"].local_bytes == 1024
    assert kernels["shared48k"].static_shared == 48 * 1024
    assert (kernels["shared48k"].blocks_per_sm, kernels["shared48k"].limiter) == (4, "shared memory")
    assert kernels["sum128"].threads == 128 and kernels["nested"].threads == 256
    assert (kernels["sum128"].blocks_per_sm, kernels["sum128"].limiter) == (16, "warps")


def test_compiled_loops_and_loads(compiled):
    kernels, _, _ = compiled
    (loop,) = kernels["sum128"].loops
    assert loop.loads == {"LDG.128": 1} and loop.bytes_per_lane == 16
    assert loop.in_flight_per_lane == 16
    assert kernels["sum128"].in_flight_per_sm == 16 * 32 * 64  # 64 resident warps
    assert kernels["sum128"].ceiling == pytest.approx(sass_report.issue_ceiling(loop.instructions))
    (inner,) = kernels["nested"].loops  # the outer loop contains it, so only the inner one is reported
    assert inner.loads == {"LDG.64": 1} and inner.bytes_per_lane == 8
    (copy,) = kernels["cp_async_double"].loops
    assert copy.loads == {"LDGSTS.128": 1} and copy.in_flight_per_lane == 32  # this tile's copy and the next
    (mma,) = kernels["mma_loop"].loops
    assert mma.hmma == 2 and mma.loads == {"LDG.128": 1}
    assert kernels["shared48k"].loops == [] and kernels["local_array"].local_bytes > 0


def test_the_command_line_prints_the_table_and_checks(compiled):
    _, _, cubin = compiled
    script = str(ROOT / "scripts" / "sass_report.py")
    out = subprocess.run([sys.executable, script, str(cubin)], capture_output=True, text=True, check=True).stdout
    assert "sum128" in out and "LDG.128x1" in out and "LDGSTS.128x1" in out
    checked = subprocess.run([sys.executable, script, "--check-decode", str(cubin)], capture_output=True, text=True)
    assert checked.returncode == 1 and "no decode kernels found" in checked.stderr


def test_baseline_comparison_flags_kernels_that_got_worse():
    def kernel(name, ceiling, in_flight, blocks, local=0):
        k = sass_report.Kernel(name, 64, local, 0, 0, 128, [])
        k.ceiling, k.in_flight_per_sm, k.blocks_per_sm = ceiling, in_flight, blocks
        return k

    before = [kernel("a", 1.2, 32768, 4), kernel("b", 1.2, 32768, 4), kernel("c", 1.2, 32768, 4),
              kernel("d", 1.2, 32768, 4)]
    after = [kernel("a", 1.6, 65536, 4), kernel("b", 1.1, 65536, 4), kernel("c", 1.6, 16384, 4),
             kernel("d", 1.6, 65536, 4, local=16), kernel("new", 0.1, 0, 1)]
    baseline = [json.loads(line.rstrip(",")) for line in sass_report.to_json(before).splitlines()[1:-1]]
    out = io.StringIO()
    assert sass_report.compare(after, baseline, out) == ["b", "c", "d"]
    assert "120% -> 160%" in out.getvalue() and "new" not in out.getvalue()


@pytest.mark.skipif(os.environ.get("PAGED_ATTN_FORCE_CUDA") != "1", reason="needs the CUDA build (CI builds it with "
                    "PAGED_ATTN_FORCE_CUDA=1)")
def test_report_reads_the_built_decode_kernels():
    import paged_attn

    assert paged_attn.has_cuda_kernels()
    try:
        sass_report.find_cuobjdump()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    kernels = sass_report.report(paged_attn._C.__file__, only=sass_report.DECODE_KERNEL.pattern)
    assert {k.name for k in kernels} == {"decode_mma_kernel<bf16, 128>", "decode_mma_kernel<half, 128>"}
    for k in kernels:
        assert k.threads == 128 and k.blocks_per_sm >= 1, k.name
        assert k.dynamic_shared == paged_attn._C._launch_plan("decode_mma", 128)["shared_bytes"] > 48 * 1024
        assert k.loops and all(loop.loads.get("LDGSTS.128", 0) and loop.hmma for loop in k.loops)
        assert k.ceiling is not None and k.in_flight_per_sm > 0
    rows = sass_report.decode_targets(kernels)
    assert len(rows) == 2
    # issue 22's targets, met by the built library (CI builds it): a regression fails here
    assert [(k.name, failed) for k, failed in rows if failed] == []
