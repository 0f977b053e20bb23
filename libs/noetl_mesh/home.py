"""A local ``noetl up``'s home (``--home``, ``NOETL_HOME``, default ``.noetl``), and how the other
commands find the stack running there: ``noetl up`` describes itself in ``<home>/stack.json`` (its pid,
the gateway, NATS and monitoring URLs, the pids of what it started) while it runs."""
from __future__ import annotations

import json
import os
from typing import Any

DEFAULT_HOME = ".noetl"
STACK_FILE = "stack.json"
ADMIN_CREDS = os.path.join("nats-creds", "admin.nk")  # the NATS admin's seed, for tools (noetl ps, nats)


def home_dir(home: str | None = None) -> str:
    """``home``, else ``NOETL_HOME``, else ``.noetl`` (of the working directory), absolute."""
    return os.path.abspath(home or os.environ.get("NOETL_HOME") or DEFAULT_HOME)


def read_stack(home: str) -> dict[str, Any]:
    """What ``<home>/stack.json`` says (``{}`` when there is none or it is not a JSON object)."""
    try:
        with open(os.path.join(home, STACK_FILE)) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def running_stack(home: str | None = None) -> dict[str, Any] | None:
    """The description of the ``noetl up`` running from ``home`` (see :func:`home_dir`), None when none
    runs there (no ``stack.json``, or its process is gone: a killed stack)."""
    info = read_stack(home_dir(home))
    pid = info.get("pid")
    if not isinstance(pid, int) or not isinstance(info.get("gateway"), str) or not runs(pid, "noetl"):
        return None
    return info


DEFAULT_GATEWAY = "http://127.0.0.1:8082"


def gateway_url(home: str | None = None) -> str:
    """The gateway a command talks to when ``--gateway`` is not given: ``NOETL_GATEWAY_URL``, else the
    gateway of the ``noetl up`` running from the home, else ``http://127.0.0.1:8082``."""
    return os.environ.get("NOETL_GATEWAY_URL") or (running_stack(home) or {}).get("gateway") or DEFAULT_GATEWAY


def admin_creds(home: str | None = None) -> str | None:
    """The NATS admin's seed file of the home, when there is one."""
    path = os.path.join(home_dir(home), ADMIN_CREDS)
    return path if os.path.isfile(path) else None


def runs(pid: int, name: str) -> bool:
    """Whether process ``pid`` is alive and its command line mentions ``name`` (not a reused pid)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return name.encode() in f.read()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return not os.path.isdir("/proc")  # no /proc to tell: alive is all we know


class HomeLock:
    """One stack per home. ``noetl up`` holds an exclusive lock on ``<home>/stack.lock`` while it runs
    (the kernel releases it when the process ends, however it ends) and describes itself in
    ``<home>/stack.json`` (its pid, URLs and the pids of the servers and services it started), removed
    when it stops. A ``stack.json`` found with the lock free is a stack that was killed (SIGKILL)
    before it could stop its servers: :meth:`leftovers` names those still running."""

    def __init__(self, home: str):
        self.home = home
        self.lock_file = os.path.join(home, "stack.lock")
        self.info_file = os.path.join(home, STACK_FILE)
        self.fd: int | None = None
        self.recorded = False

    def acquire(self) -> str | None:
        """None when this process holds the lock now, else why it cannot."""
        import fcntl

        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            info = self.read()
            if not info.get("gateway"):
                return f"a noetl stack is already starting or running from {self.home} ({self.lock_file} is locked)"
            return (f"a noetl stack already runs from {self.home} (pid {info.get('pid')}): gateway {info['gateway']}, "
                    f"NATS {info.get('nats')}; use it ({finding(self.home)}), stop it "
                    f"(Ctrl-C where it runs, or kill {info.get('pid')}), or start another with --home DIR")
        self.fd = fd
        return None

    def read(self) -> dict:
        return read_stack(self.home)

    def record(self, info: dict) -> None:
        tmp = self.info_file + ".tmp"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump(info, f, indent=1)
        os.replace(tmp, self.info_file)
        self.recorded = True

    def leftovers(self) -> str | None:
        """Why a new stack cannot start here: processes of an earlier, killed one still running."""
        running = {}
        for name, pid in (self.read().get("pids") or {}).items():
            if isinstance(pid, int) and runs(pid, "nats-server" if name == "nats-server" else
                                              "postgres" if name == "postgres" else "noetl_mesh"):
                running[name] = pid
        try:
            with open(os.path.join(self.home, "pg", "postmaster.pid")) as f:
                pid = int(f.readline().strip())
            if runs(pid, "postgres"):
                running["postgres"] = pid
        except (OSError, ValueError):
            pass
        if not running:
            return None
        listed = ", ".join(f"{name} pid {pid}" for name, pid in running.items())
        return (f"processes of an earlier noetl up from {self.home} still run ({listed}): it was killed before it "
                f"could stop them; stop them (kill {' '.join(str(p) for p in running.values())}) and start again")

    def release(self) -> None:
        if self.fd is None:
            return
        if self.recorded:  # else it describes an earlier stack (leftovers): keep it
            try:
                os.unlink(self.info_file)
            except OSError:
                pass
        os.close(self.fd)  # releases the lock
        self.fd = None


def finding(home: str) -> str:
    """How other commands find the stack of ``home``."""
    if home_dir() == home:
        return "noetl commands run here find it"
    return f"noetl commands find it with --home {home} or NOETL_HOME={home}"
