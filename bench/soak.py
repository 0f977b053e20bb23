"""The soak: mixed playbooks at a steady rate for a long while, on a stack of one process per service, with
the machine loaded beside it; it must never stall (docs/performance.md, "Soak").

    python bench/soak.py                    # 30 minutes at 70 % of the measured maximum, one CPU burner beside
    python bench/soak.py --minutes 3        # a short run
    python bench/soak.py --rate 5 --load 0  # a fixed rate (executions/s), no burner

First a calibration: executions started as fast as the stack finishes them (at most ``--in-flight`` at
once) for ``--calibrate`` seconds gives the maximum rate, and each playbook's usual time (its median).
Then the soak starts the mix at ``--share`` of that rate. Every second, the executions still running are
looked at: one running longer than ``--stuck-factor`` times its playbook's usual time (at least
``--stuck-floor`` s) is stuck, reported once with its last events and the consumers' state (as the chaos
run does). Each minute prints a line: executions finished, their latency p50/p99, and each process's
RSS. Exits 1 when an execution was stuck or did not end within the drain time.

The mix: the chaos run's deterministic playbooks (a chain with a python step, a fork/join, a parallel and
a sequential loop, a retry, best effort and fail fast), a child execution, a wait answered by a signal,
and a retry whose delay runs through the timers.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from noetl_mesh.client import GatewayClient, GatewayError
from noetl_mesh.core.state import FINAL
from noetl_mesh.infra.embedded import EmbeddedNats, EmbeddedPostgres
from noetl_mesh.infra.nats_auth import NatsAuth
from noetl_mesh.stack import ProcessStack, Settings, free_port
from noetl_mesh.testing.chaos import PLAYBOOKS, _consumers, _doc

ROOT = Path(__file__).resolve().parents[1]

MIX: dict[str, dict] = {
    **PLAYBOOKS,
    "child": (ROOT / "examples" / "nested.yaml").read_text(),
    "signal": _doc("signal", [
        {"step": "start", "tool": [{"name": "approve", "kind": "wait", "signal": "go", "timeout": "1h"}],
         "next": {"arcs": [{"step": "after", "args": {"ok": "{{ event.result }}"}}]}},
        {"step": "after", "tool": {"kind": "noop", "result": "{{ args.ok }}"}},
    ]),
    "timer": _doc("timer", [
        {"step": "start", "tool": {"kind": "python", "args": {"attempt": "{{ _attempt }}"},
                                   "code": "if attempt < 2:\n    raise ValueError('later')\nresult = attempt",
                                   "spec": {"policy": {"rules": [
                                       {"when": "{{ outcome.status == 'error' }}",
                                        "then": {"do": "retry", "attempts": 3, "delay": 1}}]}}}},
    ]),
}


def burn() -> None:  # the load beside the soak: one busy process per --load
    while True:
        pass


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))] if values else float("nan")


def rss_mb(pid: int | None) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration, TypeError):
        return 0.0


class Soak:
    def __init__(self, client: GatewayClient, args: argparse.Namespace, nats_url: str, auth: NatsAuth):
        self.client, self.args, self.nats_url, self.auth = client, args, nats_url, auth
        self.running: dict[str, tuple[str, float]] = {}  # execution id -> (playbook, started)
        self.durations: dict[str, list[float]] = {name: [] for name in MIX}
        self.finished: list[tuple[float, float, str]] = []  # (when, seconds, status)
        self.stuck: dict[str, str] = {}  # execution id -> what was seen
        self.signalled: set[str] = set()
        self.rng = random.Random(args.seed)

    def usual(self, name: str) -> float:
        seen = self.durations[name]
        return max(self.args.stuck_floor, self.args.stuck_factor * (statistics.median(seen) if seen else 1.0))

    async def start(self, name: str) -> None:
        try:
            xid = await self.client.start(MIX[name])
        except (GatewayError, httpx.HTTPError) as exc:
            print(f"start of {name} refused: {exc}", flush=True)
            return
        self.running[xid] = (name, time.monotonic())

    async def watch(self, stop: asyncio.Event) -> None:
        """Each second: what ended, the signals the waits need, what is stuck."""
        while not stop.is_set() or self.running:
            for xid, (name, started) in list(self.running.items()):
                with contextlib.suppress(GatewayError, httpx.HTTPError):
                    status = await self.client.status(xid, brief=True)
                    now = time.monotonic()
                    if status["status"] in FINAL:
                        del self.running[xid]
                        self.durations[name].append(now - started)
                        self.finished.append((now, now - started, status["status"]))
                    elif name == "signal" and xid not in self.signalled and await self.client.waits(xid):
                        await self.client.signal(xid, "go", {"ok": True})
                        self.signalled.add(xid)
                    elif now - started > self.usual(name) and xid not in self.stuck:
                        events = await self.client.all_events(xid)
                        self.stuck[xid] = (f"{xid} ({name}) running {now - started:.1f} s (usual "
                                           f"{self.usual(name) / self.args.stuck_factor:.2f} s); last events: "
                                           + ", ".join(f"{e.get('name')}:{e.get('step') or ''}" for e in events[-12:]))
                        print("STUCK", self.stuck[xid], *await _consumers(self.nats_url, self.auth), sep="\n  ",
                              flush=True)
            await asyncio.sleep(1.0)

    async def calibrate(self) -> float:
        """Executions started as fast as they finish (at most --in-flight at once): finished per second."""
        names = list(MIX)
        deadline = time.monotonic() + self.args.calibrate
        began = len(self.finished)
        t0 = time.monotonic()
        while time.monotonic() < deadline:
            if len(self.running) < self.args.in_flight:
                await self.start(names[self.rng.randrange(len(names))])
            else:
                await asyncio.sleep(0.05)
        return (len(self.finished) - began) / (time.monotonic() - t0)

    async def steady(self, rate: float, seconds: float, procs: dict) -> None:
        names = list(MIX)
        t0 = time.monotonic()
        n = 0
        minute_start, minute = t0, 1
        while time.monotonic() - t0 < seconds:
            n += 1
            await self.start(names[self.rng.randrange(len(names))])
            await asyncio.sleep(max(0.0, t0 + n / rate - time.monotonic()))
            if time.monotonic() - minute_start >= 60:
                self.report_minute(minute, minute_start, procs)
                minute_start, minute = time.monotonic(), minute + 1
        self.report_minute(minute, minute_start, procs)

    def report_minute(self, minute: int, since: float, procs: dict) -> None:
        done = [s for when, s, _ in self.finished if when >= since]
        rss = " ".join(f"{key}={rss_mb(pid):.0f}" for key, pid in procs.items())
        print(f"minute {minute}: {len(done)} finished, p50 {pct(done, 50):.2f} s, p99 {pct(done, 99):.2f} s, "
              f"running {len(self.running)}, stuck {len(self.stuck)}; RSS MB {rss}", flush=True)


async def main(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="noetl-soak-"))
    auth = NatsAuth(workdir / "nats-creds").ensure()
    nats = EmbeddedNats(store_dir=workdir / "nats", port=free_port(), auth=auth).start()
    pg_root = Path(tempfile.mkdtemp(prefix="noetl-soak-pg-"))
    pg_root.chmod(0o755)
    pg = EmbeddedPostgres(data_dir=pg_root / "data", port=free_port(), fast=True).start()
    stack = ProcessStack(Settings(nats_url=nats.url, pg_dsn=pg.dsn("postgres"), nats_creds=str(auth.directory)),
                         workers=args.workers, log_dir=str(workdir), supervise=True)
    burners = [multiprocessing.Process(target=burn, daemon=True) for _ in range(args.load)]
    code = 0
    try:
        await stack.start()
        for b in burners:
            b.start()
        async with GatewayClient(stack.gateway_url, timeout=30, token=stack.token) as client:
            await client.register((ROOT / "examples" / "nested_child.yaml").read_text())
            soak = Soak(client, args, nats.url, auth)
            stop = asyncio.Event()
            watcher = asyncio.create_task(soak.watch(stop))
            procs = {key: p.pid for key, p in stack.procs.items()} | {"nats": nats.pid, "postgres": pg.pid}
            rate = args.rate
            if rate is None:
                maximum = await soak.calibrate()
                rate = max(0.2, args.share * maximum)
                print(f"calibration: {maximum:.2f} executions/s finished with at most {args.in_flight} in flight "
                      f"(load {args.load}); the soak runs at {rate:.2f}/s; usual times: "
                      + ", ".join(f"{n} {statistics.median(d):.2f} s" for n, d in soak.durations.items() if d),
                      flush=True)
            soak.finished.clear()
            began = time.monotonic()
            await soak.steady(rate, args.minutes * 60, procs)
            stop.set()
            drain = time.monotonic() + args.drain
            while soak.running and time.monotonic() < drain:
                await asyncio.sleep(0.5)
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            lat = [s for _, s, _ in soak.finished]
            statuses: dict[str, int] = {}
            for _, _, status in soak.finished:
                statuses[status] = statuses.get(status, 0) + 1
            print(f"soak: {len(soak.finished)} executions in {time.monotonic() - began:.0f} s at {rate:.2f}/s, "
                  f"latency p50 {pct(lat, 50):.2f} s p99 {pct(lat, 99):.2f} s, statuses {statuses}, "
                  f"stuck {len(soak.stuck)}, not ended {len(soak.running)}")
            for line in soak.stuck.values():
                print("stuck:", line)
            for xid, (name, _) in soak.running.items():
                print(f"not ended: {xid} ({name})")
            code = 1 if soak.stuck or soak.running else 0
    finally:
        for b in burners:
            b.kill()
        await stack.stop()
        nats.stop()
        pg.stop()
        shutil.rmtree(pg_root, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)
    return code


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--rate", type=float, help="executions started per second (default: --share of the calibrated maximum)")
    p.add_argument("--share", type=float, default=0.7)
    p.add_argument("--calibrate", type=float, default=30.0, help="seconds of the calibration")
    p.add_argument("--in-flight", type=int, default=32, help="executions at once during the calibration")
    p.add_argument("--load", type=int, default=1, help="busy processes beside the soak")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--stuck-factor", type=float, default=10.0)
    p.add_argument("--stuck-floor", type=float, default=10.0, help="seconds: never stuck sooner")
    p.add_argument("--drain", type=float, default=120.0, help="seconds the last executions get to end")
    p.add_argument("--seed", type=int, default=0)
    sys.exit(asyncio.run(main(p.parse_args())))
