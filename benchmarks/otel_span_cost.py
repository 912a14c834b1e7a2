"""What the OpenTelemetry SDK's span costs by itself, with no Conveyor code.

`conveyor bench --observability` measures a worker with ``--tracing`` against
a plain one; this measures the floor under that figure: the SDK (a
``TracerProvider`` with no processor, the default sampler) starting and
ending a span, bare and with what ``TracingMiddleware`` gives each
``process`` span (a parent context from the stored traceparent, CONSUMER
kind, a link to the producer's span, five attributes).

    .venv/bin/python benchmarks/otel_span_cost.py [--spans 50000 --rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    TraceFlags,
    set_span_in_context,
)


def loops(spans: int) -> dict[str, Callable[[], None]]:
    tracer = TracerProvider().get_tracer("conveyor.bench")
    producer = SpanContext(trace_id=0x0AF7651916CD43DD8448EB211C80319C, span_id=0xB7AD6B7169203331,
                           is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    parent = set_span_in_context(NonRecordingSpan(producer))

    def bare() -> None:
        for _ in range(spans):
            tracer.start_span("process noop").end()

    def conventions() -> None:
        for i in range(spans):
            tracer.start_span(
                "process noop", context=parent, kind=SpanKind.CONSUMER, links=[Link(producer)],
                attributes={"messaging.system": "conveyor", "messaging.operation.type": "process",
                            "messaging.destination.name": "noop",
                            "messaging.message.id": str(i), "conveyor.attempt": 1}).end()

    return {"bare span": bare, "process span as the middleware makes it": conventions}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spans", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    spent: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, loop in loops(args.spans).items():
            t0 = time.perf_counter()
            loop()
            spent.setdefault(name, []).append((time.perf_counter() - t0) / args.spans * 1e6)
    for name, values in spent.items():
        print(f"{name:<42} {statistics.median(values):6.2f} us per span (start + end)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
