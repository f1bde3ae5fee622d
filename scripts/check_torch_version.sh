#!/usr/bin/env bash
# Builds the package against another torch release (default 2.11.0, the version on the GPU machines) in a
# virtualenv of its own (.venv-torch-VERSION) and a scratch copy of the tree, with the CUDA kernels when a toolkit
# is found, and runs the test suite there. The in-place build that .venv uses is left alone.
#
#   bash scripts/check_torch_version.sh [VERSION]
set -euo pipefail
VERSION="${1:-2.11.0}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-torch-$VERSION"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
# Only what the build and the op tests need (the engine tests skip without their packages).
"$VENV/bin/python" -m pip install --quiet "torch==$VERSION" numpy ninja "setuptools>=77" wheel pytest hypothesis

# Tracked files and new ones not ignored, so that uncommitted work is checked too.
(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$WORK")
cd "$WORK"
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
fi
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
echo "building against torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)') in $WORK"
if ! "$VENV/bin/python" setup.py build_ext --inplace > build.log 2>&1; then
  tail -n 60 build.log
  echo "build against torch $VERSION failed" >&2
  exit 1
fi
grep '^paged_attn:' build.log || true
"$VENV/bin/python" scripts/ptxas_report.py --summary build.log
# The emulated CUDA suites (tests/emulated/test_emulator.py, tests/emulated/test_emulated_kernels.py) compile the kernels with g++,
# not against torch, and the SASS report's tests read machine code: they ran with the README's test command already.
GOMP_SPINCOUNT="${GOMP_SPINCOUNT:-0}" PYTHONPATH="$WORK" "$VENV/bin/python" -m pytest tests -q -p no:cacheprovider \
  --ignore=tests/emulated/test_emulator.py --ignore=tests/emulated/test_emulated_kernels.py \
  --ignore=tests/build/test_sass_report.py
