"""A worker's slots and task processes, shared between the lanes of its pool's queue in turn (infra/lanes.py)."""
from __future__ import annotations

import asyncio
import functools

import pytest

from noetl_mesh.infra.lanes import Slots, next_in_turn


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


@run
async def test_one_lane_never_holds_the_slots_it_must_leave_to_the_others():
    """With a reserve, a lane stops at its share however many slots are free: another lane's command
    starts at once; the lane at its share waits until one of its own slots frees."""
    slots = Slots(4, lanes=9, reserve=1)
    assert [slots.try_take(2) for _ in range(4)] == [True, True, True, False]  # lane 2's share: 3 of 4
    served, tasks = await _waiting(slots, [2])
    assert served == [] and slots.free == 1
    assert slots.try_take(5)  # another lane's: the reserved slot, at once (lane 2's wait does not count)
    slots.release(5)  # lane 5's slot frees: lane 2 is at its share, so it stays free
    await asyncio.sleep(0)
    assert served == [] and slots.free == 1
    slots.release(2)  # one of lane 2's own: lane 2 takes it
    await asyncio.sleep(0)
    assert served == [2] and slots.free == 1 and slots.held == {2: 3}
    await asyncio.gather(*tasks)
    for _ in range(3):
        slots.release(2)
    assert slots.free == 4 and not slots.held


@run
async def test_a_lane_at_its_share_does_not_stop_the_others_taking_free_slots():
    slots = Slots(3, lanes=9, reserve=1)
    assert slots.try_take(1) and slots.try_take(1)
    served, tasks = await _waiting(slots, [1])  # at its share, waiting
    assert slots.try_take(4)  # free, and the only lane waiting may not take it
    served4, more = await _waiting(slots, [4])
    slots.release(1)  # lane 1 may again: in turn after the last served
    await asyncio.sleep(0)
    assert served + served4 in ([1], [4])
    slots.release(4 if served == [1] else 1)
    await asyncio.sleep(0)
    assert sorted(served + served4) == [1, 4]
    await asyncio.gather(*tasks, *more)


@run
async def test_waiters_of_no_lane_are_served_and_counted_in_no_share():
    """A task run outside a worker's command (``noetl run``'s sandbox) takes a slot of no lane: it waits
    like the others, goes first, and a lane's share is not spent by it."""
    slots = Slots(2, lanes=9, reserve=1)
    assert slots.try_take(None) and slots.try_take(3)
    served, tasks = await _waiting(slots, [None, 5])
    served_none_again, more = await _waiting(slots, [None])
    slots.release(None)
    await asyncio.sleep(0)
    slots.release(3)
    await asyncio.sleep(0)
    assert served + served_none_again == [None, None] and slots.waiting == {5: slots.waiting[5]}
    slots.release(None)
    await asyncio.sleep(0)
    assert served == [None, 5] and slots.held == {5: 1} and slots.free == 0
    await asyncio.gather(*tasks, *more)


@pytest.mark.parametrize("seed", range(40))
def test_random_takes_cancels_and_releases_keep_every_slot_and_serve_every_waiter(seed):
    """Random interleavings of users taking a slot (as the worker's lanes do, and as the sandbox does),
    being cancelled at any point, and releasing: no slot is lost or made, no lane holds more than its
    share, no free slot is left while a waiter may take it, and every waiter not cancelled is served."""
    import random

    async def trial(rnd: random.Random) -> None:
        size, lanes = rnd.randint(1, 5), rnd.randint(1, 9)
        slots = Slots(size, lanes, rnd.choice([0, 1, 2]))
        choices = [*range(lanes), None]
        outside = [0]  # slots held with no lane

        def check() -> None:
            # (a slot of no lane granted to a waiter not resumed yet is counted nowhere: at most, until the end)
            assert 0 <= slots.free and slots.free + sum(slots.held.values()) + outside[0] <= size
            assert all(n <= slots.share for n in slots.held.values())
            if slots.free > 0:
                assert not any(any(not f.done() for f in q) for lane, q in slots.waiting.items()
                               if lane is None or slots.held.get(lane, 0) < slots.share)

        async def user(lane: int | None, worker_style: bool) -> None:
            if not (worker_style and slots.try_take(lane)):
                taking = asyncio.ensure_future(slots.take(lane))
                try:
                    await asyncio.shield(taking) if worker_style else await taking
                except asyncio.CancelledError:
                    if taking.done() and not taking.cancelled():
                        slots.release(lane)  # granted, and not used
                    else:
                        taking.cancel()
                        await asyncio.gather(taking, return_exceptions=True)
                    raise
            outside[0] += lane is None
            try:
                for _ in range(rnd.randint(0, 6)):
                    await asyncio.sleep(0)
            finally:
                outside[0] -= lane is None
                slots.release(lane)

        users = []
        for _ in range(rnd.randint(20, 100)):
            roll = rnd.random()
            if roll < 0.45:
                users.append(asyncio.ensure_future(user(rnd.choice(choices), rnd.random() < 0.5)))
            elif roll < 0.6 and users:
                rnd.choice(users).cancel()
            for _ in range(rnd.randint(0, 3)):
                await asyncio.sleep(0)
            check()
        await asyncio.wait_for(asyncio.gather(*users, return_exceptions=True), 5)
        assert slots.free == size and not slots.held and not slots.waiting

    asyncio.run(trial(random.Random(seed)))
