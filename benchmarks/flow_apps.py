"""The router of benchmarks/flow_control.py's worker processes.

``limited.job`` runs at most LIMIT at once fleet-wide and takes 10 ms;
``free.job`` is a no-op without a limit.
"""

from __future__ import annotations

import asyncio
import os

from conveyor import Router
from conveyor.types import Event

LIMIT = int(os.environ.get("CONVEYOR_BENCH_FLOW_LIMIT", "5"))

router = Router()


@router.route("limited.job", max_running=LIMIT)
async def limited(event: Event) -> None:
    await asyncio.sleep(0.01)


@router.route("free.job", blocking=False)
def free(event: Event) -> None:
    """Nothing: the unlimited topic's drain rate is the figure."""
