"""Executions for the container tests: the chaos run's deterministic playbooks (noetl_mesh.testing.chaos)
and a slower loop that keeps the workers busy while faults happen, started through the stack's proxy;
their final states compared with the in-process reference engine's outcome for the same playbook."""
from __future__ import annotations

import asyncio
import contextlib
import time

import httpx

from noetl_mesh.client import GatewayClient, GatewayError
from noetl_mesh.core.state import FINAL
from noetl_mesh.testing.chaos import PLAYBOOKS as CHAOS, ChaosResult, _outcome

# a parallel loop whose iterations take 1.5 s each: commands in flight on every worker at any moment
SLOW_LOOP = {
    "apiVersion": "noetl.io/v2", "kind": "Playbook",
    "metadata": {"name": "slow_loop", "path": "tests/containers/slow_loop"}, "workload": {"n": 6},
    "workflow": [
        {"step": "start", "loop": {"in": "{{ range(workload.n) | list }}", "iterator": "x",
                                   "spec": {"mode": "parallel", "max_in_flight": 3}},
         "tool": {"kind": "python", "args": {"x": "{{ iter.x }}"}, "code": "import time\ntime.sleep(1.5)\nresult = x * 3"},
         "next": {"arcs": [{"step": "total", "args": {"values": "{{ event.result }}"}}]}},
        {"step": "total", "tool": {"kind": "noop", "result": "{{ args['values'] | sum }}"}},
    ],
}
PLAYBOOKS = {**CHAOS, "slow_loop": SLOW_LOOP}
_reference: dict[str, dict] = {}


def mix(n: int) -> list[str]:
    """n playbook names: every third the slow loop, the others the chaos run's in turn."""
    names = sorted(CHAOS)
    return ["slow_loop" if i % 3 == 0 else names[i % len(names)] for i in range(n)]


async def load(token: str, url: str, names: list[str], gap: float, faults=None, *, ca: str) -> dict[str, str]:
    """Start ``names`` one every ``gap`` seconds, calling ``faults(i)`` before the i-th; gateway errors
    and dropped connections (a fault's doing) are retried. Answers execution id -> playbook name. ``ca``:
    the stack's CA, which the proxy's certificate is verified against."""
    started: dict[str, str] = {}
    async with GatewayClient(url, timeout=10, token=token, ca=ca) as client:
        for i, name in enumerate(names):
            if faults:
                await faults(i)
            for attempt in range(300):
                try:
                    started[await client.start(PLAYBOOKS[name])] = name
                    break
                except (GatewayError, httpx.TransportError, OSError) as exc:
                    if isinstance(exc, GatewayError) and exc.status < 500 or attempt == 299:
                        raise
                    await asyncio.sleep(0.2)
            await asyncio.sleep(gap)
    return started


async def finish(token: str, url: str, ids: dict[str, str], timeout: float = 300, *, ca: str) -> ChaosResult:
    """Wait until every execution has ended (or ``timeout``); their final states, each compared with
    the reference engine's outcome (ChaosResult: unfinished, mismatches, describe())."""
    result = ChaosResult(submitted=dict(ids))
    pending = set(ids)
    deadline = time.monotonic() + timeout
    async with GatewayClient(url, timeout=10, token=token, ca=ca) as client:
        while pending and time.monotonic() < deadline:
            for xid in list(pending):
                with contextlib.suppress(GatewayError, httpx.TransportError, OSError):
                    if (await client.status(xid, brief=True))["status"] in FINAL:
                        pending.discard(xid)
            await asyncio.sleep(0.5)
        for xid in ids:
            result.finals[xid] = await client.status(xid)
    for xid, name in ids.items():
        final = result.finals[xid]
        if final.get("status") in FINAL and _outcome(final) != await reference(name):
            result.mismatches[xid] = f"got {_outcome(final)}, expected {await reference(name)}"
    return result


async def reference(name: str) -> dict:
    """The in-process reference engine's outcome of a playbook (once per name)."""
    if name not in _reference:
        from noetl_mesh.core.local import run_local
        from noetl_mesh.core.state import summary
        from noetl_mesh.tools import close_tools, default_tools

        tools = default_tools()
        try:
            _reference[name] = _outcome(summary((await run_local(PLAYBOOKS[name], tools=tools)).state))
        finally:
            await close_tools(tools)
    return _reference[name]


async def executions(token: str, url: str, *, ca: str) -> list[dict]:
    async with GatewayClient(url, timeout=30, token=token, ca=ca) as client:
        return await client.list_executions(all_pages=True)
