"""A worker's reactions to signals: the ``!`` notifications on its channel.

A signal (conveyor/notify.py names them) says that something a worker reads
only now and then has changed, so it looks again now rather than at its next
pass: the pauses (``!pause``), its leases (``!leases``: a running event was
cancelled), the flow limits and the cron schedules (``!control``), and the
events that wait for others (``!deps``). :class:`~conveyor.worker.wakeups.DueTimes`
calls the reactions; as with every payload, a signal can only make a worker
look sooner, never change what it finds.
"""

from __future__ import annotations

from collections.abc import Callable

from conveyor.notify import (
    CONTROL_NOTIFICATION,
    DEPENDENCIES_NOTIFICATION,
    LEASES_NOTIFICATION,
    PAUSE_NOTIFICATION,
)
from conveyor.worker.claims import Claims
from conveyor.worker.lanes import Lanes
from conveyor.worker.maintenance import Maintenance
from conveyor.worker.scheduler import Scheduler


def signal_reactions(claims: Claims, lanes: Lanes, maintenance: Maintenance,
                     scheduler: Scheduler | None) -> dict[str, Callable[[], None]]:
    """The reaction of a worker's parts to each signal, as ``DueTimes`` takes them."""

    def pauses_changed() -> None:
        claims.pauses.notified()
        lanes.bring_back_soon()   # a resume: the aside events come back

    def controls_changed() -> None:
        # An operator changed a flow limit or a schedule (Admin.set_limit, ...).
        if claims.flow.expire():
            claims.wake()
        if scheduler is not None:
            scheduler.poke()

    return {PAUSE_NOTIFICATION: pauses_changed,
            LEASES_NOTIFICATION: maintenance.check_leases_soon,
            CONTROL_NOTIFICATION: controls_changed,
            DEPENDENCIES_NOTIFICATION: maintenance.check_dependencies_soon}
