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


def reason_text(value: object) -> str:
    """``value`` as text, whatever it is; never raises.

    Reasons are often not strings (``PermanentFailure(exc)``, a status code,
    bytes), and an object's ``__str__`` may itself raise or return a non-str:
    the outcome must still be recorded.
    """
    if isinstance(value, BaseException):
        name = type(value).__name__
        message = _plain_str(value)
        return f"{name}: {message}" if message else name
    return _plain_str(value)


def _plain_str(value: object) -> str:
    try:
        text = str(value)
        # str() of a str subclass may hand back the subclass and its overrides.
        return text if type(text) is str else str.__str__(text)
    except BaseException:  # noqa: BLE001 - any failure to print is reported, not raised
        return f"<unprintable {type(value).__name__}>"


class HandlerSignal(Exception):
    """Base class of the outcome signals.

    ``reason`` may be any object (an exception, a status code): it is kept as
    text, e.g. ``PermanentFailure(KeyError("sku"))`` records ``KeyError: 'sku'``.
    """

    def __init__(self, reason: object = "") -> None:
        text = reason_text(reason)
        super().__init__(text)
        self.reason = text


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

    def __init__(self, seconds: float, reason: object = "") -> None:
        self.seconds = _seconds(seconds)
        super().__init__(reason_text(reason) or f"retry requested after {self.seconds:g}s")


class Snooze(HandlerSignal):
    """Put the event back for ``seconds`` without spending an attempt."""

    def __init__(self, seconds: float, reason: object = "") -> None:
        self.seconds = _seconds(seconds)
        super().__init__(reason_text(reason) or f"snoozed for {self.seconds:g}s")


class PermanentFailure(HandlerSignal):
    """Park the event ``failed`` now; no further attempts are spent."""


class Cancel(HandlerSignal):
    """Mark the event ``cancelled``: it will not run again and is not an error."""
