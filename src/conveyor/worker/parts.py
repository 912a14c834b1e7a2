"""A worker's parts, built and wired to one another (River's client builds its services so).

:func:`build_parts` is the worker's wiring diagram in one function: who calls
whom when a claim is made, an outcome written, a notification heard. Each part
is handed only what it needs. The wiring has one loop: the completer reports
to the accounting, which asks the maintenance (built on the completer) for the
clock offset and the due times for a retry's timer; it reaches those two
through closures, read when called, so every part is built once, complete.

What it returns, :class:`WorkerParts`, is frozen: a worker's parts are chosen
once, at its construction, and the life cycle only runs them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from conveyor.config import WorkerConfig
from conveyor.db.named_queries import Queries, queries_for
from conveyor.db.wake_gate import WakeGate
from conveyor.holder import Holder
from conveyor.middleware import Middleware
from conveyor.router import Router
from conveyor.worker.accounting import OutcomeAccounting, SettledObserver
from conveyor.worker.claims import Claims, claim_filter
from conveyor.worker.completer import Completer
from conveyor.worker.connection import ConnectionGate
from conveyor.worker.deadline import StopFlag
from conveyor.worker.executor import Executor
from conveyor.worker.failure_log import FailureLogLimiter
from conveyor.worker.flow import FlowControl
from conveyor.worker.flow_claims import FlowClaims
from conveyor.worker.lanes import Lanes
from conveyor.worker.listener import Listener
from conveyor.worker.maintenance import Maintenance
from conveyor.worker.reactions import signal_reactions
from conveyor.worker.running import RunningSet
from conveyor.worker.scheduler import Scheduler
from conveyor.worker.service import Service
from conveyor.worker.sessions import WorkerConnections
from conveyor.worker.shutdown import Shutdown
from conveyor.worker.startup import StartUp
from conveyor.worker.stats import OutcomeTally, WorkerStats
from conveyor.worker.wakeups import DueTimes, PauseState
from conveyor.worker.watchdog import LoopWatchdog


@dataclass(frozen=True, kw_only=True)
class WorkerParts:
    """Everything one worker is made of (see :class:`~conveyor.worker.worker.Worker`).

    ``stopping`` ends the claims and the services; ``closing``, set once
    nothing more will be acknowledged, the completer and the maintenance loop.
    ``services`` are those run from the start to the shutdown beside the
    maintenance loop: the flow claims, cron, then those the worker was given.
    """

    queries: Queries
    stats: WorkerStats
    tally: OutcomeTally
    failure_log: FailureLogLimiter
    stopping: StopFlag
    closing: asyncio.Event
    connections: WorkerConnections
    listens: bool
    holder: Holder
    running: RunningSet
    flow: FlowControl
    accounting: OutcomeAccounting
    completer: Completer
    executor: Executor
    claims: Claims
    flow_claims: FlowClaims
    pauses: PauseState
    lanes: Lanes
    maintenance: Maintenance
    scheduler: Scheduler | None
    due_times: DueTimes
    listener: Listener
    watchdog: LoopWatchdog
    services: list[Service]
    startup: StartUp
    shutdown: Shutdown


def build_parts(conninfo: str, router: Router, c: WorkerConfig, *, worker_id: str, name: str,
                listen_conninfo: str | None, middleware: Sequence[Middleware],
                clock: Callable[[], datetime] | None, services: Sequence[Service],
                connection_gate: ConnectionGate | None) -> WorkerParts:
    """The parts of the worker ``worker_id`` (called ``name``); the other arguments
    are :class:`~conveyor.worker.worker.Worker`'s."""
    q = queries_for(c.schema)
    claiming = claim_filter(router, c.tenants)
    stats = WorkerStats()
    tally = OutcomeTally()   # outcomes by minute and topic, for event_counts (0008)
    failure_log = FailureLogLimiter(c.failure_log_limit, c.failure_log_window)
    stopping = StopFlag()
    closing = asyncio.Event()
    connections = WorkerConnections(conninfo, c, stopping, listen_conninfo=listen_conninfo,
                                    cron=bool(router.schedules), gate=connection_gate)
    listens = c.listen and not (c.transaction_pooler is True
                                and connections.listen_target == conninfo)
    # What a handler finishing its own event (conveyor.complete) fences on.
    holder = Holder(worker_id, c.schema, result_limit=router.result_limit)
    running = RunningSet(c.concurrency, holder)
    flow = FlowControl(q, router)
    # A middleware that observes written outcomes (the metrics) is fed a batch at
    # a time by the accounting instead of running its hooks per event.
    observers = [m for m in middleware if isinstance(m, SettledObserver)]
    hooks = [m for m in middleware if not isinstance(m, SettledObserver)]
    accounting = OutcomeAccounting(
        running, stats, tally, failure_log, clock_offset=lambda: maintenance.clock_offset,
        wake_at=lambda when: due_times.wake_at(when), room_freed=flow.room_freed,
        observers=observers)
    completer = Completer(connections.ack, q, worker_id, flush_size=c.batch_size,
                          interval=c.ack_interval, query_timeout=c.query_timeout,
                          on_acked=accounting.settled, completed=holder.completed,
                          delete_succeeded=c.retention == 0)
    executor = Executor(router, running, completer.add, handler_timeout=c.handler_timeout,
                        backoff=c.backoff, threads=2 * c.concurrency, middleware=hooks,
                        timed=bool(observers))
    claims = Claims(connections, q, c, worker_id, flow, claiming, running=running,
                    executor=executor, completer=completer, stats=stats, stopping=stopping,
                    on_window_written=accounting.settled)
    flow_claims = FlowClaims(claims, c)
    lanes = Lanes(q, claiming, heartbeat_interval=c.heartbeat_interval, on_back=claims.wake)
    maintenance = Maintenance(connections.maintenance, q, c, worker_id, name, router.patterns,
                              running, completer.decided, stats, pauses=claims.pauses,
                              tally=tally, lanes=lanes)
    scheduler = None if connections.cron is None else Scheduler(
        connections.cron, q, router.schedules, query_timeout=c.query_timeout, clock=clock,
        clock_offset=lambda: maintenance.clock_offset)
    due_times = DueTimes(claims.wake, router.handles, lambda: maintenance.wake_offset,
                         signals=signal_reactions(claims, lanes, maintenance, scheduler))
    listener = Listener(connections.listen, q.channel, on_notify=due_times.notified,
                        on_connected=claims.wake, ping_interval=c.listener_ping_interval,
                        send_probe=maintenance.send_probe,
                        gate=WakeGate(q), holds_gate=lambda: not claims.hold.on_fetch)
    watchdog = LoopWatchdog.for_worker(conninfo, q, worker_id, c, executor,
                                       on_stall=stats.stalled, gate=connection_gate)
    # Stopped with the claims; the maintenance loop, with the acknowledgements.
    all_services: list[Service] = [flow_claims, *([scheduler] if scheduler else []), *services]
    startup = StartUp(connections.maintenance, c, router, maintenance=maintenance, flow=flow,
                      lanes=lanes, services=all_services, listener=listener if listens else None,
                      completer=completer, watchdog=watchdog, stopping=stopping,
                      closing=closing)
    shutdown = Shutdown(c, stopping=stopping, closing=closing, claims=claims,
                        flow_claims=flow_claims, completer=completer, maintenance=maintenance,
                        connections=connections, watchdog=watchdog, due_times=due_times,
                        executor=executor, failure_log=failure_log)
    return WorkerParts(
        queries=q, stats=stats, tally=tally, failure_log=failure_log, stopping=stopping,
        closing=closing, connections=connections, listens=listens, holder=holder,
        running=running, flow=flow, accounting=accounting, completer=completer,
        executor=executor, claims=claims, flow_claims=flow_claims, pauses=claims.pauses,
        lanes=lanes, maintenance=maintenance, scheduler=scheduler, due_times=due_times,
        listener=listener, watchdog=watchdog, services=all_services, startup=startup,
        shutdown=shutdown)
