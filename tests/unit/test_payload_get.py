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
