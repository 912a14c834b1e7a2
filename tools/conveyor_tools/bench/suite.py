"""The whole benchmark in one run: what is measured, in which order, how often.

Drains come in three phases. Defaults first: ``reps`` drains at the
defaults, alternating with the raw mark loop at the same batch size and the
worker's own commit setting (read from its connection settings: asynchronous)
and with that loop at the server's commit; ``drain_default_ratio`` compares
with the former. Then a search: one drain per candidate worker setting (the
defaults' median standing for the defaults) and one per raw variant (mark or
DELETE, synchronous or asynchronous commit, each batch size). Last, the best
Conveyor setting is drained ``reps`` more times, alternating with the
fastest few raw variants of the search (the finalists) and with the raw
mark loop at batch 1000 and the server's commit (``raw_drain_best_per_s``,
kept for runs of before). The strongest raw loop is the finalist with the
highest median there, and ``drain_best_ratio`` compares with it: a single
drain of 20,000 events varies by a quarter on a shared machine, so the
search alone picks among the top variants nearly at random. Every pair is
measured side by side because the load drifts; the first mover rotates
every repetition.
"""

from __future__ import annotations

import asyncio
import functools
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from conveyor.config import BATCH_SIZE_DEFAULT, CONCURRENCY_DEFAULT, WorkerConfig
from conveyor_tools.bench import measure, scratch
from conveyor_tools.bench.baseline import FINISHES, RawVariant
from conveyor_tools.bench.measure import DrainRun
from conveyor_tools.bench.processes import ProcessRegistry
from conveyor_tools.bench.scratch import BenchError

RAW_SAME_BATCH = BATCH_SIZE_DEFAULT
RAW_BEST_BATCH = 1000
DEFAULT: Settings = (BATCH_SIZE_DEFAULT, CONCURRENCY_DEFAULT, None)
# The raw loops of the benchmark's first versions, still reported under their keys.
RAW_SAME_BATCH_SERVER_COMMIT = RawVariant("mark", RAW_SAME_BATCH)
RAW_BEST_SERVER_COMMIT = RawVariant("mark", RAW_BEST_BATCH)
# Asynchronous commit for the raw search: what the worker's claim and ack connections use.
ASYNC_COMMIT = "off"

Progress = Callable[[str], None]
# The claim window of the windowed drain at defaults (docs/held-claims.md).
CLAIM_WINDOW = 0.1
# (batch_size, concurrency, retention): retention None is the command's default.
Settings = tuple[int, int, float | None]


@dataclass(frozen=True, slots=True)
class Plan:
    """Sizes and repetitions; ``quick`` shrinks everything for a smoke run."""

    events: int
    single_events: int
    batch_events: int
    reps: int
    candidates: tuple[Settings, ...]
    wake_samples: int
    raw_batches: tuple[int, ...] = (100, 500, RAW_BEST_BATCH)
    finalists: int = 3
    outbox_events: int = 3_000
    outbox_rounds: int = 30
    wake_warmup: int = 10
    wake_gap: float = 0.02
    # A group of this many no-op members and one callback (docs/workflows.md).
    chord_members: int = 10_000
    quick: bool = False

    @classmethod
    def from_args(cls, events: int, quick: bool) -> Plan:
        if quick:
            n = min(events, 2_000)
            return cls(events=n, single_events=n, batch_events=max(n, 10_000), reps=1,
                       candidates=((500, 1000, None), (500, 1000, 0)), wake_samples=50,
                       raw_batches=(RAW_SAME_BATCH, RAW_BEST_BATCH), finalists=2,
                       outbox_events=300, outbox_rounds=10, chord_members=1_000,
                       quick=True)
        # One event per transaction is commit-bound (~0.4 ms each, far more on a busy
        # box); 5,000 of each shape give a stable ratio without dominating the run.
        # The outbox's extra INSERT is a tenth of a commit: 3,000 transactions of
        # each shape in rounds of 100 keep its ratio within about 10 %.
        return cls(events=events, single_events=min(events, 5_000),
                   batch_events=max(events, 20_000),
                   reps=5, candidates=((250, 500, None), (500, 1000, None), (1000, 2000, None),
                                       (500, 1000, 0), (1000, 2000, 0)),
                   wake_samples=200)

    def raw_variants(self) -> list[RawVariant]:
        """Every raw loop of the search: each finish, each commit, each batch size."""
        return [RawVariant(finish, batch, commit) for finish in FINISHES
                for commit in (None, ASYNC_COMMIT) for batch in self.raw_batches]


