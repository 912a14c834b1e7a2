"""OpenTelemetry traces through the event row (the ``otel`` extra; docs/tracing.md).

An enqueue inside a recording span starts a ``send {topic}`` PRODUCER span
and stores its W3C context in the row (``traceparent``, ``tracestate``); the
worker's :class:`TracingMiddleware` starts a ``process {topic}`` CONSUMER
span for every attempt, linked to that context, and a child of it on the
first attempt. Names and attributes follow the OpenTelemetry messaging
semantic conventions, version :data:`SEMCONV_VERSION`.

Example::

    from conveyor.tracing import TracingMiddleware

    Worker(dsn, router, middleware=[TracingMiddleware()])

Importing this module without the extra raises
:class:`~conveyor.errors.MissingExtraError`; the rest of Conveyor never
imports it unless asked (the producer probes for it once, when it is built).
"""

from __future__ import annotations

import re
from contextvars import ContextVar, Token
from types import TracebackType
from typing import Any

from conveyor.errors import MissingExtraError
from conveyor.middleware import HandlerResult, Middleware
from conveyor.trace_context import TraceContext
from conveyor.types import Event, EventState
from conveyor.version import __version__

try:
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError as exc:  # pragma: no cover - exercised in a child interpreter
    raise MissingExtraError("conveyor.tracing", "otel", module="opentelemetry") from exc

__all__ = ["SEMCONV_VERSION", "CarriedContext", "ProducerTracing", "SendSpan",
           "TracingMiddleware", "context_of"]

# The messaging semantic conventions these spans follow: "send" (it replaced
# "publish" in 1.26) and messaging.operation.type/.name.
SEMCONV_VERSION = "1.27.0"
_SCHEMA_URL = f"https://opentelemetry.io/schemas/{SEMCONV_VERSION}"
SYSTEM = "conveyor"

# The columns hold W3C trace context whatever global propagator the
# application set (B3, Jaeger): they are typed and checked as W3C (0006).
_W3C = TraceContextTextMapPropagator()
# The fields of a version-00 traceparent, for context_of's fast path.
_HEX = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
# The last hex digit of a traceparent whose flags say "not sampled": the
# sampled flag is the lowest bit (others, such as W3C level 2's "random",
# 0x02, which the SDK sets, may be on).
_NOT_SAMPLED = frozenset("02468ace")
# Every process span's fixed attributes, and the empty context a root span starts from.
_PROCESS_ATTRIBUTES: dict[str, str] = {"messaging.system": SYSTEM,
                                       "messaging.operation.type": "process",
                                       "messaging.operation.name": "process"}
_ROOT = otel_context.Context()
# One attempt's span, the token that made it current, and the attempt entered
# before it in the same context (a batch handler's call), if any.
_Attempt = tuple[trace.Span, Token[Any], "_Attempt | None"]
# The tracestate domain's limit (tracestate_check, 0007); a longer one is dropped, as W3C
# lets a vendor do.
TRACESTATE_MAX = 512


def _tracer(provider: trace.TracerProvider | None) -> trace.Tracer:
    return trace.get_tracer("conveyor", __version__, tracer_provider=provider,
                            schema_url=_SCHEMA_URL)


def context_of(traceparent: str | None, tracestate: str | None) -> trace.SpanContext | None:
    """The span context a row's ``traceparent``/``tracestate`` hold, None when none is valid.

    A 55-character lowercase version-00 value (what the column's domain admits,
    0006/0007) is read by slicing: the W3C propagator's regular expression and
    context objects cost several microseconds per event. Anything else goes
    through the propagator.
    """
    if traceparent is None:
        return None
    if len(traceparent) == 55 and traceparent.startswith("00-") and _HEX.fullmatch(traceparent):
        state = (trace.TraceState.from_header([tracestate]) if tracestate
                 else trace.DEFAULT_TRACE_STATE)
        found = trace.SpanContext(trace_id=int(traceparent[3:35], 16),
                                  span_id=int(traceparent[36:52], 16), is_remote=True,
                                  trace_flags=trace.TraceFlags(int(traceparent[53:55], 16)),
                                  trace_state=state)
        return found if found.is_valid else None
    carrier = {"traceparent": traceparent}
    if tracestate is not None:
        carrier["tracestate"] = tracestate
    found = trace.get_current_span(_W3C.extract(carrier)).get_span_context()
    return found if found.is_valid else None


