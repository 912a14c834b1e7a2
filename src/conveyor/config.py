"""Configuration: frozen keyword-only dataclasses with documented defaults.

The library never reads environment variables; the CLI maps ``CONVEYOR_*``
variables and flags onto these classes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from conveyor.errors import ConfigError, InvalidInputError
from conveyor.retry import BackoffPolicy, RetryPolicy
from conveyor.validation import check_schema_name, check_tenant

SCHEMA_DEFAULT = "conveyor"
MAX_PAYLOAD_BYTES_DEFAULT = 256 * 1024
MAX_PAYLOAD_DEPTH_DEFAULT = 64
MAX_ATTEMPTS_DEFAULT = 5

CONCURRENCY_DEFAULT = 200
BATCH_SIZE_DEFAULT = 100
POLL_INTERVAL_DEFAULT = 5.0
LEASE_TTL_DEFAULT = 15.0
HEARTBEAT_INTERVAL_DEFAULT = 5.0
RESCUE_INTERVAL_DEFAULT = 5.0
SHUTDOWN_TIMEOUT_DEFAULT = 20.0
HANDLER_TIMEOUT_DEFAULT = 300.0
RECONNECT_MIN_DEFAULT = 2.0
RECONNECT_MAX_DEFAULT = 30.0
ACK_INTERVAL_DEFAULT = 0.005
LISTENER_PING_INTERVAL_DEFAULT = 10.0
RETENTION_DEFAULT = 7 * 24 * 3600.0
QUERY_TIMEOUT_DEFAULT = 30.0
HORIZON_ALERT_DEFAULT = 120.0
# Failure log lines per topic and outcome, and the window they are counted in.
FAILURE_LOG_LIMIT_DEFAULT = 10
FAILURE_LOG_WINDOW_DEFAULT = 60.0


# Allowed ranges, checked on creation: (lowest, highest). No real deployment
# comes near the upper ends; they exist so that a typo (1e300, "999999999999d")
# is refused here instead of failing at run time. They keep every value inside
# what consumes it: PostgreSQL's integer (claim sizes) and interval arithmetic
# on timestamptz (leases, retention), statement_timeout (an int of
# milliseconds: 24.8 days at most), and Python's timers and thread waits
# (threading.TIMEOUT_MAX). The lower ends keep a worker from spinning: a lease
# shorter than a round trip, or a poll every microsecond, is a typo too.
_DAY = 86_400.0
WORKER_RANGES: dict[str, tuple[float, float]] = {
    # A thread per slot (twice that at most) and one claim of up to this many rows.
    "concurrency": (1, 10_000),
    "batch_size": (1, 10_000),
    "max_batch_size": (1, 10_000),
    "poll_interval": (0.01, _DAY),
    "lease_ttl": (0.1, 7 * _DAY),
    "heartbeat_interval": (0.01, _DAY),
    "rescue_interval": (0.01, _DAY),
    "shutdown_timeout": (0.01, _DAY),
    "handler_timeout": (0.01, 7 * _DAY),
    "reconnect_min": (0.01, 3_600.0),
    "reconnect_max": (0.01, _DAY),
    # Finished events wait this long unacknowledged, their leases running, and a
    # stop waits it out: it is a batching window, not a schedule.
    "ack_interval": (0.0001, 1.0),
    # A window holds its rows' locks and a snapshot in an open transaction: a
    # long one holds back vacuum and keeps an operator's cancel waiting.
    "claim_window": (0.0, 10.0),
    "listener_ping_interval": (0.1, _DAY),
    "retention": (0.0, 3650 * _DAY),
    "query_timeout": (0.1, _DAY),
    "horizon_alert_after": (0.1, 7 * _DAY),
    "failure_log_limit": (1, 1_000_000),
    "failure_log_window": (1.0, _DAY),
}
PRODUCER_RANGES: dict[str, tuple[float, float]] = {
    # jsonb refuses values past 255 MiB; a claim reads a batch of payloads at once.
    "max_payload_bytes": (1, 64 * 1024 * 1024),
    # Python's json encoder and decoder recurse once per level (limit about 1000).
    "max_payload_depth": (1, 500),
    "max_attempts": (1, 1000),
}
_COUNTS = frozenset({"concurrency", "batch_size", "max_batch_size", "max_payload_bytes", "max_payload_depth",
                     "max_attempts", "failure_log_limit"})


def _seconds_text(seconds: float) -> str:
    """``0.1s``, ``60s``, ``1h``, ``7d``: a range end as a duration flag would spell it."""
    for unit, size in (("d", _DAY), ("h", 3_600.0)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def _check_range(name: str, value: object, ranges: dict[str, tuple[float, float]]) -> None:
    low, high = ranges[name]
    if name in _COUNTS:
        span = f"between {low} and {high}"
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"expected {name} to be an integer {span}, got {value!r}")
    else:
        span = f"between {_seconds_text(low)} and {_seconds_text(high)}"
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"expected {name} to be a number of seconds {span}, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(
                f"expected {name} to be a finite number of seconds {span}, got {value!r}")
    if not low <= value <= high:
        raise ConfigError(f"expected {name} to be {span}, got {value!r}")


def _schema(value: str) -> None:
    try:
        check_schema_name(value)
    except InvalidInputError as exc:
        raise ConfigError(str(exc)) from None


@dataclass(frozen=True, kw_only=True, slots=True)
class ProducerConfig:
    """How events are written.

    Every number is checked on creation against :data:`PRODUCER_RANGES`; a
    value outside raises :class:`~conveyor.errors.ConfigError` naming the range.

    Attributes:
        schema: PostgreSQL schema holding Conveyor's tables. Defaults to ``"conveyor"``.
        max_payload_bytes: largest accepted payload, in bytes of compact UTF-8 JSON.
            Defaults to 262144 (256 KiB).
        max_payload_depth: deepest accepted nesting of objects and arrays. Defaults to 64.
        max_attempts: attempts an event gets unless the call says otherwise. Defaults to 5.
    """

    schema: str = SCHEMA_DEFAULT
    max_payload_bytes: int = MAX_PAYLOAD_BYTES_DEFAULT
    max_payload_depth: int = MAX_PAYLOAD_DEPTH_DEFAULT
    max_attempts: int = MAX_ATTEMPTS_DEFAULT

    def __post_init__(self) -> None:
        _schema(self.schema)
        for name in PRODUCER_RANGES:
            _check_range(name, getattr(self, name), PRODUCER_RANGES)


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerConfig:
    """How a worker claims, runs and acknowledges events.

    Every number is checked on creation against :data:`WORKER_RANGES`; a value
    outside (NaN, infinity, ``lease_ttl=1e300``) raises
    :class:`~conveyor.errors.ConfigError` naming the range.

    Attributes:
        schema: PostgreSQL schema holding Conveyor's tables. Defaults to ``"conveyor"``.
        name: a label shown in ``conveyor status``. Defaults to ``"<host>:<pid>"``.
        concurrency: handlers running at once; the worker never claims more events
            than it has free slots; a slot is held until the result is acknowledged,
            so twice the batch size keeps claims and acknowledgements overlapping.
            Defaults to 200.
        batch_size: events claimed by one query while the worker keeps up: the
            first claim after a wake-up, and the acknowledgement batch that is
            written at once. Defaults to 100.
        max_batch_size: most events claimed by one query. While a backlog makes
            claims come back full, each claim asks for up to twice as many as the
            last, up to the free slots and this; the first short claim goes back
            to ``batch_size``. ``None``: up to half of ``concurrency`` (at least
            ``batch_size``), so that the next claim is on its way while a batch
            runs and is acknowledged. Set it to ``batch_size`` to keep every
            claim at that size. Defaults to ``None``.
        poll_interval: seconds between fallback polls when no NOTIFY arrives
            (jittered by up to 10 %). Defaults to 5.0.
        lease_ttl: seconds a claim stays valid without a heartbeat; an event whose
            worker died runs again at most ``lease_ttl + rescue_interval`` seconds
            later. Defaults to 15.0.
        heartbeat_interval: seconds between lease renewals. Defaults to 5.0.
        rescue_interval: seconds between scans for expired leases. Defaults to 5.0.
        shutdown_timeout: seconds running handlers get to finish after SIGTERM before
            their events are handed back. Defaults to 20.0.
        handler_timeout: seconds one handler call may take unless its route says
            otherwise. Defaults to 300.0.
        reconnect_min: first delay before reconnecting to a lost database. Defaults to 2.0.
        reconnect_max: largest delay between reconnection attempts. Defaults to 30.0.
        ack_interval: seconds finished events may wait to be acknowledged together.
            Defaults to 0.005.
        claim_window: seconds a claimed batch may stay in the claim's transaction,
            its rows locked rather than leased, so that the outcomes of its fast
            events are written in that transaction: each is written once instead
            of twice (claim and acknowledgement). When every event of the batch
            has its outcome, or when the window ends, the transaction writes the
            outcomes and leases the events still running, which then run on as
            leased events. While a window is open its events read ``pending``
            and another worker's claims skip them; a handler that calls
            :func:`conveyor.complete` waits for the window to end. ``0`` claims
            with leases only. Claims under flow limits are leased either way
            (docs/held-claims.md). Defaults to 0.
        listener_ping_interval: seconds of silence after which the LISTEN connection is
            checked, so a half-open connection is replaced
            (within interval + 4 s ping timeout + reconnect: about 15 s by default). Defaults to 10.0.
        retention: seconds succeeded and cancelled events are kept before the worker
            prunes them; ``None`` keeps them forever; ``0`` deletes each succeeded
            event as its success is acknowledged (the fastest drain, no history of
            successes, and an idempotency key is free again at once). Failed events
            are never pruned automatically. Defaults to 604800 (7 days).
        backoff: delay policy between failed attempts. Defaults to ``BackoffPolicy()``.
        tenants: claim only events of these tenants; ``None`` claims every tenant's.
            Defaults to ``None``.
        query_timeout: seconds the worker waits for any one of its statements; past
            that the connection is presumed half-open, dropped and replaced (TCP
            keepalives cannot see a peer whose kernel still acknowledges).
            Defaults to 30.0.
        listen: keep a LISTEN connection so a committed event wakes the worker at
            once; ``False`` polls only (every ``poll_interval``). Defaults to ``True``.
        transaction_pooler: whether the database URL goes through a transaction-pooling
            proxy (PgBouncer with ``pool_mode = transaction``). ``True``: the worker
            keeps no session state there (no session settings, no prepared
            statements) and does not LISTEN through it; give it a direct
            ``listen_conninfo`` to keep instant wake-ups. ``False``: the URL reaches
            PostgreSQL directly or through a session pooler, and the worker keeps
            its session state. ``None``: the first connection finds out; a pooler
            found there is treated as a transaction pooler (safe in either mode,
            but slower in session mode) and named in a warning. Defaults to ``None``.
        horizon_alert_after: seconds a transaction may hold back PostgreSQL's vacuum
            horizon before the worker logs an alert (checked every quarter of that, at
            most every 30 s); dead rows of finished events pile up behind such a
            transaction and claims slow down. ``None`` turns the check off.
            Defaults to 120.0.
        failure_log_limit: log lines of failed attempts, parked and cancelled
            events the worker writes per topic and outcome in each
            ``failure_log_window``; past that they are counted, and one line per
            topic and outcome gives the count when the window ends (the first
            failure of each window is always written; every error stays stored
            with its event). ``None`` writes every one. Defaults to 10.
        failure_log_window: seconds of one ``failure_log_limit`` window.
            Defaults to 60.0.
    """

    schema: str = SCHEMA_DEFAULT
    name: str | None = None
    concurrency: int = CONCURRENCY_DEFAULT
    batch_size: int = BATCH_SIZE_DEFAULT
    max_batch_size: int | None = None
    poll_interval: float = POLL_INTERVAL_DEFAULT
    lease_ttl: float = LEASE_TTL_DEFAULT
    heartbeat_interval: float = HEARTBEAT_INTERVAL_DEFAULT
    rescue_interval: float = RESCUE_INTERVAL_DEFAULT
    shutdown_timeout: float = SHUTDOWN_TIMEOUT_DEFAULT
    handler_timeout: float = HANDLER_TIMEOUT_DEFAULT
    reconnect_min: float = RECONNECT_MIN_DEFAULT
    reconnect_max: float = RECONNECT_MAX_DEFAULT
    ack_interval: float = ACK_INTERVAL_DEFAULT
    claim_window: float = 0.0
    listener_ping_interval: float = LISTENER_PING_INTERVAL_DEFAULT
    retention: float | None = RETENTION_DEFAULT
    backoff: RetryPolicy = field(default_factory=BackoffPolicy)
    tenants: tuple[str, ...] | None = None
    query_timeout: float = QUERY_TIMEOUT_DEFAULT
    listen: bool = True
    transaction_pooler: bool | None = None
    horizon_alert_after: float | None = HORIZON_ALERT_DEFAULT
    failure_log_limit: int | None = FAILURE_LOG_LIMIT_DEFAULT
    failure_log_window: float = FAILURE_LOG_WINDOW_DEFAULT

    def __post_init__(self) -> None:
        _schema(self.schema)
        if not isinstance(self.listen, bool):
            raise ConfigError(f"expected listen to be True or False, got {self.listen!r}")
        if self.transaction_pooler is not None and not isinstance(self.transaction_pooler, bool):
            raise ConfigError("expected transaction_pooler to be True, False or None, "
                              f"got {self.transaction_pooler!r}")
        if self.tenants is not None:
            if isinstance(self.tenants, str) or not self.tenants:
                raise ConfigError(f"expected tenants to be a non-empty tuple, got {self.tenants!r}")
            for tenant in self.tenants:
                try:
                    check_tenant(tenant)
                except InvalidInputError as exc:
                    raise ConfigError(str(exc)) from None
        for name in WORKER_RANGES:
            value = getattr(self, name)
            if value is not None or name not in ("retention", "horizon_alert_after",
                                                 "max_batch_size", "failure_log_limit"):
                _check_range(name, value, WORKER_RANGES)
        if self.max_batch_size is not None and self.max_batch_size < self.batch_size:
            raise ConfigError(f"expected max_batch_size to be >= batch_size ({self.batch_size}), "
                              f"got {self.max_batch_size!r}")
        if self.reconnect_max < self.reconnect_min:
            raise ConfigError(
                f"expected reconnect_max to be >= reconnect_min ({self.reconnect_min}), "
                f"got {self.reconnect_max!r}"
            )
        if self.heartbeat_interval >= self.lease_ttl:
            raise ConfigError(
                f"expected heartbeat_interval to be < lease_ttl ({self.lease_ttl}), "
                f"got {self.heartbeat_interval!r}"
            )

    @property
    def claim_limit(self) -> int:
        """The largest claim: ``max_batch_size``; when that is ``None``, half of
        ``concurrency`` (or ``batch_size`` if it is larger).

        Half, not all: a claim as large as the slots leaves none free until its
        whole batch is acknowledged, so claim, handlers and acknowledgement run
        one after the other. With half, the database claims the next batch
        while this one runs (2026-12-01: 78,000 against 57,000 events/s at the
        default 100/200 on a 20,000-event backlog, docs/benchmarks.md).
        """
        if self.max_batch_size is not None:
            return self.max_batch_size
        return max(self.batch_size, self.concurrency // 2)

    @property
    def rescue_bound(self) -> float:
        """Longest time an event of a dead worker waits before it can run again."""
        return self.lease_ttl + self.rescue_interval
