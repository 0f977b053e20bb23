"""What an operator sees of a running stack: the metrics port of its process (/metrics, /livez, /readyz)
and the traces it exports over OTLP/HTTP to a receiver on loopback, decoded with OpenTelemetry's own
protobuf package. One stack for the module, exporting (OTEL_EXPORTER_OTLP_ENDPOINT set before it starts)."""
from __future__ import annotations

import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

import httpx
import pytest
import yaml
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from prometheus_client.parser import text_string_to_metric_families

from noetl_mesh.infra import tracing

from conftest import start_stack, stop_stack

pytestmark = pytest.mark.integration

FLAKY = {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "flaky", "path": "tests/flaky"},
         "workflow": [
             {"step": "start", "tool": [
                 {"name": "call", "kind": "playbook", "path": "tests/obs_child", "args": {"n": 2}}],
              "next": {"arcs": [{"step": "flaky"}]}},
             {"step": "flaky", "tool": [
                 {"name": "boom", "kind": "python", "code": "raise ValueError('not yet')",
                  "spec": {"policy": {"rules": [
                      {"when": "{{ outcome.status == 'error' and _attempt < 2 }}",
                       "then": {"do": "retry", "attempts": 3, "delay": 0.01}},
                      {"else": {"then": {"do": "continue"}}}]}}},
                 {"name": "done", "kind": "noop", "result": "ok"}]}]}
CHILD = {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "obs_child", "path": "tests/obs_child"},
         "workflow": [{"step": "start", "tool": {"kind": "noop", "result": "{{ args.n }}"}}]}


