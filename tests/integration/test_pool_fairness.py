"""One user's backlog on a pool does not hold up another user's commands: a pool's queue is a lane
per user who starts executions, and its workers take from the lanes in turn (a whole stack, real
NATS and Postgres, a worker of the pool running one command at a time)."""
from __future__ import annotations

import asyncio
from typing import Iterator

import pytest

from conftest import StackHandle, new_user, stack_with_worker
from noetl_mesh.contracts.subjects import COMMANDS, lane_of
from noetl_mesh.infra.bus import Bus

pytestmark = pytest.mark.integration

FLOODS = 10

# each task says when it started, and takes half a second: the pool's one slot is never free for long
TIMED = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: timed, path: tests/fair/timed}
workflow:
  - step: start
    spec: {pool: fair}
    tool: {kind: python, code: "import time\\nresult = time.time()\\ntime.sleep(0.5)"}
"""
# ... and the flood's first holds the slot until the rest is queued, however slowly they are accepted
FIRST = TIMED.replace("timed", "first").replace("time.sleep(0.5)", "time.sleep(10)")


@pytest.fixture(scope="module")
def stack(module_pg) -> Iterator[StackHandle]:
    with stack_with_worker(module_pg, "fair", concurrency=1) as handle:  # one task at a time
        yield handle


def _lane(users: list[dict], name: str) -> int:
    uid = next(u["user_id"] for u in users if u["username"] == name)
    return lane_of({"requested_by": {"user_id": uid}})


def test_a_users_one_command_starts_before_anothers_backlog_has_run(stack) -> None:
    async def go() -> tuple[list[float], float]:
        flooder = await new_user(stack, "flooder", ["developer"])
        async with stack.client() as admin:
            await admin.register(TIMED)
            await admin.register(FIRST)
        # a second user whose commands wait in another lane than the first's (ids hash alike 1 time in 8)
        for n in range(40):
            other = await new_user(stack, f"other-{n}", ["developer"])
            async with stack.client() as admin:
                users = await admin.users()
            if _lane(users, f"other-{n}") != _lane(users, "flooder"):
                break
        flood_lane = f"lane-fair-p{_lane(users, 'flooder')}"
        bus = await Bus.connect(stack.nats_url, "fairness-probe", stack.admin)

        async def queued(n: int) -> None:  # n of the flood's commands queued, its first running
            info = None
            for _ in range(1200):
                info = await bus.consumer_info(COMMANDS, flood_lane)
                if info and info["num_pending"] + info["num_ack_pending"] == n and info["num_ack_pending"]:
                    return
                await asyncio.sleep(0.05)
            raise AssertionError(f"{n} commands of the flood were not queued in {flood_lane}: {info}")

        try:
            async with stack.client(token=flooder) as client:
                floods = [await client.start(path="tests/fair/first")]
                await queued(1)
                floods += await asyncio.gather(*(client.start(path="tests/fair/timed") for _ in range(FLOODS - 1)))
            await queued(FLOODS)
        finally:
            await bus.close()
        async with stack.client(token=other) as client:
            mine = await client.start(path="tests/fair/timed")
            done = await client.wait(mine, timeout=120)
        async with stack.client(token=flooder) as client:
            flooded = [await client.wait(eid, timeout=120) for eid in floods]
        assert done["status"] == "COMPLETED" and all(f["status"] == "COMPLETED" for f in flooded), (done, flooded)
        return sorted(f["steps"]["start"]["result"] for f in flooded[1:]), done["steps"]["start"]["result"]

    flood, mine = stack.run(go(), 240)
    # first come, first served, it would start after all ten; in turn, after the first and at most a
    # few more (it started third in every run so far: the first, the one fetched while it ran, then it)
    assert sum(started > mine for started in flood) >= FLOODS // 2, (flood, mine)


# a task that holds its slot and its process for two minutes, and one that ends at once
SLOW = TIMED.replace("name: timed, path: tests/fair/timed", "name: slow, path: tests/share/slow").replace(
    "pool: fair", "pool: share").replace("time.sleep(0.5)", "time.sleep(120)")
QUICK = TIMED.replace("name: timed, path: tests/fair/timed", "name: quick, path: tests/share/quick").replace(
    "pool: fair", "pool: share").replace("time.sleep(0.5)", "")


@pytest.fixture(scope="module")
def shared(module_pg) -> Iterator[StackHandle]:
    from noetl_mesh import limits

    # three run slots and two task processes: one user's share is two slots and one process (lane_reserve 1)
    with limits.override(max_task_processes=2, lane_reserve=1), \
            stack_with_worker(module_pg, "share", concurrency=3) as handle:
        yield handle


def test_one_users_slow_tasks_leave_a_slot_and_a_task_process_to_the_others(shared) -> None:
    """A user whose python tasks run for two minutes cannot hold every run slot, nor every task process,
    of a worker: another user's python task runs at once (without the reserve it waited two minutes)."""
    stack = shared

    async def go() -> tuple[dict, list[dict]]:
        hog = await new_user(stack, "hog", ["developer"])
        async with stack.client() as admin:
            await admin.register(SLOW)
            await admin.register(QUICK)
        for n in range(40):  # another user whose commands wait in another lane (ids hash alike 1 time in 8)
            other = await new_user(stack, f"neighbour-{n}", ["developer"])
            async with stack.client() as admin:
                users = await admin.users()
            if _lane(users, f"neighbour-{n}") != _lane(users, "hog"):
                break
        async with stack.client(token=hog) as client:
            slow = [await client.start(path="tests/share/slow") for _ in range(4)]
            for _ in range(600):  # the hog's tasks have taken what they may
                states = [await client.status(eid) for eid in slow]
                if sum((s.get("steps") or {}).get("start", {}).get("status") == "running" for s in states) >= 2:
                    break
                await asyncio.sleep(0.05)
            try:
                async with stack.client(token=other) as mine:
                    done = await mine.wait(await mine.start(path="tests/share/quick"), timeout=45)
                return done, [await client.status(eid) for eid in slow]
            finally:
                for eid in slow:
                    await client.cancel(eid)

    done, slow = stack.run(go(), 240)
    assert done["status"] == "COMPLETED", done
    assert all(s["status"] == "RUNNING" for s in slow), slow  # still running: the neighbour did not wait for them
