"""The relay's core: routes of topics to publishers, one handler per route, replay.

A relay is a set of routes on a :class:`~conveyor.Router`: each claimed event
of a relayed topic becomes one :class:`RelayMessage`, which the route's
publisher sends and the broker confirms before the handler returns. So the
worker's machinery is the relay's: claims with leases and fencing, retries
with backoff, attempts and parking, NOTIFY wake-ups, graceful drain on
SIGTERM, metrics and status. An event counts as relayed (``succeeded``) only
after the broker's confirmation, and stays in the table for the worker's
``retention``, the replay window (:meth:`Relay.replay`).

A broker that cannot be reached (or does not confirm in time) is not the
event's fault: the handler snoozes the event (no attempt spent, the error in
the log) for a delay that doubles while the broker stays away, so an outage
delays events and never parks them. A broker that answers and refuses
(no stream for the subject, an unroutable message, a message over its size
limit, an error reply) fails the attempt, retried with the route's backoff and
parked after the last; the other messages of the claim go on. A row whose
tenant or topic the producer would refuse (written by plain SQL) is parked
before a destination is rendered from it.
"""

from __future__ import annotations

import logging
import string
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from conveyor.db.named_queries import queries_for
from conveyor.errors import BrokerUnavailableError, ConfigError, InvalidInputError
from conveyor.flow import FlowLimit
from conveyor.outcomes import PermanentFailure, Snooze
from conveyor.patterns import TopicPattern, check_topic_pattern, sql_params
from conveyor.relay.messages import MODES as MODES
from conveyor.relay.messages import NO_TENANT as NO_TENANT
from conveyor.relay.messages import Publisher as Publisher
from conveyor.relay.messages import RelayMessage as RelayMessage
from conveyor.relay.messages import RelayRoute as RelayRoute
from conveyor.retry import BackoffPolicy
from conveyor.router import Router
from conveyor.types import Event
from conveyor.validation import check_tenant, check_topic

if TYPE_CHECKING:
    import psycopg

    from conveyor.relay.ordered import OrderedStream

log = logging.getLogger(__name__)

# The fields a destination template may name.
TEMPLATE_FIELDS = frozenset({"topic", "tenant"})

# Backoff while the broker cannot be reached: 1 s, doubling, at most 30 s.
UNAVAILABLE_BACKOFF = BackoffPolicy(base_delay=1.0, factor=2.0, max_delay=30.0, jitter=0.2)

# Events read per statement by Relay.replay.
REPLAY_BATCH = 500
# Relay.replay reads its window a slice of finish times at a time, so each
# statement reads a few of the history's block ranges (0027), not the window
# to its end: the first slice a minute long, twice as long after each slice
# that held less than half a batch (a quiet stretch goes by in a few reads).
REPLAY_FIRST_SLICE = timedelta(minutes=1)


# The most seconds a publisher waits for its broker's confirmation.
TIMEOUT_MAX = 300.0


