"""A total-queue checker over the ledger and the events table.

It applies Jepsen's *total-queue* semantics to the executions recorded by
:mod:`conveyor_tools.chaos.ledger` and the events' final states:

* **lost**: committed events that never completed (no successful execution and
  not parked ``failed``/``cancelled``);
* **unexpected**: executions of events that were never committed;
* **duplicated**: executions beyond the first that were not retries of a
  failed attempt. They are *allowed* when the previous execution's worker died
  (SIGKILL), or was cut off from the database before its acknowledgement could
  land (a network partition), or it had lost its lease by the time it ended,
  or it was cancelled (lease lost, shutdown); otherwise *unexplained* (an
  acknowledgement vanished);
* **overlapping**: two executions of one event running at the same time while
  both leases were valid (the second started before the first's granted lease
  expired, or the first still held its lease when it ended): a bug. Overlap
  with an execution whose lease had already been taken away is a zombie,
  counted apart and allowed.

Example::

    ...                                                 # enqueue, run, kill, restart
    with psycopg.connect(url, autocommit=True) as conn:
        report = check(conn, deaths={pid: killed_at})
    assert report.ok, report.summary()
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql

from conveyor_tools.chaos.ledger import (
    CANCELLED,
    RAISED,
    SCHEMA_DEFAULT,
    SUCCEEDED,
    TABLE_DEFAULT,
    table_identifier,
)


@dataclass(frozen=True, slots=True)
class Execution:
    """One handler call as the ledger recorded it (times are epoch seconds)."""

    execution: str
    event_id: int
    attempt: int
    pid: int
    started: float
    finished: float | None = None
    outcome: str | None = None
    lease_owner: str | None = None
    lease_attempt: int | None = None
    lease_state: str | None = None
    lease_expires: float | None = None
    end_lease_owner: str | None = None
    end_lease_attempt: int | None = None
    end_state: str | None = None
    host: str = ""

    @property
    def held_lease_at_start(self) -> bool:
        return (self.lease_state == "running" and self.lease_owner is not None
                and self.lease_attempt == self.attempt)

    @property
    def held_lease_at_end(self) -> bool:
        """Finished while the event row still named this execution's owner and attempt."""
        return (self.finished is not None and self.end_state == "running"
                and self.end_lease_owner is not None
                and self.end_lease_owner == self.lease_owner
                and self.end_lease_attempt == self.attempt)


EXAMPLES = 10
# How long a finished handler's acknowledgement may take to reach the database
# (the completer flushes within milliseconds; a loaded machine, a round trip).
ACK_SLACK = 1.0


