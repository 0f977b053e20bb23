"""The operator's side of a process without a stack: which OTEL_* settings export, an execution's trace
id, log lines with their execution and trace, and the metrics port's answers (a real HTTP server on
loopback, a real event loop)."""
from __future__ import annotations

import asyncio
import io
import json
import logging
import threading
import time

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from noetl_mesh import limits
from noetl_mesh.infra import logs, metrics, tracing
from noetl_mesh.infra.probes import PortTaken, ProbeServer


@pytest.mark.parametrize("env, exporters", [
    ({}, ()),  # nothing set: nothing exported
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, ("otlp",)),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, ("otlp",)),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, ("otlp",)),  # the exporter's default endpoint (localhost:4318)
    ({"OTEL_TRACES_EXPORTER": "console,otlp"}, ("console", "otlp")),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, ()),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, ()),
])
def test_which_settings_export(env, exporters):
    assert tracing.configuration(env) == exporters


def test_an_executions_trace_id_is_its_id():
    eid = "0123456789abcdef0123456789abcdef"
    assert tracing.trace_id_of(eid) == int(eid, 16)
    child = "a1b2c3d4e5f6a1b2c3d4e5f6"  # a child's id (24 hex digits): hashed, stable, 128 bits
    assert tracing.trace_id_of(child) == tracing.trace_id_of(child) != int(child, 16)
    assert 0 < tracing.trace_id_of(child) < 2 ** 128
    assert tracing.trace_id_of("0" * 32) != 0  # never the invalid id
    assert tracing.root_span_id(eid) != tracing.root_span_id(child)


def test_without_export_spans_cost_nothing_but_the_trace_context_travels(monkeypatch):
    for k in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(k, raising=False)
    tracing.setup("unit-a")
    assert not tracing.exporting()
    eid = "0123456789abcdef0123456789abcdef"
    with tracing.span("x", service="unit-a", execution_id=eid) as s:
        assert not s.is_recording()
        headers = tracing.inject({})
    assert headers["traceparent"].split("-")[1] == eid  # the execution's trace, no span made
    with tracing.consume_span("y", headers, service="unit-a", execution_id=eid):
        assert tracing.inject({})["traceparent"] == headers["traceparent"]


