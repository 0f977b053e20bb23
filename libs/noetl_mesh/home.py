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
