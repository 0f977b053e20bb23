"""The system-call filter of sandboxed tasks (D33): a seccomp-bpf program built here, no library.

What it refuses (``EPERM``), on x86_64 and aarch64 (any other machine cannot sandbox):

- network sockets: ``socket()`` of every family (``AF_UNIX`` included: the Docker and Postgres
  sockets are files), unless the pool opens the network to user code, then ``AF_INET``/``AF_INET6``
  only; ``socketpair`` stays (threads and pipes use it);
- other processes: ``ptrace``, ``process_vm_*``, ``kcmp``, ``pidfd_*``, signals to any process but the
  caller (``kill``/``tgkill`` of its own pid only), changing another process's limits, priority or
  scheduling (``prlimit64``/``sched_*`` of pid 0 or its own only; ``setpriority``, ``ioprio_set``);
- starting processes and programs (task layer only): ``fork``, ``vfork``, a ``clone`` that is not a
  thread, ``clone3`` (``ENOSYS``: the C library falls back to ``clone``), ``execve``, ``execveat``;
  a *shell* task layer (``shell=True``) allows them (a shell starts programs) but refuses ``setsid`` and
  ``setpgid``, so that every process it starts stays in its process group, which the fork server kills
  whole; its signals may go to its own process group (``kill(0)``, ``kill(-pid)``) and, when Landlock
  scopes signals to the sandbox (``signals_scoped``, ABI 6+), to any single process (the kernel then
  refuses those outside the task's own processes); never ``kill(-1)`` or another group;
- namespaces, mounts and the kernel's own surface: ``unshare``, ``setns``, ``mount`` and its family,
  ``chroot``, ``pivot_root``, ``bpf``, ``perf_event_open``, ``userfaultfd``, ``io_uring_*`` (which
  would run system calls behind the filter's back), modules, ``kexec``, ``reboot``, keyrings, clocks,
  ``personality``, ``open_by_handle_at`` (a classic container escape), SysV and POSIX IPC;
- changing files' metadata by path or descriptor (``chmod``, ``chown``, ``utime*``, ``*xattr``,
  ``truncate`` by path): the file-system layer (Landlock) controls reading and writing, not these;
- ``ioctl(TIOCSTI)`` (typing into a terminal);
- memory outside the resource limits: ``memfd_create``, ``memfd_secret`` (a file in memory that no
  limit counts), and (task layer) ``prctl(PR_SET_PDEATHSIG)``, so a task process cannot outlive its
  fork server.

Everything else is allowed: the filter is a deny-list over the Linux system-call table, which keeps
Python, its C extensions and DuckDB working; the file-system view is Landlock's job (landlock.py).
"""
from __future__ import annotations

import ctypes
import errno
import platform
import struct

__all__ = ["program", "install", "supported", "SeccompError"]


class SeccompError(OSError):
    pass


# seccomp_data: nr (int), arch (u32), instruction_pointer (u64), args[6] (u64) -- little-endian
_NR, _ARCH, _ARG = 0, 4, 16

_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_RET_KILL_PROCESS, _RET_ERRNO, _RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000

_CLONE_THREAD = 0x00010000
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME
_CLONE_NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80
_AF_INET, _AF_INET6 = 2, 10
_TIOCSTI = 0x5412
_PR_SET_PDEATHSIG = 1
_F_SETOWN, _F_SETSIG, _F_SETOWN_EX = 8, 10, 15
_FIOSETOWN, _SIOCSPGRP = 0x8901, 0x8902

