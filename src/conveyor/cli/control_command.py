"""``limits``, ``cron`` and ``audit``: run-time control of flow limits and cron schedules.

An override is a row in the database (:meth:`conveyor.Admin.set_limit`,
:meth:`conveyor.Admin.set_schedule`): it wins over what the routes declare,
across worker restarts, until cleared. Every change, pauses included, is in
the audit log that ``conveyor audit`` prints. ``--actor`` names who made a
change; by default the OS user running the command.
"""

from __future__ import annotations

import argparse
import getpass
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from conveyor.admin import Admin
from conveyor.admin_controls_core import AUDIT_KINDS, AuditEntry, LimitInfo
from conveyor.cli.context import Context, positive_int
from conveyor.cli.options import add_command, add_json, option
from conveyor.cli.output import emit_json, escape, note, say
from conveyor.cron import default_name
from conveyor.records import ScheduleInfo

Sub = Any  # argparse's private _SubParsersAction

ACTOR_FALLBACK = "cli"
AUDIT_SHOWN_DEFAULT = 50


def default_actor() -> str:
    """Who runs the command, for the audit log: the OS user (``cli`` when unknown)."""
    try:
        return getpass.getuser() or ACTOR_FALLBACK
    except (OSError, KeyError):     # no user name in the environment nor the password file
        return ACTOR_FALLBACK


def add_who(p: argparse.ArgumentParser) -> None:
    """``--reason`` and ``--actor``, as every audited change takes them."""
    option(p, "--reason", metavar="TEXT",
           help="why, for the audit log (`conveyor audit`; up to 500 characters)")
    option(p, "--actor", metavar="NAME", shown="the OS user",
           help="who makes the change, for the audit log")


def who(args: argparse.Namespace) -> dict[str, str | None]:
    return {"reason": args.reason, "actor": args.actor or default_actor()}


def _rate(text: str) -> str | float:
    """``10/s``-style text as it is, a bare number as starts per second (Admin checks both)."""
    try:
        return float(text)
    except ValueError:
        return text


def _per_second(value: float | None) -> str:
    return "-" if value is None else f"{value:g}/s"


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


# ------------------------------------------------------------------ limits

def register_limits(sub: Sub, env: Any) -> None:
    p = add_command(
        sub, "limits", "list, set and clear run-time overrides of flow limits",
        "Flow limits (max_running, rate, burst) are declared on routes in code; an\n"
        "operator may override them while the workers run. An override is kept in the\n"
        "database and wins over the declared value, across worker restarts and deploys,\n"
        "until `conveyor limits clear`. Running workers hold a changed value from their\n"
        "next claim of the pattern; a pattern no route declares gets a limit of its own.")
    lsub = p.add_subparsers(dest="limits_command", metavar="ACTION", required=True)

    ls = add_command(lsub, "list", "every flow limit: declared, override, in force, running",
                     "Each limited pattern with its declared values, the operator's override,\n"
                     "the values in force and the events running now, fleet-wide.",
                     run_limits_list, examples=[("conveyor limits list", "the table"),
                                                ("conveyor limits list --json", "as JSON")])
    add_json(ls, '{"limits": [{"pattern", "max_running", "rate", "burst", "override_max_running", '
                 '"override_rate", "override_burst", "effective", "running", ...}]}')

    st = add_command(lsub, "set", "override a pattern's max_running, rate or burst",
                     "Override the flow limit of PATTERN (an exact topic, 'prefix.*' or '*'). A\n"
                     "value not given keeps its override, or the declared value. A rate without\n"
                     "--burst allows one second's worth at once.", run_limits_set,
                     examples=[("conveyor limits set report.render --max-running 8 "
                                "--reason 'month end'", "more reports at once"),
                               ("conveyor limits set sms.send --rate 2/s --reason 'provider "
                                "throttling'", "fewer SMS a second"),
                               ("conveyor limits set 'bulk.*' --max-running 1",
                                "limit a pattern no route limits")])
    st.add_argument("pattern", metavar="PATTERN", help="the limit's topic pattern")
    option(st, "--max-running", type=int, metavar="N",
           help="events running at once, fleet-wide (1 to 1000000)")
    option(st, "--rate", type=_rate, metavar="RATE",
           help="starts per second: '10/s', '600/m', '5/10s', '1000/h' or a number")
    option(st, "--burst", type=float, metavar="N",
           help="starts allowed at once after an idle spell (at least 1)")
    add_who(st)
    add_json(st, "the limit, as in `limits list --json`")

    cl = add_command(lsub, "clear", "drop a pattern's override: the declared limit again",
                     "The declared limit holds again from the workers' next claim; a limit only\n"
                     "the override made (no route declares the pattern) is gone. Exits 1 when\n"
                     "PATTERN has no override.", run_limits_clear,
                     examples=[("conveyor limits clear sms.send --reason 'provider ok'",
                                "back to the route's rate")])
    cl.add_argument("pattern", metavar="PATTERN", help="the limit's topic pattern")
    add_who(cl)
    add_json(cl, '{"pattern", "cleared"}')


