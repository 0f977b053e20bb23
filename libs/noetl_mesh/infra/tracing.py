"""Traces: W3C trace context on every NATS message, one trace per execution, OTLP export by the
standard ``OTEL_*`` variables (docs/operations.md, "Traces"; the span tree: docs/architecture.md §7).

Export is on when ``OTEL_TRACES_EXPORTER`` names an exporter (``otlp``: OTLP over HTTP/protobuf, the
exporter this package depends on; ``console``: spans printed on stdout) or, with it unset,
``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set; ``none`` or
``OTEL_SDK_DISABLED=true`` turn it off. The exporter reads its own ``OTEL_EXPORTER_OTLP_*`` settings
(headers, timeout, compression), the batch processor ``OTEL_BSP_*``, the sampler ``OTEL_TRACES_SAMPLER``,
the resource ``OTEL_SERVICE_NAME`` (over ``noetl-<service>``) and ``OTEL_RESOURCE_ATTRIBUTES``. With
export off no span is recorded at all (the API's no-op tracer): the trace context still travels, so
the messages of an execution share one trace id, and nothing else is paid.

An execution's trace id is derived from its id (:func:`trace_id_of`: the id itself when it is 32 hex
digits, as the gateway makes them), so every service puts what it does for an execution into one
trace, whatever message it came from: a rebuild, a timer, a scheduled request, a child's request sent
by its parent's services. A span whose incoming context belongs to another trace (the gateway's HTTP
request, the parent execution) is parented on the execution's root instead and *linked* to that
context. The root span (:func:`execution_root`, span id :func:`root_span_id`) is written by the router
when the execution finishes, from the request's time to the end; a child's root links to its parent's.

Each service of a process has its own tracer provider (``service.name`` ``noetl-<service>``), so the
services of an in-process stack export as separate services too.
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
import os
import re
import uuid
from typing import Any, Iterator, Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger("noetl.tracing")

_propagator = TraceContextTextMapPropagator()
_NOOP = trace.NoOpTracer()
_HEX32 = re.compile(r"^[0-9a-f]{32}\Z")
SAMPLED = TraceFlags(TraceFlags.SAMPLED)

# span attribute names (docs/architecture.md §7)
EXECUTION_ID = "noetl.execution_id"
PARENT_EXECUTION_ID = "noetl.parent_execution_id"
STEP = "noetl.step"
STEP_RUN_ID = "noetl.step_run_id"
ITERATION = "noetl.iteration"
TASK = "noetl.task"
ATTEMPT = "noetl.attempt"
TOOL_KIND = "noetl.tool.kind"
STATUS = "noetl.status"
POOL = "noetl.pool"
EVENT = "noetl.event"
SERVICE = "noetl.service"

_tracers: dict[str, Any] = {}  # service -> its tracer (the SDK's when exporting, else the no-op one)
_providers: dict[str, Any] = {}  # service -> its SDK tracer provider
_config_key: tuple | None = None
_exporting = False
_forced_ids: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("noetl_forced_ids", default=None)


# ------------------------------------------------------------------------------ configuration
def configuration(env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The exporters the ``OTEL_*`` variables ask for (``()``: export off)."""
    env = os.environ if env is None else env
    if (env.get("OTEL_SDK_DISABLED") or "").strip().lower() == "true":
        return ()
    named = [e.strip().lower() for e in (env.get("OTEL_TRACES_EXPORTER") or "").split(",") if e.strip()]
    if not named:
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        return ("otlp",) if endpoint else ()
    return tuple(e for e in named if e != "none")


def setup(service: str, exporter: Any = None) -> Any:
    """The tracer of ``service`` in this process, made once per service and configuration (the
    ``OTEL_*`` variables as they are now): an SDK tracer exporting as the variables say, or the no-op
    tracer when nothing is to be exported. ``exporter``: an extra span exporter (tests)."""
    global _config_key, _exporting
    service = _short(service)
    exporters = configuration()
    key = (exporters, tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("OTEL_"))))
    if key != _config_key:  # the variables changed (tests): new tracers from now on
        flush()
        _tracers.clear()
        _providers.clear()
        _config_key = key
    _exporting = bool(exporters) or exporter is not None
    if service in _tracers and exporter is None:
        return _tracers[service]
    if not _exporting:
        _tracers[service] = _NOOP
        return _NOOP
    provider = _provider(service, exporters, exporter)
    _providers[service] = provider
    _tracers[service] = provider.get_tracer("noetl")
    return _tracers[service]


