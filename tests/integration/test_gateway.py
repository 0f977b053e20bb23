"""The gateway's HTTP API over real NATS and a real event-recorder (Postgres)."""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import httpx

from noetl_mesh import limits
import pytest
import yaml
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from noetl_mesh.core.local import run_local
from noetl_mesh.core.state import summary
from noetl_mesh.infra import micro
from noetl_mesh.infra.bus import EVENTS, Bus, loads
from noetl_mesh.stack import Settings, start_service, stop_service
from noetl_mesh.services.event_recorder.service import RecorderService
from noetl_mesh.services.gateway.app import GatewayService, create_app
from noetl_mesh.services.sessions.audit import STREAM as AUDIT
from noetl_mesh.services.sessions.service import Q_BOOTSTRAP, SessionsService
from noetl_mesh.services.sessions.store import LOGINS, SESSIONS, USERS
from scenarios import TINY

pytestmark = pytest.mark.integration

VALID = TINY
INVALID = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: broken}
workflow:
  - step: start
    tool: {kind: nosuchtool}
    next: {arcs: [{step: nowhere}]}
  - step: start
    case: []
"""


async def fresh_bus(nats_url: str) -> Bus:
    """A bus on an empty events stream (the NATS server is shared by the whole test session)."""
    bus = await Bus.connect(nats_url, "test")
    with contextlib.suppress(NotFoundError):
        await bus.js.delete_stream(EVENTS)
    await bus.setup(partitions=4)
    return bus


async def fresh_admin(bus: Bus) -> tuple[SessionsService, str]:
    """A sessions service on empty buckets, and the bootstrap admin's API token."""
    for stream in (f"KV_{SESSIONS}", f"KV_{USERS}", f"KV_{LOGINS}", AUDIT):
        with contextlib.suppress(NotFoundError):
            await bus.js.delete_stream(stream)
    sessions = SessionsService(bus, oidc=None)
    await sessions.start()
    return sessions, (await bus.request(Q_BOOTSTRAP, {}))["token"]


@contextlib.asynccontextmanager
async def stack(nats_url: str, pg_dsn: str, control_plane: list | None = None):
    """The recorder and the sessions service on one bus, a gateway app on it; with ``control_plane``
    (a list, filled with what started) also admission, router, loop-coordinator and credentials as the service
    runtime starts them, each a NATS micro service as the gateway's readiness wants them."""
    bus = await fresh_bus(nats_url)
    rec = RecorderService(bus, pg_dsn=pg_dsn)
    await rec.start()
    sessions, token = await fresh_admin(bus)
    registered = []
    if control_plane is not None:
        registered = [await micro.register("event-recorder", bus, rec), await micro.register("sessions", bus, sessions)]
        settings = Settings(nats_url=nats_url, pg_dsn=pg_dsn)
        control_plane += [await start_service(name, settings)
                          for name in ("admission", "router", "loop-coordinator", "credentials")]
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(bus)), base_url="http://gw",
                               headers={"Authorization": f"Bearer {token}"})
    try:
        yield bus, rec, client
    finally:
        await client.aclose()
        await asyncio.gather(*(stop_service(running) for running in control_plane or ()))
        for service in registered:
            with contextlib.suppress(Exception):  # a test may have closed the bus
                await service.stop()
        await sessions.stop()
        await rec.stop()
        await bus.close()


async def stream_events(bus: Bus, execution_id: str) -> list[tuple[dict[str, Any], dict[str, str]]]:
    """Every stored event of one execution, read straight from the stream, with its headers."""
    sub = await bus.js.pull_subscribe(f"noetl.pevt.*.*.{execution_id}.*", stream=EVENTS, config=ConsumerConfig(
        ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL, inactive_threshold=5.0))
    try:
        msgs = await sub.fetch(100, timeout=2)
    finally:
        await sub.unsubscribe()
    return [(e, dict(m.headers or {})) for m in msgs for e in loads(m.data)]


async def poll(client: httpx.AsyncClient, url: str, until, timeout: float = 30.0) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        resp = await client.get(url)
        if until(resp):
            return resp
        if time.monotonic() > deadline:
            raise AssertionError(f"{url}: {resp.status_code} {resp.text}")
        await asyncio.sleep(0.02)