def format_limits(limits: list[LimitInfo]) -> list[str]:
    if not limits:
        return ["no flow limits"]
    lines = [f"{'pattern':<28} {'max_running':>22} {'rate':>24} {'running':>7}"]
    for x in limits:
        running = _count(x.effective_max_running)
        if x.override_max_running is not None:
            running += f" (code {_count(x.max_running)})"
        rate = _per_second(x.effective_rate)
        if x.override_rate is not None or x.override_burst is not None:
            rate += f" (code {_per_second(x.rate)})"
        mark = "" if x.declared else "  [set at run time only]"
        lines.append(f"{escape(x.pattern):<28} {running:>22} {rate:>24} {x.running:>7}{mark}")
    return lines


def run_limits_list(ctx: Context, args: argparse.Namespace) -> int:
    limits = Admin(ctx.schema).limits(ctx.connect())
    if args.json:
        emit_json({"limits": [x.to_json() for x in limits]})
    else:
        say("\n".join(format_limits(limits)))
    return 0


def run_limits_set(ctx: Context, args: argparse.Namespace) -> int:
    limit = Admin(ctx.schema).set_limit(ctx.connect(), args.pattern, max_running=args.max_running,
                                        rate=args.rate, burst=args.burst, **who(args))
    if args.json:
        emit_json(limit.to_json())
    else:
        say(f"limit of {escape(limit.pattern)} now: max_running "
            f"{_count(limit.effective_max_running)}, rate {_per_second(limit.effective_rate)} "
            f"(burst {limit.effective_burst if limit.effective_burst is not None else '-'}); "
            "held by the workers from their next claim")
    return 0


def run_limits_clear(ctx: Context, args: argparse.Namespace) -> int:
    cleared = Admin(ctx.schema).clear_limit(ctx.connect(), args.pattern, **who(args))
    if args.json:
        emit_json({"pattern": args.pattern, "cleared": cleared})
    elif cleared:
        say(f"override of {escape(args.pattern)} cleared: the declared limit holds again")
    else:
        note(f"{escape(args.pattern)} has no override")
    return 0 if cleared else 1


# ------------------------------------------------------------------ cron

def format_schedules(schedules: Sequence[ScheduleInfo]) -> list[str]:
    """The lines about cron schedules, by name; none when there are none."""
    if not schedules:
        return []
    lines = ["", f"cron schedules ({len(schedules)}):"]
    for s in schedules:
        zone = "" if s.timezone == "UTC" else f" {s.timezone}"
        nxt = _utc(s.next_fire_at) if s.next_fire_at else "-"
        # A schedule defined without a name is named by what follows: said once.
        named = "" if s.name == default_name(s.topic, s.expression, s.timezone) \
            else f"{escape(s.name)}: "
        line = f"  {named}{escape(s.expression)}{escape(zone)} -> {escape(s.topic)}, next {nxt}"
        if s.expression_override is not None:
            line = (f"  {named}{escape(s.expression_override)}{escape(zone)} "
                    f"(set at run time; declared {escape(s.expression)}) -> {escape(s.topic)}, "
                    f"next {nxt}")
        if not s.enabled:
            line += ", DISABLED"
        if s.overdue:
            line += f", OVERDUE by {s.overdue_s:.0f}s: no running worker fires it"
        if s.missed:
            line += f", {s.missed} slot(s) skipped past the catch-up window"
        lines.append(line)
    return lines


