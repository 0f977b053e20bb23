"""A command that waits for a signal (``noetl up``) stops on it even when the cancellation the signal
caused was lost on its way (cli.common.Signals.wait)."""
import asyncio
import os
import signal

import pytest

from noetl_mesh.cli.common import Interrupted, Signals, arun


@pytest.mark.parametrize("when", ["while starting", "while waiting"])
def test_a_signal_ends_the_wait_even_when_its_cancellation_was_lost(when: str) -> None:
    ended: list[str] = []

    async def up(signals: Signals) -> None:
        loop = asyncio.get_running_loop()
        if when == "while starting":
            reply = loop.create_future()
            loop.call_soon(reply.set_result, "started")
            os.kill(os.getpid(), signal.SIGINT)  # its handler runs at once: the cancel comes with the reply
            assert await asyncio.wait_for(reply, 5) == "started"  # the reply won: the cancellation is lost
        else:
            loop.call_later(0.05, os.kill, os.getpid(), signal.SIGTERM)
        try:
            await asyncio.wait_for(signals.wait(), 60)  # a guard against a hang only
        finally:
            ended.append("stopped what it started")

    with Signals() as signals, pytest.raises(Interrupted):
        arun(up(signals), signals)
    assert signals.received in (signal.SIGINT, signal.SIGTERM) and ended == ["stopped what it started"]
