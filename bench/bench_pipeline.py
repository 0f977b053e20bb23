"""Micro-benchmark of the worker-side pipeline (noetl_mesh.core.pipeline) and the python tool.

Run: python bench/bench_pipeline.py [--quick]
Prints:
  * the engine overhead per task of a 10-task noop pipeline (events go to a no-op sink), plain and
    with a templated ``result:`` and a policy rule on every task;
  * the python tool's per-call latency on the warm pool vs a cold ``python -c`` per call;
  * the duckdb tool's per-call latency (fresh in-memory database per task).
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

        dd = await bench_duckdb(tools, 20 if quick else 60)
        print(f"duckdb tool, in-memory db per task, 1 query  : median {ms(statistics.median(dd))}, "
              f"max {ms(max(dd))}")
    finally:
        await close_tools(tools)


if __name__ == "__main__":
    asyncio.run(main("--quick" in sys.argv))
