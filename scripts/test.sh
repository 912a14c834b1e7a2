#!/usr/bin/env bash
# Set up (virtual environment, install) and run the test suite.
# Without CONVEYOR_TEST_DATABASE_URL the tests start a private embedded PostgreSQL.
set -euo pipefail
source "$(dirname "$0")/bootstrap.sh"
cd "$ROOT"
# Some tests run a program from a Debian package. Install it when missing and we
# can (root with apt-get); otherwise those tests fail and say how to install it:
# they never skip. Quiet unless it installs or cannot.
# need_package PACKAGE EXECUTABLE WHICH_TESTS [apt-get install option...]
need_package() {
    local package="$1" executable="$2" tests="$3"
    shift 3
    if command -v "$package" >/dev/null 2>&1 || [ -x "$executable" ]; then
        return 0
    fi
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        echo "conveyor: $package is missing (install it: apt-get install $package);" \
             "$tests will fail" >&2
        return 0
    fi
    echo "conveyor: installing $package for $tests" >&2
    apt_install() {
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=120 \
            "$@" "$package" >/dev/null 2>&1
    }
    # The package lists may be stale or absent (fresh containers): refresh them only then.
    apt_install "$@" || { apt-get update -qq >/dev/null 2>&1 && apt_install "$@"; } \
        || echo "conveyor: could not install $package; $tests will fail" >&2
}
# The R19 tests (tests/reliability/test_pgbouncer.py) run a private PgBouncer.
need_package pgbouncer /usr/sbin/pgbouncer "the R19 tests"
# The browser tests (tests/browser_support.py) drive Debian's chromium through
# Playwright: the browsers Playwright downloads itself cannot be fetched everywhere.
need_package chromium /usr/bin/chromium "the browser tests" --no-install-recommends
exec python -m pytest "$@"
