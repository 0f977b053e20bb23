"""The worker's side of the sandbox (D33): one confined fork server, one process per task.

:class:`Supervisor` starts the fork server (:mod:`.forkserver`) with a clean environment, a scratch
root of its own and the file-system view of :func:`read_paths`; each :meth:`Supervisor.run` hands it one
end of a new socket pair, the server forks a task process that confines itself further and answers on
it. A timeout, a cancellation or an answer past its size kills the task process; a crash is reported
with its exit status and the end of its standard error. Tasks never share a process, a scratch
directory or anything they left in memory.

When the pool's policy has the sandbox on and it cannot be set up (no Landlock, an unsupported machine,
a secret inside the view), the supervisor refuses every task with the reason (:class:`SandboxUnavailable`)
and the worker says so at start: it never falls back to running user code unconfined.
"""
from __future__ import annotations

import asyncio
import contextvars
import itertools
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterable

from .. import limits
from ..contracts.subjects import LANES
from ..infra.lanes import Slots
from ..tools.base import ResultTooLarge
from . import landlock, seccomp
from .policy import Policy

__all__ = ["Supervisor", "SandboxUnavailable", "TaskCrashed", "read_paths", "describe_exit"]

log = logging.getLogger("noetl.sandbox")

_STREAM_LIMIT = 1 << 20  # an answer is read in parts of at most this
_START_TIMEOUT = 60.0
ANSWER_EXIT_GRACE = 1.0  # seconds a task process has to exit after its answer before it is killed
# One fork server per kind of task, started on first use, each with only what its tasks use imported:
# a python task process is then a fork of a small interpreter (DuckDB's 20 MB of mappings would make
# every fork and exit of a python task slower), a duckdb one of an interpreter with DuckDB loaded.
PRELOAD = {"python": ("noetl_mesh.tools.python_runner",), "duckdb": ("duckdb", "noetl_mesh.tools.duckdb"),
           "shell": ("noetl_mesh.tools.shell_runner",)}
# A shell task runs programs from these directories only (read-only), and the ELF interpreter they need
# (the kernel opens it as a program too). Nothing it may write can be run.
SHELL_EXECUTE = ("/usr/local/bin", "/usr/bin", "/bin", "/usr/sbin", "/sbin")
_ELF_INTERPRETERS = ("/lib64/ld-linux-x86-64.so.2", "/lib/ld-linux-aarch64.so.1")
# Outside the Python installation, what an interpreter and its C extensions read: shared libraries and
# their cache, time zones, the CPU count and cgroup limits (DuckDB sizes itself by them). No /etc beyond
# these, no /proc but the task's own /proc/self, no /home, no /root.
_SYSTEM_READ = ("/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/local/lib", "/usr/share/zoneinfo",
                "/etc/ld.so.cache", "/etc/localtime", "/sys/devices/system/cpu", "/sys/fs/cgroup", "/dev/urandom",
                "/dev/random", "/dev/zero")
_NETWORK_READ = ("/etc/resolv.conf", "/etc/hosts", "/etc/nsswitch.conf", "/etc/gai.conf", "/etc/ssl",
                 "/usr/share/ca-certificates", "/etc/ca-certificates")
_LIMIT_NAMES = ("task_max_memory_bytes", "task_max_cpu_seconds", "task_max_open_files", "task_max_file_bytes",
                "task_max_threads", "shell_max_processes")


class SandboxUnavailable(Exception):
    """User code cannot run here: the sandbox is on and cannot be set up. ``str()`` says why and what to do."""


class TaskCrashed(Exception):
    """The task process ended without an answer, or could not be started. ``message`` says how, in a
    sentence; ``limit`` names the resource limit that stopped it, when one did."""

    def __init__(self, message: str, limit: str | None = None, stderr: str = "") -> None:
        super().__init__(message)
        self.message, self.limit, self.stderr = message, limit, stderr


def describe_exit(code: int | None) -> tuple[str, str | None]:
    """``(how a task process ended, in a sentence, the limit that ended it or None)`` from its exit status."""
    if code is None:
        return "the task process closed its answer without ending", None
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        if -code == signal.SIGXCPU:
            return f"the task process was stopped by {name}: it used its CPU time", "task_max_cpu_seconds"
        return f"the task process was killed by {name}", None
    if code == 70:
        return "the task process failed before running the task (exit status 70)", None
    return f"the task process exited with code {code}", None


