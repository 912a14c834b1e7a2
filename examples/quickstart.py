"""A minimal Conveyor app: one router with two handlers.

Run a worker for it with::

    conveyor worker --app examples.quickstart:router
"""

from __future__ import annotations

import logging

from conveyor import Event, PermanentFailure, Router

log = logging.getLogger("quickstart")
router = Router()


@router.route("email.send", timeout=30)
async def send_email(event: Event) -> None:
    to = event.payload.get("to")
    if not to:
        raise PermanentFailure("payload has no 'to' address")
    log.info("would send an email to %s (event %s)", to, event.id)


@router.route("billing.*")
def bill(event: Event) -> None:
    # A plain function runs in a thread, so blocking calls are fine here.
    log.info("billing %s for tenant %s", event.topic, event.tenant)
