"""The measurements themselves: enqueue, drain and wake-up, each with its baseline.

Timing rules (the same for Conveyor and the baseline):

* Enqueue rates alternate Conveyor and raw in rounds (ABBA...) so drift on a
  shared machine falls on both; each side is warmed up first (psycopg
  prepares a statement on its fifth execution).
* A drain starts with the draining process already running, connected and
  idle (a ``conveyor worker`` registered half a second ago; the raw loop
  waiting for ``go``) on an empty, vacuumed table after a CHECKPOINT. Then
  ``count`` events are committed in one transaction (Conveyor: its own
  ``enqueue_many``, whose NOTIFY wakes the worker; raw: COPY, then ``go``).
  The rate is ``count / (last finished_at - first attempted_at)``, both
  stamped by ``now()`` in the claim and acknowledge statements: start-up,
  imports, connecting and the enqueue are outside the window, and no polling
  granularity enters it. The parent polls (every 50 ms, through the partial
  indexes) only to know when the drain is over, and reports the rate seen
  that way too (``wall``) as a cross-check. Every event must end
  ``succeeded`` with exactly one attempt, or the run fails (a drain that
  deletes: no event may be left, and the raw loop must count every one).
  CPU per event is read from ``/proc`` (``schedstat``, in ns) for the
  draining process and, when the server is on this machine, for its
  backends, from just before the fill's commit to the end of the drain
  (an idle worker's heartbeats during the fill are not the drain's).
  Before each drain every scratch table is emptied, so autovacuum finds no
  dead rows to clean up in the middle of a later one.
* WAL per drained event: ``pg_current_wal_insert_lsn()`` read inside the
  fill's transaction just before its COMMIT, and again once the drain is
  seen done. The fill's own WAL is all before the first reading (only its
  commit record, tens of bytes, falls after), and nothing reaches the
  worker before that commit, so no separate fill has to be measured and
  subtracted. The LSN is the server's: other sessions' writes count too,
  so the suite reports the least of its runs (see ``suite._wal``).
* Wake-up latency: an idle worker, events enqueued one per transaction every
  ``gap`` seconds; latency = handler start ``time.time()`` (in the worker)
  minus ``time.time()`` right after the producer's commit returned.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import psycopg
import psycopg.sql

from conveyor.config import ProducerConfig
from conveyor.producer import NewEvent, Producer
from conveyor_tools.bench import scratch
from conveyor_tools.bench.app import NOOP_TOPIC, WAKE_TOPIC
from conveyor_tools.bench.baseline import (
    RawVariant,
    copy_rows,
    insert_sql,
    order_sql,
    wake_channel,
)
from conveyor_tools.bench.processes import CpuProbe, ProcessRegistry, peak_rss_mb
from conveyor_tools.bench.scratch import BenchError, Schemas

WARMUP = 20
POLL = 0.05
DELETE_POLL = 0.002  # the only clock of a drain whose rows are deleted
IDLE_SETTLE = 0.5  # after registering: listener connected, first heartbeat done


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("no values")
    data = sorted(values)
    pos = (len(data) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (pos - low)


def _split(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts) if base or i < extra]


@dataclass(frozen=True, slots=True)
class SingleRates:
    """Events per second, one event per transaction, in two transaction shapes.

    ``one_tx``: a transaction of its own (BEGIN, the INSERT, COMMIT) on a
    connection that is not in autocommit, as an application writes an event
    inside its own transaction. ``autocommit``: one statement on an
    autocommit connection, no BEGIN or COMMIT sent.
    """

    one_tx: float
    raw_one_tx: float
    autocommit: float
    raw_autocommit: float


def enqueue_single(url: str, schemas: Schemas, count: int, rounds: int = 10) -> SingleRates:
    """One event per transaction: ``Producer.enqueue`` against one raw INSERT of the same shape.

    The raw INSERT returns nothing (``enqueue`` returns the id): the
    strongest baseline, not the closest copy.
    """
    producer = Producer(ProducerConfig(schema=schemas.conveyor))
    insert = insert_sql(schemas.raw)
    with psycopg.connect(url) as c_tx, psycopg.connect(url) as r_tx, \
            psycopg.connect(url, autocommit=True) as c_auto, \
            psycopg.connect(url, autocommit=True) as r_auto:
        def conveyor(conn: psycopg.Connection[Any]) -> Callable[[int], None]:
            def run(k: int) -> None:
                for i in range(k):
                    producer.enqueue(conn, NOOP_TOPIC, {"i": i})
                    if not conn.autocommit:
                        conn.commit()
            return run

        def raw(conn: psycopg.Connection[Any]) -> Callable[[int], None]:
            def run(k: int) -> None:
                for i in range(k):
                    conn.execute(insert, (NOOP_TOPIC, json.dumps({"i": i})))
                    if not conn.autocommit:
                        conn.commit()
            return run

        fns = [conveyor(c_tx), raw(r_tx), conveyor(c_auto), raw(r_auto)]
        for fn in fns:
            fn(WARMUP)
        spent = _rotate(count, rounds, fns)
    return SingleRates(*(count / s for s in spent))


@dataclass(frozen=True, slots=True)
class OutboxRates:
    """Transactions per second: a business INSERT alone, with ``enqueue``, with a raw INSERT."""

    business: float
    business_enqueue: float
    business_raw_insert: float

    def marginal_us(self, rate: float) -> float:
        """Microseconds one event adds to a business transaction."""
        return (1 / rate - 1 / self.business) * 1e6

    @property
    def ratio(self) -> float | None:
        """What ``enqueue`` adds over what a plain INSERT adds; ``None`` when the
        plain INSERT measured as adding nothing (noise larger than the effect)."""
        raw = self.marginal_us(self.business_raw_insert)
        return self.marginal_us(self.business_enqueue) / raw if raw > 0 else None


def outbox_marginal(url: str, schemas: Schemas, count: int, rounds: int) -> OutboxRates:
    """The outbox's cost inside a business transaction, ``count`` transactions of each shape.

    Every transaction inserts an order (``RETURNING id``, as an application
    needs it for its event); two of the shapes then write one event naming
    that order, with ``Producer.enqueue`` or with a raw INSERT, before the
    COMMIT. The extra is small against the commit's WAL flush, so the shapes
    take turns in many short rounds (drift on a shared machine falls on all
    three alike) over a few thousand transactions each.
    """
    producer = Producer(ProducerConfig(schema=schemas.conveyor))
    order, insert = order_sql(schemas.raw), insert_sql(schemas.raw)
    with psycopg.connect(url) as alone, psycopg.connect(url) as with_enqueue, \
            psycopg.connect(url) as with_raw:
        def business(conn: psycopg.Connection[Any], i: int) -> int:
            row = conn.execute(order, (f"customer-{i % 97}", i % 1000 + 0.5)).fetchone()
            assert row is not None
            return int(row[0])

        def only(k: int) -> None:
            for i in range(k):
                business(alone, i)
                alone.commit()

        def enqueue(k: int) -> None:
            for i in range(k):
                order_id = business(with_enqueue, i)
                producer.enqueue(with_enqueue, NOOP_TOPIC, {"order": order_id})
                with_enqueue.commit()

        def raw(k: int) -> None:
            for i in range(k):
                order_id = business(with_raw, i)
                with_raw.execute(insert, (NOOP_TOPIC, json.dumps({"order": order_id})))
                with_raw.commit()

        fns = [only, enqueue, raw]
        for fn in fns:
            fn(WARMUP)
        spent = _rotate(count, rounds, fns)
    return OutboxRates(*(count / s for s in spent))


def enqueue_batch(url: str, schemas: Schemas, count: int, batch: int = 1000,
                  rounds: int = 4) -> tuple[float, float, float, float]:
    """``batch`` events per transaction, per second: bulk, bulk joining a transaction, ids, raw COPY.

    ``enqueue_bulk`` returns a count, as a raw COPY does; it is given
    ``(topic, payload)`` pairs, its fastest documented form. When the call
    begins the transaction it sends rows while it checks them; joining a
    transaction already open (here after a ``SELECT 1``, as after a business
    write) it checks every event first. ``enqueue_many`` also hands back
    every id, which costs a round trip to reserve them first.
    """
    producer = Producer(ProducerConfig(schema=schemas.conveyor))
    batches = max(1, count // batch)
    with psycopg.connect(url) as c_conn, psycopg.connect(url) as r_conn:
        def bulk(k: int) -> None:
            for _ in range(k):
                producer.enqueue_bulk(c_conn, [(NOOP_TOPIC, {"i": i}) for i in range(batch)])
                c_conn.commit()

        def bulk_in_tx(k: int) -> None:
            for _ in range(k):
                c_conn.execute("SELECT 1")
                producer.enqueue_bulk(c_conn, [(NOOP_TOPIC, {"i": i}) for i in range(batch)])
                c_conn.commit()

        def many(k: int) -> None:
            for _ in range(k):
                producer.enqueue_many(c_conn, [NewEvent(topic=NOOP_TOPIC, payload={"i": i})
                                               for i in range(batch)])
                c_conn.commit()

        def raw(k: int) -> None:
            for _ in range(k):
                copy_rows(r_conn, schemas.raw,
                          ((NOOP_TOPIC, json.dumps({"i": i})) for i in range(batch)))
                r_conn.commit()

        fns = [bulk, bulk_in_tx, many, raw]
        for fn in fns:
            fn(1)
        spent = _rotate(batches, rounds, fns)
    return tuple(batches * batch / s for s in spent)  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class EnqueueWal:
    """Bytes of WAL per enqueued event: bulk (``enqueue_bulk``, 1000 a transaction) against
    a raw COPY, single (``enqueue`` + COMMIT) against a raw INSERT + COMMIT."""

    bulk: float
    raw_copy: float
    single: float
    raw_insert: float


def enqueue_wal(admin: psycopg.Connection[Any], url: str, schemas: Schemas, count: int,
                tries: int = 3) -> EnqueueWal:
    """WAL per event of each enqueue shape, the least of ``tries`` runs of ``count`` events.

    WAL is counted server-wide (``pg_current_wal_insert_lsn()``), so another
    session's writes (or a checkpoint's full-page images) can only add to a
    run: the least is the shape's own. Nothing else in the figure depends on
    the machine's load.
    """
    producer = Producer(ProducerConfig(schema=schemas.conveyor))
    insert = insert_sql(schemas.raw)
    batch = 1000
    singles = max(1, count // 10)

    with psycopg.connect(url) as c_conn, psycopg.connect(url) as r_conn:
        def bulk() -> int:
            for _ in range(max(1, count // batch)):
                producer.enqueue_bulk(c_conn, [(NOOP_TOPIC, {"i": i}) for i in range(batch)])
                c_conn.commit()
            return max(1, count // batch) * batch

        def raw_copy() -> int:
            for _ in range(max(1, count // batch)):
                copy_rows(r_conn, schemas.raw,
                          ((NOOP_TOPIC, json.dumps({"i": i})) for i in range(batch)))
                r_conn.commit()
            return max(1, count // batch) * batch

        def single() -> int:
            for i in range(singles):
                producer.enqueue(c_conn, NOOP_TOPIC, {"i": i})
                c_conn.commit()
            return singles

        def raw_insert() -> int:
            for i in range(singles):
                r_conn.execute(insert, (NOOP_TOPIC, json.dumps({"i": i})))
                r_conn.commit()
            return singles

        least: dict[str, float] = {}
        for _ in range(tries):
            for name, fn in (("bulk", bulk), ("raw_copy", raw_copy), ("single", single),
                             ("raw_insert", raw_insert)):
                _reset_all(admin, schemas)
                lsn = scratch.wal_lsn(admin)
                n = fn()
                per_event = scratch.wal_since(admin, lsn) / n
                least[name] = min(least.get(name, per_event), per_event)
    _reset_all(admin, schemas)
    return EnqueueWal(**least)


def _rotate(total: int, rounds: int, fns: Sequence[Callable[[int], None]]) -> list[float]:
    """Run each of ``fns`` over ``total`` units, in an order rotated every round; their seconds."""
    spent = [0.0] * len(fns)
    for r, k in enumerate(_split(total, rounds)):
        for j in range(len(fns)):
            slot = (j + r) % len(fns)
            t0 = time.perf_counter()
            fns[slot](k)
            spent[slot] += time.perf_counter() - t0
    return spent


@dataclass(frozen=True, slots=True)
class DrainRun:
    """One drain: the rate from table timestamps, the parent's view, peak RSS, CPU per event.

    ``client_us``/``db_us`` are CPU microseconds per event of the draining process
    and of its database backends (``None`` where they cannot be read, e.g. a
    remote server). ``wal_bytes`` is WAL per event from the fill's commit to
    the end of the drain, every session's (a quiet server makes it the drain's).
    """

    per_s: float
    seconds: float
    wall_per_s: float
    rss_mb: float
    label: str
    client_us: float | None = None
    db_us: float | None = None
    wal_bytes: float | None = None

    @property
    def cpu_us(self) -> float | None:
        if self.client_us is None or self.db_us is None:
            return None
        return self.client_us + self.db_us


def _reset_all(admin: psycopg.Connection[Any], schemas: Schemas) -> None:
    """Empty every scratch table, not only the one drained next (see ``scratch.reset``)."""
    for schema in schemas.all:
        scratch.reset(admin, schema)


def _timeout(count: int) -> float:
    return 60.0 + count / 200


def _per_event(seconds: float | None, count: int) -> float | None:
    return None if seconds is None else seconds * 1e6 / count


def conveyor_drain(admin: psycopg.Connection[Any], url: str, schemas: Schemas, count: int,
                   registry: ProcessRegistry, *, batch_size: int | None = None,
                   concurrency: int | None = None, retention: float | None = None,
                   head_sampled: float | None = None, **options: Any) -> DrainRun:
    """Start an idle worker, then commit ``count`` events at once; time first claim to last ack.

    With ``retention=0`` the worker deletes each event as it acknowledges it,
    so no row keeps its timestamps: the drain is then timed from the fill's
    commit to the moment no event is left (polled every 2 ms), which also
    counts the wake-up and up to one poll against Conveyor. ``options`` go to
    :class:`~conveyor_tools.bench.processes.WorkerProcess` (``app``, ``flags``).
    """
    schema = schemas.conveyor
    _reset_all(admin, schemas)
    scratch.settle(admin, schema)
    worker = registry.worker(url, schema, batch_size=batch_size, concurrency=concurrency,
                             retention=retention, **options)
    worker.start()
    worker.wait_registered(admin)
    time.sleep(IDLE_SETTLE)
    probes: list[CpuProbe] = []
    deletes = retention == 0
    # One commit: its NOTIFY starts the drain. The CPU probe starts just before
    # it, so the worker's idle time (heartbeats) while the fill runs is not counted.
    lsn = scratch.fill_conveyor(url, schema, NOOP_TOPIC, count,
                                lambda: probes.append(CpuProbe(admin, worker.pid)),
                                head_sampled=head_sampled)
    filled = time.time()
    probe = probes[0]
    deadline = time.monotonic() + _timeout(count)
    while scratch.unfinished(admin, schema):
        worker.check_alive()
        if time.monotonic() > deadline:
            raise BenchError(f"conveyor drain of {count} events did not finish in time")
        time.sleep(DELETE_POLL if deletes else POLL)
    seen_done = time.time()
    wal = scratch.wal_since(admin, lsn) / count
    client_cpu, db_cpu = probe.spent(admin)
    rss = worker.peak_rss_mb()
    code = worker.stop()
    if code != 0:
        raise BenchError(f"worker exited with code {code} after the drain")
    label = _drain_label(batch_size, concurrency, retention)
    if deletes:
        left = scratch.drain_stats(admin, schema).total
        if left:
            raise BenchError(f"conveyor drain ({label}): {left} events were not deleted")
        seconds = seen_done - filled
        return DrainRun(count / seconds, seconds, count / seconds, rss, label,
                        _per_event(client_cpu, count), _per_event(db_cpu, count), wal)
    stats = scratch.drain_stats(admin, schema)
    seconds = stats.check(count, f"conveyor drain ({label})")
    assert stats.first_claim is not None
    return DrainRun(count / seconds, seconds, count / (seen_done - stats.first_claim), rss, label,
                    _per_event(client_cpu, count), _per_event(db_cpu, count), wal)


def _drain_label(batch_size: int | None, concurrency: int | None, retention: float | None) -> str:
    if batch_size is None and concurrency is None and retention is None:
        return "defaults"
    label = f"batch_size={batch_size} concurrency={concurrency}"
    return label if retention is None else f"{label} retention={retention:g}"


def raw_backlog(admin: psycopg.Connection[Any], url: str, schema: str, count: int,
                before_commit: Callable[[], None] | None = None) -> str:
    """Fill the baseline table for a drain and analyze it; the WAL position after.

    Statistics that know the backlog: planned from the empty table's, the raw
    loop's first claims read and sorted every row (about 25 ms each) until
    the plan changed, some 150 ms of a 60,000-event drain (2026-12-05), a
    weaker baseline than the loop is. The worker needs none (its claims never
    sort: conveyor/worker/sessions.py, NO_SORT), and its fill's commit starts
    its drain, so only this side is analyzed.
    """
    scratch.fill_raw(url, schema, NOOP_TOPIC, count, before_commit)
    admin.execute(psycopg.sql.SQL("ANALYZE {}").format(psycopg.sql.Identifier(schema, "events")))
    return scratch.wal_lsn(admin)


def raw_drain(admin: psycopg.Connection[Any], url: str, schemas: Schemas, count: int,
              variant: RawVariant, registry: ProcessRegistry) -> DrainRun:
    """The same for the baseline loop: connected and idle, then the events, then ``go``.

    A ``mark`` drain is timed from the table (first ``attempted_at`` to last
    ``finished_at``) as Conveyor's is; a ``delete`` drain leaves no row, so
    by the loop's own clock over the same span (sent first claim to sent
    last finish). Between the fill and ``go`` the table is analyzed
    (:func:`raw_backlog`); its WAL is counted from then on, the worker's from
    its fill's commit, which starts its drain.
    """
    schema = schemas.raw
    _reset_all(admin, schemas)
    scratch.settle(admin, schema)
    drainer = registry.raw_drainer(url, schema, variant)
    drainer.start()
    drainer.wait_ready()
    probes: list[CpuProbe] = []
    lsn = raw_backlog(admin, url, schema, count,
                      lambda: probes.append(CpuProbe(admin, drainer.pid)))
    probe = probes[0]
    drainer.go()
    report = drainer.result(_timeout(count))
    seen_done = time.time()
    wal = scratch.wal_since(admin, lsn) / count
    client_cpu, db_cpu = probe.spent(admin)
    drainer.stop()
    if report["handled"] != count:
        raise BenchError(f"raw drain ({variant.label}) handled {report['handled']} of {count} events")
    if variant.commit is not None and report["synchronous_commit"] != variant.commit:
        raise BenchError(f"raw drain ({variant.label}) ran with synchronous_commit="
                         f"{report['synchronous_commit']}")
    stats = scratch.drain_stats(admin, schema)
    if variant.finish == "delete":
        if stats.total:
            raise BenchError(f"raw drain ({variant.label}): {stats.total} events were not deleted")
        first, seconds = report["first_claim"], report["last_finish"] - report["first_claim"]
        if seconds <= 0:
            raise BenchError(f"raw drain ({variant.label}): no usable clock readings")
    else:
        seconds = stats.check(count, f"raw drain ({variant.label})")
        assert stats.first_claim is not None
        first = stats.first_claim
    return DrainRun(count / seconds, seconds, count / (seen_done - first),
                    float(report["rss_mb"]), variant.label,
                    _per_event(client_cpu, count), _per_event(db_cpu, count), wal)


# ------------------------------------------------------------------ wake-up

class _PipeReader:
    """Collects the ``"<id> <epoch>"`` lines the wake handler writes to its pipe."""

    def __init__(self, fd: int) -> None:
        self.seen: dict[int, float] = {}
        self._cond = threading.Condition()
        self._file = os.fdopen(fd, "rb")
        self._thread = threading.Thread(target=self._read, name="bench-wake-reader",
                                        daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self._file:
            event_id, _, started = line.decode().partition(" ")
            with self._cond:
                self.seen[int(event_id)] = float(started)
                self._cond.notify_all()

    def wait_for(self, ids: set[int], timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: ids <= self.seen.keys(), timeout)

    def close(self) -> None:
        self._thread.join(timeout=5)
        self._file.close()


class _Startable(Protocol):
    def start(self) -> None: ...


Child = TypeVar("Child", bound=_Startable)


@dataclass(frozen=True, slots=True)
class WakeRun:
    latencies_ms: list[float] = field(repr=False)
    missing: int
    rss_mb: float

    def p(self, q: float) -> float:
        return percentile(self.latencies_ms, q)


def wake_latency(admin: psycopg.Connection[Any], url: str, schemas: Schemas,
                 registry: ProcessRegistry, *, samples: int, warmup: int = 10,
                 gap: float = 0.02) -> WakeRun:
    """Latency from commit-return to handler start, for an idle worker at defaults."""
    schema = schemas.conveyor
    scratch.reset(admin, schema)
    worker, reader = _started_with_pipe(lambda fd: registry.worker(url, schema, wake_fd=fd))
    try:
        worker.wait_registered(admin)
        producer = Producer(ProducerConfig(schema=schema))
        with psycopg.connect(url) as conn:
            def send() -> tuple[int, float]:
                event_id = producer.enqueue(conn, WAKE_TOPIC, {})
                conn.commit()
                return event_id, time.time()

            sent = _wake_samples(send, reader, worker.check_alive, samples, warmup, gap)
        rss = worker.peak_rss_mb()
        worker.stop()
    finally:
        worker.stop()
        reader.close()
    return _wake_run(reader, sent, samples, rss)


def raw_wake_latency(admin: psycopg.Connection[Any], url: str, schemas: Schemas,
                     registry: ProcessRegistry, *, samples: int, warmup: int = 10,
                     gap: float = 0.02) -> WakeRun:
    """The same for the baseline: INSERT and NOTIFY in one transaction, LISTEN and claim."""
    schema = schemas.raw
    scratch.reset(admin, schema)
    waker, reader = _started_with_pipe(lambda fd: registry.raw_waker(url, schema, fd))
    try:
        waker.wait_ready()
        insert = insert_sql(schema) + " RETURNING id"
        notify = psycopg.sql.SQL("NOTIFY {}").format(psycopg.sql.Identifier(wake_channel(schema)))
        with psycopg.connect(url) as conn:
            def send() -> tuple[int, float]:
                row = conn.execute(insert, (WAKE_TOPIC, "{}")).fetchone()
                conn.execute(notify)
                conn.commit()
                assert row is not None
                return int(row[0]), time.time()

            def alive() -> None:
                if waker.proc is not None and waker.proc.poll() is not None:
                    raise BenchError(f"the raw wake-up loop exited:\n{waker._tail()}")

            sent = _wake_samples(send, reader, alive, samples, warmup, gap)
        rss = peak_rss_mb(waker.pid)
    finally:
        waker.stop()
        reader.close()
    return _wake_run(reader, sent, samples, rss)


def _started_with_pipe(make: Callable[[int], Child]) -> tuple[Child, _PipeReader]:
    """A child started with the write end of a new pipe, and a reader of the other end."""
    read_fd, write_fd = os.pipe()
    child = make(write_fd)
    try:
        child.start()
    finally:
        os.close(write_fd)  # the child holds the only write end now: EOF when it exits
    return child, _PipeReader(read_fd)


def _wake_samples(send: Callable[[], tuple[int, float]], reader: _PipeReader,
                  check_alive: Callable[[], None], samples: int, warmup: int,
                  gap: float) -> dict[int, float]:
    """Warm up, then send ``samples`` events ``gap`` apart; their commit times by id."""
    warm: set[int] = set()
    for _ in range(warmup):
        warm.add(send()[0])
        time.sleep(gap)
    if not reader.wait_for(warm, timeout=30):
        check_alive()
        raise BenchError("the idle consumer did not run the warm-up events within 30s")
    sent: dict[int, float] = {}
    start = time.perf_counter()
    for i in range(samples):
        pause = start + i * gap - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
        event_id, committed = send()
        sent[event_id] = committed
    # A lost NOTIFY would still be found by the 5 s poll; wait past one.
    reader.wait_for(set(sent), timeout=15)
    return sent


def _wake_run(reader: _PipeReader, sent: dict[int, float], samples: int, rss: float) -> WakeRun:
    latencies = [(reader.seen[i] - t) * 1000 for i, t in sent.items() if i in reader.seen]
    if not latencies:
        raise BenchError("no wake-up sample arrived")
    return WakeRun(latencies, samples - len(latencies), rss)


@dataclass
class ChordRun:
    """One chord (a group of no-op members and one callback), drained at defaults."""

    members: int
    callback_after_last_ms: float    # callback's start - the last member's finish
    members_done_s: float            # the last member's finish - the workflow's commit
    total_s: float                   # the callback's finish - the workflow's commit


def chord(admin: psycopg.Connection[Any], url: str, schemas: Schemas,
          registry: ProcessRegistry, *, members: int) -> ChordRun:
    """Enqueue ``group(members no-op steps).then(one no-op step)`` for an idle worker at
    defaults; read from the rows how long after the last member the callback started.

    Both sides are the database's clock (``finished_at``, ``attempted_at``), so
    the figure holds no client clock offset: it is the dependency service's
    delay plus the callback's wake-up and claim.
    """
    from conveyor import group, step

    schema = schemas.conveyor
    _reset_all(admin, schemas)
    scratch.settle(admin, schema)
    worker = registry.worker(url, schema)
    worker.start()
    worker.wait_registered(admin)
    with psycopg.connect(url) as conn:
        callback = step(NOOP_TOPIC, {"callback": True})
        ids = Producer(ProducerConfig(schema=schema)).enqueue_workflow(
            conn, group(*[step(NOOP_TOPIC, {"i": i}) for i in range(members)]).then(callback))
        committed = conn.execute("SELECT now()").fetchone()
        conn.commit()
    assert committed is not None
    table = psycopg.sql.Identifier(schema, "events")
    deadline = time.monotonic() + _timeout(members)
    done_query = psycopg.sql.SQL("SELECT state = 'succeeded' FROM {} WHERE id = %s").format(table)
    while True:
        row = admin.execute(done_query, (ids[callback],)).fetchone()
        if row is not None and row[0]:
            break
        worker.check_alive()
        if time.monotonic() > deadline:
            raise BenchError(f"the chord of {members} members did not finish in time")
        time.sleep(POLL)
    found = admin.execute(psycopg.sql.SQL("""
        SELECT extract(epoch FROM c.attempted_at - m.last) * 1000,
               extract(epoch FROM m.last - %s::timestamptz),
               extract(epoch FROM c.finished_at - %s::timestamptz)
        FROM {t} AS c,
             (SELECT max(finished_at) AS last FROM {t} WHERE id <> %s) AS m
        WHERE c.id = %s""").format(t=table),
        (committed[0], committed[0], ids[callback], ids[callback])).fetchone()
    assert found is not None
    code = worker.stop()
    if code != 0:
        raise BenchError(f"worker exited with code {code} after the chord")
    return ChordRun(members, float(found[0]), float(found[1]), float(found[2]))