# Denied everywhere (names absent from an architecture's table are skipped).
_DENIED = (
    "ptrace process_vm_readv process_vm_writev process_madvise kcmp pidfd_getfd pidfd_open pidfd_send_signal "
    "tkill rt_sigqueueinfo ioprio_set move_pages migrate_pages "
    "mount umount2 pivot_root chroot unshare setns open_tree open_tree_attr move_mount fsopen fsconfig fsmount fspick "
    "mount_setattr bpf perf_event_open userfaultfd io_uring_setup io_uring_enter io_uring_register "
    "kexec_load kexec_file_load init_module finit_module delete_module create_module reboot swapon swapoff acct "
    "quotactl quotactl_fd syslog settimeofday clock_settime clock_adjtime adjtimex sethostname setdomainname iopl "
    "ioperm lookup_dcookie name_to_handle_at open_by_handle_at keyctl add_key request_key fanotify_init vhangup "
    "personality uselib nfsservctl _sysctl "
    "truncate chmod fchmodat fchmodat2 chown lchown fchown fchownat utime utimes utimensat futimesat "
    "setxattr lsetxattr fsetxattr setxattrat removexattr lremovexattr fremovexattr removexattrat file_setattr "
    "shmget shmat shmctl shmdt semget semop semctl semtimedop msgget msgsnd msgrcv msgctl "
    "mq_open mq_unlink mq_timedsend mq_timedreceive mq_notify mq_getsetattr "
    "memfd_create memfd_secret"
).split()
# the task layer's own: no programs or processes; no priority changes (the fork server lowers a task's)
# (fchmod: the fork server opens up what a task left unreadable in its scratch, by descriptor)
_NO_PROGRAMS = ("execve", "execveat", "fork", "vfork", "setpriority", "fchmod", "inotify_init", "inotify_init1",
                "inotify_add_watch")
_PROGRAMS = ("execve", "execveat", "fork", "vfork")  # what a shell task layer keeps of _NO_PROGRAMS
_OWN_GROUP = ("setsid", "setpgid")  # what a shell task layer refuses: leaving the process group