def _provider(service: str, exporters: tuple[str, ...], extra: Any) -> Any:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    from .metrics import _version

    resource = Resource.create({"service.name": f"noetl-{service}", "service.namespace": "noetl",
                                "service.version": _version(), "service.instance.id": uuid.uuid4().hex,
                                SERVICE: service})
    provider = TracerProvider(resource=resource, id_generator=_Ids())
    for name in exporters:
        if name == "otlp":
            protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf")
            if protocol != "http/protobuf":
                log.warning("OTEL_EXPORTER_OTLP_PROTOCOL=%s: only http/protobuf is installed; exporting with it",
                            protocol)
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        elif name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        else:
            log.warning("OTEL_TRACES_EXPORTER: unknown exporter %r ignored (known: otlp, console, none)", name)
    if extra is not None:
        provider.add_span_processor(SimpleSpanProcessor(extra))
    return provider


def exporting() -> bool:
    """Whether spans are recorded and exported in this process."""
    return _exporting


def flush(timeout_ms: int = 5000) -> None:
    """Export what the batch processors hold (a stopping service; tests)."""
    for provider in list(_providers.values()):
        try:
            provider.force_flush(timeout_ms)
        except Exception:  # noqa: BLE001 - an unreachable collector must not stop a service
            pass


def tracer(service: str) -> Any:
    return _tracers.get(_short(service)) or setup(service)


def _short(service: str) -> str:
    return service[6:] if service.startswith("noetl-") else service


class _Ids:
    """Random ids (as the SDK's), except where a span must have a given identity: an execution's root."""

    def generate_span_id(self) -> int:
        forced = _forced_ids.get()
        return forced[1] if forced else int.from_bytes(os.urandom(8), "big") or 1

    def generate_trace_id(self) -> int:
        forced = _forced_ids.get()
        return forced[0] if forced else int.from_bytes(os.urandom(16), "big") or 1

    def is_trace_id_random(self) -> bool:
        return False  # an execution's trace id is its id


# ------------------------------------------------------------------------------ ids
def trace_id_of(execution_id: str) -> int:
    """An execution's trace id: its id when that is 32 hex digits (the gateway's), else the first 128
    bits of its BLAKE2b hash."""
    if _HEX32.match(execution_id) and int(execution_id, 16):
        return int(execution_id, 16)
    return int.from_bytes(hashlib.blake2b(execution_id.encode(), digest_size=16).digest(), "big") or 1


def root_span_id(execution_id: str) -> int:
    """The span id of an execution's root span (:func:`execution_root`)."""
    return int.from_bytes(hashlib.blake2b(b"root\x1f" + execution_id.encode(), digest_size=8).digest(), "big") or 1


def root_context(execution_id: str) -> SpanContext:
    return SpanContext(trace_id_of(execution_id), root_span_id(execution_id), is_remote=True, trace_flags=SAMPLED)


def current_trace_id() -> dict[str, str] | None:
    """``{trace_id}`` of the current span (for exemplars), None without a valid one."""
    ctx = trace.get_current_span().get_span_context()
    return {"trace_id": format(ctx.trace_id, "032x")} if ctx.is_valid else None


