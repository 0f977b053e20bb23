"""Every Prometheus metric of the engine, in one place (docs/operations.md, "Metrics").

The services' shells record into these (never the pure core); :mod:`.probes` serves them, with the
liveness and readiness checks, on each process's metrics port. One registry per process: a process
that runs several services (``noetl run``, ``noetl up --in-process``, the tests) tells them apart by
the ``service`` label every metric carries. Label values are bounded: service and pool names, event
classes, tool kinds, statuses, route templates (never a raw path), request subjects from the fixed
list of :mod:`noetl_mesh.contracts.subjects`.

Exemplars: a histogram observation or counter increment made while a span is being exported carries
``{trace_id}`` (OpenMetrics exposition only: a scraper that asks for ``application/openmetrics-text``
sees them; the classic text format has no exemplars).
"""
from __future__ import annotations

from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from . import tracing

# seconds: from a millisecond to ten minutes
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 600.0)
_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_SIZES = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)

registry: CollectorRegistry = REGISTRY  # the process's (with the default process and GC collectors)

BUILD_INFO = Gauge("noetl_build_info", "1 for each service running in this process, with its version",
                   ["service", "version"], registry=registry)

# ---- the control plane (admission, router, loop-coordinator) and the recorder
EVENTS_HANDLED = Counter(
    "noetl_events_handled_total",
    "Events handled, by subject class (ctl, loop, dispatch, info): folded by a control-plane service, "
    "recorded by the event-recorder", ["service", "class"], registry=registry)
DECISION = Histogram(
    "noetl_decision_seconds",
    "A control-plane delivery from its receipt to its decision stored: fold, decide, publish, every PubAck",
    ["service"], buckets=_FAST, registry=registry)
PENDING = Gauge(
    "noetl_consumer_pending",
    "Messages of a durable consumer not yet delivered (its lag), as of the last delivery this process "
    "received from it; partition '-' for consumers that are not per partition", ["service", "consumer", "partition"],
    registry=registry)
REBUILDS = Counter("noetl_rebuilds_total", "Execution states rebuilt from the stream (D22)", ["service"],
                   registry=registry)
EXECUTIONS_STARTED = Counter("noetl_executions_started_total", "Executions started (workflow.started written)",
                             ["service"], registry=registry)
EXECUTIONS_FINISHED = Counter("noetl_executions_finished_total",
                              "Executions finished (workflow.finished written), by final status",
                              ["service", "status"], registry=registry)

# ---- workers
IN_FLIGHT = Gauge("noetl_commands_in_flight", "Commands a worker holds and runs now", ["service", "pool"],
                  registry=registry)
COMMANDS = Counter(
    "noetl_commands_total",
    "Commands a worker finished with: acked (events stored), retried (nak'ed: redelivered later), dropped "
    "(malformed), payload_missing, cancelled", ["service", "pool", "outcome"], registry=registry)
TASK_DURATION = Histogram("noetl_task_duration_seconds", "One task attempt, by tool kind and outcome status",
                          ["service", "pool", "kind", "status"], buckets=_LATENCY, registry=registry)
STEP_DURATION = Histogram(
    "noetl_step_duration_seconds",
    "A step run (kind run) or loop iteration (kind iteration) on a worker, from the command's start to its "
    "terminal event, by status (success, error, suspended)", ["service", "pool", "kind", "status"],
    buckets=_LATENCY, registry=registry)

# ---- the event-recorder
RECORDER_BATCH = Histogram("noetl_recorder_batch_events", "Events written per recorder batch (one transaction)",
                           ["service"], buckets=_SIZES, registry=registry)
RECORDER_LAG = Histogram(
    "noetl_recorder_lag_seconds",
    "From an event message's publication to its row committed (the batch's oldest message)",
    ["service"], buckets=_LATENCY, registry=registry)
RECORDER_REJECTED = Counter("noetl_recorder_rejected_total", "Events recorded as rejected (Postgres refused them)",
                            ["service"], registry=registry)

# ---- request/reply, HTTP, payloads
REQUESTS = Histogram("noetl_request_duration_seconds",
                     "NATS requests served (request/reply), by subject and outcome (ok or the error kind)",
                     ["service", "subject", "outcome"], buckets=_FAST, registry=registry)
HTTP = Histogram("noetl_http_request_duration_seconds",
                 "Gateway HTTP requests by route template, method and status code",
                 ["service", "method", "route", "status"], buckets=_FAST, registry=registry)
PAYLOAD_BYTES = Counter("noetl_payload_store_bytes_total",
                        "Bytes written to (put) and read from (get) the payload object store (D23)",
                        ["service", "op"], registry=registry)
PAYLOAD_OBJECTS = Counter("noetl_payload_store_objects_total", "Objects written to and read from the payload store",
                          ["service", "op"], registry=registry)


def exemplar() -> dict[str, str] | None:
    """``{trace_id}`` of the span being exported now, else None (no exemplar)."""
    return tracing.current_trace_id() if tracing.exporting() else None


def started(service: str) -> None:
    """Mark ``service`` as running in this process (``noetl_build_info``)."""
    BUILD_INFO.labels(service, _version()).set(1)


def stopped(service: str) -> None:
    try:
        BUILD_INFO.remove(service, _version())
    except KeyError:
        pass


def forget_pending(service: str, consumer: str, partition: Any = "-") -> None:
    """A consumer this process no longer reads (a partition handed to another replica): its figure goes
    stale, so it is removed (the new reader reports it)."""
    try:
        PENDING.remove(service, consumer, str(partition))
    except KeyError:
        pass


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("noetl-mesh")
    except Exception:  # noqa: BLE001 - running from a source tree without metadata
        return "unknown"


__all__ = [name for name in dir() if name.isupper()] + ["exemplar", "started", "stopped", "forget_pending",
                                                         "registry"]
