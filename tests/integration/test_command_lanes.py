"""The lanes of a pool's queue on a real NATS server: an upgrade from the unlaned layout keeps what
earlier versions queued, and runs it; what a busy worker fetched goes to an idle one."""
from __future__ import annotations

import asyncio

import orjson
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType, StreamConfig

from noetl_mesh.contracts.subjects import COMMAND_SUBJECTS
from noetl_mesh.infra.bus import COMMANDS, EVENTS, Bus, lane_of
from noetl_mesh.tools.base import ok

pytestmark = pytest.mark.integration


def test_commands_queued_by_an_earlier_version_run_after_the_upgrade(fresh_nats):
    """A commands stream of the earlier layout (by pool and execution, no lane) with a command queued:
    setup adds the lanes' subjects, and a worker runs the queued command (the consumer pool-<pool>,
    read as one lane more) beside the new ones."""
    from noetl_mesh.services.worker.service import WorkerService

    def command(n: int) -> dict:
        return {"command_id": f"c{n}", "pool": "default", "execution_id": f"x{n}", "step": "s",
                "step_run_id": f"r{n}", "iteration": None, "tasks": [{"name": "t", "kind": "noop", "result": n}]}

    async def main() -> None:
        bus = await Bus.connect(fresh_nats.url, "upgrade-test")
        try:
            await bus.js.add_stream(StreamConfig(name=COMMANDS, subjects=["noetl.cmd.*.*", "noetl.cmd.*"],
                                                 storage=StorageType.FILE, retention=RetentionPolicy.WORK_QUEUE))
            await bus.js.publish("noetl.cmd.default.x1", orjson.dumps(command(1)), stream=COMMANDS)  # as before
            await bus.setup(1)
            assert set((await bus.js.stream_info(COMMANDS)).config.subjects) == set(COMMAND_SUBJECTS)
            await (await bus.send_command(command(2)))  # into its lane
            info = await bus.js.stream_info(COMMANDS, subjects_filter="noetl.cmd.>")
            assert info.state.subjects == {"noetl.cmd.default.x1": 1, f"noetl.cmd.default.x2.{lane_of(command(2))}": 1}
            sub = await bus.js.subscribe("noetl.pevt.>", stream=EVENTS, ordered_consumer=True)
            # pool-<pool> as the first version with lanes made it (two filters): the worker narrows it to
            # the one a worker's NATS user may name
            await bus.js.add_consumer(COMMANDS, ConsumerConfig(
                durable_name="pool-default", ack_policy=AckPolicy.EXPLICIT,
                filter_subjects=["noetl.cmd.default.*", "noetl.cmd.default"]))
            worker = WorkerService(bus, concurrency=2)
            await worker.start()
            try:
                info = await bus.js.consumer_info(COMMANDS, "pool-default")
                assert (info.config.filter_subject, info.config.filter_subjects) == ("noetl.cmd.default.*", None)
                done: dict[str, object] = {}
                while len(done) < 2:
                    msg = await sub.next_msg(timeout=20)
                    for event in orjson.loads(msg.data):
                        if event["name"] == "step.done":
                            done[event["execution_id"]] = event["data"]["result"]
                assert done == {"x1": 1, "x2": 2}
                for _ in range(50):  # acknowledged: the queue is empty
                    if not (await bus.js.stream_info(COMMANDS)).state.messages:
                        break
                    await asyncio.sleep(0.1)
                assert not (await bus.js.stream_info(COMMANDS)).state.messages
            finally:
                await worker.stop()
        finally:
            await bus.close()

    asyncio.run(main())


class Sleep:
    """A tool that sleeps ``secs`` and notes which worker ran which execution, and when."""
    kind = "sleep"

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    async def run(self, task: dict, spec: dict, ctx) -> dict:
        self.log.append(("started", ctx.execution_id, self.name))
        await asyncio.sleep(float(task["secs"]))
        self.log.append(("ended", ctx.execution_id, self.name))
        return ok(ctx.execution_id)

    async def close(self) -> None:
        pass


def test_a_command_a_busy_worker_fetched_goes_to_an_idle_one(fresh_nats):
    """A worker whose slots are taken still fetches a lane's next command (its turn at the next slot);
    when another worker of the pool has a slot free, it gets that command within a second or so, not
    after the busy worker's task."""
    from noetl_mesh.services.worker.service import WorkerService

    log: list = []

    def same_lane(n: int) -> list[str]:
        ids = (f"e{i}" for i in range(10_000))
        lane = lane_of({"execution_id": "e0"})
        return [e for e in ids if lane_of({"execution_id": e}) == lane][:n]

    def command(eid: str, secs: float) -> dict:
        return {"command_id": f"c-{eid}", "pool": "default", "execution_id": eid, "step": "s",
                "step_run_id": f"r-{eid}", "iteration": None, "tasks": [{"name": "t", "kind": "sleep", "secs": secs}]}

    async def until(what) -> None:
        for _ in range(400):
            if what in log:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"never {what}: {log}")

    async def main() -> None:
        buses = [await Bus.connect(fresh_nats.url, f"w{n}") for n in range(3)]
        await buses[0].setup(1)
        workers = []
        try:
            long, short = same_lane(2)
            busy = WorkerService(buses[1], concurrency=1, tools={"sleep": Sleep("busy", log)})
            await busy.start()
            workers.append(busy)
            await (await buses[0].send_command(command(long, 8)))
            await until(("started", long, "busy"))
            await (await buses[0].send_command(command(short, 0)))  # fetched by the busy worker's lane
            for _ in range(100):
                if (await buses[0].js.stream_info(COMMANDS)).state.messages == 2:
                    info = await buses[0].consumer_info(COMMANDS, f"lane-default-p{lane_of({'execution_id': short})}")
                    if info and info["num_ack_pending"] == 2:
                        break
                await asyncio.sleep(0.05)
            idle = WorkerService(buses[2], concurrency=1, tools={"sleep": Sleep("idle", log)})
            await idle.start()
            workers.append(idle)
            await until(("ended", short, "idle"))
            assert ("ended", long, "busy") not in log, log  # not after the busy worker's task
            assert [e for e in log if e[1] == short] == [("started", short, "idle"), ("ended", short, "idle")]
        finally:
            for w in workers:
                await w.stop()
            for b in buses:
                await b.close()

    asyncio.run(main())
