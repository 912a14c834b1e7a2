#!/usr/bin/env bash
# Set up (virtual environment, install) and run the test suite.
# Without CONVEYOR_TEST_DATABASE_URL the tests start a private embedded PostgreSQL.
set -euo pipefail
source "$(dirname "$0")/bootstrap.sh"
cd "$ROOT"
# The R19 tests (tests/reliability/test_pgbouncer.py) run a private PgBouncer.
# Install it when missing and we can (root with apt-get); otherwise those tests
# fail and say how to install it: they never skip.
if ! command -v pgbouncer >/dev/null 2>&1 && [ ! -x /usr/sbin/pgbouncer ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "conveyor: installing pgbouncer for the R19 tests" >&2
        apt_install() {
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=120 \
                pgbouncer >/dev/null 2>&1
        }
        apt_install || { apt-get update -qq >/dev/null 2>&1 && apt_install; } \
            || echo "conveyor: could not install pgbouncer; the R19 tests will fail" >&2
    else
        echo "conveyor: pgbouncer is missing (install it: apt-get install pgbouncer);" \
             "the R19 tests will fail" >&2
    fi
fi
exec python -m pytest "$@"