@dataclass
class CheckReport:
    """What :func:`check` found. ``ok`` is the verdict; the lists hold up to 10 examples."""

    committed: int = 0
    executions: int = 0
    completed: int = 0
    retries: int = 0
    unfinished: int = 0
    lost: int = 0
    unexpected: int = 0
    duplicated: int = 0
    allowed_duplicates: int = 0
    duplicates_after_kill: int = 0
    duplicates_after_partition: int = 0
    unexplained_duplicates: int = 0
    overlapping: int = 0
    zombie_overlaps: int = 0
    started_without_lease: int = 0
    not_terminal: int = 0
    orphans: int = 0
    orphans_not_rerun: int = 0
    rerun_delays: list[float] = field(default_factory=list, repr=False)
    # cut-off -> next start elsewhere, for each event whose acknowledgement a partition held
    partition_rerun_delays: list[float] = field(default_factory=list, repr=False)
    lost_examples: list[tuple[int, str]] = field(default_factory=list)
    unexpected_examples: list[int] = field(default_factory=list)
    duplicate_examples: list[int] = field(default_factory=list)
    unexplained_examples: list[int] = field(default_factory=list)
    overlap_examples: list[tuple[str, str]] = field(default_factory=list)
    started_without_lease_examples: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No loss, no unexpected execution, no unexplained duplicate, no overlap.

        ``started_without_lease`` is reported but not part of the verdict: a
        handler whose start record could only be written after its lease was
        taken (a long outage) is a zombie that at-least-once allows; if it ran
        alongside the new owner, ``overlapping`` says so.
        """
        return not (self.lost or self.unexpected or self.unexplained_duplicates
                    or self.overlapping)

    @property
    def rerun_max(self) -> float | None:
        return max(self.rerun_delays) if self.rerun_delays else None

    @property
    def rerun_p95(self) -> float | None:
        return percentile(self.rerun_delays, 95)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("rerun_delays")
        partition_reruns = data.pop("partition_rerun_delays")
        data.update(ok=self.ok, rerun_max=self.rerun_max, rerun_p95=self.rerun_p95,
                    partition_rerun_max=max(partition_reruns) if partition_reruns else None)
        return data

    def summary(self) -> str:
        parts = [f"{self.committed} committed, {self.executions} executions "
                 f"({self.retries} retries, {self.unfinished} unfinished)",
                 f"lost {self.lost}", f"unexpected {self.unexpected}",
                 f"duplicated {self.duplicated} ({self.allowed_duplicates} allowed, "
                 f"{self.unexplained_duplicates} unexplained)",
                 f"overlapping {self.overlapping} (+{self.zombie_overlaps} after lease loss)",
                 f"started without lease {self.started_without_lease}",
                 f"not terminal {self.not_terminal}"]
        if self.orphans:
            parts.append(f"orphans {self.orphans}, re-run max {_fmt(self.rerun_max)} "
                         f"p95 {_fmt(self.rerun_p95)}, never re-run {self.orphans_not_rerun}")
        text = "; ".join(parts)
        for name in ("lost_examples", "unexpected_examples", "unexplained_examples",
                     "overlap_examples", "started_without_lease_examples"):
            value = getattr(self, name)
            if value:
                text += f"\n  {name}: {value}"
        return text


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def percentile(values: Iterable[float], pct: float) -> float | None:
    """Nearest-rank percentile, ``None`` for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[rank - 1]


def _add_example(examples: list[Any], value: Any) -> None:
    if len(examples) < EXAMPLES:
        examples.append(value)


def check_records(executions: Iterable[Execution], states: Mapping[int, str], *,
                  committed: Iterable[int] | None = None,
                  deaths: Mapping[int, float] | None = None,
                  partitions: Mapping[int, Sequence[tuple[float, float]]] | None = None,
                  ack_slack: float = ACK_SLACK) -> CheckReport:
    """The checker over plain records (what :func:`check` reads, or a fabricated history).

    Args:
        executions: the ledger.
        states: every event in the events table: id -> state.
        committed: ids the producers saw committed; defaults to every id in ``states``.
            An id committed but absent from the table is lost.
        deaths: pid -> epoch second of every worker process known to have died
            (SIGKILL). Unfinished executions on other pids are presumed dead too.
        partitions: pid -> (cut, healed) epoch seconds of every time that worker was cut
            off from the database. An execution that finished at most ``ack_slack``
            seconds before a cut, or during it, may have had its acknowledgement held
            by the partition: the event running again is allowed, as after a kill.
    """
    committed_ids = set(states) if committed is None else set(committed)
    deaths = dict(deaths or {})
    by_event: dict[int, list[Execution]] = defaultdict(list)
    report = CheckReport(committed=len(committed_ids))
    for ex in executions:
        by_event[ex.event_id].append(ex)
        report.executions += 1
        if ex.finished is None:
            report.unfinished += 1
        if not ex.held_lease_at_start:
            report.started_without_lease += 1
            _add_example(report.started_without_lease_examples, ex.execution)

    for event_id in sorted(set(by_event) - committed_ids):
        report.unexpected += len(by_event[event_id])
        _add_example(report.unexpected_examples, event_id)

    for event_id in sorted(committed_ids):
        runs = by_event.get(event_id, [])
        state = states.get(event_id)
        succeeded = any(r.outcome == SUCCEEDED for r in runs)
        if succeeded or state in ("failed", "cancelled"):
            report.completed += 1
        else:
            reason = "not in the events table" if state is None else (
                f"state {state}, no successful execution" if runs else f"state {state}, never run")
            report.lost += 1
            _add_example(report.lost_examples, (event_id, reason))
        if state not in ("succeeded", "failed", "cancelled"):
            report.not_terminal += 1

    for event_id, runs in by_event.items():
        runs.sort(key=lambda r: r.started)
        for i, run in enumerate(runs):
            if i:
                prev = runs[i - 1]
                if prev.outcome == RAISED:
                    report.retries += 1
                else:
                    report.duplicated += 1
                    _add_example(report.duplicate_examples, event_id)
                    died = prev.pid in deaths or prev.finished is None
                    if prev.pid in deaths:
                        report.duplicates_after_kill += 1
                    held = _cut_off(prev, partitions or {}, ack_slack)
                    if held is not None:
                        report.duplicates_after_partition += 1
                        report.partition_rerun_delays.append(run.started - held)
                    if (died or held is not None or prev.outcome == CANCELLED
                            or not prev.held_lease_at_end):
                        report.allowed_duplicates += 1
                    else:
                        report.unexplained_duplicates += 1
                        _add_example(report.unexplained_examples, event_id)
            # Orphans: executions on a worker that died; when did the event run again?
            if run.pid in deaths and (run.finished is None or run.outcome != RAISED):
                later = runs[i + 1:] if i + 1 < len(runs) else []
                if later:
                    report.orphans += 1
                    report.rerun_delays.append(later[0].started - deaths[run.pid])
                elif run.outcome != SUCCEEDED and states.get(event_id) != "succeeded":
                    report.orphans += 1
                    report.orphans_not_rerun += 1
            # Overlaps with every later execution that started before this one ended.
            end = run.finished if run.finished is not None else deaths.get(run.pid)
            if end is None:
                continue
            for other in runs[i + 1:]:
                if other.started >= end:
                    break
                both_valid = (
                    (run.lease_expires is not None and other.started < run.lease_expires)
                    or (run.held_lease_at_end and other.held_lease_at_start))
                if both_valid:
                    report.overlapping += 1
                    _add_example(report.overlap_examples, (run.execution, other.execution))
                else:
                    report.zombie_overlaps += 1
    return report


