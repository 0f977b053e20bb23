"""The control plane's cumulative acks (infra/pinned.py: ack_choice, Acks) against a fake consumer: which
delivery a partition's reader acks, and what it must not ack, when dead readers held messages, when
messages come back with new delivery sequences, when one is handed back, and when the consumer reports a
floor that lags behind."""
from __future__ import annotations

import random
from types import SimpleNamespace

from noetl_mesh.infra.pinned import Acks, ack_choice


class FakeConsumer:
    """The server's side of an AckPolicy.ALL consumer: the unacknowledged messages (stream sequence ->
    its latest delivery sequence) and the ack floor. An ack (or a term) of (stream S, delivery D)
    acknowledges every pending message up to S and moves the floor to (D, S); it is ignored when D or
    S is at or below the floor (measured on nats-server 2.15)."""

    def __init__(self, lagging: random.Random | None = None):
        self.pending: dict[int, int] = {}
        self.floor, self.floors = (0, 0), [(0, 0)]
        self.dseq, self.acked, self.ignored = 0, [], []
        self.lagging = lagging

    def deliver(self, stream: int) -> "FakeMsg":
        self.dseq += 1
        self.pending[stream] = self.dseq
        return FakeMsg(self, stream, self.dseq)

    def ack(self, stream: int, delivery: int) -> None:
        if delivery <= self.floor[0] or stream <= self.floor[1]:
            self.ignored.append(stream)
            return
        self.acked.append(stream)
        self.pending = {s: d for s, d in self.pending.items() if s > stream}
        self.floor = (delivery, stream)
        self.floors.append(self.floor)

    def info_floor(self) -> tuple[int, int]:
        """A replicated consumer may report the floor before the last ack."""
        if self.lagging and len(self.floors) > 1 and self.lagging.random() < 0.3:
            return self.floors[-2]
        return self.floor


class FakeMsg:
    def __init__(self, consumer: FakeConsumer, stream: int, delivery: int):
        self.metadata = SimpleNamespace(sequence=SimpleNamespace(stream=stream, consumer=delivery))
        self.consumer = consumer

    def ack(self) -> None:
        self.consumer.ack(self.metadata.sequence.stream, self.metadata.sequence.consumer)


def seqs(msgs) -> list[tuple[int, int]]:
    return [(m.metadata.sequence.stream, m.metadata.sequence.consumer) for m in msgs]


def test_a_reader_alone_acks_the_last_message_it_handled():
    assert ack_choice({1: 1, 2: 2, 3: 3}, [], (0, 0)) == 3
    assert ack_choice({4: 4, 5: 5}, [(6, 6), (7, 7)], (3, 3)) == 5  # 6, 7 delivered, not handled yet


def test_it_never_acks_past_a_message_it_holds_or_handed_back():
    assert ack_choice({1: 1, 2: 2, 4: 4}, [(3, 0)], (0, 0)) == 2  # 3 handed back: it comes back anew
    assert ack_choice({2: 2, 3: 3}, [(1, 9)], (0, 0)) is None  # 1 redelivered, not handled yet


def test_redeliveries_come_with_higher_delivery_sequences_so_the_reader_acks_once_all_are_handled():
    """A dead reader held 1-10 (deliveries 1-10); this reader got 11-20 (deliveries 11-20), then 1-10
    again (deliveries 21-30), and handles them in stream order. Acking 10 (delivery 30) halfway would
    move the server's floor past the deliveries of 11-20, whose acks it would then ignore: the reader
    acks 20 once it has handled them all."""
    c = FakeConsumer()
    for s in range(1, 21):
        c.deliver(s)
    again = {s: c.deliver(s) for s in range(1, 11)}
    held = {s: FakeMsg(c, s, s) for s in range(11, 21)} | again
    acks = Acks()
    for s in range(1, 11):
        acks.handled(held.pop(s))
    assert acks.choice(seqs(held.values())) is None
    for s in range(11, 21):
        acks.handled(held.pop(s))
    msg = acks.choice([])
    msg.ack()
    acks.taken(msg)
    assert c.acked == [20] and not c.pending and not acks.done


def test_a_message_handed_back_holds_the_acks_above_it_until_it_is_handled():
    c = FakeConsumer()
    msgs = [c.deliver(s) for s in range(1, 6)]
    acks = Acks()
    acks.handled(msgs[0])
    acks.handled(msgs[1])
    returned = [(3, 0)]  # 3 failed: handed back with a delay; 4, 5 wait for it
    msg = acks.choice(returned + seqs(msgs[3:]))
    assert msg is msgs[1]
    msg.ack()
    acks.taken(msg)
    three = c.deliver(3)  # it comes back
    for m in (three, msgs[3], msgs[4]):
        acks.handled(m)
    msg = acks.choice([])
    assert msg is msgs[4]  # delivery 5, above the floor (2): 3's new delivery (6) is covered by it
    msg.ack()
    assert c.acked == [2, 5] and not c.pending and not c.ignored


