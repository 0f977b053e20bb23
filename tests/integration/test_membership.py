"""Replicas of a control-plane service share the partitions out through NATS KV membership: disjoint
sets that cover every partition, handed over when a replica leaves or dies; and in a stack with two
replicas of each service, executions run without cache rebuilds."""
from __future__ import annotations

import asyncio
import threading
import time
from unittest.mock import patch

import nats
import pytest

from noetl_mesh.client import GatewayClient
from noetl_mesh.infra.bus import EVENTS, Bus
from noetl_mesh.infra.control import PartitionedService
from noetl_mesh.infra.membership import BUCKET, Membership, assign

from conftest import start_stack, stop_stack, until

pytestmark = pytest.mark.integration


def test_assign_deals_every_partition_to_exactly_one_member():
    members = ["g.c", "g.a", "g.b"]
    sets = [assign(16, members, m) for m in members]
    assert set().union(*sets) == set(range(16)) and sum(len(s) for s in sets) == 16
    assert assign(16, members, "g.a") == {0, 3, 6, 9, 12, 15}  # sorted order, p mod n
    assert assign(4, [], "g.x") == {0, 1, 2, 3}  # not (yet) a member: read everything
    assert assign(4, ["g.x"], "g.x") == {0, 1, 2, 3}


async def _settled(groups, partitions, timeout=10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        owned = [m.owned for m in groups]
        if set().union(*owned) == set(range(partitions)) and sum(len(o) for o in owned) == partitions:
            return owned
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not settled: {owned}")
        await asyncio.sleep(0.1)


def test_a_key_that_holds_no_heartbeat_is_no_member(fresh_nats):
    """The NATS server answers a JetStream API request to any reply subject its requester names, a key
    of the members bucket among them: such a key, the server's JSON, counts as no replica (else 24 of
    them would deal every partition away from the real one)."""
    async def main():
        nc = await nats.connect(fresh_nats.url)
        js = nc.jetstream()
        try:
            a = Membership(js, "svc", 16, lambda owned: None, ttl=5)
            await a.beat()
            for n in range(24):  # as a requester with any permission to ask the JetStream API could have it
                await nc.publish(f"$JS.API.STREAM.INFO.KV_{BUCKET}", b"", reply=f"$KV.{BUCKET}.svc.-{n:02}")
            await nc.flush()
            for _ in range(200):  # the server writes its answers as it makes them
                info = await js.stream_info(f"KV_{BUCKET}", subjects_filter=f"$KV.{BUCKET}.svc.>")
                if len(info.state.subjects or {}) == 25:
                    break
                await asyncio.sleep(0.05)
            assert len(info.state.subjects) == 25  # the server wrote them
            await a.beat()
            assert a.members == [a.me] and a.owned == set(range(16))
            b = Membership(js, "svc", 16, lambda owned: None, ttl=5)  # a real replica still counts
            await b.beat()
            await a.beat()
            assert a.members == sorted([a.me, b.me]) and len(a.owned) == 8
            for n in range(24, 80):  # more keys than any stack has replicas: none read, every partition read
                await nc.publish(f"$JS.API.STREAM.INFO.KV_{BUCKET}", b"", reply=f"$KV.{BUCKET}.svc.-{n:02}")
            await nc.flush()
            for _ in range(200):
                info = await js.stream_info(f"KV_{BUCKET}", subjects_filter=f"$KV.{BUCKET}.svc.>")
                if len(info.state.subjects or {}) == 82:
                    break
                await asyncio.sleep(0.05)
            await a.beat()
            assert a.owned == set(range(16))
        finally:
            await nc.close()

    asyncio.run(main())


def test_members_share_partitions_and_take_over_from_one_that_leaves_or_dies(fresh_nats):
    async def main():
        nc = await nats.connect(fresh_nats.url)
        js = nc.jetstream()
        changes: list[set[int]] = []
        try:
            a, b, c = (Membership(js, "svc", 12, changes.append, ttl=1.5) for _ in range(3))
            other = Membership(js, "other", 12, lambda owned: None, ttl=1.5)  # another service's group
            for m in (a, b, c, other):
                await m.start()
            owned = await _settled([a, b, c], 12)
            assert all(len(o) == 4 for o in owned) and other.owned == set(range(12))
            await c.stop()  # leaves: its key is deleted, the others take its partitions at their next read
            await _settled([a, b], 12, timeout=3)
            b.task.cancel()  # dies: no more heartbeats, its key expires after the TTL
            await asyncio.gather(b.task, return_exceptions=True)
            deadline = time.monotonic() + 60  # its key expires 1.5 s after its last beat: a loaded NATS is slower
            while a.members != [a.me] and time.monotonic() < deadline:
                try:
                    await asyncio.wait_for(a.beat(), 10)
                except asyncio.TimeoutError:
                    continue
                await asyncio.sleep(0.1)
            assert a.owned == set(range(12)) and a.members == [a.me]
            assert changes  # owners were told of every change
            kv = await js.key_value(BUCKET)
            assert sorted(await kv.keys()) == sorted([a.me, other.me])  # the left one left no marker
            await a.stop()
            await other.stop()
        finally:
            await nc.close()

    asyncio.run(main())


def test_two_replicas_of_each_service_run_without_rebuilds(module_pg):
    nats_server, loop, stack = start_stack(module_pg, replicas=2)
    try:
        services = {name: stack.stack.services(name) for name in ("admission", "router", "loop-coordinator")}

        async def go():
            for replicas in services.values():  # both replicas have joined and split the partitions
                await _settled([r.membership for r in replicas], stack.stack.running[0].bus.partitions)
                for _ in range(100):  # and the readers of partitions handed over have finished
                    if all(t.done() for r in replicas for t in r.tasks):
                        break
                    await asyncio.sleep(0.05)
            for replicas in services.values():
                for r in replicas:
                    r.rebuilds = 0
            async with GatewayClient(stack.url, token=stack.token) as client:
                doc = {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "c", "path": "t/c"},
                       "workflow": [{"step": f"s{i}", "tool": {"kind": "noop", "result": i},
                                     **({"next": {"arcs": [{"step": f"s{i + 1}"}]}} if i < 4 else {})}
                                    for i in range(5)]}
                ids = await asyncio.gather(*(client.start(doc) for _ in range(20)))
                return [await client.wait(eid, timeout=60) for eid in ids]

        finals = stack.run(go(), 120)
        assert all(f["status"] == "COMPLETED" for f in finals)
        for name, replicas in services.items():
            assert sum(r.handled for r in replicas) > 0
            assert [r.rebuilds for r in replicas] == [0, 0], name  # each replica's cache stayed valid
            assert not (replicas[0].owned & replicas[1].owned), name
    finally:
        stop_stack(nats_server, loop, stack)


