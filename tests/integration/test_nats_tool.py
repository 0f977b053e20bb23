"""The ``nats`` tool on a whole stack, through the gateway, as a playbook author (role ``developer``): a
playbook publishes to, requests from, and puts and gets a KV key on a *second* NATS server (with a user
and password from a stored credential named by the keychain) that the pool opens; the credential is
never in an event or a log line; the engine's own NATS stays closed (with all of loopback opened:
tests/integration/test_sandboxed_tasks_net.py). The tool's other operations and errors against a real
server, without a stack, come first."""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Iterator

import nats
import orjson
import pytest

from noetl_mesh import limits
from noetl_mesh.infra.embedded import EmbeddedNats
from noetl_mesh.sandbox.policy import Policy, parse_destinations
from noetl_mesh.tools.base import ToolContext
from noetl_mesh.tools.nats import NatsTool

from conftest import Capture, start_stack, stop_stack
from test_sandboxed_tasks_net import developer

pytestmark = pytest.mark.integration

USER, PASSWORD = "task-user", "nats-Pw-81-very-secret"


@pytest.fixture(scope="module")
def other_nats() -> Iterator[EmbeddedNats]:
    """A second NATS server (JetStream on), a user with a password, on loopback: a playbook's own."""
    server = EmbeddedNats(config=f'authorization {{ user: "{USER}", password: "{PASSWORD}" }}').start()
    yield server
    server.stop()


async def connect(server: EmbeddedNats):
    return await nats.connect(server.url, user=USER, password=PASSWORD, allow_reconnect=False)


def tool_for(server: EmbeddedNats) -> NatsTool:
    return NatsTool(policy=Policy(allow=parse_destinations(f"127.0.0.1:{server.port}")))


def ctx(server: EmbeddedNats) -> ToolContext:
    return ToolContext(execution_id="e1", step="s", task_name="t", keychain={
        "bus": {"user": USER, "password": PASSWORD, "url": server.url}})


# =================================================================================== the tool alone


def test_jetstream_objects_keys_and_the_errors_a_policy_routes(other_nats):
    async def main():
        nc = await connect(other_nats)
        js = nc.jetstream()
        await js.add_stream(name="ORDERS", subjects=["orders.>"])
        await js.create_key_value(bucket="kv_errors")
        await js.create_key_value(bucket="kv_keys")
        await js.create_object_store(bucket="files")
        tool, c = tool_for(other_nats), ctx(other_nats)

        async def run(**task: Any) -> dict:
            return await tool.run({"auth": "bus", **task}, {"timeout": 5}, c)

        try:
            out = {
                "js": await run(operation="js_publish", subject="orders.1", data={"n": 1}, stream="ORDERS"),
                "no_stream": await run(operation="js_publish", subject="nowhere.1", data="x"),
                "put": await run(operation="object_put", bucket="files", key="a.bin", data="AAEC/w==",
                                 encoding="base64"),
                "get": await run(operation="object_get", bucket="files", key="a.bin"),
                "missing_object": await run(operation="object_get", bucket="files", key="b.bin"),
                "keys_empty": await run(operation="kv_keys", bucket="kv_errors"),
                "put_a": await run(operation="kv_put", bucket="kv_keys", key="order.1", value=1),
                "put_b": await run(operation="kv_put", bucket="kv_keys", key="invoice.1", value="x"),
                "keys": await run(operation="kv_keys", bucket="kv_keys", pattern="order.*"),
                "missing_key": await run(operation="kv_get", bucket="kv_errors", key="k"),
                "missing_bucket": await run(operation="kv_get", bucket="no_bucket", key="k"),
                "no_responders": await run(operation="request", subject="nobody.home"),
                "bad_password": await tool.run({"auth": "bus", "operation": "publish", "subject": "x"}, {},
                                               ToolContext("e1", "s", "t", keychain={"bus": {
                                                   "user": USER, "password": "a-wrong-password",
                                                   "url": other_nats.url}})),
            }
            stored = await js.get_msg("ORDERS", 1)
            await (await js.object_store("files")).put("bigger", b"z" * 4000)
            with limits.override(max_result_bytes=1024):
                out["too_large"] = await run(operation="object_get", bucket="files", key="bigger")
            out["left_open"] = await task_connections(other_nats)
            return out, stored
        finally:
            await nc.close()

    out, stored = asyncio.run(main())
    assert out["js"] == {"status": "ok", "result": {"stream": "ORDERS", "seq": 1, "duplicate": False}, "error": None}
    assert stored.data == b'{"n":1}'
    assert out["no_stream"]["error"]["kind"] == "nats_no_responders"
    assert out["put"]["result"]["size"] == 4 and out["put"]["result"]["digest"].startswith("SHA-256=")
    assert out["get"]["result"]["data"] == "AAEC/w==" and out["get"]["result"]["size"] == 4  # not UTF-8: base64
    for name, said in (("missing_object", "bucket 'files' key 'b.bin': no such object"),
                       ("missing_key", "bucket 'kv_errors' key 'k': no such key"),
                       ("missing_bucket", "bucket 'no_bucket' key 'k': no such bucket")):
        assert out[name]["error"]["kind"] == "nats_not_found" and out[name]["error"]["retryable"] is False
        assert out[name]["error"]["message"].endswith(said), out[name]
    assert out["keys_empty"]["result"] == {"bucket": "kv_errors", "keys": [], "count": 0}
    assert out["keys"]["result"] == {"bucket": "kv_keys", "keys": ["order.1"], "count": 1}
    assert out["no_responders"]["error"]["kind"] == "nats_no_responders"
    assert out["no_responders"]["error"]["retryable"] is True
    err = out["bad_password"]["error"]
    assert err["kind"] == "nats_auth_error" and err["retryable"] is False
    assert "Authorization Violation" in err["message"]
    assert "a-wrong-password" not in str(out["bad_password"])
    assert out["too_large"]["error"]["kind"] == "result_too_large"
    assert "(the object)" in out["too_large"]["error"]["message"]
    assert out["left_open"] == []  # every task's connection closed, with its inbox subscription


