"""Control-flow signals a handler raises to choose what happens to its event.

They are deliberately not subclasses of :class:`~conveyor.errors.ConveyorError`:
they are outcomes, not failures of Conveyor. Any *other* exception a handler
raises counts as a failed attempt and is retried with backoff.

Example::

    from conveyor import RetryAfter, PermanentFailure

    def charge(event):
        if event.payload["amount"] <= 0:
            raise PermanentFailure("amount must be positive")
        if gateway_busy():
            raise RetryAfter(30)      # spends this attempt, next try in 30 s
"""

from __future__ import annotations

# 100 years, as for enqueue delays (kept literal: this module imports nothing internal).
MAX_SECONDS = 100 * 366 * 24 * 3600.0


class HandlerSignal(Exception):
    """Base class of the outcome signals."""

    def __init__(self, reason: str = "") -> None:
        super().__init__(reason)
        self.reason = reason


def _seconds(seconds: float) -> float:
    # The delay ends up as run_at in the database; refuse here what it could not store.
    value = float(seconds)
    if not 0 <= value <= MAX_SECONDS:
        raise ValueError(f"expected seconds to be between 0 and {MAX_SECONDS:.0f}, got {seconds!r}")
    return value


class RetryAfter(HandlerSignal):
    """Fail this attempt and retry after ``seconds`` instead of the backoff delay.

    The attempt is spent: when it was the last one, the event is parked ``failed``.
    """

    def __init__(self, seconds: float, reason: str = "") -> None:
        self.seconds = _seconds(seconds)
        super().__init__(reason or f"retry requested after {seconds:g}s")


class Snooze(HandlerSignal):
    """Put the event back for ``seconds`` without spending an attempt."""

    def __init__(self, seconds: float, reason: str = "") -> None:
        self.seconds = _seconds(seconds)
        super().__init__(reason or f"snoozed for {seconds:g}s")


class PermanentFailure(HandlerSignal):
    """Park the event ``failed`` now; no further attempts are spent."""


class Cancel(HandlerSignal):
    """Mark the event ``cancelled``: it will not run again and is not an error."""
