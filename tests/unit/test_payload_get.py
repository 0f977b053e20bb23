"""Reading a payload (D23) has a deadline: a JetStream that stalls (a cluster that lost its leader)
would hold the reading handler, and its whole partition, for ever. It fails instead, and the message
is retried."""
from __future__ import annotations

import asyncio
import time
from unittest.mock import patch

from noetl_mesh.infra import payloads


class StalledJetStream:
    async def get_last_msg(self, stream, subject):
        await asyncio.Event().wait()  # never answers

    get_msg = get_last_msg


def test_a_stalled_read_fails_within_its_deadline():
    store = payloads.PayloadStore(js=StalledJetStream())

    async def main():
        started = time.monotonic()
        try:
            await store.get({"store": payloads.STORE, "key": "k" * 64, "size": 1 << 20})
        except asyncio.TimeoutError:
            return time.monotonic() - started
        raise AssertionError("the read should have timed out")

    with patch.object(payloads, "GET_TIMEOUT_S", 0.2):
        took = asyncio.run(asyncio.wait_for(main(), 60))  # it ends: the deadline stopped it
    assert took > 1.1  # 0.2 s plus a second for its MiB: the deadline grows with the size


class Stream:
    """Messages by sequence, as STREAM.MSG.GET answers: by sequence, or the next of a subject."""

    def __init__(self, subjects: list[str]):
        from types import SimpleNamespace

        self.msgs = {seq: SimpleNamespace(seq=seq, subject=s, data=f"{s}@{seq}".encode())
                     for seq, s in enumerate(subjects, start=1)}
        self.in_flight = self.most = 0

    async def get_msg(self, stream, seq=None, subject=None, next=False):
        from nats.js.errors import NotFoundError

        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        await asyncio.sleep(0)  # an answer takes a round trip: others are asked meanwhile
        self.in_flight -= 1
        for s in sorted(self.msgs):
            if s >= seq and (not next or self.msgs[s].subject == subject):
                if next or s == seq:
                    return self.msgs[s]
        raise NotFoundError


def test_an_objects_chunks_are_read_ahead_and_another_objects_between_them_skipped():
    layout = ["A", "B", "A", "A", "B", "B", "A", *["A"] * 20, "C", "A"]
    stream = Stream(layout)
    store = payloads.PayloadStore(js=stream)
    want = [seq for seq, s in enumerate(layout, start=1) if s == "A"]
    parts = asyncio.run(store._chunks("A", len(want), 10 ** 6))
    assert parts == [f"A@{seq}".encode() for seq in want]
    assert stream.most > 1  # asked side by side, not one round trip after another
