"""Replicas, crashes, restarts, cancellation, tracing and replay, on the real stack."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from conftest import start_stack, stop_stack
from noetl_mesh.infra.control import IDLE
from noetl_mesh.client import GatewayClient
from noetl_mesh.core.state import summary
from noetl_mesh.infra.bus import EVENTS, Bus, loads
from noetl_mesh.infra.embedded import EmbeddedNats
from noetl_mesh.infra.nats_auth import NatsAuth
from noetl_mesh.stack import ProcessStack, Settings
from scenarios import SCENARIOS, slow_chain

pytestmark = pytest.mark.integration
BY_ID = {s.id: s for s in SCENARIOS}


# ------------------------------------------------------------------------------ replicas
def test_two_replicas_of_each_control_plane_service(pg_dsn, fixture_api):
    """Executions of every shape at once, handled by two replicas of admission, router and
    loop-coordinator and two workers: outcomes as prescribed, and both replicas did work."""
    nats, loop, stack = start_stack(pg_dsn, replicas=2, workers=2, allow_net=fixture_api.endpoint)
    try:
        chosen = [BY_ID[k] for k in ("fork_join", "admission", "back_edge_before_join", "loops", "ctx",
                                     "pagination", "best_effort", "retry", "inclusive", "empty_loop")]

        async def go():
            # the replicas share the partitions out first (until then the first to ask reads them all)
            deadline = time.monotonic() + 15
            for name in ("admission", "router", "loop-coordinator"):
                while True:
                    owned = [svc.owned for svc in stack.stack.services(name)]
                    if not (owned[0] & owned[1]) and owned[0] | owned[1] == set(range(16)):
                        break
                    assert time.monotonic() < deadline, (name, owned)
                    await asyncio.sleep(0.1)
            async with GatewayClient(stack.url, token=stack.token) as client:
                from test_scenarios import workload_of

                ids = [await client.start(s.doc(fixture_api.url), workload_of(s, fixture_api))
                       for s in chosen for _ in range(3)]
                finals = [await client.wait(eid, timeout=90) for eid in ids]
                events = [await client.all_events(eid) for eid in ids]
                return list(zip([s for s in chosen for _ in range(3)], finals, events))

        for scenario, final, events in stack.run(go(), timeout=150):
            scenario.expect(final, events)
        for name in ("admission", "router", "loop-coordinator"):
            handled = [svc.handled for svc in stack.stack.services(name)]
            assert len(handled) == 2 and all(h > 0 for h in handled), (name, handled)
    finally:
        stop_stack(nats, loop, stack)


def test_replayed_state_equals_the_state_the_services_hold(stack):
    """D22: the recorder's fold of the logged events equals each service's live state, as it stood when
    the service let the execution go (finished: its state leaves the cache as IDLE); the
    loop-coordinator lets go of a playbook without loops once it knows the playbook."""
    let_go: dict[tuple[str, str], object] = {}  # (service, execution id) -> the live state at that moment
    for name in ("admission", "router", "loop-coordinator"):
        for svc in stack.stack.services(name):
            def idle(state, svc=svc, name=name, inner=svc.idle):
                done = inner(state)
                if done:
                    let_go.setdefault((name, state.execution_id), state)
                return done
            svc.idle = idle
    for scenario_id in ("back_edge_before_join", "loops"):
        final, _ = stack.execute(BY_ID[scenario_id].doc("http://unused"))
        eid = final["execution_id"]
        for name in ("admission", "router", "loop-coordinator"):
            for svc in stack.stack.services(name):
                if svc.cache.get(eid) is None:
                    continue
                assert svc.cache[eid] is IDLE, (scenario_id, name)
                live = let_go[(name, eid)]
                if name == "loop-coordinator" and scenario_id == "back_edge_before_join":
                    assert live.status not in ("COMPLETED", "FAILED")  # let go early: no loops
                    continue
                got = summary(live)
                assert {k: got[k] for k in ("status", "ctx", "steps")} == \
                       {k: final[k] for k in ("status", "ctx", "steps")}, (scenario_id, name)
                assert live.tokens == {} and not live.active_runs()


# ------------------------------------------------------------------------------ tracing
def stored(stack, eid: str) -> list:
    """An execution's messages as the events stream holds them, in order."""
    async def read():
        bus = await Bus.connect(stack.nats_url, "stored-test", stack.admin)
        sub = await bus.js.pull_subscribe(f"noetl.pevt.*.*.{eid}.*", stream=EVENTS, config=ConsumerConfig(
            ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL, inactive_threshold=5.0))
        msgs = await sub.fetch(1000, timeout=2)
        await bus.close()
        return msgs
    return stack.run(read())