class SendSpan:
    """The PRODUCER span of one enqueue call, current while the call runs.

    ``trace`` is what its rows store: this span's own W3C context, so the
    consumer's link points at the send.
    """

    __slots__ = ("_token", "span", "trace")

    def __init__(self, span: trace.Span) -> None:
        self.span = span
        carrier: dict[str, str] = {}
        _W3C.inject(carrier, context=trace.set_span_in_context(span))
        parent, state = carrier.get("traceparent"), carrier.get("tracestate") or None
        if state is not None and len(state) > TRACESTATE_MAX:
            state = None
        # None when the span has no valid context (a no-op provider): nothing to store.
        self.trace = TraceContext(parent, state) if parent is not None else None
        self._token: Token[Any] | None = None

    def finish(self, *, message_id: int | None = None, count: int | None = None,
               topics: set[str] | None = None) -> None:
        """Record what was sent: one event's id, or a batch's size and (single) topic."""
        span = self.span
        if message_id is not None:
            span.set_attribute("messaging.message.id", str(message_id))
        if count is not None:
            span.set_attribute("messaging.batch.message_count", count)
        if topics is not None and len(topics) == 1:
            (topic,) = topics
            span.set_attribute("messaging.destination.name", topic)
            span.update_name(f"send {topic}")

    def __enter__(self) -> SendSpan:
        self._token = otel_context.attach(trace.set_span_in_context(self.span))
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if exc is not None:
                _record_error(self.span, exc, str(exc))
        finally:
            self.span.end()
            if self._token is not None:
                otel_context.detach(self._token)


class CarriedContext:
    """What an enqueue inside a span that is not recorded stores: that span's
    context, so the head's decision (not sampled) travels with the event and
    the worker's span follows it (docs/tracing.md). No span of its own: the
    interface of :class:`SendSpan`, doing nothing but carry ``trace``.
    """

    __slots__ = ("trace",)

    def __init__(self, context: trace.SpanContext) -> None:
        state = context.trace_state.to_header() if context.trace_state else None
        if state is not None and (not state or len(state) > TRACESTATE_MAX):
            state = None
        self.trace: TraceContext | None = TraceContext(
            f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}",
            state)

    def finish(self, **_: Any) -> None:
        pass

    def __enter__(self) -> CarriedContext:
        return self

    def __exit__(self, *_: object) -> None:
        pass


class ProducerTracing:
    """Starts send spans for a producer inside a recording span; inside one that is
    not recorded (a head sampler said no), carries its context without a span.

    Args:
        tracer_provider: where spans go. Defaults to the global provider.
    """

    __slots__ = ("_tracer",)

    def __init__(self, tracer_provider: trace.TracerProvider | None = None) -> None:
        self._tracer = _tracer(tracer_provider)

    def start(self, topic: str | None) -> SendSpan | CarriedContext | None:
        """A send span for ``topic`` (None: a batch); the current context alone in a
        span that is not recorded; None outside any span."""
        current = trace.get_current_span()
        if not current.is_recording():
            context = current.get_span_context()
            return CarriedContext(context) if context.is_valid else None
        attributes: dict[str, str] = {"messaging.system": SYSTEM,
                                      "messaging.operation.type": "send",
                                      "messaging.operation.name": "send"}
        if topic is not None:
            attributes["messaging.destination.name"] = topic
        span = self._tracer.start_span("send" if topic is None else f"send {topic}",
                                       kind=trace.SpanKind.PRODUCER, attributes=attributes)
        return SendSpan(span)


