"""The W3C trace context a traced enqueue stores in each of its rows (migration 0006).

A leaf both sides share: the producer writes it, :mod:`conveyor.tracing` (the
``otel`` extra) builds it from the send span.
"""

from __future__ import annotations

from typing import NamedTuple


class TraceContext(NamedTuple):
    """A row's ``traceparent`` and ``tracestate`` columns."""

    traceparent: str
    tracestate: str | None
