"""Large values (D23) read back from the object store message by message, on a real NATS server: whole,
gone (PayloadMissing), and stored again while being read (read again from its new chunks, not taken
for gone)."""
from __future__ import annotations

import asyncio

import pytest

from noetl_mesh.infra.bus import Bus
from noetl_mesh.infra.payloads import PayloadMissing
from noetl_mesh.infra.wire import dumps

pytestmark = pytest.mark.integration


def test_a_value_is_read_whole_or_missing_even_when_stored_again_meanwhile(fresh_nats):
    async def main() -> None:
        bus = await Bus.connect(fresh_nats.url, "payload-test")
        try:
            await bus.setup(1)
            store = bus.payloads
            value = {"x": "a" * 1_000_000}  # 8 chunks
            ref = await store.put(value)
            store._cache.clear()
            assert await store.get(ref) == value
            bucket, read, calls = await store.bucket(), store.js.get_msg, []

            async def stored_again_after_one_chunk(*args, **kwargs):
                calls.append(kwargs.get("seq"))
                if len(calls) == 2:  # the same value stored again: new chunks, the old ones purged
                    await bucket.put(ref["key"], dumps(value))
                return await read(*args, **kwargs)

            store.js.get_msg = stored_again_after_one_chunk
            store._cache.clear()
            assert await store.get(ref) == value and len(calls) > 9  # read again from the new chunks
            store.js.get_msg = read
            await bucket.delete(ref["key"])
            store._cache.clear()
            with pytest.raises(PayloadMissing, match="no longer in"):
                await store.get(ref)
        finally:
            await bus.close()

    asyncio.run(main())
