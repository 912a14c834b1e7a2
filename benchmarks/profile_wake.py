"""Where the wake-up latency goes: commit -> NOTIFY handled -> claim -> handler start.

Runs an idle ``conveyor worker`` at its defaults through ``patched_worker.py
trace-wake``, which timestamps (``time.time()``, one clock for both processes)
the moment the worker's NOTIFY callback runs and the start and end of every
claim. Events are enqueued one per transaction ``--gap`` seconds apart, like
the benchmark's wake-up measurement, and each sample is split into:

* notify:   producer commit returned -> worker's NOTIFY callback ran
* to claim: NOTIFY callback -> the fetch loop starts its claim query
* claim:    the claim query's round trip (and row decoding)
* to run:   claim returned -> the handler started

    .venv/bin/python benchmarks/profile_wake.py --url postgresql://... [--samples 200]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Any

import psycopg

from conveyor.config import ProducerConfig
from conveyor.producer import Producer
from conveyor_tools.bench import scratch
from conveyor_tools.bench.app import WAKE_TOPIC
from conveyor_tools.bench.measure import percentile
from conveyor_tools.bench.processes import ProcessRegistry

HERE = os.path.dirname(os.path.abspath(__file__))


class TraceReader:
    def __init__(self, fd: int) -> None:
        self.lines: list[tuple[str, list[float]]] = []
        self._file = os.fdopen(fd, "rb")
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for raw in self._file:
            kind, *values = raw.decode().split()
            if kind not in ("N", "C"):
                values = [float(kind), *values]  # "<id> <t>" from the handler
                kind = "H"
            self.lines.append((kind, [float(v) for v in values]))

    def close(self) -> None:
        self._thread.join(timeout=5)
        self._file.close()


def decompose(sent: list[tuple[int, float]], lines: list[tuple[str, list[float]]]
              ) -> dict[str, list[float]]:
    notifies = sorted(v[0] for k, v in lines if k == "N")
    claims = sorted((v[0], v[1]) for k, v in lines if k == "C" and v[2] > 0)
    handled = {int(v[0]): v[1] for k, v in lines if k == "H"}
    parts: dict[str, list[float]] = {"notify": [], "to claim": [], "claim": [], "to run": [],
                                     "total": []}
    for event_id, committed in sent:
        started = handled.get(event_id)
        if started is None:
            continue
        # The last NOTIFY and the last non-empty claim before the handler started.
        n = max((t for t in notifies if t <= started), default=None)
        c = max((c for c in claims if c[1] <= started), default=None)
        if n is None or c is None or not committed - 0.005 <= n <= c[0] + 0.0005:
            continue
        parts["notify"].append((n - committed) * 1000)
        parts["to claim"].append((c[0] - n) * 1000)
        parts["claim"].append((c[1] - c[0]) * 1000)
        parts["to run"].append((started - c[1]) * 1000)
        parts["total"].append((started - committed) * 1000)
    return parts


def run(args: argparse.Namespace) -> None:
    schemas = scratch.schemas_for("conveyor_wake")
    registry = ProcessRegistry()
    with psycopg.connect(args.url, autocommit=True) as admin:
        scratch.lock(admin, schemas)
        scratch.create(admin, schemas)
        try:
            read_fd, write_fd = os.pipe()
            worker = registry.worker(
                args.url, schemas.conveyor, wake_fd=write_fd,
                launcher=[os.path.join(HERE, "patched_worker.py"),
                          "+".join(["trace-wake", *filter(None, [args.patch])]), "--"])
            worker.start()
            os.close(write_fd)
            reader = TraceReader(read_fd)
            worker.wait_registered(admin)
            time.sleep(1.0)
            producer = Producer(ProducerConfig(schema=schemas.conveyor))
            sent: list[tuple[int, float]] = []
            with psycopg.connect(args.url) as conn:
                for i in range(args.warmup + args.samples):
                    event_id = producer.enqueue(conn, WAKE_TOPIC, {})
                    conn.commit()
                    if i >= args.warmup:
                        sent.append((event_id, time.time()))
                    time.sleep(args.gap)
            time.sleep(1.0)
            worker.stop()
            reader.close()
        finally:
            registry.stop_all()
            scratch.drop(admin, schemas)
    parts = decompose(sent, reader.lines)
    print(f"{len(parts['total'])} of {len(sent)} samples decomposed (ms)")
    print(f"{'part':<10} {'p50':>7} {'p90':>7} {'p99':>7} {'max':>7}")
    for name, values in parts.items():
        if values:
            print(f"{name:<10} " + " ".join(f"{percentile(values, q):7.3f}" for q in (50, 90, 99))
                  + f" {max(values):7.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=os.environ.get("CONVEYOR_DATABASE_URL"))
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--gap", type=float, default=0.02)
    parser.add_argument("--patch", help="extra patches of patched_worker.py, e.g. async-commit")
    args: Any = parser.parse_args()
    if not args.url:
        parser.error("--url (or CONVEYOR_DATABASE_URL) is required")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
