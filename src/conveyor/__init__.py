"""Conveyor: the transactional outbox and job queue for Python on PostgreSQL."""

from conveyor.admin import Admin, AsyncAdmin
from conveyor.config import ProducerConfig, WorkerConfig
from conveyor.errors import (
    ConfigError,
    ConveyorError,
    DatabaseError,
    DatabaseUnavailableError,
    EmbeddedServerError,
    EngineError,
    EngineHTTPError,
    EngineTransportError,
    EventNotFoundError,
    InvalidDatabaseUrlError,
    InvalidInputError,
    InvalidStateError,
    MigrationError,
    MissingExtraError,
    PayloadTooLargeError,
    WorkbookError,
)
from conveyor.middleware import HandlerResult, Middleware
from conveyor.outcomes import Cancel, HandlerSignal, PermanentFailure, RetryAfter, Snooze
from conveyor.producer import (
    AsyncCommittingProducer,
    AsyncProducer,
    CommittingProducer,
    NewEvent,
    Producer,
)
from conveyor.retry import BackoffPolicy, LinearBackoff, RetryPolicy
from conveyor.router import Route, Router
from conveyor.schema.migrator import AsyncMigrator, Migration, Migrator
from conveyor.types import (
    AttemptError,
    Event,
    EventFilter,
    EventPage,
    EventRecord,
    EventState,
    EventSummary,
    Pause,
    QueueStatus,
    TopicCount,
    WorkerInfo,
)
from conveyor.worker import Worker, WorkerStats

__version__ = "0.1.0"

__all__ = [
    "Admin",
    "AsyncAdmin",
    "AsyncCommittingProducer",
    "AsyncMigrator",
    "AsyncProducer",
    "AttemptError",
    "BackoffPolicy",
    "Cancel",
    "CommittingProducer",
    "ConfigError",
    "ConveyorError",
    "DatabaseError",
    "DatabaseUnavailableError",
    "EmbeddedServerError",
    "EngineError",
    "EngineHTTPError",
    "EngineTransportError",
    "Event",
    "EventFilter",
    "EventNotFoundError",
    "EventPage",
    "EventRecord",
    "EventState",
    "EventSummary",
    "HandlerResult",
    "HandlerSignal",
    "InvalidDatabaseUrlError",
    "InvalidInputError",
    "InvalidStateError",
    "LinearBackoff",
    "Middleware",
    "Migration",
    "MigrationError",
    "Migrator",
    "MissingExtraError",
    "NewEvent",
    "Pause",
    "PayloadTooLargeError",
    "PermanentFailure",
    "Producer",
    "ProducerConfig",
    "QueueStatus",
    "RetryAfter",
    "RetryPolicy",
    "Route",
    "Router",
    "Snooze",
    "TopicCount",
    "WorkbookError",
    "Worker",
    "WorkerConfig",
    "WorkerInfo",
    "WorkerStats",
]
