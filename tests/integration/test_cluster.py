"""A 3-node NATS cluster started by the embedded module: streams, KV bucket and object store get three
replicas, and killing a node mid-run (the events stream's leader) loses nothing."""
from __future__ import annotations

import asyncio
import time

import pytest

from noetl_mesh.client import GatewayClient
from noetl_mesh.core.verify import verify
from noetl_mesh.infra.bus import COMMANDS, EVENTS, Bus
from noetl_mesh.infra.embedded import EmbeddedNatsCluster
from noetl_mesh.infra.nats_auth import NatsAuth
from noetl_mesh.stack import InProcessStack, Settings
from noetl_mesh.testing.chaos import busy_consumers

from conftest import LoopThread
from scenarios import slow_chain

pytestmark = pytest.mark.integration


def chain(n: int, sleep: float) -> dict:
    doc = slow_chain(n, sleep, result="i * 2")
    doc["workflow"][-1]["next"] = {"arcs": [{"step": "big"}]}
    doc["workflow"].append({"step": "big", "tool": {"kind": "noop", "result": "{{ 'x' * 300000 }}"}})  # D23
    return doc


async def wait_or_explain(client: GatewayClient, bus: Bus, execution_id: str) -> dict:
    """The execution's final state; when it does not end, what it recorded and where every consumer
    stands (so that a failure says which reader stopped)."""
    try:
        return await client.wait(execution_id, timeout=120)
    except TimeoutError:
        events = [f"{e.get('name')}:{e.get('step') or ''}" for e in await client.all_events(execution_id)]
        streams = {}
        for stream in (EVENTS, COMMANDS):
            try:
                info = await bus.js.stream_info(stream, subjects_filter=f"noetl.cmd.*.{execution_id}.*"
                                                if stream == COMMANDS else f"noetl.pevt.*.*.{execution_id}.*")
                streams[stream] = (f"messages {info.state.messages} first {info.state.first_seq} "
                                   f"last {info.state.last_seq} leader {info.cluster.leader if info.cluster else None} "
                                   f"the execution's messages by subject {info.state.subjects}")
            except Exception as exc:  # noqa: BLE001 - say what could not be asked
                streams[stream] = f"not answered: {type(exc).__name__} {exc}"
        try:
            consumers = await busy_consumers(bus.js)
        except Exception as exc:  # noqa: BLE001
            consumers = [f"not answered: {type(exc).__name__} {exc}"]
        raise AssertionError(f"execution {execution_id} did not finish within 120 s; recorded {events}; "
                             f"streams {streams}; consumers {consumers}; readers {readers()}") from None


async def whole(client: GatewayClient, execution_id: str, within: float = 3.0) -> dict:
    """The final state once its record is whole. A delivery to the recorder lost with the killed node is
    read from the stream about a second after the recorder finds the gap (architecture.md §5, "A
    delivery lost on the way"), so an execution's later events, even its end, may be recorded that much
    before it. A record still not whole after ``within`` seconds is returned as it is, to fail."""
    deadline = time.monotonic() + within
    while not verify(await client.all_events(execution_id), execution_id).ok and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    return await client.status(execution_id)


def readers() -> dict[str, str]:
    """Where each partition reader of this process's stack that is not waiting for a delivery is (its
    chain of awaits): a reader stuck somewhere shows there."""
    out = {}
    for task in asyncio.all_tasks():
        if "-p" not in task.get_name():
            continue
        frames, coro = [], task.get_coro()
        while coro is not None:
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
            if frame is not None:
                frames.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
            coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        if not any(f.startswith("_next:") for f in frames):  # not waiting for a delivery
            out[task.get_name()] = " > ".join(frames)
    return out


def test_three_nodes_replicate_everything_and_survive_losing_the_leader(pg_dsn, tmp_path):
    auth = NatsAuth(tmp_path / "creds").ensure()
    cluster = EmbeddedNatsCluster(3, auth=auth).start()
    loop = LoopThread()
    stack = None
    try:
        stack = loop.run(InProcessStack(Settings(nats_url=cluster.url, pg_dsn=pg_dsn, replicas=3, ack_wait=5.0,
                                                 nats_creds=str(auth.directory)),
                                        workers=2).start(), timeout=120)

        async def go():
            bus = await Bus.connect(cluster.url, "probe", auth.admin)
            try:
                async with GatewayClient(stack.gateway_url, token=stack.token) as client:
                    ids = [await client.start(chain(6, 0.3)) for _ in range(8)]
                    await asyncio.sleep(1.0)
                    leader = (await bus.js.stream_info(EVENTS)).cluster.leader
                    cluster.kill(int(leader.rsplit("-", 1)[1]))  # mid-run, the events stream's leader
                    for x in ids:
                        await wait_or_explain(client, bus, x)
                    finals = [await whole(client, x) for x in ids]
                    reports = [verify(await client.all_events(x), x) for x in ids]
                infos = {name: (await bus.js.stream_info(name)).config.num_replicas
                         for name in (EVENTS, COMMANDS, "KV_noetl_members", "OBJ_noetl_payloads",
                                      "KV_noetl_sessions", "KV_noetl_users", "NOETL_AUDIT")}
                new_leader = (await bus.js.stream_info(EVENTS)).cluster.leader
                return finals, reports, infos, leader, new_leader
            finally:
                await bus.close()

        finals, reports, infos, leader, new_leader = loop.run(go(), timeout=300)
    finally:
        if stack is not None:
            loop.run(stack.stop(), timeout=60)
        loop.close()
        cluster.stop()
    assert set(infos.values()) == {3}, infos
    assert new_leader != leader
    for final, report in zip(finals, reports):
        assert final["status"] == "COMPLETED", final
        assert [final["steps"].get(f"s{i}", {}).get("result") for i in range(6)] == [0, 2, 4, 6, 8, 10], (final, report)
        assert final["steps"]["big"]["result"] == "x" * 300000
        assert report.ok, report.findings
