"""The CUDA kernels' own source (csrc/cuda/*_kernels.cuh), executed on the CPU by the SIMT emulator
(tests/emulated/simt.h), against the float64 references of paged_attn.reference.

tests/emulated/kernels.cpp is the driver: it computes the launch with the same plan functions as the CUDA launchers
(csrc/cuda/launch_plan.h), runs the kernels thread by thread on buffers this module writes, and writes the buffers
back. It is compiled twice into build/emulated/ (AddressSanitizer + UndefinedBehaviorSanitizer, and
ThreadSanitizer), again only when a source changes. A case runs under ASan+UBSan in the three thread orders
(forward, reverse, seeded random) and once under TSan (the runs as parallel processes: the emulator runs on one
thread), or, after the first case of a parametrized test, once, under one of the two (RUNS, SWEEP_RUNS); the outputs
must match the reference and be the same bit for bit in every order and build. Unused
cache slots and blocks are NaN, unused block-table entries hold garbage, and every buffer is allocated at its exact
size, so a read of a slot, row or entry the kernel should not touch shows up as NaN in the output or as a sanitizer
report.

Tolerances as in test_attention.py: float32 within 1e-5, float16 / bfloat16 within 2e-2.
"""

import math
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from conftest import HAS_CUDA_OPS
from test_attention import NAN, make_case, tolerance
from test_plan_shared_blocks import MAX_ROW_LISTINGS, caterpillar, fewest_possible_reads, listings, modelled_reads
from test_emulator import CUDA_INCLUDE, CXX, SANITIZER_REPORT, build_programs
from test_varlen_attention import MIXED, make_varlen_case

import paged_attn
from paged_attn import reference

ROOT = Path(__file__).resolve().parents[2]
EMULATED = ROOT / "tests" / "emulated"
SOURCES = [EMULATED / "kernels.cpp", EMULATED / "simt.h", *sorted((ROOT / "csrc" / "cuda").glob("*.cuh")),
           *sorted((ROOT / "csrc" / "cuda").glob("*.h"))]
# -fno-strict-aliasing: the kernels read 16-byte vectors as uint4 and reinterpret them (as nvcc allows); -g1 as in
# test_emulator.py
FLAGS = ["-std=c++17", "-O1", "-g1", "-Wall", "-Wextra", "-Wno-unknown-pragmas", "-fno-strict-aliasing"]
BUILDS = {"asan": ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"], "tsan": ["-fsanitize=thread"]}
# (build, thread order, seed) of every run of a case. A parametrized test runs its first case in all of RUNS and each
# of the others once, in one of SWEEP_RUNS: a sweep's cases differ in sizes, dtypes, layouts and features, not in how
# the threads meet, and its first case takes that through every order and both builds (their bits must agree); each
# of the others runs under ASan+UBSan (forward order) or TSan (random order), by the parity of the sum of its
# parameter indices, so that in a grid of two parameters every value of each meets both sanitizers. (A sweep case in
# two runs, as before 2026-12-07, cost the suite ~200 more CPU-seconds on 2 cores.)
RUNS = [("asan", "forward", 0), ("asan", "reverse", 0), ("asan", "random", 11), ("tsan", "random", 12)]
SWEEP_RUNS = ([RUNS[0]], [RUNS[3]])
DTYPE_NAMES = {torch.float32: "float", torch.float16: "half", torch.bfloat16: "bfloat16"}

pytestmark = [
    pytest.mark.skipif(CUDA_INCLUDE is None, reason="CUDA toolkit headers not found (set CUDA_HOME)"),
    pytest.mark.skipif(shutil.which(CXX) is None, reason=f"no C++ compiler ({CXX})"),
]


@pytest.fixture(scope="session")
def programs():
    """build name -> the driver program (rebuilt when a kernel header, the emulator or the driver changes)."""
    return build_programs("kernels", EMULATED / "kernels.cpp", BUILDS, FLAGS, SOURCES)


@dataclass(frozen=True)
class Driver:
    programs: dict  # build name -> the driver program
    runs: list  # the (build, order, seed) runs of each case of this test: RUNS or one of SWEEP_RUNS
    # A parametrized test's case after its first: where a test says so, it runs a smaller batch of the same kinds of
    # sequences (the first case took the full one through every build and order).
    sweep: bool = False


@pytest.fixture
def driver(programs, request):
    """The driver programs, with the runs this test's cases take: RUNS for a test without parameters or the first
    case of a parametrized one, one of SWEEP_RUNS for its other cases."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is None or not any(callspec.indices.values()):
        return Driver(programs, RUNS)
    return Driver(programs, SWEEP_RUNS[sum(callspec.indices.values()) % 2], sweep=True)


# ---------------------------------------------------------------------------------------------------------------
# A case: tensors (views of buffers, written to files), scalars, and the buffers the kernels write.

@dataclass
class Case:
    op: str
    tensors: dict  # name -> tensor (CPU)
    scalars: dict = field(default_factory=dict)
    outputs: tuple = ()  # names of tensors whose buffers the kernels write
    dtype: torch.dtype = torch.float32

    def write(self, directory: Path) -> Path:
        """Writes the case file and its buffers (one per distinct storage) into `directory`."""
        lines = [f"op {self.op}", f"dtype {DTYPE_NAMES.get(self.dtype, 'float')}"]
        self.buffer_ids = {}
        for name, tensor in self.tensors.items():
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key not in self.buffer_ids:
                buffer_id = len(self.buffer_ids)
                self.buffer_ids[key] = buffer_id
                path = directory / f"buffer{buffer_id}.bin"
                # (bytes(storage) would copy byte by byte in Python: seconds for a few MB)
                torch.empty(0, dtype=torch.uint8).set_(storage).numpy().tofile(path)
                lines.append(f"buffer {buffer_id} {storage.nbytes()} {path}")
            offset = tensor.storage_offset() * tensor.element_size()
            lines.append(f"tensor {name} {self.buffer_ids[key]} {offset} {tensor.dim()} "
                         f"{' '.join(map(str, tensor.shape))} {' '.join(map(str, tensor.stride()))}")
        for name, value in self.scalars.items():
            lines.append(f"scalar {name} {value!r}")
        for name in self.outputs:
            buffer_id = self.buffer_ids[self.tensors[name].untyped_storage().data_ptr()]
            lines.append(f"output {buffer_id} {directory / f'out{buffer_id}.bin'}")
        path = directory / "case.txt"
        path.write_text("\n".join(lines) + "\n")
        return path

    def read_output(self, directory: Path, name: str) -> torch.Tensor:
        """The tensor `name` as the kernels left it, from its buffer written back by the driver."""
        tensor = self.tensors[name]
        buffer_id = self.buffer_ids[tensor.untyped_storage().data_ptr()]
        data = bytearray((directory / f"out{buffer_id}.bin").read_bytes())
        flat = torch.frombuffer(data, dtype=tensor.dtype) if data else torch.empty(0, dtype=tensor.dtype)
        return flat.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset()).clone()


def run_directory(tmp_path: Path, build: str, order: str) -> Path:
    """Where run_everywhere writes one run's case file and outputs."""
    return tmp_path / f"{build}-{order}"


def first_run_directory(driver: "Driver", tmp_path: Path) -> Path:
    """The directory of the run whose outputs run_everywhere returns (the driver's first)."""
    build, order, _ = driver.runs[0]
    return run_directory(tmp_path, build, order)


def run_everywhere(driver: Driver, case: Case, tmp_path: Path, names):
    """Runs the case in the driver's builds and orders (each run in a directory of its own, as parallel processes);
    returns the outputs of the first run after checking that every run is clean and gives the same bytes."""
    directories = [run_directory(tmp_path, build, order) for build, order, _ in driver.runs]
    case_files = []
    for directory in directories:
        directory.mkdir(exist_ok=True)
        case_files.append(case.write(directory))

    def run(index):
        build, order, seed = driver.runs[index]
        return subprocess.run([str(driver.programs[build]), str(case_files[index]), order, str(seed)],
                              capture_output=True, text=True, timeout=600,
                              env={**os.environ, "TSAN_OPTIONS": "atexit_sleep_ms=0"})

    with ThreadPoolExecutor(max_workers=min(len(driver.runs), os.cpu_count() or 1)) as pool:
        runs = list(pool.map(run, range(len(driver.runs))))
    results = []
    for (build, order, _), directory, done in zip(driver.runs, directories, runs):
        report = f"{build}/{order}: exit status {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-6000:]}"
        assert done.returncode == 0 and not SANITIZER_REPORT.search(done.stderr), report
        outputs = {name: case.read_output(directory, name) for name in names}
        if results:
            for name in names:
                assert_same_bits(outputs[name], results[0][name], f"{name}: {build}/{order} vs asan/forward")
        results.append(outputs)
    return results[0]


INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def assert_same_bits(a, b, what):
    """Equal bit patterns (so NaN equals the same NaN, and -0.0 differs from 0.0)."""
    bits = INT_OF_SIZE[a.element_size()]
    assert torch.equal(a.contiguous().view(bits), b.contiguous().view(bits)), what


# ---------------------------------------------------------------------------------------------------------------
# paged_attention

def relayout(key_cache, value_cache, layout):
    """The caches' contents (NaN where unset) in another memory layout: "packed", the K and V halves of vLLM's
    [num_blocks, block_size, num_kv_heads, 2 * head_dim] cache (head stride 2 * head_dim); "transposed", token and
    head dimensions swapped in memory ([num_blocks, num_kv_heads, block_size, head_dim] allocations)."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    if layout == "packed":
        alloc = torch.full((num_blocks, block_size, num_kv_heads, 2 * head_dim), NAN, dtype=key_cache.dtype)
        keys, values = alloc[..., :head_dim], alloc[..., head_dim:]
    else:
        assert layout == "transposed", layout
        keys, values = (torch.full((num_blocks, num_kv_heads, block_size, head_dim), NAN,
                                   dtype=key_cache.dtype).transpose(1, 2) for _ in range(2))
    keys.copy_(key_cache)
    values.copy_(value_cache)
    return keys, values


def attention_case(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, *, layout="contiguous",
                   alibi=False, sliding_window=None, soft_cap=None, split=False, partition_tokens=32, num_sms=1000,
                   blocks_per_sm=1, tensor_cores=True):
    query, key_cache, value_cache, block_tables, seq_lens_t = make_case(
        seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, "cpu",
        layout="contiguous" if layout in ("packed", "transposed") else layout)
    if layout in ("packed", "transposed"):
        key_cache, value_cache = relayout(key_cache, value_cache, layout)
    out = torch.full_like(query, NAN).contiguous()
    tensors = dict(out=out, query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                   seq_lens=seq_lens_t)
    if alibi:
        tensors["alibi_slopes"] = torch.rand(num_heads) * 0.2
    # split-KV is planned when the grid would underfill the GPU: many SMs (num_sms) force it, with one partition per
    # thread block; few SMs make thread blocks run several partitions; partitions longer than any sequence forbid it
    scalars = dict(scale=head_dim**-0.5, soft_cap=float(soft_cap or 0.0), sliding_window=int(sliding_window or 0),
                   num_sms=num_sms if split else 1, blocks_per_sm=blocks_per_sm,
                   partition_tokens=partition_tokens if split else 1 << 30)
    if not tensor_cores:  # as on a GPU below compute capability 8.0: the CUDA-core decode kernel for every dtype
        scalars["tensor_cores"] = 0
    return Case("attention", tensors, scalars, ("out",), dtype)


def check_attention(driver, case: Case, tmp_path):
    """The emulated output (every build and order the same bytes) against the reference (and a GPU's, where there is
    one); returns it."""
    t = case.tensors
    out = run_everywhere(driver, case, tmp_path, ["out"])["out"]
    expected = reference.paged_attention(
        t["query"], t["key_cache"], t["value_cache"], t["block_tables"], t["seq_lens"], scale=case.scalars["scale"],
        alibi_slopes=t.get("alibi_slopes"), sliding_window=case.scalars["sliding_window"] or None,
        logits_soft_cap=case.scalars["soft_cap"] or None, compute_dtype=torch.float64)
    torch.testing.assert_close(out.double(), expected.double(), **tolerance(case.dtype))
    if HAS_CUDA_OPS:  # where a GPU is present, the same kernels for real, on the same inputs
        cuda = {name: tensor.cuda() for name, tensor in t.items()}
        on_gpu = paged_attn.paged_attention(
            cuda["query"], cuda["key_cache"], cuda["value_cache"], cuda["block_tables"], cuda["seq_lens"],
            scale=case.scalars["scale"], alibi_slopes=cuda.get("alibi_slopes"),
            sliding_window=case.scalars["sliding_window"] or None, logits_soft_cap=case.scalars["soft_cap"] or None)
        torch.testing.assert_close(on_gpu.cpu().double(), out.double(), **tolerance(case.dtype))
    return out


HEAD_DIMS = [32, 64, 80, 96, 112, 120, 128, 192, 256]
# (num_heads, num_kv_heads): groups 1, 2, 3, 4, 8, 10, 16 (above 8: several thread blocks per kv head)
GROUPS = [(4, 4), (4, 2), (6, 2), (8, 2), (8, 1), (10, 1), (16, 1)]
BLOCK_SIZES = [8, 16, 32]


@pytest.mark.parametrize("dtype", list(DTYPE_NAMES), ids=list(DTYPE_NAMES.values()))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_attention_single_pass_every_head_dim(driver, tmp_path, dtype, head_dim):
    """Every dtype and head dim; groups and block sizes taken in turn; full and partial last blocks."""
    i = HEAD_DIMS.index(head_dim) + list(DTYPE_NAMES).index(dtype)
    num_heads, num_kv_heads = GROUPS[i % len(GROUPS)]
    block_size = BLOCK_SIZES[i % len(BLOCK_SIZES)]
    seq_lens = [1, 2 * block_size, 3 * block_size - 5]
    check_attention(driver, attention_case(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype), tmp_path)


@pytest.mark.parametrize("dtype", list(DTYPE_NAMES), ids=list(DTYPE_NAMES.values()))
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_attention_split_kv_across_partition_boundaries(driver, tmp_path, dtype, block_size):
    """Partitions of 32 tokens: lengths just below, at and past a boundary, several partitions, an empty sequence;
    the reduce kernel merges them."""
    seq_lens = [0, 31, 32, 33, 64, 97]
    check_attention(driver, attention_case(seq_lens, 8, 2, 64, block_size, dtype, split=True), tmp_path)


@pytest.mark.parametrize("split", [False, True], ids=["single_pass", "split_kv"])
@pytest.mark.parametrize("feature", ["alibi", "window", "soft_cap", "all"])
def test_attention_alibi_window_soft_cap(driver, tmp_path, feature, split):
    """ALiBi, a sliding window (20 tokens: in split mode whole partitions before it are empty), soft cap."""
    kwargs = dict(alibi=feature in ("alibi", "all"), sliding_window=20 if feature in ("window", "all") else None,
                  soft_cap=5.0 if feature in ("soft_cap", "all") else None)
    case = attention_case([5, 20, 21, 100, 130], 8, 2, 128, 16, torch.bfloat16, split=split, **kwargs)
    check_attention(driver, case, tmp_path)


@pytest.mark.parametrize("num_heads, num_kv_heads", GROUPS, ids=[f"group{h // k}" for h, k in GROUPS])
def test_attention_every_group_size_split_and_strided(driver, tmp_path, num_heads, num_kv_heads):
    """Groups 1 to 16 (above 8: several thread blocks per kv head), caches as the two halves of one allocation and the
    query a slice of a fused QKV tensor, split-KV."""
    case = attention_case([1, 45, 70], num_heads, num_kv_heads, 64, 8, torch.float16, layout="strided", split=True)
    check_attention(driver, case, tmp_path)


def decode_kernel_run(driver, case: Case, tmp_path):
    """The driver's report of the decode launch (one run, ASan build): which kernel and plan it took."""
    case_file = case.write(tmp_path)
    done = subprocess.run([str(driver.programs["asan"]), str(case_file), "forward", "0"], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


@pytest.mark.parametrize("dtype, head_dim, tensor_cores, expected", [
    (torch.float16, 128, True, "tensor cores"), (torch.bfloat16, 64, True, "tensor cores"),
    (torch.bfloat16, 256, True, "tensor cores"), (torch.float16, 120, True, "group variant"),
    (torch.float32, 128, True, "group variant"), (torch.bfloat16, 128, False, "group variant")],
    ids=["half128", "bf16_64", "bf16_256", "half120_no_instantiation", "float32", "bf16_below_sm80"])
def test_decode_kernel_choice(driver, tmp_path, dtype, head_dim, tensor_cores, expected):
    """float16 / bfloat16 with a cache of the same dtype at a head dim of DecodeMmaHeadDims take the tensor-core
    decode kernel (decode_mma_kernels.cuh); other dtypes and head dims, and GPUs without mma.sync, the CUDA-core
    kernel. (The other tests rely on this choice to cover both kernels.)"""
    case = attention_case([5, 40], 8, 2, head_dim, 16, dtype, tensor_cores=tensor_cores)
    assert expected in decode_kernel_run(driver, case, tmp_path)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["half", "bfloat16"])
@pytest.mark.parametrize("split", [False, True], ids=["single_pass", "split_kv"])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (8, 2), (16, 1)], ids=["group1", "group4", "group16"])
def test_attention_cuda_core_kernel_for_half_and_bfloat16(driver, tmp_path, dtype, split, num_heads, num_kv_heads):
    """The CUDA-core decode kernel, which float16 / bfloat16 take on GPUs below compute capability 8.0 (and for head
    dims without a tensor-core instantiation): the tensor-core kernel has taken over the other tests' 16-bit cases."""
    case = attention_case([1, 33, 70], num_heads, num_kv_heads, 128, 16, dtype, split=split, alibi=True,
                          soft_cap=5.0, sliding_window=50, tensor_cores=False)
    check_attention(driver, case, tmp_path)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("window", [None, 37], ids=["no_window", "window37"])
