"""Flow control of a route: a global concurrency limit, a rate limit, tenant fairness.

Declared on a route and enforced in the claim, so it holds across every
worker on every machine::

    router.add("report.render", render, max_running=4)        # at most 4 running, fleet-wide
    router.add("sms.send", send_sms, rate="10/s")             # at most 10 starts a second
    router.add("export.*", export, fair_by="tenant")          # no tenant starves another
    router.add("ledger.*", post, fifo_by="tenant")            # one tenant's events in order, one at a time

This module is the I/O-free half (the definitions, rate parsing); the claim
that enforces them is :mod:`conveyor.worker.flow`. See docs/flow-control.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from conveyor.errors import ConfigError
from conveyor.validation import MAX_RUNNING_MAX, rate_per_second

__all__ = ["FAIR_BY", "MAX_RUNNING_MAX", "FlowLimit", "parse_rate"]

# fifo_by: "tenant", or "payload." and a path of object keys (at most FIFO_PATH_MAX).
FIFO_PATH_MAX = 8
_FIFO_KEY_RE = re.compile(r"[^.\s]{1,100}")

FAIR_BY = ("tenant",)


def parse_rate(rate: object, pattern: str) -> float:
    """Starts per second from ``"10/s"``, ``"600/m"``, ``"5/10s"``, ``"1000/h"``; ConfigError otherwise."""
    per_second = rate_per_second(rate) if isinstance(rate, str) else None
    if per_second is None:
        raise ConfigError(f"expected rate for {pattern!r} like '10/s', '600/m' or '5/10s' "
                          f"(more than 0, at most 1000000/s), got {rate!r:.60}")
    return per_second


@dataclass(frozen=True, slots=True)
class FlowLimit:
    """A route's flow control, as the workers declare it in the database.

    Attributes:
        pattern: the route's topic pattern.
        max_running: events of the pattern running at once, across all workers; None: no limit.
        rate: starts per second (every attempt counts); None: no limit.
        burst: starts allowed at once after an idle spell: one second's worth
            of ``rate``, at least 1.
        fair_by: ``"tenant"`` to take the events of each tenant in turn; None:
            oldest first, as every other route.
        fifo_by: ``"tenant"`` or ``"payload.<key>[.<key>...]"``: the events of
            one key run one at a time, in order (higher priority first, then
            as enqueued; one enqueued with a delay takes its place when due);
            a retried event holds its key until it succeeds or is parked.
            None: no order between events.
    """

    pattern: str
    max_running: int | None
    rate: float | None
    fair_by: str | None
    fifo_by: str | None = None

    @property
    def burst(self) -> float | None:
        return None if self.rate is None else max(1.0, self.rate)

    @property
    def fifo_params(self) -> dict[str, object]:
        """The key of the fifo claim: ``fifo_tenant`` or the payload's ``fifo_path``."""
        assert self.fifo_by is not None
        if self.fifo_by == "tenant":
            return {"fifo_tenant": True, "fifo_path": []}
        return {"fifo_tenant": False, "fifo_path": self.fifo_by.split(".")[1:]}

    @classmethod
    def define(cls, pattern: str, max_running: object, rate: object,
               fair_by: object, fifo_by: object = None) -> FlowLimit | None:
        """The route's limit, None when it has none; a bad value raises ConfigError naming it."""
        if max_running is None and rate is None and fair_by is None and fifo_by is None:
            return None
        if fifo_by is not None:
            path = fifo_by.split(".") if isinstance(fifo_by, str) else []
            if not (fifo_by == "tenant" or (
                    len(path) >= 2 and path[0] == "payload" and len(path) - 1 <= FIFO_PATH_MAX
                    and all(_FIFO_KEY_RE.fullmatch(key) for key in path[1:]))):
                raise ConfigError(f"expected fifo_by for {pattern!r} to be 'tenant' or "
                                  f"'payload.<key>' (keys of the payload's objects, dotted, at "
                                  f"most {FIFO_PATH_MAX}), got {fifo_by!r:.60}")
            if fair_by is not None:
                raise ConfigError(f"fair_by and fifo_by for {pattern!r} do not go together: "
                                  "fifo_by already runs one event per key at a time")
        if max_running is not None and (
                isinstance(max_running, bool) or not isinstance(max_running, int)
                or not 1 <= max_running <= MAX_RUNNING_MAX):
            raise ConfigError(f"expected max_running for {pattern!r} to be an int from 1 to "
                              f"{MAX_RUNNING_MAX}, got {max_running!r:.60}")
        if fair_by is not None and fair_by not in FAIR_BY:
            raise ConfigError(f"expected fair_by for {pattern!r} to be one of "
                              f"{', '.join(map(repr, FAIR_BY))}, got {fair_by!r:.60}")
        per_second = None if rate is None else parse_rate(rate, pattern)
        return cls(pattern, max_running, per_second, fair_by,
                   fifo_by if isinstance(fifo_by, str) else None)
