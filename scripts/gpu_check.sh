#!/usr/bin/env bash
# The GPU check, for one lent window: at most 8 minutes of wall time in one call on an H100 or H200, with the
# library built beforehand on a GPU-less machine (the bundle: scripts/check_torch_version.sh --bundle DIR, for the
# GPU machines' torch 2.11). Its steps, each under a time limit that the budget below adds up:
#   1. at once (correctness; nothing is timed): the CUDA op tests (tests/ops -k cuda) and the engine on CUDA
#      against transformers, compute-sanitizer memcheck and racecheck on small cases of every op;
#   2. alone on the GPU: bench/bench_gpu.py, our kernels beside the device's copy bandwidth and matmul, SDPA
#      (flash, cuDNN) and FlexAttention in the same process (JSON and a summary for bench/RESULTS.md);
#   3. ncu counters of the decode kernels (single pass and split-KV).
# Leaves in OUT_DIR (what the device tool brings back: 8 files at most): summary.md, bench_gpu.json, bench_gpu.md
# and logs.tar.gz (every step's log).
#
#   bash scripts/gpu_check.sh --bundle build/gpu-bundle OUT_DIR            # on the GPU machine (device: carry it)
#   bash scripts/gpu_check.sh --dry-run --bundle build/gpu-bundle OUT_DIR  # here, no GPU: everything else
#   bash scripts/gpu_check.sh OUT_DIR                                      # no bundle: builds first (minutes)
#
# The dry run proves all but the GPU part: the bundle loads (scripts/check_gpu_bundle.py), every pytest selection
# collects tests, the scripts compile, bench_gpu.py runs every step on tiny cases on the CPU, and the steps' limits
# add up to the budget. It uses the python3 on the PATH (PYTHON=... to choose; on the GPU machines the one with
# torch), installs nothing and downloads nothing. Exit status: non-zero when a step fails or runs out of time.
set -uo pipefail
DRY=0 BUNDLE=""
while [ $# -gt 1 ]; do
  case "$1" in
    --dry-run) DRY=1; shift ;;
    --bundle) BUNDLE="$(cd "$2" && pwd)"; shift 2 ;;
    *) break ;;
  esac
done
OUT="${1:?usage: bash scripts/gpu_check.sh [--dry-run] [--bundle DIR] OUT_DIR}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
BUDGET=480  # seconds of wall time for all steps (the window: 10 minutes per call, the machine's start included)
LOGS="$(mktemp -d)"
trap 'rm -rf "$LOGS"' EXIT
export PYTHONUNBUFFERED=1 GOMP_SPINCOUNT=0 MAX_JOBS="${MAX_JOBS:-$(nproc)}"
SUMMARY="$OUT/summary.md"
status=0

# The package as the steps import it: with a bundle, a copy of paged_attn/'s Python files beside the bundle's
# library (the tree is left as it is); without one, the tree after an in-place build. `python -m` and `-c` would put
# the working directory (the tree, whose paged_attn holds no library on a GPU machine) first on sys.path: they run
# with -P (Python >= 3.11), so PYTHONPATH decides. (Scripts put their own folder first: bench/, scripts/.)
if [ -n "$BUNDLE" ]; then
  mkdir -p "$LOGS/pkg"
  cp -r paged_attn "$LOGS/pkg/"
  rm -f "$LOGS"/pkg/paged_attn/_C*.so
  cp "$BUNDLE/_C.abi3.so" "$LOGS/pkg/paged_attn/"
  export PYTHONPATH="$LOGS/pkg:$ROOT"
else
  export PYTHONPATH="$ROOT" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" PAGED_ATTN_FORCE_CUDA=1
  if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
fi

{
  echo "# paged-attn GPU check$([ $DRY = 1 ] && echo ' (dry run)'), $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/- GPU: /'
  echo "- torch $("$PY" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)' 2>&1 | tail -n 1)," \
       "Python $("$PY" -c 'import platform; print(platform.python_version())')"
  echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown); bundle: ${BUNDLE:-none (built here)}"
  echo "- budget: ${BUDGET} s of wall time"
  echo
} > "$SUMMARY"

# step NAME SECONDS COMMAND...: runs COMMAND under a time limit (killed past it), logs it in $LOGS/NAME.log, and
# writes its line of the summary to $LOGS/NAME.line (steps that run at once append nothing out of order).
step() {
  local name="$1" limit="$2" result began=$SECONDS rc=0
  shift 2
  timeout --kill-after=10 "$limit" "$@" > "$LOGS/$name.log" 2>&1 || rc=$?
  case $rc in
    0) result=ok ;;
    124|137) result="OUT OF TIME (limit ${limit} s)" ;;
    *) result="FAILED (exit $rc)" ;;
  esac
  { echo "- $name: $result in $((SECONDS - began)) s of ${limit} s"; tail -n 3 "$LOGS/$name.log" | sed 's/^/    /'
  } > "$LOGS/$name.line"
  return $rc
}
# report NAME...: the steps' lines into the summary, the logs into logs.tar.gz (also after a step that failed)
report() {
  for name in "$@"; do cat "$LOGS/$name.line" >> "$SUMMARY"; done
  tar -czf "$OUT/logs.tar.gz" -C "$LOGS" $(cd "$LOGS" && ls *.log 2>/dev/null)
}
# at_once NAME...: waits for the background steps whose pids are in PIDS, in order; fails if one did
at_once() {
  local i rc=0
  for i in "${!PIDS[@]}"; do wait "${PIDS[$i]}" || rc=1; done
  report "$@"
  return $rc
}

