"""The sandbox's fork server (D33): ``python -I -m noetl_mesh.sandbox.forkserver FD``.

Started by the worker (:mod:`.supervisor`), one per kind of task, with a clean environment and one
inherited descriptor, a ``SOCK_SEQPACKET`` control socket. Its first message is the configuration; the
server then confines itself once (capabilities dropped, Landlock: the Python installation read-only, the
scratch root and the pool's data directories writable, nothing else; seccomp), imports what its tasks
use (the python runner, or DuckDB), and answers ``{"ready": true, "landlock": ABI}`` (or ``{"ready":
false, "error"}``). A shell task's server (``config["execute"]``: where its programs may come from)
becomes, when the worker runs as root, the unprivileged user ``nobody`` first (its scratch root handed
to it), so that the kernel bounds its tasks' processes (``RLIMIT_NPROC``).

Then, for each ``{"op": "run", "id", "kind"}`` carrying one descriptor (the task's end of a socket pair),
it makes the task's scratch directory, forks, and answers ``{"id", "pid"}``. The task process (a copy of
the server: a fork costs ~2 ms where starting an interpreter costs ~25) closes every other descriptor,
adds its own confinement layer, reads its request from the socket, runs it, writes one answer line and
exits. ``{"op": "kill", "id"}`` kills it. Each task process leads a process group of its own, and
"kill" means the whole group, as does its end: what a shell task started and left running dies with
it (the group is killed before the task process is reaped, so its id cannot have been reused), and is
reaped here (the server adopts orphans: ``PR_SET_CHILD_SUBREAPER``). When a task process ends the
server answers ``{"id", "exit", "stderr"}`` (the exit status as ``os.waitstatus_to_exitcode`` gives it,
and the end of what it wrote to its standard error) and removes its scratch directory. End of file on
the control socket: the server kills what runs and exits; it also dies with the worker
(``PR_SET_PDEATHSIG``).

Only the standard library is imported before confinement.
"""
from __future__ import annotations

import errno
import json
import os
import select
import shutil
import signal
import socket
import stat
import sys
import tempfile

STDERR_TAIL = 4096  # bytes of a task's standard error sent back with its exit
TASK_NICE = 10  # how much lower a task process's scheduling priority is than the worker's
# what a task process may read of its own /proc (DuckDB sizes itself by its cgroup; libraries read their
# limits and maps): not /proc/self/net, which shows every socket of the host's network namespace
OWN_PROC = tuple(f"/proc/self/{name}" for name in ("cgroup", "mountinfo", "status", "stat", "statm", "maps",
                                                    "limits", "fd"))
_MAX_MESSAGE = 1 << 20


def _send(ctl: socket.socket, message: dict) -> None:
    try:
        ctl.send(json.dumps(message).encode())
    except OSError:
        pass  # the worker is gone: the parent-death signal ends us


def _rmtree(path: str) -> None:
    """Remove a scratch directory whatever modes the task left in it (a mode-000 directory is opened
    up through a descriptor, never a path that could lead elsewhere; links are removed, not followed)."""
    def fix(func, p, exc):  # noqa: ARG001
        for d in (os.path.dirname(p), p):
            try:
                fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                os.fchmod(fd, 0o700)
            except OSError:
                pass
            finally:
                os.close(fd)
        try:
            func(p)
        except OSError:
            pass
    shutil.rmtree(path, onerror=fix)
    if os.path.isdir(path):  # a directory made unreadable one level down: a second pass opens it
        shutil.rmtree(path, onerror=fix)


def _tail(fd: int | None) -> str:
    """The end of what a task process wrote to its standard error: read from the server's own
    descriptor of the file it made (never by path: the task may have put a link, a FIFO or another
    file in its place), at most ``STDERR_TAIL`` bytes."""
    if fd is None:
        return ""
    try:
        size = os.fstat(fd).st_size
        return os.pread(fd, STDERR_TAIL, max(0, size - STDERR_TAIL)).decode("utf-8", "replace")
    except OSError:
        return ""
    finally:
        os.close(fd)


_UID_TASKS: list[float] = [0.0, 0.0]  # (when counted, how many)