class Recorder(PartitionedService):
    """A control-plane shell whose handler only records what it got (stream seq, time)."""

    name = "probe"

    def __init__(self, bus, slow: float = 0.0):
        super().__init__(bus, ack_wait=10)
        self.got: list[tuple[int, float]] = []
        self.slow = slow

    async def handle(self, msg):
        self.got.append((msg.metadata.sequence.stream, time.monotonic()))
        await asyncio.sleep(self.slow)
        await msg.ack()


def test_a_handover_never_strands_a_message_until_ack_wait(fresh_nats):
    """A reader handed its partition away while its pull request is still open, and its event loop
    busy past the request's deadline: the delivery that arrives late is given back at once (not held
    for ack_wait, 10 s here), and a graceful stop hands over the message in hand the same way."""
    async def main():
        a_bus, b_bus = await Bus.connect(fresh_nats.url, "a"), await Bus.connect(fresh_nats.url, "b")
        await a_bus.setup(1)
        await b_bus.attach()
        a, b = Recorder(a_bus), Recorder(b_bus, slow=0.3)
        for svc, bus in ((a, a_bus), (b, b_bus)):
            await bus.consumer(EVENTS, "probe-p0", ["noetl.pevt.0.ctl.*.*"], pinned=True, ack_wait=10)
        try:
            a._read({0})
            await asyncio.sleep(0.3)  # a's reader waits in a fetch (1 s long poll)
            a._read(set())  # handed away
            publisher = threading.Thread(target=lambda: (time.sleep(0.3), asyncio.run(_publish(fresh_nats.url, 1))))
            publisher.start()
            time.sleep(1.2)  # a's loop is blocked past the fetch deadline: the delivery lands late
            publisher.join()
            t0 = time.monotonic()
            b._read({0})
            await until(lambda: len(b.got) == 1, 5)
            assert b.got[0][1] - t0 < 3 and a.got == []  # given back at once, and never handled by a
            await _publish(fresh_nats.url, 5)
            await until(lambda: len(b.got) >= 2, 5)
            t1 = time.monotonic()
            await b.stop()  # graceful: finishes or gives back what it holds
            a._read({0})
            await until(lambda: {seq for seq, _ in a.got + b.got} == {1, 2, 3, 4, 5, 6}, 8)
            seqs = [seq for seq, _ in sorted(a.got + b.got, key=lambda g: g[1])]
            assert seqs == sorted(seqs)  # in log order, across the handover
            assert max(t for _, t in a.got) - t1 < 8  # no ack_wait (10 s) in between
        finally:
            await a.stop()
            await a_bus.close()
            await b_bus.close()

    asyncio.run(main())


