"""The operator's controls over the workers: pauses, flow limits, cron schedules.

A pause, a flow limit and a schedule are rows of their own tables, not
events: the workers read them (a pause stops claims of its topics, a limit
bounds them, a schedule fires its slots), and the operator changes them at
run time. Every change writes its row of the audit log in the same statement
(:meth:`AsyncAdminControls.audit_log` reads it). :class:`AsyncAdminControls` holds these
methods, and :class:`~conveyor.admin.AsyncAdmin`, which adds the operations
on events, inherits them; use that. Kept apart from the event operations so
each file reads as one subject.

``conveyor/admin_controls_async.py`` is the source people edit;
``conveyor/admin_controls.py`` is its sync twin, generated from it by
``scripts/unasync.py``.
"""

from __future__ import annotations

from typing import Any

import psycopg

# unasync: from conveyor.admin_controls_async import AsyncAdminControls as AsyncAdminControls
from conveyor.admin_controls_core import (
    AUDIT_LIMIT_DEFAULT,
    AuditEntry,
    LimitInfo,
    audit_from_row,
    audit_params,
    check_actor,
    check_expression,
    check_schedule_name,
    limit_from_row,
    limit_params,
    next_slot,
)
from conveyor.admin_core import _check_reason, _pause_params, pause_from_row
from conveyor.db.execute import run_async
from conveyor.db.named_queries import Queries
from conveyor.db.rows import schedule_from_row
from conveyor.errors import ScheduleNotFoundError
from conveyor.notify import CONTROL_NOTIFICATION, PAUSE_NOTIFICATION
from conveyor.patterns import check_topic_pattern
from conveyor.records import Pause, ScheduleInfo


def _who(reason: object, actor: object) -> dict[str, str | None]:
    """The audit log's why and who, checked before any SQL."""
    return {"reason": _check_reason(reason), "actor": check_actor(actor)}


