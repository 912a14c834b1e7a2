"""Instructions per event that metrics and tracing add to the executor's call, counted.

Timings on a shared machine move by half from run to run; instruction counts
under valgrind's callgrind do not. Each kind runs ``N`` claimed events
through the worker's own :class:`~conveyor.worker.executor.Executor` (an async
no-op handler, so a task per call, on uvloop) in a process of its own under
callgrind, once with 1,000 events and once with 3,000: the difference over
2,000 is the instructions per event, start-up and imports cancelled out.

    .venv/bin/python benchmarks/hook_instructions.py [KIND ...]

Kinds: ``plain``; ``after_only`` and ``both`` (no-op middleware with an
``after``, or a ``before`` and an ``after``: the executor's hook path alone);
``metrics`` (``MetricsMiddleware`` as a hook, as ``conveyor.testing`` runs it);
``metrics_worker`` (as a worker runs it: calls timed, each batch's outcomes
handed to ``observe_settled``, as the acknowledgement's accounting does);
``tracing`` (an SDK provider recording every span); ``plain_head`` and
``tracing_sampled`` (rows carrying a head sampler's context, 1 % sampled, and
``ParentBased(TraceIdRatioBased(0.01))``). Each figure is printed with what it
adds to ``plain`` (``plain_head`` for ``tracing_sampled``). Needs valgrind on the PATH.
"""

from __future__ import annotations

import asyncio
import datetime
import random
import sys
from typing import Any

from conveyor_tools.bench.callgrind import instructions

KINDS = ("plain", "after_only", "both", "metrics", "metrics_worker", "tracing", "plain_head",
         "tracing_sampled")
SIZES = (1_000, 3_000)
BATCH = 100


def _events(count: int, head: bool) -> list[Any]:
    from conveyor.types import Event

    created = datetime.datetime.now(datetime.UTC)
    rng = random.Random(1)

    def traceparent() -> str:
        flags = "01" if rng.random() < 0.01 else "00"
        return f"00-{rng.getrandbits(128):032x}-{rng.getrandbits(64):016x}-{flags}"

    return [Event(id=n, topic="bench.noop", payload_text="{}", created_at=created,
                  traceparent=traceparent() if head else None) for n in range(count)]


def _middleware(kind: str) -> list[Any]:
    from conveyor.middleware import Middleware

    class AfterOnly(Middleware):
        def after(self, event: Any, result: Any) -> None:
            pass

    class Both(AfterOnly):
        def before(self, event: Any) -> None:
            pass

    if kind in ("after_only", "both"):
        return [AfterOnly() if kind == "after_only" else Both()]
    if kind == "metrics":
        from prometheus_client import CollectorRegistry

        from conveyor.metrics import MetricsMiddleware
        return [MetricsMiddleware(registry=CollectorRegistry())]
    if kind.startswith("tracing"):
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        from conveyor.tracing import TracingMiddleware
        sampler = ParentBased(TraceIdRatioBased(0.01)) if kind == "tracing_sampled" else None
        return [TracingMiddleware(TracerProvider(sampler=sampler))]
    return []


async def _drain(kind: str, count: int) -> None:
    from conveyor.retry import BackoffPolicy
    from conveyor.router import Router
    from conveyor.worker.executor import Executor
    from conveyor.worker.running import RunningSet

    router = Router()

    async def noop(event: Any) -> None:
        pass

    router.add("bench.noop", noop)
    events = _events(count, head=kind in ("plain_head", "tracing_sampled"))
    slots = RunningSet(1000)
    observer = _middleware("metrics")[0] if kind == "metrics_worker" else None
    decided: list[Any] = []
    executor = Executor(router, slots, decided.append, handler_timeout=60.0,
                        backoff=BackoffPolicy(), threads=1,
                        middleware=[] if observer else _middleware(kind), timed=bool(observer))
    for start in range(0, count, BATCH):
        batch = events[start:start + BATCH]
        slots.take(batch)
        executor.start(batch)
        await asyncio.gather(*slots.unfinished_tasks())
        if observer is not None:
            observer.observe_settled([(slots.entries[o.event_id, o.attempt].event, o)
                                      for o in decided])
        for outcome in decided:
            slots.release((outcome.event_id, outcome.attempt))
        decided.clear()
    executor.close()


def _instructions(kind: str, count: int) -> int:
    return instructions([__file__, "--run", kind, str(count)])


def main() -> int:
    if sys.argv[1:2] == ["--run"]:
        import uvloop

        uvloop.install()
        asyncio.run(_drain(sys.argv[2], int(sys.argv[3])))
        return 0
    kinds = sys.argv[1:] or list(KINDS)
    per_event = {}
    for kind in kinds:
        low, high = (_instructions(kind, n) for n in SIZES)
        per_event[kind] = (high - low) / (SIZES[1] - SIZES[0])
        base = per_event.get("plain_head" if kind == "tracing_sampled" else "plain")
        added = "" if base is None or kind.startswith("plain") else \
            f"   adds {per_event[kind] - base:8,.0f}"
        print(f"{kind:16} {per_event[kind]:9,.0f} instructions per event{added}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
