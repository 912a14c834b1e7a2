"""The I/O-free half of run-time control: checks, records and decoders.

An operator may override a flow limit's ``max_running``, ``rate`` and
``burst``, and a cron schedule's expression, or disable a schedule, while the
workers run; every such change, and every pause and resume, leaves a row in
the audit log (migration 0023). :class:`~conveyor.admin.AsyncAdmin` and
:class:`~conveyor.admin.Admin` run the statements
(conveyor/admin_controls_async.py); this module checks their arguments and
turns the rows into :class:`LimitInfo` and :class:`AuditEntry`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo

from conveyor.errors import InvalidInputError, MissingExtraError
from conveyor.patterns import check_topic_pattern
from conveyor.validation import MAX_RUNNING_MAX, RATE_MAX, rate_per_second, show

__all__ = ["AUDIT_COLUMNS", "AUDIT_KINDS", "LIMIT_COLUMNS", "AuditEntry", "LimitInfo",
           "audit_from_row", "limit_from_row"]

ACTOR_MAX_LENGTH = 200
AUDIT_LIMIT_DEFAULT = 100
AUDIT_LIMIT_MAX = 10_000
# Every kind of audited change; a filter may name one or its family ("limit").
AUDIT_KINDS = ("pause.set", "pause.resume", "limit.set", "limit.clear", "schedule.set",
               "schedule.clear", "schedule.disable", "schedule.enable", "schedule.remove")
_FAMILIES = {kind.partition(".")[0] for kind in AUDIT_KINDS}
EXPRESSION_MAX_LENGTH = 200


@dataclass(frozen=True, slots=True)
class LimitInfo:
    """One flow limit: as the routes declare it, as an operator overrides it, and in force.

    Attributes:
        pattern: the topic pattern limited.
        max_running, rate, burst, fair_by, fifo_by: as the routes declared
            them (rate and burst in starts per second); all None for a limit
            only an operator set (no route declares the pattern).
        override_max_running, override_rate, override_burst: the operator's
            values (``Admin.set_limit``), which win until cleared; None: none.
        running: events of the pattern running now, fleet-wide.
        updated_at: when the row last changed.
    """

    pattern: str
    max_running: int | None
    rate: float | None
    burst: float | None
    fair_by: str | None
    fifo_by: str | None
    override_max_running: int | None
    override_rate: float | None
    override_burst: float | None
    running: int
    updated_at: datetime

    @property
    def declared(self) -> bool:
        """Whether a route declares the pattern (else only the override made it)."""
        return any(x is not None for x in (self.max_running, self.rate, self.fair_by,
                                           self.fifo_by))

    @property
    def overridden(self) -> bool:
        return any(x is not None for x in (self.override_max_running, self.override_rate,
                                           self.override_burst))

    @property
    def effective_max_running(self) -> int | None:
        return self.max_running if self.override_max_running is None \
            else self.override_max_running

    @property
    def effective_rate(self) -> float | None:
        return self.rate if self.override_rate is None else self.override_rate

    @property
    def effective_burst(self) -> float | None:
        return self.burst if self.override_burst is None else self.override_burst

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["updated_at"] = self.updated_at.isoformat()
        out["effective"] = {"max_running": self.effective_max_running,
                            "rate": self.effective_rate, "burst": self.effective_burst}
        out["declared"] = self.declared
        return out


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One control change, as the audit log keeps it.

    Attributes:
        id: its place in the log (newer entries have greater ids).
        at: the database's time of the change's transaction.
        actor: who made it.
        kind: one of :data:`AUDIT_KINDS`, such as ``"limit.set"``.
        target: the pattern (pauses, limits) or schedule name changed.
        reason: why, as given; None when none was.
        old, new: the control before and after (None: there was none, or it is gone).
    """

    id: int
    at: datetime
    actor: str
    kind: str
    target: str
    reason: str | None
    old: dict[str, Any] | None
    new: dict[str, Any] | None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["at"] = self.at.isoformat()
        return out


LIMIT_COLUMNS = tuple(f.name for f in fields(LimitInfo))
AUDIT_COLUMNS = tuple(f.name for f in fields(AuditEntry))


def _named(columns: tuple[str, ...], row: Sequence[Any]) -> dict[str, Any]:
    if len(row) != len(columns):
        raise ValueError(f"expected a row of {len(columns)} columns ({', '.join(columns)}),"
                         f" got {len(row)}")
    return dict(zip(columns, row, strict=True))


def limit_from_row(row: Sequence[Any]) -> LimitInfo:
    """A :class:`LimitInfo` from one ``flow_limit_list`` row (:data:`LIMIT_COLUMNS`)."""
    return LimitInfo(**_named(LIMIT_COLUMNS, row))


