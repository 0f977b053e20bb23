"""W3C trace context on every NATS message, so one execution is one trace across services.

:func:`setup` installs an SDK tracer provider for a service (with an OTLP exporter when
``OTEL_EXPORTER_OTLP_ENDPOINT`` is set and the exporter package is installed; spans are otherwise
created and propagated but not exported). :func:`inject` adds ``traceparent`` to outgoing headers;
:func:`consume_span` continues the sender's trace while a message is handled.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_propagator = TraceContextTextMapPropagator()
_tracer = trace.get_tracer("noetl")


def setup(service: str, exporter=None) -> TracerProvider:
    """Install a tracer provider named after the service (once per process)."""
    global _tracer
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider(resource=Resource.create({"service.name": f"noetl-{service}"}))
        if exporter is None and os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            try:  # optional: opentelemetry-exporter-otlp
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

                exporter = OTLPSpanExporter()
            except ImportError:
                exporter = None
        if exporter is not None:
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            provider.add_span_processor(BatchSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
    _tracer = trace.get_tracer("noetl")
    return provider


def inject(headers: dict[str, str]) -> dict[str, str]:
    _propagator.inject(headers)
    return headers


@contextlib.contextmanager
def consume_span(name: str, headers: Mapping[str, str] | None, **attributes) -> Iterator[trace.Span]:
    ctx = _propagator.extract(dict(headers or {}))
    token = otel_context.attach(ctx)
    try:
        with _tracer.start_as_current_span(name, kind=SpanKind.CONSUMER, attributes=attributes) as span:
            yield span
    finally:
        otel_context.detach(token)


@contextlib.contextmanager
def span(name: str, **attributes) -> Iterator[trace.Span]:
    with _tracer.start_as_current_span(name, attributes=attributes) as s:
        yield s
