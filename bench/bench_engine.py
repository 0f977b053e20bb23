"""End-to-end benchmarks of the distributed engine (docs/performance.md), every service in its own process, NATS and
Postgres embedded, the event log on. Prints a table; asserts nothing.

    python bench/bench_engine.py            # all four scenarios (a few minutes)
    python bench/bench_engine.py --quick    # small sizes, a smoke run
    python bench/bench_engine.py chain loop # some of: chain, burst, loop, child, recorder, run
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import orjson
import yaml

from noetl_mesh.client import FINAL, GatewayClient
from noetl_mesh.core.events import make_event, new_execution_id
from noetl_mesh.infra.bus import Bus
from noetl_mesh.infra.embedded import EmbeddedNats, provision_postgres
from noetl_mesh.infra.nats_auth import NatsAuth
from noetl_mesh.stack import ProcessStack, Settings


def chain(n: int) -> dict:
    steps = [{"step": f"s{i}", "tool": {"kind": "noop", "result": i},
              **({"next": {"arcs": [{"step": f"s{i + 1}"}]}} if i < n - 1 else {})} for i in range(n)]
    return {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "chain", "path": "bench/chain"},
            "workflow": steps}


def loop_playbook(n: int, in_flight: int) -> dict:
    return {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "loop", "path": "bench/loop"},
            "workflow": [{"step": "start", "loop": {"in": f"{{{{ range({n}) | list }}}}", "iterator": "i",
                                                     "spec": {"mode": "parallel", "max_in_flight": in_flight}},
                          "tool": {"kind": "noop", "result": "{{ iter.i }}"}}]}


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


TICKS = os.sysconf("SC_CLK_TCK")


def _cpu(pid: int) -> float:
    """CPU seconds (user + system) of a process and its reaped children, from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15]) / TICKS  # utime stime cutime cstime
    except OSError:
        return 0.0


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except OSError:
                pass
    return out


def cpu_by_process(procs: dict, nats, pg) -> dict[str, float]:
    """CPU seconds so far of each service process, of NATS, and of Postgres (the postmaster and its
    backends): sample before and after a scenario, and subtract."""
    out = {key: _cpu(proc.pid) for key, proc in procs.items()}
    if nats.pid:
        out["nats"] = _cpu(nats.pid)
    if getattr(pg, "pid", None):
        out["postgres"] = _cpu(pg.pid) + sum(_cpu(c) for c in _children(pg.pid))
    return out


def nats_counts(nats) -> dict[str, float]:
    """Messages each NATS connection has published (``in_msgs``, by connection name: one per service
    process) and received (``out_msgs``), and the JetStream API requests served: sample before and
    after a scenario, and subtract."""
    import json
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"{nats.monitor_url}/connz?limit=4096", timeout=5) as r:
        conns = json.load(r)["connections"]
    with opener.open(f"{nats.monitor_url}/jsz", timeout=5) as r:
        api = json.load(r).get("api", {}).get("total", 0)
    out: dict[str, float] = {"JetStream API requests": api}
    for c in conns:
        name = c.get("name") or c.get("authorized_user") or "?"
        out[f"published by {name}"] = out.get(f"published by {name}", 0) + c.get("in_msgs", 0)
        out[f"received by {name}"] = out.get(f"received by {name}", 0) + c.get("out_msgs", 0)
        out[f"bytes published by {name}"] = out.get(f"bytes published by {name}", 0) + c.get("in_bytes", 0)
        out[f"bytes received by {name}"] = out.get(f"bytes received by {name}", 0) + c.get("out_bytes", 0)
    return out


# The budget of a noop step (docs/performance.md): CPU across every process, CPU of each Python
# service's processes, NATS messages published by every connection
BUDGET_CPU_MS, BUDGET_SERVICE_MS, BUDGET_MESSAGES = 2.0, 0.35, 8.0


def over(value: float, budget: float | None) -> str:
    """`` (budget B: met)``, `` (budget B: N× over)``, or nothing without a budget."""
    if budget is None:
        return ""
    return f" (budget {budget:g}: {'met' if value <= budget else f'{value / budget:.1f}x over'})"