def test_attention_tensor_cores_tiles_and_pipeline(driver, tmp_path, block_size, window):
    """The tensor-core decode kernel's 16-token tiles: sequences shorter than a tile, ending inside one or at its
    edge, long enough for each warp's two-stage pipeline to wrap many times (200 tokens: 13 tiles over 4 warps),
    windows and partitions of 24 tokens that start inside a tile, block size 8 (two cache blocks per tile)."""
    seq_lens = [3, 16, 47, 200]
    for split in (False, True):
        case = attention_case(seq_lens, 8, 1, 64, block_size, torch.bfloat16, sliding_window=window, split=split,
                              partition_tokens=24)
        directory = tmp_path / ("split" if split else "single")
        directory.mkdir()
        check_attention(driver, case, directory)


def decode_plan(case: Case, num_items=None):
    """The plan the driver launches the decode kernels with (the same plan_attention, through the test hook)."""
    t, scalars = case.tensors, case.scalars
    return paged_attn._C._launch_plan(
        "paged_attention", num_items or t["block_tables"].shape[0], t["query"].shape[1], t["key_cache"].shape[2],
        t["block_tables"].shape[1], t["key_cache"].shape[1], scalars["sliding_window"], scalars["num_sms"],
        scalars["blocks_per_sm"], scalars["partition_tokens"], 0, scalars.get("batch_invariant", 0))


def widen_block_table(case: Case, width):
    """The case's block table, `width` entries per row: garbage (an index past the cache) past its blocks."""
    table = case.tensors["block_tables"]
    wide = torch.full((table.shape[0], width), 10**6, dtype=torch.int32)
    wide[:, :table.shape[1]] = table
    case.tensors["block_tables"] = wide


def test_attention_many_partitions_and_wide_block_tables(driver, tmp_path):
    """Partitions of 4 tokens: 300 of them (the reduce's row groups take many each), and block tables far wider than
    the sequences: the partitions past a sequence's end are never run or read (their NaN-filled records stay
    NaN). The plan's slots (grid.z) are half the partitions: each thread block runs two, of the long sequence."""
    case = attention_case([1100, 3, 0], 4, 2, 32, 8, torch.float32, split=True, partition_tokens=4)
    widen_block_table(case, 150)  # 1200 tokens: 300 partitions
    plan = decode_plan(case)
    assert plan["num_partitions"] == 300 and plan["grid"][2] == 150
    check_attention(driver, case, tmp_path)


