"""The demo's worker side: the router of a small online shop.

``conveyor demo`` starts a real worker process with
``--app conveyor_tools.demo.app:router``. The handlers only sleep for a few
milliseconds, but some payloads carry a ``simulate`` entry that makes them
misbehave on purpose, so the demo shows each way an attempt can end:

* ``{"fail_attempts": n}``: the first ``n`` attempts raise ``ConnectionError``,
  so the event is retried with exponential backoff and then succeeds.
* ``{"busy_attempts": n}``: the first ``n`` attempts raise ``RetryAfter(1)``.
* ``{"hang_attempts": n}``: the first ``n`` attempts outlast the route's timeout.

An invoice whose payload lacks ``currency`` fails on every attempt with a
``KeyError``: that is the poison event, parked ``failed`` after its last attempt.

Real handlers must tolerate running twice (delivery is at least once); they
would dedupe on ``event.id`` or the idempotency key. These ones have no side
effects, so they need not.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from conveyor import Event, RetryAfter, Router

router = Router()

# How long the fake work of one handler call takes, in seconds.
WORK_SECONDS = (0.02, 0.15)
WEBHOOK_TIMEOUT = 1.0


def _simulate(event: Event) -> dict[str, Any]:
    payload = event.payload
    found = payload.get("simulate") if isinstance(payload, dict) else None
    return found if isinstance(found, dict) else {}


def _failing(event: Event, key: str) -> bool:
    """Whether this attempt is one the payload asked to misbehave."""
    return event.attempt <= int(_simulate(event).get(key, 0))


async def _work() -> None:
    await asyncio.sleep(random.uniform(*WORK_SECONDS))


@router.route("order.created")
async def record_order(event: Event) -> None:
    """Would update the warehouse's pick list."""
    await _work()


@router.route("email.*", timeout=10)
async def send_email(event: Event) -> None:
    """Would talk to an SMTP server, which sometimes asks us to come back later."""
    if _failing(event, "fail_attempts"):
        raise ConnectionError("SMTP 421 4.7.0 try again later")
    await _work()


@router.route("invoice.render")
def render_invoice(event: Event) -> None:
    """A plain function: the worker runs it in a thread, so blocking calls are fine."""
    if _failing(event, "busy_attempts"):
        raise RetryAfter(1.0, "PDF renderer busy, retry in 1s")
    total = sum(line["qty"] * line["unit_cents"] for line in event.payload["lines"])
    currency = event.payload["currency"]  # old producers left this out: the poison event
    time.sleep(random.uniform(*WORK_SECONDS))
    _ = f"{total / 100:.2f} {currency}"


@router.route("webhook.deliver", timeout=WEBHOOK_TIMEOUT)
async def deliver_webhook(event: Event) -> None:
    """Would POST to a partner; a hung partner is cut off by the route's timeout."""
    if _failing(event, "hang_attempts"):
        await asyncio.sleep(WEBHOOK_TIMEOUT * 10)
    await _work()


@router.route("analytics.*", blocking=False)
def track(event: Event) -> None:
    """Cheap and non-blocking, so it runs inline on the worker's event loop."""


@router.route("order.review_request")
async def ask_for_review(event: Event) -> None:
    """Scheduled a day after the order; the demo ends long before it is due."""
    await _work()
