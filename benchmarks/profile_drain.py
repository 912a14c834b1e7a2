"""Profile a Conveyor worker draining no-op events, and where the CPU goes.

Starts a real ``conveyor worker`` on an empty scratch schema, waits until it is
registered and idle, then commits ``--events`` no-op events in one transaction
and measures the drain: worker CPU per event, the CPU of the worker's database
backends (fetch / ack / listen / maintenance, found by the worker's client ports),
and optionally a sampling profile (py-spy) or a deterministic one (cProfile).
The raw-SQL baseline drainer is measured the same way for comparison.

    .venv/bin/python benchmarks/profile_drain.py --url postgresql://... \
        [--events 50000] [--batch-size 100 --concurrency 100] [--tool py-spy|cprofile]

Needs Linux (/proc) and, for --tool py-spy, ``pip install py-spy``. Scratch
schemas ``conveyor_prof_bench*`` are dropped at the end.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import psutil
import psycopg

from conveyor_tools.bench import scratch
from conveyor_tools.bench.app import NOOP_TOPIC
from conveyor_tools.bench.baseline import URL_ENV
from conveyor_tools.bench.processes import APP, BASELINE_SCRIPT, ProcessRegistry, child_env

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def backends_of(admin: psycopg.Connection[Any], pid: int) -> dict[int, str]:
    """Backend pid -> application_name for every connection of process ``pid``."""
    ports = {c.laddr.port for c in psutil.Process(pid).net_connections(kind="inet")
             if c.laddr}
    rows = admin.execute(
        "SELECT pid, application_name, client_port FROM pg_stat_activity"
        " WHERE datname = current_database()").fetchall()
    return {r[0]: r[1] or "?" for r in rows if r[2] in ports}


def wait_drained(admin: psycopg.Connection[Any], schema: str, check: Any) -> None:
    while scratch.unfinished(admin, schema):
        check()
        time.sleep(0.05)


def report_cpu(label: str, n: int, seconds: float, own: float,
               backends: dict[str, float]) -> None:
    total_db = sum(backends.values())
    print(f"\n== {label}: {n:,} events in {seconds:.3f}s = {n / seconds:,.0f}/s")
    print(f"   client process CPU: {own:.3f}s = {own / n * 1e6:.1f} us/event")
    for name, cpu in sorted(backends.items()):
        print(f"   backend {name:<18} CPU: {cpu:.3f}s = {cpu / n * 1e6:.1f} us/event")
    print(f"   all backends: {total_db / n * 1e6:.1f} us/event;"
          f" client+backends {(own + total_db) / n * 1e6:.1f} us/event")


def profile_conveyor(args: argparse.Namespace, admin: psycopg.Connection[Any],
                     schemas: scratch.Schemas, registry: ProcessRegistry, out: str) -> None:
    launcher: list[str] = ["-m", "conveyor.cli.main"]
    timeline = None
    if args.patch:
        launcher = [os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                 "patched_worker.py"), args.patch, "--"]
        if "timeline" in args.patch.split("+"):
            timeline = os.environ["PATCHED_WORKER_TIMELINE"] = os.path.join(out, "timeline.txt")
    if args.tool == "cprofile":
        launcher = ["-m", "cProfile", "-o", os.path.join(out, "worker.prof"), *launcher]
    worker = registry.worker(args.url, schemas.conveyor, batch_size=args.batch_size,
                             concurrency=args.concurrency, launcher=launcher,
                             app=args.app, flags=args.flag or [])
    scratch.reset(admin, schemas.conveyor)
    worker.start()
    worker.wait_registered(admin)
    time.sleep(1.0)  # listener connected, first heartbeat and rescue done
    backends = backends_of(admin, worker.pid)
    spy = None
    if args.tool == "py-spy":
        spy = subprocess.Popen(
            [os.path.join(os.path.dirname(sys.executable), "py-spy"), "record", "-p",
             str(worker.pid), "-r", "400", "-f", "raw", "-o", os.path.join(out, "stacks.txt")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
    cpu0 = cpu_seconds(worker.pid)
    db0 = {p: cpu_seconds(p) for p in backends}
    scratch.fill_conveyor(args.url, schemas.conveyor, NOOP_TOPIC, args.events,
                          head_sampled=args.head_sampled)
    wait_drained(admin, schemas.conveyor, worker.check_alive)
    cpu1 = cpu_seconds(worker.pid)
    backends = backends_of(admin, worker.pid)  # the ack connection opens on the first ack
    db1 = {p: cpu_seconds(p) for p in backends}
    if spy is not None:
        spy.send_signal(signal.SIGINT)
        spy.wait(30)
    worker.stop()
    stats = scratch.drain_stats(admin, schemas.conveyor)
    seconds = stats.check(args.events, "conveyor drain")
    patched = f" patched {args.patch}" if args.patch else ""
    label = (f"conveyor worker{patched} batch_size={args.batch_size or 'default'} "
             f"concurrency={args.concurrency or 'default'}")
    report_cpu(label, args.events, seconds, cpu1 - cpu0,
               {backends[p]: db1[p] - db0.get(p, 0.0) for p in backends})
    if timeline is not None:
        summarize_timeline(timeline)
    if args.tool == "py-spy":
        summarize_stacks(os.path.join(out, "stacks.txt"), args.top)
    elif args.tool == "cprofile":
        stats_ = pstats.Stats(os.path.join(out, "worker.prof"))
        stats_.sort_stats("tottime").print_stats(args.top)
        stats_.sort_stats("cumulative").print_stats(args.top)


def profile_raw(args: argparse.Namespace, admin: psycopg.Connection[Any],
                schemas: scratch.Schemas, batch: int) -> None:
    scratch.reset(admin, schemas.raw)
    scratch.fill_raw(args.url, schemas.raw, NOOP_TOPIC, args.events)
    scratch.settle(admin, schemas.raw)
    # Started and measured from the outside: the drainer does nothing before its first claim.
    proc = subprocess.Popen([sys.executable, BASELINE_SCRIPT, schemas.raw, str(batch)],
                            env=child_env(**{URL_ENV: args.url}), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        raise SystemExit("the raw drainer did not start")
    backends = backends_of(admin, proc.pid)
    before = {p: cpu_seconds(p) for p in backends}
    proc.stdin.write("go\n")
    proc.stdin.flush()
    # The drainer stays connected after its report, so its backend's CPU can be read.
    own = float(json.loads(proc.stdout.readline())["cpu_s"])
    cpu_backend = {p: cpu_seconds(p) - before[p] for p in backends}
    proc.stdin.close()
    proc.wait(timeout=30)
    stats = scratch.drain_stats(admin, schemas.raw)
    seconds = stats.check(args.events, "raw drain")
    report_cpu(f"raw drain batch={batch} (backend CPU sampled every 5 ms)", args.events,
               seconds, own, {"raw": sum(cpu_backend.values())})


def summarize_timeline(path: str) -> None:
    """What the worker's claims, acknowledgements and handler starts took, from
    patched_worker.py's timeline: the fetch loop is claiming, or waiting for
    free slots (or for the next claim to be sent) the rest of the drain."""
    spans: dict[str, list[tuple[float, float, int]]] = collections.defaultdict(list)
    with open(path, encoding="ascii") as f:
        for line in f:
            kind, began, ended, events = line.split()
            if int(events):
                spans[kind].append((float(began), float(ended), int(events)))
    if not spans["claim"]:
        print("\n== timeline: no claim recorded")
        return
    first = min(b for b, _, _ in spans["claim"])
    last = max(e for kind in spans.values() for _, e, _ in kind)
    drain = last - first
    print(f"\n== timeline: {drain * 1e3:.1f} ms from the first claim to the last write")
    for kind in ("claim", "ack", "start"):
        rows = spans[kind]
        if not rows:
            continue
        busy = sum(e - b for b, e, _ in rows)
        events = sum(n for _, _, n in rows)
        print(f"   {kind:<6} {len(rows):5d} x, {events:7,d} events: busy {busy * 1e3:7.1f} ms"
              f" ({100 * busy / drain:4.1f} % of the drain), {busy / len(rows) * 1e3:.3f} ms each,"
              f" {busy / events * 1e6:.2f} us/event")


def summarize_stacks(path: str, top: int) -> None:
    """Self and inclusive sample shares per function from py-spy's raw output."""
    self_count: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            stack, _, count_text = line.rstrip().rpartition(" ")
            # py-spy attaches after start-up and skips idle samples, so every
            # stack is the drain (uvloop runs tasks from C: no common root frame).
            count = int(count_text)
            frames = [_frame(fr) for fr in stack.split(";")]
            total += count
            self_count[frames[-1]] += count
            for name in set(frames):
                incl[name] += count
    print(f"\n== py-spy: {total} samples while draining (CPU only, idle excluded)")
    print("-- self time")
    for name, count in self_count.most_common(top):
        print(f"{100 * count / total:6.1f}%  {name}")
    print("-- inclusive time")
    for name, count in incl.most_common(top):
        print(f"{100 * count / total:6.1f}%  {name}")


