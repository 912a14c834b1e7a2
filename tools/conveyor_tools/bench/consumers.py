"""``conveyor bench --consumers``: the XLSX reader and the SMTP consumer, each with a baseline.

Needs no database. What is measured:

* XLSX aggregation (``{rows, total, by_type}`` of a 5-column sheet written by
  XlsxWriter): Conveyor's streaming reader
  (:func:`conveyor.consumers.workbook.aggregate_workbook`, what ``conveyor xlsx`` runs)
  against openpyxl's own read-only iteration computing the same aggregate,
  each run in a fresh interpreter (:mod:`conveyor_tools.bench.xlsx_child`) so the
  peak RSS (``VmHWM``) is its own; rows/s, rows per CPU second, peak RSS and
  the growth over the imports. Both results are checked against the
  aggregate known from the generated data. Full: 100k rows (median of 3)
  and 1M rows (1 run each); ``--quick``: 20k and 100k rows, 1 run each.
* Hostile files (zip bombs honest and lying about their size, 5,000 entries,
  billion laughs, XXE, quadratic blow-up): each must be refused; time and
  extra memory of the refusal, in a fresh interpreter too.
* Email: :class:`conveyor.consumers.email.EmailConsumer` sending the built-in
  ``verification`` mail to an aiosmtpd server on 127.0.0.1 in its own process
  (:mod:`conveyor_tools.bench.smtp_server`), sequentially: one consumer with
  ``max_connections=1`` reusing its connection, against a fresh consumer per
  mail (connect, STARTTLS, AUTH, send, QUIT each time). With STARTTLS + AUTH
  (the production shape; the headline figures) and in plain SMTP. The server
  must have accepted exactly the mails sent.

Progress goes to stderr; stdout gets the table, or with ``--json`` exactly one
JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import IO, Any

from conveyor_tools.bench.processes import child_env
from conveyor_tools.bench.report import rounded
from conveyor_tools.bench.scratch import BenchError
from conveyor_tools.bench.suite import stderr_progress

HERE = os.path.dirname(os.path.abspath(__file__))
XLSX_CHILD = os.path.join(HERE, "xlsx_child.py")
SMTP_SERVER = os.path.join(HERE, "smtp_server.py")
FROM = "Conveyor bench <bench@conveyor.test>"
HOSTILE_MAX_SECONDS = 2.0
HOSTILE_MAX_EXTRA_MB = 64.0

Progress = Callable[[str], None]


def label(rows: int) -> str:
    """20_000 -> '20k', 1_000_000 -> '1m'."""
    return f"{rows // 1_000_000}m" if rows % 1_000_000 == 0 else f"{rows // 1000}k"


@dataclass(frozen=True, slots=True)
class ConsumerPlan:
    sizes: tuple[tuple[int, int], ...]   # (rows, repetitions), small first
    mails_reused: int
    mails_per_connection: int
    mail_reps: int
    mail_warmup: int = 20
    quick: bool = False

    @classmethod
    def from_args(cls, quick: bool) -> ConsumerPlan:
        if quick:
            return cls(sizes=((20_000, 1), (100_000, 1)), mails_reused=200,
                       mails_per_connection=60, mail_reps=1, mail_warmup=5, quick=True)
        return cls(sizes=((100_000, 3), (1_000_000, 1)), mails_reused=1000,
                   mails_per_connection=300, mail_reps=3)


def _load() -> float:
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else 0.0


# --------------------------------------------------------------------- XLSX

def _child(reader: str, path: Path, timeout: float) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, XLSX_CHILD, reader, str(path)], capture_output=True,
                          text=True, timeout=timeout, env=child_env(), check=False)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise BenchError(f"{reader} on {path.name} exited with {proc.returncode}: "
                         f"{proc.stderr.strip()[-500:]}")
    out: dict[str, Any] = json.loads(lines[-1])
    out["rss_mb"] = out["peak_kb"] / 1024
    out["extra_mb"] = (out["peak_kb"] - out["rss_before_kb"]) / 1024
    return out


def _xlsx_size(rows: int, reps: int, say: Progress) -> dict[str, Any]:
    from conveyor_tools.bench.xlsx_files import rows_file, same_aggregate

    say(f"xlsx: {rows:,}-row workbook (written once, then cached)")
    path, want = rows_file(rows)
    runs: dict[str, list[dict[str, Any]]] = {"conveyor": [], "openpyxl": []}
    load = _load()
    timeout = 120 + rows / 5_000  # openpyxl: ~70 s per 1M rows on an idle machine
    for rep in range(reps):
        order = ["conveyor", "openpyxl"] if rep % 2 == 0 else ["openpyxl", "conveyor"]
        for reader in order:
            say(f"  {reader}, {rows:,} rows (run {rep + 1} of {reps})")
            got = _child(reader, path, timeout)
            if not got["ok"]:
                raise BenchError(f"{reader} failed on the {rows}-row workbook: {got['error']}")
            if not same_aggregate(got, want):
                raise BenchError(f"{reader} got a wrong aggregate for {rows} rows: "
                                 f"{got['rows']} rows, total {got['total']}")
            runs[reader].append(got)
    lb = label(rows)
    out: dict[str, Any] = {}
    for reader, prefix in (("conveyor", f"xlsx_{lb}"), ("openpyxl", f"openpyxl_{lb}")):
        seconds = statistics.median(r["seconds"] for r in runs[reader])
        cpu = statistics.median(r["cpu_seconds"] for r in runs[reader])
        out[f"{prefix}_rows_per_s"] = rows / seconds
        out[f"{prefix}_rows_per_cpu_s"] = rows / cpu if cpu > 0 else None
        out[f"{prefix}_seconds"] = seconds
        out[f"{prefix}_rss_mb"] = max(r["rss_mb"] for r in runs[reader])
        out[f"{prefix}_extra_mb"] = max(r["extra_mb"] for r in runs[reader])
    out[f"xlsx_speedup_{lb}"] = out[f"xlsx_{lb}_rows_per_s"] / out[f"openpyxl_{lb}_rows_per_s"]
    mine, theirs = out[f"xlsx_{lb}_rows_per_cpu_s"], out[f"openpyxl_{lb}_rows_per_cpu_s"]
    out[f"xlsx_cpu_speedup_{lb}"] = mine / theirs if mine and theirs else None
    out[f"xlsx_{lb}_load_1m"] = [load, _load()]
    out[f"xlsx_{lb}_file_mb"] = path.stat().st_size / 1e6
    return out


def _hostile(say: Progress) -> dict[str, Any]:
    from conveyor_tools.bench.xlsx_files import hostile_files

    say("hostile files (built once, then cached), each refused in a fresh interpreter")
    out: dict[str, Any] = {}
    for name, (path, what) in hostile_files().items():
        got = _child("conveyor", path, 60)
        out[name] = {"refused": not got["ok"], "seconds": got["seconds"],
                     "extra_mb": got["extra_mb"], "rss_mb": got["rss_mb"],
                     "file_kb": path.stat().st_size / 1024, "what": what,
                     "reason": got.get("error", "ACCEPTED: the file was aggregated")}
        say(f"  {name}: {'refused' if not got['ok'] else 'ACCEPTED'} in "
            f"{got['seconds'] * 1000:.1f} ms, +{got['extra_mb']:.1f} MB")
    return out


# -------------------------------------------------------------------- email

class SmtpSink:
    """The aiosmtpd server process; ``count()`` asks how many mails it accepted."""

    def __init__(self, mode: str) -> None:
        self.proc = subprocess.Popen([sys.executable, SMTP_SERVER, mode], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, env=child_env())
        line = self._stdout().readline()
        if not line:
            self.stop()
            raise BenchError(f"the SMTP server ({mode}) did not start")
        self.info: dict[str, Any] = json.loads(line)

    def _stdout(self) -> IO[str]:
        assert self.proc.stdout is not None
        return self.proc.stdout

    def count(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write("count\n")
        self.proc.stdin.flush()
        return int(json.loads(self._stdout().readline())["messages"])

    def stop(self) -> None:
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _mail_events(start: int, count: int) -> list[Any]:
    from conveyor.types import Event

    return [Event(id=i, topic="email.send", tenant="bench", payload_text=json.dumps({
        "to": f"user{i}@example.test", "template": "verification",
        "data": {"name": f"User {i}", "product": "Conveyor",
                 "link": f"https://app.example.test/verify?token={i:040d}",
                 "expires_in": "24 hours"}})) for i in range(start, start + count)]


@dataclass(frozen=True, slots=True)
class MailRun:
    per_s: float
    cpu_ms: float   # client CPU per mail
    connections: int


async def _send_reused(config: Any, templates: Any, events: list[Any]) -> MailRun:
    from conveyor.consumers.email import EmailConsumer

    consumer = EmailConsumer(config, templates)
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        for event in events:
            await consumer(event)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        await consumer.aclose()
    return MailRun(len(events) / seconds, cpu * 1000 / len(events), consumer.connections_opened)


async def _send_per_connection(config: Any, templates: Any, events: list[Any]) -> MailRun:
    from conveyor.consumers.email import EmailConsumer

    opened = 0
    t0, c0 = time.perf_counter(), time.process_time()
    for event in events:
        consumer = EmailConsumer(config, templates)  # templates shared: only the connection differs
        try:
            await consumer(event)
        finally:
            await consumer.aclose()  # QUIT, as a connect-per-mail client does
        opened += consumer.connections_opened
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return MailRun(len(events) / seconds, cpu * 1000 / len(events), opened)


def _email_mode(mode: str, plan: ConsumerPlan, say: Progress) -> dict[str, Any]:
    from conveyor.consumers.email import SmtpConfig, TemplateSet, build_message

    say(f"email over {'STARTTLS + AUTH' if mode == 'starttls' else 'plain SMTP'}: "
        f"{plan.mails_reused} on one reused connection vs {plan.mails_per_connection} "
        f"with a connection each, x {plan.mail_reps}")
    sink = SmtpSink(mode)
    try:
        info = sink.info
        config = SmtpConfig(host="127.0.0.1", port=info["port"], from_address=FROM,
                            username=info["user"], password=info["password"],
                            ca_file=info["ca_file"], starttls=mode == "starttls",
                            timeout=15.0, max_connections=1)
        templates = TemplateSet()
        next_id = 1

        def batch(n: int) -> list[Any]:
            nonlocal next_id
            events = _mail_events(next_id, n)
            next_id += n
            return events

        size = len(bytes(build_message(batch(1)[0], config, templates)))
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(_send_reused(config, templates, batch(plan.mail_warmup)))
            reused: list[MailRun] = []
            fresh: list[MailRun] = []
            load = _load()
            for rep in range(plan.mail_reps):
                steps = [("reused", plan.mails_reused), ("fresh", plan.mails_per_connection)]
                for kind, n in steps if rep % 2 == 0 else steps[::-1]:
                    before = sink.count()
                    if kind == "reused":
                        got = loop.run_until_complete(_send_reused(config, templates, batch(n)))
                        reused.append(got)
                        expect_conns = 1
                    else:
                        got = loop.run_until_complete(
                            _send_per_connection(config, templates, batch(n)))
                        fresh.append(got)
                        expect_conns = n
                    arrived = sink.count() - before
                    if arrived != n or got.connections != expect_conns:
                        raise BenchError(f"email ({mode}, {kind}): sent {n}, the server accepted "
                                         f"{arrived}, connections {got.connections}")
                    say(f"  {kind}: {got.per_s:,.0f} mails/s")
        finally:
            loop.close()
    finally:
        sink.stop()
    prefix = "emails" if mode == "starttls" else "emails_plain"
    r = statistics.median(x.per_s for x in reused)
    f = statistics.median(x.per_s for x in fresh)
    return {f"{prefix}_per_s_reused": r, f"{prefix}_per_s_per_connection": f,
            f"{prefix}_reuse_speedup": r / f,
            f"{prefix}_cpu_ms_reused": statistics.median(x.cpu_ms for x in reused),
            f"{prefix}_cpu_ms_per_connection": statistics.median(x.cpu_ms for x in fresh),
            f"{prefix}_load_1m": [load, _load()], f"{prefix}_message_bytes": size}


# ------------------------------------------------------------------- suite

def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in ("openpyxl", "XlsxWriter", "aiosmtpd", "aiosmtplib"):
        try:
            out[dist.lower()] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist.lower()] = "missing"
    return out


def run_suite(plan: ConsumerPlan, say: Progress) -> dict[str, Any]:
    for module in ("openpyxl", "xlsxwriter", "aiosmtpd"):
        try:
            __import__(module)
        except ImportError:
            raise BenchError(f"conveyor bench --consumers needs {module} "
                             "(pip install 'conveyor[test]')") from None
    started, load_start = time.time(), _load()
    result: dict[str, Any] = {}
    for rows, reps in plan.sizes:
        result.update(_xlsx_size(rows, reps, say))
    result["hostile"] = _hostile(say)
    result.update(_email_mode("starttls", plan, say))
    result.update(_email_mode("plain", plan, say))
    result["plan"] = {"xlsx_sizes": [rows for rows, _ in plan.sizes],
                      "xlsx_reps": [reps for _, reps in plan.sizes],
                      "mails_reused": plan.mails_reused,
                      "mails_per_connection": plan.mails_per_connection,
                      "mail_reps": plan.mail_reps, "quick": plan.quick}
    result["environment"] = {**_versions(), "cpus": os.cpu_count(),
                             "load_avg_1m_start": load_start, "load_avg_1m_end": _load()}
    result["elapsed_s"] = round(time.time() - started, 1)
    return result


def complete(result: dict[str, Any]) -> dict[str, Any]:
    """Targets (issue 3, "Speed"), judged on the sizes this run measured."""
    small, big = (label(n) for n in result["plan"]["xlsx_sizes"])
    hostile = result["hostile"]
    result["xlsx_rss_growth_mb"] = result[f"xlsx_{big}_rss_mb"] - result[f"xlsx_{small}_rss_mb"]
    result["hostile_all_refused"] = all(h["refused"] for h in hostile.values())
    result["hostile_max_seconds"] = max(h["seconds"] for h in hostile.values())
    result["hostile_max_extra_mb"] = max(h["extra_mb"] for h in hostile.values())
    targets = [
        (f"xlsx_speedup_{small}", f"XLSX rows/s vs openpyxl, {small} rows", ">=", 2.0),
        (f"xlsx_speedup_{big}", f"XLSX rows/s vs openpyxl, {big} rows", ">=", 2.0),
        (f"xlsx_{big}_rss_mb", f"XLSX peak RSS at {big} rows (MB)", "<", 100.0),
        ("xlsx_rss_growth_mb", f"XLSX peak RSS growth {small} -> {big} rows (MB)", "<=", 10.0),
        ("hostile_all_refused", "every hostile file refused", "==", True),
        ("hostile_max_seconds", "slowest refusal (s)", "<", HOSTILE_MAX_SECONDS),
        ("hostile_max_extra_mb", "most extra memory for a refusal (MB)", "<", HOSTILE_MAX_EXTRA_MB),
    ]

    def met(value: Any, op: str, threshold: Any) -> bool:
        return bool(value >= threshold if op == ">=" else value <= threshold if op == "<="
                    else value < threshold if op == "<" else value == threshold)

    result["targets"] = {key: {"what": what, "target": f"{op} {threshold}",
                               "value": result[key], "met": met(result[key], op, threshold)}
                         for key, what, op, threshold in targets}
    result["targets_met"] = all(t["met"] for t in result["targets"].values())
    return result


# ------------------------------------------------------------------ output

def _verdict(r: dict[str, Any], key: str) -> str:
    t = r["targets"].get(key)
    return "" if t is None else f"{t['target']:>8}  {'ok' if t['met'] else 'MISSED'}"


def format_table(r: dict[str, Any]) -> str:
    sizes = r["plan"]["xlsx_sizes"]
    lines = [f"{'XLSX aggregation':<28}{'Conveyor':>14}{'openpyxl':>14}{'ratio':>8}  target",
             "-" * 80]
    for rows in sizes:
        lb = label(rows)
        lines.append(f"{f'{rows:,} rows, rows/s':<28}{r[f'xlsx_{lb}_rows_per_s']:>12,.0f}/s"
                     f"{r[f'openpyxl_{lb}_rows_per_s']:>12,.0f}/s{r[f'xlsx_speedup_{lb}']:>8.2f}  "
                     f"{_verdict(r, f'xlsx_speedup_{lb}')}")
        cpu_ratio = r[f"xlsx_cpu_speedup_{lb}"] or 0.0
        lines.append(f"{f'{rows:,} rows, rows/CPU-s':<28}"
                     f"{r[f'xlsx_{lb}_rows_per_cpu_s'] or 0:>12,.0f}/s"
                     f"{r[f'openpyxl_{lb}_rows_per_cpu_s'] or 0:>12,.0f}/s{cpu_ratio:>8.2f}")
        lines.append(f"{f'{rows:,} rows, peak RSS':<28}{r[f'xlsx_{lb}_rss_mb']:>11.1f} MB"
                     f"{r[f'openpyxl_{lb}_rss_mb']:>11.1f} MB{'':>8}  "
                     f"{_verdict(r, f'xlsx_{lb}_rss_mb')}")
        lines.append(f"{'  (growth over imports)':<28}{r[f'xlsx_{lb}_extra_mb']:>11.1f} MB"
                     f"{r[f'openpyxl_{lb}_extra_mb']:>11.1f} MB")
    lines.append(f"{'peak RSS growth':<28}{r['xlsx_rss_growth_mb']:>11.1f} MB{'':>22}  "
                 f"{_verdict(r, 'xlsx_rss_growth_mb')}")
    lines += ["", f"{'hostile file':<22}{'result':>9}{'time':>11}{'extra mem':>12}  reason",
              "-" * 80]
    for name, h in r["hostile"].items():
        lines.append(f"{name:<22}{'refused' if h['refused'] else 'ACCEPTED':>9}"
                     f"{h['seconds'] * 1000:>8.1f} ms{h['extra_mb']:>9.1f} MB  {h['reason'][:60]}")
    lines.append(f"all refused: {r['hostile_all_refused']}; slowest {r['hostile_max_seconds']:.3f} s "
                 f"(< {HOSTILE_MAX_SECONDS:g}), most memory +{r['hostile_max_extra_mb']:.1f} MB "
                 f"(< {HOSTILE_MAX_EXTRA_MB:g})")
    lines += ["", f"{'email (sequential)':<28}{'reused':>14}{'per mail':>14}{'ratio':>8}",
              "-" * 80]
    for prefix, what in (("emails", "STARTTLS + AUTH"), ("emails_plain", "plain SMTP")):
        lines.append(f"{what + ', mails/s':<28}{r[f'{prefix}_per_s_reused']:>12,.0f}/s"
                     f"{r[f'{prefix}_per_s_per_connection']:>12,.0f}/s"
                     f"{r[f'{prefix}_reuse_speedup']:>8.2f}")
        lines.append(f"{'  client CPU per mail':<28}{r[f'{prefix}_cpu_ms_reused']:>11.2f} ms"
                     f"{r[f'{prefix}_cpu_ms_per_connection']:>11.2f} ms")
    met = sum(t["met"] for t in r["targets"].values())
    env, plan = r["environment"], r["plan"]
    lines += ["-" * 80, f"targets met: {met} of {len(r['targets'])}",
              f"xlsx: median of {plan['xlsx_reps']} runs per size, each in a fresh interpreter; "
              f"mail: {plan['mails_reused']} reused / {plan['mails_per_connection']} per "
              f"connection, median of {plan['mail_reps']}, ~{r['emails_message_bytes']} B each",
              f"{env['cpus']} CPUs, load {env['load_avg_1m_start']} -> {env['load_avg_1m_end']}; "
              f"Python {env['python']}, openpyxl {env['openpyxl']}, aiosmtpd {env['aiosmtpd']}; "
              f"took {r['elapsed_s']:.0f}s"]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``conveyor bench --consumers [--json] [--quick]``."""
    plan = ConsumerPlan.from_args(bool(args.quick))
    result = complete(run_suite(plan, stderr_progress))
    if args.json:
        print(json.dumps(rounded(result)))
    else:
        print(format_table(result))
    return 0