def _uid_tasks(uid: int) -> int:
    """The processes and threads running as ``uid`` (what the kernel's RLIMIT_NPROC counts), from /proc;
    counted at most every 50 ms (tasks started together share one count)."""
    import time

    now = time.monotonic()
    if now - _UID_TASKS[0] < 0.05:
        return int(_UID_TASKS[1])
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", "rb") as f:
                fields = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
            if int(fields[b"Uid"].split()[0]) == uid:
                count += int(fields[b"Threads"])
        except (OSError, KeyError, ValueError):
            continue
    _UID_TASKS[:] = [now, count]
    return count


class Server:
    """Keeps ``spare`` task processes forked and confined ahead of need (a duckdb one opens its in-memory
    database while it waits); hands each request to a spare of its kind (the worker runs one server per
    kind, so there is one kind, but a request of another kind is served all the same)."""

    def __init__(self, ctl: socket.socket, config: dict) -> None:
        self.ctl, self.config = ctl, config
        self.root: str = config["scratch_root"]
        self.spare_count = max(0, int(config.get("spare", 2)))
        self.wanted: dict[str, int] = {config.get("kind", "python"): self.spare_count}  # spares to keep, by kind
        self.spares: dict[str, list[tuple[int, socket.socket, str]]] = {}  # kind -> (pid, channel, scratch)
        # pid -> (task id or None while spare, scratch, the server's descriptor of its .stderr)
        self.children: dict[int, tuple[int | None, str, int | None]] = {}
        self.by_id: dict[int, int] = {}  # task id -> pid
        self.serial = 0
        self.failures = 0  # spares that died unused in a row (a confinement that fails in every fork)
        self.last_error: str | None = None

    def serve(self) -> None:
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        poll = select.poll()
        poll.register(self.ctl.fileno(), select.POLLIN)
        poll.register(wake_r, select.POLLIN)
        try:
            self._top_up()
            while True:
                for fd, _ in poll.poll():
                    if fd == wake_r:
                        os.read(wake_r, 4096)
                    elif not self._message():
                        return
                self._reap()
                self._top_up()
        finally:
            for pid in list(self.children):
                _kill_group(pid)
            while self.children:
                self._reap(block=True)

    def _message(self) -> bool:
        try:
            data, fds, _, _ = socket.recv_fds(self.ctl, _MAX_MESSAGE, 4)
        except InterruptedError:
            return True
        except ConnectionError:  # the worker closed its end with a message unread: the same as its end
            return False
        if not data:
            for fd in fds:
                os.close(fd)
            return False
        request = json.loads(data)
        if request.get("op") == "run" and len(fds) == 1:
            self._run(request, fds[0])
        elif request.get("op") == "kill":
            pid = self.by_id.get(request.get("id"))
            if pid is not None:
                _kill_group(pid)
        else:
            for fd in fds:
                os.close(fd)
        return True

    def _fork(self, kind: str) -> tuple[int, socket.socket, str] | None:
        """A new spare for ``kind``: forked, set up and confined, waiting on its channel for a request."""
        self.serial += 1
        scratch = os.path.join(self.root, f"t{self.serial}")
        err = None
        try:
            os.mkdir(scratch, 0o700)
            err = os.open(os.path.join(scratch, ".stderr"),
                          os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        except OSError as e:
            if err is not None:
                os.close(err)
            _rmtree(scratch)
            self.last_error = f"the sandbox could not prepare a task process: {e}"
            _send(self.ctl, {"warning": self.last_error})
            return None
        try:
            pid = os.fork()
        except OSError as e:
            mine.close()
            theirs.close()
            os.close(err)
            _rmtree(scratch)
            self.last_error = f"the sandbox could not start a task process: {e}"
            _send(self.ctl, {"warning": self.last_error})
            return None
        if pid == 0:
            code = 70
            try:
                mine.close()
                _task_process(self.config, theirs, scratch, self.ctl.fileno(), kind, err)
                code = 0
            except BaseException:  # noqa: BLE001 - what went wrong is on its standard error
                if os.path.isdir(scratch):  # (gone: the server is closing, and took it; nothing to say)
                    import traceback

                    traceback.print_exc()
            finally:
                os._exit(code)
        theirs.close()
        self.children[pid] = (None, scratch, err)
        return pid, mine, scratch

    def _nproc(self) -> int | None:
        """The process (and thread) limit of a task that starts now: what the user runs now plus what the
        task may add (``shell_max_processes``, ``task_max_threads``). The kernel counts them per user and
        never for root, so only a server that is not root has one (a shell task's of a root worker:
        ``nobody``; a worker that is an ordinary user: its own). Counted as the task starts, not when its
        process was forked ahead: the processes another task started meanwhile are then the count's,
        not this task's allowance (a task that had filled its allowance left none to the tasks forked
        before it)."""
        uid = os.getuid()
        if uid == 0:
            return None
        bound = self.config["limits"]["shell_max_processes" if self.config.get("execute") else "task_max_threads"]
        return _uid_tasks(uid) + int(bound)

    def _top_up(self) -> None:
        for kind, count in self.wanted.items():
            spares = self.spares.setdefault(kind, [])
            while len(spares) < count and self.failures < 3:
                spare = self._fork(kind)
                if spare is None:
                    return
                spares.append(spare)

    def _run(self, request: dict, fd: int) -> None:
        task_id = int(request["id"])
        kind = str(request.get("kind"))
        self.wanted.setdefault(kind, self.spare_count)
        spares = self.spares.setdefault(kind, [])
        try:
            while True:
                spare = spares.pop(0) if spares else self._fork(kind)
                if spare is None:
                    _send(self.ctl, {"id": task_id, "error": self.last_error or "the sandbox could not start a task process"})
                    return
                pid, chan, scratch = spare
                try:
                    socket.send_fds(chan, [json.dumps({"kind": request.get("kind"), "id": task_id,
                                                       "nproc": self._nproc()}).encode()], [fd])
                except OSError:  # it died while waiting: its exit is reaped as a spare's
                    chan.close()
                    continue
                chan.close()
                self.children[pid] = (task_id, scratch, self.children.get(pid, (None, "", None))[2])
                self.by_id[task_id] = pid
                _send(self.ctl, {"id": task_id, "pid": pid})
                return
        finally:
            os.close(fd)

    def _reap(self, block: bool = False) -> None:
        while self.children or not block:  # (not blocking: orphans too, when no task process is left)
            try:  # seen, not yet reaped: its pid (its process group's id) cannot be reused meanwhile
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT | (0 if block else os.WNOHANG))
            except ChildProcessError:
                self.children.clear()
                return
            except InterruptedError:
                continue
            if info is None:
                return
            pid = info.si_pid
            if pid in self.children:
                _kill_group(pid)  # what it started and left running (a shell's background processes)
            try:
                _, status = os.waitpid(pid, 0)
            except ChildProcessError:
                continue
            if pid not in self.children:  # an orphan of a task's process group, handed to us: reaped
                continue
            task_id, scratch, err = self.children.pop(pid)
            tail = _tail(err)
            if scratch:
                _rmtree(scratch)
            if task_id is None:  # a spare that died unused
                for spares in self.spares.values():
                    for i, spare in enumerate(spares):
                        if spare[0] == pid:
                            spares.pop(i)[1].close()
                            break
                self.failures += 1
                _send(self.ctl, {"warning": f"a task process died before it was used "
                                            f"(status {os.waitstatus_to_exitcode(status)}): {tail[-2000:]}"})
            else:
                self.failures = 0
                self.by_id.pop(task_id, None)
                _send(self.ctl, {"id": task_id, "exit": os.waitstatus_to_exitcode(status), "stderr": tail})
            if block:
                return


