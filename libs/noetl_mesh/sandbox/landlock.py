"""The file-system (and TCP) view of sandboxed tasks (D33), with Linux Landlock; no library.

Landlock is the kernel's unprivileged sandbox (Linux 5.13+, enabled in most distributions' kernels):
a process lists the directories it keeps, then restricts itself; the restriction holds for it and
every process it starts, whatever its user id (root included), cannot be lifted, and stacks (a later
layer can only take away more). It needs no privilege, no user namespace and no setuid helper, so it
works the same in ``noetl run``, ``noetl up`` and a container running as an ordinary user.

What this module uses, by the kernel's Landlock ABI version:

- 1: reading, writing, creating and removing files and directories, beneath the listed paths only;
  everything else (``/proc``, ``/etc``, the stack's home and credentials...) cannot be opened;
- 2, 3: renaming across directories, truncating (handled when the kernel knows them);
- 4: TCP ``connect``/``bind`` refused unless the pool opens the network to user code;
- 5: device ``ioctl``;
- 6: no signals to processes outside the sandbox, no abstract UNIX sockets outside it.
"""
from __future__ import annotations

import ctypes
import errno
import os
import struct
from collections.abc import Iterable

__all__ = ["abi", "restrict", "LandlockError", "READ", "WRITE"]


class LandlockError(OSError):
    pass


_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446  # the same number on every architecture
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1

EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
REMOVE_DIR, REMOVE_FILE, MAKE_CHAR, MAKE_DIR = 1 << 4, 1 << 5, 1 << 6, 1 << 7
MAKE_REG, MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK, MAKE_SYM = 1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12
REFER, TRUNCATE, IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1

_FS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}
_FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV  # the rights a file (not a directory) takes

READ = READ_FILE | READ_DIR
WRITE = (READ | WRITE_FILE | REMOVE_DIR | REMOVE_FILE | MAKE_DIR | MAKE_REG | MAKE_SOCK | MAKE_FIFO | MAKE_SYM
         | REFER | TRUNCATE)

_libc = None


def _syscall():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    return _libc.syscall


def abi() -> int:
    """The kernel's Landlock ABI version; 0 when Landlock is missing or disabled."""
    if not os.uname().sysname == "Linux":
        return 0
    r = _syscall()(ctypes.c_long(_CREATE_RULESET), None, ctypes.c_long(0), ctypes.c_long(_CREATE_RULESET_VERSION))
    return int(r) if r > 0 else 0


def _handled_fs(version: int) -> int:
    return _FS_BY_ABI[max(v for v in _FS_BY_ABI if v <= version)]


def restrict(paths: Iterable[tuple[str, int]], *, network: bool) -> int:
    """Restrict this thread (and what it starts) to ``paths`` — ``(path, rights)`` with rights from
    :data:`READ`, :data:`WRITE` — and, unless ``network``, to no TCP connect or bind. Call it while the
    process has one thread (Landlock applies to the calling thread). Returns the ABI version used;
    :class:`LandlockError` when Landlock is unavailable or a path cannot be added (a missing path is
    skipped, and so is one this process may not open: an unprivileged user's, which could not read it
    anyway)."""
    version = abi()
    if version < 1:
        raise LandlockError(errno.ENOSYS, "Landlock is not available in this kernel (Linux 5.13+ with Landlock "
                                          "enabled in its security modules, lsm=landlock,...)")
    fs = _handled_fs(version)
    net = 0 if network or version < 4 else _NET_BIND_TCP | _NET_CONNECT_TCP
    scoped = _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL if version >= 6 else 0
    attr = struct.pack("<QQQ", fs, net, scoped)
    size = 8 if version < 4 else 16 if version < 6 else 24
    call = _syscall()
    buf = ctypes.create_string_buffer(attr[:size], size)
    ruleset = call(ctypes.c_long(_CREATE_RULESET), buf, ctypes.c_long(size), ctypes.c_long(0))
    if ruleset < 0:
        e = ctypes.get_errno()
        raise LandlockError(e, f"landlock_create_ruleset: {os.strerror(e)}")
    try:
        for path, rights in paths:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except (FileNotFoundError, PermissionError):
                continue
            try:
                allowed = rights & fs
                if not os.path.isdir(path):
                    allowed &= _FILE_RIGHTS
                rule = ctypes.create_string_buffer(struct.pack("<Qi", allowed, fd), 12)
                if call(ctypes.c_long(_ADD_RULE), ctypes.c_long(ruleset), ctypes.c_long(_RULE_PATH_BENEATH),
                        rule, ctypes.c_long(0)) != 0:
                    e = ctypes.get_errno()
                    raise LandlockError(e, f"landlock_add_rule({path}): {os.strerror(e)}")
            finally:
                os.close(fd)
        if call(ctypes.c_long(_RESTRICT_SELF), ctypes.c_long(ruleset), ctypes.c_long(0)) != 0:
            e = ctypes.get_errno()
            raise LandlockError(e, f"landlock_restrict_self: {os.strerror(e)}")
    finally:
        os.close(ruleset)
    return version
