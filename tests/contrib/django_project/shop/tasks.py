"""Django tasks the tests enqueue through ConveyorBackend."""

from __future__ import annotations

from django_tasks import task

from shop.models import Order


class Declined(Exception):
    """A business error with a module path of its own."""


@task()
def add(a: int, b: int) -> dict[str, int]:
    return {"sum": a + b, "orders": Order.objects.count()}


@task(priority=10, queue_name="emails")
def send_receipt(order_id: int) -> str:
    return f"receipt for {order_id}"


@task()
def decline(reason: str) -> None:
    raise Declined(reason)


@task(takes_context=True)
def which_attempt(context, label: str) -> dict[str, object]:  # type: ignore[no-untyped-def]
    return {"label": label, "attempt": context.attempt, "id": context.task_result.id}


@task()
async def async_double(n: int) -> int:
    return n * 2
