"""A flush that timed out leaves its cancelled future queued in nats-py: the PONG that answers it later
must not break the connection's read loop (infra/bus.py patches the client's PONG handling)."""
from __future__ import annotations

import asyncio

from nats.aio.client import Client

from noetl_mesh.infra import bus  # noqa: F401 - installs the handling


def test_a_pong_for_a_flush_that_gave_up_is_taken_and_the_next_one_answered():
    async def main():
        loop = asyncio.get_running_loop()
        client = Client()
        gave_up, waiting = loop.create_future(), loop.create_future()
        gave_up.cancel()
        client._pongs, client._pongs_received, client._pings_outstanding = [gave_up, waiting], 0, 2
        await client._process_pong()  # before: InvalidStateError, the read loop's error with a traceback
        assert not waiting.done()  # that PONG was the first PING's
        await client._process_pong()
        return waiting.result(), client._pongs_received, client._pongs

    assert asyncio.run(main()) == (True, 2, [])
