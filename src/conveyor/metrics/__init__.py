"""Prometheus metrics, ``/healthz`` and ``/readyz`` for a worker (the ``metrics`` extra).

Three parts, none of which costs the claim or acknowledgement path anything:

- :class:`MetricsMiddleware` counts every handler outcome and times it, by topic;
- :class:`WorkerCollector` reads a worker's own counters at scrape time;
- :class:`DatabaseGauges` reads queue depths from the database on a timer, in
  one worker at a time (an advisory lock), so a scrape never queries.

:func:`metrics_app` serves them as a Starlette app to mount in your ASGI app;
:class:`MetricsServer` serves the same on a port from a thread of its own, so
``/healthz`` still answers (503) while a handler blocks the event loop. See
docs/observability.md.
"""

from __future__ import annotations

from conveyor.errors import MissingExtraError

try:
    import prometheus_client  # noqa: F401
    import starlette  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised in a child interpreter
    raise MissingExtraError("conveyor.metrics", "metrics", module=exc.name) from None

from conveyor.metrics.app import MetricsServer, metrics_app
from conveyor.metrics.collectors import BuildInfo, DatabaseGauges, StreamsCollector, WorkerCollector
from conveyor.metrics.config import MetricsConfig
from conveyor.metrics.health import Check, health, readiness
from conveyor.metrics.middleware import MetricsMiddleware

__all__ = [
    "BuildInfo",
    "Check",
    "DatabaseGauges",
    "MetricsConfig",
    "MetricsMiddleware",
    "MetricsServer",
    "StreamsCollector",
    "WorkerCollector",
    "health",
    "metrics_app",
    "readiness",
]