def seconds(name: str, value: object, *, least: float, most: float) -> float:
    """A publisher's setting in seconds, or ConfigError naming it (bools and NaN refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not (least < value <= most if least == 0 else least <= value <= most):
        raise ConfigError(f"expected {name} to be seconds from {least:.0f} to {most:.0f}, "
                          f"got {value!r:.60}")
    return float(value)


def error_text(exc: BaseException) -> str:
    """A broker client's exception as a publisher's error text: its message, or its
    class name when it has none (several of them are raised bare)."""
    return str(exc) or type(exc).__name__


def _template_fields(template: str, pattern: str) -> None:
    try:
        names = {name for _, name, spec, conv in string.Formatter().parse(template)
                 if name is not None}
    except ValueError as exc:
        raise ConfigError(f"expected destination for {pattern!r} to be a template like "
                          f"'events.{{topic}}', got {template!r}: {exc}") from None
    unknown = names - TEMPLATE_FIELDS
    if unknown or not template:
        raise ConfigError(f"expected destination for {pattern!r} to name only {{topic}} and "
                          f"{{tenant}}, got {template!r}")


@dataclass
class _Unavailable:
    """How long to snooze while a publisher's broker stays away.

    The wait doubles per round of retries, not per event: every publish in
    flight fails at once when a broker goes away (or fills up), and counting
    each as a step would send them all to the longest wait after one outage.
    """

    failures: int = 0
    delay: float = 0.0
    until: float = 0.0      # monotonic time the current round's wait ends

    def next_delay(self) -> float:
        now = time.monotonic()
        if now >= self.until:
            self.failures += 1
            self.delay = UNAVAILABLE_BACKOFF.delay(self.failures)
            self.until = now + self.delay
        return self.delay

    def reset(self) -> None:
        """The broker answered: the next outage starts from the shortest wait."""
        self.failures, self.until = 0, 0.0


@dataclass
class Relay:
    """Routes of topic patterns to publishers; attach them to a router a worker serves.

    ``msg_id_prefix`` goes before the event id in every deduplication id: give
    each database (or schema) relaying into the same broker its own.

    Example::

        relay = Relay()
        relay.route("order.*", NatsPublisher("nats://127.0.0.1:4222", stream="ORDERS",
                                             subjects=["orders.>"]),
                    destination="orders.{tenant}.{topic}")
        router = relay.router()
        # conveyor relay --app myapp.relay:relay  (or: conveyor worker --app myapp.relay:router)
    """

    msg_id_prefix: str = ""
    routes: list[RelayRoute] = field(default_factory=list)
    _unavailable: dict[int, _Unavailable] = field(default_factory=dict, repr=False)

    def route(self, pattern: str, publisher: Publisher, *, destination: str = "{topic}",
              mode: str = "unordered", key: str = "tenant") -> None:
        """Relay the events of ``pattern`` (an exact topic, ``prefix.*`` or ``*``) to ``publisher``.

        ``destination``: the subject, routing key or stream key, a template over
        ``{topic}`` and ``{tenant}`` (``-`` for an event without one).
        ``mode``: ``"unordered"`` (the default: as many publishes in flight as
        the worker runs handlers), ``"per_key"``: the events of one ``key``
        (``"tenant"`` or ``"payload.<field>"``) are published one at a time, in
        order, keys side by side (the route's ``fifo_by``, docs/flow-control.md),
        or ``"ordered"``: one stream of all the route's events, one at a time in
        the order of the transactions that wrote them, read by one relay at a
        time (:class:`~conveyor.relay.ordered.OrderedStream`). An ordered route
        may not overlap another route of the relay (the worker would claim its
        events).
        """
        check_topic_pattern(pattern)
        if mode not in MODES:
            raise ConfigError(f"expected mode for {pattern!r} to be one of "
                              f"{', '.join(map(repr, MODES))}, got {mode!r:.60}")
        if not isinstance(publisher, Publisher):
            raise ConfigError(f"expected a publisher for {pattern!r} (NatsPublisher, "
                              f"RabbitMQPublisher, RedisStreamPublisher or one of your own), "
                              f"got {publisher!r}")
        _template_fields(destination, pattern)
        if any(r.pattern == pattern for r in self.routes):
            raise ConfigError(f"pattern {pattern!r} is relayed twice")
        ordered = mode == "ordered"
        for r in self.routes:
            if (ordered or r.ordered) and TopicPattern(r.pattern).overlaps(TopicPattern(pattern)):
                raise ConfigError(f"pattern {pattern!r} overlaps {r.pattern!r}, and an ordered "
                                  "route must have its topics to itself")
        fifo_by = key if mode == "per_key" else None
        if fifo_by is not None:
            FlowLimit.define(pattern, None, None, None, fifo_by)   # a bad key fails here
        self.routes.append(RelayRoute(pattern, publisher, destination, fifo_by, ordered))

    def attach(self, router: Router, **route_options: Any) -> None:
        """Add one route per unordered or per-key relay route to ``router``
        (``route_options``: Router.add's); ordered routes are read by :meth:`streams`."""
        for r in self.routes:
            if r.ordered:
                continue
            if callable(getattr(r.publisher, "publish_many", None)):
                router.add(r.pattern, self._batch_handler(r), fifo_by=r.fifo_by, batch=True,
                           **route_options)
            else:
                router.add(r.pattern, self._handler(r), fifo_by=r.fifo_by, **route_options)

    @property
    def claims(self) -> bool:
        """Whether a worker serves some of the routes (any that is not ordered)."""
        return any(not r.ordered for r in self.routes)

    def streams(self, conninfo: str, *, schema: str = "conveyor", batch_size: int = 100,
                poll_interval: float = 1.0, name: str = "relay") -> list[OrderedStream]:
        """One :class:`~conveyor.relay.ordered.OrderedStream` per ordered route; run each
        (``await stream.run()``) beside the worker serving :meth:`router`."""
        from conveyor.relay.ordered import OrderedStream

        return [OrderedStream(self, r, conninfo, schema=schema, batch_size=batch_size,
                              poll_interval=poll_interval, name=name)
                for r in self.routes if r.ordered]

    def router(self, **route_options: Any) -> Router:
        """A new router with the relay's routes."""
        router = Router()
        self.attach(router, **route_options)
        return router

    @property
    def publishers(self) -> list[Publisher]:
        seen: dict[int, Publisher] = {}
        for r in self.routes:
            seen.setdefault(id(r.publisher), r.publisher)
        return list(seen.values())

    async def start(self) -> None:
        """Connect every publisher and check its broker (stream, exchange): fail fast."""
        for publisher in self.publishers:
            await publisher.start()

    async def aclose(self) -> None:
        for publisher in self.publishers:
            try:
                await publisher.aclose()
            except Exception as exc:  # noqa: BLE001 - closing is best effort, each in turn
                log.warning("closing %s failed: %s", publisher.name, exc)

    async def __aenter__(self) -> Relay:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def message(self, route: RelayRoute, event: Event) -> RelayMessage:
        """The message of ``event`` on ``route``; PermanentFailure if its destination is unusable."""
        try:
            # The producer's checks again: a row written by plain SQL has had only
            # the table's, and a tenant like 'globex.order' would put the event
            # into another tenant's subjects ('events.{tenant}.{topic}').
            check_topic(event.topic)
            check_tenant(event.tenant)
        except InvalidInputError as exc:
            raise PermanentFailure(f"cannot relay event {event.id}: {exc}") from None
        tenant = event.tenant
        destination = route.destination.format(topic=event.topic,
                                               tenant=NO_TENANT if tenant is None else tenant)
        problem = route.publisher.check_destination(destination)
        if problem is not None:
            raise PermanentFailure(f"cannot relay to {route.publisher.name}: {problem}")
        headers = {"conveyor-event-id": str(event.id), "conveyor-topic": event.topic,
                   "conveyor-attempt": str(event.attempt)}
        if tenant is not None:
            headers["conveyor-tenant"] = tenant
        if event.traceparent is not None:
            headers["traceparent"] = event.traceparent
            if event.tracestate:
                headers["tracestate"] = event.tracestate
        return RelayMessage(event.id, f"{self.msg_id_prefix}{event.id}", event.topic, tenant,
                            event.attempt, destination, event.payload_text.encode(), headers)

    def _handler(self, route: RelayRoute) -> Callable[[Event], Any]:
        publisher = route.publisher
        state = self._unavailable.setdefault(id(publisher), _Unavailable())

        async def relay(event: Event) -> None:
            message = self.message(route, event)
            try:
                await publisher.publish(message)
            except BrokerUnavailableError as exc:
                delay = state.next_delay()
                log.warning("%s unavailable, event %d back in %.1fs: %s", publisher.name,
                            event.id, delay, exc, extra={"action": "relay_unavailable"})
                raise Snooze(delay, exc) from exc
            state.reset()

        relay.__qualname__ = f"relay to {publisher.name}"
        return relay

    def _batch_handler(self, route: RelayRoute) -> Callable[[list[Event]], Any]:
        """The route's events of one claim published together (``publish_many``)."""
        publisher = route.publisher
        publish_many = publisher.publish_many  # type: ignore[attr-defined]
        state = self._unavailable.setdefault(id(publisher), _Unavailable())

        async def relay(events: list[Event]) -> list[BaseException | None]:
            results: list[BaseException | None] = [None] * len(events)
            messages, places = [], []
            for i, event in enumerate(events):
                try:
                    messages.append(self.message(route, event))
                    places.append(i)
                except PermanentFailure as exc:
                    results[i] = exc
            try:
                failed = await publish_many(messages) if messages else []
            except BrokerUnavailableError as exc:
                failed = [exc] * len(messages)
            away = None
            for i, error in zip(places, failed, strict=True):
                if isinstance(error, BrokerUnavailableError):
                    away = error
                    results[i] = Snooze(state.next_delay(), error)
                else:
                    results[i] = error
            if away is not None:
                log.warning("%s unavailable, %d events back in %.1fs: %s", publisher.name,
                            sum(isinstance(r, Snooze) for r in results), state.delay, away,
                            extra={"action": "relay_unavailable"})
            elif messages:
                state.reset()
            return results

        relay.__qualname__ = f"relay to {publisher.name}"
        return relay

    async def replay(self, conn: psycopg.AsyncConnection[Any], *, since: datetime,
                     until: datetime | None = None, schema: str = "conveyor") -> int:
        """Publish again every relayed event of the relay's topics that finished from
        ``since`` (to ``until``), oldest first; returns how many.

        The same deduplication ids as the first time: within the broker's
        deduplication window a replay adds nothing, beyond it each event once
        more. Rows are read in batches; nothing is written to the table.
        """
        for value, name in ((since, "since"), (until, "until")):
            if value is not None and (not isinstance(value, datetime) or value.tzinfo is None):
                raise InvalidInputError(f"expected {name} to be a timezone-aware datetime, "
                                        f"got {value!r}")
        count = 0
        async for route, event in self._replayed(conn, since, until, schema):
            try:
                message = self.message(route, event)
            except PermanentFailure as exc:
                # Relayed before its tenant or topic was checked here: not again.
                log.warning("replay skips event %d: %s", event.id, exc,
                            extra={"action": "relay_replay_skipped", "event_id": event.id})
                continue
            await route.publisher.publish(message)
            count += 1
        return count

    async def _replayed(self, conn: psycopg.AsyncConnection[Any], since: datetime,
                        until: datetime | None, schema: str
                        ) -> AsyncIterator[tuple[RelayRoute, Event]]:
        q = queries_for(schema)
        if until is None:
            # The events finished by now: those finishing while it runs are not replayed.
            row = await (await conn.execute(q["clock_now"])).fetchone()
            until = datetime.fromtimestamp(float(row[0]) if row else time.time(), UTC)
        after_at, after_id = since, 0
        params = {**sql_params(r.pattern for r in self.routes), "limit": REPLAY_BATCH}
        router = Router()
        by_handler: dict[int, RelayRoute] = {}
        for r in self.routes:
            route = router.add(r.pattern, _no_op)
            by_handler[id(route)] = r
        span = REPLAY_FIRST_SLICE
        while after_at < until:
            before = min(until, after_at + span)
            cur = await conn.execute(q["relay_replay"], {**params, "after_at": after_at,
                                                          "after_id": after_id,
                                                          "before": before})
            rows = await cur.fetchall()
            for (id_, tenant, topic, payload, attempts, traceparent, tracestate,
                 finished_at) in rows:
                # The cursor moves past every row read, routed or not, so a batch
                # can never be read again.
                after_at, after_id = finished_at, id_
                found = router.resolve(topic)
                if found is None:
                    continue
                yield by_handler[id(found)], Event(
                    id=id_, topic=topic, payload_text=payload, tenant=tenant, attempt=attempts,
                    traceparent=traceparent, tracestate=tracestate)
            if len(rows) < REPLAY_BATCH:
                # The slice is read: the next starts where it ended.
                after_at, after_id = before, 0
                if len(rows) < REPLAY_BATCH // 2:
                    span *= 2


def _no_op(event: Event) -> None:
    """Stands in for the relay handler while replay resolves topics to routes."""