@pytest.mark.parametrize("feature", ["plain", "alibi", "soft_cap", "both"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float", "bf16"])
def test_attention_cuda_core_several_tiles_per_partition(driver, tmp_path, dtype, feature):
    """The CUDA-core decode kernel over sequences of several 256-token tiles in one partition (single pass): each
    tile's row tables (step 0) and its ALiBi positions (step 2) are its own, not the first tile's; lengths at and
    just past a tile's end. ALiBi and soft cap each alone, and together."""
    case = attention_case([700, 257, 256, 513], 4, 2, 64, 16, dtype, alibi=feature in ("alibi", "both"),
                          soft_cap=5.0 if feature in ("soft_cap", "both") else None, tensor_cores=False)
    check_attention(driver, case, tmp_path)


@pytest.mark.parametrize("window", [None, 50], ids=["no_window", "window50"])
def test_attention_partitions_looped_inside_a_thread_block(driver, tmp_path, window):
    """Few SMs: the plan's slots (grid.z = 4) are fewer than the partitions a sequence needs (the table's 336 tokens:
    11 partitions of 32; 10 for the sequence of 300), so each thread block runs partitions z, z + 4, z + 8 from fresh
    accumulators; with a window, the partitions before it are skipped (a block may start at its second or third
    one, or have none)."""
    case = attention_case([300, 45, 130], 4, 1, 64, 16, torch.bfloat16, sliding_window=window, split=True,
                          num_sms=4, blocks_per_sm=1)
    plan = decode_plan(case)
    assert (plan["num_partitions"], plan["partition_size"], plan["grid"]) == (11, 32, (3, 1, 4))
    check_attention(driver, case, tmp_path)


@pytest.mark.parametrize("num_sms,blocks_per_sm,size", [(10, 2, 192), (6, 2, 320)], ids=["192", "320"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float", "bf16"])
def test_attention_partition_sizes_of_the_default_plan(driver, tmp_path, num_sms, blocks_per_sm, size, dtype):
    """The default plan's partition sizes (multiples of 64 tokens up to 512, by shape): 192 and 320 tokens, across
    the CUDA-core kernel's 256-token tiles (float32) and the tensor-core kernel's 4 warps of 16-token tiles (bf16),
    for sequences ending inside a partition, at its edge, and in the first one; with a window of 300 that starts
    inside a partition."""
    for window in (None, 300):
        case = attention_case([1000, 576, 3], 4, 1, 64, 16, dtype, sliding_window=window, split=True,
                              partition_tokens=512, num_sms=num_sms, blocks_per_sm=blocks_per_sm)
        table_tokens = case.tensors["block_tables"].shape[1] * 16
        plan = decode_plan(case)
        assert plan["partition_size"] == size and plan["num_partitions"] == -(-table_tokens // size), plan
        directory = tmp_path / str(window)
        directory.mkdir()
        check_attention(driver, case, directory)


def rows_of(case: Case, rows, width=None, **scalars) -> Case:
    """The attention case of some of `case`'s sequences (same caches), their tables cut to `width` blocks."""
    t = dict(case.tensors)
    t["query"], t["seq_lens"] = t["query"][rows].contiguous(), t["seq_lens"][rows].contiguous()
    t["block_tables"] = t["block_tables"][rows][:, :width].contiguous()
    t["out"] = torch.full_like(t["query"], NAN)
    return Case("attention", t, {**case.scalars, **scalars}, ("out",), case.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float", "bf16"])
def test_batch_invariant_rows_have_the_same_bits_in_any_batch(driver, tmp_path, dtype):
    """set_batch_invariant's plan (the scalar batch_invariant = 1; CUDA-core kernel for float32, tensor cores for
    bf16): a 700-token row gets the same bits alone (its table 44 blocks wide) on 1 SM and on 1000, in a batch
    with longer and shorter rows (a table of 125 blocks), and in that batch reordered on 1 SM; checked against the
    reference once. Without it the plans of the first two differ (single pass, split-KV) and so do the row's bits."""
    full = attention_case([40, 700, 2000, 5], 4, 2, 64, 16, dtype, split=True, partition_tokens=512, num_sms=1000)
    runs = {  # name: (rows, table width, num_sms)
        "alone, 1 SM": ([1], 44, 1), "alone, 1000 SMs": ([1], 44, 1000), "in the batch": ([0, 1, 2, 3], None, 1000),
        "reordered, 1 SM": ([2, 3, 1], None, 1)}
    outputs = {}
    for invariant in (1, 0):
        for name, (rows, width, num_sms) in runs.items():
            if not invariant and name not in ("alone, 1 SM", "alone, 1000 SMs"):
                continue
            case = rows_of(full, rows, width, num_sms=num_sms, blocks_per_sm=1, batch_invariant=invariant)
            plan = decode_plan(case)
            assert (plan["partition_size"] == 512 and plan["num_partitions"] >= 2) or not invariant, plan
            directory = tmp_path / f"{name.replace(' ', '_').replace(',', '')}-{invariant}"
            directory.mkdir()
            if name == "in the batch":  # the reference once
                out = check_attention(driver, case, directory)
            else:
                out = run_everywhere(driver, case, directory, ["out"])["out"]
            outputs[name, invariant] = out[rows.index(1)]
    for name in runs:
        assert_same_bits(outputs[name, 1], outputs["alone, 1 SM", 1], f"the 700-token row {name} vs alone, 1 SM")
    assert not torch.equal(outputs["alone, 1 SM", 0], outputs["alone, 1000 SMs", 0]), (
        "without batch invariance the single pass and split-KV gave the same bits: the test shows nothing")


def test_attention_block_table_much_wider_than_the_sequences(driver, tmp_path):
    """A table of 1600 tokens (50 partitions) for sequences of at most 70: the plan sizes the scratch for 50
    partitions but launches 2 slots (2 SMs x 2 blocks for 6 blocks per slot), and the blocks find the few partitions
    with tokens and stop (the table's garbage entries past the sequences are never read)."""
    case = attention_case([40, 70, 5], 8, 2, 128, 8, torch.float16, split=True, num_sms=2, blocks_per_sm=2)
    widen_block_table(case, 200)
    plan = decode_plan(case)
    assert (plan["num_partitions"], plan["grid"]) == (50, (3, 2, 2))
    check_attention(driver, case, tmp_path)


def test_attention_clamps_invalid_lengths(driver, tmp_path):
    """seq_lens past the block table's capacity, or negative (validation is opt-in on CUDA), read no entry past the
    row: the block table is allocated at its exact size, so AddressSanitizer would report it. The result is that
    of the capacity (and of length 0)."""
    case = attention_case([40, 9], 4, 4, 64, 16, torch.float16, split=True)
    t = case.tensors
    table = t["block_tables"]
    table[0, :] = table[0, 0]  # a full block, read again and again: every token of the capacity is valid
    t["seq_lens"] = torch.tensor([10**6, -5], dtype=torch.int32)
    out = run_everywhere(driver, case, tmp_path, ["out"])["out"]
    clamped = torch.tensor([table.shape[1] * 16, 0], dtype=torch.int32)
    expected = reference.paged_attention(t["query"], t["key_cache"], t["value_cache"], table, clamped,
                                         compute_dtype=torch.float64)
    torch.testing.assert_close(out.double(), expected.double(), **tolerance(torch.float16))


def test_attention_huge_window_means_every_token(driver, tmp_path):
    """A window wider than int32 (the kernels' int) covers every token, as on the CPU."""
    case = attention_case([40, 77], 4, 4, 32, 16, torch.float32, sliding_window=2**40)
    check_attention(driver, case, tmp_path)


@pytest.mark.parametrize("split", [False, True], ids=["single_pass", "split_kv"])
@pytest.mark.parametrize("layout", ["packed", "transposed"])
def test_attention_strided_cache_layouts(driver, tmp_path, layout, split):
    """Caches with strided rows: the K and V halves of vLLM's packed cache, and token and head dimensions swapped."""
    case = attention_case([3, 40, 77], 8, 2, 64, 16, torch.bfloat16, layout=layout, split=split)
    check_attention(driver, case, tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# paged_attention with query_start_loc: the tensor-core kernel (float16/bfloat16) next to the decode kernels for the
# one-row sequences, and the decode kernels for every row (float32, head dims without a tensor-core kernel, or
# every_row=True).

def varlen_case(specs, num_heads, num_kv_heads, head_dim, block_size, dtype, *, layout="contiguous", alibi=False,
                sliding_window=None, soft_cap=None, every_row=False, split=False, partition_tokens=32, num_sms=1000,
                blocks_per_sm=1):
    """specs: (seq_len, query_len) per sequence (test_varlen_attention.make_varlen_case: NaN in unused slots and
    blocks, garbage past each block-table row's blocks)."""
    query, key_cache, value_cache, block_tables, seq_lens, starts = make_varlen_case(
        specs, num_heads, num_kv_heads, head_dim, block_size, dtype, "cpu",
        "contiguous" if layout == "transposed" else layout)
    if layout == "transposed":
        key_cache, value_cache = relayout(key_cache, value_cache, layout)
    out = torch.full(query.shape, NAN, dtype=dtype)
    tensors = dict(out=out, query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                   seq_lens=seq_lens, query_start_loc=starts)
    if alibi:
        tensors["alibi_slopes"] = torch.rand(num_heads) * 0.5
    scalars = dict(scale=head_dim**-0.5, soft_cap=float(soft_cap or 0.0), sliding_window=int(sliding_window or 0),
                   num_sms=num_sms if split else 1, blocks_per_sm=blocks_per_sm,
                   partition_tokens=partition_tokens if split else 1 << 30, every_row=int(every_row))
    return Case("attention", tensors, scalars, ("out",), dtype)


def check_varlen(driver, case: Case, tmp_path):
    t, scalars = case.tensors, case.scalars
    out = run_everywhere(driver, case, tmp_path, ["out"])["out"]
    kwargs = dict(scale=scalars["scale"], alibi_slopes=t.get("alibi_slopes"),
                  sliding_window=scalars["sliding_window"] or None, logits_soft_cap=scalars["soft_cap"] or None)
    expected = reference.paged_attention(t["query"], t["key_cache"], t["value_cache"], t["block_tables"],
                                         t["seq_lens"], query_start_loc=t["query_start_loc"],
                                         compute_dtype=torch.float64, **kwargs)
    assert not out.isnan().any(), "a row was not written, or a NaN-poisoned slot leaked in"
    torch.testing.assert_close(out.double(), expected.double(), **tolerance(case.dtype))
    if HAS_CUDA_OPS:  # where a GPU is present, the same kernels for real, on the same inputs
        cuda = {name: tensor.cuda() for name, tensor in t.items()}
        cuda_kwargs = dict(kwargs, alibi_slopes=cuda.get("alibi_slopes"))
        on_gpu = paged_attn.paged_attention(cuda["query"], cuda["key_cache"], cuda["value_cache"],
                                            cuda["block_tables"], cuda["seq_lens"],
                                            query_start_loc=cuda["query_start_loc"], **cuda_kwargs)
        torch.testing.assert_close(on_gpu.cpu().double(), out.double(), **tolerance(case.dtype))
    return out


# MIXED (test_varlen_attention): a whole prompt, a decode, an empty sequence, a chunk after a cached prefix, a prompt
# of exactly two blocks, a sequence without query rows, a long chunk over several tiles and key steps, a decode.
# The decode kernels take one thread block per query row (and kv head) on the every-row path, which the emulator
# runs slowly: that path gets fewer rows (the same kinds of sequences).
EVERY_ROW_MIXED = [(37, 20), (50, 1), (0, 0), (70, 13), (32, 2), (5, 0), (33, 1)]
# MIXED's kinds of sequences with a shorter long chunk (70 rows after 60 cached tokens: still several tiles and key
# steps, a quarter of the work): the fp8 tests' batch, and a sweep's cases after the first (Driver.sweep).
SHORT_MIXED = [(37, 37), (50, 1), (0, 0), (70, 13), (32, 32), (5, 0), (130, 70), (33, 1)]
@pytest.mark.parametrize("dtype, head_dim", [(torch.bfloat16, 128), (torch.float16, 64), (torch.bfloat16, 80),
                                             (torch.float16, 256), (torch.bfloat16, 96), (torch.float32, 64),
                                             (torch.float16, 120)],
                         ids=["bf16-128", "half-64", "bf16-80", "half-256", "bf16-96",
                              "float-64 (decode kernel per row)", "half-120 (no tensor-core kernel)"])
def test_varlen_mixed_batch(driver, tmp_path, dtype, head_dim):
    every_row = dtype == torch.float32 or head_dim == 120
    specs = EVERY_ROW_MIXED if every_row else SHORT_MIXED if driver.sweep else MIXED
    check_varlen(driver, varlen_case(specs, 8, 2, head_dim, 16, dtype), tmp_path)


@pytest.mark.parametrize("num_heads, num_kv_heads", GROUPS + [(80, 1)],
                         ids=[f"group{h // k}" for h, k in GROUPS] + ["group80 (two thread blocks)"])
def test_varlen_every_group_size(driver, tmp_path, num_heads, num_kv_heads):
    """Query tiles of 64 (token, head) rows: 64 tokens of one head down to one token of 40 heads (group 80: two
    thread blocks); groups that do not divide 64 leave rows unused."""
    specs = [(45, 45), (9, 1), (70, 23)]
    check_varlen(driver, varlen_case(specs, num_heads, num_kv_heads, 64, 8, torch.float16), tmp_path)


@pytest.mark.parametrize("layout", ["contiguous", "halves", "packed", "transposed"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_varlen_block_sizes_and_cache_layouts(driver, tmp_path, block_size, layout):
    specs = [(33, 33), (100, 17), (64, 1), (7, 0)]
    check_varlen(driver, varlen_case(specs, 4, 2, 64, block_size, torch.bfloat16, layout=layout), tmp_path)


@pytest.mark.parametrize("feature", ["alibi", "window7", "window64", "soft_cap", "all"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "float"])
def test_varlen_alibi_window_soft_cap(driver, tmp_path, feature, dtype):
    """ALiBi, sliding windows (7: tiles whose rows see different first keys, key steps seen by no row of a warp;
    64: one key step), soft cap; each query row's position is its own."""
    window = {"window7": 7, "window64": 64, "all": 20}.get(feature)
    specs = EVERY_ROW_MIXED if dtype == torch.float32 else SHORT_MIXED if driver.sweep else MIXED
    case = varlen_case(specs, 8, 2, 64, 16, dtype, layout="packed", alibi=feature in ("alibi", "all"),
                       sliding_window=window, soft_cap={"soft_cap": 5.0, "all": 30.0}.get(feature))
    check_varlen(driver, case, tmp_path)


@pytest.mark.parametrize("dtype, head_dim, window, features", [
    (torch.bfloat16, 64, 150, False),   # 64-key steps: masked, unmasked (the plain loop), masked again
    (torch.float16, 128, 150, True),    # the same through the loop with soft cap and ALiBi
    (torch.bfloat16, 256, 40, False),   # 16-key steps
], ids=["bf16-64-window150", "half-128-window150-alibi-soft_cap", "bf16-256-window40"])
def test_varlen_masked_and_unmasked_key_steps(driver, tmp_path, dtype, head_dim, window, features):
    """The tensor-core kernel runs a tile's masked key steps (the window's start, the causal diagonal) in one loop
    and the steps every row sees in others: with a window longer than a tile's rows plus a key step, a tile has
    masked steps before and after its unmasked ones (the first masked loop jumps over them), and the long prompt's
    first tiles have unmasked steps only before the diagonal."""
    specs = [(300, 120), (200, 200), (90, 3)]
    case = varlen_case(specs, 8, 2, head_dim, 16, dtype, layout="packed", alibi=features, sliding_window=window,
                       soft_cap=30.0 if features else None)
    check_varlen(driver, case, tmp_path)


@pytest.mark.parametrize("dtype", list(DTYPE_NAMES), ids=list(DTYPE_NAMES.values()))
def test_varlen_every_row_split_kv(driver, tmp_path, dtype):
    """The decode kernels for every query row (each row's sequence by binary search), split-KV and the reduce."""
    case = varlen_case([(0, 0), (75, 40), (33, 1), (130, 3)], 8, 2, 64, 8, dtype, every_row=True, split=True,
                       alibi=True, sliding_window=50)
    check_varlen(driver, case, tmp_path)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "float"])
def test_varlen_one_row_per_sequence_is_exactly_decode(driver, tmp_path, dtype):
    """query_start_loc = arange: the decode kernels serve every row, so the bits equal the call without it."""
    case = varlen_case([(1, 1), (17, 1), (64, 1), (200, 1), (3, 1)], 8, 2, 128, 16, dtype, layout="halves")
    out = check_varlen(driver, case, tmp_path)
    decode = Case("attention", {k: v for k, v in case.tensors.items() if k != "query_start_loc"}, case.scalars,
                  ("out",), dtype)
    decode.tensors["out"] = torch.full_like(decode.tensors["out"], NAN)
    decode_dir = tmp_path / "decode"
    decode_dir.mkdir()
    assert_same_bits(run_everywhere(driver, decode, decode_dir, ["out"])["out"], out, "decode vs query_start_loc")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "float"])
def test_varlen_invalid_query_start_loc_stays_in_bounds(driver, tmp_path, dtype):
    """query_start_loc past num_tokens and decreasing, a sequence with more query rows than tokens (validation is
    opt-in on CUDA): every buffer is allocated at its exact size, so a read or write past one is a sanitizer report.
    Each row is written once (the same bits in every thread order), and the valid sequence's rows are right."""
    case = varlen_case([(40, 10), (12, 12), (30, 6)], 4, 2, 64, 16, dtype)
    t = case.tensors
    assert t["query"].shape[0] == 28
    # sequence 1: rows 10-27 (clamped), 3 tokens: most rows sit before position 0; sequence 2: decreasing, no rows
    t["query_start_loc"] = torch.tensor([0, 10, 10**6, 5], dtype=torch.int32)
    t["seq_lens"] = torch.tensor([40, 3, 10**6], dtype=torch.int32)
    out = run_everywhere(driver, case, tmp_path, ["out"])["out"]
    assert not out.isnan().any()
    expected = reference.paged_attention(t["query"][:10], t["key_cache"], t["value_cache"], t["block_tables"][:1],
                                         t["seq_lens"][:1], query_start_loc=torch.tensor([0, 10], dtype=torch.int32),
                                         compute_dtype=torch.float64)
    torch.testing.assert_close(out[:10].double(), expected.double(), **tolerance(dtype))


# ---------------------------------------------------------------------------------------------------------------
# reshape_and_cache and copy_blocks: moved bytes must be exactly the reference's

def check_reshape_and_cache(driver, tmp_path, key, value, key_cache, value_cache, slots):
    """reshape_and_cache on the emulated kernel (every order, the sanitizers): the caches equal the reference's, bit
    for bit."""
    case = Case("reshape_and_cache", dict(key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                                          slot_mapping=slots), dict(element_size=key.element_size()),
                ("key_cache", "value_cache"), key.dtype)
    out = run_everywhere(driver, case, tmp_path, ["key_cache", "value_cache"])
    expected_key, expected_value = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, expected_key, expected_value, slots)
    assert_same_bits(out["key_cache"], expected_key, "key_cache")
    assert_same_bits(out["value_cache"], expected_value, "value_cache")


@pytest.mark.parametrize("dtype, head_dim", [(torch.float32, 64), (torch.float16, 128), (torch.bfloat16, 80),
                                             (torch.float16, 6), (torch.bfloat16, 3)],
                         ids=["float-64", "half-128", "bf16-80", "half-6 (8-byte units)", "bf16-3 (2-byte units)"])
@pytest.mark.parametrize("layout", ["contiguous", "fused_qkv", "padded_heads", "head_major"])
def test_reshape_and_cache(driver, tmp_path, dtype, head_dim, layout):
    """Keys/values contiguous, slices of a fused QKV projection, rows padded (head stride > head_dim) or head-major
    (token stride < head stride); slots scattered, some skipped (-1)."""
    num_tokens, num_kv_heads, num_blocks, block_size = 11, 2, 5, 4
    if layout == "fused_qkv":
        qkv = torch.randn(num_tokens, 4 + 2 * num_kv_heads, head_dim).to(dtype)
        key, value = qkv[:, 4:4 + num_kv_heads], qkv[:, 4 + num_kv_heads:]
    elif layout == "padded_heads":
        key = torch.randn(num_tokens, num_kv_heads, head_dim + 8).to(dtype)[..., :head_dim]
        value = torch.randn(num_tokens, num_kv_heads, head_dim + 8).to(dtype)[..., :head_dim]
    elif layout == "head_major":
        key = torch.randn(num_kv_heads, num_tokens, head_dim).to(dtype).transpose(0, 1)
        value = torch.randn(num_kv_heads, num_tokens, head_dim).to(dtype).transpose(0, 1)
    else:
        key = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
        value = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), NAN, dtype=dtype)
    value_cache = torch.full_like(key_cache, NAN)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[[2, 7]] = -1
    check_reshape_and_cache(driver, tmp_path, key, value, key_cache, value_cache, slots)


@pytest.mark.parametrize("num_layers", [3, 130], ids=["3_layers", "130_layers (two launches)"])
def test_copy_blocks(driver, tmp_path, num_layers):
    """Copies in every layer, also past the 128 layers one launch carries; the halves layout for the values."""
    shape = (6, 4, 2, 16)
    key_caches = [torch.randn(shape, dtype=torch.bfloat16) for _ in range(num_layers)]
    value_caches = [torch.randn((6, 2) + shape[1:], dtype=torch.bfloat16)[:, 1] for _ in range(num_layers)]
    mapping = torch.tensor([[0, 3], [5, 1], [2, 4]])
    tensors = {f"key_caches.{i}": cache for i, cache in enumerate(key_caches)}
    tensors.update({f"value_caches.{i}": cache for i, cache in enumerate(value_caches)})
    tensors["block_mapping"] = mapping
    case = Case("copy_blocks", tensors, dict(num_layers=num_layers, element_size=2), tuple(tensors)[:-1],
                torch.bfloat16)
    out = run_everywhere(driver, case, tmp_path, list(tensors)[:-1])
    expected_keys, expected_values = [c.clone() for c in key_caches], [c.clone() for c in value_caches]
    reference.copy_blocks(expected_keys, expected_values, mapping)
    for i in range(num_layers):
        assert_same_bits(out[f"key_caches.{i}"], expected_keys[i], f"key_caches[{i}]")
        assert_same_bits(out[f"value_caches.{i}"], expected_values[i], f"value_caches[{i}]")


def test_copy_blocks_of_latent_caches(driver, tmp_path):
    """One cache per layer (MLA's latent caches, value_caches=[]: the launch's grid.z is 1), every pair copied."""
    caches = [torch.randn(6, 4, 1, 72, dtype=torch.bfloat16) for _ in range(2)]  # [num_blocks, block_size, 1, row]
    mapping = torch.tensor([[0, 3], [5, 1]])
    tensors = {f"key_caches.{i}": cache for i, cache in enumerate(caches)}
    tensors["block_mapping"] = mapping
    case = Case("copy_blocks", tensors, dict(num_layers=2, element_size=2), tuple(tensors)[:-1], torch.bfloat16)
    out = run_everywhere(driver, case, tmp_path, list(tensors)[:-1])
    expected = [c.clone() for c in caches]
    reference.copy_blocks(expected, [], mapping)
    for i in range(2):
        assert_same_bits(out[f"key_caches.{i}"], expected[i], f"key_caches[{i}]")


@pytest.mark.parametrize("dtype, head_dim", [(torch.float32, 64), (torch.bfloat16, 3)],
                         ids=["float-64", "bf16-3 (2-byte units)"])
@pytest.mark.parametrize("layout", ["packed", "transposed"])
def test_reshape_and_cache_into_strided_caches(driver, tmp_path, dtype, head_dim, layout):
    """Caches with strided rows (vLLM's packed K|V halves, one allocation; token and head dimensions transposed):
    each token's rows land in their slots and nothing else changes."""
    num_tokens, num_kv_heads, num_blocks, block_size = 9, 2, 5, 4
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache, value_cache = relayout(torch.full(shape, NAN, dtype=dtype), torch.full(shape, NAN, dtype=dtype), layout)
    key = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[3] = -1
    check_reshape_and_cache(driver, tmp_path, key, value, key_cache, value_cache, slots)


def test_copy_blocks_strided_views_copy_only_their_rows(driver, tmp_path):
    """Layer 0: the K and V halves of one packed allocation; layer 1: transposed caches. Each view's rows move (the
    two packed halves together cover their allocation, so every byte of it is compared)."""
    shape = (6, 4, 2, 16)
    packed_key, packed_value = relayout(torch.randn(shape, dtype=torch.bfloat16),
                                        torch.randn(shape, dtype=torch.bfloat16), "packed")
    t_key, t_value = relayout(torch.randn(shape, dtype=torch.bfloat16), torch.randn(shape, dtype=torch.bfloat16),
                              "transposed")
    mapping = torch.tensor([[0, 3], [5, 1], [2, 4]])
    tensors = {"key_caches.0": packed_key, "key_caches.1": t_key, "value_caches.0": packed_value,
               "value_caches.1": t_value, "block_mapping": mapping}
    case = Case("copy_blocks", tensors, dict(num_layers=2, element_size=2), tuple(tensors)[:-1], torch.bfloat16)
    out = run_everywhere(driver, case, tmp_path, list(tensors)[:-1])
    expected_keys, expected_values = [packed_key.clone(), t_key.clone()], [packed_value.clone(), t_value.clone()]
    reference.copy_blocks(expected_keys, expected_values, mapping)
    for i in range(2):
        assert_same_bits(out[f"key_caches.{i}"], expected_keys[i], f"key_caches[{i}]")
        assert_same_bits(out[f"value_caches.{i}"], expected_values[i], f"value_caches[{i}]")


def test_copy_blocks_of_one_packed_half_leaves_the_other_alone(driver, tmp_path):
    """Only the K half of a packed cache is copied (the V 'cache' is a separate allocation): the V rows between the
    K rows of a destination block keep their NaN."""
    num_blocks, block_size, num_kv_heads, head_dim = 6, 4, 2, 16
    alloc = torch.randn(num_blocks, block_size, num_kv_heads, 2 * head_dim, dtype=torch.bfloat16)
    alloc[4:, ..., head_dim:] = NAN  # the destinations' V rows (a copy of the whole block span would fill them)
    key = alloc[..., :head_dim]
    other_value = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.bfloat16)
    mapping = torch.tensor([[1, 4], [2, 5]])
    tensors = {"key_caches.0": key, "value_caches.0": other_value, "block_mapping": mapping}
    case = Case("copy_blocks", tensors, dict(num_layers=1, element_size=2), ("key_caches.0", "value_caches.0"),
                torch.bfloat16)
    run_everywhere(driver, case, tmp_path, ["key_caches.0"])
    buffer_id = case.buffer_ids[alloc.untyped_storage().data_ptr()]
    data = bytearray((first_run_directory(driver, tmp_path) / f"out{buffer_id}.bin").read_bytes())
    after = torch.frombuffer(data, dtype=torch.bfloat16).view(alloc.shape)
    expected = alloc.clone()
    expected[4, ..., :head_dim] = alloc[1, ..., :head_dim]
    expected[5, ..., :head_dim] = alloc[2, ..., :head_dim]
    assert_same_bits(after, expected, "the packed allocation")


# ---------------------------------------------------------------------------------------------------------------
# merge_attention_states: the merge of attention over keys [0, k) and [k, n) against the float64 reference merge of
# the same parts (within one rounding of the dtype), the edges (-inf, +inf, NaN) as documented in paged_attn/ops.py

@pytest.mark.parametrize("dtype, num_heads, head_dim", [(torch.float32, 5, 64), (torch.float16, 4, 128),
                                                        (torch.bfloat16, 3, 40)],
                         ids=["float-5x64 (a spare warp)", "half-4x128", "bf16-3x40 (lanes past head_dim)"])
def test_merge_attention_states(driver, tmp_path, dtype, num_heads, head_dim):
    """Random split points per row; rows with edges: a part with no key (-inf), a +inf part (it dominates), both
    parts empty, a NaN lse, a NaN value. out lives in a NaN-filled wider allocation (nothing else may be written), lse_b is vLLM's
    [num_heads, num_tokens] layout transposed, lse too."""
    num_tokens, num_keys = 6, 40
    query = torch.randn(num_tokens, num_heads, head_dim, dtype=torch.float64)
    keys = torch.randn(num_keys, num_heads, head_dim, dtype=torch.float64)
    values = torch.randn(num_keys, num_heads, head_dim, dtype=torch.float64)
    out_a, lse_a = reference.attention_with_lse(query, keys[:17], values[:17])
    out_b, lse_b = reference.attention_with_lse(query, keys[17:], values[17:])
    out_a, out_b, lse_a, lse_b = out_a.to(dtype), out_b.to(dtype), lse_a.float(), lse_b.float()
    lse_a[1, 0] = -math.inf
    lse_b[1, 1] = math.inf
    lse_a[2, 0], lse_b[2, 0] = -math.inf, -math.inf
    lse_a[3, 2] = NAN
    out_b[4, 1, 3] = NAN
    out_alloc = torch.full((num_tokens, num_heads + 1, head_dim), NAN, dtype=dtype)
    lse_alloc = torch.full((num_heads, num_tokens), NAN)
    lse_b_heads_first = lse_b.t().contiguous()
    tensors = dict(out=out_alloc[:, 1:], lse=lse_alloc.t(), out_a=out_a, lse_a=lse_a, out_b=out_b,
                   lse_b=lse_b_heads_first.t())
    case = Case("merge_attention_states", tensors, {}, ("out", "lse"), dtype)
    result = run_everywhere(driver, case, tmp_path, ["out", "lse"])
    want_out, want_lse = reference.merge_attention_states(out_a, lse_a, out_b, lse_b)
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(result["out"], want_out, rtol=tol, atol=tol, equal_nan=True)
    torch.testing.assert_close(result["lse"], want_lse, rtol=1e-6, atol=1e-6, equal_nan=True)
    assert (result["out"][2, 0] == 0).all() and result["lse"][2, 0] == -math.inf
    assert torch.equal(result["out"][1, 1], out_b[1, 1]) and result["lse"][1, 1] == math.inf
    assert result["out"][3, 2].isnan().all() and result["lse"][3, 2].isnan()
    assert result["out"].isnan().sum() == head_dim + 1  # the NaN lse's row and the one NaN value
    buffer_id = case.buffer_ids[out_alloc.untyped_storage().data_ptr()]
    data = bytearray((first_run_directory(driver, tmp_path) / f"out{buffer_id}.bin").read_bytes())
    assert torch.frombuffer(data, dtype=dtype).view(out_alloc.shape)[:, 0].isnan().all()


# ---------------------------------------------------------------------------------------------------------------
# fp8 caches (float8_e4m3fn, float8_e5m2; float32 / float16 / bfloat16 queries): attention against the reference on
# the dequantized caches, reshape_and_cache's bytes against reference.quantize_fp8 (test_fp8.py's checks). Unused
# slots hold the NaN byte. With query_start_loc the launches of csrc/cuda/attention.cpp: the tensor-core kernel for
# float16 / bfloat16 queries, the decode kernels for every row with float32 queries.

FP8_FORMATS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}  # the driver's fp8_format scalar


