"""Confining a process (D33): capabilities, Landlock, seccomp and resource limits, in that order.

The fork server confines itself once (:func:`server`); each task process, forked from it, adds its own
layer (:func:`task`): its own scratch directory instead of the scratch root, no new processes or
programs, signals to itself only, and its resource limits. Both run while the process has one thread.

A shell task's fork server (``execute`` paths given) runs programs from those directories only; a
worker running as root first makes that server an unprivileged user (:func:`drop_user`), so that the
kernel counts its processes (``RLIMIT_NPROC`` does not apply to root).
"""
from __future__ import annotations

import ctypes
import os
import resource
import signal
from collections.abc import Iterable, Mapping

from . import landlock, seccomp

__all__ = ["server", "task", "set_limits", "set_nproc", "drop_capabilities", "drop_user", "NOBODY"]

NOBODY = 65534  # the user and group a shell task's fork server becomes when the worker runs as root

_PR_SET_NO_NEW_PRIVS, _PR_CAPBSET_DROP, _PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 38, 24, 1, 36
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def die_with_parent() -> None:
    """SIGKILL when the parent dies, so nothing sandboxed outlives the process that started it."""
    _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def reap_orphans() -> None:
    """Become the parent of this process's orphaned descendants (``PR_SET_CHILD_SUBREAPER``): what a
    task process leaves behind is then reaped here at once when killed, not by the host's init, whose
    pace (a container's may never reap) would leave it counted against a user's process limit."""
    _libc().prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def drop_capabilities() -> None:
    """A process running as root keeps uid 0 but loses every capability (bounding set included): it
    cannot override file permissions, kill other users' processes, mount, trace..."""
    libc = _libc()
    for cap in range(64):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # past the kernel's last capability (EINVAL)
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable, twice (64 bits): all zero
    if libc.capset(header, data) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"capset: {os.strerror(e)}")


def _no_new_privs() -> None:
    if _libc().prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(e)}")


def drop_user(uid: int = NOBODY, gid: int = NOBODY) -> None:
    """Become ``uid``/``gid`` for good (real, effective and saved), with no supplementary groups: every
    capability goes with root. Only a process running as root can; OSError otherwise."""
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getgroups():
        raise OSError(f"could not become uid {uid}")


def _layer(read: Iterable[str], write: Iterable[str], execute: Iterable[str], network: bool,
           task_pid: int | None) -> int:
    paths = [(p, landlock.READ) for p in read] + [(p, landlock.WRITE) for p in write]
    paths += [(p, landlock.READ | landlock.EXECUTE) for p in execute]
    paths += [("/dev/null", landlock.READ | landlock.WRITE_FILE)]
    version = landlock.restrict(paths, network=network)
    shell = bool(execute) and task_pid is not None
    seccomp.install(seccomp.program(task_pid=task_pid, network=network, shell=shell, signals_scoped=version >= 6))
    return version


def server(read: Iterable[str], write: Iterable[str], *, network: bool, execute: Iterable[str] = ()) -> int:
    """The fork server's layer: returns the Landlock ABI version in force. Raises OSError (or
    :class:`landlock.LandlockError`, :class:`seccomp.SeccompError`) when any part cannot be set.
    ``execute``: files and directories whose programs may run (a shell task's server)."""
    if os.geteuid() == 0:
        drop_capabilities()
    _no_new_privs()
    return _layer(read, write, list(execute), network, None)


def task(read: Iterable[str], write: Iterable[str], *, network: bool, execute: Iterable[str] = ()) -> None:
    """A task process's own layer (on top of the server's); with ``execute``, a shell task's (programs
    from those paths, processes kept in its process group)."""
    _layer(read, write, list(execute), network, os.getpid())


# resource -> the limit's name (limits.py) that sets it
RLIMITS = {
    "task_max_memory_bytes": resource.RLIMIT_DATA,
    "task_max_cpu_seconds": resource.RLIMIT_CPU,
    "task_max_open_files": resource.RLIMIT_NOFILE,
    "task_max_file_bytes": resource.RLIMIT_FSIZE,
}


ADDRESS_SPACE_SLACK = 1 << 30  # beyond the memory limit: the libraries, thread stacks and reservations mapped


def set_nproc(limit: int | None) -> None:
    """The task's process and thread limit (``RLIMIT_NPROC``: the user's processes now plus what the
    task may add), set as its task starts; None: none (root, whom the kernel never counts)."""
    if limit is not None:
        _, hard = resource.getrlimit(resource.RLIMIT_NPROC)  # (a process that is not root cannot raise it)
        limit = int(limit) if hard == resource.RLIM_INFINITY else min(int(limit), hard)
        resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))


def set_limits(values: Mapping[str, int]) -> None:
    """Resource limits of a task process: memory (data segment and private mappings: what Python,
    NumPy and DuckDB allocate; and every mapping, shared ones included, at most 1 GiB beyond that), CPU
    time (SIGXCPU, then SIGKILL 2 s later), open files, and the size of a file it writes (the write
    fails: SIGXFSZ is ignored). No core files."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    space = int(values["task_max_memory_bytes"]) + ADDRESS_SPACE_SLACK
    resource.setrlimit(resource.RLIMIT_AS, (space, space))
    for name, which in RLIMITS.items():
        value = int(values[name])
        hard = value + 2 if which == resource.RLIMIT_CPU else value
        soft_now, hard_now = resource.getrlimit(which)
        if hard_now != resource.RLIM_INFINITY:
            hard = min(hard, hard_now)
        resource.setrlimit(which, (min(value, hard), hard))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