def test_a_term_the_server_took_moves_the_floor_and_one_it_ignored_is_covered_later():
    c = FakeConsumer()
    msgs = [c.deliver(s) for s in range(1, 4)]
    acks = Acks()
    acks.handled(msgs[0])
    c.ack(2, 2)  # terminated: the server takes it as an ack of 1 and 2
    acks.taken(msgs[1])
    assert acks.floor == (2, 2) and not acks.done
    acks.taken(msgs[0])  # below the floor: ignored by the server, and nothing to ack
    assert not acks.done


def test_acks_cover_only_handled_messages_and_the_server_takes_every_one():
    """Random interleavings of a partition's deliveries: to this reader, to readers that die holding
    them (the pin moved for a moment), redeliveries of what is unacknowledged (ack_wait) with new
    delivery sequences, handlers handing a message back, terms, and a consumer whose reported floor
    sometimes lags one ack behind. The reader handles, in stream order, only while it holds every
    unacknowledged message (its resync) — a redelivery of a message it handled and has not acked is
    not handled again — and acks at random moments what ack_choice picks. Every ack the server takes
    covers only handled messages, it ignores none, and once everything has come back the floor is
    the end and nothing is unacknowledged."""
    for seed in range(600):
        rnd = random.Random(seed)
        total = 50
        c = FakeConsumer(lagging=random.Random(seed) if seed % 2 else None)
        acks, held, returned, handled = Acks(), {}, set(), set()
        fresh = list(range(1, total + 1))

        def out_of_reach() -> set[int]:
            """What this reader still has to handle or ack whose delivery the server's floor has passed."""
            return {s for s, m in [*held.items(), *acks.done.items()]
                    if s > c.floor[1] and m.metadata.sequence.consumer <= c.floor[0]}

        def ack(final: bool = False) -> None:
            while True:
                msg = acks.choice(seqs(held.values()) + [(s, 0) for s in returned], final=final)
                if msg is None:
                    return
                floor, ignored, stuck = c.floor[1], len(c.ignored), out_of_reach()
                msg.ack()
                acks.taken(msg)
                assert len(c.ignored) == ignored, seed  # every ack it chooses is one the server takes
                assert final or out_of_reach() <= stuck, seed  # and it puts nothing out of reach
                assert all(s in handled for s in range(floor + 1, c.floor[1] + 1)), seed

        for _ in range(rnd.randrange(0, 8)):  # a reader that died holding these
            c.deliver(fresh.pop(0))
        for _ in range(2000):
            if not fresh and not c.pending:
                break
            step = rnd.random()
            if step < 0.3 and fresh:
                for _ in range(min(len(fresh), rnd.randrange(1, 8))):
                    s = fresh.pop(0)
                    held[s] = c.deliver(s)
            elif step < 0.35 and fresh:  # the pin moved for a moment: another reader got these, and died
                for _ in range(min(len(fresh), rnd.randrange(1, 4))):
                    c.deliver(fresh.pop(0))
            elif step < 0.5 and c.pending:  # ack_wait ran out (or a nak's delay) for some of the unacknowledged
                for s in sorted(rnd.sample(sorted(c.pending), rnd.randrange(1, len(c.pending) + 1))):
                    msg = c.deliver(s)
                    if s in acks.done:
                        acks.done[s] = msg  # handled, not acked: its new delivery is the one to ack
                    elif s not in handled or s > acks.floor[1]:
                        held[s] = msg
                    returned.discard(s)
            elif step < 0.6:  # the reader asks the consumer (a resync): the floor, perhaps lagging
                acks.raise_floor(*c.info_floor())
                for s in [s for s in held if s <= acks.floor[1]]:
                    del held[s]
                returned -= {s for s in returned if s <= acks.floor[1]}
            elif step < 0.85:  # it handles what it holds, in stream order, if it holds everything unacknowledged
                if set(c.pending) - held.keys() - acks.done.keys():
                    continue
                returned.clear()
                for s in sorted(held):
                    msg = held.pop(s)
                    r = rnd.random()
                    if r < 0.05:  # handed back: what follows waits for it
                        returned.add(s)
                        break
                    handled.add(s)
                    if r < 0.08:  # cannot be handled: terminated, which the server takes as an ack
                        floor = c.floor[1]
                        msg.ack()
                        acks.taken(msg)
                        assert all(x in handled for x in range(floor + 1, c.floor[1] + 1)), seed
                    else:
                        acks.handled(msg)
                    if rnd.random() < 0.2:
                        ack()
            else:
                ack()
        ack(final=True)
        assert not fresh and c.floor[1] == total and not c.pending, (seed, c.floor, c.pending, held, returned)
