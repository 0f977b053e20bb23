"""Following an execution to its end (client.Following.wait), when a signal stops the follower."""
import asyncio

from noetl_mesh.client import Following


class Polled(Following):
    """An execution that runs on; at the second poll its reply and a cancellation of the follower arrive
    together, as a signal's can while a reply is on its way."""

    def __init__(self) -> None:
        self.polls = 0
        self.follower: asyncio.Task | None = None
        self.signalled = False

    async def status(self, execution_id: str, brief: bool = False) -> dict:
        self.polls += 1
        loop = asyncio.get_running_loop()
        reply = loop.create_future()
        loop.call_soon(reply.set_result, {"status": "RUNNING"})
        if self.polls == 2:
            self.signalled = True
            loop.call_soon(self.follower.cancel)
        return await asyncio.wait_for(reply, 5)  # nats-py's request waits so


def test_a_signal_stops_the_wait_even_when_its_cancellation_is_lost_in_a_reply():
    async def main():
        client = Polled()
        client.follower = asyncio.ensure_future(client.wait("x1", timeout=3, poll=0.01,
                                                            stop=lambda: client.signalled))
        await asyncio.wait({client.follower}, timeout=10)
        return client

    client = asyncio.run(main())
    # cancelled at the poll after the signal (on Python 3.11 wait_for returned the reply instead of raising;
    # without ``stop`` the wait would poll on to its timeout: TimeoutError)
    assert client.follower.cancelled() and client.polls <= 3
