"""Timers, waits and signals (D29, D30) through the gateway on the real stack: JetStream message
schedules fire the timers, across a restart of every control-plane service, the worker and NATS."""
from __future__ import annotations

import asyncio
import time

import nats
import pytest

from noetl_mesh.client import GatewayClient, GatewayError
from noetl_mesh.infra.embedded import EmbeddedNats
from noetl_mesh.infra.nats_auth import connect_options
from noetl_mesh.stack import start_service, stop_service

from conftest import developer, start_stack, stop_stack

DELAYED = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: delayed, path: time/delayed}
workflow:
  - step: start
    tool: {kind: noop, result: 1}
    next: {arcs: [{step: nap, spec: {delay: 2s}}]}
  - step: nap
    tool: [{name: w, kind: wait, duration: 2s}]
    next: {arcs: [{step: end}]}
  - step: end
    tool: {kind: noop, result: "{{ nap.result }}"}
"""

TIMEOUT = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: timeout, path: time/timeout}
workflow:
  - step: start
    spec: {policy: {lifecycle: {timeout_s: 1}}}
    tool: {kind: python, code: "import time\\ntime.sleep(3600)\\nresult = 1", spec: {timeout: 3600}}
    next: {arcs: [{step: handler, when: "{{ event.error.kind == 'timeout' }}"}]}
  - step: handler
    tool: {kind: noop, result: handled}
"""

APPROVAL = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: approval, path: time/approval}
workflow:
  - step: start
    tool:
      - {name: nap, kind: wait, duration: "{{ workload.nap }}"}
      - name: approve
        kind: wait
        signal: approve
        timeout: 1h
        roles: [operator, admin]
        assignee: finance
        form: {amount: number}
        schema: {type: object, required: [ok], properties: {ok: {type: boolean}}}
    next: {arcs: [{step: end}]}
  - step: end
    tool: {kind: noop, result: "{{ start.result.payload.ok }}"}
"""

LONG_DELAY = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: long, path: time/long}
workflow:
  - step: start
    tool: {kind: noop}
    next: {arcs: [{step: end, spec: {delay: 1h}}]}
  - step: end
    tool: {kind: noop}
"""


@pytest.fixture(scope="module")
def timed(module_pg, tmp_path_factory):
    nats_, loop, handle = start_stack(module_pg)
    yield handle
    stop_stack(nats_, loop, handle)


def _names(events):
    return [e["name"] for e in events]