def count_rows(scenario: str, before: dict, after: dict, steps: int, budget: bool = False) -> list[tuple]:
    used = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    pub = sum(v for k, v in used.items() if k.startswith("published"))
    sent = sum(v for k, v in used.items() if k.startswith("bytes published"))
    rows = [(scenario, "NATS messages published per step, all connections"
             + over(pub / steps, BUDGET_MESSAGES if budget else None), f"{pub / steps:.1f}"),
            (scenario, "NATS bytes published per step, all connections", f"{sent / steps:,.0f}"),
            (scenario, "JetStream API requests per step", f"{used.get('JetStream API requests', 0) / steps:.1f}")]
    for key, n in sorted(used.items(), key=lambda kv: -kv[1]):
        if n and key != "JetStream API requests" and not key.startswith("bytes"):
            rows.append((scenario, f"messages per step {key}", f"{n / steps:.1f}"))
    for key, n in sorted(used.items(), key=lambda kv: -kv[1]):
        if n >= steps and key.startswith("bytes"):  # at least a byte per step
            rows.append((scenario, f"{key.replace('bytes ', 'bytes per step ')}", f"{n / steps:,.0f}"))
    return rows


def cpu_rows(scenario: str, before: dict, after: dict, steps: int, budget: bool = False) -> list[tuple]:
    """CPU seconds of every process and of each; ``budget``: each against a noop step's budget."""
    used = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    total = sum(used.values())
    per = total / steps * 1000
    rows = [(scenario, f"CPU seconds, all processes ({per:.2f} ms per step)"
             + over(per, BUDGET_CPU_MS if budget else None), f"{total:.1f}")]
    for key, sec in sorted(used.items(), key=lambda kv: -kv[1]):
        ms = sec / steps * 1000
        python = budget and not any(k in key for k in ("nats", "postgres"))  # the budget is the Python services'
        rows.append((scenario, f"CPU seconds {key}" + (f" ({ms:.2f} ms per step)" if budget else "")
                     + over(ms, BUDGET_SERVICE_MS if python else None), f"{sec:.2f}"))
    return rows


class RssSampler(threading.Thread):
    """Peak resident memory of each service process, sampled from /proc every 100 ms."""

    def __init__(self, procs: dict):
        super().__init__(daemon=True)
        self.procs, self.peak, self.stop_flag = procs, {}, False

    def run(self) -> None:
        while not self.stop_flag:
            for key, proc in self.procs.items():
                try:
                    with open(f"/proc/{proc.pid}/status") as f:
                        for line in f:
                            if line.startswith("VmRSS:"):
                                kb = int(line.split()[1])
                                self.peak[key] = max(self.peak.get(key, 0), kb)
                except OSError:
                    pass
            time.sleep(0.1)


async def run_one(client: GatewayClient, doc: dict, timeout: float = 600) -> tuple[dict, list[dict]]:
    eid = await client.start(doc)
    status = await client.wait(eid, timeout=timeout, poll=0.01)
    return status, await client.all_events(eid)


async def bench_chain(url: str, token: str, steps: int, rounds: int, nats_url: str | None = None,
                      creds: str | None = None) -> list[tuple]:
    per_step, hops, ids = [], [], []
    async with GatewayClient(url, token=token) as client:
        await run_one(client, chain(3))  # warm-up
        for _ in range(rounds):
            status, events = await run_one(client, chain(steps))
            assert status["status"] == "COMPLETED", status
            ids.append(events[0]["execution_id"])
            t = {(e["name"], e["step"]): e["timestamp"] for e in events}
            first = t[("step.admitted", "s0")]
            last = t[("step.done", f"s{steps - 1}")]
            per_step.append((last - first) / steps * 1000)
            for i in range(steps - 1):  # control-plane hop: step.done of one -> step.started of the next
                hops.append((t[("step.started", f"s{i + 1}")] - t[("step.done", f"s{i}")]) * 1000)
    rows = [("chain", f"{steps}-step noop chain x{rounds}: wall time per step p50", f"{statistics.median(per_step):.2f} ms"),
            ("chain", "step-to-step overhead (done -> next started) p50", f"{pct(hops, 50):.2f} ms"),
            ("chain", "step-to-step overhead p99", f"{pct(hops, 99):.2f} ms"),
            ("chain", "steps/s in one execution", f"{1000 / statistics.median(per_step):.0f}")]
    if nats_url:
        rows += await hop_anatomy(nats_url, creds, ids[-5:], steps)
    return rows


# the hops of one noop step, in order: (writer of the cause, its event) -> (writer of the effect, its event)
HOPS = [("worker", "step.done", "router", "token.enqueued"),
        ("router", "next.evaluated", "admission", "step.admitted"),
        ("admission", "step.scheduled", "worker", "step.started")]


