"""Benchmarks of the gateway's request path. Prints a table; asserts nothing.

    python bench/bench_gateway.py           # body parsing, then submissions over HTTP (embedded NATS)
    python bench/bench_gateway.py --quick   # fewer repetitions

parse: the strict JSON reading of a body (services/gateway/body.py) against plain ``json.loads`` and
``orjson.loads`` for bodies of several shapes. submit: ``POST /api/executions`` through a real HTTP
server and a real NATS server (the request is published; no other service is needed), p50/p99, and
the latency of ``GET /health`` while big bodies are being parsed and validated.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time

import httpx
import orjson
import yaml

from noetl_mesh import limits
from noetl_mesh.infra.bus import Bus
from noetl_mesh.infra.embedded import EmbeddedNats
from noetl_mesh.services.gateway.app import GatewayService
from noetl_mesh.services.gateway.body import parse_json
from noetl_mesh.services.sessions.service import SessionsService
from noetl_mesh.stack import Settings, bootstrap

TINY = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: tiny, path: bench/tiny}
workload: {n: 2}
workflow:
  - step: start
    tool: {kind: noop, result: "{{ workload.n }}"}
    next: {arcs: [{step: double, args: {x: "{{ event.result }}"}}]}
  - step: double
    tool: {kind: noop, result: "{{ args.x * 2 }}"}
"""


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def timed(fn, *args, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - started)
    return best


def bodies() -> dict[str, bytes]:
    records = [{"id": i, "name": f"item {i}", "price": i * 1.5, "tags": ["a", "b"], "ok": True} for i in range(20_000)]
    return {
        "inline playbook": json.dumps({"playbook": TINY, "workload": {"n": 3}}).encode(),
        "20k records": json.dumps({"path": "bench/tiny", "workload": {"rows": records}}).encode(),
        "escaped non-ASCII text": json.dumps({"path": "p", "workload": {"t": "é\n" * 300_000}},
                                                        ensure_ascii=True).encode(),
        "4M small ints": b'{"path": "p", "workload": {"x": [' + b",".join([b"7"] * 4_000_000) + b"]}}",
    }


def bench_parse(quick: bool) -> None:
    print("\nparse (best of n, ms)")
    print(f"{'body':36} {'bytes':>11} {'orjson':>9} {'json':>9} {'strict':>9}")
    for name, raw in bodies().items():
        n = 1 if len(raw) > 4_000_000 else (3 if quick else 10) if len(raw) > 10_000 else (200 if quick else 2000)
        o = timed(orjson.loads, raw, repeat=n) * 1e3
        j = timed(json.loads, raw, repeat=n) * 1e3
        with limits.override(max_body_values=5_000_000):  # measured, not refused
            s = timed(parse_json, raw, 64, repeat=n) * 1e3
        print(f"{name:36} {len(raw):>11,} {o:>9.3f} {j:>9.3f} {s:>9.3f}")


async def bench_submit(quick: bool) -> None:
    nats = EmbeddedNats().start()
    bus = await Bus.connect(nats.url, "bench-gateway")
    await bus.setup(partitions=4)
    sessions = SessionsService(bus, oidc=None)  # requests carry the bootstrap admin's token
    await sessions.start()
    auth = {"Authorization": f"Bearer {await bootstrap(Settings(nats_url=nats.url))}"}
    gateway = GatewayService(bus)
    await gateway.start()
    try:
        async with httpx.AsyncClient(base_url=gateway.url, trust_env=False, timeout=120, headers=auth) as http:
            n = 200 if quick else 1000
            print(f"\nsubmit (POST /api/executions, {n} sequential, ms)")
            mapping = yaml.safe_load(TINY)
            for name, body in (("inline YAML text", {"playbook": TINY, "workload": {"n": 3}}),
                               ("inline mapping", {"playbook": mapping, "workload": {"n": 3}})):
                lat = []
                for _ in range(n):
                    started = time.perf_counter()
                    resp = await http.post("/api/executions", json=body)
                    lat.append((time.perf_counter() - started) * 1e3)
                    assert resp.status_code == 202, resp.text
                print(f"  {name:20} p50 {statistics.median(lat):6.2f}   p99 {pct(lat, 99):6.2f}")

            # /health while two 2,000-step playbooks are parsed and validated (sent from other threads)
            big = {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "big", "path": "bench/big"},
                   "workflow": [{"step": "start" if i == 0 else f"s{i}", "tool": {"kind": "nosuchtool" if i == 1999
                                                                                   else "noop"},
                                 **({"next": {"arcs": [{"step": f"s{i + 1}"}]}} if i < 1999 else {})}
                                for i in range(2000)]}

            def submit(body: dict) -> None:
                with httpx.Client(base_url=gateway.url, trust_env=False, timeout=300, headers=auth) as client:
                    client.post("/api/executions", json=body)

            threads = [threading.Thread(target=submit, args=({"playbook": b},)) for b in (big, yaml.safe_dump(big))]
            started = time.perf_counter()
            lat = []
            with limits.override(max_steps=5_000):  # validated in full, not refused for its length
                for t in threads:
                    t.start()
                while any(t.is_alive() for t in threads):
                    t0 = time.perf_counter()
                    await http.get("/health")
                    lat.append((time.perf_counter() - t0) * 1e3)
                    await asyncio.sleep(0.01)
            took = time.perf_counter() - started
            print(f"\n/health during two 2,000-step validations ({took:.1f} s): {len(lat)} answers, "
                  f"p50 {statistics.median(lat):.1f} ms, max {max(lat):.1f} ms")
    finally:
        await gateway.stop()
        await sessions.stop()
        await bus.close()
        nats.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("parts", nargs="*", help="parse, submit (default: both)")
    args = ap.parse_args()
    parts = args.parts or ["parse", "submit"]
    if "parse" in parts:
        bench_parse(args.quick)
    if "submit" in parts:
        asyncio.run(bench_submit(args.quick))


if __name__ == "__main__":
    main()