_X86_64 = {
    "socket": 41, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "process_madvise": 440,
    "kcmp": 312, "pidfd_getfd": 438, "pidfd_open": 434, "pidfd_send_signal": 424, "kill": 62, "tkill": 200,
    "tgkill": 234, "rt_sigqueueinfo": 129, "rt_tgsigqueueinfo": 297, "prlimit64": 302, "setpriority": 141,
    "ioprio_set": 251, "sched_setscheduler": 144, "sched_setparam": 142, "sched_setattr": 314,
    "move_pages": 279, "migrate_pages": 256, "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161,
    "unshare": 272, "setns": 308, "open_tree": 428, "open_tree_attr": 467, "move_mount": 429, "fsopen": 430,
    "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442, "bpf": 321, "perf_event_open": 298,
    "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "kexec_load": 246, "kexec_file_load": 320, "init_module": 175, "finit_module": 313, "delete_module": 176,
    "create_module": 174, "reboot": 169, "swapon": 167, "swapoff": 168, "acct": 163, "quotactl": 179,
    "quotactl_fd": 443, "syslog": 103, "settimeofday": 164, "clock_settime": 227, "clock_adjtime": 305,
    "adjtimex": 159, "sethostname": 170, "setdomainname": 171, "iopl": 172, "ioperm": 173,
    "lookup_dcookie": 212, "name_to_handle_at": 303, "open_by_handle_at": 304, "keyctl": 250, "add_key": 248,
    "request_key": 249, "fanotify_init": 300, "vhangup": 153, "personality": 135, "uselib": 134,
    "nfsservctl": 180, "_sysctl": 156, "truncate": 76, "chmod": 90, "fchmod": 91, "fchmodat": 268,
    "fchmodat2": 452, "chown": 92, "lchown": 94, "fchown": 93, "fchownat": 260, "utime": 132, "utimes": 235,
    "utimensat": 280, "futimesat": 261, "setxattr": 188, "lsetxattr": 189, "fsetxattr": 190, "setxattrat": 463,
    "removexattr": 197, "lremovexattr": 198, "fremovexattr": 199, "removexattrat": 466, "file_setattr": 469,
    "shmget": 29, "shmat": 30, "shmctl": 31, "shmdt": 67, "semget": 64, "semop": 65, "semctl": 66,
    "semtimedop": 220, "msgget": 68, "msgsnd": 69, "msgrcv": 70, "msgctl": 71, "mq_open": 240,
    "mq_unlink": 241, "mq_timedsend": 242, "mq_timedreceive": 243, "mq_notify": 244, "mq_getsetattr": 245,
    "execve": 59, "execveat": 322, "fork": 57, "vfork": 58, "clone": 56, "clone3": 435, "ioctl": 16,
    "memfd_create": 319, "memfd_secret": 447, "prctl": 157, "fcntl": 72, "sched_setaffinity": 203,
    "inotify_init": 253, "inotify_init1": 294, "inotify_add_watch": 254, "setsid": 112, "setpgid": 109,
}
_AARCH64 = {
    "socket": 198, "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "process_madvise": 440,
    "kcmp": 272, "pidfd_getfd": 438, "pidfd_open": 434, "pidfd_send_signal": 424, "kill": 129, "tkill": 130,
    "tgkill": 131, "rt_sigqueueinfo": 138, "rt_tgsigqueueinfo": 240, "prlimit64": 261, "setpriority": 140,
    "ioprio_set": 30, "sched_setscheduler": 119, "sched_setparam": 118, "sched_setattr": 274,
    "move_pages": 239, "migrate_pages": 238, "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51,
    "unshare": 97, "setns": 268, "open_tree": 428, "open_tree_attr": 467, "move_mount": 429, "fsopen": 430,
    "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442, "bpf": 280, "perf_event_open": 241,
    "userfaultfd": 282, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "kexec_load": 104, "kexec_file_load": 294, "init_module": 105, "finit_module": 273, "delete_module": 106,
    "reboot": 142, "swapon": 224, "swapoff": 225, "acct": 89, "quotactl": 60, "quotactl_fd": 443,
    "syslog": 116, "settimeofday": 170, "clock_settime": 112, "clock_adjtime": 266, "adjtimex": 171,
    "sethostname": 161, "setdomainname": 162, "lookup_dcookie": 18, "name_to_handle_at": 264,
    "open_by_handle_at": 265, "keyctl": 219, "add_key": 217, "request_key": 218, "fanotify_init": 262,
    "vhangup": 58, "personality": 92, "nfsservctl": 42, "truncate": 45, "fchmod": 52, "fchmodat": 53,
    "fchmodat2": 452, "fchown": 55, "fchownat": 54, "utimensat": 88, "setxattr": 5, "lsetxattr": 6,
    "fsetxattr": 7, "setxattrat": 463, "removexattr": 14, "lremovexattr": 15, "fremovexattr": 16,
    "removexattrat": 466, "file_setattr": 469, "shmget": 194, "shmat": 196, "shmctl": 195, "shmdt": 197,
    "semget": 190, "semop": 193, "semctl": 191, "semtimedop": 192, "msgget": 186, "msgsnd": 189,
    "msgrcv": 188, "msgctl": 187, "mq_open": 180, "mq_unlink": 181, "mq_timedsend": 182,
    "mq_timedreceive": 183, "mq_notify": 184, "mq_getsetattr": 185, "execve": 221, "execveat": 281,
    "clone": 220, "clone3": 435, "ioctl": 29, "memfd_create": 279, "memfd_secret": 447, "prctl": 167,
    "fcntl": 25, "sched_setaffinity": 122, "inotify_init1": 26, "inotify_add_watch": 27, "setsid": 157,
    "setpgid": 154,
}
# machine -> (AUDIT_ARCH_*, table, the seccomp system call's number)
_ARCHES = {"x86_64": (0xC000003E, _X86_64, 317), "aarch64": (0xC00000B7, _AARCH64, 277)}


def supported(machine: str | None = None) -> bool:
    return (machine or platform.machine()) in _ARCHES


