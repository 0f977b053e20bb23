"""Micro-benchmark of the worker-side pipeline (noetl_mesh.core.pipeline) and the python tool.

Run: python bench/bench_pipeline.py [--quick]
Prints:
  * the engine overhead per task of a 10-task noop pipeline (events go to a no-op sink), plain and
    with a templated ``result:`` and a policy rule on every task;
  * the python tool's per-call latency on the warm pool vs a cold ``python -c`` per call;
  * the duckdb tool's per-call latency (fresh in-memory database per task);
  * the worker's masking (D24): one 10-task command through ``execute_command`` with and without a
    keychain (3 secrets), and ``mask`` alone on one ``task.processed`` event's data (without and with
    a secret in it).
No assertions.
"""
from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time

from noetl_mesh.core.pipeline import run_pipeline
from noetl_mesh.tools import close_tools, default_tools


def command(tasks: list[dict]) -> dict:
    return {
        "execution_id": "e-bench",
        "step": "bench",
        "step_run_id": "r-1",
        "iteration": None,
        "tasks": tasks,
        "spec_layers": {"executor": None, "step": None, "loop": None},
        "workload": {"n": 1},
        "ctx": {},
        "args": {},
        "iter": None,
        "steps": {"start": {"status": "done", "result": 1}},
        "keychain": {},
        "loop_mode": None,
    }


async def _sink(name: str, fields: dict) -> None:
    return None


async def bench_noop(tasks: list[dict], tools: dict, rounds: int) -> tuple[float, float]:
    cmd = command(tasks)
    for _ in range(50):  # warm caches (template compile cache, imports)
        await run_pipeline(cmd, tools, _sink)
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(rounds):
            res = await run_pipeline(cmd, tools, _sink)
        samples.append((time.perf_counter() - t0) / rounds)
        assert res.status == "ok", res.error
    per_pipeline = min(samples)
    return per_pipeline, per_pipeline / len(tasks)


async def bench_python(tools: dict, calls: int) -> list[float]:
    from noetl_mesh.tools.base import ToolContext

    py = tools["python"]
    ctx = ToolContext("e", "s", "t", timeout=60)
    first_t0 = time.perf_counter()
    await py.run({"code": "result = 1"}, {}, ctx)
    first = time.perf_counter() - first_t0
    times = []
    for i in range(calls):
        t0 = time.perf_counter()
        out = await py.run({"code": "result = x + 1", "args": {"x": i}}, {}, ctx)
        times.append(time.perf_counter() - t0)
        assert out["result"] == i + 1, out
    return [first] + times


async def bench_duckdb(tools: dict, calls: int) -> list[float]:
    from noetl_mesh.tools.base import ToolContext

    db = tools["duckdb"]
    ctx = ToolContext("e", "s", "t", timeout=60)
    times = []
    for i in range(calls):
        t0 = time.perf_counter()
        out = await db.run({"command": "select ?::int + 1 as n", "params": [i]}, {}, ctx)
        times.append(time.perf_counter() - t0)
        assert out["result"]["rows"] == [{"n": i + 1}], out
        await asyncio.sleep(0.015)  # tasks are rarely back to back; lets the spare database open
    return times


