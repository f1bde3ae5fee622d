"""Proves that the emulated kernel tests bite: plants realistic bugs in copies of the CUDA kernels, runs the emulated
suite (tests/emulated/test_emulated_kernels.py, test_emulated_mla.py) on each, and reports which check caught it.

    .venv/bin/python tests/emulated/mutate.py [--only NAME ...] [--check]

Each mutant is one textual change to a copy of the repository's csrc/cuda and tests/ in a scratch folder (the
change must apply exactly once, so a mutant that no longer matches the source is reported, not silently skipped);
the suite there builds its own driver from the mutated headers and stops at the first failure. Takes about two
minutes per mutant on 2 cores (two sanitizer builds of the driver, then the cases up to the first failure).
The table it prints is recorded in tests/emulated/README.md.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ATTENTION = "csrc/cuda/attention_kernels.cuh"
PARAMS = "csrc/cuda/attention_params.cuh"  # the task geometry all three kernels share
MATH = "csrc/cuda/attention_math.cuh"  # their conversions, reductions and the end of a row
CACHE = "csrc/cuda/paged_cache.cuh"
CACHE_OPS = "csrc/cuda/cache_ops_kernels.cuh"
VARLEN = "csrc/cuda/varlen_attention_kernels.cuh"
DECODE_MMA = "csrc/cuda/decode_mma_kernels.cuh"
DECODE_MMA_TESTS = "tensor_cores_tiles or single_pass_every_head_dim"  # the tensor-core decode kernel's cases
VARLEN_TESTS = "varlen"  # pytest -k: the tensor-core kernel's mutants run only the variable-length tests
NONFINITE_TESTS = "nonfinite"  # and the NaN / inf mutants only the tests that plant them
SEVERAL_TILES_TESTS = "several_tiles"  # the CUDA-core decode over several tiles per partition
SINK_TESTS = "sinks or lse"  # the attention sinks' and the lse's mutants, their tests
SHARED = "csrc/cuda/shared_blocks.cuh"
SHARED_TESTS = "shared_blocks"  # the shared-blocks plan's mutants, its tests
MLA = "csrc/cuda/mla_kernels.cuh"
MLA_TESTS = "mla"  # the latent-attention kernel's mutants, its tests (test_emulated_mla.py)

# name -> (file, text, replacement[, pytest -k expression])
MUTANTS = {
    "missing __syncthreads between steps 1 and 2": (
        ATTENTION,
        "tile_logits<T, C, HEAD_DIM, GROUP>(logits_s, q, p, task, rs, key_rows_s, n);\n"
        "      __syncthreads();",
        "tile_logits<T, C, HEAD_DIM, GROUP>(logits_s, q, p, task, rs, key_rows_s, n);"),
    "missing __syncthreads between steps 0 and 1 (the row tables read while being written)": (
        ATTENTION,
        "tile_rows(key_rows_s, value_rows_s, p, task, tile_begin, n);\n      __syncthreads();",
        "tile_rows(key_rows_s, value_rows_s, p, task, tile_begin, n);"),
    "stale row tables: step 0 only for a partition's first tile": (
        ATTENTION,
        "      tile_rows(key_rows_s, value_rows_s, p, task, tile_begin, n);",
        "      if (tile_begin == task.begin) tile_rows(key_rows_s, value_rows_s, p, task, tile_begin, n);",
        SEVERAL_TILES_TESTS),
    "soft cap and ALiBi skipped when only one of them is on": (
        ATTENTION,
        "if (soft_cap || alibi) {  // uniform across the thread block",
        "if (soft_cap && alibi) {  // uniform across the thread block", SEVERAL_TILES_TESTS),
    "shuffle inside a divergent branch": (
        ATTENTION,
        "      dot = sum_over_lanes<R::LANES>(dot);  // every lane takes part, also past the tile's end\n"
        "      if (rs.row_lane == 0 && j < n) {",
        "      if (rs.row_lane == 0 && j < n) {\n        dot = sum_over_lanes<R::LANES>(dot);"),
    "off-by-one in the sliding window": (
        PARAMS,
        "seq_len > sliding_window ? seq_len - sliding_window : 0",
        "seq_len > sliding_window ? seq_len - sliding_window + 1 : 0"),
    "the reduce drops the last, partial split-KV partition": (
        ATTENTION,
        "const int last = static_cast<int>((static_cast<int64_t>(seq_len) + p.partition_size - 1) / p.partition_size);",
        "const int last = static_cast<int>(static_cast<int64_t>(seq_len) / p.partition_size);"),
    "out-of-bounds shared-memory index": (
        ATTENTION,
        "if (d < HEAD_DIM) partial_s[rs.row_group][g][d] = acc[g][i][e];",
        "if (d < HEAD_DIM) partial_s[rs.row_group + 1][g][d] = acc[g][i][e];"),
    "wrong stride: a token's rows as if one kv head": (
        CACHE,
        "return block(block_id) + offset * token_stride;",
        "return block(block_id) + offset * head_stride;"),
    "wrong stride: reshape_and_cache reads keys with the row length as head stride": (
        CACHE_OPS,
        "p.key_cache.slot_row(slot, head)[u] = key_src[head * p.key_head_stride + u];",
        "p.key_cache.slot_row(slot, head)[u] = key_src[head * head_units + u];"),
    "copy_blocks copies a strided view's block as one run (as if its rows were packed)": (
        CACHE_OPS,
        "  if (cache.packed_rows()) {  // uniform across the launch's thread block",
        "  if (true) {", "copy_blocks"),
    "tensor-core kernel: a causal bound off by one (a row sees the next token)": (
        VARLEN,
        "    return key <= row_pos && (W == 0",
        "    return key <= row_pos + 1 && (W == 0", VARLEN_TESTS),
    "tensor-core kernel: the last key step is skipped (key_end one short)": (
        VARLEN,
        "tile.key_end = max(tile.first_pos + tile.tokens, 0);",
        "tile.key_end = max(tile.first_pos + tile.tokens - 1, 0);", VARLEN_TESTS),
    "tensor-core kernel: O is not rescaled when a row's max grows": (
        VARLEN,
        "o[jd][0] *= rescale[0], o[jd][1] *= rescale[0], o[jd][2] *= rescale[1], o[jd][3] *= rescale[1];",
        "(void)rescale;", VARLEN_TESTS),
    "tensor-core kernel: V read with ldmatrix without .trans (V's rows taken as the B operand's columns)": (
        VARLEN,
        "ldmatrix_x4_trans(b, v_s + kk * 16 * ROW + v_lds + 8 * jd);",
        "ldmatrix_x4(b, v_s + kk * 16 * ROW + v_lds + 8 * jd);", VARLEN_TESTS),
    "tensor-core kernel: P's A fragment with its halves swapped (rows g + 8 for keys 8-15)": (
        VARLEN,
        "const uint32_t a[4] = {prob[2 * kk][0], prob[2 * kk][1], prob[2 * kk + 1][0], prob[2 * kk + 1][1]};",
        "const uint32_t a[4] = {prob[2 * kk][0], prob[2 * kk + 1][0], prob[2 * kk][1], prob[2 * kk + 1][1]};",
        VARLEN_TESTS),
    "tensor-core kernel: the row max shuffled over the wrong lanes (xor 4: another row's quad)": (
        VARLEN,
        "tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));",
        "tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 4));", VARLEN_TESTS),
    "tensor-core kernel: the step's K read without waiting for its copies (cp.async wait missing)": (
        VARLEN,
        "    cp_async_wait<1>();\n    if constexpr (S::kFp8) (void)own_rows(true, slot);",
        "    if constexpr (S::kFp8) (void)own_rows(true, slot);", VARLEN_TESTS),
    "tensor-core kernel: no barrier between V's wait and P V (other threads' copies unseen)": (
        VARLEN,
        "      __syncthreads();  // V visible; every warp is done with this step's K\n",
        "", VARLEN_TESTS),
    "tensor-core kernel: stale key rows (the next step's rows not computed)": (
        VARLEN,
        "    if (next >= 0) fill_rows(slot ^ 1, next);",
        "", VARLEN_TESTS),
    "tensor-core kernel: one masked step taken as unmasked (the causal bound of the unmasked steps one too far)": (
        VARLEN,
        "min(causal_room < 0 ? 0 : causal_room / N + 1, steps)",
        "min(causal_room < 0 ? 0 : causal_room / N + 2, steps)", VARLEN_TESTS),
    # NaN and inf outside a row's view (test_*nonfinite*: only those tests run)
    "tensor-core kernel: inf and NaN values not zeroed for the P V product (0 * NaN reaches masked rows)": (
        VARLEN,
        "*value = zero_nonfinite<T>(stored_value, unused);",
        "*value = stored_value;", NONFINITE_TESTS),
    "tensor-core kernel: the non-finite values' correction ignores the mask": (
        VARLEN,
        "const bool see0 = sees(pos[0], key), see1 = sees(pos[1], key);",
        "const bool see0 = true, see1 = true;", NONFINITE_TESTS),
    "tensor-core kernel: the mask added to the logits, not selected (a NaN logit survives it)": (
        VARLEN,
        "if constexpr (MASKED) logit = sees(pos[r], key) ? logit : -INFINITY;",
        "if constexpr (MASKED) logit += sees(pos[r], key) ? 0.0f : -INFINITY;", NONFINITE_TESTS),
    "decode kernel: a NaN sum (a visible NaN key) written as 0": (
        ATTENTION,
        "from_float(p.out[out_row * HEAD_DIM + d], o / row_sum(max_s[g], sum_s[g], sink));",
        "from_float(p.out[out_row * HEAD_DIM + d], sum_s[g] > 0.0f ? o / row_sum(max_s[g], sum_s[g], sink) : 0.0f);",
        NONFINITE_TESTS),
    "the reduce skips partitions of weight 0 (a NaN partition whose max is -inf)": (
        ATTENTION,
        "      total += w * s[u];",
        "      if (w == 0.0f) continue;\n      total += w * s[u];", NONFINITE_TESTS),
    # the tensor-core decode kernel (decode_mma_kernels.cuh): its cp.async pipeline and fragments
    "tensor-core decode: the tile is read without waiting for its copies": (
        DECODE_MMA,
        "    cp_async_wait<1>();  // this tile's group",
        "    // cp_async_wait<1>();  // this tile's group", DECODE_MMA_TESTS),
    "tensor-core decode: the wait leaves the tile's own group pending (wait<2>)": (
        DECODE_MMA,
        "    cp_async_wait<1>();  // this tile's group",
        "    cp_async_wait<2>();  // this tile's group", DECODE_MMA_TESTS),
    "tensor-core decode: no __syncwarp between the copies' wait and the warp's reads of them": (
        DECODE_MMA,
        "    __syncwarp();        // and every lane's copies of it are visible to the whole warp",
        "", DECODE_MMA_TESTS),
    "tensor-core decode: no __syncwarp before the next tile is copied over the stage just read": (
        DECODE_MMA,
        "    __syncwarp();  // every lane is done with this stage before the next iteration copies into it",
        "", DECODE_MMA_TESTS),
    "tensor-core decode: stale block-table entries (the prefetched tile's entries not reloaded)": (
        DECODE_MMA,
        "        next_blocks = load_tile_blocks(block_table, next + kDecodeWarps, task.end, block_shift);\n"
        "      }\n    }",
        "      }\n    }", DECODE_MMA_TESTS),
    "tensor-core decode: P^T not transposed (the accumulator layout taken as the B layout)": (
        DECODE_MMA,
        "{movmatrix_trans(pack2<T>(x[0], x[1])), movmatrix_trans(pack2<T>(x[2], x[3]))}",
        "{pack2<T>(x[0], x[1]), pack2<T>(x[2], x[3])}", DECODE_MMA_TESTS),
    "tensor-core decode: the accumulators not rescaled when the running max grows": (
        DECODE_MMA,
        "    state.acc[j][0] *= rescale[0], state.acc[j][1] *= rescale[1];\n"
        "    state.acc[j][2] *= rescale[0], state.acc[j][3] *= rescale[1];",
        "    (void)rescale;", DECODE_MMA_TESTS),
    # thread blocks that run several partitions (the plan's grid.z below a sequence's partitions)
    "a thread block's later partitions start from the running max and sum of the one before": (
        ATTENTION,
        "    if (static_cast<int>(threadIdx.x) < GROUP) {\n      max_s[threadIdx.x] = -INFINITY",
        "    if (partition < static_cast<int>(gridDim.z) && static_cast<int>(threadIdx.x) < GROUP) {\n"
        "      max_s[threadIdx.x] = -INFINITY", "partition or wide"),
    "with a window, a thread block starts at the window's first partition, not at its own next one": (
        ATTENTION,
        "if (partition < first) partition += (first - partition + gridDim.z - 1) / gridDim.z * gridDim.z;",
        "if (partition < first) partition = first;", "partition or wide"),
    # attention sinks (gpt-oss) and the lse: counted once per row, where its state is final
    "split-KV: the sink counted in every partition's record (and again by the reduce)": (
        ATTENTION,
        "if (d == 0) p.partial_max[slot] = max_s[g], p.partial_sum[slot] = sum_s[g];",
        "if (d == 0) p.partial_max[slot] = max_s[g],\n"
        "        p.partial_sum[slot] = row_sum(max_s[g], sum_s[g], sink_of(p.sinks, task.first_head + g));",
        SINK_TESTS),
    "the reduce drops the sink": (
        ATTENTION,
        "const float sink = sink_of(p.sinks, head), row_total",
        "const float sink = -INFINITY, row_total", SINK_TESTS),
    "decode kernel: the sink soft-capped like a logit": (
        ATTENTION,
        "      const float sink = sink_of(p.sinks, task.first_head + g);",
        "      const float sink = p.logits_soft_cap > 0.0f\n"
        "          ? p.logits_soft_cap * tanhf(sink_of(p.sinks, task.first_head + g) / p.logits_soft_cap)\n"
        "          : sink_of(p.sinks, task.first_head + g);", SINK_TESTS),
    "tensor-core decode: the sink dropped": (
        DECODE_MMA,
        "const float sink = sink_of(p.sinks, task.first_head + slot);",
        "const float sink = -INFINITY;", SINK_TESTS),
    "tensor-core kernel: the sink dropped": (
        VARLEN,
        "const float sink = sink_of(p.sinks, head);",
        "const float sink = -INFINITY;", SINK_TESTS),
    "the lse without the row's max (log of the sum only)": (
        MATH,
        "  return base + __logf(fmaf(w, sum, e));",
        "  return __logf(fmaf(w, sum, e));", SINK_TESTS),
    "an empty decode row's lse left unwritten": (
        MATH,
        "  if (p.lse != nullptr && static_cast<int>(threadIdx.x) < task.num_heads) {",
        "  if (false) {", SINK_TESTS),
    "shared blocks: a dropped merge (a task's partition records not written)": (
        DECODE_MMA,
        "      if (item < 0) continue;  // a task's slot without a row",
        "      if (item < 0 || task_block) continue;  // a task's slot without a row", SHARED_TESTS),
    "shared blocks: a row mapped to the wrong task (it skips the next task's partitions)": (
        SHARED,
        "    if (!listing_fits(p, s, 0, listing)) continue;\n    const SharedRange range = shared_range(p, task);",
        "    if (!listing_fits(p, s, 0, listing)) continue;\n"
        "    const SharedRange range = shared_range(p, (task + 1) % p.num_shared_tasks);", SHARED_TESTS),
    "shared blocks: a plan applied to other tables (the block-table check dropped)": (
        SHARED, "  return __syncthreads_and(same);", "  return __syncthreads_and(true);", SHARED_TESTS),
    "shared blocks: a window that starts inside a task's range not checked": (
        SHARED, "      window_start(seq_len, p.sliding_window) > range.begin * ps ||\n", "", SHARED_TESTS),
    "shared blocks: ALiBi rows of another length than the reference's served": (
        SHARED, " ||\n      (p.alibi_slopes != nullptr && seq_len != clamped_seq_len(p, ref))", "", SHARED_TESTS),
    "MLA: the rope part of the row dropped from the logits": (
        MLA, "  for (int k = 0; k < L::KSTEPS; k += 2) {", "  for (int k = 0; k < LORA / 16; k += 2) {", MLA_TESTS),
    "MLA: values read past kv_lora_rank (columns shifted by 8)": (
        MLA, "L::PAD_ROW + L::COLS * warp + 8 * (lane / 16);", "L::PAD_ROW + L::COLS * warp + 8 * (lane / 16) + 8;",
        MLA_TESTS),
    "MLA: a wrong head-to-row mapping (heads g and g + 8 swapped on output)": (
        MLA, "    const int head = task.first_head + slot;",
        "    const int head = task.first_head + (slot ^ 8) % task.num_heads;", MLA_TESTS),
    "MLA: a missing merge (a warp's sum alone, not the four warps')": (
        MLA, "    for (int w = 0; w < kMlaWarps; ++w) total += sum_s[w][slot];", "    total = sum_s[warp][slot];",
        MLA_TESTS),
    "MLA: O not rescaled when the reference max moves": (
        MLA, "    state.acc[j][0] *= factor[0], state.acc[j][1] *= factor[0];\n"
        "    state.acc[j][2] *= factor[1], state.acc[j][3] *= factor[1];\n", "", MLA_TESTS),
    "MLA: a stage read before its wait": (
        MLA, "        cp_async_wait<0>();\n        __syncthreads();  // the step's rows",
        "        cp_async_wait<1>();\n        __syncthreads();  // the step's rows", MLA_TESTS),
}

# What caught it, from the first failure's report.
CHECKS = [
    ("emulator: synchronization error", re.compile(r"emulator error")),
    ("AddressSanitizer", re.compile(r"AddressSanitizer")),
    ("UndefinedBehaviorSanitizer", re.compile(r"runtime error:")),
    ("ThreadSanitizer: data race", re.compile(r"ThreadSanitizer")),
    ("outputs differ between thread orders", re.compile(r"vs asan/forward")),
    ("an output left unwritten (NaN-filled)", re.compile(r"was not written")),
    ("float64 reference", re.compile(r"Tensor-likes are not (close|equal)|Mismatched elements")),
    ("bytes differ from the reference", re.compile(r"AssertionError: (key_cache|value_cache|key_caches|value_caches)")),
]


def run_mutant(name, file, text, replacement, python, select=None):
    with tempfile.TemporaryDirectory(prefix="mutant-") as scratch:
        scratch = Path(scratch)
        for part in ("csrc", "tests"):
            shutil.copytree(ROOT / part, scratch / part, ignore=shutil.ignore_patterns("__pycache__"))
        path = scratch / file
        source = path.read_text()
        if source.count(text) != 1:
            return "mutation does not apply (the source changed?)", "", 0.0
        path.write_text(source.replace(text, replacement))
        start = time.perf_counter()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "GOMP_SPINCOUNT": "0"}
        command = [python, "-m", "pytest", "tests/emulated/test_emulated_kernels.py", "tests/emulated/test_emulated_mla.py",
                   "-x", "-q", "-p", "no:cacheprovider"]
        result = subprocess.run(command + (["-k", select] if select else []), cwd=scratch, env=env,
                                capture_output=True, text=True)
        elapsed = time.perf_counter() - start
        output = result.stdout + result.stderr
        if result.returncode == 0:
            return "NOT CAUGHT", "", elapsed
        failed = re.search(r"^FAILED (\S+)", output, re.M)
        test = failed.group(1).split("::")[-1] if failed else "?"
        for check, pattern in CHECKS:
            if pattern.search(output):
                return check, test, elapsed
        return "other failure", test, elapsed


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", help="names (substrings) of the mutants to run")
    parser.add_argument("--check", action="store_true",
                        help="only check that each mutant applies exactly once to the source (runs no test)")
    args = parser.parse_args(argv)
    chosen = {name: m for name, m in MUTANTS.items() if not args.only or any(o in name for o in args.only)}
    if args.check:
        stale = [(name, file) for name, (file, text, *_) in chosen.items() if (ROOT / file).read_text().count(text) != 1]
        for name, file in stale:
            print(f"does not apply exactly once: {name} ({file})")
        print(f"{len(chosen) - len(stale)} of {len(chosen)} mutants apply")
        return 1 if stale else 0
    rows = []
    for name, (file, text, replacement, *select) in chosen.items():
        check, test, elapsed = run_mutant(name, file, text, replacement, sys.executable, *select)
        rows.append((name, check, test, elapsed))
        print(f"{name}: {check} ({test}, {elapsed:.0f} s)", flush=True)
    print("\n| planted bug | caught by | first failing test |\n| --- | --- | --- |")
    for name, check, test, _ in rows:
        print(f"| {name} | {check} | `{test}` |")
    return 0 if all(check not in ("NOT CAUGHT",) and not check.startswith("mutation") for _, check, _, _ in rows) \
        else 1


if __name__ == "__main__":
    sys.exit(main())
