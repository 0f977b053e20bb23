"""The control plane's partition reader (infra/pinned.py) on a real NATS server: batches, yet no
message of a partition is handled before an earlier one — when the pin moves away from a reader that
still holds messages, and when a handler fails on one — and the reader acknowledges cumulatively."""
from __future__ import annotations

import asyncio
import json

from unittest.mock import patch

import nats
import pytest
from nats.aio.msg import Msg
from nats.js.api import AckPolicy

from noetl_mesh.contracts.subjects import control_filter
from noetl_mesh.core.decide import CONSUMES
from noetl_mesh.infra.bus import EVENTS, Bus
from noetl_mesh.infra.pinned import GROUP, PinnedReader

from conftest import until

pytestmark = pytest.mark.integration

DURABLE = "probe-p0"
EARLIER = "probe-earlier-p0"  # an earlier version's durable of the partition


def _collecting(got: list[int]):
    """A handler that notes each message's stream sequence (the reader acks)."""
    async def handle(msg):
        got.append(msg.metadata.sequence.stream)
    return handle


async def _setup(url: str) -> Bus:
    bus = await Bus.connect(url, "pinned")
    await bus.setup(1)
    await bus.consumer(EVENTS, DURABLE, ["noetl.pevt.0.ctl.*.*"], pinned=True, ack_wait=2, max_deliver=50,
                       ack_policy=AckPolicy.ALL)
    return bus


async def _publish(bus: Bus, n: int) -> None:
    for _ in range(n):
        await bus.js.publish("noetl.evt.router.ctl.x1", b"[]")


def test_a_newly_pinned_reader_waits_for_the_messages_an_earlier_one_still_holds(fresh_nats):
    """A reader takes messages 1-3 and dies holding them (never acks); its pin is given up; 4-6 arrive.
    The next reader is pinned and given 4-6 first, yet handles 1-6 in order: it holds 4-6 until
    1-3 come back (their ack_wait, 2 s here)."""
    async def main():
        bus = await _setup(fresh_nats.url)
        dead = await nats.connect(fresh_nats.url)
        try:
            await _publish(bus, 3)
            inbox = dead.new_inbox()
            sub = await dead.subscribe(inbox)
            await dead.publish(f"$JS.API.CONSUMER.MSG.NEXT.{EVENTS}.{DURABLE}",
                               json.dumps({"batch": 3, "expires": 10**9, "group": GROUP}).encode(), reply=inbox)
            taken = [await sub.next_msg(timeout=2) for _ in range(3)]
            assert [m.metadata.sequence.stream for m in taken] == [1, 2, 3]
            await dead.request(f"$JS.API.CONSUMER.UNPIN.{EVENTS}.{DURABLE}", json.dumps({"group": GROUP}).encode())
            await _publish(bus, 3)

            got: list[int] = []
            stop = asyncio.Event()
            reader = PinnedReader(bus, EVENTS, DURABLE, _collecting(got), stop)
            task = asyncio.create_task(reader.run())
            await until(lambda: len(got) >= 6, 15)
            stop.set()
            await task
            assert got == [1, 2, 3, 4, 5, 6]
            assert reader.resyncs >= 1
        finally:
            await dead.close()
            await bus.close()

    asyncio.run(main())


def test_a_failing_handler_holds_up_what_follows_it(fresh_nats):
    """The handler fails on message 2 the first time: it is handed back (with a delay), and 3-5, which
    the reader already received, are handled only after it. (1 is handled first, alone, so that 2-5
    reach a reader that is past its first resync.)"""
    async def main():
        bus = await _setup(fresh_nats.url)
        try:
            attempts: list[int] = []
            done: list[int] = []

            async def handle(msg):
                seq = msg.metadata.sequence.stream
                attempts.append(seq)
                if seq == 2 and attempts.count(2) == 1:
                    raise RuntimeError("a service did not answer")
                done.append(seq)

            stop = asyncio.Event()
            reader = PinnedReader(bus, EVENTS, DURABLE, handle, stop)
            task = asyncio.create_task(reader.run())
            await _publish(bus, 1)
            await until(lambda: done == [1], 5)
            resyncs = reader.resyncs
            await _publish(bus, 4)
            await until(lambda: len(done) >= 5, 15)
            assert reader.resyncs > resyncs
            stop.set()
            await task
            assert done == [1, 2, 3, 4, 5]
            assert attempts.count(2) == 2
        finally:
            await bus.close()

    asyncio.run(main())


