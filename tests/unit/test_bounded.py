"""A hostile check runs in a child process that is killed past its time or its memory (infra/bounded.py),
and the next check gets a fresh child."""
from __future__ import annotations

import asyncio
import time

import pytest

from noetl_mesh.core.signals import schema_refusal
from noetl_mesh.infra.bounded import Bounded, Overrun

BACKTRACKS = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^(a+)+$"}}}


def test_a_check_that_backtracks_is_stopped_and_the_next_one_runs():
    async def main():
        check = Bounded(seconds=1.0, max_bytes=512 << 20, preload=("jsonschema",))
        try:
            assert await check(schema_refusal, "s", BACKTRACKS, {"code": "aaaa"}) is None
            refused = await check(schema_refusal, "s", BACKTRACKS, {"code": "b"})
            assert refused.status == 422 and refused.location == "body['code']"
            started = time.monotonic()
            with pytest.raises(Overrun, match="more than 1 s"):
                await check(schema_refusal, "s", BACKTRACKS, {"code": "a" * 64 + "!"})  # 2**64 steps in `re`
            assert time.monotonic() - started < 10
            assert await check(schema_refusal, "s", BACKTRACKS, {"code": "aa"}) is None  # a fresh child
        finally:
            check.close(kill=True)
    asyncio.run(main())


def test_a_check_waiting_behind_a_costly_one_runs_once_that_one_is_stopped():
    async def main():
        check = Bounded(seconds=1.0, max_bytes=512 << 20, preload=("jsonschema",))
        try:
            await check(schema_refusal, "s", BACKTRACKS, {"code": "a"})  # the child is warm
            costly = asyncio.ensure_future(check(schema_refusal, "s", BACKTRACKS, {"code": "a" * 64 + "!"}))
            await asyncio.sleep(0.5)
            assert await check(schema_refusal, "s", BACKTRACKS, {"code": "b"}) is not None
            with pytest.raises(Overrun):
                await costly
        finally:
            check.close(kill=True)
    asyncio.run(main())


def test_a_check_that_eats_memory_fails_in_its_child():
    async def main():
        check = Bounded(seconds=20.0, max_bytes=256 << 20)
        try:
            with pytest.raises(Overrun, match="MemoryError"):
                await check(bytearray, 1 << 30)
            assert await check(len, b"abc") == 3
        finally:
            check.close(kill=True)
    asyncio.run(main())


def test_a_check_is_not_failed_by_the_time_it_waited_and_a_flood_is_refused_at_once():
    """Two costly checks ahead (each stopped after its second) do not fail a cheap one that waited for
    them; with ``max_waiting`` checks waiting, one more is refused at once (Busy), not queued."""
    from noetl_mesh.infra.bounded import Busy

    async def main():
        check = Bounded(seconds=1.0, max_bytes=512 << 20, preload=("jsonschema",), max_waiting=2)
        try:
            await check(schema_refusal, "s", BACKTRACKS, {"code": "a"})  # the child is warm
            costly = [asyncio.ensure_future(check(schema_refusal, "s", BACKTRACKS, {"code": "a" * 64 + "!"}))
                      for _ in range(2)]
            await asyncio.sleep(0.1)
            cheap = asyncio.ensure_future(check(schema_refusal, "s", BACKTRACKS, {"code": "b"}))
            await asyncio.sleep(0.1)
            with pytest.raises(Busy):  # one costly running, one costly and the cheap one waiting
                await check(schema_refusal, "s", BACKTRACKS, {"code": "c"})
            assert (await cheap).status == 422  # checked, after more than its second of waiting
            for call in costly:
                with pytest.raises(Overrun):
                    await call
        finally:
            check.close(kill=True)
    asyncio.run(main())
