"""``conveyor`` CLI with experimental query patches, to measure a fix before making it.

Used by ``profile_drain.py --patch NAME``; never by the benchmark itself. Each
patch replaces one named query's text in the loaded catalogue (the files in
``src/conveyor/db/queries`` are untouched), then runs the normal CLI.

    python benchmarks/patched_worker.py trace-wake -- --schema s worker ...

Patches (joined with "+"): trace-wake, and the query patches in PATCHES. The
worker's own settings already hold what earlier patches measured
(synchronous_commit off on the claim and acknowledgement sessions, one
deadline sweeper instead of a timer per handler, the acknowledgement without
its state test).
"""

from __future__ import annotations

import sys

from conveyor.db import named_queries

# Query patches: named query -> replacement text, e.g.
# {"my-patch": {"event_claim": "WITH next AS (...) UPDATE ..."}}. The ones that
# earlier rounds measured were adopted (the acknowledgement without its state
# test) or dropped; add one here to price the next idea.
PATCHES: dict[str, dict[str, str]] = {}


def trace_wake_path() -> None:
    """Write "N <t>" when a NOTIFY is handled and "C <start> <end> <n>" per claim to the
    benchmark's wake pipe, next to the handler's "<id> <t>" lines."""
    import os
    import time

    from conveyor.worker.claims import Claims
    from conveyor.worker.wakeups import DueTimes

    fd = int(os.environ["CONVEYOR_BENCH_WAKE_FD"])
    notified, claim = DueTimes.notified, Claims.claim

    def traced_notified(self: DueTimes, payload: str) -> None:
        os.write(fd, f"N {time.time():.6f}\n".encode())
        notified(self, payload)

    async def traced_claim(self: Claims, want: int, **kwargs: bool) -> object:
        start = time.time()
        events = await claim(self, want, **kwargs)
        os.write(fd, f"C {start:.6f} {time.time():.6f} {len(events or [])}\n".encode())
        return events

    DueTimes.notified = traced_notified  # type: ignore[method-assign]
    Claims.claim = traced_claim  # type: ignore[assignment,method-assign]


def main() -> int:
    name, sep, *rest = sys.argv[1:]
    assert sep == "--", "usage: patched_worker.py PATCH -- CLI-ARGS..."
    for part in name.split("+"):
        if part == "trace-wake":
            trace_wake_path()
        else:
            named_queries.raw_queries().update(PATCHES[part])
    from conveyor.cli.main import main as cli_main

    return cli_main(rest)


if __name__ == "__main__":
    sys.exit(main())
