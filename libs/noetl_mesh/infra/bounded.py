"""A pure function of hostile input, run where its CPU and memory are bounded: a child process.

Some checks cost what their input makes them cost and cannot be interrupted from inside Python (a
regular expression that backtracks, nested JSON Schema combinators). :class:`Bounded` runs such a
function in a warm child process (one at a time: a second call waits for the first, at most
``max_waiting`` of them), kills the child when the call overruns its time, and starts a fresh one for
the next call. The child's address space is
capped, so a call that would eat memory fails there (``MemoryError``) instead of in the service.
"""
from __future__ import annotations

import asyncio
import importlib
import multiprocessing
import resource
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class Overrun(Exception):
    """The call took longer than its time, or its child died (killed for memory, say)."""


class Busy(Exception):
    """``max_waiting`` calls wait already: this one is refused at once, not queued."""


def _cap_memory(max_bytes: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (max_bytes, max_bytes))


def _load(modules: tuple[str, ...]) -> None:
    for name in modules:
        importlib.import_module(name)


class Bounded:
    def __init__(self, seconds: float, max_bytes: int = 1 << 30, preload: tuple[str, ...] = (),
                 max_waiting: int = 16) -> None:
        """``preload``: modules a new child imports before its first call (its start is not counted)."""
        self.seconds = seconds
        self.max_bytes = max_bytes
        self.preload = preload
        self.max_waiting = max_waiting
        self.waiting = 0
        self._pool: ProcessPoolExecutor | None = None
        self._lock: asyncio.Lock | None = None

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # spawn, not fork: the service has threads (NATS, the event loop's executor) a fork would copy
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_cap_memory, initargs=(self.max_bytes,))
        return self._pool

    async def __call__(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the child; :class:`Overrun` past ``seconds`` of its own run (the time it
        waited for earlier calls is not its cost: a costly call of someone else's must not fail it);
        :class:`Busy` when ``max_waiting`` calls wait already (a flood is refused, not queued without end)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        if self.waiting >= self.max_waiting:
            raise Busy(f"{self.waiting} checks wait already")
        loop = asyncio.get_running_loop()
        self.waiting += 1
        try:
            await self._lock.acquire()
        finally:
            self.waiting -= 1
        try:
            if self._pool is None:  # a new child's start and imports are not the call's cost
                await loop.run_in_executor(self._executor(), _load, (*self.preload, fn.__module__))
            async with asyncio.timeout(self.seconds):
                return await loop.run_in_executor(self._executor(), fn, *args)
        except TimeoutError:
            self.close(kill=True)
            raise Overrun(f"took more than {self.seconds:g} s") from None
        except asyncio.CancelledError:  # its caller went away: the next call must not wait for what it started
            self.close(kill=True)
            raise
        except (BrokenProcessPool, MemoryError) as exc:
            self.close(kill=True)
            raise Overrun(f"its process failed ({type(exc).__name__}: over {self.max_bytes >> 20} MiB?)") from None
        finally:
            self._lock.release()

    def close(self, kill: bool = False) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        if kill:
            # the executor cannot stop a running call: end its process (the executor keeps them by pid)
            for proc in list(getattr(pool, "_processes", {}).values()):
                proc.kill()
        pool.shutdown(wait=False, cancel_futures=True)
