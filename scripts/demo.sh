#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the package's main job, the serving demo on SmolLM2-135M
# (python -m paged_attn). Extra arguments go to it (--help lists them).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
export GOMP_SPINCOUNT="${GOMP_SPINCOUNT:-0}"
exec .venv/bin/python -m paged_attn "$@"