async def _until(client, eid, name, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            events = await client.all_events(eid)
        except GatewayError as exc:  # not recorded yet
            if exc.status != 404:
                raise
            events = []
        if name in _names(events):
            return events
        await asyncio.sleep(0.1)
    raise AssertionError(f"{name} never recorded for {eid}")


def test_a_step_timeout_cancels_the_task_and_routes_to_its_handler(timed):
    status, events = timed.execute(TIMEOUT, timeout=60)  # the task sleeps an hour: cancelled, not waited for
    assert status["status"] == "COMPLETED", status
    assert status["steps"]["start"]["status"] == "failed" and status["steps"]["handler"]["result"] == "handled"
    failed = next(e for e in events if e["name"] == "step.failed")
    assert failed["source"] == "router" and failed["data"]["error"]["kind"] == "timeout"


def test_an_approval_sent_by_http_resumes_the_execution(timed):
    async def go():
        async with timed.client() as client:
            eid = await client.start(APPROVAL, {"nap": 0})
            await _until(client, eid, "wait.started")
            deadline = time.monotonic() + 20
            while True:  # the inbox lists it once the recorder has it
                waits = await client.waits(eid)
                if any(w["signal"] == "approve" for w in waits) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            [inbox] = [w for w in waits if w["signal"] == "approve"]
            assert inbox["spec"]["assignee"] == "finance" and inbox["spec"]["roles"] == ["operator", "admin"]
            with pytest.raises(GatewayError) as bad:
                await client.signal(eid, "approve", {"ok": "yes"})
            assert bad.value.status == 422 and "is not of type 'boolean'" in str(bad.value.body)
            sent = await client.signal(eid, "approve", {"ok": True})
            assert sent["status"] == "DELIVERED"
            final = await client.wait(eid, timeout=30)
            with pytest.raises(GatewayError) as again:
                await client.signal(eid, "approve", {"ok": False})
            assert again.value.status == 409
            return final, await client.all_events(eid)

    final, events = timed.run(go(), 90)
    assert final["status"] == "COMPLETED" and final["steps"]["end"]["result"] is True
    result = final["steps"]["start"]["result"]
    assert result["signal"] == "approve" and result["payload"] == {"ok": True} and result["by"]["user_id"]
    assert _names(events).count("signal.received") == 1  # the bad payload changed nothing


def test_a_signal_sent_before_its_wait_begins_is_kept(timed):
    async def go():
        async with timed.client() as client:
            eid = await client.start(APPROVAL, {"nap": "2s"})
            await _until(client, eid, "wait.started")  # the nap's wait, not the approval's
            sent = await client.signal(eid, "approve", {"ok": False})
            assert sent["status"] == "KEPT"
            with pytest.raises(GatewayError) as dup:
                await client.signal(eid, "approve", {"ok": True})
            assert dup.value.status == 409
            return await client.wait(eid, timeout=30)

    final = timed.run(go(), 60)
    assert final["status"] == "COMPLETED" and final["steps"]["end"]["result"] is False


def test_an_early_signal_the_schema_refuses_is_not_delivered_and_the_wait_goes_on(timed):
    """Sent before its wait begins, a payload the wait's schema refuses is kept (only the roles could be
    checked), refused when the wait begins (signal.checked, and the execution's refused_signals with the
    schema's error), never delivered: the wait still waits, and takes the valid signal sent next."""
    async def go():
        async with timed.client() as client:
            eid = await client.start(APPROVAL, {"nap": "2s"})
            await _until(client, eid, "wait.started")  # the nap's wait, not the approval's
            assert (await client.signal(eid, "approve", {"ok": "yes"}))["status"] == "KEPT"
            events = await _until(client, eid, "signal.checked")
            [checked] = [e for e in events if e["name"] == "signal.checked"]
            assert checked["source"] == "admission" and checked["data"]["accepted"] is False
            assert checked["data"]["location"] == "body['ok']" and "'yes' is not of type 'boolean'" in checked["data"]["error"]
            status = await client.status(eid)
            assert status["status"] == "RUNNING" and "kept_signals" not in status
            [refused] = status["refused_signals"]
            assert refused["signal"] == "approve" and refused["step"] == "start" and "boolean" in refused["error"]
            [waiting] = [w for w in status["waits"] if w.get("signal") == "approve"]
            assert waiting["status"] == "waiting" and waiting["refused_signals"] == [refused]
            assert (await client.signal(eid, "approve", {"ok": True}))["status"] == "DELIVERED"
            return await client.wait(eid, timeout=30), await client.all_events(eid)

    final, events = timed.run(go(), 60)
    assert final["status"] == "COMPLETED" and final["steps"]["end"]["result"] is True
    assert final["steps"]["start"]["result"]["payload"] == {"ok": True}
    assert [e["data"]["outcome"]["result"]["payload"] for e in events
            if e["name"] == "wait.ended" and (e["data"]["outcome"].get("result") or {}).get("signal")] == [{"ok": True}]


def test_the_starter_cannot_approve_their_own_gate_by_signalling_before_it_begins(timed):
    """A developer starts the approval (operators and admins only) and signals it during the nap: the
    signal is kept (only the cancellation rule, which the starter passes, could be checked), then
    refused when the wait begins, for the roles its sender had; the wait goes on, and an admin's
    approval is the one delivered."""
    token = developer(timed)

    async def go():
        async with timed.client(token=token) as dev, timed.client() as admin:
            eid = await dev.start(APPROVAL, {"nap": "2s"})
            await _until(dev, eid, "wait.started")  # the nap's wait, not the approval's
            assert (await dev.signal(eid, "approve", {"ok": True}))["status"] == "KEPT"
            events = await _until(dev, eid, "signal.checked")
            [checked] = [e for e in events if e["name"] == "signal.checked"]
            assert checked["data"]["accepted"] is False
            assert "roles operator, admin only, and its sender had developer" in checked["data"]["error"]
            status = await dev.status(eid)
            assert status["status"] == "RUNNING"
            with pytest.raises(GatewayError) as again:  # sent to the open wait: the gateway refuses it
                await dev.signal(eid, "approve", {"ok": True})
            assert again.value.status == 403
            assert (await admin.signal(eid, "approve", {"ok": False}))["status"] == "DELIVERED"
            return await admin.wait(eid, timeout=30)

    final = timed.run(go(), 60)
    assert final["status"] == "COMPLETED" and final["steps"]["end"]["result"] is False


def test_cancel_clears_pending_timers(timed):
    async def go():
        async with timed.client() as client:
            eid = await client.start(LONG_DELAY)
            await _until(client, eid, "timer.scheduled")
            await client.cancel(eid)
            final = await client.wait(eid, timeout=30)
        nc = await nats.connect(timed.nats_url, **connect_options(timed.admin))
        try:
            js = nc.jetstream()
            msg = await js.get_last_msg("NOETL_EVENTS", f"noetl.sched.{eid}.*")
            return final, msg
        finally:
            await nc.close()

    final, msg = timed.run(go(), 60)
    assert final["status"] == "CANCELLED"
    assert not msg.data and "Nats-Schedule" not in (msg.headers or {})  # the schedule was replaced


def test_a_delay_and_a_wait_survive_restarting_every_service_and_nats(module_pg, tmp_path):
    """The delayed token and the wait's timer live in JetStream: the control plane, the worker and NATS
    itself are stopped while both are pending, and the execution still completes on time."""
    store = tmp_path / "jetstream"
    nats_, loop, handle = start_stack(module_pg, nats_kw={"store_dir": str(store)})
    stack = handle.stack
    try:
        async def go():
            async with handle.client() as client:
                eid = await client.start(DELAYED)
                await _until(client, eid, "timer.scheduled")
                names = ("admission", "router", "loop-coordinator", "worker")
                old = [r for r in stack.running if r.name in names]
                await asyncio.gather(*(stop_service(r) for r in old))
                stack.running = [r for r in stack.running if r not in old]
                return eid, [r.name for r in old]

        eid, names = handle.run(go(), 60)
        port = nats_.port
        nats_.stop()  # and NATS: the schedules are in its file store
        restarted = EmbeddedNats(store_dir=str(store), port=port, auth=nats_.auth).start()

        async def resume():
            fresh = [await start_service(n, stack.settings) for n in names]
            stack.running += fresh
            async with handle.client() as client:
                return await client.wait(eid, timeout=60), await client.all_events(eid)

        final, events = handle.run(resume(), 120)
        assert final["status"] == "COMPLETED", final
        assert final["steps"]["end"]["result"] == {"waited": 2.0}
        fired = [e for e in events if e["name"] == "timer.fired"]
        assert [e["data"]["kind"] for e in fired] == ["token", "wait"] and all(e["source"] == "timer" for e in fired)
        done = next(e for e in events if e["name"] == "step.done" and e["step"] == "start")
        nap = next(e for e in events if e["name"] == "step.admitted" and e["step"] == "nap")
        assert nap["timestamp"] - done["timestamp"] >= 1.9  # the token waited for its delay
        nats_ = restarted
    finally:
        stop_stack(nats_, loop, handle)
