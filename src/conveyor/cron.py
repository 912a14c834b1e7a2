"""Cron schedules: events enqueued on a timetable, by every worker, once per slot.

Declare them on the router the workers run::

    router.cron("*/5 * * * *", "report.build", payload={"kind": "hourly"},
                tz="Europe/Madrid", catch_up=600)

Every worker whose router declares a schedule may fire it; a slot's
(schedule, fire time) key, inserted in the transaction that enqueues its
event, makes each slot fire exactly once however many workers run. Slots
are computed by cronsim (Debian cron's rules for daylight saving time);
the expressions take five fields, or six with seconds first. See
docs/cron.md.

This module is the I/O-free half: definitions and slot arithmetic. The loop
that fires them is :mod:`conveyor.worker.scheduler`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from conveyor.errors import ConfigError, InvalidInputError, MissingExtraError
from conveyor.types import Event
from conveyor.validation import (
    check_max_attempts,
    check_priority,
    check_tenant,
    check_topic,
    encode_payload,
)

if TYPE_CHECKING:
    from cronsim import CronSim

__all__ = ["CATCH_UP_DEFAULT", "Schedule", "fire_time"]

# Seconds a slot may be late and still fire (after a deploy or an outage);
# older ones are skipped and counted. Five minutes: a restart is covered, a
# one-second schedule does not burst a day's worth of events after a night down.
CATCH_UP_DEFAULT = 300.0
# A slot found this many seconds after its time is on time, whatever
# catch_up says: the loop wakes a few milliseconds late, a busy database later.
ON_TIME = 5.0
CATCH_UP_MAX = 7 * 86_400.0
NAME_MAX_LENGTH = 100
# A schedule's payload, as an enqueued one at the producer's defaults.
PAYLOAD_MAX_BYTES = 1024 * 1024
PAYLOAD_MAX_DEPTH = 64
# Slots looked at in one firing: a second-by-second schedule after a week
# down would otherwise walk 600,000 of them to count what it skipped.
SLOT_WALK_LIMIT = 100_000

_KEY_RE = re.compile(r"^cron:(?P<name>.+)@(?P<at>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)$")


def _cronsim() -> type[CronSim]:
    # Imported on first use: a core install imports this module with the router.
    try:
        from cronsim import CronSim
    except ImportError as exc:
        raise MissingExtraError("conveyor.cron", "cron", module="cronsim") from exc
    return CronSim


def _cronsim_error() -> type[Exception]:
    from cronsim import CronSimError
    return CronSimError


def default_name(topic: str, expression: str, tz: str) -> str:
    """The name of a schedule defined without one: ``"mail.digest 0 6 * * * Europe/Madrid"``."""
    return f"{topic} {expression}" + ("" if tz == "UTC" else f" {tz}")


@dataclass(frozen=True, slots=True)
class Schedule:
    """One cron schedule, as :meth:`conveyor.Router.cron` declares it.

    Attributes:
        name: the schedule's key in the database; defaults to
            ``"<topic> <expression>"`` (with `` <tz>`` when not UTC).
        expression: five cron fields, or six with seconds first.
        topic: the topic of the events it enqueues.
        payload: their payload (JSON text).
        timezone: the IANA zone the expression is read in.
        catch_up: seconds a slot may be late and still fire.
        tenant, priority, max_attempts: the enqueued events' fields.
    """

    name: str
    expression: str
    topic: str
    payload: str
    timezone: str
    catch_up: float
    tenant: str | None
    priority: int
    max_attempts: int

    @classmethod
    def define(cls, expression: object, topic: object, payload: Any = None, *,
               name: object = None, tz: object = "UTC", catch_up: object = CATCH_UP_DEFAULT,
               tenant: object = None, priority: object = 0, max_attempts: object = 5) -> Schedule:
        """A checked schedule; every bad value raises ConfigError naming it."""
        cron = _cronsim()
        try:
            topic = check_topic(topic)
            tenant = check_tenant(tenant)
            priority = check_priority(priority)
            max_attempts = check_max_attempts(max_attempts)
            payload_text = encode_payload(payload, max_bytes=PAYLOAD_MAX_BYTES,
                                          max_depth=PAYLOAD_MAX_DEPTH)
        except InvalidInputError as exc:
            raise ConfigError(f"cron schedule for {topic!r:.60}: {exc}") from None
        if not isinstance(expression, str):
            raise ConfigError(f"expected a cron expression string, got {expression!r:.60}")
        expression = " ".join(expression.split())
        if not isinstance(tz, str):
            raise ConfigError(f"expected tz to be an IANA time zone name, got {tz!r:.60}")
        try:
            zone = ZoneInfo(tz)
        except (ZoneInfoNotFoundError, ValueError):
            raise ConfigError(f"unknown time zone {tz!r:.60} (expected an IANA name such as "
                              f"'Europe/Madrid')") from None
        try:
            next(iter(cron(expression, datetime.now(zone))))
        except (_cronsim_error(), StopIteration) as exc:
            raise ConfigError(f"invalid cron expression {expression!r:.60}: "
                              f"{exc or 'it never fires'}") from None
        if isinstance(catch_up, bool) or not isinstance(catch_up, int | float) \
                or not math.isfinite(catch_up) or not 0 <= catch_up <= CATCH_UP_MAX:
            raise ConfigError(f"expected catch_up to be seconds from 0 to {CATCH_UP_MAX:.0f}, "
                              f"got {catch_up!r:.60}")
        if name is None:
            name = default_name(topic, expression, tz)
        if not isinstance(name, str) or not name.strip() or len(name) > NAME_MAX_LENGTH \
                or any(ord(c) < 32 for c in name):
            raise ConfigError(f"expected a schedule name of 1 to {NAME_MAX_LENGTH} printable "
                              f"characters, got {name!r:.120}")
        return cls(name, expression, topic, payload_text, tz, float(catch_up), tenant,
                   priority, max_attempts)

    def _slots_after(self, moment: datetime) -> Iterator[datetime]:
        """Slots strictly after ``moment``, as UTC instants, in order."""
        zone = ZoneInfo(self.timezone)
        for slot in _cronsim()(self.expression, moment.astimezone(zone)):
            yield slot.astimezone(UTC)

    def next_after(self, moment: datetime) -> datetime | None:
        """The first slot after ``moment`` (None if the expression never fires again)."""
        return next(self._slots_after(moment), None)

    def due(self, fired_through: datetime, now: datetime) -> tuple[list[datetime], int, datetime]:
        """``(fire, skipped, through)``: the slots in (fired_through, now] that fire, how
        many older ones are skipped, and the instant up to which that settles them all
        (``now``, or an earlier slot when the walk stopped at its limit).

        A slot fires when it is at most ``catch_up`` seconds (and never less
        than ON_TIME) before ``now``.
        """
        window_start = now.timestamp() - max(self.catch_up, ON_TIME)
        fire: list[datetime] = []
        skipped = 0
        last = fired_through
        for walked, slot in enumerate(self._slots_after(fired_through)):
            if slot > now:
                break
            if walked >= SLOT_WALK_LIMIT:
                return fire, skipped, last
            if slot.timestamp() < window_start:
                skipped += 1
            else:
                fire.append(slot)
            last = slot
        return fire, skipped, now


def fire_time(event: Event) -> datetime | None:
    """The slot a cron-enqueued event was fired for (an aware UTC datetime); None for others.

    Read from the event's idempotency key, ``cron:<schedule>@<UTC instant>``::

        @router.route("report.build")
        async def build(event):
            period_end = conveyor.cron.fire_time(event)
    """
    key = event.idempotency_key
    if key is None:
        return None
    match = _KEY_RE.match(key)
    if match is None:
        return None
    return datetime.strptime(match["at"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