def test_one_execution_is_one_trace(stack):
    final, _ = stack.execute(BY_ID["fork_join"].doc("http://unused"))
    found = [(dict(m.headers or {}), [e["name"] for e in loads(m.data)]) for m in stored(stack, final["execution_id"])]
    assert found and all("traceparent" in h for h, _ in found), found
    trace_ids = {h["traceparent"].split("-")[1] for h, _ in found}
    assert len(trace_ids) == 1
    sources = {name for _, names in found for name in names}
    assert {"playbook.execution.requested", "step.admitted", "task.processed", "next.evaluated"} <= sources


def test_the_loop_coordinator_reads_two_messages_of_a_flat_execution(stack):
    """A playbook without loops: after its evaluation, admission, the router, the worker and their timers
    send its control messages as ``flat``, which only admission and the router read; a playbook with a
    loop keeps every one ``ctl`` (and ``loop``), for the loop-coordinator too."""
    def classes(eid):  # (class, writer, event names) of each stored message
        return [(m.subject.split(".")[3], m.subject.split(".")[5], [e["name"] for e in loads(m.data)])
                for m in stored(stack, eid)]

    flat, _ = stack.execute(BY_ID["back_edge_before_join"].doc("http://unused"))
    assert flat["status"] == "COMPLETED"
    got = classes(flat["execution_id"])
    read_by_loops = [(writer, names) for cls, writer, names in got if cls in ("ctl", "loop")]
    assert [w for w, _ in read_by_loops] == ["gateway", "admission"], got
    assert read_by_loops[1][1][0] == "playbook.request.evaluated"
    assert {w for cls, w, _ in got if cls == "flat"} >= {"admission", "router", "worker"}, got
    looped, _ = stack.execute(BY_ID["loops"].doc("http://unused"))
    assert "flat" not in {cls for cls, _, _ in classes(looped["execution_id"])}


# ------------------------------------------------------------------------------ cancellation
def test_cancel_stops_a_running_execution(stack):
    async def go():
        async with GatewayClient(stack.url, token=stack.token) as client:
            eid = await client.start(slow_chain(3, 30))
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # wait until the first step really runs
                events = await client.all_events(eid) if await _exists(client, eid) else []
                if any(e["name"] == "task.started" for e in events):
                    break
                await asyncio.sleep(0.05)
            t0 = time.monotonic()
            await client.cancel(eid, reason="test")
            final = await client.wait(eid, timeout=20)
            return final, time.monotonic() - t0, await client.all_events(eid)

    final, _, events = stack.run(go())
    assert final["status"] == "CANCELLED"  # within the wait's 20 s: each step sleeps 30 s
    assert final["steps"]["s0"]["status"] == "cancelled" and "s1" not in final["steps"]
    names = [e["name"] for e in events]
    assert "execution.cancelled" in names and names[-2:] == ["workflow.finished", "playbook.processed"]


def test_cancel_purges_queued_commands_so_a_later_worker_runs_none(pg_dsn):
    """Commands queued for an execution that ends (cancelled here) are purged from the work queue: a
    worker that starts afterwards (it never got the cancel broadcast) runs none of them."""
    from noetl_mesh.infra.bus import COMMANDS
    from noetl_mesh.stack import start_service

    nats, loop, stack = start_stack(pg_dsn, workers=0)
    try:
        async def go():
            bus = await Bus.connect(stack.nats_url, "queue-probe", stack.admin)
            try:
                async with GatewayClient(stack.url, token=stack.token) as client:
                    doc = {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "q", "path": "t/q"},
                           "workflow": [{"step": "start", "loop": {"in": "{{ range(40) | list }}", "iterator": "i",
                                                                   "spec": {"mode": "parallel", "max_in_flight": 8}},
                                         "tool": {"kind": "noop", "result": "{{ iter.i }}"}}]}
                    eid = await client.start(doc)
                    other = await client.start(doc)  # not cancelled: its commands stay queued

                    async def queued():  # commands in the queue, by execution
                        info = await bus.js.stream_info(COMMANDS, subjects_filter="noetl.cmd.*.*.*")
                        return {x: sum(n for subject, n in (info.state.subjects or {}).items()
                                       if subject.startswith(f"noetl.cmd.default.{x}.")) for x in (eid, other)}

                    for _ in range(200):  # max_in_flight 8: eight one-iteration commands each
                        before = await queued()
                        if before == {eid: 8, other: 8}:
                            break
                        await asyncio.sleep(0.05)
                    await client.cancel(eid, reason="test")
                    assert (await client.wait(eid, timeout=20))["status"] == "CANCELLED"
                    for _ in range(100):  # the router purges after workflow.finished
                        left = await queued()
                        if left[eid] == 0:
                            break
                        await asyncio.sleep(0.05)
                    worker = await start_service("worker", stack.stack.settings)
                    stack.stack.running.append(worker)
                    final = await client.wait(other, timeout=30)
                    events = await client.all_events(eid)
                    return before, left, final, events, eid, other
            finally:
                await bus.close()

        before, left, final, events, eid, other = stack.run(go(), timeout=90)
        assert before == {eid: 8, other: 8} and left == {eid: 0, other: 8}  # only the cancelled one's are gone
        assert final["status"] == "COMPLETED" and final["steps"]["start"]["result"] == list(range(40))
        assert not [e for e in events if e["name"] in ("task.started", "loop.iteration.done")]
    finally:
        stop_stack(nats, loop, stack)


