"""Inside a task process: the ``shell`` tool's runner (D33), called by :mod:`noetl_mesh.sandbox.task`.

:func:`run` takes ``{"commands": [...], "env": {...}, "shell": "/bin/sh", "max_output": N}`` and runs
each command with ``<shell> -c <command>``, one after the other, in the task's scratch directory, until
one exits with a status other than 0. Its answer::

    {"exit_code": 0, "stdout": "...", "stderr": "...", "stdout_truncated": false, "stderr_truncated": false,
     "commands_run": 1, "fork_failed": false}

``exit_code`` is the last command's status; a command killed by a signal has ``-N`` (the signal's
number). Each command's environment is ``PATH``, ``HOME`` and ``TMPDIR`` (the scratch directory),
``LANG`` and what the request's ``env`` gives, nothing else; its standard input is ``/dev/null``.

Output is bounded: standard output keeps its first ``max_output`` bytes, standard error its last (what
explains a failure is at its end), each with a marker saying how much was left out. A command is done
when its shell exits: what it left running in the background is not waited for (its output stops being
read; the fork server kills the task's whole process group when the task process ends).

``fork_failed``: the shell said it could not start a process (the kernel's ``EAGAIN`` of the process
limit, in the words of dash, bash or busybox), so the commands did not all run: the runner stops
there, without waiting for the shell (``exit_code`` None), and the task ends.

Only the standard library is imported here.
"""
from __future__ import annotations

import os
import select

__all__ = ["run", "Output"]

DEFAULT_SHELL = "/bin/sh"
# what a shell writes when fork() fails with EAGAIN (RLIMIT_NPROC): dash, bash, busybox ash
_FORK_FAILED = (b"Cannot fork", b"fork: retry", b"fork: Resource temporarily unavailable", b"can't fork")
_CARRY = max(map(len, _FORK_FAILED))


class Output:
    """One stream of a command: its first ``limit`` bytes (``keep="head"``) or its last
    (``keep="tail"``), and how many bytes were written in all."""

    def __init__(self, limit: int, keep: str = "head") -> None:
        self.limit, self.keep = max(0, int(limit)), keep
        self.data = bytearray()
        self.total = 0
        self.seen = b""  # the end of what was written, for patterns across reads

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        if self.keep == "head":
            room = self.limit - len(self.data)
            if room > 0:
                self.data += chunk[:room]
        else:
            self.data += chunk
            if len(self.data) > self.limit:
                del self.data[:len(self.data) - self.limit]

    @property
    def truncated(self) -> bool:
        return self.total > len(self.data)

    def text(self) -> str:
        body = bytes(self.data).decode("utf-8", "replace")
        if not self.truncated:
            return body
        cut = self.total - len(self.data)
        if self.keep == "head":
            return f"{body}\n[... {cut} more bytes not kept: output is capped at {self.limit} bytes]"
        return f"[... {cut} earlier bytes not kept: output is capped at {self.limit} bytes]\n{body}"


def _environment(env: object, home: str) -> dict[str, str]:
    out = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8"}
    if isinstance(env, dict):
        for key, value in env.items():
            out[str(key)] = str(value)
    return out


def _one(shell: str, command: str, env: dict[str, str], out: Output, err: Output,
         fork_failed: list[bool]) -> int | None:
    """Run one command; its exit status (``-N``: killed by signal N; 127: the shell could not start;
    None: it could not start a process, and was left to be killed with the task)."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        pid = os.fork()
    except BlockingIOError as e:  # EAGAIN: the process limit is reached already
        for fd in (out_r, out_w, err_r, err_w):
            os.close(fd)
        err.add(f"the task could not start its shell: fork: {e.strerror}\n".encode())
        fork_failed[0] = True
        return None
    if pid == 0:  # the command's process: its pipes as 1 and 2, nothing else open, then the shell
        try:
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            os.closerange(3, 1 << 16)
            os.execve(shell, [os.path.basename(shell), "-c", command], env)
        except BaseException as e:  # noqa: BLE001 - said on its standard error
            try:
                os.write(2, f"{shell}: cannot run: {e}\n".encode())
            except OSError:
                pass
        os._exit(127)
    os.close(out_w)
    os.close(err_w)
    streams = {out_r: out, err_r: err}
    poll = select.poll()
    for fd in streams:
        poll.register(fd, select.POLLIN)

    def read(fd: int) -> bool:
        """Read what ``fd`` holds; False when there is nothing more now (its end, or an empty pipe)."""
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return False
        if not chunk:
            poll.unregister(fd)
            del streams[fd]
            os.close(fd)
            return False
        stream = streams[fd]
        stream.add(chunk)
        if stream is err:
            seen = stream.seen + chunk
            if any(p in seen for p in _FORK_FAILED):
                fork_failed[0] = True
            stream.seen = seen[-_CARRY:]
        return True

    status = None
    while status is None and not fork_failed[0]:
        for fd, _ in poll.poll(100) if streams else ():
            read(fd)
        done, st = os.waitpid(pid, os.WNOHANG if streams else 0)
        if done:
            status = st
    # the shell has exited, or could not start a process (a fork bomb at the process limit: not waited
    # for, the fork server kills the task's process group when the task process ends): what its pipes
    # hold now is read (at most 64 reads: a background process writing on must not keep this going); one
    # that keeps a pipe open is not waited for
    for fd in list(streams):
        os.set_blocking(fd, False)
        for _ in range(64):
            if fd not in streams or not read(fd):
                break
    for fd in list(streams):
        os.close(fd)  # (a pipe a background process still holds: it gets EPIPE if it writes on)
    return None if status is None else os.waitstatus_to_exitcode(status)


def run(req: dict) -> dict:
    commands = req.get("commands") or []
    shell = str(req.get("shell") or DEFAULT_SHELL)
    limit = int(req.get("max_output") or 1 << 20)
    out, err = Output(limit, "head"), Output(limit, "tail")
    env = _environment(req.get("env"), os.getcwd())
    fork_failed = [False]
    code, ran = 0, 0
    for command in commands:
        ran += 1
        code = _one(shell, str(command), env, out, err, fork_failed)
        if code != 0 or fork_failed[0]:
            break
    return {"exit_code": code, "stdout": out.text(), "stderr": err.text(), "stdout_truncated": out.truncated,
            "stderr_truncated": err.truncated, "commands_run": ran, "fork_failed": fork_failed[0]}
