"""Typed tasks: a function whose calls are enqueued as events, checked by mypy.

:meth:`Router.task <conveyor.router.Router.task>` turns a function into a
:class:`Task`. ``task.enqueue(conn, *args, **kwargs)`` takes exactly the
function's parameters (a ``ParamSpec``, so mypy and pyright check every call),
binds them to its signature at once (a wrong call raises
:class:`~conveyor.errors.InvalidInputError` before anything is written), and
writes one event on the task's topic whose payload is ``{"args": [...],
"kwargs": {...}}``, JSON-checked like any payload. The worker calls the
function with the arguments decoded. Topics and payloads stay the core: a
task is an ordinary route, and its events can be enqueued by hand too.

Example::

    router = Router()

    @router.task("email.send")
    async def send_email(to: str, subject: str, *, urgent: bool = False) -> None:
        ...

    send_email.enqueue(conn, "ada@example.com", "Welcome", urgent=True)
    send_email.using(delay=3600, tenant="acme").enqueue(conn, "bob@example.com", "Later")
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar

import psycopg

from conveyor.canvas import Step, step
from conveyor.errors import InvalidInputError
from conveyor.outcomes import PermanentFailure
from conveyor.types import Event
from conveyor.validation import check_topic

if TYPE_CHECKING:
    from conveyor.producer import Producer
    from conveyor.producer_async import AsyncProducer

P = ParamSpec("P")
R = TypeVar("R")

# The enqueue options a task passes on (Producer.enqueue's keyword arguments).
OPTIONS = ("tenant", "idempotency_key", "delay", "run_at", "priority", "max_attempts")


class Task(Generic[P, R]):
    """A function and the topic its calls are enqueued on.

    Calling the task calls the function here and now; :meth:`enqueue` and
    :meth:`aenqueue` write the call as an event in the caller's transaction.

    Args:
        fn: the function, sync or async.
        topic: an exact topic (not a pattern).
        producer: writes the events of :meth:`enqueue`. Defaults to ``Producer()``.
        async_producer: writes those of :meth:`aenqueue`. Defaults to ``AsyncProducer()``.

    The default producers are built on first use: routing (``Router.task``)
    loads no producer, and a worker that only runs the task never builds one.
    """

    def __init__(self, fn: Callable[P, R], topic: str, *, producer: Producer | None = None,
                 async_producer: AsyncProducer | None = None,
                 options: Mapping[str, Any] | None = None) -> None:
        self.fn = fn
        self.topic = check_topic(topic)
        self._producer = producer
        self._async_producer = async_producer
        self.options: dict[str, Any] = dict(options or {})
        self._signature = inspect.signature(fn)
        self.__name__ = getattr(fn, "__name__", topic)
        self.__doc__ = fn.__doc__

    @property
    def producer(self) -> Producer:
        """Writes the events of :meth:`enqueue`."""
        if self._producer is None:
            from conveyor.producer import Producer
            self._producer = Producer()
        return self._producer

    @property
    def async_producer(self) -> AsyncProducer:
        """Writes the events of :meth:`aenqueue`."""
        if self._async_producer is None:
            from conveyor.producer_async import AsyncProducer
            self._async_producer = AsyncProducer()
        return self._async_producer

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<Task {self.topic!r} {self.__name__}>"

    def using(self, *, tenant: str | None = None, idempotency_key: str | None = None,
              delay: float | None = None, run_at: datetime | None = None,
              priority: int | None = None, max_attempts: int | None = None) -> Task[P, R]:
        """The same task with enqueue options set (those not given stay as they were)."""
        given = {"tenant": tenant, "idempotency_key": idempotency_key, "delay": delay,
                 "run_at": run_at, "priority": priority, "max_attempts": max_attempts}
        options = {**self.options, **{k: v for k, v in given.items() if v is not None}}
        return Task(self.fn, self.topic, producer=self._producer,
                    async_producer=self._async_producer, options=options)

    def payload(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The event payload for a call: the arguments, checked against the signature."""
        try:
            self._signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise InvalidInputError(f"task {self.topic!r} ({self.__name__}): {exc}") from None
        return {"args": list(args), "kwargs": kwargs}

    def step(self, *args: P.args, **kwargs: P.kwargs) -> Step:
        """This call as a workflow step (:mod:`conveyor.canvas`), with the task's options."""
        options = {k: v for k, v in self.options.items() if k != "idempotency_key"}
        return step(self.topic, self.payload(*args, **kwargs), **options)

    def enqueue(self, conn: psycopg.Connection[Any], *args: P.args, **kwargs: P.kwargs) -> int:
        """Write this call as an event in ``conn``'s transaction; returns the event's id."""
        return self.producer.enqueue(conn, self.topic, self.payload(*args, **kwargs),
                                     **self.options)

    async def aenqueue(self, conn: psycopg.AsyncConnection[Any], *args: P.args,
                       **kwargs: P.kwargs) -> int:
        """:meth:`enqueue` on an async connection."""
        return await self.async_producer.enqueue(conn, self.topic, self.payload(*args, **kwargs),
                                                 **self.options)

    def arguments(self, event: Event) -> tuple[list[Any], dict[str, Any]]:
        """The call an event holds; a payload that is not one fails the event for good."""
        payload = event.payload
        if (not isinstance(payload, dict) or set(payload) != {"args", "kwargs"}
                or not isinstance(payload["args"], list) or not isinstance(payload["kwargs"], dict)):
            raise PermanentFailure(f"event {event.id} of task {self.topic!r} does not hold a call: "
                                   f"expected {{\"args\": [...], \"kwargs\": {{...}}}}, got "
                                   f"{str(payload)[:100]}")
        args, kwargs = payload["args"], payload["kwargs"]
        try:
            self._signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise PermanentFailure(f"event {event.id} does not fit task {self.topic!r} "
                                   f"({self.__name__}): {exc}") from None
        return args, kwargs

    def handler(self) -> Callable[[Event], Any]:
        """The route handler: async for an async function, plain for a plain one."""
        fn, arguments = self.fn, self.arguments
        if inspect.iscoroutinefunction(fn):
            async def run_async(event: Event) -> Any:
                args, kwargs = arguments(event)
                return await fn(*args, **kwargs)
            return run_async

        def run(event: Event) -> Any:
            args, kwargs = arguments(event)
            return fn(*args, **kwargs)
        return run