# ------------------------------------------------------------------------------------------ tests
def test_catalog_endpoints(nats_url: str, pg_dsn: str) -> None:
    async def main() -> None:
        async with stack(nats_url, pg_dsn) as (_, _, gw):
            first = await gw.post("/api/catalog", json={"content": VALID})
            assert first.status_code == 201, first.text
            assert {k: first.json()[k] for k in ("path", "version", "name", "warnings")} == \
                   {"path": "tests/tiny", "version": 1, "name": "tiny", "warnings": []}
            second = await gw.post("/api/catalog", content=VALID.replace("n: 2", "n: 3"),
                                   headers={"content-type": "application/x-yaml"})
            assert second.status_code == 201 and second.json()["version"] == 2
            third = await gw.post("/api/catalog", content=VALID, headers={"content-type": "text/plain; charset=utf-8"})
            assert third.json()["version"] == 3

            invalid = await gw.post("/api/catalog", json={"content": INVALID})
            assert invalid.status_code == 422
            detail = invalid.json()["detail"]
            assert detail["message"] == "invalid playbook" and len(detail["errors"]) >= 3
            assert all({"location", "message", "severity"} <= set(e) <= {"location", "message", "severity", "line",
                                                                         "column"} for e in detail["errors"])
            assert all(isinstance(e.get("line"), int) for e in detail["errors"]), detail  # sent as text: located
            not_yaml = await gw.post("/api/catalog", content="a: [b", headers={"content-type": "text/yaml"})
            assert not_yaml.status_code == 422 and "YAML" in not_yaml.json()["detail"]["errors"][0]["message"]
            assert (await gw.post("/api/catalog", json={"text": VALID})).status_code == 422
            png = await gw.post("/api/catalog", content=b"x", headers={"content-type": "image/png"})
            assert png.status_code == 415

            listed = (await gw.get("/api/catalog")).json()
            assert [e["version"] for e in listed] == [3, 2, 1]
            assert [e["version"] for e in (await gw.get("/api/catalog", params={"path": "nope"})).json()] == []
            by_id = await gw.get(f"/api/catalog/{first.json()['id']}")
            assert by_id.status_code == 200 and by_id.json()["content"] == VALID
            latest = (await gw.get("/api/catalog/by-path/tests/tiny")).json()
            assert latest["version"] == 3 and latest["content"] == VALID
            v2 = (await gw.get("/api/catalog/by-path/tests/tiny", params={"version": 2})).json()
            assert "n: 3" in v2["content"]
            assert (await gw.get("/api/catalog/999999")).status_code == 404
            assert (await gw.get("/api/catalog/by-path/tests/none")).status_code == 404
            assert (await gw.get("/api/catalog/by-path/tests/tiny", params={"version": 9})).status_code == 404
            assert (await gw.get("/api/catalog/not-a-number")).status_code == 422

    asyncio.run(main())


def test_bad_execution_requests(nats_url: str, pg_dsn: str) -> None:
    async def main() -> None:
        async with stack(nats_url, pg_dsn) as (_, _, gw):
            unknown = await gw.post("/api/executions", json={"path": "tests/tiny", "colour": "red"})
            assert unknown.status_code == 422
            assert [e["location"] for e in unknown.json()["detail"]["errors"]] == ["body.colour"]
            assert unknown.json()["detail"]["message"] == "body.colour: Extra inputs are not permitted"
            none = await gw.post("/api/executions", json={"workload": {}})
            assert none.status_code == 422 and "exactly one" in none.json()["detail"]["errors"][0]["message"]
            two = await gw.post("/api/executions", json={"path": "a", "catalog_id": 1})
            assert two.status_code == 422 and "path, catalog_id" in two.json()["detail"]["message"]
            everything = await gw.post("/api/executions", json={"workload": [1], "extra": 1, "version": "x"})
            kinds = {e["type"] for e in everything.json()["detail"]["errors"]}
            assert {"dict_type", "extra_forbidden", "int_parsing", "exactly_one_source"} <= kinds
            assert everything.json()["detail"]["message"].endswith(f"(and {len(everything.json()['detail']['errors']) - 1} more)")
            malformed = await gw.post("/api/executions", content=b"{not json", headers={"content-type": "application/json"})
            assert malformed.status_code == 400 and "line 1, column 2" in malformed.json()["detail"]["message"]

            inline = await gw.post("/api/executions", json={"playbook": INVALID})
            assert inline.status_code == 422 and len(inline.json()["detail"]["errors"]) >= 3
            assert inline.json()["detail"]["location"] == "body.playbook"
            assert all(set(e) == {"location", "message", "severity"} for e in inline.json()["detail"]["errors"])
            as_mapping = await gw.post("/api/executions", json={"playbook": yaml.safe_load(INVALID)})
            assert as_mapping.json()["detail"] == inline.json()["detail"]
            assert (await gw.post("/api/executions", json={"playbook": "a: [b"})).status_code == 422

            assert (await gw.post("/api/executions", json={"path": "tests/nowhere"})).status_code == 404
            assert (await gw.post("/api/executions", json={"catalog_id": 424242})).status_code == 404

    asyncio.run(main())