def _utc(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")



def register_cron(sub: Sub, env: Any) -> None:
    p = add_command(
        sub, "cron", "list, change, disable and enable cron schedules at run time",
        "Cron schedules are declared on routers in code; an operator may change a\n"
        "schedule's expression, or disable it, while the workers run. The change is kept\n"
        "in the database and wins over the declaration, across worker restarts and\n"
        "deploys, until `conveyor cron clear` (the expression) or `conveyor cron enable`.\n"
        "A changed or enabled schedule starts from the change: earlier slots do not fire.")
    csub = p.add_subparsers(dest="cron_command", metavar="ACTION", required=True)

    ls = add_command(csub, "list", "every schedule: expression, next slot, state",
                     "Every schedule a worker has declared, as `conveyor status` shows them.",
                     run_cron_list, examples=[("conveyor cron list --json", "as JSON")])
    add_json(ls, '{"schedules": [{"name", "expression", "expression_override", "enabled", '
                 '"next_fire_at", "last_fired_at", ...}]}')

    st = add_command(csub, "set", "fire a schedule on another cron expression",
                     "Fire schedule NAME on --schedule instead of its declared expression, read\n"
                     "in the schedule's time zone; five fields, or six with seconds first.",
                     run_cron_set,
                     examples=[("conveyor cron set nightly-report --schedule '30 2 * * *' "
                                "--reason 'after the backup'", "half an hour earlier")])
    st.add_argument("name", metavar="NAME", help="the schedule's name (`conveyor cron list`)")
    option(st, "--schedule", required=True, metavar="EXPR", help="the cron expression to fire")
    add_who(st)
    add_json(st, "the schedule, as in `cron list --json`")

    for action, help_text, description, run in (
            ("clear", "fire a schedule on its declared expression again",
             "Drop the expression set by `conveyor cron set NAME`.", run_cron_clear),
            ("disable", "stop a schedule from firing",
             "Its slots pass unfired (not counted as missed) and it is never overdue, until\n"
             "`conveyor cron enable NAME`; a worker restart does not enable it.",
             run_cron_disable),
            ("enable", "let a disabled schedule fire again",
             "It fires from now on: the slots it passed disabled stay unfired.",
             run_cron_enable)):
        a = add_command(csub, action, help_text, description, run,
                        examples=[(f"conveyor cron {action} nightly-report --reason 'ticket 42'",
                                   help_text)])
        a.add_argument("name", metavar="NAME", help="the schedule's name (`conveyor cron list`)")
        add_who(a)
        add_json(a, "the schedule, as in `cron list --json`")

    rm = add_command(csub, "remove", "forget a schedule no worker declares any more",
                     "Delete schedule NAME's row (with its override). A worker that still\n"
                     "declares it puts it back within a minute. Exits 1 when there is none.",
                     run_cron_remove,
                     examples=[("conveyor cron remove old-report --reason 'retired'",
                                "forget it")])
    rm.add_argument("name", metavar="NAME", help="the schedule's name (`conveyor cron list`)")
    add_who(rm)
    add_json(rm, '{"name", "removed"}')


def run_cron_list(ctx: Context, args: argparse.Namespace) -> int:
    schedules = Admin(ctx.schema).schedules(ctx.connect())
    if args.json:
        emit_json({"schedules": [s.to_json() for s in schedules]})
    else:
        say("\n".join(format_schedules(schedules)[1:] or ["no cron schedules"]))
    return 0


def _show_schedule(args: argparse.Namespace, info: Any, done: str) -> int:
    if args.json:
        emit_json(info.to_json())
    else:
        say(f"schedule {escape(info.name)} {done}; " + format_schedules([info])[-1].strip())
    return 0


def run_cron_set(ctx: Context, args: argparse.Namespace) -> int:
    info = Admin(ctx.schema).set_schedule(ctx.connect(), args.name, args.schedule, **who(args))
    return _show_schedule(args, info, "changed")


def run_cron_clear(ctx: Context, args: argparse.Namespace) -> int:
    info = Admin(ctx.schema).clear_schedule(ctx.connect(), args.name, **who(args))
    return _show_schedule(args, info, "back to its declared expression")


def run_cron_disable(ctx: Context, args: argparse.Namespace) -> int:
    info = Admin(ctx.schema).disable_schedule(ctx.connect(), args.name, **who(args))
    return _show_schedule(args, info, "disabled")


def run_cron_enable(ctx: Context, args: argparse.Namespace) -> int:
    info = Admin(ctx.schema).enable_schedule(ctx.connect(), args.name, **who(args))
    return _show_schedule(args, info, "enabled")


def run_cron_remove(ctx: Context, args: argparse.Namespace) -> int:
    removed = Admin(ctx.schema).remove_schedule(ctx.connect(), args.name, **who(args))
    if args.json:
        emit_json({"name": args.name, "removed": removed})
    elif removed:
        say(f"schedule {escape(args.name)} removed")
    else:
        note(f"no cron schedule is named {escape(args.name)}")
    return 0 if removed else 1


# ------------------------------------------------------------------ audit

def register_audit(sub: Sub, env: Any) -> None:
    p = add_command(
        sub, "audit", "the log of control changes: who, when, why, before and after",
        "Every pause and resume, flow limit set or cleared and schedule changed,\n"
        "disabled, enabled or removed, newest first: when (the database's time), who,\n"
        "what, why, and the values before and after.", run_audit,
        examples=[("conveyor audit", f"the last {AUDIT_SHOWN_DEFAULT} changes"),
                  ("conveyor audit --pattern sms.send --kind limit", "one limit's history"),
                  ("conveyor audit --json --limit 1000", "as JSON")])
    option(p, "--pattern", metavar="TARGET",
           help="only the changes of this pattern or schedule name")
    option(p, "--kind", metavar="KIND", choices=sorted({k.partition(".")[0] for k in AUDIT_KINDS}
                                                       | set(AUDIT_KINDS)),
           help="only this kind ('limit.set') or family ('limit', 'schedule', 'pause')")
    option(p, "--limit", type=positive_int, default=AUDIT_SHOWN_DEFAULT,
           help="at most this many entries (up to 10000)")
    add_json(p, '{"entries": [{"id", "at", "actor", "kind", "target", "reason", "old", "new"}]}')


def format_entry(entry: AuditEntry) -> str:
    at = entry.at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    why = f" ({escape(entry.reason)})" if entry.reason else ""
    return (f"{at}  {escape(entry.actor)}  {entry.kind} {escape(entry.target)}{why}: "
            f"{_values(entry.old)} -> {_values(entry.new)}")


def _values(values: dict[str, Any] | None) -> str:
    if values is None:
        return "none"
    shown = {k: v for k, v in values.items() if v is not None and k != "paused_at"}
    return escape(", ".join(f"{k}={v}" for k, v in shown.items()) or "none")


def run_audit(ctx: Context, args: argparse.Namespace) -> int:
    entries = Admin(ctx.schema).audit_log(ctx.connect(), target=args.pattern, kind=args.kind,
                                          limit=args.limit)
    if args.json:
        emit_json({"entries": [e.to_json() for e in entries]})
    elif not entries:
        say("no control changes" + ("" if args.pattern is None and args.kind is None
                                    else " match"))
    else:
        say("\n".join(format_entry(e) for e in entries))
    return 0
