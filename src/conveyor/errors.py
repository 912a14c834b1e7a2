"""Conveyor's exception tree.

Every error Conveyor raises on purpose derives from :class:`ConveyorError`::

    ConveyorError
    ├── ConfigError            a setting is out of range or malformed
    ├── InvalidInputError      an event, topic, tenant, key or id was refused before any SQL
    │   └── PayloadTooLargeError
    ├── DatabaseError          the database refused or could not be reached
    │   └── DatabaseUnavailableError
    │       └── InvalidDatabaseUrlError   the URL does not parse (also a ConfigError)
    ├── MigrationError         the schema is missing, too new, or a migration failed
    ├── EventNotFoundError     no event has that id
    ├── ScheduleNotFoundError  no cron schedule has that name
    ├── InvalidStateError      the event is in a state that forbids the operation
    │   └── LeaseLostError     a handler's attempt is no longer its worker's (complete())
    ├── WaitTimeoutError       Admin.wait() ran out of time (also a TimeoutError)
    ├── EmbeddedServerError    the embedded PostgreSQL could not be started
    ├── MissingExtraError      an optional part's extra is not installed (also an ImportError)
    ├── WorkbookError          a spreadsheet is corrupt, hostile or lacks required columns
    ├── EngineError            a call to the application's HTTP API failed
    │   ├── EngineTransportError   no HTTP answer (refused, reset, timed out)
    │   └── EngineHTTPError        an answer outside 2xx; ``status`` holds the code
    └── RelayError             the relay could not publish an event to its broker
        ├── BrokerUnavailableError  no connection, or no confirmation in time
        └── PublishRejectedError    the broker refused the message (no stream, unroutable, nack)

Handler outcomes (retry later, permanent failure, cancel, snooze) are *not*
errors; they live in :mod:`conveyor.outcomes`.
"""

from __future__ import annotations


class ConveyorError(Exception):
    """Base class of every error Conveyor raises on purpose."""


class ConfigError(ConveyorError, ValueError):
    """A configuration value is invalid; the message names the field and value."""


class InvalidInputError(ConveyorError, ValueError):
    """An input was refused before any SQL ran; the message names the value."""


class PayloadTooLargeError(InvalidInputError):
    """An event payload exceeds the configured size or nesting limit."""


class DatabaseError(ConveyorError):
    """The database refused an operation; the driver error is the ``__cause__``."""


class DatabaseUnavailableError(DatabaseError):
    """The database could not be reached."""


class InvalidDatabaseUrlError(DatabaseUnavailableError, ConfigError):
    """The database URL does not parse: retrying cannot help, and the message never quotes it."""


class MigrationError(ConveyorError):
    """The schema is missing, newer than this version, or a migration failed."""


class EventNotFoundError(ConveyorError, LookupError):
    """No event exists with the given id."""


class ScheduleNotFoundError(ConveyorError, LookupError):
    """No cron schedule has the given name; the message lists those that exist."""


class InvalidStateError(ConveyorError):
    """The event's state does not allow the requested operation."""


class LeaseLostError(InvalidStateError):
    """The attempt a handler is finishing is no longer its worker's: the lease
    expired and another worker took the event, or an operator cancelled it.
    Raised inside the handler's transaction, which must roll back."""


class WaitTimeoutError(ConveyorError, TimeoutError):
    """The awaited event did not reach a final state within the timeout."""


class EmbeddedServerError(ConveyorError):
    """The embedded PostgreSQL server could not be started or reached."""


class MissingExtraError(ConveyorError, ImportError):
    """An optional part was used without the extra that installs its dependencies.

    Also an ``ImportError``, so code that probes for an optional part with
    ``except ImportError`` keeps working. ``extra`` names the extra to install.

    Example::

        MissingExtraError("the engine client", "http", module="httpx")
        # the engine client needs the 'http' extra: pip install 'conveyor[http]'
    """

    def __init__(self, feature: str, extra: str, *, module: str | None = None) -> None:
        super().__init__(f"{feature} needs the {extra!r} extra: pip install 'conveyor[{extra}]'",
                         name=module)
        self.feature = feature
        self.extra = extra

    def __reduce__(self) -> tuple[type[MissingExtraError], tuple[str, str], dict[str, object]]:
        # Keyword arguments do not survive the default exception pickling.
        return type(self), (self.feature, self.extra), {"name": self.name}


class WorkbookError(ConveyorError):
    """A workbook was refused: not XLSX, corrupt, truncated, hostile, or invalid content."""


class EngineError(ConveyorError):
    """A call to the application's HTTP API (the engine) failed."""


class EngineTransportError(EngineError):
    """The engine gave no HTTP answer: refused, reset, or timed out."""


class EngineHTTPError(EngineError):
    """The engine answered outside 2xx."""

    def __init__(self, message: str, *, status: int, body: object = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body

    @property
    def retryable(self) -> bool:
        """Whether trying again later could succeed (408, 425, 429 and 5xx)."""
        return self.status in (408, 425, 429) or self.status >= 500


class RelayError(ConveyorError):
    """The relay could not publish an event to its broker (conveyor.relay)."""


class BrokerUnavailableError(RelayError):
    """The broker could not be reached, or did not confirm in time.

    The relay puts the event back without spending an attempt and backs off:
    an outage delays events, it never parks them.
    """


class PublishRejectedError(RelayError):
    """The broker answered and refused the message: a failed attempt, retried with backoff."""
