#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the test suite. Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
export GOMP_SPINCOUNT="${GOMP_SPINCOUNT:-0}"  # idle OpenMP threads sleep instead of spinning
# One pytest-xdist worker per core (at most 4; PYTEST_WORKERS=N to choose, -n 0 among the arguments for none), each
# test file whole in one worker: a file's tests share its fixtures (a loaded model, the emulator's builds).
WORKERS="${PYTEST_WORKERS:-$(nproc)}"
if [ "$WORKERS" -gt 4 ]; then WORKERS=4; fi
exec .venv/bin/python -m pytest tests -n "$WORKERS" --dist loadfile "$@"
