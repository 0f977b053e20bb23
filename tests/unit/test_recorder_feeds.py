"""The recorder's cumulative acks (services/event_recorder/feeds.py) against a fake consumer: what it
acks, and what it must not ack, when another reader held messages of the partition."""
from __future__ import annotations

import asyncio
import random
from datetime import datetime, timezone
from types import SimpleNamespace

import orjson
import pytest
from nats.js.api import RawStreamMsg
from nats.js.errors import NotFoundError

from noetl_mesh.services.event_recorder import feeds
from noetl_mesh.services.event_recorder.feeds import Feed, StoredMessage


class FakeConsumer:
    """The server's side: which stream sequences are unacknowledged, and the ack floor. As the NATS
    server does for AckPolicy.ALL: an ack of (stream S, delivery D) acknowledges every pending message
    up to S and moves the floor to (D, S), and is ignored when D or S is at or below the floor."""

    def __init__(self, pending: set[int], lagging=None):
        self.pending, self.floor, self.acked, self.ignored, self.naked = set(pending), (0, 0), [], [], []
        self.lagging = lagging  # a Random: info then sometimes shows the floor before the last ack
        self.floors = [(0, 0)]
        self.ghosts: list[int] = []  # stream sequences redelivered just before an ack covered them

    def ack(self, stream: int, consumer: int) -> None:
        if self.lagging and self.lagging.random() < 0.3:  # redeliveries on their way as the ack arrives
            self.ghosts += [s for s in sorted(self.pending) if s <= stream and self.lagging.random() < 0.5]
        if consumer <= self.floor[0] or stream <= self.floor[1]:
            self.ignored.append(stream)
            return
        self.acked.append(stream)
        self.pending = {s for s in self.pending if s > stream}
        self.floor = (consumer, stream)
        self.floors.append(self.floor)

    def info(self) -> dict:
        """A replicated consumer's leader reports the ack floor of its store, which an ack reaches
        after the cluster has taken it: it may lag behind the pending count."""
        floor = self.floors[-2] if self.lagging and len(self.floors) > 1 and self.lagging.random() < 0.3 else self.floor
        return {"ack_floor": {"consumer_seq": floor[0], "stream_seq": floor[1]},
                "num_ack_pending": len(self.pending)}


class FakeMsg:
    def __init__(self, consumer: FakeConsumer, stream: int, delivery: int):
        self.metadata = SimpleNamespace(sequence=SimpleNamespace(stream=stream, consumer=delivery), num_pending=0)
        self.headers = None
        self.consumer = consumer
        consumer.pending.add(stream)

    async def ack(self) -> None:
        self.consumer.ack(self.metadata.sequence.stream, self.metadata.sequence.consumer)

    async def nak(self, delay=None) -> None:
        self.consumer.naked.append(self.metadata.sequence.stream)


class FakeNats:
    """Answers CONSUMER.INFO for the fake consumer (counted); its ``js`` reads a stream that holds the
    partition's messages 1 to ``stored`` (counted as ``read``)."""

    def __init__(self, consumer: FakeConsumer, stored: int = 10_000):
        self.consumer, self.asked, self.is_closed, self.stored, self.read = consumer, 0, False, stored, 0

    async def request(self, subject: str, payload: bytes, timeout: float = 1.0):
        self.asked += 1
        return SimpleNamespace(data=orjson.dumps(self.consumer.info()))

    async def get_msg(self, stream: str, seq: int, subject: str, next: bool) -> RawStreamMsg:
        """nats-py's JetStreamManager.get_msg: the next message of ``subject`` at or after ``seq``."""
        self.read += 1
        assert stream == "NOETL_EVENTS" and subject == "noetl.pevt.0.>" and next
        if seq > self.stored:
            raise NotFoundError()
        return RawStreamMsg(subject="noetl.pevt.0.ctl.x.admission", seq=seq, data=b"[]",
                            headers={"Nats-Msg-Id": "m"}, time=datetime(2026, 11, 27, 19, 30, tzinfo=timezone.utc))


def feed_with(consumer: FakeConsumer) -> tuple[Feed, FakeNats]:
    nc = FakeNats(consumer)
    return Feed(SimpleNamespace(nc=nc, js=nc, throwaway=False), 0, asyncio.Queue(), limit=1000), nc


def settle(feed: Feed, msgs: list) -> list[StoredMessage]:
    """``feed.settle(msgs)``, and the messages a read of a gap it began meanwhile put on its queue (when
    GAP_READ_AFTER is 0; else the read waits, and is cancelled with the loop)."""
    async def go() -> None:
        await feed.settle(msgs)
        if feed.gap_task is not None and feeds.GAP_READ_AFTER == 0:
            await feed.gap_task
    asyncio.run(go())
    out = []
    while not feed.out.empty():
        out.append(feed.out.get_nowait()[1])
    return out


def deliver(feed: Feed, msgs: list[FakeMsg]) -> None:
    """What ``_on_msg`` does with a delivery: in flight until recorded."""
    for m in msgs:
        seq = m.metadata.sequence.stream
        feed.inflight[seq] = feed.inflight.get(seq, 0) + 1