def _ancestor(path: str, of: str) -> bool:
    path, of = os.path.realpath(path), os.path.realpath(of)
    return of == path or of.startswith(path.rstrip(os.sep) + os.sep)


def read_paths(policy: Policy) -> list[str]:
    """What a task may read: the Python installation (the entries of ``sys.path`` inside its prefixes or
    site-packages, never the current directory or ``PYTHONPATH``), the engine's own packages, system
    libraries, and with an open network the resolver's and TLS files."""
    import site

    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    sites = {os.path.realpath(p) for p in site.getsitepackages()}
    paths: list[str] = []
    for p in [*sys.path, sysconfig.get_paths().get("stdlib") or "", sysconfig.get_paths().get("platstdlib") or ""]:
        if not p or not os.path.isdir(p):
            continue
        real = os.path.realpath(p)
        if real in sites or any(real != prefix and _ancestor(prefix, real) for prefix in prefixes):
            paths.append(real)
    import noetl_mesh
    import noetl_mesh.services

    paths += [os.path.dirname(os.path.realpath(noetl_mesh.__file__)),
              os.path.dirname(os.path.realpath(noetl_mesh.services.__file__))]
    paths += [p for p in _SYSTEM_READ if os.path.exists(p)]
    if policy.python_network:
        paths += [p for p in _NETWORK_READ if os.path.exists(p)]
    out: list[str] = []
    for p in paths:
        if p not in out:
            out.append(p)
    return out


def execute_paths() -> list[str]:
    """Where a shell task's programs may come from: :data:`SHELL_EXECUTE` and the ELF interpreter (its
    real file), those that exist."""
    out: list[str] = []
    for p in [*SHELL_EXECUTE, *(os.path.realpath(p) for p in _ELF_INTERPRETERS if os.path.exists(p))]:
        if os.path.exists(p) and p not in out:
            out.append(p)
    return out


def _exposed(view: Iterable[str], secrets: Iterable[str]) -> str | None:
    for secret in secrets:
        if not secret:
            continue
        for p in view:
            if _ancestor(p, secret):
                return f"{secret} lies inside {p}, which tasks may read"
    return None


