#!/usr/bin/env bash
# Set up (virtual environment, install) and run the test suite.
# Without CONVEYOR_TEST_DATABASE_URL the tests start a private embedded PostgreSQL.
set -euo pipefail
source "$(dirname "$0")/bootstrap.sh"
cd "$ROOT"
exec python -m pytest "$@"