def _kill_group(pid: int) -> None:
    """SIGKILL a task process and its process group (every process it started: a shell task cannot
    leave its group; another task's process may have left it, so it is killed by pid too)."""
    for kill, target in ((os.killpg, pid), (os.kill, pid)):
        try:
            kill(target, signal.SIGKILL)
        except OSError:
            pass


def _task_process(config: dict, chan: socket.socket, scratch: str, ctl_fd: int, kind: str, err: int) -> None:
    """In a forked task process: isolate and confine, get ready for a task of ``kind``, wait for its
    request, run it, answer. ``err``: its standard output and error, a file the server made and reads."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.dup2(err, 1)
    os.dup2(err, 2)
    keep = chan.fileno()
    os.closerange(3, keep)
    os.closerange(keep + 1, 1 << 16)
    os.setpgid(0, 0)
    from . import confine

    confine.die_with_parent()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.chdir(scratch)
    os.environ.clear()
    os.environ.update({"HOME": scratch, "TMPDIR": scratch, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8",
                       "PYTHONIOENCODING": "utf-8"})
    tempfile.tempdir = scratch
    try:  # user code yields the CPU to the engine's own processes (the filter then forbids changing it)
        os.setpriority(os.PRIO_PROCESS, 0, min(19, os.getpriority(os.PRIO_PROCESS, 0) + TASK_NICE))
    except OSError:
        pass
    confine.set_limits(config["limits"])
    if config["confine"]:
        confine.task([*config["read"], *OWN_PROC], [scratch, *config["data_dirs"]], network=config["network"],
                     execute=config.get("execute") or ())
    from . import task

    warm = task.prepare(kind, config)
    data, fds, _, _ = socket.recv_fds(chan, _MAX_MESSAGE, 1)
    chan.close()
    if not data or len(fds) != 1:
        return  # the server is going away
    confine.set_nproc(json.loads(data).get("nproc"))
    task.serve(socket.socket(fileno=fds[0]), kind, config, warm)


def _become_nobody(config: dict) -> None:
    """A shell task's server, started by root: its scratch root handed to ``nobody``, what it will
    import imported now (the Python installation may not be readable by ``nobody``), then ``nobody``
    for good. The kernel counts ``nobody``'s processes, so ``RLIMIT_NPROC`` bounds its tasks'."""
    from . import confine, task  # noqa: F401 - imported while readable
    import time  # noqa: F401
    import traceback  # noqa: F401

    for module in config.get("preload") or ():
        __import__(module)
    os.chown(config["scratch_root"], confine.NOBODY, confine.NOBODY)
    confine.drop_user()


def main() -> None:
    if len(sys.argv) != 2 or not sys.argv[1].isdigit():
        print("usage: python -I -m noetl_mesh.sandbox.forkserver FD (started by a worker)", file=sys.stderr)
        raise SystemExit(2)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctl = socket.socket(fileno=int(sys.argv[1]))
    ctl.setblocking(True)
    from . import confine

    confine.die_with_parent()
    confine.reap_orphans()
    config = json.loads(ctl.recv(_MAX_MESSAGE))
    os.umask(0o077)
    abi = 0
    if config["confine"]:
        try:
            st = os.stat(config["scratch_root"])
            if not stat.S_ISDIR(st.st_mode):
                raise OSError(errno.ENOTDIR, f"{config['scratch_root']} is not a directory")
            if config.get("execute") and os.geteuid() == 0:
                _become_nobody(config)
            # /proc: each task process narrows it to /proc/self (its own) in its layer
            abi = confine.server([*config["read"], "/proc"], [config["scratch_root"], *config["data_dirs"]],
                                 network=config["network"], execute=config.get("execute") or ())
        except Exception as e:  # noqa: BLE001 - said to the worker, which refuses user code
            _send(ctl, {"ready": False, "error": f"{type(e).__name__}: {e}"})
            return
    preloaded, failed = [], {}
    for module in config.get("preload") or ():
        try:
            __import__(module)
            preloaded.append(module)
        except Exception as e:  # noqa: BLE001 - the task that needs it reports the error
            failed[module] = f"{type(e).__name__}: {e}"
    from . import task  # noqa: F401,F811 - imported once here, not in every task

    import gc

    gc.freeze()  # what is loaded now is never collected in a task process: fewer pages copied after a fork
    _send(ctl, {"ready": True, "landlock": abi, "pid": os.getpid(), "preloaded": preloaded, "failed": failed})
    Server(ctl, config).serve()


if __name__ == "__main__":
    main()
