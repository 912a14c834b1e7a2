"""Process plumbing of the long-running commands (``worker``, ``worker-multi``).

Stop signals from the first moment: a worker's event loop installs its own
SIGTERM/SIGINT handlers only once it runs; before that (importing the
application, building the config, creating the loop) and after the loop is
closed (which restores the default handlers), a signal would kill the process
by the signal. :class:`StopSignals` notes a stop request in those windows
instead, so a SIGTERM at any moment of a worker's life ends in a clean exit 0.

Also: the event loop (uvloop or asyncio), the ``--app`` target, a loop run
that never waits for handler threads, and an exit that leaves stuck ones.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import inspect
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from types import FrameType
from typing import Any, Protocol

from conveyor.cli.context import Context
from conveyor.cli.options import option
from conveyor.errors import InvalidInputError, MissingExtraError
from conveyor.middleware import Middleware
from conveyor.router import Router

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Notes SIGTERM/SIGINT outside the event loop; hands the request to it once it runs."""

    def __init__(self) -> None:
        self.requested = False
        self._forward: Callable[[], None] | None = None

    def install(self) -> StopSignals:
        """Catch the stop signals from now on (main thread only); returns self."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def forward_to(self, request_stop: Callable[[], None]) -> None:
        """Call ``request_stop`` now if a stop already came, and on every later signal.

        Call it inside the loop, right after the loop's own handlers are
        installed: a signal between the two is seen by one or the other.
        """
        self._forward = request_stop
        if self.requested:
            request_stop()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        first = not self.requested
        self.requested = True
        if first:
            log.info("%s received: stopping", signal.Signals(signum).name,
                     extra={"action": "stop_signal"})
        if self._forward is not None:
            self._forward()


EVENT_LOOPS = ("auto", "uvloop", "asyncio")


def add_event_loop_arg(p: argparse.ArgumentParser, env: Callable[..., str | None]) -> None:
    option(p, "--event-loop", env="EVENT_LOOP", choices=EVENT_LOOPS, default="auto",
           help="'uvloop' (the 'uvloop' extra, Linux and macOS: about 10-20 %% "
                "less CPU per event and a faster wake-up), 'asyncio' (the standard "
                "loop), or 'auto': uvloop when it can be imported")


def new_event_loop(kind: str = "auto") -> asyncio.AbstractEventLoop:
    """The worker's event loop: uvloop when asked for or, with ``auto``, when installed.

    ``uvloop`` without the extra raises MissingExtraError; ``auto`` falls back
    to asyncio's loop quietly. Defaults to ``auto``.
    """
    if kind not in EVENT_LOOPS:
        raise InvalidInputError(f"invalid event loop {kind!r}: expected one of {', '.join(EVENT_LOOPS)}")
    if kind != "asyncio":
        try:
            import uvloop
        except ImportError as exc:
            if kind == "uvloop":
                raise MissingExtraError("--event-loop uvloop", "uvloop", module=exc.name) from None
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def import_target(spec: str, flag: str = "--app") -> object:
    """The object named by ``'module:attribute'`` (the current directory is importable).

    Whatever goes wrong, the module raising at import included, is one
    InvalidInputError naming the target and the reason: user code must not
    turn into a traceback here.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise InvalidInputError(f"invalid {flag} {spec!r}: expected 'module:attribute'")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidInputError(f"cannot import module {module_name!r} for {flag}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - any error of user code at import
        raise InvalidInputError(f"{flag} {spec!r}: importing {module_name!r} raised "
                                f"{_describe_error(exc)}") from None
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise InvalidInputError(f"module {module_name!r} has no attribute {attr!r}") from None
    return target


def load_router(spec: str) -> Router:
    """The Router named by ``--app``: an attribute, or what a function of no arguments returns.

    Whatever goes wrong (the module raises at import, the target needs
    arguments or raises, it is no Router) is one InvalidInputError naming the
    target and the reason: user code must not turn into a traceback here.
    """
    target = import_target(spec)
    if isinstance(target, Router):
        return target
    if not callable(target) or isinstance(target, type):
        kind = f"class {target.__name__}" if isinstance(target, type) else type(target).__name__
        raise InvalidInputError(f"--app {spec!r} is a {kind}, not a conveyor.Router")
    return _build_router(spec, target)


def _build_router(spec: str, factory: Callable[..., object]) -> Router:
    try:
        inspect.signature(factory).bind()
    except TypeError as exc:
        raise InvalidInputError(f"--app {spec!r} needs arguments ({exc}); name a Router or "
                                "a function taking none") from None
    except ValueError:
        pass  # no signature to read (some builtins): calling it will tell
    try:
        built = factory()
    except Exception as exc:  # noqa: BLE001 - any error of user code building the router
        raise InvalidInputError(f"--app {spec!r} raised {_describe_error(exc)}") from None
    if not isinstance(built, Router):
        raise InvalidInputError(
            f"--app {spec!r} returned a {type(built).__name__}, not a conveyor.Router")
    return built


def _describe_error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def add_metrics_args(p: argparse.ArgumentParser, *, every_tenant: bool = False) -> None:
    option(p, "--metrics-port", env="METRICS_PORT", type=port, shown="off",
           help="serve /metrics, /healthz and /readyz on this port (needs the 'metrics' "
                "extra; see docs/observability.md)"
                + ("; healthy and ready while every tenant's worker is" if every_tenant else ""))
    option(p, "--metrics-host", env="METRICS_HOST", default="127.0.0.1",
           help="address the metrics port binds")


def port(text: str) -> int:
    """argparse type: a TCP port, 1-65535."""
    try:
        number = int(text)
    except ValueError:
        number = -1
    if not 1 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port 1-65535, got {text!r}")
    return number


class Runnable(Protocol):
    """What ``worker`` and ``worker-multi`` run: a Worker or a MultiTenantWorker."""

    def install_signal_handlers(self) -> None: ...
    def request_stop(self) -> None: ...
    async def run(self) -> None: ...


class Beside(Protocol):
    """Metrics served beside a runnable (cli.metrics_serving)."""

    async def run_beside(self, target: Any) -> None: ...
    def stop(self) -> None: ...


# CPython's own first threshold, and the one a long-running CLI process uses
# instead (serve_until_stopped).
PYTHON_GC_THRESHOLD = 700
YOUNG_GC_THRESHOLD = 10_000


def serve_until_stopped(target: Runnable, stop: StopSignals, event_loop: str,
               metrics: Beside | None = None) -> None:
    """Run ``target`` until it stops (SIGTERM, SIGINT), with its metrics beside it if any.

    What the process has made so far (its modules, the app, the worker) is
    moved out of the cyclic garbage collector's sight first (``gc.freeze``):
    it lives as long as the process, and every full collection walked it
    again. And the youngest generation is collected every
    :data:`YOUNG_GC_THRESHOLD` allocations instead of Python's 700, unless
    the app set a threshold of its own. A drain allocates steadily, the
    tracing middleware most: with a 1 % sampler it added 25,700 instructions
    an event, 9,300 fewer once frozen and 6,500 fewer again with the
    threshold (docs/benchmarks.md). Reference counting still frees what is
    let go at once; only reference cycles wait longer.
    """
    gc.freeze()
    young, *older = gc.get_threshold()
    if young == PYTHON_GC_THRESHOLD:
        gc.set_threshold(YOUNG_GC_THRESHOLD, *older)

    async def serve() -> None:
        target.install_signal_handlers()
        stop.forward_to(target.request_stop)
        if metrics is None:
            await target.run()
        else:
            await metrics.run_beside(target)

    try:
        run_until_stopped(serve(), event_loop)
    finally:
        if metrics is not None:
            metrics.stop()
    stop.install()   # closing the loop restored the default handlers; the exit is under way


def run_until_stopped(main: Coroutine[Any, Any, None], event_loop: str = "auto") -> None:
    """Like asyncio.run, but never waits for threads a handler left running.

    asyncio.run joins the loop's default executor on the way out, so one handler
    still inside ``asyncio.to_thread`` would hold the process past its shutdown
    timeout. Here the default executor's threads carry the handler-thread name
    (so the exit path below sees them) and are not joined.
    """
    try:
        loop = new_event_loop(event_loop)
    except (InvalidInputError, MissingExtraError):
        main.close()  # never awaited: say so quietly instead of warning
        raise
    loop.set_default_executor(ThreadPoolExecutor(thread_name_prefix="conveyor-handler-default"))
    try:
        loop.run_until_complete(main)
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()  # shuts the default executor down without waiting for its threads


def leave_stuck_handler_threads(ctx: Context) -> None:
    """Exit at once if plain handlers still run in threads; their events were handed back.

    Such threads cannot be interrupted, and waiting for them would hold the
    process past its shutdown timeout. Idle pool threads exit as soon as they
    see the shutdown; one shared deadline bounds the wait however many are stuck.
    """
    handler_threads = [t for t in threading.enumerate() if t.name.startswith("conveyor-handler")]
    deadline = time.monotonic() + 0.5
    for thread in handler_threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    stuck = [t for t in handler_threads if t.is_alive()]
    if stuck:
        log.warning("%d handler threads still running at exit; leaving them", len(stuck),
                    extra={"action": "exit_abandon_threads"})
        ctx.close()
        logging.shutdown()
        os._exit(0)


def add_tracing_arg(parser: argparse.ArgumentParser) -> None:
    """``--tracing``, shared by ``worker`` and ``worker-multi``."""
    parser.add_argument(
        "--tracing", action="store_true",
        help="a 'process {topic}' OpenTelemetry span around every handler call, linked to "
             "the span that enqueued the event; spans go to the tracer provider your app "
             "(or opentelemetry-instrument) set up (needs the 'otel' extra; docs/tracing.md)")


def tracing_middleware(args: argparse.Namespace) -> list[Middleware]:
    """``[TracingMiddleware()]`` when ``--tracing`` was given; a one-line error without the extra."""
    if not args.tracing:
        return []
    try:
        from conveyor.tracing import TracingMiddleware
    except ImportError as exc:   # MissingExtraError: its message says what to install
        raise InvalidInputError(f"--tracing: {exc}") from None
    return [TracingMiddleware()]