def audit_from_row(row: Sequence[Any]) -> AuditEntry:
    """An :class:`AuditEntry` from one ``control_audit_list`` row (:data:`AUDIT_COLUMNS`)."""
    return AuditEntry(**_named(AUDIT_COLUMNS, row))


def check_actor(actor: object) -> str | None:
    """Who makes a change: 1 to 200 printable characters, or None (the database role)."""
    if actor is None:
        return None
    if not isinstance(actor, str) or not actor.strip() or len(actor) > ACTOR_MAX_LENGTH \
            or any(ord(c) < 32 or 127 <= ord(c) < 160 for c in actor):
        raise InvalidInputError(f"expected actor to be 1 to {ACTOR_MAX_LENGTH} printable "
                                f"characters, got {show(actor)}")
    return actor


def check_max_running(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) \
            or not 1 <= value <= MAX_RUNNING_MAX:
        raise InvalidInputError(f"expected max_running to be an int from 1 to "
                                f"{MAX_RUNNING_MAX}, got {show(value)}")
    return value


def check_rate(value: object) -> float | None:
    """Starts per second from ``"10/s"``, ``"600/m"``, ``"5/10s"`` or a number; None for None."""
    if value is None:
        return None
    per_second = rate_per_second(value)
    if per_second is None:
        raise InvalidInputError(f"expected rate like '10/s', '600/m' or '5/10s', or starts per "
                                f"second (more than 0, at most {RATE_MAX:.0f}/s), got "
                                f"{show(value)}")
    return per_second


def check_burst(value: object) -> float | None:
    if value is None:
        return None
    number = float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        else math.nan
    if not (math.isfinite(number) and 1 <= number <= RATE_MAX):
        raise InvalidInputError(f"expected burst to be starts from 1 to {RATE_MAX:.0f}, "
                                f"got {show(value)}")
    return number


def limit_params(pattern: object, max_running: object, rate: object,
                 burst: object) -> dict[str, Any]:
    """flow_override_set's parameters; a rate without a burst gets one second's worth."""
    params: dict[str, Any] = {"pattern": check_topic_pattern(pattern),
                              "max_running": check_max_running(max_running),
                              "rate": check_rate(rate), "burst": check_burst(burst)}
    if params["max_running"] is None and params["rate"] is None and params["burst"] is None:
        raise InvalidInputError(f"expected max_running, rate or burst to set for "
                                f"{params['pattern']!r}, got none")
    if params["rate"] is not None and params["burst"] is None:
        params["burst"] = max(1.0, params["rate"])
    return params


def check_schedule_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise InvalidInputError(f"expected a schedule name, got {show(name)}")
    return name


def check_expression(expression: object, timezone: str, now: datetime) -> tuple[str, datetime]:
    """``(expression, next slot)``: the expression tidied, and its first slot after ``now``
    read in ``timezone``; an expression cronsim refuses raises InvalidInputError naming it."""
    if not isinstance(expression, str) or not expression.strip() \
            or len(expression) > EXPRESSION_MAX_LENGTH:
        raise InvalidInputError(f"expected a cron expression, got {show(expression)}")
    expression = " ".join(expression.split())
    try:
        from cronsim import CronSim, CronSimError
    except ImportError as exc:
        raise MissingExtraError("conveyor.cron", "cron", module="cronsim") from exc
    try:
        slot = next(iter(CronSim(expression, now.astimezone(ZoneInfo(timezone)))))
    except (CronSimError, StopIteration) as exc:
        raise InvalidInputError(f"invalid cron expression {expression!r:.60}: "
                                f"{exc or 'it never fires'}") from None
    return expression, slot.astimezone(UTC)


def next_slot(expression: str, timezone: str, now: datetime) -> datetime | None:
    """The expression's first slot after ``now``; None when cronsim is missing or refuses it
    (the workers' scheduler computes it then)."""
    try:
        return check_expression(expression, timezone, now)[1]
    except (InvalidInputError, MissingExtraError):
        return None


def audit_params(target: object, kind: object, limit: object, before: object) -> dict[str, Any]:
    """control_audit_list's parameters, each checked."""
    if target is not None and (not isinstance(target, str) or not target):
        raise InvalidInputError(f"expected a pattern or schedule name, got {show(target)}")
    if kind is not None and kind not in AUDIT_KINDS and kind not in _FAMILIES:
        raise InvalidInputError(f"expected kind to be one of {', '.join(sorted(_FAMILIES))} or "
                                f"{', '.join(AUDIT_KINDS)}, got {show(kind)}")
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= AUDIT_LIMIT_MAX:
        raise InvalidInputError(f"expected limit to be an int from 1 to {AUDIT_LIMIT_MAX}, "
                                f"got {show(limit)}")
    if before is not None and (isinstance(before, bool) or not isinstance(before, int)):
        raise InvalidInputError(f"expected before to be an audit entry id, got {show(before)}")
    return {"target": target, "kind": kind, "limit": limit, "before": before}