# The steps: (name, limit in seconds, command). Phase 1's steps run at once (its limit: the largest of theirs).
TESTS=(tests/ops tests/engine/test_engine_tiny.py tests/engine/test_engine_deepseek.py -k cuda -q -ra -p no:cacheprovider)
SANITIZED=("$PY" scripts/sanitizer_cases.py)
NCU_METRICS=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
NCU_METRICS+=,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size
LIMIT_SETUP=30 LIMIT_TESTS=150 LIMIT_MEMCHECK=120 LIMIT_RACECHECK=150 LIMIT_BENCH=220 LIMIT_NCU=50
phase1=$(( LIMIT_TESTS > LIMIT_RACECHECK ? LIMIT_TESTS : LIMIT_RACECHECK ))
phase1=$(( phase1 > LIMIT_MEMCHECK ? phase1 : LIMIT_MEMCHECK ))
planned=$(( LIMIT_SETUP + phase1 + LIMIT_BENCH + 10 + LIMIT_NCU ))  # (10: bench_gpu.py's kill grace)
echo "- steps' limits add up to ${planned} s (setup ${LIMIT_SETUP}, at once ${phase1}, benchmark ${LIMIT_BENCH}," \
     "ncu ${LIMIT_NCU})" >> "$SUMMARY"
if [ "$planned" -gt "$BUDGET" ]; then echo "- OVER THE BUDGET of ${BUDGET} s" >> "$SUMMARY"; status=1; fi

if [ $DRY = 1 ]; then
  # Everything but the GPU: the bundle, the selections, the scripts, the benchmark's every step on tiny CPU cases.
  if [ -n "$BUNDLE" ]; then step bundle "$LIMIT_SETUP" "$PY" scripts/check_gpu_bundle.py "$BUNDLE" || status=1
  else step bundle "$LIMIT_SETUP" true; fi
  step tests "$LIMIT_TESTS" "$PY" -P -m pytest --collect-only "${TESTS[@]}" || status=1
  step scripts 30 "$PY" -m py_compile scripts/sanitizer_cases.py scripts/ncu_cases.py bench/bench_gpu.py || status=1
  step bench_gpu "$LIMIT_BENCH" "$PY" bench/bench_gpu.py --device cpu --tiny --json "$OUT/bench_gpu.json" \
    --summary "$OUT/bench_gpu.md" || status=1
  report bundle tests scripts bench_gpu
  if ! grep -Eq "^[0-9]+(/[0-9]+)? tests collected" "$LOGS/tests.log"; then
    echo "- the tests' selection collects nothing" >> "$SUMMARY"
    status=1
  fi
  cat "$SUMMARY"
  exit $status
fi

# Setup: with a bundle, the GPU and the ops' CUDA kernels are there; without one, the in-place build.
if [ -n "$BUNDLE" ]; then
  step setup "$LIMIT_SETUP" "$PY" -P -c "import torch, paged_attn; assert torch.cuda.is_available(), 'no GPU visible'; \
assert paged_attn.ops.has_cuda_kernels(); print(torch.cuda.get_device_name(), paged_attn._C.__file__)" || status=1
else
  step setup 900 "$PY" setup.py build_ext --inplace || status=1
fi
report setup
if [ $status -ne 0 ]; then cat "$SUMMARY"; exit 1; fi

# 1. At once: the tests (pytest-xdist where the image has it) and the sanitizers (small cases; their results are
# also checked against the reference).
WORKERS=()
if "$PY" -c "import xdist" 2>/dev/null; then WORKERS=(-n 6 --dist loadfile); fi
PIDS=()
step tests "$LIMIT_TESTS" "$PY" -P -m pytest "${TESTS[@]}" "${WORKERS[@]}" & PIDS+=($!)
step memcheck "$LIMIT_MEMCHECK" compute-sanitizer --tool memcheck --error-exitcode 3 "${SANITIZED[@]}" & PIDS+=($!)
step racecheck "$LIMIT_RACECHECK" compute-sanitizer --tool racecheck --error-exitcode 3 "${SANITIZED[@]}" & PIDS+=($!)
at_once tests memcheck racecheck || status=1

# 2. The benchmark alone on the GPU (its own budget ends its cases 30 s before the limit).
step bench_gpu $((LIMIT_BENCH + 10)) "$PY" bench/bench_gpu.py --budget $((LIMIT_BENCH - 30)) \
  --json "$OUT/bench_gpu.json" --summary "$OUT/bench_gpu.md" || status=1
report bench_gpu

# 3. Counters of the decode kernels, for tuning (where the runtime lets ncu read them).
step ncu "$LIMIT_NCU" ncu --clock-control none -k regex:paged_attention --launch-count 8 --metrics "$NCU_METRICS" \
  "$PY" scripts/ncu_cases.py || status=1
report ncu

{ echo; echo "Wall time: ${SECONDS} s (budget ${BUDGET} s)"; echo
  [ -f "$OUT/bench_gpu.md" ] && cat "$OUT/bench_gpu.md"; } >> "$SUMMARY"
cat "$SUMMARY"
exit $status