class TracingMiddleware(Middleware):
    """A ``process {topic}`` CONSUMER span around every attempt, current for the handler.

    The span links to the producer's send span stored with the event; on the
    first attempt it is also that span's child, so a request's trace runs on
    into the work it enqueued. A retry, which may come hours later, starts a
    trace of its own, linked back (docs/tracing.md says why).

    Args:
        tracer_provider: where spans go. Defaults to the global provider.
    """

    def __init__(self, tracer_provider: trace.TracerProvider | None = None) -> None:
        self._tracer = _tracer(tracer_provider)
        # Whether spans may be no-ops: only while the global provider is the
        # API's proxy (no SDK set up yet). The global can be set once, so once
        # it is not the proxy it never is again.
        self._maybe_noop = tracer_provider is None
        # Whether the provider's sampler drops every span whose remote parent
        # was not sampled: then such an event's first attempt needs no span of
        # its own, only its producer's context made current (see before()).
        self._parent_decides = (tracer_provider is not None
                                and follows_unsampled_parents(tracer_provider))
        # The attempt's span, the token that made it current, and the attempts
        # entered before it in the same context: before() and after() run in the
        # handler's own context, so each call sees its own; a batch handler's
        # call enters each of its events in turn and leaves them in reverse, so
        # after() takes the last one entered.
        self._attempt: ContextVar[_Attempt | None] = ContextVar(
            f"conveyor_tracing_{id(self)}", default=None)

    def _spans_are_noops(self) -> bool:
        """Whether every span would be a no-op: no SDK set up (yet). Building a span's
        links and attributes would then cost CPU on every event for nothing."""
        provider = trace.get_tracer_provider()
        if type(provider) is trace.ProxyTracerProvider:
            return True
        self._maybe_noop = False
        self._parent_decides = follows_unsampled_parents(provider)
        # The SDK's own tracer from now on: the one made before it was set up
        # is a proxy, one more call per span (hot path, measured: see
        # docs/benchmarks.md).
        self._tracer = _tracer(None)
        return False

    def _unsampled(self, event: Event) -> _UnsampledParent | None:
        """The producer's context when the head sampler said no and the provider's
        sampler would follow it (the SDK's span would record nothing) on the
        first attempt; the handler's own calls carry the decision on. Read
        from the row only if one of them asks for it."""
        carried = event.traceparent
        if carried is not None and carried[-1:] in _NOT_SAMPLED and event.attempt == 1 \
                and self._parent_decides:
            return _UnsampledParent(carried, event.tracestate)
        return None

    def quiet(self, event: Event) -> bool:
        """No hooks for an attempt that records nothing: no SDK, or an unsampled
        first attempt, whose producer's context is made current here."""
        if self._maybe_noop and self._spans_are_noops():
            return True
        unsampled = self._unsampled(event)
        if unsampled is None:
            return False
        # The handler's own context, dropped with it: nothing to detach.
        otel_context.attach(trace.set_span_in_context(unsampled, _ROOT))
        return True

    def before(self, event: Event) -> None:
        if self._maybe_noop and self._spans_are_noops():
            return
        unsampled = self._unsampled(event)
        if unsampled is not None:
            # Another middleware sees this attempt, so this one's after() runs too.
            token = otel_context.attach(trace.set_span_in_context(unsampled, _ROOT))
            self._attempt.set((unsampled, token, self._attempt.get()))
            return
        carried = event.traceparent
        producer = context_of(carried, event.tracestate) if carried is not None else None
        if producer is None:
            # A root: never whatever span happens to be current in the worker.
            links, parent = None, _ROOT
        else:
            links = [trace.Link(producer)]
            # The send span's child on the first attempt; a retry starts a trace of its own.
            parent = (trace.set_span_in_context(trace.NonRecordingSpan(producer), _ROOT)
                      if event.attempt == 1 else _ROOT)
        attributes: dict[str, str | int] = {
            **_PROCESS_ATTRIBUTES,
            "messaging.destination.name": event.topic,
            "messaging.message.id": str(event.id),
            "conveyor.attempt": event.attempt,
        }
        if event.tenant is not None:
            attributes["conveyor.tenant"] = event.tenant
        span = self._tracer.start_span(f"process {event.topic}", context=parent,
                                       kind=trace.SpanKind.CONSUMER, links=links,
                                       attributes=attributes)
        # Current even when not sampled: the handler's own spans and outgoing
        # calls then carry the decision (ParentBased samplers drop them too).
        token = otel_context.attach(trace.set_span_in_context(span))
        self._attempt.set((span, token, self._attempt.get()))

    def after(self, event: Event, result: HandlerResult) -> None:
        current = self._attempt.get()
        if current is None:
            return
        span, token, entered_before = current
        self._attempt.set(entered_before)
        if not span.is_recording():
            # Not sampled: nothing to record, only the context to restore.
            otel_context.detach(token)
            return
        try:
            span.set_attribute("conveyor.outcome", str(result.state))
            if result.error is not None and result.state != EventState.SUCCEEDED:
                if result.exception is not None:
                    _record_error(span, result.exception, result.error)
                else:   # a timeout: no exception object, only the recorded text
                    span.set_attribute("error.type", "timeout")
                    span.set_status(trace.Status(trace.StatusCode.ERROR, result.error))
        finally:
            span.end()
            otel_context.detach(token)


class _UnsampledParent(trace.NonRecordingSpan):
    """A producer's unsampled context, parsed from the row's columns on first use:
    a handler that makes no traced call never pays for it (context_of's parse
    was most of what an unsampled event cost, 2026-12-03)."""

    def __init__(self, traceparent: str, tracestate: str | None) -> None:
        self._row = (traceparent, tracestate)
        self._parsed: trace.SpanContext | None = None

    def get_span_context(self) -> trace.SpanContext:
        if self._parsed is None:
            self._parsed = context_of(*self._row) or trace.INVALID_SPAN_CONTEXT
        return self._parsed

    def __repr__(self) -> str:
        # The base class's repr reads the context it was built with: there is none here.
        return f"NonRecordingSpan({self.get_span_context()!r})"


def follows_unsampled_parents(provider: trace.TracerProvider) -> bool:
    """Whether ``provider`` is the SDK's and its sampler drops a span whose remote
    parent was not sampled: ``ParentBased`` with its default for that case.

    Asked of the sampler once, with such a parent; a sampler of another kind,
    or a ParentBased told to sample those spans, is always asked per span.
    """
    try:
        from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
        from opentelemetry.sdk.trace.sampling import Decision, ParentBased
    except ImportError:   # the API alone: no sampler to ask
        return False
    if not isinstance(provider, SdkTracerProvider) or not isinstance(provider.sampler, ParentBased):
        return False
    parent = trace.SpanContext(trace_id=1, span_id=1, is_remote=True,
                               trace_flags=trace.TraceFlags(trace.TraceFlags.DEFAULT))
    probe = provider.sampler.should_sample(
        trace.set_span_in_context(trace.NonRecordingSpan(parent), _ROOT), 1, "probe")
    return probe.decision is Decision.DROP


def _record_error(span: trace.Span, exc: BaseException, description: str) -> None:
    span.record_exception(exc)
    span.set_attribute("error.type", type(exc).__qualname__)
    span.set_status(trace.Status(trace.StatusCode.ERROR, description))
