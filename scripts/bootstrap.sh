# Sourced by the other scripts: create the virtual environment (CONVEYOR_VENV,
# .venv by default) with the extras CONVEYOR_EXTRAS (`test` by default) and
# install Conveyor and its tools
# (tools/: `conveyor bench`, `conveyor demo`, the chaos ledger) into it when
# missing or when either pyproject.toml changed since the last install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CONVEYOR_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "conveyor: creating virtual environment in $VENV" >&2
    "$PYTHON" -m venv "$VENV"
fi
STAMP="$VENV/.conveyor-installed"
WANT="$(cat "$ROOT/pyproject.toml" "$ROOT/tools/pyproject.toml" | sha256sum | cut -d' ' -f1)-${CONVEYOR_EXTRAS:-test}"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    echo "conveyor: installing into $VENV" >&2
    "$VENV/bin/python" -m pip install --quiet --upgrade pip >&2
    "$VENV/bin/python" -m pip install --quiet -e "$ROOT[${CONVEYOR_EXTRAS:-test}]" \
        -e "$ROOT/tools" >&2
    echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