def test_start_execution_publishes_the_request_with_trace_context(nats_url: str, pg_dsn: str) -> None:
    async def main() -> None:
        async with stack(nats_url, pg_dsn) as (bus, _, gw):
            inline = await gw.post("/api/executions", json={"playbook": VALID, "workload": {"n": 5}})
            assert inline.status_code == 202 and inline.json()["status"] == "PENDING"
            xid = inline.json()["execution_id"]
            [(event, headers)] = await stream_events(bus, xid)
            assert event["name"] == "playbook.execution.requested" and event["source"] == "gateway"
            assert event["status"] == "in_progress" and event["data"]["workload"] == {"n": 5}
            assert event["data"]["playbook"] == yaml.safe_load(VALID) and event["data"]["catalog"] is None
            by = event["data"]["requested_by"]  # who started it: the bootstrap admin's API token, no secret
            # never the token's id: the sessions service takes it as proof of who asks, and viewers read this
            assert set(by) == {"user_id", "username", "kind", "roles"} and by["username"] == "admin"
            assert by["roles"] == ["admin"]  # the roles the request carried (D33)
            assert headers["traceparent"].startswith("00-") and headers["Nats-Msg-Id"] == event["event_id"]

            entry = (await gw.post("/api/catalog", json={"content": VALID})).json()
            await gw.post("/api/catalog", json={"content": VALID.replace("n: 2", "n: 7")})
            by_path = await gw.post("/api/executions", json={"path": "tests/tiny", "version": 1,
                                                             "parent_execution_id": xid})
            [(event, _)] = await stream_events(bus, by_path.json()["execution_id"])
            assert event["data"]["catalog"] == {"path": "tests/tiny", "version": 1}
            assert event["data"]["playbook"]["workload"] == {"n": 2} and event["data"]["parent_execution_id"] == xid
            by_id = await gw.post("/api/executions", json={"catalog_id": entry["id"]})
            [(event, _)] = await stream_events(bus, by_id.json()["execution_id"])
            assert event["data"]["catalog"] == {"path": "tests/tiny", "version": 1}
            latest = await gw.post("/api/executions", json={"path": "tests/tiny"})
            [(event, _)] = await stream_events(bus, latest.json()["execution_id"])
            assert event["data"]["catalog"]["version"] == 2 and event["data"]["playbook"]["workload"] == {"n": 7}

            # the recorder projects the request: PENDING, then listed (until it has, the gateway answers
            # from the log with a brief PENDING: on a loaded machine that can come first)
            pending = await poll(gw, f"/api/executions/{xid}", lambda r: r.status_code == 200 and "path" in r.json())
            assert pending.json()["status"] == "PENDING" and pending.json()["path"] == "tests/tiny"
            listed = await poll(gw, "/api/executions", lambda r: len(r.json()) == 4)
            assert listed.json()[0]["execution_id"] == latest.json()["execution_id"]
            assert {r["status"] for r in listed.json()} == {"PENDING"}
            assert (await gw.get("/api/executions", params={"status": "RUNNING"})).json() == []
            assert (await gw.get("/api/executions", params={"status": "BOGUS"})).status_code == 422

    asyncio.run(main())