async def task_connections(server: EmbeddedNats) -> list[dict]:
    """The open connections of tasks (named ``noetl-task``) to ``server``, with their subscriptions."""
    import httpx

    async with httpx.AsyncClient(trust_env=False) as http:
        connz = (await http.get(f"{server.monitor_url}/connz", params={"subs": 1})).json()
    return [c for c in connz.get("connections") or [] if c.get("name") == "noetl-task"]


def test_a_request_times_out_within_the_tasks_timeout(other_nats):
    async def main():
        nc = await connect(other_nats)
        async def silent(msg) -> None:  # takes the request, never answers
            return None

        await nc.subscribe("slow.svc", cb=silent)
        await nc.flush()
        try:
            return await tool_for(other_nats).run(
                {"auth": "bus", "operation": "request", "subject": "slow.svc", "timeout": 1}, {}, ctx(other_nats))
        finally:
            await nc.close()

    out = asyncio.run(main())
    assert out["error"]["kind"] == "nats_timeout" and out["error"]["retryable"] is True, out
    assert "subject 'slow.svc': no answer in time" in out["error"]["message"]


# ============================================================================ through the gateway

PLAYBOOK = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: nats_tool, path: tests/nats_tool}
workload: {order: 42}
keychain:
  - {name: bus, kind: credential, credential: partner_nats}
workflow:
  - step: start
    tool:
      - name: announce
        kind: nats
        auth: bus
        operation: publish
        subject: orders.created
        data: {order: "{{ workload.order }}"}
        headers: {X-Order: "{{ workload.order }}"}
      - name: ask
        kind: nats
        auth: bus
        operation: request
        subject: prices.quote
        data: {order: "{{ workload.order }}"}
      - name: remember
        kind: nats
        auth: bus
        operation: kv_put
        bucket: orders
        key: "order.{{ workload.order }}"
        value: {price: "{{ ask.result.data.price }}"}
      - name: recall
        kind: nats
        auth: bus
        operation: kv_get
        bucket: orders
        key: "order.{{ workload.order }}"
