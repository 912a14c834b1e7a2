"""The router of the flow-control proof's worker processes (tests/acceptance/test_flow_processes.py).

``limited.job`` may run at most FLOW_MAX_RUNNING at once fleet-wide and
takes 10 ms; ``fair.job`` takes each tenant in turn (at most 4 running);
``rate.job`` starts at most 50 a second; ``free.job`` has no limit.
"""

from __future__ import annotations

import asyncio

from conveyor import Router
from conveyor.types import Event

FLOW_MAX_RUNNING = 5

router = Router()


@router.route("limited.job", max_running=FLOW_MAX_RUNNING)
async def limited(event: Event) -> None:
    await asyncio.sleep(0.01)


@router.route("fair.job", fair_by="tenant", max_running=4)
async def fair(event: Event) -> None:
    await asyncio.sleep(0.01)


@router.route("rate.job", rate="50/s", blocking=False)
def rated(event: Event) -> None:
    """Nothing: the test reads the starts from the rows."""


@router.route("free.job", blocking=False)
def free(event: Event) -> None:
    """Nothing: the unlimited topic's drain rate is the figure."""
