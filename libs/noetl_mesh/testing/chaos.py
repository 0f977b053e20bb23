"""A chaos run: a mixed load on a stack of one process per service while services and workers are
killed at random (SIGKILL), NATS is restarted and Postgres is stopped for a while; afterwards every
execution's log is checked (:mod:`noetl_mesh.core.verify`) and its outcome compared with the in-process
reference engine's for the same playbook and workload.

Used by ``tests/integration/test_chaos.py`` (a short run) and ``bench/chaos.py`` (the long one).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ..client import GatewayClient, GatewayError
from ..core.local import run_local
from ..core.state import FINAL, summary
from ..core.verify import Report, verify
from ..infra.embedded import EmbeddedNats, EmbeddedPostgres
from ..infra.nats_auth import NatsAuth
from ..stack import ProcessStack, Settings, free_port

log = logging.getLogger("noetl.chaos")


def _doc(name: str, workflow: list[dict], workload: dict | None = None) -> dict:
    return {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": name, "path": f"chaos/{name}"},
            "workload": workload or {}, "workflow": workflow}


def _sleepy(seconds: float, result: str) -> dict:
    return {"kind": "python", "args": {"s": seconds}, "code": f"import time\ntime.sleep(s)\nresult = {result}"}


# Deterministic playbooks (no clock, no randomness): their outcome is the reference engine's.
PLAYBOOKS: dict[str, dict] = {
    "chain": _doc("chain", [
        {"step": "start", "tool": {"kind": "noop", "result": "{{ workload.n }}"}, "next": {"arcs": [{"step": "s1"}]}},
        {"step": "s1", "tool": _sleepy(0.2, "s * 10"), "next": {"arcs": [{"step": "s2", "args": {"v": "{{ event.result }}"}}]}},
        {"step": "s2", "tool": {"kind": "noop", "result": "{{ args.v + start.result }}"},
         "next": {"arcs": [{"step": "s3"}]}},
        {"step": "s3", "tool": [{"name": "a", "kind": "noop", "result": "{{ s2.result }}"},
                                {"name": "b", "kind": "noop", "result": "{{ a.result * 2 }}",
                                 "spec": {"policy": {"rules": [{"else": {"then": {"do": "continue",
                                                                                   "set_ctx": {"b": "{{ outcome.result }}"}}}}]}}}]},
    ], {"n": 1}),
    "fork_join": _doc("fork_join", [
        {"step": "start", "next": {"spec": {"mode": "inclusive"}, "arcs": [
            {"step": "a", "args": {"k": 1}}, {"step": "b"}, {"step": "c", "when": "{{ workload.take_c }}"}]}},
        {"step": "a", "tool": _sleepy(0.1, "'A'"), "next": {"arcs": [{"step": "join", "args": {"a": "{{ event.result }}"}}]}},
        {"step": "b", "tool": {"kind": "noop", "result": "B"}, "next": {"arcs": [{"step": "join", "args": {"b": "{{ event.result }}"}}]}},
        {"step": "c", "tool": {"kind": "noop", "result": "C"}, "next": {"arcs": [{"step": "join", "args": {"c": "{{ event.result }}"}}]}},
        {"step": "join", "tool": {"kind": "noop", "result": "{{ args }}"}},
    ], {"take_c": True}),
    "parallel_loop": _doc("parallel_loop", [
        {"step": "start", "loop": {"in": "{{ range(workload.n) | list }}", "iterator": "x",
                                   "spec": {"mode": "parallel", "max_in_flight": 4}},
         "tool": [{"name": "square", "kind": "noop", "result": "{{ iter.x * iter.x }}"},
                  {"name": "slow", "kind": "python", "args": {"v": "{{ square.result }}"},
                   "code": "import time\ntime.sleep(0.02)\nresult = v + 1"}],
         "next": {"arcs": [{"step": "total", "args": {"values": "{{ event.result }}"}}]}},
        {"step": "total", "tool": {"kind": "noop", "result": "{{ args['values'] | sum }}"}},
    ], {"n": 24}),
    "sequential_loop": _doc("sequential_loop", [
        {"step": "start", "loop": {"in": "{{ workload.items }}", "iterator": "item"},
         "tool": {"kind": "noop", "result": "{{ iter.item | upper }}"}},
    ], {"items": ["a", "b", "c", "d", "e"]}),
    "retry": _doc("retry", [
        {"step": "start", "tool": {"kind": "python", "args": {"attempt": "{{ _attempt }}"},
                                   "code": "if attempt < 3:\n    raise ValueError('not yet')\nresult = attempt",
                                   "spec": {"policy": {"rules": [
                                       {"when": "{{ outcome.status == 'error' }}",
                                        "then": {"do": "retry", "attempts": 4, "delay": 0.05}}]}}}},
    ]),
    "best_effort": _doc("best_effort", [
        {"step": "start", "next": {"spec": {"mode": "inclusive"}, "arcs": [{"step": "bad"}, {"step": "good"}]}},
        {"step": "bad", "spec": {"policy": {"failure": {"mode": "best_effort"}}},
         "tool": {"kind": "python", "code": "raise RuntimeError('expected')"}, "next": {"arcs": [{"step": "never"}]}},
        {"step": "good", "tool": _sleepy(0.1, "'fine'")},
        {"step": "never", "tool": {"kind": "noop"}},
    ]),
    "fail_fast": _doc("fail_fast", [
        {"step": "start", "tool": {"kind": "noop", "result": 1}, "next": {"arcs": [{"step": "boom"}]}},
        {"step": "boom", "tool": {"kind": "python", "code": "raise KeyError('gone')"}, "next": {"arcs": [{"step": "after"}]}},
        {"step": "after", "tool": {"kind": "noop"}},
    ]),
}


@dataclass
class ChaosConfig:
    executions: int = 20
    kills: int = 6
    nats_restarts: int = 1
    pg_outages: int = 1
    pg_outage_s: float = 3.0
    duration_s: float = 12.0  # the window over which the faults are spread
    workers: int = 2
    replicas: int = 1
    seed: int = 0
    finish_timeout_s: float = 180.0


@dataclass
class ChaosResult:
    submitted: dict[str, str] = field(default_factory=dict)  # execution id -> playbook name
    finals: dict[str, dict] = field(default_factory=dict)
    reports: dict[str, Report] = field(default_factory=dict)
    mismatches: dict[str, str] = field(default_factory=dict)  # execution id -> how it differs from the reference
    faults: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)  # NATS permission violations (none expected)
    events: int = 0
    seconds: float = 0.0
    stuck: list[str] = field(default_factory=list)  # for unfinished executions: their last events, the consumers

    @property
    def unfinished(self) -> list[str]:
        return [x for x in self.submitted if (self.finals.get(x) or {}).get("status") not in FINAL]

    @property
    def ok(self) -> bool:
        return (not self.unfinished and not self.mismatches and not self.violations
                and all(r.ok for r in self.reports.values()))

    def describe(self) -> str:
        lines = [f"{len(self.submitted)} executions, {self.events} events, faults: {', '.join(self.faults)} "
                 f"({self.seconds:.1f} s)"]
        lines += [f"unfinished: {x} ({self.submitted[x]})" for x in self.unfinished]
        lines += [f"{x} ({self.submitted[x]}): {f.check}: {f.message}" for x, r in self.reports.items() for f in r.findings]
        lines += [f"{x} ({self.submitted[x]}) differs from the reference: {m}" for x, m in self.mismatches.items()]
        lines += [f"NATS: {v}" for v in self.violations]
        lines += self.stuck
        return "\n".join(lines)


async def _retrying(call, *args, attempts: int = 600, **kw):
    """A gateway call through the faults: retried on 5xx and connection errors."""
    for i in range(attempts):
        try:
            return await call(*args, **kw)
        except GatewayError as exc:
            if exc.status < 500 or i == attempts - 1:
                raise
        except (httpx.TransportError, OSError):
            if i == attempts - 1:
                raise
        await asyncio.sleep(0.2)


async def run_chaos(cfg: ChaosConfig, workdir: str | Path) -> ChaosResult:
    workdir = Path(workdir)
    rng = random.Random(cfg.seed)
    result = ChaosResult()
    started = time.monotonic()
    nats_port = free_port()
    auth = NatsAuth(workdir / "nats-creds").ensure()  # one user per service, as deployed
    nats = EmbeddedNats(store_dir=workdir / "nats", port=nats_port, log_path=workdir / "nats.log", auth=auth).start()
    pg_root = Path(tempfile.mkdtemp(prefix="noetl-chaos-pg-"))  # the postgres user must reach it
    pg_root.chmod(0o755)
    pg = EmbeddedPostgres(data_dir=pg_root / "data", port=free_port(), fast=True).start()
    env = {"NOETL_CONTROL_ACK_WAIT": "3"}
    old_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    stack = ProcessStack(Settings(nats_url=nats.url, pg_dsn=pg.dsn("postgres"), ack_wait=3.0, concurrency=4,
                                  nats_creds=str(auth.directory)),
                         replicas=cfg.replicas, workers=cfg.workers, log_dir=str(workdir), supervise=True)
    try:
        await stack.start()
        async with GatewayClient(stack.gateway_url, timeout=10, token=stack.token) as client:
            names = list(PLAYBOOKS)
            plan = [names[i % len(names)] for i in range(cfg.executions)]
            rng.shuffle(plan)
            faults = asyncio.create_task(_faults(cfg, rng, stack, nats, pg, result))
            for i, name in enumerate(plan):
                xid = await _retrying(client.start, PLAYBOOKS[name])
                result.submitted[xid] = name
                await asyncio.sleep(cfg.duration_s / max(1, cfg.executions) * 0.8)
            await faults
            deadline = time.monotonic() + cfg.finish_timeout_s
            pending = set(result.submitted)
            while pending and time.monotonic() < deadline:
                for xid in list(pending):
                    with contextlib.suppress(GatewayError, httpx.TransportError, OSError):
                        status = await client.status(xid, brief=True)
                        if status["status"] in FINAL:
                            pending.discard(xid)
                await asyncio.sleep(0.5)
            for xid in result.submitted:
                result.finals[xid] = await _retrying(client.status, xid)
                events = await _retrying(client.all_events, xid)
                result.events += len(events)
                result.reports[xid] = verify(events, xid)
                if xid in pending:
                    result.stuck.append(f"{xid} ended with: " + ", ".join(
                        f"{e.get('name')}:{e.get('step') or ''}" for e in events[-12:]))
            if pending:
                result.stuck += await _consumers(nats.url, auth)
        await _compare(result)
    finally:
        await stack.stop()
        result.violations = nats.violations()
        nats.stop()
        pg.stop()
        shutil.rmtree(pg_root, ignore_errors=True)
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    result.seconds = time.monotonic() - started
    return result


async def busy_consumers(js: Any) -> list[str]:
    """The consumers of the events and commands streams that hold or wait for something, or that no
    reader asks (``waiting 0``: a reader that stopped), a line each: where a stuck execution stands."""
    from ..infra.bus import COMMANDS, EVENTS

    out = []
    for stream in (EVENTS, COMMANDS):
        for c in await asyncio.wait_for(js.consumers_info(stream), 30):
            if c.num_pending or c.num_ack_pending or not c.num_waiting:
                out.append(f"consumer {c.name}: pending {c.num_pending} ack_pending {c.num_ack_pending} "
                           f"redelivered {c.num_redelivered} waiting {c.num_waiting} "
                           f"delivered {c.delivered.stream_seq} floor {c.ack_floor.stream_seq} "
                           f"leader {c.cluster.leader if c.cluster else None}")
    return out


async def _consumers(url: str, auth: NatsAuth) -> list[str]:
    from ..infra.bus import Bus

    try:
        bus = await asyncio.wait_for(Bus.connect(url, "chaos-probe", auth.admin), 30)
        try:
            return await busy_consumers(bus.js)
        finally:
            await bus.close()
    except Exception as exc:  # noqa: BLE001 - a diagnosis, best effort
        return [f"consumers not read: {type(exc).__name__}: {exc}"]


async def _faults(cfg: ChaosConfig, rng: random.Random, stack: ProcessStack, nats: EmbeddedNats,
                  pg: EmbeddedPostgres, result: ChaosResult) -> None:
    kinds = ["kill"] * cfg.kills + ["nats"] * cfg.nats_restarts + ["pg"] * cfg.pg_outages
    rng.shuffle(kinds)
    gap = cfg.duration_s / max(1, len(kinds) + 1)
    for kind in kinds:
        await asyncio.sleep(gap * rng.uniform(0.5, 1.5))
        if kind == "kill":
            key = rng.choice(sorted(k for k, p in stack.procs.items() if p.poll() is None))
            with contextlib.suppress(ProcessLookupError):
                os.kill(stack.procs[key].pid, signal.SIGKILL)
            result.faults.append(f"kill {key}")
        elif kind == "nats":
            await asyncio.to_thread(nats.stop)
            await asyncio.sleep(1.0)
            await asyncio.to_thread(nats.start)
            result.faults.append("NATS restart")
        else:
            await asyncio.to_thread(pg.stop)
            await asyncio.sleep(cfg.pg_outage_s)
            await asyncio.to_thread(pg.start)
            result.faults.append(f"Postgres down {cfg.pg_outage_s:g} s")


def _outcome(s: dict) -> dict:
    return {"status": s["status"], "steps": {k: {"status": v["status"], "runs": v["runs"], "result": v["result"]}
                                             for k, v in s["steps"].items()}, "ctx": s.get("ctx") or {}}


async def _compare(result: ChaosResult) -> None:
    """Each execution's outcome equals the reference engine's for its playbook (computed once each)."""
    from ..tools import close_tools, default_tools

    reference: dict[str, dict] = {}
    tools = default_tools()
    try:
        for name in set(result.submitted.values()):
            reference[name] = _outcome(summary((await run_local(PLAYBOOKS[name], tools=tools)).state))
    finally:
        await close_tools(tools)
    for xid, name in result.submitted.items():
        final = result.finals.get(xid) or {}
        if final.get("status") not in FINAL:
            continue
        got = _outcome(final)
        if got != reference[name]:
            result.mismatches[xid] = f"got {got}, expected {reference[name]}"
