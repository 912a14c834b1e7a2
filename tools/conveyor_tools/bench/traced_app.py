"""The benchmark's router with the OpenTelemetry SDK set up, for ``conveyor worker --tracing``.

Spans are recorded and handed to a ``BatchSpanProcessor`` (the processor a
production setup uses) whose exporter drops them, so the drain pays for
starting, linking and ending a ``process`` span per event, and for batching
it, but not for a network or a collector on this machine.
"""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from conveyor_tools.bench.app import router as router


class _Dropped(SpanExporter):
    """Accepts every batch and keeps nothing."""

    def __init__(self) -> None:
        self.exported = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.exported += len(spans)
        return SpanExportResult.SUCCESS


_provider = TracerProvider()
_provider.add_span_processor(BatchSpanProcessor(_Dropped()))
trace.set_tracer_provider(_provider)
