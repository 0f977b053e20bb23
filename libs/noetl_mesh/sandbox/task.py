"""Inside a task process (D33): read one request, run it, write one answer line, exit.

The request is the JSON the worker wrote on the task's socket (then shut its side); the answer is one
JSON line. Kinds: ``python`` (:mod:`noetl_mesh.tools.python_runner`), ``duckdb``
(:func:`noetl_mesh.tools.duckdb.execute`) and ``shell`` (:mod:`noetl_mesh.tools.shell_runner`). An answer says ``sandbox: true`` when what failed was
refused by the sandbox, ``limit`` when a resource limit stopped it.

Under confinement an audit hook turns what the kernel would refuse anyway (starting a process or a
program; a network socket on a pool whose network is closed) into an error that says why, before the
system call is made. It is a courtesy, not the barrier: the kernel's filters are. A shell task starts
programs by design, and has no such hook: what refuses it there is the kernel's, in the shell's words.
"""
from __future__ import annotations

import errno
import json
import os
import socket
import sys

_PROCESS_EVENTS = frozenset({"os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.spawn", "os.system",
                             "subprocess.Popen", "os.startfile", "pty.spawn"})


class SandboxRefused(PermissionError):
    """What the sandbox refuses, said in words (raised by the audit hook)."""


def _audit_hook(network: bool):
    def hook(event: str, args: tuple) -> None:
        if event in _PROCESS_EVENTS:
            raise SandboxRefused(errno.EPERM, "a task runs as one process: starting processes or programs is "
                                              "refused by the sandbox (D33; threads are allowed)")
        if event in ("os.kill", "os.killpg") and args and args[0] != os.getpid():
            raise SandboxRefused(errno.EPERM, "signals to other processes are refused by the sandbox (D33)")
        if event == "socket.__new__" and not network and len(args) > 1 and args[1] != socket.AF_UNIX:
            raise SandboxRefused(errno.EPERM, "the network is closed to python and duckdb tasks on this worker "
                                                  "pool (D33): use an http task, or a pool with "
                                                  "NOETL_SANDBOX_PYTHON_NET=1")
    return hook


def sandbox_refusal(e: BaseException, confined: bool) -> bool:
    """Whether an exception is the sandbox refusing something (not the task's own error)."""
    if not confined:
        return False
    return isinstance(e, SandboxRefused) or (isinstance(e, OSError) and e.errno in (errno.EPERM, errno.EACCES))


def _read_all(sock: socket.socket) -> bytes:
    parts = []
    while True:
        part = sock.recv(1 << 20)
        if not part:
            return b"".join(parts)
        parts.append(part)


def prepare(kind: str, config: dict) -> object:
    """What a spare task process of ``kind`` can do before its request comes: a duckdb one opens its
    in-memory database (the ~15 ms DuckDB takes to start one), already confined to the directories a
    request may use."""
    if kind != "duckdb":
        return None
    from noetl_mesh.tools import duckdb as duckdb_tool

    try:
        return duckdb_tool.connect(None, [os.getcwd(), *config.get("data_dirs", ())],
                                   config["limits"]["task_max_memory_bytes"])
    except Exception:  # noqa: BLE001 - the request will open its own, and say what fails
        return None


def serve(sock: socket.socket, kind: str | None, config: dict, warm: object = None) -> None:
    confined = bool(config.get("confine"))
    request = json.loads(_read_all(sock))
    if confined and kind != "shell":
        sys.addaudithook(_audit_hook(bool(config.get("network"))))
    try:
        if kind == "python":
            from noetl_mesh.tools import python_runner

            answer = python_runner.run(request, confined=confined)
            answer["pid"] = os.getpid()
            out = python_runner.encode(answer)
        elif kind == "shell":
            from noetl_mesh.tools import shell_runner

            answer = shell_runner.run(request)
            answer["pid"] = os.getpid()
            out = json.dumps(answer, ensure_ascii=False, separators=(",", ":")).encode()
        elif kind == "duckdb":
            from noetl_mesh.tools import duckdb as duckdb_tool

            out = json.dumps(duckdb_tool.execute(request, confined=confined, warm=warm), ensure_ascii=False,
                             separators=(",", ":"), default=str).encode()
        else:
            out = json.dumps({"ok": False, "exception_type": "ProtocolError",
                              "message": f"unknown task kind {kind!r}"}).encode()
    except MemoryError:
        out = json.dumps({"ok": False, "exception_type": "MemoryError", "limit": "task_max_memory_bytes",
                          "message": "out of memory"}).encode()
    sock.sendall(out + b"\n")
    sock.close()