"""


@pytest.fixture(scope="module")
def opened(module_pg, other_nats, throwaway_credential_key) -> Iterator[Any]:
    """A stack whose workers may reach the second NATS server (and nothing else beyond the default), its
    logs captured, a stored credential for that server and a developer's token."""
    capture = Capture()
    root = logging.getLogger()
    level = root.level
    root.addHandler(capture)
    root.setLevel(logging.DEBUG)
    nats_, loop, handle = start_stack(module_pg, allow_net=f"127.0.0.1:{other_nats.port}")
    handle.capture = capture

    async def store() -> None:
        async with handle.client() as admin:
            await admin.credential_put("partner_nats", "nats", {"user": USER, "password": PASSWORD,
                                                                "url": other_nats.url},
                                       roles=["developer", "admin"])  # the developer's playbooks use it (D24)

    handle.run(store())
    handle.developer = developer(handle)
    try:
        yield handle
    finally:
        stop_stack(nats_, loop, handle)
        root.removeHandler(capture)
        root.setLevel(level)


def test_a_playbook_publishes_requests_puts_and_gets_on_its_own_nats_server(opened, other_nats):
    from noetl_mesh.client import GatewayClient

    seen: list[tuple[str, bytes, dict]] = []

    async def go():
        nc = await connect(other_nats)
        await nc.jetstream().create_key_value(bucket="orders")

        async def quote(msg) -> None:
            order = orjson.loads(msg.data)["order"]
            await msg.respond(orjson.dumps({"order": order, "price": 9.5}))

        async def note(msg) -> None:
            seen.append((msg.subject, msg.data, dict(msg.headers or {})))

        await nc.subscribe("prices.quote", cb=quote)
        await nc.subscribe("orders.>", cb=note)
        await nc.flush()
        try:
            async with GatewayClient(opened.url, token=opened.developer) as client:
                eid = await client.start(path="tests/nats_tool", workload={"order": 42})
                final = await client.wait(eid, timeout=60)
                events = await client.all_events(eid)
            entry = await (await nc.jetstream().key_value("orders")).get("order.42")
            return final, events, entry.value
        finally:
            await nc.close()

    async def register():
        async with GatewayClient(opened.url, token=opened.developer) as client:
            await client.register(PLAYBOOK)

    opened.run(register())
    final, events, stored = opened.run(go(), 90)
    assert final["status"] == "COMPLETED", final
    outcomes = {e["task"]: e["data"]["outcome"] for e in events if e["name"] == "task.processed"}
    assert outcomes["announce"]["result"] == {"subject": "orders.created", "bytes": len(b'{"order":42}')}
    assert seen == [("orders.created", b'{"order":42}', {"X-Order": "42"})]
    assert outcomes["ask"]["result"] == {"subject": "prices.quote", "data": {"order": 42, "price": 9.5}, "headers": {}}
    assert outcomes["remember"]["result"]["revision"] == 1 and stored == b'{"price":9.5}'
    assert outcomes["recall"]["result"] == {"bucket": "orders", "key": "order.42", "value": {"price": 9.5},
                                            "revision": 1}
    # the credential was used, and is in no event and no log line of the stack
    text = orjson.dumps(events).decode()
    assert PASSWORD not in text
    assert not [line for line in opened.capture.lines if PASSWORD in line]


def test_a_developer_cannot_reach_a_neighbouring_port_or_the_engines_nats(opened, other_nats):
    from test_sandboxed_tasks_net import probe, refused

    final, outcome = probe(opened, opened.developer, {"kind": "nats", "operation": "publish", "subject": "x",
                                                      "url": f"nats://127.0.0.1:{other_nats.port + 1}"})
    assert f"NOETL_SANDBOX_ALLOW_NET=127.0.0.1:{other_nats.port + 1} " in refused(final, outcome)
    port = opened.nats_url.rsplit(":", 1)[1]
    final, outcome = probe(opened, opened.developer, {"kind": "nats", "operation": "kv_get", "bucket": "noetl_users",
                                                      "key": "admin", "url": f"nats://localhost:{port}"})
    assert "localhost:" in refused(final, outcome) and "resolves to 127.0.0.1" in outcome["error"]["message"]
