"""The ``python`` tool (D25): user code in a warm pool of child interpreters.

Each child (``python -m noetl_mesh.tools.python_runner``) runs one task at a time and speaks
newline-delimited JSON over its stdin/stdout. Children start lazily; after the first use the pool is
topped up in the background to ``pool_size`` warm children. A child is replaced after
``max_tasks_per_child`` tasks, after a crash (``os._exit``, a segfault, an OOM kill), and after a
timeout (it is killed: ``error.kind = "timeout"``, retryable). A crash, a hang or a leak in user code
therefore never takes the worker down.

Outcome (D8): ``result`` is ``main(...)``'s return value or the variable ``result``; ``py`` carries
``exception_type`` (bare class name, None on success) and ``stdout`` (what the code printed, at most
64 KiB; ``stdout_truncated`` says when more was printed). The child's answer is read from the pipe in
parts: past ``limits.max_result_bytes`` (plus room for stdout) reading stops, the child is replaced and
the task fails with ``result_too_large``.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Mapping
from typing import Any

from .. import limits
from .base import ResultTooLarge, ToolContext, error, ok, timeout_seconds

__all__ = ["PythonTool", "PythonPool"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 60.0  # KIND_DEFAULTS["python"]["timeout"]
MAX_STDOUT = 64 * 1024
_STREAM_LIMIT = 1 << 20  # a child's answer is read in parts of at most this (the pipe's buffer in between)
_ANSWER_SLACK = 64 * 1024  # an answer's envelope, error message and traceback, beyond result and stdout
_START_TIMEOUT = 60.0  # a child that does not say "ready" within this is broken


class _ChildCrashed(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _Child:
    __slots__ = ("proc", "uses")

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.uses = 0

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "closed its output"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class PythonPool:
    """A pool of warm child interpreters, each running one request at a time."""

    def __init__(
        self,
        size: int = 2,
        max_tasks_per_child: int = 200,
        *,
        python: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> None:
        if size < 1:
            raise ValueError("pool size must be at least 1")
        self.size = size
        self.max_tasks = max(1, max_tasks_per_child)
        self._argv = [python or sys.executable, "-m", "noetl_mesh.tools.python_runner"]
        self._env = dict(env) if env is not None else None
        self._cwd = cwd
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sem: asyncio.Semaphore | None = None
        self._idle: list[_Child] = []
        self._children: set[_Child] = set()
        self._spawning: set[asyncio.Task] = set()
        self._busy = 0
        self._bg: set[asyncio.Future] = set()
        self._closed = False
        self.spawned = 0  # children started so far (for tests and metrics)

    # ------------------------------------------------------------------------------------ lifecycle

    def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        if self._loop is not None:
            # Used from a new event loop: the old children's pipes belong to the old loop.
            for child in list(self._children):
                _hard_kill(child)
            self._children.clear()
            self._idle.clear()
            self._spawning.clear()
            self._busy = 0
        self._loop = loop
        self._sem = asyncio.Semaphore(self.size)
        self._closed = False

    async def _spawn(self) -> _Child:
        kwargs: dict[str, Any] = {}
        if self._env is not None:
            kwargs["env"] = self._env
        if self._cwd is not None:
            kwargs["cwd"] = self._cwd
        proc = await asyncio.create_subprocess_exec(
            *self._argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=None,  # user stderr goes to the worker's stderr
            limit=_STREAM_LIMIT,
            **kwargs,
        )
        child = _Child(proc)
        self._children.add(child)
        self.spawned += 1
        try:
            async with asyncio.timeout(_START_TIMEOUT):
                line = await proc.stdout.readline()  # type: ignore[union-attr]
            if not line or not json.loads(line).get("ready"):
                raise _ChildCrashed(f"python child {_describe_exit(proc.returncode)} before it was ready")
        except BaseException:
            await self._discard(child)
            raise
        return child

    async def _spawn_idle(self) -> None:
        try:
            child = await self._spawn()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            log.warning("could not pre-start a python child: %s", e)
            return
        if self._closed:
            await self._discard(child)
        else:
            self._idle.append(child)

    def _top_up(self) -> None:
        """Start children in the background until the pool holds ``size`` of them (pre-warming)."""
        if self._closed:
            return
        while len(self._idle) + self._busy + len(self._spawning) < self.size:
            t = asyncio.ensure_future(self._spawn_idle())
            self._spawning.add(t)
            t.add_done_callback(self._spawning.discard)

    async def _acquire(self) -> _Child:
        while True:
            while self._idle:
                child = self._idle.pop()
                if child.alive:
                    return child
                await self._discard(child)
            if self._spawning:
                await asyncio.wait(set(self._spawning), return_when=asyncio.FIRST_COMPLETED)
                continue
            return await self._spawn()

    async def _discard(self, child: _Child) -> None:
        """Stop a child for good (kill it if needed) and reap it."""
        self._children.discard(child)
        proc = child.proc
        if proc.returncode is None:
            try:
                proc.kill()
            except ProcessLookupError:
                pass
        try:
            await asyncio.wait_for(proc.wait(), 5.0)
        except (asyncio.TimeoutError, ProcessLookupError):
            pass

    async def _retire(self, child: _Child) -> None:
        """Let a healthy child exit on EOF, killing it if it does not."""
        self._children.discard(child)
        proc = child.proc
        try:
            if proc.stdin is not None:
                proc.stdin.close()
            await asyncio.wait_for(proc.wait(), 2.0)
        except (asyncio.TimeoutError, OSError):
            await self._discard(child)

    async def close(self) -> None:
        """Stop every child. The pool can be used again afterwards (it starts new children)."""
        self._closed = True
        for t in list(self._spawning):
            t.cancel()
        for t in list(self._spawning):
            try:
                await t
            except BaseException:  # noqa: BLE001
                pass
        self._spawning.clear()
        idle, self._idle = self._idle, []
        for child in idle:
            await self._retire(child)
        for child in list(self._children):
            await self._discard(child)
        self._loop = None

    def pids(self) -> list[int]:
        """Pids of the live children (for tests)."""
        return sorted(c.pid for c in self._children if c.alive)

    # -------------------------------------------------------------------------------------- execute

    async def execute(self, request: dict, timeout: float | None, max_answer: int | None = None) -> tuple[dict, int]:
        """Send one request to a warm child; ``(response, pid)``.

        Raises ``asyncio.TimeoutError`` (the child was killed), :class:`_ChildCrashed`, or
        :class:`ResultTooLarge` when the answer passes ``max_answer`` bytes (the child is killed: reading
        stops there).
        """
        self._bind()
        payload = json.dumps(request, ensure_ascii=False, separators=(",", ":"), default=str).encode() + b"\n"
        assert self._sem is not None
        async with self._sem:
            child = await self._acquire()
            self._busy += 1
            healthy = False
            try:
                proc = child.proc
                try:
                    proc.stdin.write(payload)  # type: ignore[union-attr]
                    async with asyncio.timeout(timeout):
                        await proc.stdin.drain()  # type: ignore[union-attr]
                        line = await _read_answer(proc.stdout, max_answer)  # type: ignore[arg-type]
                except (BrokenPipeError, ConnectionResetError):
                    line = b""
                if not line:
                    try:
                        await asyncio.wait_for(proc.wait(), 2.0)
                    except asyncio.TimeoutError:
                        pass
                    raise _ChildCrashed(f"python process {child.pid} {_describe_exit(proc.returncode)}")
                try:
                    response = json.loads(line)
                except ValueError as e:
                    raise _ChildCrashed(f"python child sent an unreadable response: {e}") from None
                healthy = True
                child.uses += 1
                return response, child.pid
            finally:
                self._busy -= 1
                if healthy and child.uses < self.max_tasks and not self._closed:
                    self._idle.append(child)
                elif healthy:
                    t = asyncio.ensure_future(self._retire(child))
                    self._bg.add(t)
                    t.add_done_callback(self._bg.discard)
                else:
                    # timeout, crash or cancellation: the child's state is unknown, replace it.
                    await asyncio.shield(self._discard(child))
                if not self._closed:
                    self._top_up()


async def _read_answer(stream: asyncio.StreamReader, max_answer: int | None) -> bytes:
    """One answer line, read in parts; :class:`ResultTooLarge` as soon as it passes ``max_answer``
    bytes (so a huge result is never held); ``b""`` when the child closed its output first."""
    parts: list[bytes] = []
    size = 0
    while True:
        try:
            part = await stream.readuntil(b"\n")
            done = True
        except asyncio.LimitOverrunError as e:  # no newline within the stream's limit yet
            part = await stream.readexactly(e.consumed)
            done = False
        except asyncio.IncompleteReadError:  # the child died mid-answer (or before it)
            return b""
        size += len(part)
        if max_answer is not None and size > max_answer:
            raise ResultTooLarge(None, "the python process's answer")
        parts.append(part)
        if done:
            return parts[0] if len(parts) == 1 else b"".join(parts)


def _hard_kill(child: _Child) -> None:
    try:
        os.kill(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class PythonTool:
    """``kind: python`` (D25)."""

    kind = "python"

    def __init__(
        self,
        pool_size: int = 2,
        max_tasks_per_child: int = 200,
        *,
        max_stdout: int = MAX_STDOUT,
        python: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.pool = PythonPool(pool_size, max_tasks_per_child, python=python, env=env)
        self.max_stdout = max_stdout

    async def run(self, task: dict, spec: dict, ctx: ToolContext) -> dict:
        code = task.get("code")
        if not isinstance(code, str):
            return error("python_error", "python task needs 'code' (a string)", py=_py(None))
        args = task["args"] if "args" in task else task.get("input")
        if args is None:
            args = {}
        if not isinstance(args, Mapping):
            return error(
                "python_error", f"python task 'args' must render to a mapping, got {type(args).__name__}", py=_py(None)
            )
        timeout = timeout_seconds(ctx.timeout if ctx.timeout is not None else spec.get("timeout"), DEFAULT_TIMEOUT)
        request = {
            "code": code,
            "args": dict(args),
            "filename": f"<{ctx.step}.{ctx.task_name}>",
            "max_stdout": self.max_stdout,
        }
        max_answer = limits.current().max_result_bytes + 6 * self.max_stdout + _ANSWER_SLACK
        try:
            resp, pid = await self.pool.execute(request, timeout, max_answer)
        except ResultTooLarge as e:
            return e.outcome(ctx, py=_py(None))
        except asyncio.TimeoutError:
            return error(
                "timeout", f"python task exceeded its timeout of {timeout:g}s (process killed)", True, py=_py(None)
            )
        except _ChildCrashed as e:
            return error("python_crash", e.message, False, py=_py("ChildProcessError"))
        stdout = resp.get("stdout") or ""
        py = _py(None, stdout, resp.get("stdout_truncated", False), pid)
        if resp.get("ok"):
            return ok(resp.get("result"), py=py)
        py["exception_type"] = resp.get("exception_type")
        out = error("python_error", resp.get("message") or "", False, py=py)
        out["error"]["exception_type"] = resp.get("exception_type")
        if resp.get("traceback"):
            out["error"]["traceback"] = resp["traceback"]
        return out

    async def close(self) -> None:
        await self.pool.close()


def _py(exception_type: str | None, stdout: str = "", truncated: bool = False, pid: int | None = None) -> dict:
    return {"exception_type": exception_type, "stdout": stdout, "stdout_truncated": truncated, "pid": pid}
