#!/usr/bin/env bash
# Configures and builds the C++ library with CMakeLists.txt against the virtualenv's libtorch (scripts/setup.sh
# makes it), then runs the C++ test with ctest. Build tree: build-cmake/. The CUDA kernels are built as setup.py
# builds them: with a CUDA build of torch and the toolkit, where a GPU is visible or PAGED_ATTN_FORCE_CUDA=1, and
# never with PAGED_ATTN_NO_CUDA=1 (CI's CMake stage: the main build already compiled and checked the CUDA objects).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY=.venv/bin/python
PREFIX="$($PY -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
SITE="$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
ARGS=(-S . -B build-cmake -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$PREFIX")

# A CUDA build of torch: its CMake config needs the toolkit and the NVRTC library that the pip wheel ships, even
# for a library without CUDA kernels; then the kernels themselves only where setup.py would build them.
TORCH_CUDA="$($PY -c 'import torch; print(torch.version.cuda is not None)')"
WANT_CUDA="$($PY -c 'import os, torch; print(os.environ.get("PAGED_ATTN_NO_CUDA") != "1"
  and (torch.cuda.is_available() or os.environ.get("PAGED_ATTN_FORCE_CUDA") == "1"))')"
CUDA_ROOT="${CUDA_HOME:-/usr/local/cuda}"
if [ "$TORCH_CUDA" = True ] && [ -x "$CUDA_ROOT/bin/nvcc" ]; then
  export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"  # no GPU to probe here
  ARGS+=(-DCUDA_TOOLKIT_ROOT_DIR="$CUDA_ROOT" -DCMAKE_CUDA_COMPILER="$CUDA_ROOT/bin/nvcc")
  NVRTC="$(ls "$SITE"/nvidia/cu*/lib/libnvrtc.so.* 2>/dev/null | head -n 1 || true)"
  [ -n "$NVRTC" ] && ARGS+=(-DCUDA_nvrtc_LIBRARY="$NVRTC")
  [ "$WANT_CUDA" = True ] && ARGS+=(-DPAGED_ATTN_CUDA=ON) || ARGS+=(-DPAGED_ATTN_CUDA=OFF)
else
  ARGS+=(-DPAGED_ATTN_CUDA=OFF)
fi

PATH="$ROOT/.venv/bin:$PATH"  # the cmake from requirements-dev.txt (knows nvcc 13)
cmake "${ARGS[@]}"
cmake --build build-cmake -j "$(nproc)" 2>&1 | tee build-cmake/build.log
$PY scripts/ptxas_report.py --summary build-cmake/build.log
ctest --test-dir build-cmake --output-on-failure