def fp8_attention(case: Case, fp8, query_dtype) -> Case:
    """The case with its caches quantized into fp8 (same layout, NaN bytes elsewhere) and its query in query_dtype."""
    from test_fp8 import to_fp8

    t = case.tensors
    k_scale, v_scale = torch.tensor([0.05]), torch.tensor([0.2])
    t["key_cache"], t["value_cache"] = to_fp8((t["key_cache"], t["value_cache"]), fp8, (k_scale, v_scale))
    t["k_scale"], t["v_scale"] = k_scale, v_scale
    t["query"] = t["query"].to(query_dtype)
    t["out"] = torch.full(t["query"].shape, NAN, dtype=query_dtype)
    case.scalars["fp8_format"] = FP8_FORMATS[fp8]
    case.dtype = query_dtype
    return case


def check_fp8_attention(driver, case: Case, tmp_path):
    t, scalars = case.tensors, case.scalars
    out = run_everywhere(driver, case, tmp_path, ["out"])["out"]
    kwargs = dict(scale=scalars["scale"], alibi_slopes=t.get("alibi_slopes"),
                  sliding_window=scalars["sliding_window"] or None, logits_soft_cap=scalars["soft_cap"] or None,
                  query_start_loc=t.get("query_start_loc"))
    keys = reference.dequantize_fp8(t["key_cache"], t["k_scale"], torch.float64)
    values = reference.dequantize_fp8(t["value_cache"], t["v_scale"], torch.float64)
    expected = reference.paged_attention(t["query"], keys, values, t["block_tables"], t["seq_lens"],
                                         compute_dtype=torch.float64, **kwargs)
    assert not out.isnan().any(), "a row was not written, or a NaN-poisoned slot leaked in"
    torch.testing.assert_close(out.double(), expected.double(), **tolerance(case.dtype))
    if HAS_CUDA_OPS:  # where a GPU is present, the same kernels for real, on the same inputs
        cuda = {name: tensor.cuda() for name, tensor in t.items()}
        cuda_kwargs = dict(kwargs, alibi_slopes=cuda.get("alibi_slopes"), query_start_loc=cuda.get("query_start_loc"))
        on_gpu = paged_attn.paged_attention(cuda["query"], cuda["key_cache"], cuda["value_cache"],
                                            cuda["block_tables"], cuda["seq_lens"], k_scale=cuda["k_scale"],
                                            v_scale=cuda["v_scale"], **cuda_kwargs)
        torch.testing.assert_close(on_gpu.cpu().double(), out.double(), **tolerance(case.dtype))