async def bench_masking(rounds: int) -> tuple[float, float, float, float]:
    """Per command without and with a keychain of 3 secrets, and per event for ``mask`` alone (an
    event without a secret, and one holding a secret)."""
    from noetl_mesh.core.keychain import mask, secrets_of
    from noetl_mesh.core.worker import execute_command
    from noetl_mesh.tools.noop import NoopTool

    keychain = [{"name": "api", "kind": "static", "token": "tok-9f8e7d6c5b4a", "user": "svc-user"},
                {"name": "db", "kind": "static", "password": "pg/pass word+1"}]
    tasks = [{"name": f"t{i}", "kind": "noop", "result": {"i": i, "msg": "fetched rows from the api", "rows": [
        {"id": j, "name": f"row {j}", "note": "nothing secret here"} for j in range(5)]}} for i in range(10)]
    tools = {"noop": NoopTool()}

    async def sink(event: dict) -> None:
        return None

    def cmd(kc: list) -> dict:
        return {**command(tasks), "command_id": "c-bench", "pool": "default", "chunk": None, "workbook": [],
                "keychain": kc}

    async def per_command(kc: list) -> float:
        c = cmd(kc)
        for _ in range(20):
            await execute_command(c, tools, sink)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(rounds):
                await execute_command(c, tools, sink)
            best = min(best, (time.perf_counter() - t0) / rounds)
        return best

    plain = await per_command([])
    masked = await per_command(keychain)
    secrets = secrets_of({d["name"]: d for d in keychain})
    data = {"outcome": {"status": "ok", "result": tasks[3]["result"], "error": None,
                        "meta": {"attempt": 1, "duration_ms": 0.1, "action_id": "a" * 32}}}
    holding = {"outcome": {**data["outcome"], "result": {**tasks[3]["result"], "msg": "token=tok-9f8e7d6c5b4a"}}}
    n = rounds * 20
    per_event = []
    for value in (data, holding):
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                mask(value, secrets)
            best = min(best, (time.perf_counter() - t0) / n)
        per_event.append(best)
    return plain, masked, per_event[0], per_event[1]


def cold_python(calls: int) -> list[float]:
    times = []
    for i in range(calls):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", f"x = {i}; result = x + 1"], check=True)
        times.append(time.perf_counter() - t0)
    return times


def ms(v: float) -> str:
    return f"{v * 1000:8.3f} ms"


def us(v: float) -> str:
    return f"{v * 1e6:8.1f} µs"


async def main(quick: bool) -> None:
    tools = default_tools()
    rounds = 200 if quick else 2000
    try:
        plain = [{"name": f"t{i}", "kind": "noop"} for i in range(10)]
        per_pipe, per_task = await bench_noop(plain, tools, rounds)
        print(f"noop pipeline, 10 tasks                      : {us(per_pipe)} per pipeline, {us(per_task)} per task")

        rich = [
            {
                "name": f"t{i}",
                "kind": "noop",
                "result": "{{ (_prev or 0) + workload.n }}",
                "spec": {"policy": {"rules": [
                    {"when": "{{ outcome.status == 'error' }}", "then": {"do": "fail"}},
                    {"else": {"then": {"do": "continue"}}},
                ]}},
            }
            for i in range(10)
        ]
        per_pipe, per_task = await bench_noop(rich, tools, rounds // 2)
        print(f"noop pipeline, 10 tasks, templated + policy  : {us(per_pipe)} per pipeline, {us(per_task)} per task")

        n = 50 if quick else 300
        warm = await bench_python(tools, n)
        print(f"python tool, first call (cold child start)   : {ms(warm[0])}")
        print(f"python tool, warm pool, one-line task        : median {ms(statistics.median(warm[1:]))}, "
              f"p95 {ms(sorted(warm[1:])[int(len(warm[1:]) * 0.95) - 1])}")
        cold = cold_python(10 if quick else 30)
        print(f"cold `python -c` per call (for comparison)   : median {ms(statistics.median(cold))}")

        plain, masked, clean, holding = await bench_masking(50 if quick else 300)
        print(f"worker command, 10 noop tasks, no keychain   : {us(plain)} per command")
        print(f"worker command, 10 noop tasks, 3 secrets     : {us(masked)} per command "
              f"(masking {us((masked - plain) / 22)} per event)")
        print(f"mask() of one task.processed event's data    : {us(clean)} without a secret, "
              f"{us(holding)} holding one")

        dd = await bench_duckdb(tools, 20 if quick else 60)
        print(f"duckdb tool, in-memory db per task, 1 query  : median {ms(statistics.median(dd))}, "
              f"max {ms(max(dd))}")
    finally:
        await close_tools(tools)


if __name__ == "__main__":
    asyncio.run(main("--quick" in sys.argv))