class OtlpReceiver:
    """An OTLP/HTTP traces endpoint on loopback: every span received, with its service."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, Any]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                with receiver.lock:
                    for rs in request.resource_spans:
                        attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                        for ss in rs.scope_spans:
                            receiver.spans += [(attrs.get("service.name"), s) for s in ss.spans]
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def of(self, trace_id: int) -> list[tuple[str, Any]]:
        with self.lock:
            return [(svc, s) for svc, s in self.spans if int.from_bytes(s.trace_id, "big") == trace_id]


@pytest.fixture(scope="module")
def otlp() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    saved = {k: os.environ.get(k) for k in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_BSP_SCHEDULE_DELAY")}
    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.url
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"
    yield receiver
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    receiver.server.shutdown()


@pytest.fixture(scope="module")
def obs_stack(module_pg, otlp):
    nats, loop, handle = start_stack(module_pg, settings_kw={"metrics_port": 0})
    yield handle
    stop_stack(nats, loop, handle)


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def total(samples: dict, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def run(stack, doc: dict, workload: dict | None = None) -> tuple[dict, list[dict]]:
    final, events = stack.execute(doc, workload)
    return final, events


def test_metrics_move_with_work(obs_stack) -> None:
    url = obs_stack.metrics_url
    assert url and httpx.get(f"{url}/livez").status_code == 200
    ready = httpx.get(f"{url}/readyz", timeout=10)
    assert ready.status_code == 200, ready.text
    services = ready.json()["services"]
    assert {"gateway", "admission", "router", "loop-coordinator", "event-recorder", "worker", "sessions",
            "scheduler"} <= set(services)
    assert services["event-recorder"]["database"] is True and services["event-recorder"]["consumer"] is True
    assert services["router"]["partitions"] == 16 and all(s["nats"] == "connected" for s in services.values())

    before = scrape(url)
    doc = {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "m", "path": "tests/metrics"},
           "workflow": [{"step": "start", "tool": {"kind": "noop", "result": "{{ workload.big | length }}"},
                         "next": {"arcs": [{"step": "second"}]}},
                        {"step": "second", "tool": {"kind": "python", "code": "result = 1"}}]}
    final, _ = run(obs_stack, doc, {"big": "x" * 300_000})  # over 256 KiB: the request's workload by reference
    assert final["status"] == "COMPLETED", final
    deadline = time.monotonic() + 10
    while True:  # the recorder writes the last events a moment after the execution is seen finished
        after = scrape(url)
        if total(after, "noetl_recorder_batch_events_count") > total(before, "noetl_recorder_batch_events_count") \
                and total(after, "noetl_events_handled_total", service="event-recorder") >= \
                total(before, "noetl_events_handled_total", service="event-recorder") + 10:
            break
        assert time.monotonic() < deadline, "the recorder's figures did not move"
        time.sleep(0.2)

    def moved(name: str, by: float = 1, **labels: str) -> None:
        delta = total(after, name, **labels) - total(before, name, **labels)
        assert delta >= by, f"{name}{labels}: moved by {delta}, expected at least {by}"

    moved("noetl_executions_started_total", service="admission")
    moved("noetl_executions_finished_total", service="router", status="COMPLETED")
    moved("noetl_events_handled_total", 3, service="router", **{"class": "ctl"})
    moved("noetl_decision_seconds_count", 2, service="admission")
    moved("noetl_task_duration_seconds_count", service="worker", kind="noop", status="ok")
    moved("noetl_task_duration_seconds_count", service="worker", kind="python", status="ok")
    moved("noetl_step_duration_seconds_count", 2, service="worker", kind="run", status="success")
    moved("noetl_commands_total", 2, service="worker", outcome="acked")
    moved("noetl_http_request_duration_seconds_count", service="gateway", method="POST", route="/api/executions",
          status="202")
    moved("noetl_http_request_duration_seconds_count", service="gateway", method="GET",
          route="/api/executions/{execution_id}", status="200")
    moved("noetl_request_duration_seconds_count", service="event-recorder", subject="noetl.q.execution.get",
          outcome="ok")
    moved("noetl_payload_store_bytes_total", 300_000, service="gateway", op="put")
    moved("noetl_payload_store_bytes_total", 300_000, service="admission", op="get")
    assert total(after, "noetl_commands_in_flight", service="worker") == 0
    pending = {dict(ls)["partition"] for (n, ls) in after if n == "noetl_consumer_pending" and
               dict(ls)["service"] == "router"}
    assert pending and pending <= {str(p) for p in range(16)}  # the partitions it read from, by label
    assert total(after, "noetl_build_info", service="router") == 1

    # OpenMetrics: the same figures, with the trace ids of exported spans as exemplars
    om = httpx.get(f"{url}/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}).text
    assert om.rstrip().endswith("# EOF")
    assert any("noetl_decision_seconds_bucket" in line and '# {trace_id="' in line for line in om.splitlines())


def test_one_trace_per_execution_across_services(obs_stack, otlp) -> None:
    async def register():
        async with obs_stack.client() as client:
            await client.register(yaml.safe_dump(CHILD))

    obs_stack.run(register())
    final, events = run(obs_stack, FLAKY)
    assert final["status"] == "COMPLETED", final
    eid = final["execution_id"]
    child = next(e["data"]["child"]["execution_id"] for e in events if e["name"] == "task.suspended")
    tid, child_tid = tracing.trace_id_of(eid), tracing.trace_id_of(child)
    assert tid == int(eid, 16)  # the gateway's ids are trace ids as they are

    deadline = time.monotonic() + 15
    while True:  # the root spans come last (the router writes them when each execution ends)
        obs_stack.run(_flush())
        spans = otlp.of(tid)
        roots = [s for _, s in spans if not s.parent_span_id]
        if roots and [s for _, s in otlp.of(child_tid) if not s.parent_span_id] and \
                any(s.name == "task done" for _, s in spans):
            break
        assert time.monotonic() < deadline, f"no complete trace: {[(svc, s.name) for svc, s in spans]}"
        time.sleep(0.3)

    def attrs(s) -> dict[str, Any]:
        out = {}
        for a in s.attributes:
            v = a.value
            out[a.key] = v.string_value if v.HasField("string_value") else v.int_value if v.HasField("int_value") \
                else v.bool_value if v.HasField("bool_value") else v.double_value
        return out

    # one tree: a single root (the execution), every other span's parent is in the trace
    [root] = roots
    assert root.name == "execution tests/flaky" and root.span_id == tracing.root_span_id(eid).to_bytes(8, "big")
    assert attrs(root)["noetl.status"] == "COMPLETED"
    ids = {s.span_id for _, s in spans}
    assert all(s.parent_span_id in ids for _, s in spans if s is not root)
    services = {svc for svc, _ in spans}
    assert {"noetl-gateway", "noetl-admission", "noetl-router", "noetl-worker"} <= services, services
    # the root spans the execution: from its request (made inside the gateway's sending span) to its end
    # (the router writes it while deciding the end, inside that decision's span)
    assert root.start_time_unix_nano <= min(s.start_time_unix_nano for svc, s in spans if svc != "noetl-gateway")
    assert root.end_time_unix_nano >= max(s.end_time_unix_nano for svc, s in spans if svc == "noetl-worker")

    # a span per step run (on the worker) and per task attempt, with their attributes
    steps = {attrs(s)["noetl.step"]: s for svc, s in spans if svc == "noetl-worker" and s.name.startswith("step ")}
    assert set(steps) == {"start", "flaky"}
    flaky = steps["flaky"]
    tasks = [s for _, s in spans if s.name == "task boom"]
    assert sorted(attrs(t)["noetl.attempt"] for t in tasks) == [1, 2]
    for t in tasks:
        a = attrs(t)
        assert t.parent_span_id == flaky.span_id and a["noetl.tool.kind"] == "python" and a["noetl.status"] == "error"
        assert a["noetl.execution_id"] == eid and a["noetl.step"] == "flaky" and a["noetl.task"] == "boom"
    [done] = [s for _, s in spans if s.name == "task done"]
    assert attrs(done)["noetl.tool.kind"] == "noop" and attrs(done)["noetl.status"] == "ok"
    # span events: the retry, and the policy's directives (retry, then continue)
    names = [e.name for e in flaky.events]
    assert names.count("retry") == 1 and names.count("policy") == 2
    directives = [next(a.value.string_value for a in e.attributes if a.key == "noetl.policy.do")
                  for e in flaky.events if e.name == "policy"]
    assert directives == ["retry", "continue"]

    # the control plane's decisions are in the same trace, under the execution's root or a message's span
    decided = {s.name for svc, s in spans if svc in ("noetl-admission", "noetl-router")}
    assert "admission playbook.execution.requested" in decided and any(n.startswith("router ") for n in decided)
    # the gateway's request went out in the execution's trace, linked to the HTTP request's span
    [sent] = [s for svc, s in spans if s.name == "gateway playbook.execution.requested"]
    assert sent.parent_span_id == root.span_id and len(sent.links) == 1

    # the child: a trace of its own, whose root links to the parent's root
    child_spans = otlp.of(child_tid)
    [child_root] = [s for _, s in child_spans if not s.parent_span_id]
    assert [(int.from_bytes(link.trace_id, "big"), link.span_id) for link in child_root.links] == \
           [(tid, root.span_id)]
    assert attrs(child_root)["noetl.parent_execution_id"] == eid
    assert any(s.name == "step start" for svc, s in child_spans if svc == "noetl-worker")


async def _flush() -> None:
    tracing.flush()


def test_log_lines_name_the_execution_and_its_trace(obs_stack) -> None:
    """A record a service makes while handling an execution's message carries the execution's id and
    trace id (here: the control plane dropping an event its subject's writer may not write)."""
    import io
    import json
    import logging

    from noetl_mesh.core.events import make_event
    from noetl_mesh.infra import logs
    from noetl_mesh.infra.bus import EVENTS, Bus, dumps

    final, _ = run(obs_stack, {"apiVersion": "noetl.io/v2", "kind": "Playbook",
                               "metadata": {"name": "l", "path": "tests/logs"},
                               "workflow": [{"step": "start", "tool": {"kind": "noop"}}]})
    eid = final["execution_id"]
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(logs.ContextFilter())
    handler.setFormatter(logs.JsonFormatter())
    logging.getLogger("noetl.bus").addHandler(handler)
    try:
        async def forge():
            bus = await Bus.connect(obs_stack.nats_url, "forger", obs_stack.admin)
            try:  # the router may not write task.started: every control-plane reader drops it, loudly
                event = make_event("task.started", eid, event_id="forged-log", source="router", status="in_progress")
                await bus.js.publish(f"noetl.evt.router.ctl.{eid}", dumps([event]), stream=EVENTS)
            finally:
                await bus.close()

        obs_stack.run(forge())
        deadline = time.monotonic() + 10
        while True:
            lines = [json.loads(line) for line in out.getvalue().splitlines()]
            dropped = [line for line in lines if "forged-log" in line["message"]]
            if {line["service"] for line in dropped} >= {"admission", "router", "event-recorder"}:
                break
            assert time.monotonic() < deadline, lines
            time.sleep(0.1)
    finally:
        logging.getLogger("noetl.bus").removeHandler(handler)
    for line in dropped:
        assert line["execution_id"] == eid and line["trace_id"] == eid and line["level"] == "ERROR", line