class _Asm:
    """A tiny classic-BPF assembler with forward labels."""

    def __init__(self) -> None:
        self.code: list[tuple[int, object, object, int]] = []
        self.labels: dict[str, int] = {}

    def op(self, code: int, k: int, jt: object = 0, jf: object = 0) -> None:
        self.code.append((code, jt, jf, k & 0xFFFFFFFF))

    def label(self, name: str) -> None:
        self.labels[name] = len(self.code)

    def bytes(self) -> bytes:
        out = []
        for i, (code, jt, jf, k) in enumerate(self.code):
            jumps = []
            for j in (jt, jf):
                if isinstance(j, str):
                    j = self.labels[j] - i - 1
                if not 0 <= j < 256:
                    raise ValueError(f"BPF jump out of range at {i}: {j}")
                jumps.append(j)
            out.append(struct.pack("<HBBI", code, jumps[0], jumps[1], k))
        return b"".join(out)


def program(*, task_pid: int | None, network: bool, machine: str | None = None, shell: bool = False,
            signals_scoped: bool = False) -> bytes:
    """The filter as BPF bytes. ``task_pid``: the task process's own pid (the task layer: no new
    processes or programs, signals to itself only); ``None``: the fork server's layer (it forks tasks).
    ``network``: ``socket()`` of ``AF_INET``/``AF_INET6`` allowed. ``shell`` (task layer): processes and
    programs allowed, its process group kept, signals to its group (and, ``signals_scoped``, to any one
    process: Landlock keeps them inside the task's own)."""
    machine = machine or platform.machine()
    if machine not in _ARCHES:
        raise SeccompError(errno.ENOSYS, f"no system-call filter for {machine} (x86_64 and aarch64 only)")
    arch, table, _ = _ARCHES[machine]
    eperm = _RET_ERRNO | errno.EPERM
    a = _Asm()
    a.op(_LD_W_ABS, _ARCH)
    a.op(_JEQ, arch, 1, 0)
    a.op(_RET, _RET_KILL_PROCESS)  # another ABI (i386 on x86_64, say): its numbers mean other calls
    a.op(_LD_W_ABS, _NR)
    if machine == "x86_64":
        a.op(_JGE, 0x40000000, 0, 1)  # the x32 ABI: same calls under other numbers
        a.op(_RET, eperm)

    denied = [n for n in _DENIED if n in table]
    if task_pid is not None:
        denied += [n for n in _NO_PROGRAMS if n in table and not (shell and n in _PROGRAMS)]
        if shell:
            denied += [n for n in _OWN_GROUP if n in table]
    for name in denied:
        a.op(_JEQ, table[name], 0, 1)
        a.op(_RET, eperm)
    a.op(_JEQ, table["clone3"], 0, 1)
    a.op(_RET, _RET_ERRNO | errno.ENOSYS)

    def arg_block(name: str, arg: int, body) -> None:
        """If the call is ``name``: load its argument ``arg`` (low 32 bits) and run ``body``, which
        returns on every path; otherwise skip the block (the accumulator still holds the number)."""
        skip = f"after_{name}"
        a.op(_JEQ, table[name], 0, skip)
        a.op(_LD_W_ABS, _ARG + 8 * arg)
        body()
        a.label(skip)

    def clone_body() -> None:
        a.op(_JSET, _CLONE_NAMESPACES, "clone_no", 0)
        if task_pid is not None and not shell:
            a.op(_JSET, _CLONE_THREAD, 0, "clone_no")  # a process, not a thread
        a.op(_RET, _RET_ALLOW)
        a.label("clone_no")
        a.op(_RET, eperm)

    arg_block("clone", 0, clone_body)

    def socket_body() -> None:
        if network:
            a.op(_JEQ, _AF_INET, "socket_yes", 0)
            a.op(_JEQ, _AF_INET6, "socket_yes", 0)
        a.op(_RET, eperm)
        a.label("socket_yes")
        a.op(_RET, _RET_ALLOW)

    arg_block("socket", 0, socket_body)

    def ioctl_body() -> None:  # not typing into a terminal; not naming who gets a descriptor's signals
        for cmd in (_TIOCSTI, _FIOSETOWN, _SIOCSPGRP):
            a.op(_JEQ, cmd, "ioctl_no", 0)
        a.op(_RET, _RET_ALLOW)
        a.label("ioctl_no")
        a.op(_RET, eperm)

    arg_block("ioctl", 1, ioctl_body)

    def fcntl_body() -> None:  # F_SETOWN/F_SETSIG: a signal sent to any process of the same user by I/O
        for cmd in (_F_SETOWN, _F_SETSIG, _F_SETOWN_EX):
            a.op(_JEQ, cmd, "fcntl_no", 0)
        a.op(_RET, _RET_ALLOW)
        a.label("fcntl_no")
        a.op(_RET, eperm)

    arg_block("fcntl", 1, fcntl_body)

    if task_pid is not None:
        def own_pid(label: str, zero_is_self: bool):
            def body() -> None:
                if zero_is_self:
                    a.op(_JEQ, 0, f"{label}_yes", 0)
                a.op(_JEQ, task_pid, f"{label}_yes", 0)
                a.op(_RET, eperm)
                a.label(f"{label}_yes")
                a.op(_RET, _RET_ALLOW)
            return body

        def prctl_body() -> None:  # not PR_SET_PDEATHSIG: a task process dies with its fork server
            a.op(_JEQ, _PR_SET_PDEATHSIG, 0, 1)
            a.op(_RET, eperm)
            a.op(_RET, _RET_ALLOW)

        def own_group(label: str):
            """A shell's signals: itself, its process group (0, -pid), and with Landlock's signal scope
            any one process (a positive pid: the kernel keeps it inside the sandbox); never -1 or
            another group."""
            def body() -> None:
                a.op(_JEQ, 0, f"{label}_yes", 0)
                a.op(_JEQ, task_pid, f"{label}_yes", 0)
                a.op(_JEQ, -task_pid, f"{label}_yes", 0)
                if signals_scoped:
                    a.op(_JSET, 0x80000000, 0, f"{label}_yes")  # not negative
                a.op(_RET, eperm)
                a.label(f"{label}_yes")
                a.op(_RET, _RET_ALLOW)
            return body

        arg_block("prctl", 0, prctl_body)
        signals = own_group if shell else (lambda label: own_pid(label, False))
        arg_block("kill", 0, signals("kill"))
        arg_block("tgkill", 0, signals("tgkill"))
        arg_block("rt_tgsigqueueinfo", 0, own_pid("rtsq", False))
        for name in ("prlimit64", "sched_setscheduler", "sched_setparam", "sched_setattr", "sched_setaffinity"):
            arg_block(name, 0, own_pid(name, True))
    a.op(_RET, _RET_ALLOW)
    return a.bytes()


