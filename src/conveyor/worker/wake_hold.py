"""When a worker holds the wake gate, and on which connection.

Producers wake only who holds the gate (:mod:`conveyor.db.wake_gate`). A
worker holds it while it may wait for a wake-up, and lets it go while its
claims come back full (a backlog: it claims again at once, so wake-ups
would be wasted on it):

- on its **fetch connection** (:class:`FetchHold`), the usual case: the
  fetch loop holds the slots before the claim after which it would wait,
  claims once more if it got one newly (a producer that skipped the wake-up
  there has ended), and lets them go after a full claim;
- on its **LISTEN connection**, for as long as it listens, when the fetch
  connection cannot keep a session's lock (it goes through a transaction
  pooler) or the claims run in windows
  (``claim_window``): :attr:`FetchHold.on_fetch` says which; the listener
  (worker/listener.py) asks.

A worker with flow limits never lets the gate go: its flow claims
(worker/flow_claims.py) may wait for a wake-up while its plain claims are
full.
"""

from __future__ import annotations

import logging

import psycopg

from conveyor.db.named_queries import Queries
from conveyor.db.wake_gate import WakeGate
from conveyor.worker.connection import RECOVERABLE_ERRORS, ManagedConnection, StopRequested
from conveyor.worker.deadline import with_deadline
from conveyor.worker.flow import FlowControl

log = logging.getLogger(__name__)


class FetchHold:
    """The fetch loop's hold on the wake gate.

    ``enabled``: whether the worker listens and claims without windows; when
    not, :attr:`on_fetch` is always False.
    """

    def __init__(self, queries: Queries, fetch: ManagedConnection, flow: FlowControl, *,
                 enabled: bool, query_timeout: float) -> None:
        self.gate = WakeGate(queries)
        self._fetch = fetch
        self._flow = flow
        self._enabled = enabled
        self._timeout = query_timeout

    @property
    def on_fetch(self) -> bool:
        """Whether the fetch connection holds the gate for this worker (else its
        LISTEN connection does). Before its first connect it is taken to reach
        PostgreSQL directly, as nearly always: a pooler found then moves the
        hold to the LISTEN connection at that one's next round (within
        ``listener_ping_interval``), and until then this worker's wake-ups may
        wait for the poll."""
        return self._enabled and self._fetch.pooled is not True

    async def before_wait(self) -> bool:
        """Hold the gate before the worker waits; whether a slot was newly held (then
        claim again before waiting). Errors are left to the next claim."""
        if not self.on_fetch:
            return False
        try:
            conn = await self._fetch.get()
            gained = await with_deadline(conn, self.gate.hold(conn), self._timeout)
        except StopRequested:
            return False
        except RECOVERABLE_ERRORS:
            return False     # the claim that follows the wait reconnects
        except psycopg.Error as exc:
            # Waiting without the gate only makes this worker's wake-ups wait for the poll.
            log.warning("could not hold the wake gate: %s", exc, extra={"action": "wake_gate_failed"})
            return False
        if gained:
            # The flow claims wait for wake-ups too: what they missed is claimable.
            self._flow.poke()
        return gained

    async def after_full_claim(self) -> None:
        """Let the gate go: the next claim follows at once, no wake-up needed."""
        if not self.gate.held or self._flow.active:
            return
        try:
            conn = await self._fetch.get()
            await with_deadline(conn, self.gate.release(conn), self._timeout)
        except StopRequested:
            pass
        except RECOVERABLE_ERRORS:
            pass     # a lost session holds nothing
        except psycopg.Error as exc:
            # Held on, producers keep waking this worker: the cost of before, nothing lost.
            log.warning("could not let the wake gate go: %s", exc,
                        extra={"action": "wake_gate_failed"})

    def wait_at_most(self, poll: float) -> float:
        """The wait before the next claim: ``poll``, or sooner while a slot is missing."""
        return self.gate.retry_in(poll) if self.on_fetch else poll