def test_a_feed_alone_acks_the_highest_recorded_sequence_without_asking():
    c = FakeConsumer(set())
    feed, nc = feed_with(c)
    batch = [FakeMsg(c, s, s) for s in range(1, 11)]
    deliver(feed, batch)
    asyncio.run(feed.settle(batch))
    assert c.acked == [10] and nc.asked == 0 and not feed.held and not c.pending
    more = [FakeMsg(c, s, s) for s in range(11, 21)]
    deliver(feed, more)
    asyncio.run(feed.settle(more))
    assert c.acked == [10, 20] and nc.asked == 0


def test_messages_another_reader_holds_hold_the_acks_until_they_are_redelivered_and_recorded():
    """A dead reader held stream 1-100 (deliveries 1-100). This feed records 101-600 (deliveries
    101-600): it may not ack, since that would ack 1-100 unrecorded. Then 1-100 come back (deliveries
    601-700) and are queued while a batch is written: still no ack, though the consumer's pending
    count (600) now equals what the feed holds plus what it has in flight. With half of them
    recorded it still does not ack 50: the server would move its delivery floor to 650, past the
    deliveries of 101-600, and ignore an ack of any of them. Once all are recorded it acks 600."""
    c = FakeConsumer(set(range(1, 101)))
    feed, nc = feed_with(c)
    mine = [FakeMsg(c, s, s) for s in range(101, 601)]
    deliver(feed, mine)
    asyncio.run(feed.settle(mine))
    assert c.acked == [] and nc.asked == 1 and len(feed.held) == 500
    again = [FakeMsg(c, s, 600 + s) for s in range(1, 101)]
    deliver(feed, again)  # redelivered, queued behind the batch being written
    asyncio.run(feed.settle([]))
    assert c.acked == []  # not while 1-100 are unrecorded
    asyncio.run(feed.settle(again[:50]))
    assert c.acked == []
    asyncio.run(feed.settle(again[50:]))
    assert c.acked == [600] and not c.ignored and not feed.held and not c.pending


def test_acks_held_past_the_gap_read_time_read_what_is_missing_from_the_stream(monkeypatch):
    """A delivery lost on the way (stream 3, delivery 3): the feed records 1-2 and 4-10 and may not
    ack past 3. Once it has held its acks for GAP_READ_AFTER, it reads what it lacks below its own
    from the stream (3 alone: the rest it holds), records it like a delivery, and its next ack covers
    it: nothing waits for the redelivery at ack_wait. A hold that ends before GAP_READ_AFTER reads
    nothing."""
    c = FakeConsumer(set())
    feed, nc = feed_with(c)
    FakeMsg(c, 1, 1)  # delivered, and redelivered before the gap read time
    got = [FakeMsg(c, 2, 2)]
    deliver(feed, got)

    async def hold_then_get_it_back() -> None:
        await feed.settle(got)
        assert c.acked == [] and feed.gap_task is not None and not feed.gap_task.done()
        again = FakeMsg(c, 1, 3)
        deliver(feed, [again])
        await feed.settle([again])
        await feed.gap_task
    asyncio.run(hold_then_get_it_back())
    assert c.acked == [2] and nc.read == 0 and feed.out.empty()

    monkeypatch.setattr(feeds, "GAP_READ_AFTER", 0.0)
    c = FakeConsumer(set())
    feed, nc = feed_with(c)
    lost = FakeMsg(c, 3, 3)  # delivered: pending at the server, never arrived
    got = [FakeMsg(c, s, s) for s in (1, 2, *range(4, 11))]
    deliver(feed, got)
    assert settle(feed, got[:2]) == [] and c.acked == [2]
    read = settle(feed, got[2:])  # held: the gap is read
    assert [m.metadata.sequence.stream for m in read] == [3] and nc.read == 7  # 3, then 4-10 (held) to the top
    assert read[0].metadata.sequence.consumer == 0 and read[0].headers == {"Nats-Msg-Id": "m"}
    assert read[0].data == b"[]" and read[0].metadata.timestamp.year == 2026 and feed.inflight == {3: 1}
    assert c.acked == [2] and 3 in c.pending
    assert settle(feed, read) == []  # recorded: ack 10, which covers 3
    assert c.acked == [2, 10] and not c.pending and not c.ignored and not feed.held and feed.holding_since is None
    assert lost.metadata.sequence.stream not in c.pending


