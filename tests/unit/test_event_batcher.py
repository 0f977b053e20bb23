"""The worker's EventBatcher sends a run's batches in order: a batch leaves only once the earlier ones
are stored, so that a step's end is never in the log while what the run reported before it (a
``ctx.patched``) was lost in a NATS restart."""
from __future__ import annotations

import asyncio

from noetl_mesh.services.worker.service import EventBatcher


class FakeBus:
    def __init__(self):
        self.sent: list[list[str]] = []
        self.acks: list[asyncio.Future] = []

    async def send_events(self, events, limit=None, flat=False):
        self.sent.append([e["name"] for e in events])
        ack = asyncio.get_running_loop().create_future()
        self.acks.append(ack)
        return ack


def test_a_batch_waits_for_the_earlier_ones_to_be_stored():
    bus = FakeBus()

    async def main():
        batcher = EventBatcher(bus, linger=0.01)
        await batcher.add({"name": "ctx.patched"})
        await asyncio.sleep(0.05)  # the first batch leaves after its linger
        await batcher.add({"name": "step.done"})
        closing = asyncio.create_task(batcher.close())
        await asyncio.sleep(0.05)
        assert bus.sent == [["ctx.patched"]]  # step.done waits for the first batch's PubAck
        bus.acks[0].set_result(None)
        await asyncio.sleep(0.05)
        assert bus.sent == [["ctx.patched"], ["step.done"]]
        bus.acks[1].set_result(None)
        await asyncio.wait_for(closing, 1)

    asyncio.run(main())


def test_a_lost_batch_fails_the_run_before_a_later_one_leaves():
    bus = FakeBus()

    async def main():
        batcher = EventBatcher(bus, linger=0.01)
        await batcher.add({"name": "ctx.patched"})
        await asyncio.sleep(0.05)
        await batcher.add({"name": "step.done"})
        closing = asyncio.create_task(batcher.close())
        await asyncio.sleep(0.02)
        bus.acks[0].set_exception(ConnectionError("no response from stream"))
        try:
            await asyncio.wait_for(closing, 1)
        except ConnectionError:
            pass
        else:
            raise AssertionError("close should have failed (the command is then retried)")
        assert bus.sent == [["ctx.patched"]]

    asyncio.run(main())