def _frame(frame: str) -> str:
    # "func (path/to/file.py:123)" -> "func (file.py)"
    name, _, where = frame.partition(" (")
    file = where.rstrip(")").rsplit(":", 1)[0]
    return f"{name} ({'/'.join(file.split('/')[-2:])})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=os.environ.get("CONVEYOR_DATABASE_URL"), required=False)
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--concurrency", type=int)
    parser.add_argument("--tool", choices=["none", "py-spy", "cprofile"], default="none")
    parser.add_argument("--raw-batch", type=int, action="append",
                        help="also profile the raw drainer at this batch (repeatable)")
    parser.add_argument("--patch", help="run the worker through patched_worker.py with these "
                        "patches, e.g. timeline or two-fetch+timeline (see patched_worker.py)")
    parser.add_argument("--app", default=APP, help="the router the worker serves, e.g. "
                        "conveyor_tools.bench.traced_app:router (tracing set up)")
    parser.add_argument("--flag", action="append",
                        help="a worker flag, e.g. --flag=--tracing (repeatable)")
    parser.add_argument("--head-sampled", type=float,
                        help="enqueue each event in a request span sampled at this ratio "
                        "(as conveyor bench --observability's tracing_sampled)")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--out", default=None, help="directory for profiles (default: temp)")
    args = parser.parse_args()
    if not args.url:
        parser.error("--url (or CONVEYOR_DATABASE_URL) is required")
    out = args.out or tempfile.mkdtemp(prefix="conveyor-profile-")
    os.makedirs(out, exist_ok=True)
    schemas = scratch.schemas_for("conveyor_prof")
    registry = ProcessRegistry()
    with psycopg.connect(args.url, autocommit=True) as admin:
        scratch.lock(admin, schemas)
        scratch.create(admin, schemas)
        try:
            profile_conveyor(args, admin, schemas, registry, out)
            for batch in args.raw_batch or []:
                profile_raw(args, admin, schemas, batch)
        finally:
            registry.stop_all()
            scratch.drop(admin, schemas)
    print(f"\nprofiles in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
