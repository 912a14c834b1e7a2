"""The whole benchmark in one run: what is measured, in which order, how often.

Drains at defaults repeat ``reps`` times, alternating with the raw loop at
the same batch size, and the medians are reported. The best Conveyor setting
is searched by one drain per candidate (the defaults' median included); the
winner is then drained ``reps`` more times, alternating with the raw loop at
batch 1000, and the two medians of that phase are compared. Every pair is
measured side by side because the load on a shared machine drifts.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg

from conveyor.config import BATCH_SIZE_DEFAULT, CONCURRENCY_DEFAULT
from conveyor_tools.bench import measure, scratch
from conveyor_tools.bench.measure import DrainRun
from conveyor_tools.bench.processes import ProcessRegistry

RAW_SAME_BATCH = BATCH_SIZE_DEFAULT
RAW_BEST_BATCH = 1000
DEFAULT: Settings = (BATCH_SIZE_DEFAULT, CONCURRENCY_DEFAULT, None)

Progress = Callable[[str], None]
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
    wake_warmup: int = 10
    wake_gap: float = 0.02
    quick: bool = False

    @classmethod
    def from_args(cls, events: int, quick: bool) -> Plan:
        if quick:
            n = min(events, 2_000)
            return cls(events=n, single_events=n, batch_events=max(n, 10_000), reps=1,
                       candidates=((500, 1000, None), (500, 1000, 0)), wake_samples=50,
                       quick=True)
        # One event per transaction is commit-bound (~0.4 ms each, far more on a busy
        # box); 5,000 pairs give a stable ratio without dominating the run.
        return cls(events=events, single_events=min(events, 5_000),
                   batch_events=max(events, 20_000),
                   reps=5, candidates=((250, 500, None), (500, 1000, None), (1000, 2000, None),
                                       (500, 1000, 0), (1000, 2000, 0)),
                   wake_samples=200)


def _median(runs: list[DrainRun]) -> float:
    return statistics.median(r.per_s for r in runs)


def _median_of(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _cpu(runs: list[DrainRun]) -> dict[str, float | None]:
    """Median CPU microseconds per event: the draining process, its backends, both."""
    return {"client": _median_of([r.client_us for r in runs]),
            "db": _median_of([r.db_us for r in runs]),
            "total": _median_of([r.cpu_us for r in runs])}


def _settings(batch_size: int, concurrency: int, retention: float | None) -> dict[str, Any]:
    """Retention ``None`` is the default (7 days); 0 deletes each event as it is acknowledged."""
    return {"batch_size": batch_size, "concurrency": concurrency,
            "retention": "default" if retention is None else retention}


def _environment(admin: psycopg.Connection[Any]) -> dict[str, Any]:
    row = admin.execute("SELECT current_setting('server_version'),"
                        " current_setting('synchronous_commit'), current_setting('fsync')"
                        ).fetchone()
    assert row is not None
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return {"postgresql": row[0], "synchronous_commit": row[1], "fsync": row[2],
            "python": platform.python_version(), "cpus": os.cpu_count(),
            "load_avg_1m_end": round(load[0], 2), "psycopg": psycopg.__version__}


class Suite:
    def __init__(self, url: str, base_schema: str, plan: Plan, progress: Progress) -> None:
        self.url = url
        self.plan = plan
        self.schemas = scratch.schemas_for(base_schema)
        self.say = progress
        self.registry = ProcessRegistry()
        self._candidate_log: list[dict[str, Any]] = []

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
        self.say(f"enqueue, 1 event per transaction ({p.single_events:,} each)")
        single, raw_single = measure.enqueue_single(self.url, s, p.single_events)
        self.say(f"enqueue, 1000 events per transaction ({p.batch_events:,} each)")
        batch, batch_in_tx, batch_ids, raw_copy = measure.enqueue_batch(
            self.url, s, p.batch_events)
        for schema in s.all:
            scratch.reset(admin, schema)
        default, raw_same = self._drains(admin)
        best_settings, best, raw_best = self._best(admin, default)
        self.say(f"wake-up latency ({p.wake_samples} samples, idle worker at defaults)")
        wake = measure.wake_latency(admin, self.url, s, self.registry, samples=p.wake_samples,
                                    warmup=p.wake_warmup, gap=p.wake_gap)
        self.say(f"raw wake-up floor ({p.wake_samples} samples: LISTEN, claim, no framework)")
        raw_wake = measure.raw_wake_latency(admin, self.url, s, self.registry,
                                            samples=p.wake_samples, warmup=p.wake_warmup,
                                            gap=p.wake_gap)
        return {
            "enqueue_single_per_s": single, "raw_single_per_s": raw_single,
            "enqueue_batch_per_s": batch, "enqueue_batch_in_tx_per_s": batch_in_tx,
            "enqueue_batch_ids_per_s": batch_ids,
            "raw_copy_per_s": raw_copy,
            "drain_default_per_s": _median(default),
            "raw_drain_same_batch_per_s": _median(raw_same),
            "drain_best_per_s": _median(best),
            "drain_best_settings": _settings(*best_settings),
            "raw_drain_best_per_s": _median(raw_best),
            "wake_p50_ms": wake.p(50), "wake_p95_ms": wake.p(95), "wake_p99_ms": wake.p(99),
            "wake_max_ms": max(wake.latencies_ms), "wake_samples": len(wake.latencies_ms),
            "wake_missing": wake.missing,
            "raw_wake_p50_ms": raw_wake.p(50), "raw_wake_p99_ms": raw_wake.p(99),
            "worker_rss_mb": max(r.rss_mb for r in default),
            "worker_rss_best_mb": max(r.rss_mb for r in best),
            "worker_rss_wake_mb": wake.rss_mb,
            "raw_worker_rss_mb": max(r.rss_mb for r in raw_same + raw_best),
            "cpu_us_per_event": {"drain_default": _cpu(default), "drain_best": _cpu(best),
                                 "raw_drain_same_batch": _cpu(raw_same),
                                 "raw_drain_best": _cpu(raw_best)},
            "runs": {
                "drain_default": [_run_json(r) for r in default],
                "drain_best": [_run_json(r) for r in best],
                "raw_drain_same_batch": [_run_json(r) for r in raw_same],
                "raw_drain_best": [_run_json(r) for r in raw_best],
                "drain_candidates": self._candidate_log,
            },
            "plan": {"events": p.events, "single_events": p.single_events,
                     "batch_events": p.batch_events, "reps": p.reps, "quick": p.quick,
                     "wake_gap_ms": p.wake_gap * 1000, "wake_warmup": p.wake_warmup,
                     "raw_same_batch": RAW_SAME_BATCH, "raw_best_batch": RAW_BEST_BATCH},
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

    def _raw(self, admin: psycopg.Connection[Any], batch: int) -> DrainRun:
        self.say(f"  raw drain, batch {batch}")
        return measure.raw_drain(admin, self.url, self.schemas, self.plan.events, batch,
                                 self.registry)

    def _drains(self, admin: psycopg.Connection[Any]) -> tuple[list[DrainRun], list[DrainRun]]:
        """Defaults against the raw loop at the same batch size, alternating, first mover rotated."""
        self.say(f"drain {self.plan.events:,} no-op events x {self.plan.reps}")
        return self._alternate(lambda: self._conveyor(admin, DEFAULT),
                               lambda: self._raw(admin, RAW_SAME_BATCH))

    def _alternate(self, ours: Callable[[], DrainRun], raw: Callable[[], DrainRun]
                   ) -> tuple[list[DrainRun], list[DrainRun]]:
        """``reps`` runs of each, side by side, the first mover swapped every repetition."""
        runs: tuple[list[DrainRun], list[DrainRun]] = ([], [])
        for rep in range(self.plan.reps):
            for side in ((0, 1) if rep % 2 == 0 else (1, 0)):
                runs[side].append((ours, raw)[side]())
        return runs

    def _best(self, admin: psycopg.Connection[Any], default: list[DrainRun]
              ) -> tuple[Settings, list[DrainRun], list[DrainRun]]:
        """The fastest candidate settings, then that one against the raw best, alternating.

        The raw best runs beside the winner's own runs, not in an earlier
        phase: on a shared machine the load drifts within a minute, and a
        ratio of runs minutes apart measures the drift as much as the queue.
        """
        self.say("search the best worker settings")
        tried: dict[Settings, list[DrainRun]] = {DEFAULT: default}
        for settings in self.plan.candidates:
            tried[settings] = [self._conveyor(admin, settings)]
        self._candidate_log = [{**_settings(*k), "per_s": [r.per_s for r in v]}
                               for k, v in tried.items()]
        winner = max(tried, key=lambda k: _median(tried[k]))
        runs, raw_best = self._alternate(lambda: self._conveyor(admin, winner),
                                         lambda: self._raw(admin, RAW_BEST_BATCH))
        return winner, runs, raw_best


def _label(settings: Settings) -> str:
    label = f"batch_size={settings[0]} concurrency={settings[1]}"
    return label if settings[2] is None else f"{label} retention={settings[2]:g}"


def _run_json(run: DrainRun) -> dict[str, Any]:
    return {"per_s": round(run.per_s, 1), "seconds": round(run.seconds, 4),
            "wall_per_s": round(run.wall_per_s, 1), "rss_mb": round(run.rss_mb, 1),
            "client_cpu_us": run.client_us, "db_cpu_us": run.db_us}


def stderr_progress(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)
