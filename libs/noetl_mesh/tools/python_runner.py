"""Inside a task process: the ``python`` tool's code runner (D25), called by :mod:`noetl_mesh.sandbox.task`.

:func:`run` takes ``{"code", "args", "filename", "max_stdout"}`` and gives one answer:

* ``{"ok": true, "result": ..., "stdout": "..."}``
* ``{"ok": false, "exception_type": "ValueError", "message": "...", "traceback": "...", "stdout": "...",
  "errno": N (an OSError), "sandbox": true (refused by the sandbox, D33)}``

During the code ``sys.stdout`` is a bounded capture buffer (returned as ``stdout``) and ``sys.stdin`` is
empty; the process's own descriptors 0-2 are /dev/null and a file in the task's scratch directory, so
nothing the code writes can corrupt the answer, which goes to the task's socket. Each task process runs
one request, in a fork of a fresh interpreter: nothing a task leaves behind reaches another.

Only the standard library is imported here.
"""
from __future__ import annotations

import builtins
import inspect
import io
import json
import sys
import traceback

_TRACEBACK_LIMIT = 4000  # characters kept from the end of a traceback


class _Capture(io.TextIOBase):
    """A text stream that keeps the first ``limit`` characters written to it."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self._parts: list[str] = []
        self._size = 0
        self._limit = limit
        self.truncated = False

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:  # type: ignore[override]
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        room = self._limit - self._size
        if room > 0:
            part = s[:room]
            self._parts.append(part)
            self._size += len(part)
        if len(s) > max(room, 0):
            self.truncated = True
        return len(s)

    def getvalue(self) -> str:
        return "".join(self._parts)

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"


def _call_main(fn, args: dict):
    """D25: call ``main`` with the args whose names match its parameters (all with ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return fn(**args)
    if any(p.kind is p.VAR_KEYWORD for p in params):
        rv = fn(**args)
    else:
        pos, kw = [], {}
        for p in params:
            if p.name not in args:
                continue
            if p.kind is p.POSITIONAL_ONLY:
                pos.append(args[p.name])
            elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                kw[p.name] = args[p.name]
        rv = fn(*pos, **kw)
    if inspect.isawaitable(rv):
        import asyncio

        async def _await(aw):
            return await aw

        rv = asyncio.run(_await(rv))
    return rv


def _safe_str(e: BaseException) -> str:
    try:
        return str(e)
    except BaseException:  # noqa: BLE001 - a broken __str__ must not kill the runner
        return f"<unprintable {type(e).__name__}>"


def _user_traceback(exc: BaseException, filename: str) -> str:
    tb = exc.__traceback__
    # Drop the runner's own frames: start at the first frame of the user's code.
    t = tb
    while t is not None and t.tb_frame.f_code.co_filename != filename:
        t = t.tb_next
    try:
        te = traceback.TracebackException(type(exc), exc, t if t is not None else tb, limit=20)
        text = "".join(te.format())
    except BaseException:  # noqa: BLE001
        return ""
    if len(text) > _TRACEBACK_LIMIT:
        text = "…" + text[-_TRACEBACK_LIMIT:]
    return text


def run(req: dict, confined: bool = False) -> dict:
    code = req.get("code") or ""
    args = req.get("args") or {}
    filename = req.get("filename") or "<python task>"
    cap = _Capture(int(req.get("max_stdout") or 65536))
    saved_out, saved_in = sys.stdout, sys.stdin
    sys.stdout = cap
    sys.stdin = io.StringIO("")
    try:
        g: dict = {"__name__": "__noetl_task__", "__builtins__": builtins}
        g.update(args)
        try:
            exec(compile(code, filename, "exec"), g)  # noqa: S102 - running user code is this tool's job
            fn = g.get("main")
            if callable(fn) and fn is not args.get("main"):
                result = _call_main(fn, args)
            else:
                result = g.get("result")
        except BaseException as e:  # noqa: BLE001 - SystemExit and KeyboardInterrupt are user errors too
            from noetl_mesh.sandbox.task import sandbox_refusal

            out = {
                "ok": False,
                "exception_type": type(e).__name__,
                "message": _safe_str(e),
                "traceback": _user_traceback(e, filename),
                "stdout": cap.getvalue(),
                "stdout_truncated": cap.truncated,
            }
            if isinstance(e, OSError) and e.errno is not None:
                out["errno"] = e.errno
            if sandbox_refusal(e, confined):
                out["sandbox"] = True
            if isinstance(e, MemoryError) or (isinstance(e, OSError) and e.errno == 12):  # ENOMEM: a mapping
                out["limit"] = "task_max_memory_bytes"
            return out
    finally:
        sys.stdout, sys.stdin = saved_out, saved_in
    return {"ok": True, "result": result, "stdout": cap.getvalue(), "stdout_truncated": cap.truncated}


def encode(resp: dict) -> bytes:
    try:
        return json.dumps(resp, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    except (TypeError, ValueError, RecursionError) as e:
        if not resp.get("ok"):
            raise
        result = resp.get("result")
        bad = {
            "ok": False,
            "exception_type": type(e).__name__,
            "message": f"result is not JSON-serialisable ({type(result).__name__}): {e}",
            "traceback": "",
            "stdout": resp.get("stdout", ""),
            "stdout_truncated": resp.get("stdout_truncated", False),
            "not_json": True,
        }
        return json.dumps(bad, ensure_ascii=False, separators=(",", ":")).encode()
