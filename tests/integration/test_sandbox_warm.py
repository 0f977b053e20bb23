"""A worker starts the fork servers of its sandboxed task kinds ahead of their first task
(NOETL_SANDBOX_WARM, default every kind), so a playbook's first duckdb task does not wait for one."""
from __future__ import annotations

import time

import pytest

from noetl_mesh.sandbox.supervisor import PRELOAD

from conftest import start_stack, stop_stack

pytestmark = pytest.mark.integration


def started_kinds(handle, settle: float) -> set[str]:
    """The kinds whose fork servers the stack's worker runs, once every kind it may start is up (or
    ``settle`` seconds after python's, for a kind it must not start)."""
    [worker] = handle.stack.services("worker")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "python" not in worker.sandbox._servers:
        time.sleep(0.05)
    until = time.monotonic() + settle
    while time.monotonic() < until and set(worker.sandbox._servers) != set(PRELOAD):
        time.sleep(0.05)
    return set(worker.sandbox._servers)


@pytest.mark.parametrize("warm, expected", [(None, set(PRELOAD)), ("python", {"python"})])
def test_a_worker_starts_its_fork_servers_ahead(pg_dsn, monkeypatch, warm, expected):
    if warm is None:
        monkeypatch.delenv("NOETL_SANDBOX_WARM", raising=False)
    else:
        monkeypatch.setenv("NOETL_SANDBOX_WARM", warm)
    nats, loop, handle = start_stack(pg_dsn)
    try:
        assert started_kinds(handle, settle=60 if warm is None else 3) == expected
    finally:
        stop_stack(nats, loop, handle)
