"""The benchmark's router with the OpenTelemetry SDK sampling 1 % of traces at the head.

``ParentBased(TraceIdRatioBased(0.01))``, the usual production setting, and
no span processor: most ``process`` spans are not sampled, so the drain
measures what ``--tracing`` costs an event that is not traced.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from conveyor_tools.bench.app import router as router

SAMPLED = 0.01

trace.set_tracer_provider(TracerProvider(sampler=ParentBased(TraceIdRatioBased(SAMPLED))))
