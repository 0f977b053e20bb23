"""Child-process side of the python tool (D25): ``python -m noetl_mesh.tools.python_runner``.

Protocol: newline-delimited JSON over the process's original stdin/stdout. At start the child writes
``{"ready": true, "pid": N}``; then, for each request line ``{"code", "args", "filename",
"max_stdout"}`` it writes exactly one response line:

* ``{"ok": true, "result": ..., "stdout": "..."}``
* ``{"ok": false, "exception_type": "ValueError", "message": "...", "traceback": "...", "stdout": "..."}``

User code cannot corrupt the protocol: the protocol streams are private duplicates of fds 0 and 1;
fd 0 is then pointed at /dev/null and fd 1 at stderr, and during user code ``sys.stdout`` is a bounded
capture buffer (returned as ``stdout``) and ``sys.stdin`` is empty. One request at a time; the parent
kills the process on timeout and replaces it after a crash or N requests.

Only the standard library is imported here (the child must start fast).
"""
from __future__ import annotations

import builtins
import inspect
import io
import json
import os
import signal
import sys
import traceback

_TRACEBACK_LIMIT = 4000  # characters kept from the end of a traceback
_CODE_CACHE: dict[tuple[str, str], object] = {}
_CODE_CACHE_SIZE = 256


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


def _compile(code: str, filename: str) -> object:
    key = (code, filename)
    obj = _CODE_CACHE.get(key)
    if obj is None:
        obj = compile(code, filename, "exec")
        if len(_CODE_CACHE) >= _CODE_CACHE_SIZE:
            _CODE_CACHE.clear()
        _CODE_CACHE[key] = obj
    return obj


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


def _run(req: dict) -> dict:
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
            exec(_compile(code, filename), g)  # noqa: S102 - running user code is this tool's job
            fn = g.get("main")
            if callable(fn) and fn is not args.get("main"):
                result = _call_main(fn, args)
            else:
                result = g.get("result")
        except BaseException as e:  # noqa: BLE001 - SystemExit and KeyboardInterrupt are user errors too
            return {
                "ok": False,
                "exception_type": type(e).__name__,
                "message": _safe_str(e),
                "traceback": _user_traceback(e, filename),
                "stdout": cap.getvalue(),
                "stdout_truncated": cap.truncated,
            }
    finally:
        sys.stdout, sys.stdin = saved_out, saved_in
    return {"ok": True, "result": result, "stdout": cap.getvalue(), "stdout_truncated": cap.truncated}


def _encode(resp: dict) -> bytes:
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


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the parent dies, so a hung child never outlives the worker."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort
        pass


def main() -> None:
    # Interrupts are the parent's business (it kills or recycles this process).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    proto_in = os.fdopen(os.dup(0), "rb", buffering=1 << 16)
    proto_out = os.fdopen(os.dup(1), "wb", buffering=0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)  # stray writes to fd 1 (C extensions, subprocesses) go to stderr
    proto_out.write(json.dumps({"ready": True, "pid": os.getpid()}).encode() + b"\n")
    while True:
        line = proto_in.readline()
        if not line:
            return  # parent closed stdin: exit quietly
        try:
            req = json.loads(line)
        except ValueError as e:
            resp = {"ok": False, "exception_type": "ProtocolError", "message": str(e), "traceback": "", "stdout": ""}
        else:
            resp = _run(req)
        proto_out.write(_encode(resp) + b"\n")


if __name__ == "__main__":
    main()
