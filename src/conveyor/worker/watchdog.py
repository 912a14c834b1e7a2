"""Notices an event loop that a handler blocks, names the handler, and keeps the leases.

An async handler that calls blocking code (``time.sleep``, a synchronous
driver, heavy CPU work) stops the whole worker: no other handler runs, no
heartbeat renews the leases, no deadline is enforced. Past ``lease_ttl`` the
rescuer of another worker would take the events back and run them again, the
attempts overlapping on two workers, so a handler that always succeeds could
end ``failed`` after ``max_attempts`` rescues. Nothing on the blocked loop can
see this happen, so a thread watches a tick the loop posts; while the loop is
stuck, that thread renews the worker's leases itself (:class:`StallLeases`),
each one only until its handler's timeout, so a loop blocked for ever does not
hold its events for ever.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg

from conveyor.config import WorkerConfig
from conveyor.db.connect import connect
from conveyor.db.named_queries import Queries
from conveyor.errors import DatabaseUnavailableError
from conveyor.types import Event
from conveyor.worker.connection import ConnectionGate
from conveyor.worker.in_flight import InFlight

log = logging.getLogger(__name__)

TICK_INTERVAL = 0.1
# A loop that has not run for this long (or a quarter of the lease, if less) is
# reported: every handler and the heartbeat wait on it.
LOOP_STALL_WARNING = 1.0


def _where(thread_id: int) -> str:
    """The innermost frame the given thread is executing, as ``file:line in function``."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return "an unknown place"
    code = frame.f_code
    return f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"


class StallLeases:
    """Renews a blocked worker's leases from the watchdog's thread, on a connection of its own.

    The connection is opened at the first renewal of a stall and closed when
    the loop runs again: a worker whose loop never blocks never opens it.

    Args:
        conninfo: where the worker's connections go.
        queries: the schema's named queries.
        owner: the worker's id, the lease owner of its events.
        lease_ttl: seconds each renewal extends a lease by.
        query_timeout: bound of each statement (and of the connect).
        held: given the loop's clock now (as the loop would read it) and how
            long the loop has been stuck, returns the ids of the events whose
            leases to keep: those whose calls may still legitimately run
            (:meth:`~conveyor.worker.executor.Executor.held_during_stall`).
        gate: what must admit the connection before it opens (a shared connection
            budget); refused, the renewal is skipped and logged. Defaults to none.
    """

    def __init__(self, conninfo: str, queries: Queries, owner: str, *, lease_ttl: float,
                 query_timeout: float, held: Callable[[float, float], list[int]],
                 gate: ConnectionGate | None = None) -> None:
        self._conninfo = conninfo
        self._gate = gate
        self._q = queries
        self._owner = owner
        self._lease_ttl = lease_ttl
        self._timeout = query_timeout
        self._held = held
        self._conn: psycopg.Connection[Any] | None = None
        self._admitted = False     # whether the gate admitted the connection held

    def renew(self, loop_now: float, stalled_for: float) -> tuple[int, int]:
        """Renew the held events' leases; returns (held, renewed). Never raises."""
        try:
            ids = sorted(set(self._held(loop_now, stalled_for)))
            if not ids:
                return 0, 0
            conn = self._conn
            if conn is None or conn.closed:
                self.close()
                if self._gate is not None and not self._gate.try_acquire():
                    log.warning("no room in the connection budget to renew the leases while "
                                "the event loop is blocked", extra={"action": "stall_renew_failed"})
                    return len(ids), 0
                self._admitted = self._gate is not None
                # No prepared statements: a transaction pooler may stand in between.
                conn = self._conn = connect(
                    self._conninfo, autocommit=True, application_name="conveyor-watchdog",
                    connect_timeout=max(1, round(self._timeout)), prepare_threshold=None)
            with conn.transaction():
                # Transaction-local, so a transaction pooler keeps no setting.
                conn.execute("SELECT set_config('statement_timeout', %s, true)",
                             [str(int(self._timeout * 1000))])
                cur = conn.execute(self._q["event_extend_leases"], {
                    "ids": ids, "owner": self._owner, "lease_ttl": self._lease_ttl})
                return len(ids), len(cur.fetchall())
        except (psycopg.Error, OSError, DatabaseUnavailableError) as exc:
            log.warning("could not renew the leases while the event loop is blocked: %s",
                        (str(exc).strip().splitlines() or [type(exc).__name__])[0],
                        extra={"action": "stall_renew_failed"})
            self.close()
            return 0, 0
        except Exception:   # a thread's error must not end the watchdog
            log.exception("could not renew the leases while the event loop is blocked",
                          extra={"action": "stall_renew_failed"})
            return 0, 0

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - closing is best effort
                pass
        if self._admitted and self._gate is not None:
            self._admitted = False
            self._gate.release()


