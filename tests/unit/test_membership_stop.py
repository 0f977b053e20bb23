"""A replica's membership heartbeat ends when it is stopped, whenever the stop comes: on Python 3.11
``asyncio.wait_for`` swallows a cancel that lands as the awaited reply comes (in the heartbeat's own
wait, and inside nats-py's requests), and a service's stop then waited for the heartbeat forever (seen
twice: a test stack's teardown hung 120 s in ``Membership.stop``)."""
from __future__ import annotations

import asyncio

from noetl_mesh.infra.membership import Membership


def beating(beat) -> Membership:
    """A membership whose heartbeat is ``beat``, running every 10 ms."""
    m = Membership(None, "svc", 4, lambda _: None, ttl=0.03)
    m.beat = beat
    m.task = asyncio.create_task(m._run())
    return m


def test_the_heartbeat_ends_when_the_cancel_lands_as_a_beat_ends():
    async def main():
        beats = 0

        async def beat():
            nonlocal beats
            beats += 1
            asyncio.get_running_loop().call_soon(m.task.cancel)  # lands in the same turn the beat ends

        m = beating(beat)
        done, _ = await asyncio.wait([m.task], timeout=2)
        assert done and m.task.cancelled(), f"still beating after {beats} cancels"
        assert beats == 1

    asyncio.run(main())


def test_stop_ends_the_heartbeat_even_when_the_beat_swallows_the_cancel():
    """As nats-py's own ``wait_for`` does when the reply and the cancel come together: the beat returns
    normally, the cancel lost."""
    async def main():
        beats = 0

        async def beat():
            nonlocal beats
            beats += 1
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                asyncio.current_task().uncancel()  # swallowed

        m = beating(beat)
        while beats == 0:
            await asyncio.sleep(0.005)
        stopping = asyncio.create_task(m.stop())
        done, _ = await asyncio.wait([stopping], timeout=5)
        assert done and m.task.done(), f"still beating after {beats} beats"
        stopping.cancel()

    asyncio.run(main())
