"""Benchmark of the sessions service on an embedded NATS server: validation latency and logins per second.

Run: python bench/bench_auth.py            (python bench/bench_auth.py --quick for a smoke run)
Prints figures; no assertions. Password hashing is argon2id with the service's default parameters
(core/access.py HASHER: t=2, m=19 MiB, p=1) on ``--hash-threads`` threads; ``--rfc9106`` uses RFC 9106's
second recommended profile (t=3, m=64 MiB, p=4) instead, for comparison.

- validate, request/reply: what a gateway pays per uncached request (client -> NATS -> service -> KV
  get -> reply), sequential, p50/p99; the same with a refresh written on every call (the worst case;
  normally one write per session per ``session_refresh_interval``); and N callers at once (per second).
- validate, in process: the service's handler alone (one KV get), without the request/reply hop.
- login: one argon2 verification alone, then logins through the service, sequential and concurrent.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import orjson
from argon2 import PasswordHasher

from noetl_mesh import limits
from noetl_mesh.core import access
from noetl_mesh.infra.bus import Bus
from noetl_mesh.infra.embedded import EmbeddedNats
from noetl_mesh.services.sessions import service as S

PASSWORD = "benchmark password 1"


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def row(name: str, samples: list[float]) -> None:
    ms = [s * 1000 for s in samples]
    print(f"{name:<52} {len(ms):>6} {pct(ms, 50):>9.3f} {pct(ms, 99):>9.3f} {statistics.mean(ms):>9.3f}")


async def timed(n: int, call) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        await call()
        out.append(time.perf_counter() - start)
    return out


async def main(args: argparse.Namespace) -> None:
    n = 200 if args.quick else 3000
    logins = 4 if args.quick else 24
    server = EmbeddedNats().start()
    try:
        bus = await Bus.connect(server.url, "noetl-sessions")
        hasher = PasswordHasher(time_cost=3, memory_cost=64 * 1024, parallelism=4) if args.rfc9106 else access.HASHER
        svc = S.SessionsService(bus, oidc=None, hasher=hasher, hash_threads=args.hash_threads)
        await svc.start()
        client = await Bus.connect(server.url, "bench")

        async def request(subject: str, payload: dict):
            msg = await client.nc.request(subject, orjson.dumps(payload), timeout=30)
            reply = orjson.loads(msg.data)
            if isinstance(reply, dict) and "error" in reply:
                raise RuntimeError(reply["error"])
            return reply

        boot = await request(S.Q_BOOTSTRAP, {"username": "admin", "password": PASSWORD})
        admin = await request(S.Q_VALIDATE, {"token": boot["token"]})
        await request(S.Q_USERS_ADD, {"principal": admin, "username": "bench", "password": PASSWORD,
                                      "roles": ["developer"]})
        token = (await request(S.Q_LOGIN, {"username": "bench", "password": PASSWORD}))["token"]
        api_token = (await request(S.Q_TOKENS_CREATE, {"principal": admin, "name": "bench"}))["token"]

        print(f"{'validate (ms)':<52} {'n':>6} {'p50':>9} {'p99':>9} {'mean':>9}")
        print("-" * 89)
        for _ in range(50):  # warm up
            await request(S.Q_VALIDATE, {"token": token})
        row("session, request/reply (no write)", await timed(n, lambda: request(S.Q_VALIDATE, {"token": token})))
        row("API token, request/reply", await timed(n, lambda: request(S.Q_VALIDATE, {"token": api_token})))
        with limits.override(session_refresh_interval=0.001):
            row("session, request/reply, refresh written every call",
                await timed(n, lambda: request(S.Q_VALIDATE, {"token": token})))
        row("session, in process (one KV get)", await timed(n, lambda: svc.validate({"token": token})))

        for callers in (8, 64):
            start = time.perf_counter()
            per = max(1, n // callers)

            async def caller():
                for _ in range(per):
                    await request(S.Q_VALIDATE, {"token": token})

            await asyncio.gather(*(caller() for _ in range(callers)))
            took = time.perf_counter() - start
            print(f"session, request/reply, {callers} callers at once: {callers * per / took:,.0f} validations/s")

        print()
        print(f"{'login (ms)':<52} {'n':>6} {'p50':>9} {'p99':>9} {'mean':>9}")
        print("-" * 89)
        stored = access.hash_password(PASSWORD, hasher)
        alone = []
        for _ in range(max(2, logins // 4)):
            start = time.perf_counter()
            access.verify_password(stored, PASSWORD, hasher)
            alone.append(time.perf_counter() - start)
        row(f"argon2id verify alone (t={hasher.time_cost}, m={hasher.memory_cost // 1024} MiB, "
            f"p={hasher.parallelism})", alone)
        sequential = await timed(logins, lambda: request(S.Q_LOGIN, {"username": "bench", "password": PASSWORD}))
        row("login through the service, sequential", sequential)
        print(f"logins per second, sequential: {1 / statistics.mean(sequential):.1f}")
        start = time.perf_counter()
        await asyncio.gather(*(request(S.Q_LOGIN, {"username": "bench", "password": PASSWORD}) for _ in range(logins)))
        took = time.perf_counter() - start
        print(f"logins per second, {logins} at once ({args.hash_threads} hashing threads): {logins / took:.1f}")

        # validations stay fast while logins hash
        busy = asyncio.gather(*(request(S.Q_LOGIN, {"username": "bench", "password": PASSWORD}) for _ in range(logins)))
        during = await timed(max(50, n // 10), lambda: request(S.Q_VALIDATE, {"token": token}))
        await busy
        row("validate while logins hash", during)

        await svc.stop()
        await bus.close()
        await client.close()
    finally:
        server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--hash-threads", type=int, default=1)
    parser.add_argument("--rfc9106", action="store_true", help="argon2id t=3, m=64 MiB, p=4")
    asyncio.run(main(parser.parse_args()))
