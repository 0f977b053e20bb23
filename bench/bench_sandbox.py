"""What a python or duckdb task costs in its sandboxed process (D33, docs/performance.md): latency of one
task at a time (back to back, and with a pause between tasks as steps of a chain have), throughput of
tasks at once, and the CPU of every process involved per task. Prints a table; asserts nothing.

    python bench/bench_sandbox.py            # 300 tasks a scenario
    python bench/bench_sandbox.py --quick    # a smoke run
"""
from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import time

from noetl_mesh.tools.base import ToolContext
from noetl_mesh.tools.duckdb import DuckdbTool
from noetl_mesh.tools.python import PythonTool


def ctx() -> ToolContext:
    return ToolContext(execution_id="bench", step="s", task_name="t")


def cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


async def sequential(tool, task: dict, n: int, pause: float) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        out = await tool.run(task, {}, ctx())
        times.append(time.perf_counter() - t0)
        assert out["status"] == "ok", out
        if pause:
            await asyncio.sleep(pause)
    return times


async def concurrent(tool, task: dict, n: int, width: int) -> float:
    sem = asyncio.Semaphore(width)

    async def one():
        async with sem:
            out = await tool.run(task, {}, ctx())
            assert out["status"] == "ok", out

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    return n / (time.perf_counter() - t0)


async def scenario(name: str, make, task: dict, n: int) -> None:
    tool = make()
    await tool.run(task, {}, ctx())  # warm: the first task starts the processes
    await asyncio.sleep(0.5)
    c0 = cpu()
    back = await sequential(tool, task, n, 0.0)
    paced = await sequential(tool, task, n, 0.02)
    rate = await concurrent(tool, task, n, 8)
    await tool.close()
    per_task = (cpu() - c0) / (3 * n) * 1000
    print(f"{name:8} back-to-back p50 {statistics.median(back) * 1000:6.2f} ms p90 {pct(back, 90) * 1000:6.2f} ms | "
          f"paced p50 {statistics.median(paced) * 1000:6.2f} ms p90 {pct(paced, 90) * 1000:6.2f} ms | "
          f"8 at once {rate:6.0f} tasks/s | CPU {per_task:5.2f} ms/task (all processes)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("-n", type=int, default=300)
    args = ap.parse_args()
    n = 20 if args.quick else args.n
    asyncio.run(scenario("python", PythonTool, {"code": "result = x + 1", "args": {"x": 1}}, n))
    asyncio.run(scenario("duckdb", DuckdbTool, {"command": "select 42 as x"}, n))


if __name__ == "__main__":
    main()