def current_ids() -> tuple[str | None, str | None]:
    """The current trace and span ids in hex (for log lines), or Nones."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None, None
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")


# ------------------------------------------------------------------------------ spans
def inject(headers: dict[str, str]) -> dict[str, str]:
    _propagator.inject(headers)
    return headers


def extract(headers: Mapping[str, str] | None) -> Any:
    """The context a message's ``traceparent`` names (W3C version 00 parsed here, quickly: every
    delivery pays it; anything else through OpenTelemetry's propagator); an empty one without."""
    tp = headers.get("traceparent") if headers else None
    if not tp:
        return otel_context.Context()
    parts = tp.split("-")
    if len(parts) != 4 or parts[0] != "00" or len(parts[1]) != 32 or len(parts[2]) != 16 or len(parts[3]) != 2:
        return _propagator.extract(dict(headers))
    try:
        tid, sid, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
    except ValueError:
        return otel_context.Context()
    if not tid or not sid:
        return otel_context.Context()
    return trace.set_span_in_context(NonRecordingSpan(SpanContext(tid, sid, is_remote=True,
                                                                  trace_flags=TraceFlags(flags))))


def _parent(incoming: Any, execution_id: str | None) -> tuple[Any, list[Link] | None]:
    """The context to start a span in and its links: the incoming one, unless it belongs to another
    trace than the execution's (then the execution's root, linked to the incoming span)."""
    if execution_id is None:
        return incoming, None
    sc = trace.get_current_span(incoming).get_span_context()
    tid = trace_id_of(execution_id)
    if sc.trace_id == tid:
        return incoming, None
    parent = trace.set_span_in_context(NonRecordingSpan(root_context(execution_id)), incoming)
    return parent, ([Link(sc)] if sc.is_valid else None)


@contextlib.contextmanager
def consume_span(name: str, headers: Mapping[str, str] | None, *, service: str,
                 execution_id: str | None = None, **attributes: Any) -> Iterator[trace.Span]:
    """A span for a received message, continuing the sender's trace (or the execution's: see the module)."""
    incoming = extract(headers)
    parent, links = _parent(incoming, execution_id)
    if not _exporting:  # no span: the received context is the current one (for what is sent meanwhile)
        token = otel_context.attach(parent)
        try:
            yield trace.get_current_span(parent)
        finally:
            otel_context.detach(token)
        return
    if execution_id is not None:
        attributes[EXECUTION_ID] = execution_id
    with tracer(service).start_as_current_span(name, context=parent, kind=SpanKind.CONSUMER,
                                               attributes=attributes, links=links) as s:
        yield s


@contextlib.contextmanager
def span(name: str, *, service: str, execution_id: str | None = None, **attributes: Any) -> Iterator[trace.Span]:
    """A span in the current context (in the execution's trace when ``execution_id`` is given)."""
    parent, links = _parent(otel_context.get_current(), execution_id)
    if execution_id is not None:
        attributes[EXECUTION_ID] = execution_id
    with tracer(service).start_as_current_span(name, context=parent, attributes=attributes, links=links) as s:
        yield s


def otel_context_of(s: trace.Span):
    """A context manager making ``s`` the current span (not ending it)."""
    return trace.use_span(s, end_on_exit=False)


def start_span(name: str, *, service: str, start_time: int | None = None, **attributes: Any) -> trace.Span:
    """A child span of the current one, started now (or at ``start_time``, ns) and ended by the caller."""
    return tracer(service).start_span(name, attributes=attributes, start_time=start_time)


def execution_root(service: str, execution_id: str, *, start_time: float | None, status: str,
                   path: str | None = None, parent_execution_id: str | None = None) -> None:
    """Record the execution's root span (its trace's root), from ``start_time`` (the request's time,
    epoch seconds) to now, once the execution has finished. A child's root links to its parent's."""
    if not _exporting:
        return
    links = [Link(root_context(parent_execution_id))] if parent_execution_id else None
    attributes = {EXECUTION_ID: execution_id, STATUS: status}
    if path:
        attributes["noetl.path"] = path
    if parent_execution_id:
        attributes[PARENT_EXECUTION_ID] = parent_execution_id
    token = _forced_ids.set((trace_id_of(execution_id), root_span_id(execution_id)))
    try:
        s = tracer(service).start_span(f"execution {path or execution_id}", context=otel_context.Context(),
                                       kind=SpanKind.INTERNAL, attributes=attributes, links=links,
                                       start_time=int(start_time * 1e9) if start_time else None)
    finally:
        _forced_ids.reset(token)
    if status != "COMPLETED":
        s.set_status(trace.Status(trace.StatusCode.ERROR, status))
    s.end()