def test_execution_state_events_and_cancel(nats_url: str, pg_dsn: str) -> None:
    run = asyncio.run(run_local(yaml.safe_load(VALID)))
    expected = summary(run.state)
    xid = run.execution_id

    async def main() -> None:
        async with stack(nats_url, pg_dsn) as (bus, _, gw):
            assert (await gw.get(f"/api/executions/{xid}")).status_code == 404
            assert (await gw.get(f"/api/executions/{xid}/events")).status_code == 404
            assert (await gw.post(f"/api/executions/{xid}/cancel")).status_code == 404
            for event in run.log:
                await bus.publish_event(event)
            state = await poll(gw, f"/api/executions/{xid}",
                               lambda r: r.status_code == 200 and r.json().get("event_count") == len(run.log))
            body = state.json()
            assert body["status"] == "COMPLETED" and body["steps"] == expected["steps"]
            assert {k: body[k] for k in expected} == expected and body["finished_at"]

            page = (await gw.get(f"/api/executions/{xid}/events", params={"offset": 2, "limit": 3})).json()
            assert (page["total"], page["offset"], page["limit"]) == (len(run.log), 2, 3)
            assert [e["event_id"] for e in page["events"]] == [e["event_id"] for e in run.log[2:5]]
            assert all(isinstance(e["seq"], int) for e in page["events"])
            assert (await gw.get(f"/api/executions/{xid}/events", params={"limit": 5000})).status_code == 422

            finished = await gw.post(f"/api/executions/{xid}/cancel")
            assert finished.status_code == 409

            started = (await gw.post("/api/executions", json={"playbook": VALID})).json()["execution_id"]
            await poll(gw, f"/api/executions/{started}", lambda r: r.status_code == 200)
            cancel = await gw.post(f"/api/executions/{started}/cancel", json={"reason": "enough"})
            assert cancel.status_code == 202 and cancel.json() == {"execution_id": started, "status": "CANCELLING"}
            events = [e for e, _ in await stream_events(bus, started)]
            assert [e["name"] for e in events] == ["playbook.execution.requested", "execution.cancelled"]
            assert events[1]["data"]["reason"] == "enough" and events[1]["source"] == "gateway"
            assert events[1]["data"]["requested_by"]["username"] == "admin"
            again = await gw.post(f"/api/executions/{started}/cancel")  # same stable id: stored once
            assert again.status_code == 202 and len(await stream_events(bus, started)) == 2

    asyncio.run(main())


