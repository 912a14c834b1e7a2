"""``conveyor`` CLI with experimental query patches, to measure a fix before making it.

Used by ``profile_drain.py --patch NAME``; never by the benchmark itself. Each
patch replaces one named query's text in the loaded catalogue (the files in
``src/conveyor/db/queries`` are untouched), then runs the normal CLI.

    python benchmarks/patched_worker.py trace-wake -- --schema s worker ...

Patches (joined with "+"): trace-wake, timeline, two-fetch, ack-refill, and the query
patches in PATCHES. The
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


TIMELINE_ENV = "PATCHED_WORKER_TIMELINE"


def timeline() -> None:
    """Record every claim, acknowledgement and handler start as a line
    "KIND START END EVENTS" (time.perf_counter(), KIND claim, ack or start) in
    the file the environment's PATCHED_WORKER_TIMELINE names, written at exit:
    where the fetch loop's time goes (profile_drain.py sums it up)."""
    import atexit
    import os
    import time
    from typing import Any

    from conveyor.worker.claims import Claims
    from conveyor.worker.completer import Completer
    from conveyor.worker.executor import Executor

    path = os.environ[TIMELINE_ENV]
    records: list[tuple[str, float, float, int]] = []
    claim, write, start = Claims._claim, Completer._write, Executor.start

    async def timed_claim(self: Claims, *args: Any) -> Any:
        began = time.perf_counter()
        events = await claim(self, *args)
        records.append(("claim", began, time.perf_counter(), len(events or ())))
        return events

    async def timed_write(self: Completer, conn: Any, batch: Any) -> Any:
        began = time.perf_counter()
        done = await write(self, conn, batch)
        records.append(("ack", began, time.perf_counter(), len(batch)))
        return done

    def timed_start(self: Executor, events: Any) -> None:
        began = time.perf_counter()
        start(self, events)
        records.append(("start", began, time.perf_counter(), len(events)))

    def dump() -> None:
        with open(path, "w", encoding="ascii") as out:
            out.writelines(f"{kind} {a:.6f} {b:.6f} {n}\n" for kind, a, b, n in records)

    Claims._claim = timed_claim  # type: ignore[method-assign]
    Completer._write = timed_write  # type: ignore[method-assign]
    Executor.start = timed_start  # type: ignore[method-assign]
    atexit.register(dump)


def two_fetch() -> None:
    """A second fetch loop on a connection of its own, beside the first: one
    claim is on its way while the other's rows are handed out (a design
    priced, not shipped: one more connection per worker)."""
    import asyncio
    import copy

    from conveyor.worker.claims import Claims
    from conveyor.worker.connection import CursorCache

    fetch_loop = Claims.fetch_loop

    async def twin_loops(self: Claims) -> None:
        twin = copy.copy(self)
        fetch = copy.copy(self.connections.fetch)
        fetch.role, fetch._conn, fetch._connecting = "fetch2", None, asyncio.Lock()
        twin.connections = copy.copy(self.connections)
        twin.connections.fetch = fetch
        twin._cursors = {**self._cursors, fetch.role: CursorCache(binary=True)}
        twin._deferred = []
        twin.hold = copy.copy(self.hold)
        twin.hold._enabled = False      # the first loop keeps the wake gate
        await asyncio.gather(fetch_loop(self), fetch_loop(twin))

    Claims.fetch_loop = twin_loops  # type: ignore[method-assign]


def ack_refill() -> None:
    """After each acknowledgement written while a backlog lasts, the acknowledging
    connection claims into the slots it freed, on its own round trip, while the
    fetch loop claims on its connection as before (a design priced, not shipped)."""
    from conveyor.db.rows import claim_cursor
    from conveyor.worker.claims import Claims
    from conveyor.worker.completer import Completer
    from conveyor.worker.connection import CursorCache

    init, flush, claim = Claims.__init__, Completer.flush, Claims.claim
    state = {"full": False}

    def patched_init(self: Claims, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        self.completer._refill = self  # type: ignore[attr-defined]
        self._cursors["ack"] = CursorCache(binary=True, setup=claim_cursor)

    async def patched_claim(self: Claims, want: int, **kwargs: bool) -> object:
        events = await claim(self, want, **kwargs)
        state["full"] = events is not None and len(events) == want
        return events

    async def patched_flush(self: Completer) -> None:
        await flush(self)
        claims = getattr(self, "_refill", None)
        if claims is None or not state["full"]:
            return
        free = claims.running.free_slots()
        if free >= max(1, claims.config.batch_size // 4):
            want = min(free, self.flush_size)
            events = await claims._claim(self._conn, claims._cursors["ack"], want, False)
            state["full"] = events is not None and len(events) == want

    Claims.__init__ = patched_init  # type: ignore[method-assign]
    Claims.claim = patched_claim  # type: ignore[method-assign]
    Completer.flush = patched_flush  # type: ignore[method-assign]


def main() -> int:
    name, sep, *rest = sys.argv[1:]
    assert sep == "--", "usage: patched_worker.py PATCH -- CLI-ARGS..."
    for part in name.split("+"):
        if part == "trace-wake":
            trace_wake_path()
        elif part == "timeline":
            timeline()
        elif part == "two-fetch":
            two_fetch()
        elif part == "ack-refill":
            ack_refill()
        else:
            named_queries.raw_queries().update(PATCHES[part])
    from conveyor.cli.main import main as cli_main

    return cli_main(rest)


if __name__ == "__main__":
    sys.exit(main())
