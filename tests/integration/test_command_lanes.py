"""The lanes of a pool's queue on a real NATS server: an upgrade from the unlaned layout keeps what
earlier versions queued, and runs it."""
from __future__ import annotations

import asyncio

import orjson
import pytest
from nats.js.api import RetentionPolicy, StorageType, StreamConfig

from noetl_mesh.contracts.subjects import COMMAND_SUBJECTS
from noetl_mesh.infra.bus import COMMANDS, EVENTS, Bus, lane_of

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
            worker = WorkerService(bus, concurrency=2)
            await worker.start()
            try:
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