def worker_commit() -> str | None:
    """The ``synchronous_commit`` of a default worker's claims and acknowledgements.

    Read from the worker's own connection settings (built, never connected),
    so the raw loop it is compared with follows whatever the worker does;
    ``None`` when it keeps the server's. The raw loop claims and finishes on
    one connection, so the two must agree.
    """
    from conveyor.worker.sessions import WorkerConnections

    conns = WorkerConnections("postgresql://", WorkerConfig(), asyncio.Event())
    found: dict[str, object] = {}
    for role, conn in (("fetch", conns.fetch), ("ack", conns.ack)):
        settings = getattr(conn, "_settings", None)  # private: a guess would go stale unseen
        if not isinstance(settings, dict):
            raise BenchError("cannot read the worker's connection settings (ManagedConnection"
                             "._settings); update conveyor_tools.bench.suite.worker_commit")
        found[role] = settings.get("synchronous_commit")
    if found["fetch"] != found["ack"]:
        raise BenchError(f"the worker's fetch and ack connections commit differently ({found});"
                         " the raw loop at the same commit setting needs one")
    commit = found["fetch"]
    return None if commit is None else str(commit)


def _median(runs: list[DrainRun]) -> float:
    return statistics.median(r.per_s for r in runs)


def _median_of(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _wal(runs: list[DrainRun]) -> float | None:
    """The least WAL bytes per event of the runs.

    Not the median: a drain's own WAL is the same to the byte from run to
    run on a quiet server, and the LSN moves for every session's writes, so
    other work can only add to a run's figure, never take away.
    """
    known = [r.wal_bytes for r in runs if r.wal_bytes is not None]
    return min(known) if known else None


def _cpu(runs: list[DrainRun]) -> dict[str, float | None]:
    """Median CPU microseconds per event: the draining process, its backends, both."""
    return {"client": _median_of([r.client_us for r in runs]),
            "db": _median_of([r.db_us for r in runs]),
            "total": _median_of([r.cpu_us for r in runs])}


def _settings(batch_size: int, concurrency: int, retention: float | None) -> dict[str, Any]:
    """Retention ``None`` is the default (7 days); 0 deletes each event as it is acknowledged."""
    return {"batch_size": batch_size, "concurrency": concurrency,
            "retention": "default" if retention is None else retention}


def _source() -> dict[str, Any] | None:
    """The git commit of the measured ``conveyor`` and its uncommitted changes, when it is a
    checkout: figures are cited by commit, and a dirty tree is not that commit."""
    import conveyor

    root = Path(conveyor.__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        changed = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "src",
                                  "tools"], capture_output=True, text=True, timeout=10,
                                 check=True).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return None  # an installed package, or no git: nothing to cite
    return {"commit": head, "uncommitted": sorted(line[3:] for line in changed)}


def _environment(admin: psycopg.Connection[Any]) -> dict[str, Any]:
    row = admin.execute("SELECT current_setting('server_version'),"
                        " current_setting('synchronous_commit'), current_setting('fsync')"
                        ).fetchone()
    assert row is not None
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return {"postgresql": row[0], "synchronous_commit": row[1], "fsync": row[2],
            "python": platform.python_version(), "cpus": os.cpu_count(),
            "load_avg_1m_end": round(load[0], 2), "psycopg": psycopg.__version__,
            "source": _source()}