def test_health_docs_and_outages(nats_url: str, pg_dsn: str) -> None:
    async def main() -> None:
        control_plane: list = []
        async with stack(nats_url, pg_dsn, control_plane) as (bus, rec, gw):
            assert (await gw.get("/health")).json() == {"status": "ok"}
            ready = await gw.get("/ready")
            assert ready.status_code == 200 and ready.json()["status"] == "ready", ready.text
            assert ready.json()["nats"] == {"ok": True, "state": "connected"} and ready.json()["recorder"]["ok"] is True
            assert ready.json()["services"] == {name: {"ok": True, "replicas": 1, "error": None} for name in (
                "admission", "router", "loop-coordinator", "event-recorder", "credentials", "sessions")}

            router = next(r for r in control_plane if r.name == "router")  # the control plane without a router
            control_plane.remove(router)
            await stop_service(router)
            ready = await gw.get("/ready")
            assert ready.status_code == 503 and ready.json()["recorder"]["ok"] is True
            assert ready.json()["services"]["router"] == {
                "ok": False, "replicas": 0, "error": "no replica answered $SRV.PING.noetl-router within 1s"}
            assert all(s["ok"] for name, s in ready.json()["services"].items() if name != "router")
            control_plane.append(await start_service("router", Settings(nats_url=nats_url)))
            control_plane.append(await start_service("router", Settings(nats_url=nats_url)))  # two replicas
            # a replica's answer may come after /ready has counted (a loaded machine): ask until both are counted
            await poll(gw, "/ready", lambda r: r.status_code == 200 and r.json()["services"]["router"]["replicas"] == 2, 30)
            docs = await gw.get("/docs")
            assert docs.status_code == 200 and "swagger" in docs.text.lower()
            spec = (await gw.get("/openapi.json")).json()
            assert {"/api/catalog", "/api/executions", "/api/executions/{execution_id}/cancel",
                    "/health", "/ready"} <= set(spec["paths"])
            body = spec["paths"]["/api/executions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
            assert set(body["properties"]) >= {"path", "playbook", "workload"}

            await rec.stop()  # nobody answers the queries now
            assert (await gw.get("/health")).json() == {"status": "ok"}  # alive, but not ready
            ready = await gw.get("/ready")
            assert ready.status_code == 503 and ready.headers["retry-after"] == "1"
            assert ready.json()["nats"]["ok"] is True and ready.json()["recorder"]["ok"] is False
            assert "no service answers" in ready.json()["recorder"]["error"]
            missing = await gw.get("/api/executions/whatever")
            assert missing.status_code == 503 and "unavailable" in missing.json()["detail"]["message"]
            assert missing.headers["retry-after"] == "1"

            await bus.close()  # NATS gone
            assert (await gw.get("/health")).status_code == 200
            ready = await gw.get("/ready")
            assert ready.status_code == 503 and ready.json()["nats"] == {"ok": False, "state": "closed"}
            for resp in (await gw.get("/api/executions"), await gw.post("/api/executions", json={"playbook": VALID})):
                assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
                assert "NATS is closed" in resp.json()["detail"]["message"]

    asyncio.run(main())


def test_through_a_real_http_server(nats_url: str, pg_dsn: str) -> None:
    async def main() -> None:
        bus = await fresh_bus(nats_url)
        rec = RecorderService(bus, pg_dsn=pg_dsn)
        gateway = GatewayService(bus, host="127.0.0.1", port=0)
        await rec.start()
        sessions, token = await fresh_admin(bus)
        await gateway.start()
        try:
            url = gateway.url
            assert url.startswith("http://127.0.0.1:") and gateway.port > 0
            async with httpx.AsyncClient(base_url=gateway.url, trust_env=False,
                                         headers={"Authorization": f"Bearer {token}"}) as http:
                assert (await http.get("/health")).json()["status"] == "ok"
                registered = await http.post("/api/catalog", content=VALID, headers={"content-type": "text/yaml"})
                assert registered.status_code == 201 and registered.json()["version"] == 1
                started = await http.post("/api/executions", json={"path": "tests/tiny"})
                assert started.status_code == 202
                xid = started.json()["execution_id"]
                await poll(http, f"/api/executions/{xid}", lambda r: r.status_code == 200)
        finally:
            await gateway.stop()
            await sessions.stop()
            await rec.stop()
            await bus.close()
        with pytest.raises(httpx.ConnectError):
            async with httpx.AsyncClient(trust_env=False) as http:
                await http.get(f"{url}/health")

    asyncio.run(main())


def test_connections_past_max_http_connections_are_503_at_once(nats_url: str) -> None:
    """Past the limit, a new request is answered 503 and its connection closed, instead of the gateway
    holding connections until it runs out of file descriptors; the ones within it are answered."""
    import socket

    async def main() -> None:
        bus = await fresh_bus(nats_url)
        with limits.override(max_http_connections=3):
            gateway = GatewayService(bus, host="127.0.0.1", port=0)
            await gateway.start()
        held = [socket.create_connection(("127.0.0.1", gateway.port), timeout=30) for _ in range(3)]
        try:
            while len(gateway._server.server_state.connections) < 3:  # until the server has taken them
                await asyncio.sleep(0.01)
            async with httpx.AsyncClient(base_url=gateway.url, trust_env=False) as http:
                over = await http.get("/health")
            assert over.status_code == 503, over.text
            for conn in held:
                conn.close()
            while gateway._server.server_state.connections:  # until the server has seen them go
                await asyncio.sleep(0.01)
            async with httpx.AsyncClient(base_url=gateway.url, trust_env=False) as http:
                assert (await http.get("/health")).status_code == 200
        finally:
            for conn in held:
                conn.close()
            await gateway.stop()
            await bus.close()

    asyncio.run(main())
