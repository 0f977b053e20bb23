"""Folds of an execution's recorded events for a reply (its status, the console's view, a timeline, a
restart's seed), bounded whatever the execution's size and however many ask at once.

A fold runs on the recorder's one event loop, beside the recording of every execution's events, on one
of its few database connections. An execution near its limits (``max_step_runs`` of an arc cycle) has
some 200,000 events to fold, about 2 s of CPU and 300 MB read at once: eight viewers asking together
took every connection and the loop, so recording and every other user's reads stopped. So:

- a *large* fold (more than ``SMALL`` events) waits for the recorder's one slot before it takes a
  connection (``unavailable``, with a time to retry, after ``WAIT`` seconds): large folds run one at a
  time per recorder, and never hold the connections recording needs;
- a status or a view reads its rows ``CHUNK`` at a time through a server-side cursor (:func:`stream`)
  and folds each chunk before the next, so memory is the state's, not the log's, and recording runs
  between chunks (a timeline and a restart's seed read theirs at once, in the slot);
- one user's large folds go one at a time (the gateway names the reader): a user's second waits for
  the first before it queues for the slot, so a user asking many at once does not queue ahead of
  everyone else (a console page asks two or three at once); past :data:`PER_READER` waiting, ``too_many``
  (429);
- its answer is kept by the execution and its event count (:class:`Large`): asking again about an
  execution that has not moved costs one count. Only a status and the view of the whole log are kept
  (a view at an earlier event is folded each time): so nobody's answers push another's out.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from typing import Any, Awaitable, Callable, Iterable

from noetl_mesh.core.state import ExecutionState, apply
from noetl_mesh.infra.bus import BusError

from . import schema

log = logging.getLogger("noetl.event-recorder")

SMALL = 2_000  # events a reply may fold without the slot (about 20 ms of CPU)
CHUNK = 2_000  # rows read and folded at a time by a large fold
WAIT = 5.0  # seconds a large fold waits for the slot
RETRY_AFTER = 2  # seconds, in the answer of one that waited in vain
KEEP = 8  # large folds' answers kept
KNOWN = 1024  # executions remembered as large
PER_READER = 4  # large folds one user may have waiting or running


def fold_into(state: ExecutionState, events: Iterable[dict[str, Any]]) -> ExecutionState:
    """The engine's fold (D22) of recorded events onto ``state``; what no writer of the engine sends
    (rejected, odd data) folds to nothing."""
    for event in events:
        if isinstance(event["data"], dict) and not schema.is_rejected(event):
            try:
                apply(state, event)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                log.warning("execution %s: event %s (%s) does not fold: %s", state.execution_id,
                            event["event_id"], event["name"], exc)
    return state


async def stream(conn: Any, sql: str, params: tuple, xid: str,
                 readable: Callable[[list[dict[str, Any]]], Awaitable[list[dict[str, Any]]]],
                 seen: Callable[[dict[str, Any]], None] | None = None) -> tuple[ExecutionState, int]:
    """Fold the events ``sql`` selects (``schema.SELECT_EVENT`` rows, in log order) ``CHUNK`` at a time
    through a server-side cursor (``conn`` in a transaction); ``readable`` reads back what an event
    carries by reference; ``seen`` is shown each event. Returns the state and the number of rows."""
    state, n = ExecutionState(xid), 0
    async with conn.cursor(name="fold") as cur:
        await cur.execute(sql, params)
        while rows := await cur.fetchmany(CHUNK):
            n += len(rows)
            events = await readable([schema.row_event(r) for r in rows])
            fold_into(state, events)
            if seen is not None:
                for event in events:
                    seen(event)
            await asyncio.sleep(0)  # recording, and the other replies, between two chunks
    return state, n


class Large:
    """The recorder's slot for large folds, and their kept answers."""

    def __init__(self, keep: int = KEEP):
        self.slot = asyncio.Semaphore(1)
        self.keep = keep
        self.kept: OrderedDict[tuple, Any] = OrderedDict()
        self.folded: OrderedDict[str, None] = OrderedDict()  # executions folded large lately
        self.readers: dict[str, int] = {}  # user -> their large folds waiting or running
        self.turns: dict[str, asyncio.Lock] = {}  # user -> whose turn it is among their large folds

    def known(self, xid: str) -> bool:
        """Whether ``xid`` was folded large lately: a status then asks for its count before any event."""
        return xid in self.folded

    @contextlib.asynccontextmanager
    async def fold(self, xid: str, events: int, what: str, reader: Any = None):
        """Hold the slot for a fold of ``events`` events (a no-op for a small one), for the user
        ``reader`` (a user id; None: a service's own read, not bounded per user)."""
        if events <= SMALL:
            yield
            return
        reader = reader if isinstance(reader, str) else None
        if reader is not None and self.readers.get(reader, 0) >= PER_READER:
            raise BusError("too_many", f"{what} of execution {xid} folds its {events} events, and {PER_READER} "
                                       f"other large reads of yours wait or are being folded (one at a time per "
                                       f"user); try again", details={"retry_after": RETRY_AFTER})
        turn = None
        if reader is not None:
            self.readers[reader] = self.readers.get(reader, 0) + 1
            turn = self.turns.setdefault(reader, asyncio.Lock())
        deadline = asyncio.get_running_loop().time() + WAIT
        try:
            try:
                if turn is not None:
                    await asyncio.wait_for(turn.acquire(), WAIT)
                try:
                    await asyncio.wait_for(self.slot.acquire(), max(0.0, deadline - asyncio.get_running_loop().time()))
                except BaseException:
                    if turn is not None:
                        turn.release()
                    raise
            except asyncio.TimeoutError:
                raise BusError("unavailable", f"{what} of execution {xid} folds its {events} events, and the "
                                              f"event-recorder folds another large execution's now (one at a "
                                              f"time); try again", details={"retry_after": RETRY_AFTER}) from None
            try:
                yield
            finally:
                self.slot.release()
                if turn is not None:
                    turn.release()
        finally:
            if reader is not None:
                self.readers[reader] -= 1
                if not self.readers[reader]:  # nobody holds or waits for this user's turn
                    del self.readers[reader]
                    self.turns.pop(reader, None)

    async def answer(self, key: tuple | None, xid: str, events: int, what: str, reader: Any,
                     make: Callable[[], Awaitable[tuple[Any, tuple | None]]]) -> tuple[Any, bool]:
        """The answer kept under ``key`` (None: one not kept), else ``make()``'s, made in the slot
        (:meth:`fold`) unless it was made while this one waited; ``make`` returns the answer and the key to
        keep it under (the event count its snapshot read). ``(answer, whether it was kept)``."""
        kept = self.get(key) if key is not None else None
        if kept is not None:
            return kept, True
        async with self.fold(xid, events, what, reader):
            kept = self.get(key) if key is not None else None
            if kept is not None:
                return kept, True
            made, keep = await make()
            if keep is not None:
                self.put(keep, made)
            return made, False

    def get(self, key: tuple) -> Any:
        value = self.kept.get(key)
        if value is not None:
            self.kept.move_to_end(key)
        return value

    def put(self, key: tuple, value: Any) -> None:
        """Keep the answer of a large fold; ``key`` starts with what was asked and the execution's id."""
        self.kept[key] = value
        self.kept.move_to_end(key)
        while len(self.kept) > self.keep:
            self.kept.popitem(last=False)
        self.folded[key[1]] = None
        self.folded.move_to_end(key[1])
        while len(self.folded) > KNOWN:
            self.folded.popitem(last=False)
