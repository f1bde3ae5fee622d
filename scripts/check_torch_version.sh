#!/usr/bin/env bash
# Builds the package against another torch release (default 2.11.0, the version on the GPU machines) in a
# virtualenv of its own (.venv-torch-VERSION) and a scratch copy of the tree, with the CUDA kernels where setup.py
# builds them (a GPU, or PAGED_ATTN_FORCE_CUDA=1 as in CI), and runs the tests that another torch can change: those
# marked `extension` (the compiled ops, their registration, fakes and torch.compile; see pyproject.toml). The rest
# (block manager, engine logic, the CLI, the emulated kernels, the SASS report) do not depend on torch's version
# and ran with the README's test command. The in-place build that .venv uses is left alone. With
# PAGED_ATTN_NVCC_CACHE (as CI sets it), the torch-free CUDA kernel files come from the objects of an earlier build.
#
#   bash scripts/check_torch_version.sh [VERSION]          # venv, build and tests
#   bash scripts/check_torch_version.sh --venv [VERSION]   # only make the venv (CI starts this early)
set -euo pipefail
VENV_ONLY=0
if [ "${1:-}" = "--venv" ]; then VENV_ONLY=1; shift; fi
VERSION="${1:-2.11.0}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-torch-$VERSION"

if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
# Only what the build and the extension's tests need.
"$VENV/bin/python" -m pip install --quiet "torch==$VERSION" numpy ninja "setuptools>=77" wheel pytest pytest-xdist \
  hypothesis
[ "$VENV_ONLY" = 1 ] && exit 0

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
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
WORKERS="${PYTEST_WORKERS:-$(nproc)}"  # as scripts/test.sh: a worker per core (at most 4), a file per worker
if [ "$WORKERS" -gt 4 ]; then WORKERS=4; fi
GOMP_SPINCOUNT="${GOMP_SPINCOUNT:-0}" PYTHONPATH="$WORK" "$VENV/bin/python" -m pytest tests -q -p no:cacheprovider \
  -m extension -n "$WORKERS" --dist loadfile
