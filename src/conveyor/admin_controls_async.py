"""The operator's controls over the workers: pauses and cron schedules.

A pause and a schedule are rows of their own tables, not events: the workers
read them (a pause stops claims of its topics, a schedule fires its slots),
and the operator changes them. :class:`AsyncAdminControls` holds these
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
from conveyor.admin_core import _pause_params, pause_from_row
from conveyor.db.execute import run_async
from conveyor.db.named_queries import Queries
from conveyor.db.rows import schedule_from_row
from conveyor.errors import InvalidInputError
from conveyor.notify import PAUSE_NOTIFICATION
from conveyor.records import Pause, ScheduleInfo


class AsyncAdminControls:
    """Pauses and cron schedules, on the connection you pass, in its transaction."""

    _q: Queries

    async def pause(self, conn: psycopg.AsyncConnection[Any], pattern: str, *,
                    tenant: str | None = None, reason: str | None = None) -> Pause:
        """Stop every worker from claiming events of ``pattern``; returns the pause.

        ``pattern``: an exact topic, ``"prefix.*"`` or ``"*"``, as a route is
        written. ``tenant``: only this tenant's events; defaults to None, every
        tenant. ``reason``: who and why, shown by ``conveyor status`` (up to
        500 characters); defaults to None.

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
        params = _pause_params(pattern, tenant, reason)
        row = await (await run_async(conn, self._q["pause_upsert"], params)).fetchone()
        assert row is not None  # an upsert always returns its row
        await self._notify_pauses(conn)
        return pause_from_row(row)

    async def resume(self, conn: psycopg.AsyncConnection[Any], pattern: str, *,
                     tenant: str | None = None) -> bool:
        """Lift the pause of exactly ``pattern`` and ``tenant``; returns whether one existed.

        It names the pause as :meth:`pause` did: resuming ``"email.*"`` leaves
        a pause of ``"email.send"``, or of ``"email.*"`` for one tenant, in
        place. Takes effect when the caller's transaction commits; workers
        claim the topic again within a second. ``tenant`` defaults to None.
        """
        params = _pause_params(pattern, tenant)
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

    async def remove_schedule(self, conn: psycopg.AsyncConnection[Any], name: str) -> bool:
        """Forget a cron schedule no worker declares any more; ``True`` if it existed.

        A worker that still declares it puts it back within a minute (starting
        from then, without firing the slots in between).
        """
        if not isinstance(name, str) or not name:
            raise InvalidInputError(f"expected a schedule name, got {name!r:.60}")
        cur = await run_async(conn, self._q["cron_remove"], {"name": name})
        return await cur.fetchone() is not None

    async def _notify_pauses(self, conn: psycopg.AsyncConnection[Any]) -> None:
        # Delivered at commit, and not at all on a rollback: the workers hear
        # of a pause exactly when it exists.
        await run_async(conn, self._q["event_notify"],
                        {"channel": self._q.channel, "payload": PAUSE_NOTIFICATION})
