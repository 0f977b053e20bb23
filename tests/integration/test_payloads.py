"""D23: results larger than the payload limit travel as object-store references; templates, the
gateway and `noetl run --json` see the value; no message and no event row carries it."""
from __future__ import annotations

import asyncio

import orjson
import psycopg
import pytest
from nats import connect as nats_connect
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from noetl_mesh.infra.bus import COMMANDS, EVENTS, Bus, lane_of
from noetl_mesh.infra.embedded import EmbeddedNats
from noetl_mesh.infra.payloads import STORE, PayloadMissing, PayloadStore, is_ref

pytestmark = pytest.mark.integration
BIG = 20_000_000


def test_store_round_trip_is_content_addressed():
    nats = EmbeddedNats().start()

    async def main():
        bus = await Bus.connect(nats.url, "payload-test")
        try:
            value = {"small": 1, "big": "y" * 300_000, "list": [{"z": "w" * 300_000}, 2]}
            shrunk = await bus.payloads.shrink(value, 256 * 1024)
            assert shrunk["small"] == 1 and is_ref(shrunk["big"]) and is_ref(shrunk["list"][0]["z"]) and shrunk["list"][1] == 2
            assert shrunk["big"]["store"] == STORE and shrunk["big"]["size"] > 300_000
            again = await bus.payloads.shrink(value, 256 * 1024)
            assert again == shrunk  # same value, same reference (D21)
            fresh = Bus(bus.nc, bus.js, "other")  # no cache: read back from the object store
            assert await fresh.payloads.expand(shrunk) == value
            assert await bus.payloads.shrink({"a": 1}) == {"a": 1}
        finally:
            await bus.close()

    try:
        asyncio.run(main())
    finally:
        nats.stop()


def test_objects_expire_after_the_retention_and_an_aged_object_is_refreshed():
    nats = EmbeddedNats().start()

    async def main():
        nc = await nats_connect(nats.url)
        try:
            js = nc.jetstream()
            store = PayloadStore(js, retention_s=2.0)
            old = await store.put("a" * 1000)
            await asyncio.sleep(1.2)  # older than half the retention: putting the same value writes it again
            again = await store.put("a" * 1000)
            assert again == old
            gone = await store.put("b" * 1000)
            await asyncio.sleep(1.5)
            # the refreshed object is younger than the retention; the other one has expired
            reader = PayloadStore(js, retention_s=2.0)  # no cache
            assert await reader.get(old) == "a" * 1000
            await asyncio.sleep(1.5)
            with pytest.raises(PayloadMissing, match=f"payload {gone['key']} .* kept 2 s"):
                await PayloadStore(js, retention_s=2.0).get(gone)
        finally:
            await nc.close()

    try:
        asyncio.run(main())
    finally:
        nats.stop()


def test_a_20_mb_result_runs_end_to_end(stack, module_pg):
    doc = {
        "apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "big", "path": "tests/big"},
        "workflow": [
            {"step": "start", "tool": {"kind": "python", "code": f"result = {{'blob': 'x' * {BIG}, 'n': 7}}"},
             "next": {"arcs": [{"step": "measure", "args": {"n": "{{ event.result.n }}"}}]}},
            {"step": "measure", "tool": {"kind": "python", "args": {"blob": "{{ start.result.blob }}", "n": "{{ args.n }}"},
                                         "code": "result = {'length': len(blob), 'n': n}"}},
        ],
    }
    final, events = stack.execute(doc, timeout=120)
    assert final["status"] == "COMPLETED"
    assert final["steps"]["measure"]["result"] == {"length": BIG, "n": 7}
    assert len(final["steps"]["start"]["result"]["blob"]) == BIG  # the gateway shows the value

    async def sizes():
        bus = await Bus.connect(stack.nats_url, "size-test", stack.admin)
        sub = await bus.js.pull_subscribe(f"noetl.pevt.*.*.{final['execution_id']}.*", stream=EVENTS,
                                          config=ConsumerConfig(ack_policy=AckPolicy.NONE,
                                                                deliver_policy=DeliverPolicy.ALL,
                                                                inactive_threshold=5.0))
        msgs = await sub.fetch(1000, timeout=2)
        await bus.close()
        return [len(m.data) for m in msgs]

    message_sizes = stack.run(sizes())
    assert message_sizes and max(message_sizes) < 1024 * 1024
    with psycopg.connect(module_pg) as conn:
        biggest = conn.execute("SELECT max(length(data::text)) FROM event WHERE execution_id = %s",
                               (final["execution_id"],)).fetchone()[0]
    assert biggest < 300 * 1024


def test_a_command_whose_payload_expired_fails_its_run_clearly(fresh_nats):
    from noetl_mesh.services.worker.service import WorkerService

    async def main():
        bus = await Bus.connect(fresh_nats.url, "expired-test")
        await bus.setup(1)
        worker = WorkerService(bus, concurrency=1)
        await worker.start()
        try:
            sub = await bus.js.subscribe("noetl.pevt.>", stream=EVENTS, ordered_consumer=True)
            missing = {"store": STORE, "key": "0" * 64, "size": 999, "checksum": "sha256:" + "0" * 64}
            command = {"command_id": "c1", "pool": "default", "execution_id": "x1", "step": "s",
                       "step_run_id": "r1", "iteration": None, "tasks": [{"name": "t", "kind": "noop"}], "args": missing}
            await bus.send_command(command)
            msg = await sub.next_msg(timeout=10)
            [event] = orjson.loads(msg.data)
            assert (event["name"], event["step_run_id"], event["source"]) == ("step.failed", "r1", "worker:default")
            error = event["data"]["error"]
            assert error["kind"] == "payload_missing" and not error["retryable"]
            assert f"payload {'0' * 64} (999 bytes) is no longer in noetl_payloads" in error["message"]
            lane = f"lane-default-p{lane_of(command)}"
            info = await bus.js.consumer_info(COMMANDS, lane)
            for _ in range(50):  # acknowledged: not redelivered
                if info.num_ack_pending == 0 and info.num_pending == 0:
                    break
                await asyncio.sleep(0.1)
                info = await bus.js.consumer_info(COMMANDS, lane)
            assert info.num_ack_pending == 0 and info.num_pending == 0 and info.delivered.stream_seq
        finally:
            await worker.stop()
            await bus.close()

    asyncio.run(main())


def test_a_command_of_several_large_fields_stays_under_the_message_limit(fresh_nats):
    """Each field under the payload limit, together over the server's max payload (a resume command:
    the child's result plus a continuation): the bus turns fields into references until it fits."""
    from noetl_mesh.infra.bus import MAX_MESSAGE

    async def main():
        bus = await Bus.connect(fresh_nats.url, "big-command")
        await bus.setup(1)
        try:
            fields = {k: "x" * 250_000 for k in ("args", "ctx", "steps", "resume")}
            command = {"command_id": "c1", "pool": "default", "execution_id": "x1", "step": "s",
                       "step_run_id": "r1", "iteration": None, "tasks": [], **fields}
            await (await bus.send_command(command))
            sub = await bus.js.pull_subscribe("noetl.cmd.default.>", "big", stream=COMMANDS)
            [msg] = await sub.fetch(1, timeout=5)
            assert len(msg.data) <= MAX_MESSAGE
            assert await bus.expand(msg.data, orjson.loads(msg.data)) == command
        finally:
            await bus.close()

    asyncio.run(main())
