#!/usr/bin/env bash
# Set up (virtual environment, install) and run the demo on the embedded PostgreSQL.
set -euo pipefail
source "$(dirname "$0")/bootstrap.sh"
cd "$ROOT"
exec conveyor demo "$@"