class AsyncAdminControls:
    """Pauses, flow limits and cron schedules, on the connection you pass, in its
    transaction; each change audited (who: ``actor``, by default the database
    role; why: ``reason``)."""

    _q: Queries

    async def pause(self, conn: psycopg.AsyncConnection[Any], pattern: str, *,
                    tenant: str | None = None, reason: str | None = None,
                    actor: str | None = None) -> Pause:
        """Stop every worker from claiming events of ``pattern``; returns the pause.

        ``pattern``: an exact topic, ``"prefix.*"`` or ``"*"``, as a route is
        written. ``tenant``: only this tenant's events; defaults to None, every
        tenant. ``reason``: who and why, shown by ``conveyor status`` (up to
        500 characters); defaults to None. ``actor``: who pauses, for the
        audit log; defaults to None, the database role.

        Joins the caller's transaction like every method here: the pause
        exists, and the workers hear of it, only when that transaction
        commits. Workers then claim no matching event within a second (a
        NOTIFY, and a poll every half second as the fallback); events already
        running finish normally. The pause is a row in the database, so it
        holds across worker restarts until :meth:`resume`. Pausing what is
        already paused keeps its ``paused_at`` and replaces the reason when
        one is given.

        Example::

            with conn.transaction():
                admin.pause(conn, "email.*", reason="ops: smtp relay down")
        """
        params = {**_pause_params(pattern, tenant, reason), "actor": check_actor(actor)}
        row = await (await run_async(conn, self._q["pause_upsert"], params)).fetchone()
        assert row is not None  # an upsert always returns its row
        await self._notify_pauses(conn)
        return pause_from_row(row)

    async def resume(self, conn: psycopg.AsyncConnection[Any], pattern: str, *,
                     tenant: str | None = None, reason: str | None = None,
                     actor: str | None = None) -> bool:
        """Lift the pause of exactly ``pattern`` and ``tenant``; returns whether one existed.

        It names the pause as :meth:`pause` did: resuming ``"email.*"`` leaves
        a pause of ``"email.send"``, or of ``"email.*"`` for one tenant, in
        place. Takes effect when the caller's transaction commits; workers
        claim the topic again within a second. ``tenant`` defaults to None;
        ``reason`` and ``actor`` go to the audit log (defaults: None, and the
        database role).
        """
        params = {**_pause_params(pattern, tenant, reason), "actor": check_actor(actor)}
        cur = await run_async(conn, self._q["pause_delete"], params)
        if await cur.fetchone() is None:
            return False
        await self._notify_pauses(conn)
        return True

    async def paused(self, conn: psycopg.AsyncConnection[Any]) -> list[Pause]:
        """Every pause in force, by pattern, the all-tenants one before per-tenant ones."""
        cur = await run_async(conn, self._q["pause_list"])
        return [pause_from_row(r) for r in await cur.fetchall()]

    async def schedules(self, conn: psycopg.AsyncConnection[Any]) -> list[ScheduleInfo]:
        """Every cron schedule a worker has declared, by name, with its next slot and
        whether it is overdue (no scheduler is firing it); see docs/cron.md."""
        cur = await run_async(conn, self._q["cron_list"])
        return [schedule_from_row(r) for r in await cur.fetchall()]

    async def remove_schedule(self, conn: psycopg.AsyncConnection[Any], name: str, *,
                              reason: str | None = None, actor: str | None = None) -> bool:
        """Forget a cron schedule no worker declares any more; ``True`` if it existed.

        A worker that still declares it puts it back within a minute (starting
        from then, without firing the slots in between), without the override
        or the disabling it had. Audited with ``reason`` and ``actor``.
        """
        params = {"name": check_schedule_name(name), **_who(reason, actor)}
        cur = await run_async(conn, self._q["cron_remove"], params)
        return await cur.fetchone() is not None

    async def set_schedule(self, conn: psycopg.AsyncConnection[Any], name: str, expression: str,
                           *, reason: str | None = None,
                           actor: str | None = None) -> ScheduleInfo:
        """Fire schedule ``name`` on ``expression`` instead of the declared one; returns it.

        The override is kept in the database and wins over the expression the
        routes declare, across worker restarts and deploys, until
        :meth:`clear_schedule`. It takes effect from the change: slots of
        the new expression before it do not fire. Running workers follow within
        a second (a NOTIFY; at the latest at their next declaration, a minute).
        ``expression`` is read in the schedule's zone; one cronsim refuses
        raises InvalidInputError naming it, an unknown ``name``
        ScheduleNotFoundError.

        Example::

            admin.set_schedule(conn, "nightly-report", "30 2 * * *", reason="after the backup")
        """
        who = _who(reason, actor)
        row = await self._schedule_row(conn, name)
        tidy, following = check_expression(expression, row[2], row[5])
        return await self._control_schedule(conn, row, "schedule.set", expression=tidy,
                                            enabled=row[4], restart=True,
                                            next_fire_at=following if row[4] else None,
                                            **who)

    async def clear_schedule(self, conn: psycopg.AsyncConnection[Any], name: str, *,
                             reason: str | None = None,
                             actor: str | None = None) -> ScheduleInfo:
        """Fire schedule ``name`` on its declared expression again (from now on); returns it."""
        who = _who(reason, actor)
        row = await self._schedule_row(conn, name)
        following = next_slot(row[1], row[2], row[5]) if row[4] else None
        # Back on the declared expression from now; without an override nothing moves.
        return await self._control_schedule(conn, row, "schedule.clear", expression=None,
                                            enabled=row[4], restart=row[3] is not None,
                                            next_fire_at=following, **who)

    async def disable_schedule(self, conn: psycopg.AsyncConnection[Any], name: str, *,
                               reason: str | None = None,
                               actor: str | None = None) -> ScheduleInfo:
        """Stop schedule ``name`` from firing until :meth:`enable_schedule`; returns it.

        Its slots pass unfired (not counted as missed) and it is never
        overdue; a worker restart does not enable it again.
        """
        who = _who(reason, actor)
        row = await self._schedule_row(conn, name)
        return await self._control_schedule(conn, row, "schedule.disable", expression=row[3],
                                            enabled=False, restart=False, next_fire_at=None,
                                            **who)

    async def enable_schedule(self, conn: psycopg.AsyncConnection[Any], name: str, *,
                              reason: str | None = None,
                              actor: str | None = None) -> ScheduleInfo:
        """Let schedule ``name`` fire again, from now: the slots it passed disabled stay
        unfired; returns it."""
        who = _who(reason, actor)
        row = await self._schedule_row(conn, name)
        following = next_slot(row[3] or row[1], row[2], row[5])
        # From now when it was disabled; an enabled one keeps its cursor.
        return await self._control_schedule(conn, row, "schedule.enable", expression=row[3],
                                            enabled=True, restart=not row[4],
                                            next_fire_at=following, **who)

    async def set_limit(self, conn: psycopg.AsyncConnection[Any], pattern: str, *,
                        max_running: int | None = None, rate: str | float | None = None,
                        burst: float | None = None, reason: str | None = None,
                        actor: str | None = None) -> LimitInfo:
        """Override the flow limit of ``pattern`` at run time; returns the limit.

        ``max_running``: events of the pattern running at once, fleet-wide
        (1 to 1,000,000). ``rate``: ``"10/s"``, ``"600/m"``, ``"5/10s"``, or
        starts per second as a number. ``burst``: starts allowed at once after
        an idle spell (at least 1); defaults to one second's worth of a rate
        set here. Each defaults to None: that field keeps its override, or
        the declared value. At least one is needed.

        The override is kept in the database and wins over what the routes
        declare, across worker restarts, until :meth:`clear_limit`. Running
        workers hold the new limit from their next claim of the pattern (each
        claim reads it under the pattern's lock). ``pattern`` need not be a
        declared route's: the override then makes a limit of its own, which
        every worker enforces from its next read of the limits (a NOTIFY makes
        that their next claim). Bad values raise InvalidInputError naming them.

        Example::

            admin.set_limit(conn, "sms.send", rate="2/s", reason="provider throttling us")
        """
        params = {**limit_params(pattern, max_running, rate, burst), **_who(reason, actor)}
        await run_async(conn, self._q["flow_override_set"], params)
        await self._notify_control(conn)
        found = await self.limits(conn, pattern=params["pattern"])
        return found[0]

    async def clear_limit(self, conn: psycopg.AsyncConnection[Any], pattern: str, *,
                          reason: str | None = None, actor: str | None = None) -> bool:
        """Drop the override of ``pattern``: the declared limit holds again (a limit no
        route declares is gone); ``True`` if there was an override."""
        params = {"pattern": check_topic_pattern(pattern), **_who(reason, actor)}
        cur = await run_async(conn, self._q["flow_override_clear"], params)
        if await cur.fetchone() is None:
            return False
        await self._notify_control(conn)
        return True

    async def limits(self, conn: psycopg.AsyncConnection[Any], *,
                     pattern: str | None = None) -> list[LimitInfo]:
        """Every flow limit (or only ``pattern``'s), declared, overridden and in force,
        with its running events; by pattern."""
        if pattern is not None:
            pattern = check_topic_pattern(pattern)
        cur = await run_async(conn, self._q["flow_limit_list"], {"pattern": pattern})
        return [limit_from_row(r) for r in await cur.fetchall()]

    async def audit_log(self, conn: psycopg.AsyncConnection[Any], *, target: str | None = None,
                        kind: str | None = None, limit: int = AUDIT_LIMIT_DEFAULT,
                        before: int | None = None) -> list[AuditEntry]:
        """The control changes, newest first: at most ``limit`` (1 to 10,000; defaults
        to 100), of one pattern or schedule name (``target``) and one ``kind``
        (``"limit.set"``) or family (``"limit"``, ``"schedule"``, ``"pause"``) when
        given; ``before``: only entries older than that id (the next page)."""
        cur = await run_async(conn, self._q["control_audit_list"],
                              audit_params(target, kind, limit, before))
        return [audit_from_row(r) for r in await cur.fetchall()]

    async def _schedule_row(self, conn: psycopg.AsyncConnection[Any],
                            name: str) -> tuple[Any, ...]:
        # (name, expression, timezone, expression_override, enabled, now), locked.
        cur = await run_async(conn, self._q["cron_control_get"],
                              {"name": check_schedule_name(name)})
        row = await cur.fetchone()
        if row is None:
            known = [s.name for s in await self.schedules(conn)]
            raise ScheduleNotFoundError(
                f"unknown cron schedule {name!r:.100}; schedules: "
                + (", ".join(repr(k) for k in known[:20]) or "none"))
        return tuple(row)

    async def _control_schedule(self, conn: psycopg.AsyncConnection[Any], row: tuple[Any, ...],
                                kind: str, *, expression: str | None, enabled: bool,
                                restart: bool, next_fire_at: object,
                                **who: str | None) -> ScheduleInfo:
        await run_async(conn, self._q["cron_control"], {
            "name": row[0], "expression_override": expression, "enabled": enabled,
            "restart": restart, "next_fire_at": next_fire_at, "kind": kind, **who})
        await self._notify_control(conn)
        return next(s for s in await self.schedules(conn) if s.name == row[0])

    async def _notify_control(self, conn: psycopg.AsyncConnection[Any]) -> None:
        # Delivered at commit (and not on a rollback), as the pauses' notice is.
        await run_async(conn, self._q["event_notify"],
                        {"channel": self._q.channel, "payload": CONTROL_NOTIFICATION})

    async def _notify_pauses(self, conn: psycopg.AsyncConnection[Any]) -> None:
        # Delivered at commit, and not at all on a rollback: the workers hear
        # of a pause exactly when it exists.
        await run_async(conn, self._q["event_notify"],
                        {"channel": self._q.channel, "payload": PAUSE_NOTIFICATION})