def test_two_readers_of_one_partition_never_interleave(fresh_nats):
    """Two readers pull the same partition at once (membership changing): one is pinned and handles
    everything, in order; the other is given nothing."""
    async def main():
        bus = await _setup(fresh_nats.url)
        try:
            got: dict[str, list[int]] = {"a": [], "b": []}

            def handler(name):
                async def handle(msg):
                    got[name].append(msg.metadata.sequence.stream)
                return handle

            stop = asyncio.Event()
            tasks = [asyncio.create_task(PinnedReader(bus, EVENTS, DURABLE, handler(n), stop).run()) for n in got]
            await asyncio.sleep(0.3)
            await _publish(bus, 200)
            await until(lambda: len(got["a"]) + len(got["b"]) >= 200, 20)
            stop.set()
            await asyncio.gather(*tasks)
            handled = got["a"] or got["b"]
            assert not (got["a"] and got["b"]), {k: len(v) for k, v in got.items()}
            assert handled == list(range(1, 201))
        finally:
            await bus.close()

    asyncio.run(main())


def test_a_durable_of_an_earlier_version_hands_over_to_the_new_one(fresh_nats):
    """A partition's durable of an earlier version acknowledged each message (an ack policy a consumer
    cannot change): the new durable starts after its ack floor, and it is deleted."""
    async def main():
        bus = await Bus.connect(fresh_nats.url, "pinned")
        await bus.setup(1)
        try:
            await bus.consumer(EVENTS, EARLIER, ["noetl.pevt.0.ctl.*.*"], max_ack_pending=1, ack_wait=2)
            await _publish(bus, 2)
            sub = await bus.js.pull_subscribe_bind(EARLIER, stream=EVENTS)
            [first] = await sub.fetch(1, timeout=2)
            await first.ack_sync()
            await sub.unsubscribe()
            start = await bus.handover_consumer(EVENTS, EARLIER, {DURABLE: ["noetl.pevt.0.ctl.*.*"]}, pinned=True,
                                                ack_wait=2, ack_policy=AckPolicy.ALL)
            assert start == 2 and await bus.consumer_info(EVENTS, EARLIER) is None
            info = await bus.consumer_info(EVENTS, DURABLE)
            assert info["config"]["ack_policy"] == "all" and info["config"]["max_ack_pending"] == 128
            # a second replica, after the first has handed over: the durable keeps its start
            assert await bus.handover_consumer(EVENTS, EARLIER, {DURABLE: ["noetl.pevt.0.ctl.*.*"]}, pinned=True,
                                               ack_wait=2, ack_policy=AckPolicy.ALL) is None
            got: list[int] = []
            stop = asyncio.Event()
            task = asyncio.create_task(PinnedReader(bus, EVENTS, DURABLE, _collecting(got), stop).run())
            await until(lambda: got == [2], 5)  # where the old durable left off
            stop.set()
            await task
        finally:
            await bus.close()

    asyncio.run(main())


def test_one_ack_covers_many_messages(fresh_nats):
    """A reader handling 300 messages acknowledges them with a few acks, each covering what it
    handled before; once it stops, nothing is unacknowledged."""
    async def main():
        bus = await _setup(fresh_nats.url)
        spy = await nats.connect(fresh_nats.url)
        try:
            acks: list[str] = []

            async def note(msg):
                acks.append(msg.subject)

            await spy.subscribe(f"$JS.ACK.{EVENTS}.{DURABLE}.>", cb=note)
            await spy.flush()
            got: list[int] = []
            stop = asyncio.Event()
            task = asyncio.create_task(PinnedReader(bus, EVENTS, DURABLE, _collecting(got), stop).run())
            await asyncio.sleep(0.3)
            await _publish(bus, 300)
            await until(lambda: len(got) >= 300, 20)
            stop.set()
            await task
            info = await bus.consumer_info(EVENTS, DURABLE)
            assert got == list(range(1, 301))
            assert info["num_ack_pending"] == 0 and info["ack_floor"]["stream_seq"] == 300
            assert 0 < len(acks) <= 300 // 10, len(acks)
        finally:
            await spy.close()
            await bus.close()

    asyncio.run(main())