def test_a_quiet_partition_reads_its_gap_while_the_writer_is_idle(monkeypatch):
    """A delivery lost on the way (stream 1) while NATS did not answer the consumer's info: the batch's
    settle cannot tell a gap, and no other batch comes (the partition went quiet, its execution over).
    The writer's idle turn (``tend``) asks again, reads the gap from the stream, and once that is
    recorded the ack covers it: the log is whole without waiting for the redelivery at ack_wait."""
    monkeypatch.setattr(feeds, "GAP_READ_AFTER", 0.0)
    c = FakeConsumer(set())
    feed, nc = feed_with(c)
    FakeMsg(c, 1, 1)  # delivered: pending at the server, never arrived
    got = [FakeMsg(c, s, s) for s in range(2, 6)]
    deliver(feed, got)
    answering = nc.request

    async def not_answered(*args, **kwargs):
        raise TimeoutError("nats: timeout")
    nc.request = not_answered
    assert settle(feed, got) == [] and c.acked == [] and feed.gap_task is None and len(feed.held) == 4
    nc.request = answering

    async def idle() -> None:
        await feed.tend()
        await feed.gap_task
    asyncio.run(idle())
    read = [feed.out.get_nowait()[1] for _ in range(feed.out.qsize())]
    assert [m.metadata.sequence.stream for m in read] == [1]
    assert settle(feed, read) == [] and c.acked == [5] and not c.pending and not feed.held
    asyncio.run(feed.tend())  # nothing held: nothing asked
    assert c.acked == [5] and not c.ignored


def test_a_redelivery_of_a_recorded_message_does_not_stop_the_ack():
    c = FakeConsumer(set())
    feed, _ = feed_with(c)
    first = [FakeMsg(c, s, s) for s in range(1, 11)]
    deliver(feed, first)
    redelivered = FakeMsg(c, 7, 11)  # its ack_wait ran out while the batch was written
    deliver(feed, [redelivered])
    asyncio.run(feed.settle(first))  # 7 is recorded (its first delivery): everything may be acked
    assert c.acked == [10]
    asyncio.run(feed.settle([redelivered]))  # recorded again, idempotently: nothing new to ack
    assert c.acked == [10] and not feed.held


def test_a_released_feed_acks_nothing_and_gives_back_what_it_records_late():
    c = FakeConsumer(set())
    feed, _ = feed_with(c)
    batch = [FakeMsg(c, s, s) for s in range(1, 4)]
    deliver(feed, batch)
    feed.closed = True  # its pin was given up: another reader may hold later messages
    asyncio.run(feed.settle(batch))
    assert c.acked == [] and c.naked == [1, 2, 3] and not feed.inflight


@pytest.mark.parametrize("gap_reads", [False, True], ids=["redelivered", "read-from-the-stream"])
def test_acks_cover_only_recorded_messages_and_the_server_takes_every_one(monkeypatch, gap_reads):
    """Random interleavings of dead readers' deliveries (at the start and midway), fresh deliveries,
    redeliveries (ack_wait) and recorded batches, with a consumer whose reported floor sometimes lags one ack behind: every
    ack the server takes covers only recorded messages, it ignores none (each is above its floor), and
    once the pending messages have come back the floor is the end. ``gap_reads``: the feed reads what
    it lacks from the stream as soon as its acks are held (the reads recorded in later batches)."""
    monkeypatch.setattr(feeds, "GAP_READ_AFTER", 0.0 if gap_reads else 3600.0)
    reads = 0
    for seed in range(400):
        rnd = random.Random(seed)
        total, c = 60, FakeConsumer(set(), lagging=random.Random(seed) if seed % 2 else None)
        feed, nc = feed_with(c)
        nc.stored = total
        dseq, fresh, queue, recorded = 0, list(range(1, total + 1)), [], set()

        def delivery(stream: int) -> FakeMsg:
            nonlocal dseq
            dseq += 1
            return FakeMsg(c, stream, dseq)

        for _ in range(rnd.randrange(0, 20)):  # a reader that died with these
            delivery(fresh.pop(0))
        for _ in range(400):
            if not fresh and not queue and not c.pending:
                break
            step = rnd.random()
            if step < 0.35 and fresh:
                got = [delivery(fresh.pop(0)) for _ in range(min(len(fresh), rnd.randrange(1, 12)))]
            elif step < 0.4 and fresh:  # the pin moved for a moment: another reader got these, and died
                for _ in range(min(len(fresh), rnd.randrange(1, 4))):
                    delivery(fresh.pop(0))
                continue
            elif step < 0.55 and c.pending:  # ack_wait ran out for some of the unacknowledged
                got = [delivery(x) for x in sorted(rnd.sample(sorted(c.pending), rnd.randrange(1, len(c.pending) + 1)))]
            elif step < 0.6 and c.ghosts:  # what was redelivered as an ack covered it arrives now
                got = [delivery(x) for x in c.ghosts]
                c.pending -= {x for x in c.ghosts if x <= c.floor[1]}  # acknowledged meanwhile: not pending
                c.ghosts = []
            else:
                n = rnd.randrange(0, len(queue) + 1)
                batch, queue[:n] = queue[:n], []
                recorded |= {m.metadata.sequence.stream for m in batch}
                floor = c.floor[1]
                read = settle(feed, batch)
                queue += read
                reads += len(read)
                assert all(x in recorded for x in range(floor + 1, c.floor[1] + 1)), seed
                continue
            deliver(feed, got)
            queue += got
        assert not c.ignored and c.floor[1] == total and not c.pending, seed
    assert (reads > 0) == gap_reads