@pytest.mark.parametrize("fp8", list(FP8_FORMATS), ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype, heads, head_dim, split", [
    (torch.bfloat16, (8, 2), 128, False),   # group 4: 8-byte vectors of 8 values, 8 rows per batch
    (torch.float16, (8, 1), 64, True),      # group 8; split-KV and the reduce
    (torch.bfloat16, (4, 4), 80, True),     # group 1: 16-byte vectors of 16 values
    (torch.float16, (16, 1), 256, False),   # two thread blocks of 8 heads
    (torch.float32, (8, 2), 128, True),     # float32 queries: group 4, split-KV
    (torch.float32, (4, 4), 64, False),     # float32 queries: group 1
], ids=["bf16-group4-128", "half-group8-64-split", "bf16-group1-80-split", "half-group16-256", "float-group4-128-split",
        "float-group1-64"])
def test_fp8_attention(driver, tmp_path, fp8, dtype, heads, head_dim, split):
    case = attention_case([1, 31, 33, 70], *heads, head_dim, 16, torch.float32, split=split)
    check_fp8_attention(driver, fp8_attention(case, fp8, dtype), tmp_path)


@pytest.mark.parametrize("layout", ["packed", "transposed"])
def test_fp8_attention_features_and_strided_caches(driver, tmp_path, layout):
    """ALiBi, a window and soft cap together, split-KV, on strided caches."""
    case = attention_case([5, 20, 21, 100], 8, 2, 64, 8, torch.float32, layout=layout, alibi=True, sliding_window=20,
                          soft_cap=30.0, split=True)
    check_fp8_attention(driver, fp8_attention(case, torch.float8_e4m3fn, torch.bfloat16), tmp_path)


