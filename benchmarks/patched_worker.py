"""``conveyor`` CLI with experimental query patches, to measure a fix before making it.

Used by ``profile_drain.py --patch NAME``; never by the benchmark itself. Each
patch replaces one named query's text in the loaded catalogue (the files in
``src/conveyor/db/queries`` are untouched), then runs the normal CLI.

    python benchmarks/patched_worker.py ack-no-state+async-commit -- --schema s worker ...

Patches: ack-no-state, async-commit, no-handler-timeout, trace-wake (joined with "+").
"""

from __future__ import annotations

import sys

from conveyor.db import named_queries

# event_succeed_many without "e.state = 'running'": lease_owner = owner implies it
# (events_lease_check), and without it the planner cannot pick events_lease_idx for
# a nested loop that rescans unnest() once per running row.
ACK_NO_STATE = """
UPDATE {schema}.events AS e
SET state = 'succeeded',
    lease_owner = NULL,
    lease_expires_at = NULL,
    finished_at = now(),
    updated_at = now()
FROM unnest(%(ids)s::bigint[], %(attempts)s::int[]) AS d(id, attempt)
WHERE e.id = d.id
  AND e.lease_owner = %(owner)s
  AND e.attempts = d.attempt
RETURNING e.id
"""

PATCHES = {"ack-no-state": {"event_succeed_many": ACK_NO_STATE.strip()}}


def trace_wake_path() -> None:
    """Write "N <t>" when a NOTIFY is handled and "C <start> <end> <n>" per claim to the
    benchmark's wake pipe, next to the handler's "<id> <t>" lines."""
    import os
    import time

    from conveyor.worker.worker import Worker

    fd = int(os.environ["CONVEYOR_BENCH_WAKE_FD"])
    notified, claim = Worker._notified, Worker._claim

    def traced_notified(self: Worker, payload: str) -> None:
        os.write(fd, f"N {time.time():.6f}\n".encode())
        notified(self, payload)

    async def traced_claim(self: Worker, want: int, **kwargs: object) -> object:
        start = time.time()
        events = await claim(self, want, **kwargs)
        os.write(fd, f"C {start:.6f} {time.time():.6f} {len(events or [])}\n".encode())
        return events

    Worker._notified = traced_notified  # type: ignore[method-assign]
    Worker._claim = traced_claim  # type: ignore[assignment,method-assign]


def async_commit() -> None:
    """Worker connections with synchronous_commit=off: claims and acks stop waiting for
    the WAL flush. A claim or ack lost in a server crash only means a rerun (the event
    is pending again, or its lease expires), which at-least-once already allows."""
    from conveyor.worker import connection

    original = connection.connect_async

    async def connect_async(conninfo: str, **extra: object) -> object:
        extra.setdefault("options", "-c synchronous_commit=off")
        return await original(conninfo, **extra)

    connection.connect_async = connect_async  # type: ignore[assignment]


def no_handler_timeout() -> None:
    """Measurement only: run handlers without the per-event ``asyncio.timeout`` (one
    TimerHandle pushed on and cancelled from the loop's heap per event), to price it."""
    import asyncio
    import types

    from conveyor.worker import executor

    class _NoDeadline:
        async def __aenter__(self) -> _NoDeadline:
            return self

        async def __aexit__(self, *exc: object) -> bool:
            return False

        def expired(self) -> bool:
            return False

    no_deadline = _NoDeadline()
    shim = types.SimpleNamespace(**{k: getattr(asyncio, k) for k in dir(asyncio)
                                    if not k.startswith("__")})
    shim.timeout = lambda _seconds: no_deadline
    executor.asyncio = shim  # type: ignore[attr-defined]


def main() -> int:
    name, sep, *rest = sys.argv[1:]
    assert sep == "--", "usage: patched_worker.py PATCH -- CLI-ARGS..."
    for part in name.split("+"):
        if part == "trace-wake":
            trace_wake_path()
        elif part == "async-commit":
            async_commit()
        elif part == "no-handler-timeout":
            no_handler_timeout()
        else:
            named_queries.raw_queries().update(PATCHES[part])
    from conveyor.cli.main import main as cli_main

    return cli_main(rest)


if __name__ == "__main__":
    sys.exit(main())