_PR_SET_NO_NEW_PRIVS = 38
_SECCOMP_SET_MODE_FILTER = 1
_SECCOMP_FILTER_FLAG_TSYNC = 1


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install(code: bytes) -> None:
    """Load the filter into this process (every thread: ``TSYNC``); it cannot be removed."""
    machine = platform.machine()
    if machine not in _ARCHES:
        raise SeccompError(errno.ENOSYS, f"no system-call filter for {machine}")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        e = ctypes.get_errno()
        raise SeccompError(e, f"prctl(PR_SET_NO_NEW_PRIVS): {errno.errorcode.get(e, e)}")
    buf = ctypes.create_string_buffer(code, len(code))
    prog = _SockFprog(len(code) // 8, ctypes.cast(buf, ctypes.c_void_p))
    nr = _ARCHES[machine][2]
    libc.syscall.restype = ctypes.c_long
    if libc.syscall(ctypes.c_long(nr), ctypes.c_long(_SECCOMP_SET_MODE_FILTER),
                    ctypes.c_long(_SECCOMP_FILTER_FLAG_TSYNC), ctypes.byref(prog)) != 0:
        e = ctypes.get_errno()
        raise SeccompError(e, f"seccomp(SET_MODE_FILTER): {errno.errorcode.get(e, e)}")
