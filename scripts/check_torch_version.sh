#!/usr/bin/env bash
# Builds the package against another torch release (default 2.11.0, the version on the GPU machines) in a
# virtualenv of its own (.venv-torch-VERSION) and a scratch copy of the tree, with the CUDA kernels where setup.py
# builds them (a GPU, or PAGED_ATTN_FORCE_CUDA=1 as in CI), and runs the tests that another torch can change: those
# marked `extension` (the compiled ops, their registration, fakes and torch.compile; see pyproject.toml). The rest
# (block manager, engine logic, the CLI, the emulated kernels, the SASS report) do not depend on torch's version
# and ran with the README's test command. The in-place build that .venv uses is left alone. With
# PAGED_ATTN_NVCC_CACHE (as CI sets it), the torch-free CUDA kernel files come from the objects of an earlier build.
# With --bundle DIR it also keeps the library it built, DIR/_C.abi3.so (CUDA kernels required, sm_90), checks it
# with scripts/check_gpu_bundle.py and runs the GPU check's dry run with it: the GPU check's bundle
# (scripts/gpu_check.sh --bundle DIR), built here for the GPU machines' torch 2.11 and any CPython >= 3.10.
#
#   bash scripts/check_torch_version.sh [VERSION]                      # venv, build and tests
#   bash scripts/check_torch_version.sh --venv [VERSION]               # only make the venv (CI starts this early)
#   bash scripts/check_torch_version.sh --bundle build/gpu-bundle      # venv, build, bundle and its check, tests
set -euo pipefail
VENV_ONLY=0 BUNDLE=""
if [ "${1:-}" = "--venv" ]; then VENV_ONLY=1; shift; fi
if [ "${1:-}" = "--bundle" ]; then BUNDLE="$(mkdir -p "$2" && cd "$2" && pwd)"; shift 2; fi
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
if [ -n "$BUNDLE" ]; then
  export PAGED_ATTN_FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
fi
echo "building against torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)') in $WORK"
if ! "$VENV/bin/python" setup.py build_ext --inplace > build.log 2>&1; then
  tail -n 60 build.log
  echo "build against torch $VERSION failed" >&2
  exit 1
fi
grep '^paged_attn:' build.log || true
"$VENV/bin/python" scripts/ptxas_report.py --summary build.log
if [ -n "$BUNDLE" ]; then
  strip --strip-debug -o "$BUNDLE/_C.abi3.so" paged_attn/_C.abi3.so  # (its host debug info: 34 of 83 MiB)
  "$VENV/bin/python" scripts/check_gpu_bundle.py "$BUNDLE"
  # (the tree's own library set aside meanwhile, as on a GPU machine, where only the bundle holds one)
  mv paged_attn/_C.abi3.so "$WORK/_C.abi3.so.aside"
  PYTHON="$VENV/bin/python" bash scripts/gpu_check.sh --dry-run --bundle "$BUNDLE" "$WORK/gpu-check-dry-run"
  mv "$WORK/_C.abi3.so.aside" paged_attn/_C.abi3.so
fi
WORKERS="${PYTEST_WORKERS:-$(nproc)}"  # as scripts/test.sh: a worker per core (at most 4), a file per worker
if [ "$WORKERS" -gt 4 ]; then WORKERS=4; fi
GOMP_SPINCOUNT="${GOMP_SPINCOUNT:-0}" PYTHONPATH="$WORK" "$VENV/bin/python" -m pytest tests -q -p no:cacheprovider \
  -m extension -n "$WORKERS" --dist loadfile
