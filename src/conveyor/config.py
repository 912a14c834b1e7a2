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


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or value <= 0:
        raise ConfigError(f"expected {name} to be > 0, got {value!r}")


def _schema(value: str) -> None:
    try:
        check_schema_name(value)
    except InvalidInputError as exc:
        raise ConfigError(str(exc)) from None


@dataclass(frozen=True, kw_only=True, slots=True)
class ProducerConfig:
    """How events are written.

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
        _positive("max_payload_bytes", self.max_payload_bytes)
        _positive("max_payload_depth", self.max_payload_depth)
        if not isinstance(self.max_attempts, int) or not 1 <= self.max_attempts <= 1000:
            raise ConfigError(f"expected max_attempts to be 1..1000, got {self.max_attempts!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerConfig:
    """How a worker claims, runs and acknowledges events.

    Attributes:
        schema: PostgreSQL schema holding Conveyor's tables. Defaults to ``"conveyor"``.
        name: a label shown in ``conveyor status``. Defaults to ``"<host>:<pid>"``.
        concurrency: handlers running at once; the worker never claims more events
            than it has free slots; a slot is held until the result is acknowledged,
            so twice the batch size keeps claims and acknowledgements overlapping.
            Defaults to 200.
        batch_size: most events claimed by one query. Defaults to 100.
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
    """

    schema: str = SCHEMA_DEFAULT
    name: str | None = None
    concurrency: int = CONCURRENCY_DEFAULT
    batch_size: int = BATCH_SIZE_DEFAULT
    poll_interval: float = POLL_INTERVAL_DEFAULT
    lease_ttl: float = LEASE_TTL_DEFAULT
    heartbeat_interval: float = HEARTBEAT_INTERVAL_DEFAULT
    rescue_interval: float = RESCUE_INTERVAL_DEFAULT
    shutdown_timeout: float = SHUTDOWN_TIMEOUT_DEFAULT
    handler_timeout: float = HANDLER_TIMEOUT_DEFAULT
    reconnect_min: float = RECONNECT_MIN_DEFAULT
    reconnect_max: float = RECONNECT_MAX_DEFAULT
    ack_interval: float = ACK_INTERVAL_DEFAULT
    listener_ping_interval: float = LISTENER_PING_INTERVAL_DEFAULT
    retention: float | None = RETENTION_DEFAULT
    backoff: RetryPolicy = field(default_factory=BackoffPolicy)
    tenants: tuple[str, ...] | None = None
    query_timeout: float = QUERY_TIMEOUT_DEFAULT
    listen: bool = True
    transaction_pooler: bool | None = None
    horizon_alert_after: float | None = HORIZON_ALERT_DEFAULT

    def __post_init__(self) -> None:
        _schema(self.schema)
        if not isinstance(self.listen, bool):
            raise ConfigError(f"expected listen to be True or False, got {self.listen!r}")
        if self.transaction_pooler is not None and not isinstance(self.transaction_pooler, bool):
            raise ConfigError("expected transaction_pooler to be True, False or None, "
                              f"got {self.transaction_pooler!r}")
        if self.horizon_alert_after is not None:
            _positive("horizon_alert_after", self.horizon_alert_after)
        if self.tenants is not None:
            if isinstance(self.tenants, str) or not self.tenants:
                raise ConfigError(f"expected tenants to be a non-empty tuple, got {self.tenants!r}")
            for tenant in self.tenants:
                try:
                    check_tenant(tenant)
                except InvalidInputError as exc:
                    raise ConfigError(str(exc)) from None
        for name in ("concurrency", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"expected {name} to be an integer >= 1, got {value!r}")
        for name in ("poll_interval", "lease_ttl", "heartbeat_interval", "rescue_interval",
                     "shutdown_timeout", "handler_timeout", "reconnect_min", "reconnect_max",
                     "ack_interval", "listener_ping_interval", "query_timeout"):
            _positive(name, getattr(self, name))
        r = self.retention
        if r is not None and (isinstance(r, bool) or not isinstance(r, int | float)
                              or not math.isfinite(r) or r < 0):
            raise ConfigError(f"expected retention to be >= 0 seconds or None, got {r!r}")
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
    def rescue_bound(self) -> float:
        """Longest time an event of a dead worker waits before it can run again."""
        return self.lease_ttl + self.rescue_interval