def test_an_ack_that_was_lost_is_sent_again_when_its_messages_come_back(fresh_nats):
    """The ack covering 1-3 never reaches the server (a node failing over with it): after ack_wait the
    consumer redelivers 1-3, which the reader handled and believes acknowledged. It acks them again
    instead of waiting for the consumer to count them as its own forever, handles none of them twice,
    and goes on with 4-5."""
    async def main():
        bus = await _setup(fresh_nats.url)
        real, lost = Msg.ack, []

        async def lossy(msg):
            if not lost:
                lost.append(msg.metadata.sequence.stream)
                return
            await real(msg)

        try:
            got: list[int] = []
            stop = asyncio.Event()
            with patch.object(Msg, "ack", lossy):
                task = asyncio.create_task(PinnedReader(bus, EVENTS, DURABLE, _collecting(got), stop).run())
                await asyncio.sleep(0.3)
                await _publish(bus, 3)
                await until(lambda: got == [1, 2, 3] and lost, 5)
                await asyncio.sleep(3)  # ack_wait (2 s): 1-3 come back
                await _publish(bus, 2)
                await until(lambda: len(got) >= 5, 10)
                await asyncio.sleep(0.3)
                info = await bus.consumer_info(EVENTS, DURABLE)
                stop.set()
                await task
            assert lost == [3] and got == [1, 2, 3, 4, 5]
            assert info["num_ack_pending"] == 0 and info["ack_floor"]["stream_seq"] == 5, info
        finally:
            await bus.close()

    asyncio.run(main())


def test_a_stopping_reader_gives_back_what_arrives_late_once_and_only_after_unpinning(fresh_nats):
    """Messages delivered to a stopping reader's still-open pull request are given back after it has
    unpinned, each delivered there once: a nak while the request is open would come straight back to
    it, again and again, each time counting towards max_deliver."""
    async def main():
        bus = await _setup(fresh_nats.url)
        try:
            await _publish(bus, 1)
            got_a: list[int] = []
            stop_a = asyncio.Event()
            a = asyncio.create_task(PinnedReader(bus, EVENTS, DURABLE, _collecting(got_a), stop_a).run())
            await until(lambda: got_a == [1], 5)
            stop_a.set()
            await asyncio.sleep(0.4)  # its loop has ended: it is releasing, its request still open
            await _publish(bus, 5)
            await a
            got_b: dict[int, int] = {}

            async def handle_b(msg):
                got_b[msg.metadata.sequence.stream] = msg.metadata.num_delivered

            stop_b = asyncio.Event()
            b = asyncio.create_task(PinnedReader(bus, EVENTS, DURABLE, handle_b, stop_b).run())
            await until(lambda: set(got_a) | set(got_b) == {1, 2, 3, 4, 5, 6}, 10)
            stop_b.set()
            await b
            assert got_b, "the stopping reader handled everything: nothing was late"
            assert max(got_b.values()) <= 2, got_b  # once to the stopping reader, once to the next
        finally:
            await bus.close()

    asyncio.run(main())


def test_setup_gives_the_durables_of_an_earlier_version_the_classes_read_now(fresh_nats):
    """A router durable made when the router read ``ctl`` only: setup adds ``flat`` (but the router's own)
    before any writer of this version sends it, keeping the durable's position, its ack floor and its
    pinned group."""
    async def main():
        bus = await Bus.connect(fresh_nats.url, "pinned")
        await bus.setup(1)
        try:
            await bus.consumer(EVENTS, "router-all-p0", ["noetl.pevt.0.ctl.*.*"], pinned=True, ack_wait=2,
                               max_deliver=50, ack_policy=AckPolicy.ALL)
            await _publish(bus, 2)
            got: list[int] = []
            stop = asyncio.Event()
            reader = asyncio.create_task(PinnedReader(bus, EVENTS, "router-all-p0", _collecting(got), stop).run())
            await until(lambda: got == [1, 2], 5)
            stop.set()
            await reader  # it acks what it handled as it stops
            await bus.setup(1)  # an upgrade's setup
            info = await bus.consumer_info(EVENTS, "router-all-p0")
            assert info["config"]["filter_subjects"] == control_filter("router", 0, CONSUMES["router"])
            assert info["config"]["ack_policy"] == "all" and info["config"]["priority_groups"] == [GROUP]
            assert info["ack_floor"]["stream_seq"] == 2  # where it was
            assert await bus.consumer_info(EVENTS, "loop-coordinator-all-p0") is None  # none made that was not there
            await bus.js.publish("noetl.evt.worker.flat.x1", b"[]")
            await bus.js.publish("noetl.evt.worker.loop.x1", b"[]")  # not a class the router reads
            await bus.js.publish("noetl.evt.router.flat.x1", b"[]")  # its own flat message: folded when made
            await bus.js.publish("noetl.evt.router.ctl.x1", b"[]")
            got = []
            stop = asyncio.Event()
            reader = asyncio.create_task(PinnedReader(bus, EVENTS, "router-all-p0", _collecting(got), stop).run())
            await until(lambda: got == [3, 6], 5)
            stop.set()
            await reader
        finally:
            await bus.close()

    asyncio.run(main())