async def _exists(client, eid):
    try:
        await client.status(eid)
        return True
    except Exception:  # noqa: BLE001
        return False


# ------------------------------------------------------------------------------ crashes (processes)
@pytest.fixture
def process_stack(pg_dsn, tmp_path, monkeypatch):
    monkeypatch.setenv("NOETL_CONTROL_ACK_WAIT", "2")
    auth = NatsAuth(tmp_path / "creds").ensure()
    nats = EmbeddedNats(auth=auth).start()
    logs = tmp_path / "logs"
    logs.mkdir()
    stack = ProcessStack(Settings(nats_url=nats.url, pg_dsn=pg_dsn, ack_wait=2.0, concurrency=4,
                                  nats_creds=str(auth.directory)), log_dir=str(logs))
    asyncio.run(stack.start())
    yield stack
    asyncio.run(stack.stop())
    nats.stop()


async def _wait_for_event(client, eid, predicate, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await _exists(client, eid):
            events = await client.all_events(eid)
            if any(predicate(e) for e in events):
                return events
        await asyncio.sleep(0.05)
    raise AssertionError("event not seen")


def test_worker_killed_mid_task_is_redelivered_and_not_double_counted(process_stack):
    stack = process_stack

    async def go():
        async with GatewayClient(stack.gateway_url, token=stack.token) as client:
            eid = await client.start(slow_chain(2, 1.5))
            await _wait_for_event(client, eid, lambda e: e["name"] == "task.started" and e["step"] == "s0")
            stack.kill("worker-0")  # SIGKILL while the python task sleeps
            stack.spawn("worker", "worker-1")
            final = await client.wait(eid, timeout=60)
            return final, await client.all_events(eid)

    final, events = asyncio.run(go())
    assert final["status"] == "COMPLETED"
    assert final["steps"]["s0"] == {"status": "done", "runs": 1, "result": 0}
    s0 = [e for e in events if e["step"] == "s0"]
    # the rerun reproduced the ids of what the dead worker had reported: one task.started of
    # attempt 1 in the log, one task.processed, one step.done (D21)
    assert [e["name"] for e in s0 if e["name"].startswith("task.")] == ["task.started", "task.processed"]
    assert [e["attempt"] for e in s0 if e["name"] == "task.processed"] == [1]
    assert sum(e["name"] == "step.done" for e in s0) == 1


def test_control_plane_killed_and_restarted_mid_execution(process_stack):
    stack = process_stack

    async def go():
        async with GatewayClient(stack.gateway_url, token=stack.token) as client:
            eid = await client.start(slow_chain(6, 0.3))
            await _wait_for_event(client, eid, lambda e: e["name"] == "step.started" and e["step"] == "s1")
            for name in ("admission-0", "router-0", "loop-coordinator-0"):
                stack.kill(name)
            await asyncio.sleep(0.5)
            for name in ("admission", "router", "loop-coordinator"):
                stack.spawn(name, f"{name}-0")
            final = await client.wait(eid, timeout=60)
            return final, await client.all_events(eid)

    final, events = asyncio.run(go())
    assert final["status"] == "COMPLETED"
    assert all(final["steps"][f"s{i}"] == {"status": "done", "runs": 1, "result": i} for i in range(6))
    assert sum(e["name"] == "workflow.finished" for e in events) == 1
    assert sum(e["name"] == "step.admitted" for e in events) == 6


# ------------------------------------------------------------------------------ lost commands
@pytest.mark.parametrize("admission_down", [False, True], ids=["admission-up", "admission-down-meanwhile"])
def test_a_command_no_worker_can_finish_fails_its_step_instead_of_hanging(pg_dsn, admission_down):
    """Workers that take a command and die (here: a consumer that never answers) until it runs out
    of deliveries: admission reports the step run failed (`worker_lost`), the router applies D15. The
    server's advisory is kept in a stream, so it is reported also when no admission ran at that moment."""
    from nats.js.api import AckPolicy as Ack

    from noetl_mesh.infra.bus import COMMANDS, LOST_COMMANDS
    from noetl_mesh.stack import start_service, stop_service

    nats, loop, stack = start_stack(pg_dsn, workers=0)
    try:
        async def go():
            bus = await Bus.connect(stack.nats_url, "black-hole", stack.admin)
            await bus.js.add_consumer(COMMANDS, ConsumerConfig(
                durable_name="black-hole", filter_subject="noetl.cmd.default.>", ack_policy=Ack.EXPLICIT,
                ack_wait=1.0, max_deliver=2, max_ack_pending=100))
            sub = await bus.js.pull_subscribe_bind("black-hole", stream=COMMANDS)
            taken = asyncio.Event()

            async def swallow():
                while True:
                    try:
                        if await sub.fetch(10, timeout=0.5):  # take, never acknowledge
                            taken.set()
                    except asyncio.CancelledError:
                        raise
                    except Exception:  # noqa: BLE001 - empty fetches
                        pass

            task = asyncio.create_task(swallow())
            try:
                async with GatewayClient(stack.url, token=stack.token) as client:
                    eid = await client.start({
                        "apiVersion": "noetl.io/v2", "kind": "Playbook",
                        "metadata": {"name": "lost", "path": "tests/lost"},
                        "workflow": [{"step": "start", "tool": {"kind": "noop", "result": 1},
                                      "next": {"arcs": [{"step": "recover",
                                                         "when": "{{ event.error.kind == 'worker_lost' }}"}]}},
                                     # tool-less: admission finishes it, no worker needed
                                     {"step": "recover", "next": {"arcs": [{"step": "never", "when": "{{ false }}"}]}},
                                     {"step": "never", "tool": {"kind": "noop"}}]})
                    if admission_down:
                        await asyncio.wait_for(taken.wait(), 10)
                        old = [r for r in stack.stack.running if r.name == "admission"]
                        await asyncio.gather(*(stop_service(r) for r in old))
                        for _ in range(100):  # the advisory (after 2 deliveries) is stored, unread
                            if (await bus.js.stream_info(LOST_COMMANDS)).state.messages:
                                break
                            await asyncio.sleep(0.1)
                        else:
                            raise AssertionError("no advisory stored")
                        assert (await client.status(eid, brief=True))["status"] == "RUNNING"
                        fresh = await start_service("admission", stack.stack.settings)
                        stack.stack.running = [r for r in stack.stack.running if r not in old] + [fresh]
                    final = await client.wait(eid, timeout=20)
                    return final, await client.all_events(eid)
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await bus.nc.close()

        final, events = stack.run(go(), timeout=60)
        assert final["status"] == "COMPLETED"  # the failure was routed to `recover` (D15)
        assert final["steps"]["start"]["status"] == "failed" and final["steps"]["recover"]["runs"] == 1
        failed = next(e for e in events if e["name"] == "step.failed")
        assert failed["source"] == "admission" and failed["data"]["error"]["kind"] == "worker_lost"
    finally:
        stop_stack(nats, loop, stack)


def test_a_service_whose_port_was_taken_as_it_started_starts_on_another(pg_dsn, tmp_path, monkeypatch):
    """The stack chooses the gateway's port and each service's metrics port; another process may bind one
    before the service does (a busy machine): that service exits (uvicorn's 3, or 6) and the stack starts
    it again on another port."""
    import socket

    import noetl_mesh.stack as stack_module

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    real, chosen = stack_module.free_port, []

    def first_one_taken() -> int:  # the gateway's port, then the first metrics port: taken
        chosen.append(taken.getsockname()[1] if len(chosen) < 2 else real())
        return chosen[-1]

    monkeypatch.setattr(stack_module, "free_port", first_one_taken)
    auth = NatsAuth(tmp_path / "creds").ensure()
    nats = EmbeddedNats(auth=auth).start()
    logs = tmp_path / "logs"
    logs.mkdir()
    stack = ProcessStack(Settings(nats_url=nats.url, pg_dsn=pg_dsn, nats_creds=str(auth.directory)), log_dir=str(logs))
    try:
        asyncio.run(stack.start())
        first = next(k for k, port in stack.metrics_ports.items() if port != taken.getsockname()[1])
        assert taken.getsockname()[1] not in stack.metrics_ports.values() and first
        assert stack.port != taken.getsockname()[1] and len(chosen) > 3
        said = "".join(p.read_text() for p in logs.iterdir())
        assert f"cannot listen on 127.0.0.1:{taken.getsockname()[1]} for metrics" in said
        assert all(proc.poll() is None for proc in stack.procs.values())
    finally:
        asyncio.run(stack.stop())
        nats.stop()
        taken.close()