@pytest.mark.parametrize("fp8, dtype, head_dim, feature", [
    (torch.float8_e4m3fn, torch.bfloat16, 128, "alibi"),
    (torch.float8_e5m2, torch.float16, 64, "sliding_window"),
    (torch.float8_e4m3fn, torch.float16, 256, "soft_cap"),
    (torch.float8_e5m2, torch.bfloat16, 80, None),
], ids=["e4m3-bf16-128-alibi", "e5m2-half-64-window", "e4m3-half-256-soft_cap", "e5m2-bf16-80"])
def test_fp8_varlen_tensor_cores(driver, tmp_path, fp8, dtype, head_dim, feature):
    """query_start_loc with float16 / bfloat16 queries: the tensor-core kernel (the fp8 values converted into shared
    memory) next to the decode kernels, on vLLM's packed layout (prompts, chunks, decodes, empty sequences)."""
    features = dict(alibi=dict(alibi=True), sliding_window=dict(sliding_window=30), soft_cap=dict(soft_cap=30.0))
    case = varlen_case(SHORT_MIXED, 8, 2, head_dim, 16, torch.float32, layout="packed", **features.get(feature, {}))
    check_fp8_attention(driver, fp8_attention(case, fp8, dtype), tmp_path)


@pytest.mark.parametrize("fp8, dtype", [(torch.float8_e5m2, torch.float32), (torch.float8_e4m3fn, torch.float16)],
                         ids=["e5m2-float", "e4m3-half-every_row"])
def test_fp8_varlen_every_row(driver, tmp_path, fp8, dtype):
    """query_start_loc through the decode kernels for every row: float32 queries, and every_row=True."""
    case = varlen_case(EVERY_ROW_MIXED, 8, 2, 64, 16, torch.float32, layout="packed", alibi=True, sliding_window=30,
                       every_row=dtype != torch.float32)
    check_fp8_attention(driver, fp8_attention(case, fp8, dtype), tmp_path)


@pytest.mark.parametrize("fp8", list(FP8_FORMATS), ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", list(DTYPE_NAMES), ids=list(DTYPE_NAMES.values()))
@pytest.mark.parametrize("layout", ["contiguous", "packed"])
def test_fp8_reshape_and_cache(driver, tmp_path, fp8, dtype, layout):
    """Quantized bytes against reference.quantize_fp8 (ties counted), values over many binades with +-0, NaN, +-inf
    and exact ties planted; keys and values slices of a fused QKV tensor; unwritten slots keep their NaN byte."""
    from test_fp8 import NAN_BYTE, assert_quantized, plant_specials, poisoned, spread_values

    num_tokens, num_kv_heads, head_dim, num_blocks, block_size = 9, 2, 32, 5, 4
    qkv = spread_values((num_tokens, 3 * num_kv_heads, head_dim), dtype, "cpu")
    key, value = qkv[:, num_kv_heads:2 * num_kv_heads], qkv[:, 2 * num_kv_heads:]
    plant_specials(key, value)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if layout == "packed":
        alloc = poisoned(shape[:3] + (2 * head_dim,), fp8)
        key_cache, value_cache = alloc[..., :head_dim], alloc[..., head_dim:]
    else:
        key_cache, value_cache = poisoned(shape, fp8), poisoned(shape, fp8)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[3] = -1  # (token 0, with the special values, is written)
    k_scale, v_scale = torch.tensor([0.37]), torch.tensor([2.5])
    case = Case("reshape_and_cache", dict(key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                                          slot_mapping=slots, k_scale=k_scale, v_scale=v_scale),
                dict(element_size=key.element_size(), fp8_format=FP8_FORMATS[fp8]), ("key_cache", "value_cache"),
                dtype)
    out = run_everywhere(driver, case, tmp_path, ["key_cache", "value_cache"])
    keep = slots >= 0
    blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
    ties = assert_quantized(out["key_cache"][blocks, offsets], key[keep], k_scale, fp8)
    ties += assert_quantized(out["value_cache"][blocks, offsets], value[keep], v_scale, fp8)
    assert ties <= 2, f"{ties} ties rounded the other way"
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[keep]] = True
    for name in ("key_cache", "value_cache"):
        rest = out[name].reshape(num_blocks * block_size, -1)[~written]
        assert (rest.view(torch.uint8) == NAN_BYTE).all(), f"{name}: a slot that was not written changed"


# ---------------------------------------------------------------------------------------------------------------
# NaN and inf in keys and values: a row must never see a non-finite key or value outside the keys it attends to
# (after its position, before its window, in unused slots), while one it does see must reach it (as in the
# reference, which sums over exactly each row's visible keys). The planted tokens share key tiles, partitions and
# thread blocks with visible ones: a masked probability of 0 times a NaN or inf value is NaN, and a NaN logit added
# to (not replaced by) the mask stays NaN.

INF = float("inf")
# The values planted, in turn: (cache, value); one element of kv head 0 per planted token.
NONFINITE = [("value_cache", NAN), ("key_cache", INF), ("value_cache", -INF), ("key_cache", NAN),
             ("value_cache", INF), ("key_cache", -INF)]
FP8_BYTES = {torch.float8_e4m3fn: {NAN: 0x7F},  # e4m3 has no inf: NaN there too
             torch.float8_e5m2: {NAN: 0x7F, INF: 0x7C, -INF: 0xFC}}


def sequences(case: Case):
    """(seq_len, query rows) of each sequence: one row per sequence without query_start_loc."""
    t = case.tensors
    lens = t["seq_lens"].tolist()
    if "query_start_loc" not in t:
        return [(n, 1) for n in lens]
    starts = t["query_start_loc"].tolist()
    return [(n, starts[s + 1] - starts[s]) for s, n in enumerate(lens)]


def set_element(cache, index, value, fp8):
    if fp8 is None:
        cache[index] = value
    else:
        cache.view(torch.uint8)[index] = FP8_BYTES[fp8].get(value, FP8_BYTES[fp8][NAN])


