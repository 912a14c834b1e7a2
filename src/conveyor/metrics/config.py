"""The bounds of the metrics: how many series, connections and seconds they may take.

Every bound exists so that what a producer writes (a topic built from data) or
what a client does (a connection left half-sent) cannot grow the worker's
memory, its scrape or its thread count without limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from conveyor.errors import ConfigError

MAX_TOPICS_DEFAULT = 200
REQUEST_TIMEOUT_DEFAULT = 10.0
MAX_CONNECTIONS_DEFAULT = 16

# The label value of the series that count everything past a bound. A topic
# must start with a letter or digit, and a tenant is lowercase letters, digits
# and hyphens (conveyor.validation), so no real topic or tenant can be this.
OTHER = "_other"

METRICS_RANGES: dict[str, tuple[float, float]] = {
    # Each label set costs about 40 lines of exposition (an outcome counter and
    # two histograms): 10,000 of them is a 4 MB scrape.
    "max_topics": (1, 10_000),
    "max_connections": (1, 1_000),
    "request_timeout": (0.1, 3_600.0),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class MetricsConfig:
    """Bounds of the metrics collectors and of the metrics port.

    Every number is checked on creation against :data:`METRICS_RANGES`; a
    value outside raises :class:`~conveyor.errors.ConfigError` naming the range.

    Example::

        MetricsMiddleware(config=MetricsConfig(max_topics=500))

    Attributes:
        max_topics: topics (with ``tenant_label``, topic-and-tenant pairs; for
            the database gauges, also cron schedules and flow-limited patterns)
            that get series of their own, per collector. The rest are counted
            together under the label value ``_other``, so totals stay right.
            The middleware keeps the first ones it sees; the database gauges
            the ones with the most events. Defaults to 200.
        max_connections: connections the metrics port serves at once; one
            more is answered 503 and closed. Defaults to 16.
        request_timeout: seconds a connection to the metrics port may stay
            idle (sending its request or reading the answer) before it is
            closed. Defaults to 10.
    """

    max_topics: int = MAX_TOPICS_DEFAULT
    max_connections: int = MAX_CONNECTIONS_DEFAULT
    request_timeout: float = REQUEST_TIMEOUT_DEFAULT

    def __post_init__(self) -> None:
        for name, (low, high) in METRICS_RANGES.items():
            value = getattr(self, name)
            counted = name != "request_timeout"
            kind = "an integer" if counted else "a number of seconds"
            wrong_type = (isinstance(value, bool) or not isinstance(value, int if counted else
                                                                     int | float))
            if wrong_type or not math.isfinite(value) or not low <= value <= high:
                raise ConfigError(f"expected {name} to be {kind} between {low:g} and "
                                  f"{high:g}, got {value!r}")