def test_spans_join_the_executions_trace_and_link_what_they_came_from(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")  # no network exporter; the in-memory one below
    memory = InMemorySpanExporter()
    tracing.setup("unit-b", exporter=memory)
    eid = "fedcba9876543210fedcba9876543210"
    other = {"traceparent": "00-11111111111111111111111111111111-2222222222222222-01"}
    with tracing.consume_span("admission x", other, service="unit-b", execution_id=eid, **{tracing.EVENT: "e"}):
        with tracing.span("inner", service="unit-b"):
            pass
    tracing.execution_root("unit-b", eid, start_time=time.time() - 1, status="FAILED", path="p",
                           parent_execution_id="0123456789abcdef0123456789abcdef")
    inner, outer, root = memory.get_finished_spans()
    assert outer.context.trace_id == inner.context.trace_id == root.context.trace_id == int(eid, 16)
    assert outer.parent.span_id == tracing.root_span_id(eid) and inner.parent.span_id == outer.context.span_id
    assert [link.context.trace_id for link in outer.links] == [0x11111111111111111111111111111111]
    assert root.parent is None and root.context.span_id == tracing.root_span_id(eid)
    assert root.status.status_code.name == "ERROR" and root.attributes[tracing.PARENT_EXECUTION_ID]
    assert root.links[0].context.span_id == tracing.root_span_id("0123456789abcdef0123456789abcdef")
    assert root.resource.attributes["service.name"] == "noetl-unit-b"


def _record(fmt: str, **kw) -> str:
    out = io.StringIO()
    logs.configure("unit", fmt, "INFO", stream=out)
    try:
        logging.getLogger("noetl.test").warning("hello %s", "there", **kw)
    finally:
        logging.getLogger().handlers.clear()
    return out.getvalue()


def test_log_lines_carry_the_execution_and_trace(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    tracing.setup("unit-c", exporter=InMemorySpanExporter())
    eid = "00112233445566778899aabbccddeeff"
    plain = json.loads(_record("json"))
    assert plain["message"] == "hello there" and plain["service"] == "unit" and plain["level"] == "WARNING"
    assert "execution_id" not in plain and "trace_id" not in plain  # none here: none said
    with logs.bind(eid), tracing.span("s", service="unit-c", execution_id=eid):
        line = json.loads(_record("json"))
        text = _record("text")
        try:
            raise ValueError("bad")
        except ValueError:
            failed = json.loads(_record("json", exc_info=True))
    assert line["execution_id"] == eid and line["trace_id"] == eid and len(line["span_id"]) == 16
    assert f"[execution={eid} trace={eid}]" in text and " unit WARNING noetl.test: hello there" in text
    assert "ValueError: bad" in failed["exception"] and failed["exception"].startswith("Traceback")
    with pytest.raises(ValueError, match="log format"):
        logs.configure("unit", "xml")


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def test_the_metrics_port_answers_live_ready_and_metrics(loop):
    state = {"ok": True}

    async def check():
        return {"ok": state["ok"], "detail": 1}

    probes = ProbeServer(loop, "127.0.0.1", 0, token="s3cret").start()
    try:
        probes.expect("router")
        assert httpx.get(f"{probes.url}/readyz").json()["services"]["router"]["error"] == "starting"
        probes.add("router", check)
        assert httpx.get(f"{probes.url}/livez").status_code == 200
        ready = httpx.get(f"{probes.url}/readyz")
        assert ready.status_code == 200 and ready.json()["services"]["router"] == {"ok": True, "detail": 1}
        state["ok"] = False
        assert httpx.get(f"{probes.url}/readyz").status_code == 503
        metrics.REBUILDS.labels("unit").inc()
        assert httpx.get(f"{probes.url}/metrics").status_code == 401  # the token is required for metrics
        assert httpx.get(f"{probes.url}/metrics", headers={"Authorization": "Bearer nope"}).status_code == 401
        text = httpx.get(f"{probes.url}/metrics", headers={"Authorization": "Bearer s3cret"}).text
        assert 'noetl_rebuilds_total{service="unit"}' in text
        assert httpx.get(f"{probes.url}/other").status_code == 404

        # a stalled loop: not alive (restart it), not ready; /metrics still answers (its own thread)
        blocked = threading.Event()
        loop.call_soon_threadsafe(lambda: blocked.wait(8))
        import noetl_mesh.infra.probes as probes_module

        old = probes_module.LIVE_TIMEOUT
        probes_module.LIVE_TIMEOUT = 0.5
        try:
            live = httpx.get(f"{probes.url}/livez", timeout=5)
            assert live.status_code == 503 and live.json()["status"] == "stalled"
            assert httpx.get(f"{probes.url}/metrics", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        finally:
            probes_module.LIVE_TIMEOUT = old
            blocked.set()
        with pytest.raises(PortTaken, match="cannot listen"):
            ProbeServer(loop, "127.0.0.1", probes.port).start()
    finally:
        probes.stop()


def test_the_metrics_port_bounds_its_connections(loop, monkeypatch):
    import socket

    with limits.override(metrics_connections=2, metrics_request_seconds=1):
        probes = ProbeServer(loop, "127.0.0.1", 0).start()
    idle = []
    try:
        for _ in range(2):  # two clients that connect and say nothing hold both slots ...
            idle.append(socket.create_connection(("127.0.0.1", probes.port)))
        time.sleep(0.2)
        with pytest.raises(httpx.TransportError):  # ... so a third is closed unanswered
            httpx.get(f"{probes.url}/livez", timeout=3)
        time.sleep(1.5)  # the idle ones are dropped after IO_TIMEOUT: the port answers again
        assert httpx.get(f"{probes.url}/livez", timeout=3).status_code == 200
    finally:
        for s in idle:
            s.close()
        probes.stop()
