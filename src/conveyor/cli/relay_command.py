"""``conveyor relay``: relay events into brokers until SIGTERM, or replay a window once."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import logging
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from psycopg import errors

from conveyor.admin import Admin
from conveyor.cli.context import Context, duration, moment
from conveyor.cli.options import add_command
from conveyor.cli.output import say
from conveyor.cli.process import (
    StopSignals,
    import_target,
    run_until_stopped,
    serve_until_stopped,
    tracing_middleware,
)
from conveyor.cli.worker_options import (
    add_worker_options,
    build_worker,
    refuse_without_database,
    report_exit,
)
from conveyor.errors import BrokerUnavailableError, DatabaseUnavailableError, InvalidInputError

if TYPE_CHECKING:
    from conveyor.relay import Relay
    from conveyor.relay.ordered import OrderedStream
    from conveyor.worker import Worker

Env = Callable[..., str | None]
Sub = Any  # argparse's private _SubParsersAction

log = logging.getLogger(__name__)


def register_relay(sub: Sub, env: Env) -> None:
    p = add_command(sub, "relay", "relay events into brokers until SIGTERM/SIGINT",
             "Publish the events of the topics a conveyor.relay.Relay routes (--app names\n"
             "it, or a function taking no arguments that returns one) to their brokers:\n"
             "NATS JetStream, RabbitMQ, Redis Streams. An event counts as relayed only\n"
             "once the broker confirmed it; a refusal is a failed attempt (retried with\n"
             "backoff, parked after the last); an unreachable broker puts events back\n"
             "without spending attempts. Relayed events stay for --retention, the window\n"
             "--replay can publish again (the brokers drop what they already hold within\n"
             "their deduplication window). A route in mode=\"ordered\" is one stream in\n"
             "transaction order, read by one relay process at a time (the others wait to\n"
             "take over); --batch-size and --poll-interval apply to it too. Every other\n"
             "option is conveyor worker's.",
             run_relay, examples=[
                 ("conveyor relay --app myapp.relay:relay", "relay until SIGTERM"),
                 ("conveyor relay --app myapp.relay:relay --replay --since 2h",
                  "publish again what was relayed in the last two hours, then exit"),
                 ("conveyor relay --app myapp.relay:relay --replay "
                  "--since 2031-03-30T09:00:00Z --until 2031-03-30T10:00:00Z",
                  "publish again one hour's events"),
             ])
    p.add_argument("--app", required=True, metavar="MODULE:RELAY",
                   help="the conveyor.relay.Relay to serve")
    p.add_argument("--replay", action="store_true",
                   help="publish again the relayed events that finished from --since (to "
                        "--until), oldest first, then exit; nothing is claimed")
    p.add_argument("--since", type=since, metavar="TIME",
                   help="with --replay: ISO 8601 with its offset, or a duration ago (2h, 1d)")
    p.add_argument("--until", type=moment, metavar="TIME",
                   help="with --replay: ISO 8601 with its offset (default: now)")
    add_worker_options(p, env)


def since(text: str) -> datetime.datetime:
    """argparse type: a moment, or a duration before now."""
    try:
        return moment(text)
    except argparse.ArgumentTypeError:
        pass
    try:
        ago = duration(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"invalid time {text!r}: expected ISO 8601 with an offset "
            "(2031-03-30T07:00:00Z) or a duration ago (90s, 2h, 1d)") from None
    return datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=ago)


def load_relay(spec: str) -> Relay:
    from conveyor.relay import Relay

    target = import_target(spec)
    if not isinstance(target, Relay) and callable(target) and not isinstance(target, type):
        try:
            target = target()
        except Exception as exc:  # noqa: BLE001 - any error of user code building the relay
            raise InvalidInputError(f"--app {spec!r} raised {type(exc).__name__}: {exc}") from None
    if not isinstance(target, Relay):
        raise InvalidInputError(f"--app {spec!r} is a {type(target).__name__}, not a "
                                "conveyor.relay.Relay")
    if not target.routes:
        raise InvalidInputError(f"--app {spec!r} relays no topic: add a route "
                                "(relay.route(pattern, publisher))")
    return target


class _RelayProcess:
    """The relay's publishers opened and closed around the worker serving its routes,
    which runs the ordered streams as its services, or around the streams alone."""

    def __init__(self, relay: Relay, worker: Worker | None, streams: list[OrderedStream]) -> None:
        self.relay = relay
        self.worker = worker
        self.streams = streams
        self._stop = asyncio.Event()

    def install_signal_handlers(self) -> None:
        if self.worker is not None:
            self.worker.install_signal_handlers()
            return
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)

    def request_stop(self) -> None:
        if self.worker is not None:
            self.worker.request_stop()
        self._stop.set()

    async def run(self) -> None:
        try:
            await self.relay.start()
        except BrokerUnavailableError as exc:
            # Not fatal: events wait (no attempt spent) until the broker answers.
            log.warning("a broker is unreachable at start: %s", exc,
                        extra={"action": "relay_unavailable"})
        tasks = [] if self.worker is not None else \
            [asyncio.ensure_future(stream.run(self._stop)) for stream in self.streams]
        try:
            if self.worker is not None:
                await self.worker.run()
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.relay.aclose()


def run_relay(ctx: Context, args: argparse.Namespace) -> int:
    refuse_without_database(ctx, args, "the relay")
    _keep_replayable(ctx)
    if args.replay:
        return _replay(ctx, args)
    if args.since is not None or args.until is not None:
        raise InvalidInputError("--since and --until go with --replay")
    if args.retention == 0:
        raise InvalidInputError("--retention 0 deletes each event as it is relayed: the relay "
                                "keeps them for a replay window (give a duration, or 'forever')")
    middleware = tracing_middleware(args)
    stop = StopSignals().install()
    relay = load_relay(args.app)
    streams = relay.streams(ctx.url(), schema=ctx.schema, batch_size=args.batch_size,
                            poll_interval=args.poll_interval, name=args.name or "relay")
    worker = metrics = None
    if streams and args.tenants:
        raise InvalidInputError("--tenant limits a worker's claims; an ordered stream is every "
                                "tenant's events in one order (relay ordered routes without "
                                "--tenant)")
    if not relay.claims and args.metrics_port is not None:
        # Health and readiness are the worker's; the streams' series ride along with it.
        raise InvalidInputError("--metrics-port needs a route the worker serves (unordered or "
                                "per_key); a relay of ordered routes only reports in its log "
                                "and in conveyor status")
    if relay.claims:
        built = build_worker(ctx, args, relay.router(), middleware, stop, services=streams)
        if built is None:
            return 0
        worker, metrics = built
        if metrics is not None and streams:
            from conveyor.metrics import StreamsCollector

            metrics.registry.register(StreamsCollector(streams))
    elif stop.requested:
        return 0
    process = _RelayProcess(relay, worker, streams)
    serve_until_stopped(process, stop, args.event_loop, metrics)
    if worker is not None:
        report_exit(ctx, worker)
    for stream in streams:
        log.info("ordered stream %s: %d events relayed", stream.pattern, stream.relayed,
                 extra={"action": "exit"})
    return 0


def _replay(ctx: Context, args: argparse.Namespace) -> int:
    from conveyor.db.connect import connect_async

    if args.since is None:
        raise InvalidInputError("--replay needs --since (a time, or a duration ago like 2h)")
    relay = load_relay(args.app)
    count = 0

    async def replay() -> None:
        nonlocal count
        async with relay:
            conn = await connect_async(ctx.url(), autocommit=True)
            try:
                count = await relay.replay(conn, since=args.since, until=args.until,
                                           schema=ctx.schema)
            finally:
                await conn.close()

    run_until_stopped(replay(), args.event_loop)
    say(f"replayed {count} events")
    return 0


def _keep_replayable(ctx: Context) -> None:
    """The history's partitions get the index a replay reads (0027): a queue that
    relays pays for it, one that does not never does. A role that may not create
    indexes is told, and the relay goes on (its replays read whole partitions)."""
    try:
        conn = ctx.connect()
        with conn.transaction():
            Admin(ctx.schema).set_history_replayable(conn)
    except DatabaseUnavailableError as exc:
        # The worker waits for the database; the next start makes it replayable.
        log.warning("could not make the history replayable: %s", exc,
                    extra={"action": "relay_history_deferred"})
    except errors.InsufficientPrivilege as exc:
        log.warning("a replay will read the history's partitions whole: this role may not "
                    "index them (%s); run `conveyor history --replayable` once as the "
                    "schema's owner", exc.diag.message_primary,
                    extra={"action": "relay_history_refused"})