class LoopWatchdog:
    """Warns when the loop has not run for ``warn_after`` seconds; again past the lease.

    Args:
        identify: called from the watchdog's thread while the loop is stuck;
            returns the event whose handler holds it, if it can tell.
        warn_after: seconds without a loop tick before the first warning.
        lease_ttl: seconds after which the worker's leases may expire.
        on_stall: told the length of every stall once it ends (for statistics).
        leases: renews the leases while the loop is stuck, every
            ``renew_every`` seconds from the first warning on. Defaults to
            None (they are not renewed).
        renew_every: seconds between those renewals (the heartbeat's interval).
    """

    def __init__(self, *, identify: Callable[[], Event | None], warn_after: float,
                 lease_ttl: float, on_stall: Callable[[float], None] | None = None,
                 leases: StallLeases | None = None, renew_every: float = 1.0) -> None:
        self._identify = identify
        self._warn_after = warn_after
        self._lease_ttl = lease_ttl
        self._on_stall = on_stall
        self._leases = leases
        self._renew_every = renew_every
        self._beat = time.monotonic()
        self._beat_loop_time = 0.0   # the loop's own clock at that beat
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tick_handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0

    @classmethod
    def for_worker(cls, conninfo: str, queries: Queries, owner: str, config: WorkerConfig,
                   calls: InFlight, *, on_stall: Callable[[float], None],
                   gate: ConnectionGate | None = None) -> LoopWatchdog:
        """The watchdog of the worker ``owner``, whose handler calls are ``calls``:
        it warns after ``LOOP_STALL_WARNING``, and renews the leases of the calls
        that may still run (:class:`StallLeases`, on a connection to ``conninfo``
        admitted by ``gate``) at the heartbeat's pace."""
        leases = StallLeases(conninfo, queries, owner, lease_ttl=config.lease_ttl,
                             query_timeout=config.query_timeout,
                             held=calls.held_during_stall, gate=gate)
        return cls(identify=calls.blocking_event,
                   warn_after=min(LOOP_STALL_WARNING, config.lease_ttl / 4),
                   lease_ttl=config.lease_ttl, on_stall=on_stall, leases=leases,
                   renew_every=config.heartbeat_interval)

    @property
    def watching(self) -> bool:
        """Whether the watchdog runs, which it does exactly while the worker's loops do."""
        return self._thread is not None

    def lag(self) -> float:
        """Seconds since the loop last ran its tick (0 to 0.1 while it runs freely)."""
        return max(0.0, time.monotonic() - self._beat)

    def start(self) -> None:
        """Start watching the running loop (call from inside it)."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._beat = time.monotonic()
        self._beat_loop_time = self._loop.time()
        self._tick_handle = self._loop.call_later(TICK_INTERVAL, self._tick)
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="conveyor-loop-watchdog",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._tick_handle is not None:
            self._tick_handle.cancel()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            self._thread = None

    def _tick(self) -> None:
        assert self._loop is not None
        # Both clocks at once: a handler's deadline is on the loop's clock, which
        # (uvloop's cached one) cannot be read from this thread while it is stuck.
        self._beat_loop_time = self._loop.time()
        self._beat = time.monotonic()
        self._tick_handle = self._loop.call_later(TICK_INTERVAL, self._tick)

    def _watch(self) -> None:
        stalled_since: float | None = None   # the beat the current stall started from
        past_lease = False
        next_renewal = 0.0
        try:
            while not self._stop.wait(TICK_INTERVAL):
                beat = self._beat
                now = time.monotonic()
                lag = now - beat
                if stalled_since is not None and beat != stalled_since:
                    self._resumed(beat - stalled_since)
                    stalled_since, past_lease = None, False
                if lag < self._warn_after + TICK_INTERVAL:
                    continue
                if stalled_since is None:
                    stalled_since = beat
                    next_renewal = now
                    self._report(lag, logging.WARNING, "loop_blocked",
                                 "async handlers must not block: route blocking code with "
                                 "blocking=True or use asyncio.to_thread")
                elif not past_lease and lag >= self._lease_ttl:
                    past_lease = True
                    self._report(lag, logging.ERROR, "loop_blocked_past_lease",
                                 f"past the lease ({self._lease_ttl:g}s): "
                                 + ("the watchdog renews the leases of the worker's events, "
                                    "each until its handler's timeout; after that they may be "
                                    "rescued and run again elsewhere" if self._leases is not None
                                    else "no heartbeat ran, so this worker's events may be "
                                    "rescued and run again elsewhere"))
                if self._leases is not None and now >= next_renewal:
                    next_renewal = now + self._renew_every
                    self._renew(self._beat_loop_time + lag, lag)
        finally:
            if self._leases is not None:
                self._leases.close()

    def _renew(self, loop_now: float, stalled_for: float) -> None:
        assert self._leases is not None
        held, renewed = self._leases.renew(loop_now, stalled_for)
        if held:
            log.info("renewed %d of %d leases while the event loop is blocked", renewed, held,
                     extra={"action": "stall_leases_renewed", "held": held, "renewed": renewed,
                            "blocked_s": round(stalled_for, 3)})

    def _report(self, lag: float, level: int, action: str, advice: str) -> None:
        try:
            event = self._identify()
        except Exception:  # noqa: BLE001 - naming the culprit is best effort
            event = None
        where = _where(self._loop_thread)
        if event is None:
            culprit, fields = "", {}
        else:
            culprit = (f" by the handler of event {event.id} ({event.topic}, "
                       f"attempt {event.attempt})")
            fields = {"event_id": event.id, "topic": event.topic, "tenant": event.tenant,
                      "attempt": event.attempt}
        log.log(level, "event loop blocked for %.1fs%s, now at %s; %s", lag, culprit, where,
                advice, extra={"action": action, "blocked_s": round(lag, 3), "where": where,
                               **fields})

    def _resumed(self, stalled: float) -> None:
        if self._leases is not None:
            self._leases.close()
        log.info("event loop ran again after %.1fs", stalled,
                 extra={"action": "loop_resumed", "blocked_s": round(stalled, 3)})
        if self._on_stall is not None:
            self._on_stall(stalled)