async def _publish(url: str, n: int) -> None:
    nc = await nats.connect(url)
    try:
        for _ in range(n):
            await nc.jetstream().publish("noetl.evt.router.ctl.x1", b"[]")
    finally:
        await nc.close()


def test_first_seq_finds_an_executions_first_message_of_any_class(fresh_nats):
    """What tells a child's request whether a cancellation came before it (control.handle)."""
    from noetl_mesh.core.events import make_event

    async def main():
        bus = await Bus.connect(fresh_nats.url, "first")
        await bus.setup(1)
        try:
            assert await bus.first_seq("c1", 0) is None
            other = await bus.publish_event(make_event("execution.cancelled", "c0", event_id="x0", source="gateway"))
            cancel = await bus.publish_event(make_event("execution.cancelled", "c1", event_id="x1", source="router"))
            request = await bus.publish_event(make_event("playbook.execution.requested", "c1", event_id="x2", source="admission"))
            info = await bus.publish_event(make_event("task.started", "c2", event_id="x3", source="worker:default"))
            seq = lambda log_seq: log_seq // 1024  # noqa: E731 - stream sequence of a log_seq
            assert await bus.first_seq("c1", 0) == seq(cancel) < seq(request) and seq(other) < seq(cancel)
            assert await bus.first_seq("c2", 0) == seq(info)  # an info-class message counts too
        finally:
            await bus.close()

    asyncio.run(main())


def test_a_reader_that_fails_outside_its_handler_is_replaced(fresh_nats):
    """A pull request the connection refuses (nats-py raises while it reconnects with a full buffer)
    ends that reader; another takes its place, and the partition's messages are still handled."""
    from noetl_mesh.infra import pinned
    from nats.errors import OutboundBufferLimitError

    real, refused = pinned.PinnedReader._request, []

    async def refuse_once(self):
        if not refused:
            refused.append(self)
            raise OutboundBufferLimitError
        await real(self)

    async def main():
        bus = await Bus.connect(fresh_nats.url, "r")
        await bus.setup(1)
        await bus.consumer(EVENTS, "probe-p0", ["noetl.pevt.0.ctl.*.*"], pinned=True, ack_wait=10)
        probe = Recorder(bus)
        try:
            with patch.object(pinned.PinnedReader, "_request", refuse_once):
                probe._read({0})
                await _publish(fresh_nats.url, 3)
                await until(lambda: len(probe.got) == 3, 8)
            assert len(refused) == 1 and not probe.readers[0][0].done()
            probe.started = True  # (the probe was not started through start())
            readiness = await probe.ready()  # failed a moment ago: said, for a few seconds
            assert not readiness["ok"] and "OutboundBufferLimitError" in readiness["error"], readiness
            probe.failed[0] = (probe.failed[0][0] - 10, probe.failed[0][1])
            assert (await probe.ready())["ok"]
        finally:
            await probe.stop()
            await bus.close()

    asyncio.run(main())


def test_reading_an_execution_back_skips_a_message_that_cannot_be_read(fresh_nats):
    """A rebuild reads the execution's messages back; one that is not JSON (dropped when it was
    delivered) is skipped there too, instead of failing every later event's rebuild."""
    from noetl_mesh.core.events import make_event

    async def main():
        bus = await Bus.connect(fresh_nats.url, "reader")
        await bus.setup(1)
        try:
            await bus.publish_event(make_event("playbook.execution.requested", "c9", event_id="y1", source="gateway"))
            await bus.js.publish("noetl.evt.worker.ctl.c9", b"not json")
            await bus.publish_event(make_event("execution.cancelled", "c9", event_id="y2", source="gateway"))
            events = await bus.execution_events("c9", 0)
            assert [e["event_id"] for _, e in events] == ["y1", "y2"]
        finally:
            await bus.close()

    asyncio.run(main())
