"""A worker's run slots and task processes, shared fairly between the lanes of its pool's queue.

A pool's commands wait in lanes (``contracts.subjects.lane_of``: one per user who started the
execution, by a hash of the user's id), each read through a durable consumer of its own. When a slot
frees and several lanes of a worker hold commands fetched and not started, the lane next in turn after
the one served last gets it (each lane asks for one slot at a time). So a user with a thousand
commands queued waits in one lane, and another user's command starts at the next turn of its own lane,
not after the thousand. The worker's task processes (``max_task_processes``, shared by its python,
duckdb and shell tasks) are handed out the same way, by the lane of the command a task runs for.
With ``lane_reserve`` (limits.py), one lane never holds the last slots or processes: another user's
command, or task, starts at once however long the first user's tasks run.
"""
from __future__ import annotations

import asyncio
import collections
from typing import Iterable


def next_in_turn(waiting: Iterable[int | None], last: int, lanes: int) -> int | None:
    """The lane served next of those ``waiting``: the first after ``last``, going round ``lanes``; the
    waiters of no lane (None: a task run outside a worker's command, as under ``noetl run``) first."""
    return min(waiting, key=lambda lane: -1 if lane is None else (lane - last - 1) % lanes)


class Slots:
    """``size`` slots. :meth:`try_take` takes a free one when no lane waits that could take it;
    :meth:`take` waits for one, in its lane's turn (the waiters of one lane in their order);
    :meth:`release` hands a freed slot to the lane next in turn, or frees it. With ``reserve``, no lane
    holds more than ``size - reserve`` slots at once (at least one): the rest are for the other lanes, so
    one user's slow tasks cannot hold every slot (a lane at its share waits until one of its own slots
    frees). A slot taken with no lane (None) is counted in no lane's share."""

    def __init__(self, size: int, lanes: int, reserve: int = 0):
        self.free = size
        self.lanes = lanes
        self.share = max(1, size - reserve) if reserve > 0 else size + 1  # the most slots one lane holds
        self.held: dict[int, int] = {}  # lane -> slots it holds now
        self.last = -1
        self.waiting: dict[int | None, collections.deque[asyncio.Future]] = {}  # lane -> its waiters, first first
        self._released = asyncio.Event()

    def _may(self, lane: int | None) -> bool:
        return lane is None or self.held.get(lane, 0) < self.share

    def _hold(self, lane: int | None) -> None:
        self.free -= 1
        if lane is not None:
            self.held[lane] = self.held.get(lane, 0) + 1

    def try_take(self, lane: int | None = None) -> bool:
        if self.free > 0 and self._may(lane) and not any(self._may(w) for w in self.waiting):
            self._hold(lane)
            return True
        return False

    async def take(self, lane: int | None) -> None:
        """A slot for one of ``lane``'s commands or tasks (None: of no lane)."""
        if self.try_take(lane):
            return
        granted = asyncio.get_running_loop().create_future()
        queue = self.waiting.setdefault(lane, collections.deque())
        queue.append(granted)
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self.release(lane)  # handed the slot as it was cancelled: hand it on
            elif granted in queue:
                queue.remove(granted)
                if not queue and self.waiting.get(lane) is queue:
                    del self.waiting[lane]
            raise

    def release(self, lane: int | None = None) -> None:
        """``lane``'s slot (the one it took) is free: to the lane next in turn that may take it."""
        if lane is not None and self.held.get(lane):
            self.held[lane] -= 1
            if not self.held[lane]:
                del self.held[lane]
        self.free += 1
        while self.free > 0:
            ready = [w for w in self.waiting if self._may(w)]
            if not ready:
                break
            turn = next_in_turn(ready, self.last, self.lanes)
            queue = self.waiting[turn]
            granted = queue.popleft()
            if not queue:
                del self.waiting[turn]
            if not granted.done():  # (one cancelled as its lane stops is passed over)
                if turn is not None:
                    self.last = turn
                self._hold(turn)
                granted.set_result(None)
        self._released.set()
        self._released = asyncio.Event()

    async def released(self) -> None:
        """Until the next :meth:`release`."""
        await self._released.wait()
