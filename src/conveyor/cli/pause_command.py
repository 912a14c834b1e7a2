"""``pause`` and ``resume``: stop and restart the claiming of topics on every worker.

A pause is a row in the database (:meth:`conveyor.Admin.pause`), so it holds
across worker restarts until ``resume``; ``status`` lists the pauses in force.
"""

from __future__ import annotations

import argparse
from typing import Any

from conveyor.admin import Admin
from conveyor.cli.context import Context
from conveyor.cli.control_command import default_actor
from conveyor.cli.options import add_command, add_json, option
from conveyor.cli.output import emit_json, escape, note, say

Sub = Any  # argparse's private _SubParsersAction

PATTERN_HELP = "an exact topic, 'prefix.*' for every topic under a prefix, or '*' for all"


def _add_target(p: argparse.ArgumentParser, verb: str) -> None:
    p.add_argument("pattern", metavar="PATTERN", help=PATTERN_HELP)
    option(p, "--tenant", help=f"{verb} only this tenant's events", shown="every tenant")


def register_pause(sub: Sub, env: Any) -> None:
    p = add_command(
        sub, "pause", "stop every worker from claiming events of a topic pattern",
        "Workers claim no pending event of PATTERN (of one tenant with --tenant)\n"
        "within a second of this command; events already running finish normally.\n"
        "The pause is kept in the database, so it holds across worker restarts until\n"
        "`conveyor resume` names the same pattern and tenant. Pausing again only\n"
        "replaces the reason.", run_pause,
        examples=[("conveyor pause 'email.*' --reason 'ops: smtp relay down'",
                   "every email topic, for every tenant"),
                  ("conveyor pause billing.invoice --tenant acme", "one topic of one tenant"),
                  ("conveyor pause '*'", "everything")])
    _add_target(p, "pause")
    option(p, "--reason", help="who paused and why, shown by `conveyor status` (up to 500 "
                               "characters)", metavar="TEXT")
    _add_actor(p)
    add_json(p, '{"pattern", "tenant", "reason", "paused_at"}')


def run_pause(ctx: Context, args: argparse.Namespace) -> int:
    pause = Admin(ctx.schema).pause(ctx.connect(), args.pattern, tenant=args.tenant,
                                    reason=args.reason, actor=args.actor or default_actor())
    if args.json:
        emit_json(pause.to_json())
    else:
        say(f"paused {_target(pause.pattern, pause.tenant)}"
            + (f": {escape(pause.reason)}" if pause.reason else ""))
    return 0


def register_resume(sub: Sub, env: Any) -> None:
    p = add_command(
        sub, "resume", "let workers claim a paused topic pattern again",
        "Lift the pause of exactly PATTERN (and --tenant) that `conveyor pause` set;\n"
        "workers claim its events again within a second. Other pauses stay: resuming\n"
        "'email.*' leaves a pause of 'email.send', or of 'email.*' for one tenant.\n"
        "Exits 1 when that pattern and tenant were not paused.", run_resume,
        examples=[("conveyor resume 'email.*'", "lift the pause of every email topic"),
                  ("conveyor resume billing.invoice --tenant acme", "one tenant's pause")])
    _add_target(p, "resume")
    option(p, "--reason", help="why, for the audit log (`conveyor audit`)", metavar="TEXT")
    _add_actor(p)
    add_json(p, '{"pattern", "tenant", "resumed"}')


def run_resume(ctx: Context, args: argparse.Namespace) -> int:
    admin = Admin(ctx.schema)
    conn = ctx.connect()
    resumed = admin.resume(conn, args.pattern, tenant=args.tenant, reason=args.reason,
                           actor=args.actor or default_actor())
    target = _target(args.pattern, args.tenant)
    if args.json:
        emit_json({"pattern": args.pattern, "tenant": args.tenant, "resumed": resumed})
    elif resumed:
        say(f"resumed {target}")
    else:
        paused = admin.paused(conn)
        note(f"{target} is not paused; paused: "
             + (", ".join(_target(p.pattern, p.tenant) for p in paused) or "nothing"))
    return 0 if resumed else 1


def _add_actor(p: argparse.ArgumentParser) -> None:
    option(p, "--actor", metavar="NAME", shown="the OS user",
           help="who makes the change, for the audit log (`conveyor audit`)")


def _target(pattern: str, tenant: str | None) -> str:
    return escape(pattern) + (f" (tenant {escape(tenant)})" if tenant is not None
                              else " (every tenant)")
