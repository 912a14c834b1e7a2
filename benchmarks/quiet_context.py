"""What a quiet attempt of ``--tracing`` costs, part by part, in a loop of tasks.

The executor starts each handler in a task; for a quiet attempt
(``Middleware.quiet``, docs/middleware.md) it first runs the hooks' ``quiet``
in a copy of the context and creates the task in that copy. Timed alone
(``timeit``), ``TracingMiddleware.quiet`` takes about a microsecond; in a
worker it adds more. This creates 100 no-op tasks a round, each in its own
context after one of these steps, and prints CPU microseconds per task:

* ``plain``: ``create_task`` as a worker without middleware does;
* ``copy``: the context copied, nothing set in it;
* ``setvar``: one ``ContextVar.set`` in the copy;
* ``attach``: OpenTelemetry's ``context.attach`` of an empty context;
* ``quiet``: ``TracingMiddleware.quiet`` of an unsampled first attempt.

    .venv/bin/python benchmarks/quiet_context.py [--rounds 300] [--gc worker]

``--gc worker`` collects garbage as a ``conveyor worker`` process does
(``conveyor.cli.process.serve_until_stopped``: start-up objects frozen, the
youngest generation collected every 10,000 allocations); by default, as
Python does. Every object a step allocates makes the collector's walks
come sooner, so the two settings price the same steps differently.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from conveyor.cli.process import YOUNG_GC_THRESHOLD
from conveyor.tracing import TracingMiddleware
from conveyor.types import Event

TASKS = 100
VAR: contextvars.ContextVar[object] = contextvars.ContextVar("quiet_context_bench")
EMPTY = otel_context.Context()


async def _noop(event: Event) -> None:
    return None


def _variants() -> dict[str, Callable[[Event], Any] | None]:
    middleware = TracingMiddleware(TracerProvider(sampler=ParentBased(TraceIdRatioBased(0.01))))
    return {
        "plain": None,
        "copy": lambda event: None,
        "setvar": lambda event: VAR.set(event),
        "attach": lambda event: otel_context.attach(EMPTY),
        "quiet": middleware.quiet,
    }


async def _round(step: Callable[[Event], Any] | None, events: list[Event], rounds: int) -> float:
    loop = asyncio.get_running_loop()
    started = time.process_time()
    for _ in range(rounds):
        tasks = []
        for event in events:
            if step is None:
                tasks.append(loop.create_task(_noop(event)))
            else:
                context = contextvars.copy_context()
                context.run(step, event)
                tasks.append(loop.create_task(_noop(event), context=context))
        await asyncio.gather(*tasks)
    return (time.process_time() - started) / (rounds * len(events)) * 1e6


async def _measure(rounds: int, repeats: int) -> dict[str, float]:
    events = [Event(id=n, topic="bench.noop", payload_text="{}",
                    traceparent=f"00-{n + 1:032x}-{0x77:016x}-00") for n in range(TASKS)]
    variants = _variants()
    spent: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, step in variants.items():
            spent[name].append(await _round(step, events, rounds))
    return {name: statistics.median(values) for name, values in spent.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=300, help="rounds of 100 tasks per sample")
    parser.add_argument("--repeats", type=int, default=5, help="samples per variant, alternating")
    parser.add_argument("--gc", choices=["python", "worker"], default="python",
                        help="the garbage collector's settings: Python's own, or a worker's")
    args = parser.parse_args()
    if args.gc == "worker":
        gc.freeze()
        _python_young, *older = gc.get_threshold()
        gc.set_threshold(YOUNG_GC_THRESHOLD, *older)
    trace.set_tracer_provider(TracerProvider(sampler=ParentBased(TraceIdRatioBased(0.01))))
    result = asyncio.run(_measure(args.rounds, args.repeats))
    plain = result["plain"]
    print(f"CPU per no-op task, median of {args.repeats} samples of {args.rounds} x {TASKS}, "
          f"{args.gc}'s garbage collection:")
    for name, us in result.items():
        print(f"  {name:<8} {us:5.2f} us   +{us - plain:4.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