class _Server:
    """One running fork server and what waits on its answers."""

    def __init__(self, proc: subprocess.Popen, ctl: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        self.proc, self.ctl, self.loop = proc, ctl, loop
        self.pids: dict[int, asyncio.Future] = {}
        self.exits: dict[int, asyncio.Future] = {}
        self.dead: str | None = None
        self.hello: asyncio.Future = loop.create_future()

    def on_readable(self) -> None:
        while True:
            try:
                data = self.ctl.recv(1 << 20)
            except BlockingIOError:
                return
            except OSError as e:
                data, err = b"", e
            else:
                err = None
            if not data:
                self._died(f"the sandbox's fork server went away ({err or 'end of file'}), and its task process with it")
                return
            message = json.loads(data)
            if "ready" in message:
                if not self.hello.done():
                    self.hello.set_result(message)
                continue
            if "warning" in message:
                log.warning("sandbox: %s", message["warning"])
                continue
            task_id = message.get("id")
            if "error" in message:  # the task process could not be started
                for fut in (self.pids.pop(task_id, None), self.exits.pop(task_id, None)):
                    if fut is not None and not fut.done():
                        fut.set_exception(TaskCrashed(message["error"]))
                continue
            if "pid" in message:
                fut = self.pids.pop(task_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(message["pid"])
            if "exit" in message:
                fut = self.exits.pop(task_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(message)

    def _died(self, why: str) -> None:
        if self.dead:
            return
        self.dead = why
        try:
            self.loop.remove_reader(self.ctl.fileno())
        except (ValueError, OSError):
            pass
        if not self.hello.done():
            self.hello.set_result({"ready": False, "error": why})
        for fut in [*self.pids.values(), *self.exits.values()]:
            if not fut.done():
                fut.set_exception(TaskCrashed(why))
                fut.exception()  # a waiter still gets it; one that gave up (closing) is not logged as lost
        self.pids.clear()
        self.exits.clear()

    async def send(self, message: dict, fds: list[int] | None = None) -> None:
        data = json.dumps(message).encode()
        while True:
            try:
                if fds:
                    socket.send_fds(self.ctl, [data], fds)
                else:
                    self.ctl.send(data)
                return
            except BlockingIOError:
                await asyncio.sleep(0.001)
            except OSError as exc:  # it died before this request reached it: the task never started
                self._died(f"the sandbox's fork server went away before the task started ({exc})")
                raise TaskCrashed(self.dead) from None

    def kill(self) -> None:
        """Close the server: the end of its control socket makes it kill its task processes and their
        process groups (what a shell task left running) and exit; killed if it has not within 2 s."""
        self._died("the sandbox was closed")
        try:
            self.ctl.close()
        except OSError:
            pass
        try:
            self.proc.wait(2)
        except subprocess.TimeoutExpired:
            pass
        if self.proc.poll() is None:
            try:
                self.proc.kill()
            except OSError:
                pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


# The lane of the command a task runs for (set by the worker as it starts the command; None: no lane):
# the worker's task processes are handed out between lanes in turn, as its run slots are.
LANE: contextvars.ContextVar[int | None] = contextvars.ContextVar("noetl_task_lane", default=None)


class Supervisor:
    """Runs python, duckdb and shell requests in sandboxed task processes (see the module's text)."""

    def __init__(self, policy: Policy | None = None, *, secret_paths: Iterable[str] = (),
                 python: str | None = None, spare: int = 2) -> None:
        self.policy = policy if policy is not None else Policy()
        self.secret_paths = [p for p in secret_paths if p]
        self.python = python or sys.executable
        self.spare = spare  # task processes kept forked and confined ahead of need
        self.landlock = 0
        self.spawned = 0  # task processes started (for tests and metrics)
        self._servers: dict[str, _Server] = {}  # by kind of task
        self._starting: dict[str, asyncio.Task] = {}
        self._unavailable: str | None = None
        self._refused: dict[str, str] = {}  # kind -> why its fork server could not confine itself
        self._root: str | None = None
        self._sem: Slots | None = None
        self._sem_loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count(1)
        self._running: dict[int, int] = {}  # task id -> pid of its process, while it runs
        self._finishing: set[asyncio.Task] = set()  # answered tasks whose process has not exited yet

    def running(self) -> list[int]:
        """The pids of the task processes running now."""
        return sorted(self._running.values())

    # --------------------------------------------------------------------------------------- state
    @property
    def confined(self) -> bool:
        return self.policy.enabled

    def describe(self) -> str:
        """One line for the worker's start-up log."""
        if self._unavailable:
            return (f"sandbox UNAVAILABLE: {self._unavailable}. This worker refuses python, duckdb and shell tasks; "
                    "run them on a pool that can sandbox, or set NOETL_SANDBOX=off for a trusted pool")
        if not self.policy.enabled:
            return self.policy.describe()
        return f"{self.policy.describe()}; Landlock ABI {self.landlock}, seccomp filter"

    def _preflight(self) -> str | None:
        """Why confinement cannot work here, before starting anything; None if it may."""
        if not sys.platform.startswith("linux"):
            return f"sandboxed tasks need Linux (this is {sys.platform})"
        if not seccomp.supported():
            import platform

            return f"no system-call filter for this machine ({platform.machine()}; x86_64 and aarch64 are supported)"
        if landlock.abi() < 1:
            return ("Landlock is not available in this kernel (Linux 5.13+ with Landlock among its security "
                    "modules, e.g. lsm=landlock,...; in a container, a seccomp profile that allows the "
                    "landlock_* system calls)")
        view = read_paths(self.policy) + list(self.policy.data_dirs) + execute_paths()
        if "/" in view:
            return "the task's view would hold the whole file system (a Python installed at /?)"
        exposed = _exposed(view, self.secret_paths)
        if exposed:
            return f"the task's view would expose a secret: {exposed}"
        return None

    # ------------------------------------------------------------------------------------ lifecycle
    async def start(self, kind: str = "python") -> None:
        """Start the fork server of ``kind``'s tasks (a no-op when it runs). Never raises for an
        unavailable sandbox: :meth:`run` refuses then, and :meth:`describe` says why."""
        loop = asyncio.get_running_loop()
        server = self._servers.get(kind)
        if server is not None and (server.loop is not loop or server.dead):
            server.kill()
            del self._servers[kind]
            server = None
        if server is not None or self._unavailable or kind in self._refused:
            return
        starting = self._starting.get(kind)
        if starting is not None and not starting.done() and starting.get_loop() is loop:
            await asyncio.shield(starting)
            return
        self._starting[kind] = starting = asyncio.ensure_future(self._start(kind))
        await asyncio.shield(starting)

    async def _start(self, kind: str) -> None:
        if kind not in PRELOAD:
            raise ValueError(f"no sandboxed task kind {kind!r}")
        loop = asyncio.get_running_loop()
        if self.policy.enabled:
            why = self._preflight()
            if why:
                self._unavailable = why
                log.error("%s", self.describe())
                return
        if self._root is None or not os.path.isdir(self._root):
            self._root = tempfile.mkdtemp(prefix="noetl-sandbox-")
        scratch_root = tempfile.mkdtemp(prefix=f"{kind}-", dir=self._root)  # each server its own: names never meet
        if kind == "shell" and os.geteuid() == 0:  # its server becomes nobody: it must pass through the root
            os.chmod(self._root, 0o711)  # (to reach its own; every other server's stays 0700, root's)
        values = limits.current()
        config = {
            "confine": self.policy.enabled,
            "scratch_root": scratch_root,
            "read": read_paths(self.policy),
            "data_dirs": list(self.policy.data_dirs),
            "network": self.policy.python_network,
            "kind": kind,
            "execute": execute_paths() if kind == "shell" else [],
            "preload": list(PRELOAD[kind]),
            "limits": {name: getattr(values, name) for name in _LIMIT_NAMES},
            "spare": self.spare,
        }
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": scratch_root, "TMPDIR": scratch_root}
        try:
            proc = subprocess.Popen([self.python, "-I", "-m", "noetl_mesh.sandbox.forkserver", str(theirs.fileno())],
                                    pass_fds=(theirs.fileno(),), env=env, cwd=scratch_root,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
        finally:
            theirs.close()
        mine.setblocking(False)
        server = _Server(proc, mine, loop)
        loop.add_reader(mine.fileno(), server.on_readable)
        try:
            await server.send(config)
            async with asyncio.timeout(_START_TIMEOUT):
                hello = await server.hello
        except TimeoutError:
            hello = {"ready": False, "error": f"the fork server did not start within {_START_TIMEOUT:g}s"}
        except BaseException:  # the start cancelled (the sandbox closing): this server is nobody's to kill else
            await asyncio.shield(asyncio.to_thread(server.kill))
            raise
        if not hello.get("ready"):
            server.kill()
            if self.policy.enabled:
                why = f"confinement failed: {hello.get('error')}"
                if kind == "shell":  # its own profile: python and duckdb tasks may still be confined
                    self._refused[kind] = why
                    log.error("sandbox UNAVAILABLE for shell tasks: %s. This worker refuses them", why)
                else:
                    self._unavailable = why
                    log.error("%s", self.describe())
                return
            raise TaskCrashed(f"the task process server could not start: {hello.get('error')}")
        for module, why in (hello.get("failed") or {}).items():
            log.warning("sandbox: %s cannot be imported in the task processes: %s", module, why)
        self.landlock = hello.get("landlock") or 0
        self._servers[kind] = server
        if self._sem is None or self._sem_loop is not loop:  # shared by every kind: the worker's bound
            self._sem, self._sem_loop = Slots(limits.current().max_task_processes, LANES + 1,
                                              limits.current().lane_reserve), loop

    async def close(self) -> None:
        for finishing in list(self._finishing):
            finishing.cancel()
        await asyncio.gather(*self._finishing, return_exceptions=True)
        for starting in self._starting.values():
            if not starting.done():
                starting.cancel()
        await asyncio.gather(*self._starting.values(), return_exceptions=True)
        self._starting.clear()
        servers, self._servers = list(self._servers.values()), {}
        for server in servers:
            await asyncio.to_thread(server.kill)
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

    # ------------------------------------------------------------------------------------------- run
    async def run(self, kind: str, request: dict, *, timeout: float | None, max_answer: int | None) -> dict:
        """One request in a new task process; its answer (a mapping). Raises :class:`SandboxUnavailable`,
        ``TimeoutError`` (the process was killed), :class:`TaskCrashed`, :class:`ResultTooLarge`."""
        await self.start(kind)
        if self._unavailable:
            raise SandboxUnavailable(f"this worker pool cannot sandbox user code: {self._unavailable} (D33)")
        if kind in self._refused:
            raise SandboxUnavailable(f"this worker pool cannot sandbox {kind} tasks: {self._refused[kind]} (D33)")
        server, sem = self._servers[kind], self._sem
        assert server is not None and sem is not None
        payload = json.dumps(request, ensure_ascii=False, separators=(",", ":"), default=str).encode()
        lane = LANE.get()
        await sem.take(lane)  # in its lane's turn (infra/lanes.py)
        handed_over = False  # the slot is released by _after_answer once the process has exited
        task_id = next(self._ids)
        try:
            loop = asyncio.get_running_loop()
            pid_fut, exit_fut = loop.create_future(), loop.create_future()
            server.pids[task_id], server.exits[task_id] = pid_fut, exit_fut
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                await server.send({"op": "run", "id": task_id, "kind": kind}, [theirs.fileno()])
            finally:
                theirs.close()
            self.spawned += 1
            pid_fut.add_done_callback(lambda f: None if f.cancelled() or f.exception() else  # (retrieves it)
                                      self._running.__setitem__(task_id, f.result()))
            mine.setblocking(False)
            reader, writer = await asyncio.open_connection(sock=mine, limit=_STREAM_LIMIT)
            answered, line = False, None
            try:
                async with asyncio.timeout(timeout):
                    try:
                        writer.write(payload)
                        await writer.drain()
                        writer.write_eof()
                    except ConnectionError:  # no process took the request: its exit says why
                        line = b""
                    else:
                        line = await _read_answer(reader, max_answer)
                answered = bool(line)
            finally:
                writer.close()
                if not answered:  # a timeout, a cancellation, an oversized or missing answer
                    self._running.pop(task_id, None)
                    await self._end(server, task_id, pid_fut)
                    if line is None:  # not waiting for its exit
                        server.exits.pop(task_id, None)
            if not line:
                try:
                    async with asyncio.timeout(5):
                        ended = await exit_fut
                except TimeoutError:
                    ended = {"exit": None, "stderr": ""}
                how, limit = describe_exit(ended.get("exit"))
                raise TaskCrashed(how, limit, ended.get("stderr") or "")
            # Answered: the process ends by itself at once. One that goes on (it wrote an answer early
            # and kept running) is killed; either way its slot is free only once it has exited.
            finishing = asyncio.ensure_future(self._after_answer(server, task_id, pid_fut, exit_fut))
            finishing.add_done_callback(lambda _: sem.release(lane))  # even if cancelled before it starts
            self._finishing.add(finishing)
            finishing.add_done_callback(self._finishing.discard)
            handed_over = True
            return json.loads(line)
        finally:
            if not handed_over:
                self._running.pop(task_id, None)
                sem.release(lane)

    async def _after_answer(self, server: _Server, task_id: int, pid_fut: asyncio.Future,
                            exit_fut: asyncio.Future) -> None:
        """Until the answered task's process has exited (killed if it goes on); its process slot is
        released when this ends, however (a done callback)."""
        try:
            try:
                async with asyncio.timeout(ANSWER_EXIT_GRACE):
                    await asyncio.shield(exit_fut)
            except TimeoutError:
                log.warning("sandbox: task process %s went on after its answer: killed", self._running.get(task_id))
                await self._end(server, task_id, pid_fut)
                async with asyncio.timeout(5):
                    await asyncio.shield(exit_fut)
        except (TimeoutError, TaskCrashed, asyncio.CancelledError):
            pass
        finally:
            server.exits.pop(task_id, None)
            server.pids.pop(task_id, None)
            self._running.pop(task_id, None)

    def server_pid(self, kind: str = "python") -> int | None:
        """The pid of ``kind``'s fork server, when it runs."""
        server = self._servers.get(kind)
        return server.proc.pid if server is not None else None

    async def _end(self, server: _Server, task_id: int, pid_fut: asyncio.Future) -> None:
        """Kill a task process (once the server has started it)."""
        try:
            if not pid_fut.done():
                await asyncio.wait_for(asyncio.shield(pid_fut), 5)
            if not server.dead:
                await server.send({"op": "kill", "id": task_id})
        except (TimeoutError, TaskCrashed, OSError):
            pass


async def _read_answer(stream: asyncio.StreamReader, max_answer: int | None) -> bytes:
    """One answer line, read in parts; :class:`ResultTooLarge` as soon as it passes ``max_answer``
    bytes (so a huge result is never held); ``b""`` when the task process closed its end first."""
    parts: list[bytes] = []
    size = 0
    while True:
        try:
            part = await stream.readuntil(b"\n")
            done = True
        except asyncio.LimitOverrunError as e:
            part = await stream.readexactly(e.consumed)
            done = False
        except (asyncio.IncompleteReadError, ConnectionError):  # the process died mid-answer, or before it
            return b""
        size += len(part)
        if max_answer is not None and size > max_answer:
            raise ResultTooLarge(None, "the task process's answer")
        parts.append(part)
        if done:
            return parts[0] if len(parts) == 1 else b"".join(parts)

