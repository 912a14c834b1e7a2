#!/usr/bin/env bash
# Set up (virtual environment, install) and run the test suite.
# Without CONVEYOR_TEST_DATABASE_URL the tests start a private embedded PostgreSQL.
set -euo pipefail
source "$(dirname "$0")/bootstrap.sh"
cd "$ROOT"
# The suite starts some thousand Python processes (pytest-xdist's, the CLI's,
# workers and relays): with PYTHONDONTWRITEBYTECODE set (some images do), each
# compiles Conveyor and the test modules again. Collecting the suite took 8.4 s
# of CPU without the bytecode cache and 3.4 s with it, a CLI call 0.35 and
# 0.24 s (2026-12-04). The cache goes to __pycache__, which git ignores.
unset PYTHONDONTWRITEBYTECODE
# Temporary files in memory when the machine has room there. The tests' private
# PostgreSQL servers (chaos runs, restarts, the 200 tenant databases), brokers
# and venvs live under TMPDIR; on this machine's disk (ext4 mounted with
# discard) every deleted file is a discard, and creating the 200 tenant
# databases on a private server took 39 s there and 8.8 s on /dev/shm, stopping
# and removing it 17 s and 5.4 s (2026-12-05, a loaded machine). A TMPDIR set
# by the caller is kept; so is the disk when /dev/shm has under 6 GB free.
shm_free_kb="$(df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 {print $4}')" || true
if [ -z "${TMPDIR:-}" ] && [ -w /dev/shm ] && [ "${shm_free_kb:-0}" -ge $((6 * 1024 * 1024)) ]; then
    # Sticky and world-writable, as /tmp: the embedded servers run as another user.
    TMPDIR=/dev/shm/conveyor-tests
    mkdir -p "$TMPDIR" && chmod 1777 "$TMPDIR" && export TMPDIR || unset TMPDIR
fi
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
# The R19 tests (tests/reliability/test_pgbouncer.py) run a private PgBouncer;
# the browser tests (tests/browser_support.py) drive Debian's chromium through
# Playwright (the browsers Playwright downloads itself cannot be fetched
# everywhere). None of them is in the parallel tier, so on a machine without
# them the installs (20-25 s, mostly the package index and downloads) run
# while it does, and the other tiers wait for them.
need_packages() {
    need_package pgbouncer /usr/sbin/pgbouncer "the R19 tests"
    need_package chromium /usr/bin/chromium "the browser tests" --no-install-recommends
}
packages=""
# Three tiers, with the same arguments (paths, -k, -x...):
# 1. the tests marked neither `serial` nor `light`, in parallel:
#    CONVEYOR_TEST_WORKERS processes (pytest-xdist; two per core, at most 8, by
#    default), a test file's tests in one process (--dist loadfile: module
#    fixtures such as Django's set-up are per process). Two per core because
#    most tests wait on workers, servers and subprocesses: on 2 cores, one
#    process per core left the machine about half idle and took 416 s; two per
#    core, 263 s (2026-12-04, a quiet machine). Three per core took 267-303 s
#    against two's 320 s (2026-12-05), but the machine was busy throughout and
#    one run in four failed two tests that time themselves (moved to the
#    serial tier, or untimed, since): two per core leaves room;
# 2. the `light` ones, CONVEYOR_TEST_LIGHT_WORKERS (4) at a time: tests that
#    would not share the machine with the parallel tier (they restart private
#    servers or time themselves loosely) but do with three others of their kind
#    (four at a time took 158 and 164 s where three took 181-191 s, 2026-12-05),
#    mostly waiting; test by test, not file by file, and a process that runs
#    out takes another's queued tests (--dist worksteal): with --dist load a
#    long test could wait queued behind another while a process sat idle;
# 3. the `serial` ones (they load the CPU, time themselves tightly or drive a
#    browser), one at a time.
# CONVEYOR_TEST_TIER=parallel, light or serial runs one tier alone. A tier none
# of the selected tests belongs to is no failure; all of them empty is (pytest's
# status 5).
tier="${CONVEYOR_TEST_TIER:-all}"
case "$tier" in
    all|parallel|light|serial) ;;
    *) echo "conveyor: expected CONVEYOR_TEST_TIER to be all, parallel, light or serial," \
            "got $tier" >&2
       exit 2 ;;
esac
cores="$(nproc 2>/dev/null || echo 2)"
workers="${CONVEYOR_TEST_WORKERS:-$(( cores * 2 < 8 ? cores * 2 : 8 ))}"
parallel=5 light=5 serial=5
if [ "$tier" = all ]; then
    need_packages &
    packages=$!
elif [ "$tier" != parallel ]; then
    need_packages
fi
if [ "$tier" = all ] || [ "$tier" = parallel ]; then
    parallel=0
    # --no-loadscope-reorder: tests/conftest.py orders the files, longest first.
    python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder \
        -m "not serial and not light" "$@" || parallel=$?
fi
if [ -n "$packages" ]; then
    wait "$packages" || true   # need_package says what it could not install
fi
if [ "$tier" = all ] || [ "$tier" = light ]; then
    light=0
    python -m pytest -n "${CONVEYOR_TEST_LIGHT_WORKERS:-4}" --dist worksteal -m light "$@" \
        || light=$?
fi
if [ "$tier" = all ] || [ "$tier" = serial ]; then
    serial=0
    python -m pytest -m serial "$@" || serial=$?
fi
if [ "$parallel" = 5 ] && [ "$light" = 5 ] && [ "$serial" = 5 ]; then
    exit 5
fi
for status in "$parallel" "$light" "$serial"; do
    if [ "$status" != 0 ] && [ "$status" != 5 ]; then
        exit "$status"
    fi
done
