"""`noetl run`'s stack has no gateway: the command line is its only client, over NATS with the gateway's
NATS user (client.StackClient). It must answer as the gateway would for what `noetl run` asks, refuse
what the gateway refuses, and need no permission the gateway's NATS user lacks (stop_stack fails on a
permission violation the server logged)."""
from __future__ import annotations

import asyncio

import pytest

from conftest import SLOW, start_stack, stop_stack
from noetl_mesh import limits
from noetl_mesh.client import GatewayError, StackClient

pytestmark = pytest.mark.integration

CHILD = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: child, path: tests/stack-client/child}
workflow:
  - step: start
    tool: {kind: noop, result: "{{ workload.n * 2 }}"}
"""


def test_the_command_lines_own_client_starts_follows_refuses_and_cancels(module_pg):
    nats, loop, handle = start_stack(module_pg, gateway=False)
    try:
        stack = handle.stack
        # no HTTP API, nor what only its users reach, nor a first admin
        assert {r.name for r in stack.running} == {"event-recorder", "credentials", "admission", "router",
                                                    "loop-coordinator", "worker"} and stack.token is None

        async def go() -> None:
            settings = stack.settings
            async with await StackClient.connect(settings.nats_url, settings.creds_for("gateway")) as client:
                # refused on the way in, as the gateway refuses: where and why
                with pytest.raises(GatewayError) as bad:
                    await client.start("apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {name: x}\nworkflow: []\n")
                assert bad.value.status == 422 and bad.value.errors
                assert str(bad.value).startswith("the embedded stack answered 422: invalid playbook")
                with limits.override(max_workload_bytes=100), pytest.raises(GatewayError) as big:
                    await client.start(CHILD, {"n": 1, "pad": "x" * 200})
                assert big.value.status == 413 and "max_workload_bytes" in str(big.value)
                forged = {"store": "nats-object:noetl_payloads", "key": "ab", "size": 1, "checksum": "c"}
                with pytest.raises(GatewayError) as ref:  # only the engine writes one (D23)
                    await client.start(CHILD, {"n": 1, "in": [forged]})
                assert ref.value.status == 422 and str(ref.value).startswith(
                    "the embedded stack answered 422: workload.in[0]: an object whose keys are exactly")
                with pytest.raises(GatewayError) as unknown:
                    await client.status("0" * 32)
                assert unknown.value.status == 404

                entry = await client.register(CHILD)
                assert entry["path"] == "tests/stack-client/child" and entry["warnings"] == []
                done = await client.wait(await client.start(CHILD, {"n": 21}), timeout=60)
                assert done["status"] == "COMPLETED" and done["steps"]["start"]["result"] == 42

                xid = await client.start(SLOW)
                names: list[str] = []
                for _ in range(600):  # the task runs (404 until the recorder has the request)
                    try:
                        names = [e["name"] for e in await client.all_events(xid)]
                    except GatewayError as exc:
                        assert exc.status == 404, exc
                    if "task.started" in names:
                        break
                    await asyncio.sleep(0.1)
                assert names[0] == "playbook.execution.requested" and "task.started" in names
                assert (await client.cancel(xid, reason="test"))["status"] == "CANCELLING"
                final = await client.wait(xid, timeout=60)
                assert final["status"] == "CANCELLED"
                with pytest.raises(GatewayError) as again:
                    await client.cancel(xid)
                assert again.value.status == 409 and "already CANCELLED" in str(again.value)

        loop.run(go(), timeout=180)
    finally:
        stop_stack(nats, loop, handle)


def test_an_execution_cancelled_before_it_is_recorded_is_cancelled_not_unknown(module_pg):
    """A cancel right after a start is accepted may reach the gateway (or `noetl run`'s client) before
    the recorder has recorded the request: the log knows the execution, so it is cancelled, not
    called unknown (404). An id that names no request, or that is not an id, is still unknown."""
    from noetl_mesh.client import GatewayClient

    nats, loop, handle = start_stack(module_pg)
    stack = handle.stack
    recorder = stack.services("event-recorder")[0]
    try:
        gate = asyncio.Event()
        store = recorder.store

        async def held(records):  # the recorder answers queries, and records nothing until the gate opens
            await gate.wait()
            await store(records)

        async def go() -> None:
            recorder.store = held
            settings = stack.settings
            async with GatewayClient(stack.gateway_url, token=stack.token) as http, \
                    await StackClient.connect(settings.nats_url, settings.creds_for("gateway")) as own:
                for client in (http, own):
                    xid = await client.start(SLOW)
                    assert (await client.cancel(xid, reason="at once"))["status"] == "CANCELLING"
                    for unknown in ("0" * 32, "x.>", "*"):
                        with pytest.raises(GatewayError) as exc:
                            await client.cancel(unknown)
                        assert exc.value.status in (404, 422), exc.value  # the gateway's path checks first
                pending = await own.bus.pending_request(xid)
                assert pending == {"execution_id": xid, "status": "PENDING", "requested_by": None}
                # a signal and a child link to an execution accepted and not recorded yet: the log says
                xid = await http.start(SLOW)
                assert (await http.status(xid))["status"] == "PENDING"  # not 404
                page = await http.events(xid)  # nor its events: none recorded yet
                assert (page["events"], page["total"], page["next_offset"]) == ([], 0, None)
                with pytest.raises(GatewayError) as unknown:
                    await http.events("0" * 32)
                assert unknown.value.status == 404
                assert (await http.signal(xid, "go", {}))["status"] == "KEPT"
                assert await http.start(SLOW, parent_execution_id=xid)
            gate.set()

        loop.run(go(), timeout=120)
    finally:
        stop_stack(nats, loop, handle)