def _cut_off(run: Execution, partitions: Mapping[int, Sequence[tuple[float, float]]],
             slack: float) -> float | None:
    """When ``run``'s worker was cut off before its outcome could reach the database, if it was."""
    if run.finished is None:
        return None
    for cut, healed in partitions.get(run.pid, ()):
        if cut - slack <= run.finished <= healed:
            return cut
    return None


def _epoch(value: datetime | None) -> float | None:
    return None if value is None else value.timestamp()


def read_executions(conn: psycopg.Connection[Any], table: str = TABLE_DEFAULT) -> list[Execution]:
    """Every ledger record, as :class:`Execution` values."""
    query = sql.SQL(
        "SELECT execution::text, event_id, attempt, worker_pid, started_at, finished_at, outcome, "
        "lease_owner::text, lease_attempt, lease_state, lease_expires_at, end_lease_owner::text, "
        "end_lease_attempt, end_state, host FROM {}").format(table_identifier(table))
    rows = conn.execute(query).fetchall()
    return [Execution(execution=r[0], event_id=r[1], attempt=r[2], pid=r[3],
                      started=r[4].timestamp(), finished=_epoch(r[5]), outcome=r[6],
                      lease_owner=r[7], lease_attempt=r[8], lease_state=r[9],
                      lease_expires=_epoch(r[10]), end_lease_owner=r[11],
                      end_lease_attempt=r[12], end_state=r[13], host=r[14]) for r in rows]


def check(conn: psycopg.Connection[Any], *, table: str = TABLE_DEFAULT,
          schema: str = SCHEMA_DEFAULT, committed: Iterable[int] | None = None,
          deaths: Mapping[int, float] | None = None,
          partitions: Mapping[int, Sequence[tuple[float, float]]] | None = None,
          topic_like: str | None = None) -> CheckReport:
    """Check the ledger against the events table (see :func:`check_records`).

    ``topic_like`` limits the committed set to events whose topic matches a
    LIKE pattern (e.g. ``'chaos.%'``) when the table holds other events too.
    """
    query = sql.SQL("SELECT id, state FROM {} WHERE {}").format(
        sql.Identifier(schema, "events"),
        sql.SQL("true") if topic_like is None else sql.SQL("topic LIKE {}").format(
            sql.Literal(topic_like)))
    states = {int(i): str(s) for i, s in conn.execute(query).fetchall()}
    return check_records(read_executions(conn, table), states, committed=committed, deaths=deaths,
                         partitions=partitions)
