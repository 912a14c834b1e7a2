"""Apps for the start-up signal tests: one slow to import, one quick with slow handlers."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from conveyor import Event, Router

MARKER_ENV = "CONVEYOR_TEST_IMPORT_MARKER"

router = Router()


async def _slow(event: Event) -> None:
    await asyncio.sleep(0.2)


router.add("startup.*", _slow)


def slow_import_router() -> Router:
    """The router of an app whose import takes seconds (a big framework, a model load)."""
    marker = os.environ.get(MARKER_ENV)
    if marker:
        Path(marker).write_text("importing")
    time.sleep(3)
    return router
