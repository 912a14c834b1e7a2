"""The benchmark's router with the OpenTelemetry SDK set up, for ``conveyor worker --tracing``.

Tracing on, no exporter (the case issue 12 sets a target for): an SDK
``TracerProvider`` that samples and records every span, with no span
processor, so the drain pays for starting, linking and ending a ``process``
span per event but not for batching or sending it anywhere.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from conveyor_tools.bench.app import router as router

trace.set_tracer_provider(TracerProvider())
