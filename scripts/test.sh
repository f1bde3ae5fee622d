#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the test suite. Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
export GOMP_SPINCOUNT="${GOMP_SPINCOUNT:-0}"  # idle OpenMP threads sleep instead of spinning
exec .venv/bin/python -m pytest tests "$@"