async def hop_anatomy(nats_url: str, creds: str | None, ids: list[str], steps: int) -> list[tuple]:
    """Each hop of a chain step split in two, from the events stream: the cause's event created ->
    its message stored (JetStream's timestamp), and stored -> the effect's event created (delivery,
    the reader's work, and for the worker's hop the command's own publish after the events' PubAck)."""
    import nats
    from noetl_mesh.infra.nats_auth import connect_options

    nc = await nats.connect(nats_url, **connect_options(creds))
    js = nc.jetstream()
    parts: dict[tuple, list[float]] = {}
    try:
        for eid in ids:
            stored: dict[tuple, tuple[float, float]] = {}  # (event name, step) -> (created, stored)
            sub = await js.subscribe(f"noetl.pevt.*.*.{eid}.*", ordered_consumer=True, stream="NOETL_EVENTS")
            while True:
                try:
                    msg = await sub.next_msg(timeout=0.5)
                except Exception:  # noqa: BLE001 - the end of the execution's messages
                    break
                at = msg.metadata.timestamp.timestamp()
                for event in orjson.loads(msg.data):
                    stored.setdefault((event["name"], event.get("step")), (event["timestamp"], at))
            await sub.unsubscribe()
            for i in range(1, steps - 1):
                for cause_writer, cause, effect_writer, effect in HOPS:
                    cause_step = f"s{i - 1}" if cause in ("step.done", "next.evaluated") else f"s{i}"  # of the step that ended
                    a, b = stored.get((cause, cause_step)), stored.get((effect, f"s{i}"))
                    if a and b:
                        key = (cause_writer, cause, effect_writer, effect)
                        parts.setdefault(key + ("stored",), []).append((a[1] - a[0]) * 1000)
                        parts.setdefault(key + ("effect",), []).append((b[0] - a[1]) * 1000)
    finally:
        await nc.close()
    rows = []
    for cause_writer, cause, effect_writer, effect in HOPS:
        key = (cause_writer, cause, effect_writer, effect)
        if key + ("stored",) in parts:
            rows.append(("chain", f"hop {cause} -> {effect}: created -> stored / stored -> {effect} created, p50",
                         f"{pct(parts[key + ('stored',)], 50):.2f} / {pct(parts[key + ('effect',)], 50):.2f} ms"))
    return rows