def plant_nonfinite(case: Case, *, visible=(), fp8=None):
    """Plants NONFINITE values, in turn, into the keys or values of: without a window, each multi-row sequence's last
    token (seen by its last row only) and, with 4 or more rows, the token of its middle row (seen from there on);
    with a window, every token t with t % 16 == 5 (seen by the rows t to t + window - 1: rows before them, in the same
    tile, and after them, with t before their window, must not see it) but those every row sees. visible:
    (sequence, cache, value) planted in the sequence's last token, which its last row sees. The unused slots of each
    partially filled last block become +inf (keys) and -inf (values) instead of NaN (e4m3: NaN)."""
    t = case.tensors
    window = case.scalars["sliding_window"]
    block_size = t["key_cache"].shape[1]
    head_dim = t["key_cache"].shape[3]
    planted = 0
    for s, (seq_len, rows) in enumerate(sequences(case)):
        if window:
            tokens = [token for token in range(seq_len)
                      if token % 16 == 5 and not seq_len - window <= token < seq_len - rows]
        else:
            tokens = [seq_len - 1] if rows >= 2 else []
            if rows >= 4:
                tokens.append(seq_len - rows + rows // 2)
        plants = [(token, *NONFINITE[(planted + i) % len(NONFINITE)]) for i, token in enumerate(tokens)]
        planted += len(plants)
        plants += [(seq_len - 1, cache, value) for seq, cache, value in visible if seq == s]
        for token, cache, value in plants:
            block = t["block_tables"][s, token // block_size]
            set_element(t[cache], (block, token % block_size, 0, (7 * planted + token) % head_dim), value, fp8)
        if seq_len % block_size:
            block, first = t["block_tables"][s, seq_len // block_size], seq_len % block_size
            set_element(t["key_cache"], (block, slice(first, None)), INF, fp8)
            set_element(t["value_cache"], (block, slice(first, None)), -INF, fp8)
    return case


def check_nonfinite(driver, case: Case, tmp_path, fp8=None):
    """The kernels' output against the reference's, NaN and inf included (the same elements in both); the planted
    values must reach some rows and not others."""
    t, scalars = case.tensors, case.scalars
    out = run_everywhere(driver, case, tmp_path, ["out"])["out"]
    keys, values, kwargs = t["key_cache"], t["value_cache"], {}
    if fp8 is not None:
        keys = reference.dequantize_fp8(keys, t["k_scale"], torch.float64)
        values = reference.dequantize_fp8(values, t["v_scale"], torch.float64)
    expected = reference.paged_attention(
        t["query"], keys, values, t["block_tables"], t["seq_lens"], scale=scalars["scale"],
        sliding_window=scalars["sliding_window"] or None, logits_soft_cap=scalars["soft_cap"] or None,
        query_start_loc=t.get("query_start_loc"), compute_dtype=torch.float64)
    finite = expected.isfinite().all(-1)
    assert finite.any() and not finite.all(), "the planted values must reach some rows and not others"
    torch.testing.assert_close(out.double(), expected.double(), equal_nan=True, **tolerance(case.dtype))


@pytest.mark.parametrize("split", [False, True], ids=["single_pass-bf16", "split_kv-float"])
def test_attention_nonfinite_outside_the_window(driver, tmp_path, split):
    """Decode rows with a window of 20: NaN and inf before the window (in the window's first block and partition,
    and in partitions before it), and in unused slots; a visible NaN key (sequence 5: the only token of its last
    32-token partition) must give NaN."""
    dtype = torch.float32 if split else torch.bfloat16
    case = attention_case([5, 20, 21, 100, 130, 33], 8, 2, 64, 16, dtype, sliding_window=20, split=split)
    check_nonfinite(driver, plant_nonfinite(case, visible=[(5, "key_cache", NAN)]), tmp_path)


NONFINITE_SPECS = [(37, 37), (50, 1), (70, 13), (40, 2), (0, 0), (33, 1), (20, 4)]
NONFINITE_EVERY_ROW_SPECS = [(37, 12), (50, 1), (70, 5), (40, 2), (33, 1)]


@pytest.mark.parametrize("dtype, head_dim, window, every_row, split", [
    (torch.bfloat16, 128, None, False, False),  # the tensor-core kernel, keys after each row
    (torch.float16, 64, 7, False, False),      # the tensor-core kernel, a window of 7 (several per tile)
    (torch.bfloat16, 256, 20, False, False),   # the tensor-core kernel's 16-key steps
    (torch.float32, 64, 7, True, False),       # the decode kernels for every row
    (torch.bfloat16, 64, None, True, True),    # every row, split-KV and the reduce
], ids=["bf16-128", "half-64-window7", "bf16-256-window20", "float-64-every_row-window7", "bf16-every_row-split"])
def test_varlen_nonfinite_outside_each_rows_view(driver, tmp_path, dtype, head_dim, window, every_row, split):
    """query_start_loc: NaN and inf after each row's position (in the same tile and key step as the keys it sees),
    before its window, in unused slots; a visible NaN key in a decode row (sequence 1) must give NaN, as the last
    row of each multi-row sequence does (it sees the planted last token)."""
    specs = NONFINITE_EVERY_ROW_SPECS if every_row else NONFINITE_SPECS
    case = varlen_case(specs, 8, 2, head_dim, 16, dtype, layout="packed", sliding_window=window, every_row=every_row,
                       split=split)
    check_nonfinite(driver, plant_nonfinite(case, visible=[(1, "key_cache", NAN)]), tmp_path)


@pytest.mark.parametrize("fp8, dtype, window", [(torch.float8_e5m2, torch.bfloat16, None),
                                                (torch.float8_e4m3fn, torch.float16, 7)],
                         ids=["e5m2-bf16", "e4m3-half-window7"])
def test_fp8_varlen_nonfinite_outside_each_rows_view(driver, tmp_path, fp8, dtype, window):
    """The tensor-core kernel on fp8 caches (values converted into shared memory): NaN and inf bytes (e4m3: NaN
    only) outside each row's view."""
    case = varlen_case(NONFINITE_SPECS, 8, 2, 64, 16, torch.float32, sliding_window=window)
    case = fp8_attention(case, fp8, dtype)
    check_nonfinite(driver, plant_nonfinite(case, visible=[(1, "key_cache", NAN)], fp8=fp8), tmp_path, fp8)


# ---------------------------------------------------------------------------------------------------------------
# Attention sinks (gpt-oss) and the log-sum-exp (return_lse): both are applied where a row's state is final
# (row_sum and row_lse, attention_math.cuh): the single-pass ends of both decode kernels, split-KV's reduce (never a
# partition's record) and the tensor-core kernel's end; each is run here, against the float64 reference's out and
# lse, with the lse buffer NaN-filled (every row must be written).

def with_sinks_and_lse(case: Case, sinks, lse=True) -> Case:
    """The case with float32 sinks [num_heads] (or none) and, if lse, an lse output [num_tokens, num_heads]."""
    t = case.tensors
    if sinks is not None:
        t["sinks"] = sinks
    if lse:
        t["lse"] = torch.full(t["query"].shape[:2], NAN)
        case.outputs = (*case.outputs, "lse")
    return case


def random_sinks(num_heads, seed):
    """Sinks of the logits' size (about N(0, 1) here): each matters, none takes all; head 1 has none (-inf)."""
    sinks = torch.empty(num_heads).uniform_(-1.0, 4.0, generator=torch.Generator().manual_seed(seed))
    sinks[1] = -math.inf
    return sinks


def check_sinks_and_lse(driver, case: Case, tmp_path):
    """out (and lse, when the case has it) against the reference; returns the kernels' outputs."""
    from test_return_lse import lse_tolerance

    t, scalars = case.tensors, case.scalars
    names = ["out", "lse"] if "lse" in t else ["out"]
    results = run_everywhere(driver, case, tmp_path, names)
    keys, values = t["key_cache"], t["value_cache"]
    if "fp8_format" in scalars:
        keys = reference.dequantize_fp8(keys, t["k_scale"], torch.float64)
        values = reference.dequantize_fp8(values, t["v_scale"], torch.float64)
    kwargs = dict(scale=scalars["scale"], alibi_slopes=t.get("alibi_slopes"),
                  sliding_window=scalars["sliding_window"] or None, logits_soft_cap=scalars["soft_cap"] or None,
                  query_start_loc=t.get("query_start_loc"), sinks=t.get("sinks"))
    expected, expected_lse = reference.paged_attention(t["query"], keys, values, t["block_tables"], t["seq_lens"],
                                                       compute_dtype=torch.float64, return_lse=True, **kwargs)
    assert not results["out"].isnan().any(), "a row was not written, or a NaN-poisoned slot leaked in"
    torch.testing.assert_close(results["out"].double(), expected.double(), **tolerance(case.dtype))
    if "lse" in t:
        assert not results["lse"].isnan().any(), "a row's lse was not written"
        torch.testing.assert_close(results["lse"].double(), expected_lse, **lse_tolerance(case.dtype))
    if HAS_CUDA_OPS:  # where a GPU is present, the same kernels for real, on the same inputs
        cuda = {name: tensor.cuda() for name, tensor in t.items()}
        on_gpu, on_gpu_lse = paged_attn.paged_attention(
            cuda["query"], cuda["key_cache"], cuda["value_cache"], cuda["block_tables"], cuda["seq_lens"],
            k_scale=cuda.get("k_scale"), v_scale=cuda.get("v_scale"), return_lse=True,
            **dict(kwargs, alibi_slopes=cuda.get("alibi_slopes"), query_start_loc=cuda.get("query_start_loc"),
                   sinks=cuda.get("sinks")))
        torch.testing.assert_close(on_gpu.cpu().double(), results["out"].double(), **tolerance(case.dtype))
        if "lse" in t:
            torch.testing.assert_close(on_gpu_lse.cpu(), results["lse"], rtol=1e-5, atol=1e-5)
    return results


DECODE_KERNELS = {  # name -> (dtype, num_heads, num_kv_heads, head_dim, tensor_cores)
    "cuda_core-float": (torch.float32, 8, 2, 64, True),
    "tensor_cores-bf16": (torch.bfloat16, 8, 2, 128, True),
    "cuda_core-half-group16": (torch.float16, 16, 1, 64, False),  # two thread blocks per kv head
}


@pytest.mark.parametrize("split", [False, True], ids=["single_pass", "split_kv"])
@pytest.mark.parametrize("kernel", list(DECODE_KERNELS))
def test_decode_sinks_and_lse(driver, tmp_path, kernel, split):
    """Both decode kernels, single pass and split-KV (partitions of 32: the sink counted once, by the reduce), an
    empty sequence (out 0, lse = the sink), ALiBi, a window of 50 (whole partitions empty before it) and soft cap
    (the sink is not capped), a head without a sink."""
    dtype, num_heads, num_kv_heads, head_dim, tensor_cores = DECODE_KERNELS[kernel]
    case = attention_case([0, 5, 33, 97, 130], num_heads, num_kv_heads, head_dim, 16, dtype, split=split,
                          alibi=True, sliding_window=50, soft_cap=5.0, tensor_cores=tensor_cores)
    check_sinks_and_lse(driver, with_sinks_and_lse(case, random_sinks(num_heads, 1)), tmp_path)


@pytest.mark.parametrize("dtype, every_row", [(torch.bfloat16, False), (torch.float32, True)],
                         ids=["bf16-tensor_cores", "float-every_row-split_kv"])
def test_varlen_sinks_and_lse(driver, tmp_path, dtype, every_row):
    """query_start_loc: the tensor-core kernel's rows and the decode kernels' one-row sequences (bf16), or the
    decode kernels for every row with split-KV (float32); prompts, chunks, decodes, empty sequences, ALiBi, a window
    and soft cap."""
    specs = EVERY_ROW_MIXED if every_row else MIXED
    case = varlen_case(specs, 8, 2, 64, 16, dtype, layout="packed", alibi=True, sliding_window=20, soft_cap=30.0,
                       every_row=every_row, split=every_row)
    check_sinks_and_lse(driver, with_sinks_and_lse(case, random_sinks(8, 2)), tmp_path)


@pytest.mark.parametrize("query_start_loc", [False, True], ids=["decode", "varlen"])
def test_fp8_sinks_and_lse(driver, tmp_path, query_start_loc):
    """fp8 caches (v_scale applied with the sink's normalization): decode split-KV, and the tensor-core kernel."""
    if query_start_loc:
        case = varlen_case(SHORT_MIXED, 8, 2, 64, 16, torch.float32, sliding_window=30)
    else:
        case = attention_case([1, 31, 33, 70], 8, 2, 64, 16, torch.float32, split=True)
    case = fp8_attention(case, torch.float8_e4m3fn, torch.bfloat16)
    check_sinks_and_lse(driver, with_sinks_and_lse(case, random_sinks(8, 3)), tmp_path)


@pytest.mark.parametrize("kernel", ["cuda_core-float-split_kv", "tensor_cores-bf16", "varlen-bf16"])
def test_extreme_sinks_give_zeros_never_nan(driver, tmp_path, kernel):
    """+inf takes the whole softmax (out exactly 0, lse +inf); 1e30 and 88.8 (whose exp overflows float32) nearly
    all of it; -1e30 nothing; a row that sees no key gives out 0 and lse = the sink."""
    sinks = torch.tensor([math.inf, 1e30, 88.8, -1e30, -math.inf, 0.5, 3.0, math.inf])
    if kernel == "varlen-bf16":
        case = varlen_case([(40, 40), (9, 1), (0, 0), (70, 13)], 8, 2, 64, 16, torch.bfloat16)
    else:
        dtype = torch.float32 if kernel.startswith("cuda_core") else torch.bfloat16
        case = attention_case([0, 40, 70], 8, 2, 64, 16, dtype, split=kernel.endswith("split_kv"))
    results = check_sinks_and_lse(driver, with_sinks_and_lse(case, sinks), tmp_path)
    out, lse = results["out"], results["lse"]
    assert torch.equal(out[:, [0, 7]], torch.zeros_like(out[:, [0, 7]]))
    assert torch.equal(lse[:, [0, 7]], torch.full_like(lse[:, [0, 7]], math.inf))
    if kernel != "varlen-bf16":  # the decode row of the empty sequence
        assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(lse[0], sinks)


@pytest.mark.parametrize("split", [False, True], ids=["single_pass", "split_kv"])
def test_minus_inf_sinks_are_no_sinks_and_lse_alone(driver, tmp_path, split):
    """Sinks of -inf give the bits of no sinks, the lse included; the lse without sinks; sinks without the lse."""
    case = attention_case([0, 5, 33, 97], 8, 2, 128, 16, torch.bfloat16, split=split, sliding_window=50)
    for name in ("plain", "minus_inf", "no_lse"):
        (tmp_path / name).mkdir()
    plain = check_sinks_and_lse(driver, with_sinks_and_lse(case, None), tmp_path / "plain")
    runs = {}
    for name, sinks, lse in [("minus_inf", torch.full((8,), -math.inf), True), ("no_lse", random_sinks(8, 4), False)]:
        case.tensors.pop("lse", None), case.tensors.pop("sinks", None)
        case.outputs = ("out",)
        case.tensors["out"] = torch.full_like(case.tensors["out"], NAN)
        runs[name] = check_sinks_and_lse(driver, with_sinks_and_lse(case, sinks, lse), tmp_path / name)
    for name in ("out", "lse"):
        assert_same_bits(runs["minus_inf"][name], plain[name], f"{name}: sinks of -inf vs none")


# ---------------------------------------------------------------------------------------------------------------
# Shared blocks (csrc/cuda/shared_blocks.cuh): the tensor-core decode kernel with a plan of
# paged_attn.plan_shared_blocks, split-KV in partitions of 32 tokens.

def share_blocks(case, groups):
    """Makes rows share blocks: for each (rows, num_blocks) in groups, rows[1:] take rows[0]'s first num_blocks
    block-table entries (full blocks of rows[0]; the rows' own blocks there stay in the cache, unread)."""
    tables = case.tensors["block_tables"]
    for rows, num_blocks in groups:
        for row in rows[1:]:
            tables[row, :num_blocks] = tables[rows[0], :num_blocks]
    return case


def shared_tree_case(num_heads, num_kv_heads, dtype=torch.bfloat16, *, alibi=False, sliding_window=None,
                     soft_cap=None, sinks=False):
    """A tree of shared blocks (block size 16): rows 0-4 share a 128-token prompt, rows 0-2 also the next 64
    tokens (a fork), rows 0 and 1 the 32 after those (another); rows 5-7 share 96 tokens of their own; row 8 shares
    nothing; lengths end inside and on block boundaries. 4 rows per task at most (plan_shared_blocks: 8 head slots)."""
    seq_lens = [230, 251, 200, 150, 129, 140, 97, 113, 77]
    case = attention_case(seq_lens, num_heads, num_kv_heads, 64, 16, dtype, split=True, alibi=alibi,
                          sliding_window=sliding_window, soft_cap=soft_cap)
    share_blocks(case, [([0, 1, 2, 3, 4], 8), ([0, 1, 2], 12), ([0, 1], 14), ([5, 6, 7], 6)])
    if sinks:
        case = with_sinks_and_lse(case, random_sinks(num_heads, 1))
    return case


def with_plan(case, plan=None, **scalars):
    """The case with a shared-blocks plan (by default plan_shared_blocks of its own tables)."""
    t = case.tensors
    if plan is None:
        num_heads, num_kv_heads = t["query"].shape[1], t["key_cache"].shape[2]
        plan = paged_attn.plan_shared_blocks(t["block_tables"], t["seq_lens"], t["key_cache"].shape[1],
                                             num_queries_per_kv=num_heads // num_kv_heads, min_shared_tokens=32)
    return Case(case.op, {**t, "shared_plan": plan.contiguous()}, {**case.scalars, **scalars}, case.outputs,
                case.dtype)


def check_shared(driver, case, tmp_path, plan=None):
    """Runs the case with a plan and without: each output within the float64 reference's tolerance, and the same
    bits with the plan as without (a head slot's column of the mma, and its softmax, do not depend on the other
    slots'). Returns the plan."""
    shared = with_plan(case, plan)
    names = ["out", "lse"] if "lse" in case.tensors else ["out"]
    (tmp_path / "shared").mkdir()
    (tmp_path / "alone").mkdir()
    with_sharing = check_sinks_and_lse(driver, shared, tmp_path / "shared")
    # (without the plan in one run: the plan's runs must give its bits in every order and build anyway)
    alone = run_everywhere(Driver(driver.programs, RUNS[:1]), case, tmp_path / "alone", names)
    for name in names:
        assert_same_bits(with_sharing[name], alone[name], f"{name}: with the plan vs without")
    return shared.tensors["shared_plan"]


@pytest.mark.parametrize("num_heads, num_kv_heads, feature", [
    (4, 4, None), (4, 4, "alibi"), (4, 4, "window"), (4, 4, "soft_cap_sinks"),
    (8, 4, None), (8, 4, "alibi"), (6, 2, "window"), (6, 2, "soft_cap_sinks")])
def test_shared_blocks_tree(driver, tmp_path, num_heads, num_kv_heads, feature):
    """A tree of shared blocks at three depths and a second group, with MHA (8 rows per task), groups of 2 and 3
    (4 and 2 rows per task: 8 and 6 of the 8 head slots); ALiBi (each slot its row's position), a window of 100 (it
    starts inside the shared prompt for the longer rows: their listings fail the window rule and they read those
    blocks themselves), soft cap with sinks and lse (the reduce's)."""
    case = shared_tree_case(num_heads, num_kv_heads, alibi=feature == "alibi",
                            sliding_window=100 if feature == "window" else None,
                            soft_cap=5.0 if feature == "soft_cap_sinks" else None, sinks=feature == "soft_cap_sinks")
    plan = check_shared(driver, case, tmp_path)
    # the tree's nodes were found: 4 tasks, or with 2 rows per task 3 (rows 0-1, 3-4 and 6-7; rows 2 and 5 read
    # their shared blocks themselves, as few reads as any plan of 2 rows per task)
    assert plan.shape[0] >= 3, plan


def test_shared_blocks_serve_the_rows_they_list(driver, tmp_path):
    """Without the tasks' thread blocks (drop_shared_tasks), exactly the rows the tasks serve keep NaN records, so
    the outputs of those rows, and only those, are NaN: the rows' own thread blocks skip what a task computes, and
    the task computes it. With a window of 100 a task serves only the rows whose window starts at or before its
    range: rows 0 and 1 for the last 32 shared tokens, row 2 for the 64 before, row 6 (97 tokens) for its 96.
    With ALiBi a task serves the rows of its reference's length: rows 5-7 made 97 tokens long (as samples of one
    prompt are); of the other tasks (rows of different lengths) only the reference itself."""
    for name, window, alibi, served in (("plain", None, False, [0, 1, 2, 3, 4, 5, 6, 7]),
                                        ("window", 100, False, [0, 1, 2, 6]), ("alibi", None, True, [5, 6, 7])):
        base = shared_tree_case(4, 4, sliding_window=window, alibi=alibi)
        if alibi:
            base.tensors["seq_lens"][[5, 7]] = 97
        case = with_plan(base, drop_shared_tasks=1)
        directory = tmp_path / name
        directory.mkdir()
        out = run_everywhere(driver, case, directory, ["out"])["out"]
        nan_rows = [row for row in range(out.shape[0]) if out[row].isnan().any()]
        if alibi:
            served = sorted(set(served) | set(case.tensors["shared_plan"][:, 0].tolist()))
        assert nan_rows == served, (name, nan_rows, case.tensors["shared_plan"])


def deep_tree_case(shape, num_heads, num_kv_heads):
    """Trees deeper than a row's listings the kernel takes (8), block size 16, partitions of 32 tokens, each row
    ending in a partly filled block of its own. "caterpillar": 13 rows, row d leaves a shared prompt after 4 (d + 1)
    blocks (tests/ops' test_plan_shared_blocks.caterpillar): rows 8-12 lie in 9 to 12 of the tree's nodes.
    "twin_caterpillar": 24 rows, rows 2k and 2k + 1 leave it after 2 (k + 1) blocks: rows 22 and 23 lie in 12."""
    if shape == "caterpillar":
        _, lens = caterpillar(13, 4, 16)
        groups = [([12, d], 4 * (d + 1)) for d in range(12)]
    else:
        lens = torch.tensor([2 * (r // 2 + 1) * 16 + 1 + (5 * r) % 15 for r in range(24)])
        groups = [([23, r], 2 * (r // 2 + 1)) for r in range(23)]
    case = attention_case(lens.tolist(), num_heads, num_kv_heads, 64, 16, torch.bfloat16, split=True)
    return share_blocks(case, groups)


@pytest.mark.parametrize("shape, num_heads, num_kv_heads", [("caterpillar", 1, 1), ("twin_caterpillar", 2, 1)],
                         ids=["caterpillar-mha", "twin_caterpillar-gqa2"])
def test_shared_blocks_at_depth(driver, tmp_path, shape, num_heads, num_kv_heads):
    """The deepest rows of a deep tree keep their sharing: the plan lists no row more often than the kernel takes,
    the tasks serve every row (without the tasks' thread blocks, drop_shared_tasks, every row's output is NaN; a
    plan of the whole tree listed rows 8-12 of the caterpillar 9 to 12 times, and the kernel served them none of
    it), the same bits as without the plan, and (modelled from the plan with the kernel's rules: the emulator does
    not count reads) each partition that m rows hold is read ceil(m / rows_per_task) times per kv head."""
    case = deep_tree_case(shape, num_heads, num_kv_heads)
    t = case.tensors
    rows_per_task = 8 // (num_heads // num_kv_heads)
    plan = check_shared(driver, case, tmp_path)
    assert max(len(found) for found in listings(plan).values()) < MAX_ROW_LISTINGS, plan
    (tmp_path / "dropped").mkdir()
    dropped = with_plan(case, plan, drop_shared_tasks=1)
    out = run_everywhere(Driver(driver.programs, RUNS[:1]), dropped, tmp_path / "dropped", ["out"])["out"]
    assert [row for row in range(out.shape[0]) if out[row].isnan().any()] == list(range(out.shape[0])), plan
    reads = modelled_reads(plan, t["block_tables"], t["seq_lens"], 16, rows_per_task, partition_blocks=2)
    assert reads == fewest_possible_reads(t["block_tables"], t["seq_lens"], 16, rows_per_task, partition_blocks=2)

def test_shared_blocks_plan_of_other_tables_is_harmless(driver, tmp_path):
    """A plan made for other tables: rows moved (the plan's rows now hold other prefixes), a row whose shared blocks
    now differ in one entry, a row shortened below its task's range, a row listed in two overlapping tasks, a task
    past the table's width, out-of-range rows and references, a duplicate row. Every output is still right, and the
    same bits as without a plan, under the sanitizers."""
    case = shared_tree_case(4, 4)
    t = case.tensors
    plan = paged_attn.plan_shared_blocks(t["block_tables"], t["seq_lens"], 16, min_shared_tokens=32)
    tables = t["block_tables"]
    tables[[1, 5]] = tables[[5, 1]].clone()       # rows 1 and 5 swap their tables
    t["seq_lens"][[1, 5]] = t["seq_lens"][[5, 1]].clone()
    tables[3, 2] = tables[8, 0]                   # row 3's prompt differs in one block
    t["seq_lens"][4] = 40                         # row 4 ends inside the prompt
    width = tables.shape[1]
    extra = torch.tensor([
        [0, 0, 8, 2, 0, -1, -1, -1, -1, -1, -1],          # row 2 again, overlapping its own listing
        [0, 4, width + 3, 6, 7, -1, -1, -1, -1, -1, -1],  # past the table's width
        [99, 0, 8, 0, 1, -1, -1, -1, -1, -1, -1],         # a reference that is not a sequence
        [5, 0, 6, 5, 7, 7, 1000, -5, -1, -1, -1],         # a duplicate row, rows that are not sequences
    ], dtype=torch.int32)
    check_shared(driver, case, tmp_path, torch.cat([plan, extra]))


def test_shared_blocks_random_plans(driver, tmp_path):
    """Plans of random integers (rows, references and block ranges around the valid ones): right outputs, the same
    bits as without a plan, no sanitizer report."""
    generator = torch.Generator().manual_seed(5)
    case = shared_tree_case(8, 4, alibi=True)
    width = case.tensors["block_tables"].shape[1]
    plan = torch.randint(-2, 11, (24, 11), generator=generator, dtype=torch.int32)
    plan[:, 1] = torch.randint(-1, width, (24,), generator=generator)
    plan[:, 2] = plan[:, 1] + torch.randint(-1, width, (24,), generator=generator)
    check_shared(driver, case, tmp_path, plan)
