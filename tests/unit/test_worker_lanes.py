"""A worker's slots, shared between the lanes of its pool's queue in turn (services/worker/lanes.py)."""
from __future__ import annotations

import asyncio
import functools

import pytest

from noetl_mesh.services.worker.lanes import Slots, next_in_turn


def test_the_lane_after_the_last_served_goes_next_round_the_lanes():
    assert next_in_turn({0, 5}, last=-1, lanes=9) == 0
    assert next_in_turn({0, 5}, last=0, lanes=9) == 5
    assert next_in_turn({0, 5}, last=5, lanes=9) == 0
    assert next_in_turn({3}, last=3, lanes=9) == 3  # alone, it is served again
    assert next_in_turn({8, 1}, last=7, lanes=9) == 8


def run(test):
    """The coroutine test run to its end in a loop of its own."""
    @functools.wraps(test)
    def sync() -> None:
        asyncio.run(test())
    return sync


async def _waiting(slots: Slots, lanes: list[int]) -> tuple[list[int], list[asyncio.Task]]:
    served: list[int] = []

    async def wait(lane: int) -> None:
        await slots.take(lane)
        served.append(lane)

    tasks = [asyncio.create_task(wait(lane)) for lane in lanes]
    await asyncio.sleep(0)
    return served, tasks


@run
async def test_a_freed_slot_goes_to_the_lanes_in_turn_not_first_come():
    slots = Slots(2, lanes=9)
    assert slots.try_take() and slots.try_take() and not slots.try_take()
    served, tasks = await _waiting(slots, [2, 7, 4])
    assert served == [] and set(slots.waiting) == {2, 4, 7}
    assert not slots.try_take()  # lanes wait: a newcomer does not go before them
    for _ in range(3):
        slots.release()
        await asyncio.sleep(0)
    assert served == [2, 4, 7]  # by lane, from the first after the last served
    await asyncio.gather(*tasks)
    slots.release()
    assert slots.free == 1 and slots.try_take()


@run
async def test_a_lane_that_waits_again_takes_its_turn_after_the_others():
    slots = Slots(1, lanes=9)
    assert slots.try_take()
    served, tasks = await _waiting(slots, [1, 6])
    slots.release()
    await asyncio.sleep(0)
    assert served == [1]
    more, again = await _waiting(slots, [1])  # lane 1's next command: behind lane 6
    slots.release()
    await asyncio.sleep(0)
    slots.release()
    await asyncio.sleep(0)
    assert served == [1, 6] and more == [1]
    await asyncio.gather(*tasks, *again)


@run
async def test_a_waiter_stopped_leaves_its_place_and_a_slot_handed_as_it_stops_goes_on():
    slots = Slots(1, lanes=9)
    assert slots.try_take()
    served, tasks = await _waiting(slots, [3, 5])
    tasks[0].cancel()  # lane 3 stops waiting
    await asyncio.gather(tasks[0], return_exceptions=True)
    assert set(slots.waiting) == {5}
    slots.release()
    await asyncio.sleep(0)
    assert served == [5]
    # handed a slot in the same turn as it is cancelled: the slot is not lost
    served, more = await _waiting(slots, [2])
    slots.release()  # granted to lane 2 ...
    more[0].cancel()  # ... which is stopped before it runs
    await asyncio.gather(*more, return_exceptions=True)
    assert served == [] and slots.free == 1 and not slots.waiting


@run
async def test_released_wakes_whoever_waits_for_the_next_slot():
    slots = Slots(1, lanes=9)
    assert slots.try_take()
    woke = asyncio.create_task(slots.released())
    await asyncio.sleep(0)
    assert not woke.done()
    slots.release()
    await asyncio.wait_for(woke, 1)
    with pytest.raises(asyncio.TimeoutError):  # a new wait waits for the next release
        await asyncio.wait_for(slots.released(), 0.01)


@run
async def test_a_slot_freed_as_a_waiting_lane_stops_is_not_lost():
    """A worker that stops cancels its lanes while a running command ends: the cancelled waiter is
    passed over, the slot goes to the next lane waiting, or back to the free ones."""
    slots = Slots(1, lanes=9)
    assert slots.try_take()
    served, tasks = await _waiting(slots, [3, 5])
    tasks[0].cancel()  # lane 3's wait is cancelled ...
    slots.release()  # ... and, before it runs again, a slot frees
    await asyncio.gather(*tasks, return_exceptions=True)
    assert served == [5] and not slots.waiting and slots.free == 0
    served, tasks = await _waiting(slots, [4])
    tasks[0].cancel()
    slots.release()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert served == [] and not slots.waiting and slots.free == 1
