"""A worker's run slots, shared fairly between the lanes of its pool's queue.

A pool's commands wait in lanes (``contracts.subjects.lane_of``: one per user who started the
execution, by a hash of the user's id), each read through a durable consumer of its own. When a slot
frees and several lanes of a worker hold commands fetched and not started, the lane next in turn after
the one served last gets it (each lane asks for one slot at a time). So a user with a thousand
commands queued waits in one lane, and another user's command starts at the next turn of its own lane,
not after the thousand.
"""
from __future__ import annotations

import asyncio


def next_in_turn(waiting: set[int] | dict[int, object], last: int, lanes: int) -> int:
    """The lane served next of those ``waiting``: the first after ``last``, going round ``lanes``."""
    return min(waiting, key=lambda lane: (lane - last - 1) % lanes)


class Slots:
    """``size`` run slots. :meth:`try_take` takes a free one when no lane waits; :meth:`take` waits for
    one, in its lane's turn; :meth:`release` hands a freed slot to the lane next in turn, or frees it."""

    def __init__(self, size: int, lanes: int):
        self.free = size
        self.lanes = lanes
        self.last = -1
        self.waiting: dict[int, asyncio.Future] = {}
        self._released = asyncio.Event()

    def try_take(self) -> bool:
        if self.free > 0 and not self.waiting:
            self.free -= 1
            return True
        return False

    async def take(self, lane: int) -> None:
        """A slot for ``lane``'s one waiting command (a lane waits for one slot at a time)."""
        if self.try_take():
            return
        assert lane not in self.waiting, f"lane {lane} already waits for a slot"
        granted = asyncio.get_running_loop().create_future()
        self.waiting[lane] = granted
        try:
            await granted
        except asyncio.CancelledError:
            if self.waiting.get(lane) is granted:
                del self.waiting[lane]
            elif granted.done() and not granted.cancelled():
                self.release()  # handed the slot as it was cancelled: hand it on
            raise

    def release(self) -> None:
        while self.waiting:
            lane = next_in_turn(self.waiting, self.last, self.lanes)
            granted = self.waiting.pop(lane)
            if not granted.done():  # (one cancelled as its lane stops is passed over)
                self.last = lane
                granted.set_result(None)
                break
        else:
            self.free += 1
        self._released.set()
        self._released = asyncio.Event()

    async def released(self) -> None:
        """Until the next :meth:`release`."""
        await self._released.wait()