async def bench_burst(url: str, token: str, executions: int, steps: int = 5, gateway_cpu=None,
                      done=None) -> list[tuple]:
    """``gateway_cpu``: the gateway process's CPU seconds so far (sampled around the submissions).
    The wait reads the executions' totals by status (one aggregate read every 0.2 s), not each
    execution's status, so that the CPU of the run is the engine's; ``done()`` is called once every
    execution has ended, before each one's status is read (the reads are the caller's to measure)."""
    doc = chain(steps)
    cpu0 = gateway_cpu() if gateway_cpu else 0.0
    sem = asyncio.Semaphore(64)
    async with GatewayClient(url, timeout=120, token=token) as client:
        since = time.time() - 0.5
        before = (await client.stats(since=since, buckets=1))["totals"]
        ended_before = sum(before.get(s, 0) for s in FINAL)
        t0 = time.perf_counter()

        async def submit() -> str:
            async with sem:
                return await client.start(doc)

        ids = await asyncio.gather(*(submit() for _ in range(executions)))
        submitted = time.perf_counter() - t0
        per_request = (gateway_cpu() - cpu0) / executions * 1000 if gateway_cpu else None
        while True:
            totals = (await client.stats(since=since, buckets=1))["totals"]
            if sum(totals.get(s, 0) for s in FINAL) - ended_before >= executions:
                break
            if time.perf_counter() - t0 > 900:
                raise TimeoutError(f"the burst has not ended after 900 s: {totals}")
            await asyncio.sleep(0.2)
        elapsed = time.perf_counter() - t0
        if done is not None:
            done()
        for eid in ids:
            status = await client.status(eid)
            assert status["status"] == "COMPLETED", status
        latencies = []
        for eid in ids[:: max(1, executions // 200)]:
            events = await client.all_events(eid)
            t = {e["name"]: e["timestamp"] for e in events}
            latencies.append((t["workflow.finished"] - t["playbook.execution.requested"]) * 1000)
    return [("burst", f"{executions} executions x {steps} noop steps: executions/s", f"{executions / elapsed:.1f}"),
            ("burst", "steps/s", f"{executions * steps / elapsed:.0f}"),
            ("burst", "submission through the gateway", f"{submitted:.1f} s"),
            *([("burst", "gateway CPU per accepted submission", f"{per_request:.2f} ms")] if per_request else []),
            ("burst", "end-to-end latency p50 / p99", f"{pct(latencies, 50):.0f} / {pct(latencies, 99):.0f} ms")]


async def bench_loop(url: str, token: str, n: int, in_flight: int, sampler: RssSampler) -> list[tuple]:
    async with GatewayClient(url, timeout=120, token=token) as client:
        t0 = time.perf_counter()
        eid = await client.start(loop_playbook(n, in_flight))
        status = await client.wait(eid, timeout=3600, poll=0.5)
        elapsed = time.perf_counter() - t0
    assert status["status"] == "COMPLETED", status["status"]
    assert status["steps"]["start"]["runs"] == 1
    rows = [("loop", f"parallel loop of {n} noop iterations (max_in_flight {in_flight})", f"{n / elapsed:.0f} iterations/s"),
            ("loop", "wall time", f"{elapsed:.1f} s")]
    for key, kb in sorted(sampler.peak.items()):
        rows.append(("loop", f"peak RSS {key}", f"{kb / 1024:.0f} MB"))
    return rows


CHILD = {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "child", "path": "bench/child"},
         "workflow": [{"step": "start", "tool": {"kind": "noop", "result": "{{ args.i }}"}}]}


async def bench_child(url: str, token: str, calls: int, fanout: int) -> list[tuple]:
    """Child executions: the round trip of a `playbook` task (task.started -> task.processed in the
    parent: suspend, request, the child's whole run, the notice, the resume) in a sequential chain, and
    children per second when a parallel loop calls one per iteration."""
    import yaml

    seq = {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "calls", "path": "bench/calls"},
           "workflow": [{"step": "start", "loop": {"in": f"{{{{ range({calls}) | list }}}}", "iterator": "i"},
                         "tool": {"kind": "playbook", "path": "bench/child", "args": {"i": "{{ iter.i }}"}}}]}
    fan = {**seq, "workflow": [{**seq["workflow"][0], "loop": {
        "in": f"{{{{ range({fanout}) | list }}}}", "iterator": "i", "spec": {"mode": "parallel", "max_in_flight": 64}}}]}
    async with GatewayClient(url, timeout=120, token=token) as client:
        await client.register(yaml.safe_dump(CHILD))
        await run_one(client, {**seq, "workflow": [{**seq["workflow"][0], "loop": {"in": "{{ [1] }}", "iterator": "i"}}]})
        status, events = await run_one(client, seq)
        assert status["status"] == "COMPLETED", status
        started = {e["iteration"]: e["timestamp"] for e in events if e["name"] == "task.started"}
        trips = [(e["timestamp"] - started[e["iteration"]]) * 1000 for e in events if e["name"] == "task.processed"]
        gaps = await child_anatomy(client, events, list(started)[calls // 2:][:20])
        t0 = time.perf_counter()
        status, _ = await run_one(client, fan)
        elapsed = time.perf_counter() - t0
        assert status["status"] == "COMPLETED" and len(status["steps"]["start"]["result"]) == fanout, status
    return [("child", f"playbook task round trip ({calls} sequential children) p50", f"{pct(trips, 50):.1f} ms"),
            ("child", "playbook task round trip p99", f"{pct(trips, 99):.1f} ms"),
            *gaps,
            ("child", f"{fanout} children from a parallel loop (max_in_flight 64)", f"{fanout / elapsed:.0f} children/s")]


async def child_anatomy(client: GatewayClient, events: list[dict], iterations: list) -> list[tuple]:
    """Where a round trip's time goes: the parent's and the child's events of each sampled call merged in
    time order, and the median gap before each event (the gaps of 0.3 ms and more; the rest is the
    services' own work between two events of one decision)."""
    gaps: dict[str, list[float]] = {}
    for iteration in iterations:
        mine = [e for e in events if e.get("iteration") == iteration and e["name"].startswith("task.")]
        child = next((((e.get("data") or {}).get("child") or {}) for e in mine if e["name"] == "task.suspended"), {})
        child_id = child.get("execution_id") if isinstance(child, dict) else child
        if not isinstance(child_id, str):
            continue
        start = next(e["timestamp"] for e in mine if e["name"] == "task.started")
        end = next(e["timestamp"] for e in mine if e["name"] == "task.processed")
        notice = [e for e in events if e["name"] == "playbook.child.finished"
                  and (e.get("data") or {}).get("child_execution_id") == child_id]
        merged = sorted([("parent", e) for e in mine + notice] + [("child", e) for e in await client.all_events(child_id)],
                        key=lambda we: we[1]["timestamp"])
        previous = None
        for who, e in merged:
            if not start <= e["timestamp"] <= end:
                continue
            if previous is not None:
                key = f"{previous[0]} {previous[1]['name']} -> {who} {e['name']} ({e['source']})"
                gaps.setdefault(key, []).append((e["timestamp"] - previous[1]["timestamp"]) * 1000)
            previous = (who, e)
    return [("child", f"gap {key}, p50", f"{statistics.median(v):.2f} ms")
            for key, v in gaps.items() if len(v) >= len(iterations) // 2 and statistics.median(v) >= 0.3]


async def bench_recorder(nats, pg, pg_dsn: str, n: int, auth: NatsAuth, creds: str, recorders: int) -> list[tuple]:
    """``n`` events (one per message, a worst case) published first, then drained by ``recorders``
    recorder processes started together. The rate is measured between 20% and 80% recorded, once the
    processes have started and dealt the partitions out."""
    bus = await Bus.connect(nats.url, "bench", auth.admin)
    await bus.setup()
    eids = [new_execution_id() for _ in range(max(1, n // 100))]
    for start in range(0, n, 1000):  # one event per message, as a worst case for the recorder
        futures = [await bus.send_events([make_event("task.processed", eids[i % len(eids)], event_id=f"bench-{i}",
                                                      source="worker:bench", data={"outcome": {"status": "ok", "result": i}})])
                   for i in range(start, min(n, start + 1000))]
        await asyncio.gather(*futures)
    await bus.close()
    import psycopg

    stack = ProcessStack(Settings(nats_url=nats.url, pg_dsn=pg_dsn, nats_creds=creds))
    before = cpu_by_process({}, nats, pg)
    t0 = time.perf_counter()
    for i in range(recorders):
        stack.spawn("event-recorder", f"event-recorder-{i}")
    marks: dict[float, float] = {}
    try:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
            while True:
                try:
                    done = (await (await conn.execute("select count(*) from event where source = 'worker:bench'")).fetchone())[0]
                except psycopg.errors.UndefinedTable:  # not migrated yet
                    done = 0
                now = time.perf_counter()
                for share in (0.2, 0.8, 1.0):
                    if done >= share * n and share not in marks:
                        marks[share] = now
                if done >= n:
                    break
                await asyncio.sleep(0.05)
        after = {**cpu_by_process(stack.procs, nats, pg)}
        before.update({key: 0.0 for key in stack.procs})
    finally:
        await stack.stop()
    print(f"  [recorder] 20% at {marks[0.2] - t0:.1f} s, 80% at {marks[0.8] - t0:.1f} s, all at {marks[1.0] - t0:.1f} s")
    rate = 0.6 * n / (marks[0.8] - marks[0.2])
    label = f"{recorders} recorder process{'es' if recorders > 1 else ''}"
    return ([("recorder", f"{n} events drained by {label}, 20% to 80%", f"{rate:.0f} events/s"),
             ("recorder", f"the same, from the processes' start to the last", f"{n / (marks[1.0] - t0):.0f} events/s")]
            + [(s, m.replace("per step", "per event").replace("ms per", "µs per"), v)
               for s, m, v in cpu_rows("recorder", before, after, n / 1000)])


class Rows(list):
    """Rows of the result table; each is also printed as soon as it is measured."""

    def __iadd__(self, new):
        for scenario, measure, value in new:
            print(f"  [{scenario}] {measure}: {value}", flush=True)
        self.extend(new)
        return self

    def table(self) -> None:
        width = max(len(r[1]) for r in self)
        print(f"\n{'scenario':<9} {'measure':<{width}}  value")
        for scenario, measure, value in self:
            print(f"{scenario:<9} {measure:<{width}}  {value}")


def bench_run(times: int) -> Rows:
    """``noetl run examples/hello.yaml`` from the shell: the wall time of the whole command (its own NATS
    and Postgres, every service, the playbook, the stop). The first run also makes the Postgres template."""
    import subprocess

    example = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "hello.yaml")
    walls = []
    for _ in range(times + 1):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "noetl_mesh.cli", "run", example], check=True, capture_output=True)
        walls.append(time.perf_counter() - started)
    first, rest = walls[0], sorted(walls[1:])
    return Rows([("run", "noetl run examples/hello.yaml, wall p50 / min", f"{statistics.median(rest):.2f} / {rest[0]:.2f} s"),
                 ("run", "the first of them", f"{first:.2f} s")])


async def main(args: argparse.Namespace) -> None:
    which = set(args.which or ["chain", "burst", "loop", "child", "recorder", "run"])
    quick = args.quick
    rows = Rows()
    creds = tempfile.mkdtemp(prefix="noetl-bench-creds-")
    auth = NatsAuth(creds).ensure()  # one NATS user per service, as deployed: permissions are on the hot path
    nats = EmbeddedNats(auth=auth).start()
    pg = provision_postgres(fast=True)
    try:
        if which & {"chain", "burst", "loop", "child"}:
            dsn = pg.create_database("bench_stack")
            stack = ProcessStack(Settings(nats_url=nats.url, pg_dsn=dsn, concurrency=args.concurrency, nats_creds=creds),
                                 workers=args.workers, replicas=args.replicas, log_dir=args.log_dir)
            if args.log_dir:
                os.makedirs(args.log_dir, exist_ok=True)
            await stack.start()
            if args.replicas > 1:
                await asyncio.sleep(3)  # replicas share the partitions out (membership settles in ~2 s)
            sampler = RssSampler(stack.procs)
            sampler.start()
            try:
                if "chain" in which:
                    rows += await bench_chain(stack.gateway_url, stack.token, 20, 3 if quick else 20, nats.url, auth.admin)
                if "burst" in which:
                    n = 50 if quick else 1000
                    before, counts = cpu_by_process(stack.procs, nats, pg), nats_counts(nats)
                    ended = []
                    rows += await bench_burst(stack.gateway_url, stack.token, n,
                                              gateway_cpu=lambda: _cpu(stack.procs["gateway"].pid),
                                              done=lambda: ended.append((cpu_by_process(stack.procs, nats, pg),
                                                                         nats_counts(nats))))
                    rows += cpu_rows("burst", before, ended[0][0], n * 5, budget=True)
                    rows += count_rows("burst", counts, ended[0][1], n * 5, budget=True)
                    reads = sum(cpu_by_process(stack.procs, nats, pg).values()) - sum(ended[0][0].values())
                    rows += [("burst", "then each execution's status read once, and 200 executions' events:"
                              " CPU per execution, all processes", f"{reads / n * 1000:.2f} ms")]
                if "child" in which:
                    rows += await bench_child(stack.gateway_url, stack.token, 20 if quick else 100, 100 if quick else 1000)
                if "loop" in which:
                    sampler.peak.clear()
                    n = 2000 if quick else 100_000
                    before, counts = cpu_by_process(stack.procs, nats, pg), nats_counts(nats)
                    rows += await bench_loop(stack.gateway_url, stack.token, n, 256, sampler)
                    rows += [(s, m.replace("per step", "per iteration"), v)
                             for s, m, v in cpu_rows("loop", before, cpu_by_process(stack.procs, nats, pg), n)
                             + count_rows("loop", counts, nats_counts(nats), n)]
            finally:
                sampler.stop_flag = True
                await stack.stop()
        if "recorder" in which:
            rows += await bench_recorder(nats, pg, pg.create_database("bench_recorder"), 5000 if quick else 100_000,
                                         auth, creds, args.recorders)
    finally:
        violations = nats.violations()
        nats.stop()
        pg.stop()
        shutil.rmtree(creds, ignore_errors=True)
    if violations:
        print("NATS permission violations:", *violations, sep="\n  ")
    if "run" in which:
        rows += bench_run(2 if quick else 5)
    rows.table()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("which", nargs="*", choices=["chain", "burst", "loop", "child", "recorder", "run", []], default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--replicas", type=int, default=1, help="replicas of admission, router, loop-coordinator")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--recorders", type=int, default=1, help="recorder processes of the recorder scenario")
    parser.add_argument("--log-dir")
    asyncio.run(main(parser.parse_args()))