class Suite:
    def __init__(self, url: str, base_schema: str, plan: Plan, progress: Progress) -> None:
        self.url = url
        self.plan = plan
        self.schemas = scratch.schemas_for(base_schema)
        self.say = progress
        self.registry = ProcessRegistry()
        self._candidate_log: list[dict[str, Any]] = []
        self._variant_log: list[dict[str, Any]] = []
        self._finalist_log: list[dict[str, Any]] = []

    def run(self) -> dict[str, Any]:
        started = time.time()
        load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        with psycopg.connect(self.url, autocommit=True) as admin:
            scratch.lock(admin, self.schemas)
            scratch.create(admin, self.schemas)
            try:
                result = self._measure(admin)
            finally:
                self.registry.stop_all()
                scratch.drop(admin, self.schemas)
            result["environment"] = _environment(admin)
        result["environment"]["load_avg_1m_start"] = round(load_start, 2)
        result["elapsed_s"] = round(time.time() - started, 1)
        return result

    def _measure(self, admin: psycopg.Connection[Any]) -> dict[str, Any]:
        p, s = self.plan, self.schemas
        self.say(f"enqueue, 1 event per transaction, 4 shapes ({p.single_events:,} each)")
        single = measure.enqueue_single(self.url, s, p.single_events)
        self.say(f"outbox in a business transaction, 3 shapes ({p.outbox_events:,} each)")
        outbox = measure.outbox_marginal(self.url, s, p.outbox_events, p.outbox_rounds)
        self.say(f"enqueue, 1000 events per transaction ({p.batch_events:,} each)")
        batch, batch_in_tx, batch_ids, raw_copy = measure.enqueue_batch(
            self.url, s, p.batch_events)
        self.say(f"WAL per enqueued event, 4 shapes ({p.batch_events:,} bulk each)")
        enqueue_wal = measure.enqueue_wal(admin, self.url, s, p.batch_events)
        for schema in s.all:
            scratch.reset(admin, schema)
        commit = worker_commit()
        same_commit = RawVariant("mark", RAW_SAME_BATCH, commit)
        default, window, raws = self._drains(admin, same_commit)
        raw_same_commit, raw_same = raws[same_commit], raws[RAW_SAME_BATCH_SERVER_COMMIT]
        best_settings, best, strongest, raws = self._best(admin, default)
        raw_strongest, raw_best = raws[strongest], raws[RAW_BEST_SERVER_COMMIT]
        self.say(f"wake-up latency ({p.wake_samples} samples, idle worker at defaults)")
        wake = measure.wake_latency(admin, self.url, s, self.registry, samples=p.wake_samples,
                                    warmup=p.wake_warmup, gap=p.wake_gap)
        self.say(f"raw wake-up floor ({p.wake_samples} samples: LISTEN, claim, no framework)")
        raw_wake = measure.raw_wake_latency(admin, self.url, s, self.registry,
                                            samples=p.wake_samples, warmup=p.wake_warmup,
                                            gap=p.wake_gap)
        self.say(f"a chord of {p.chord_members:,} no-op members and a callback, at defaults")
        chord = measure.chord(admin, self.url, s, self.registry, members=p.chord_members)
        return {
            "chord_members": chord.members,
            "chord_callback_after_last_ms": round(chord.callback_after_last_ms, 1),
            "chord_members_done_s": round(chord.members_done_s, 3),
            "chord_total_s": round(chord.total_s, 3),
            "enqueue_single_per_s": single.one_tx, "raw_single_per_s": single.raw_one_tx,
            "enqueue_one_tx_per_s": single.one_tx, "raw_insert_one_tx_per_s": single.raw_one_tx,
            "enqueue_autocommit_per_s": single.autocommit,
            "raw_insert_autocommit_per_s": single.raw_autocommit,
            "outbox_business_per_s": outbox.business,
            "outbox_business_enqueue_per_s": outbox.business_enqueue,
            "outbox_business_raw_insert_per_s": outbox.business_raw_insert,
            "enqueue_batch_per_s": batch, "enqueue_batch_in_tx_per_s": batch_in_tx,
            "enqueue_batch_ids_per_s": batch_ids,
            "raw_copy_per_s": raw_copy,
            "drain_default_per_s": _median(default),
            "drain_window_per_s": _median(window),
            "drain_window_seconds": CLAIM_WINDOW,
            "raw_drain_same_batch_per_s": _median(raw_same),
            "raw_drain_same_commit_per_s": _median(raw_same_commit),
            "raw_drain_same_commit_variant": same_commit.label,
            "worker_synchronous_commit": commit or "server",
            "drain_best_per_s": _median(best),
            "drain_best_settings": _settings(*best_settings),
            "raw_drain_best_per_s": _median(raw_best),
            "raw_drain_strongest_per_s": _median(raw_strongest),
            "raw_drain_strongest_variant": strongest.label,
            "wal_bytes_per_event": {"drain_default": _wal(default), "drain_best": _wal(best),
                                    "drain_window": _wal(window),
                                    "raw_same_commit": _wal(raw_same_commit),
                                    "raw_strongest": _wal(raw_strongest),
                                    "enqueue_bulk": enqueue_wal.bulk,
                                    "raw_copy": enqueue_wal.raw_copy,
                                    "enqueue_single": enqueue_wal.single,
                                    "raw_insert_one_tx": enqueue_wal.raw_insert},
            "worker_cpu_us_per_event": _cpu(default)["client"],
            "raw_cpu_us_per_event": _cpu(raw_same_commit)["client"],
            "wake_p50_ms": wake.p(50), "wake_p95_ms": wake.p(95), "wake_p99_ms": wake.p(99),
            "wake_max_ms": max(wake.latencies_ms), "wake_samples": len(wake.latencies_ms),
            "wake_missing": wake.missing,
            "raw_wake_p50_ms": raw_wake.p(50), "raw_wake_p99_ms": raw_wake.p(99),
            "worker_rss_mb": max(r.rss_mb for r in default),
            "worker_rss_best_mb": max(r.rss_mb for r in best),
            "worker_rss_wake_mb": wake.rss_mb,
            "raw_worker_rss_mb": max(r.rss_mb for r in raw_same + raw_best),
            "cpu_us_per_event": {"drain_default": _cpu(default), "drain_best": _cpu(best),
                                 "drain_window": _cpu(window),
                                 "raw_drain_same_batch": _cpu(raw_same),
                                 "raw_drain_best": _cpu(raw_best),
                                 "raw_drain_same_commit": _cpu(raw_same_commit),
                                 "raw_drain_strongest": _cpu(raw_strongest)},
            "runs": {
                "drain_default": [_run_json(r) for r in default],
                "drain_window": [_run_json(r) for r in window],
                "drain_best": [_run_json(r) for r in best],
                "raw_drain_same_batch": [_run_json(r) for r in raw_same],
                "raw_drain_best": [_run_json(r) for r in raw_best],
                "raw_drain_same_commit": [_run_json(r) for r in raw_same_commit],
                "raw_drain_strongest": [_run_json(r) for r in raw_strongest],
                "drain_candidates": self._candidate_log,
                "raw_drain_variants": self._variant_log,
                "raw_drain_finalists": self._finalist_log,
            },
            "plan": {"events": p.events, "single_events": p.single_events,
                     "batch_events": p.batch_events, "reps": p.reps, "quick": p.quick,
                     "wake_gap_ms": p.wake_gap * 1000, "wake_warmup": p.wake_warmup,
                     "raw_same_batch": RAW_SAME_BATCH, "raw_best_batch": RAW_BEST_BATCH,
                     "raw_batches": list(p.raw_batches), "raw_finalists": p.finalists,
                     "outbox_events": p.outbox_events, "chord_members": p.chord_members,
                     "outbox_rounds": p.outbox_rounds},
        }

    def _conveyor(self, admin: psycopg.Connection[Any], settings: Settings) -> DrainRun:
        is_default = settings == DEFAULT
        self.say(f"  conveyor drain, {'defaults' if is_default else _label(settings)}")
        if is_default:  # pass no flags at all: the command's own defaults
            return measure.conveyor_drain(admin, self.url, self.schemas, self.plan.events,
                                          self.registry)
        return measure.conveyor_drain(admin, self.url, self.schemas, self.plan.events,
                                      self.registry, batch_size=settings[0],
                                      concurrency=settings[1], retention=settings[2])

    def _raw(self, admin: psycopg.Connection[Any], variant: RawVariant) -> DrainRun:
        self.say(f"  raw drain, {variant.label}")
        return measure.raw_drain(admin, self.url, self.schemas, self.plan.events, variant,
                                 self.registry)

    def _drains(self, admin: psycopg.Connection[Any], same_commit: RawVariant
                ) -> tuple[list[DrainRun], list[DrainRun], dict[RawVariant, list[DrainRun]]]:
        """Defaults, and defaults with claim windows, against the raw loop at the same
        batch, with the worker's commit and the server's; all in turns."""
        self.say(f"drain {self.plan.events:,} no-op events x {self.plan.reps}")
        variants = [same_commit, RAW_SAME_BATCH_SERVER_COMMIT]
        distinct = list(dict.fromkeys(variants))
        runs = self._alternate([lambda: self._conveyor(admin, DEFAULT),
                                lambda: self._windowed_drain(admin),
                                *(functools.partial(self._raw, admin, v) for v in distinct)])
        return runs[0], runs[1], dict(zip(distinct, runs[2:], strict=True))

    def _windowed_drain(self, admin: psycopg.Connection[Any]) -> DrainRun:
        """The command's defaults but claim windows (docs/held-claims.md)."""
        self.say(f"  conveyor drain, defaults with --claim-window {CLAIM_WINDOW:g}")
        return measure.conveyor_drain(admin, self.url, self.schemas, self.plan.events,
                                      self.registry, flags=["--claim-window", f"{CLAIM_WINDOW:g}"])

    def _phase(self, admin: psycopg.Connection[Any], ours: Callable[[], DrainRun],
               variants: Sequence[RawVariant]
               ) -> tuple[list[DrainRun], dict[RawVariant, list[DrainRun]]]:
        """``reps`` runs of Conveyor and of each distinct raw variant, side by side."""
        distinct = list(dict.fromkeys(variants))
        sides: list[Callable[[], DrainRun]] = [ours]
        sides += [functools.partial(self._raw, admin, v) for v in distinct]
        runs = self._alternate(sides)
        return runs[0], dict(zip(distinct, runs[1:], strict=True))

    def _alternate(self, sides: Sequence[Callable[[], DrainRun]]) -> list[list[DrainRun]]:
        """``reps`` runs of each, in turn, the first mover rotated every repetition."""
        runs: list[list[DrainRun]] = [[] for _ in sides]
        for rep in range(self.plan.reps):
            for j in range(len(sides)):
                side = (j + rep) % len(sides)
                runs[side].append(sides[side]())
        return runs

    def _best(self, admin: psycopg.Connection[Any], default: list[DrainRun]
              ) -> tuple[Settings, list[DrainRun], RawVariant, dict[RawVariant, list[DrainRun]]]:
        """The fastest worker settings and the strongest raw loop, measured side by side.

        The search runs each candidate and each raw variant once, taking
        turns so drift falls on both. The raw runs compared with are measured
        again beside the winner's own runs, not taken from the search: on a
        shared machine the load drifts within a minute, and the best of a
        dozen single runs is biased upward by its luck.
        """
        self.say("search the best worker settings and the strongest raw loop")
        tried: dict[Settings, list[DrainRun]] = {DEFAULT: default}
        raws: dict[RawVariant, DrainRun] = {}
        variants = self.plan.raw_variants()
        for i in range(max(len(self.plan.candidates), len(variants))):
            if i < len(self.plan.candidates):
                settings = self.plan.candidates[i]
                tried[settings] = [self._conveyor(admin, settings)]
            if i < len(variants):
                raws[variants[i]] = self._raw(admin, variants[i])
        winner = max(tried, key=lambda k: _median(tried[k]))
        finalists = sorted(raws, key=lambda v: raws[v].per_s, reverse=True)[:self.plan.finalists]
        self.say(f"drain at the best settings x {self.plan.reps}, beside the raw finalists")
        runs, by_variant = self._phase(admin, lambda: self._conveyor(admin, winner),
                                       [*finalists, RAW_BEST_SERVER_COMMIT])
        strongest = max(finalists, key=lambda v: _median(by_variant[v]))
        self._candidate_log = [{**_settings(*k), "per_s": [r.per_s for r in v]}
                               for k, v in tried.items()]
        self._variant_log = [_variant_json(v, r) for v, r in raws.items()]
        self._finalist_log = [{"variant": v.label, "per_s": [r.per_s for r in by_variant[v]],
                               "median_per_s": _median(by_variant[v])} for v in finalists]
        return winner, runs, strongest, by_variant


def _label(settings: Settings) -> str:
    label = f"batch_size={settings[0]} concurrency={settings[1]}"
    return label if settings[2] is None else f"{label} retention={settings[2]:g}"


def _run_json(run: DrainRun) -> dict[str, Any]:
    return {"per_s": round(run.per_s, 1), "seconds": round(run.seconds, 4),
            "wall_per_s": round(run.wall_per_s, 1), "rss_mb": round(run.rss_mb, 1),
            "client_cpu_us": run.client_us, "db_cpu_us": run.db_us,
            "wal_bytes_per_event": run.wal_bytes}


def _variant_json(variant: RawVariant, run: DrainRun) -> dict[str, Any]:
    return {"variant": variant.label, "finish": variant.finish, "batch": variant.batch,
            "commit": variant.commit or "server", **_run_json(run)}


def stderr_progress(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)
