"""The router of the cron kill test's worker processes: a one-second schedule and its no-op handler."""

from __future__ import annotations

from conveyor import Router
from conveyor.types import Event

router = Router()
# catch_up covers any moment when every worker happens to be dead at once.
router.cron("* * * * * *", "tick.second", {"from": "cron"}, name="every second", catch_up=60)


@router.route("tick.second", blocking=False)
def tick(event: Event) -> None:
    """Nothing to do: the test counts the events, not the calls."""
