"""Benchmark of access control at the gateway: what authentication adds to a request, and logins per
second through the gateway. Prints figures; asserts nothing.

    python bench/bench_gateway_auth.py           # (--quick for a smoke run)

Embedded NATS, the sessions service (argon2id with its default parameters, one hashing thread) and a
gateway behind a real HTTP server; no Postgres (no route measured here reads the event log).

- added latency, warm cache: ``GET /api/auth/whoami`` (a token, validated once then cached for 1 s) against
  ``GET /health`` (public); neither handler asks anything of NATS, so the difference is the access check
  (header, digest, cache lookup, permission) plus whoami's permission list. Interleaved, sequential,
  over HTTP on loopback; p50 and p99 of each and of the difference.
- the access check alone: the route dependency called in process, warm cache (µs per call).
- cold: the same whoami with the cache off (every request asks ``noetl.q.sessions.validate``).
- logins: ``POST /api/auth/login`` sequential (latency) and N at once (logins per second).
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx

from noetl_mesh.infra.bus import Bus
from noetl_mesh.infra.embedded import EmbeddedNats
from noetl_mesh.services.gateway import auth
from noetl_mesh.services.gateway.app import GatewayService
from noetl_mesh.services.sessions.service import SessionsService
from noetl_mesh.stack import Settings, bootstrap

PASSWORD = "benchmark password 1"


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def line(name: str, ms: list[float]) -> None:
    print(f"  {name:<44} n={len(ms):<6} p50 {pct(ms, 50):7.3f}  p99 {pct(ms, 99):7.3f}  mean {statistics.mean(ms):7.3f} ms")


async def timed(http: httpx.AsyncClient, method: str, url: str, **kw) -> float:
    started = time.perf_counter()
    resp = await http.request(method, url, **kw)
    took = (time.perf_counter() - started) * 1e3
    assert resp.status_code < 300, resp.text
    return took


async def added_latency(gateway: GatewayService, token: str, n: int) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=gateway.url, trust_env=False, timeout=60) as http:
        for _ in range(200):  # warm-up: connections, caches, code paths
            await http.get("/health")
            await http.get("/api/auth/whoami", headers=headers)
        public, signed, diff = [], [], []
        for _ in range(n):
            a = await timed(http, "GET", "/health")
            b = await timed(http, "GET", "/api/auth/whoami", headers=headers)
            public.append(a)
            signed.append(b)
            diff.append(b - a)
        print(f"\nadded latency per authenticated request, warm cache ({n} pairs, interleaved, sequential)")
        line("GET /health (public)", public)
        line("GET /api/auth/whoami (bearer token)", signed)
        print(f"  {'difference of the medians':<44} {statistics.median(signed) - statistics.median(public):7.3f} ms"
              f"   (p50 of the pairwise differences {pct(diff, 50):.3f} ms)")

        cache = gateway.app.state.auth.cache
        ttl, cache.ttl = cache.ttl, 0.0  # every request validated by the sessions service
        cold = [await timed(http, "GET", "/api/auth/whoami", headers=headers) for _ in range(n // 2)]
        cache.ttl = ttl
        line("GET /api/auth/whoami, cache off (validate each)", cold)


async def check_alone(gateway: GatewayService, token: str, n: int) -> None:
    """The dependency itself, in process, with the principal cached."""
    from starlette.requests import Request

    app = gateway.app
    require = auth.Require("execution.read")
    scope = {"type": "http", "method": "GET", "path": "/api/executions", "headers": [
        (b"authorization", f"Bearer {token}".encode())], "app": app, "query_string": b"", "state": {}}
    await require(Request(scope))  # cached from here
    started = time.perf_counter()
    for _ in range(n):
        await require(Request(scope))
    per = (time.perf_counter() - started) / n * 1e6
    print(f"\nthe access check alone (Require.__call__, warm cache, in process): {per:.1f} µs per request")


async def logins(gateway: GatewayService, admin_token: str, n: int, at_once: int) -> None:
    users = [f"bench{i}" for i in range(8)]
    async with httpx.AsyncClient(base_url=gateway.url, trust_env=False, timeout=120) as http:
        for name in users:
            resp = await http.post("/api/users", headers={"Authorization": f"Bearer {admin_token}"},
                                   json={"username": name, "password": PASSWORD, "roles": ["viewer"]})
            assert resp.status_code in (201, 409), resp.text

        async def one(i: int) -> float:
            return await timed(http, "POST", "/api/auth/login",
                               json={"username": users[i % len(users)], "password": PASSWORD})

        sequential = [await one(i) for i in range(max(10, n // 5))]
        print(f"\nlogins through the gateway (argon2id t=2 m=19 MiB p=1, one hashing thread, {len(users)} users)")
        line("POST /api/auth/login, sequential", sequential)
        sem = asyncio.Semaphore(at_once)

        async def bounded(i: int) -> float:
            async with sem:
                return await one(i)

        started = time.perf_counter()
        took = await asyncio.gather(*(bounded(i) for i in range(n)))
        wall = time.perf_counter() - started
        print(f"  {n} logins, {at_once} at once: {n / wall:.1f} logins/s "
              f"(latency p50 {pct(took, 50):.0f} ms, p99 {pct(took, 99):.0f} ms)")


async def main(quick: bool) -> None:
    nats = EmbeddedNats().start()
    bus = await Bus.connect(nats.url, "bench-auth")
    await bus.setup(partitions=4)
    sessions = SessionsService(bus, oidc=None)
    await sessions.start()
    gateway = GatewayService(await Bus.connect(nats.url, "bench-gateway"))
    await gateway.start()
    try:
        token = await bootstrap(Settings(nats_url=nats.url))
        await added_latency(gateway, token, 300 if quick else 3000)
        await check_alone(gateway, token, 2000 if quick else 50_000)
        await logins(gateway, token, 30 if quick else 200, 8)
    finally:
        await gateway.stop()
        await gateway.bus.close()
        await sessions.stop()
        await bus.close()
        nats.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    asyncio.run(main(ap.parse_args().quick))
