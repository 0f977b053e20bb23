"""D23: results larger than the payload limit travel as object-store references; templates, the
gateway and `noetl run --json` see the value; no message and no event row carries it."""
from __future__ import annotations

import asyncio

import psycopg
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from noetl_mesh.infra.bus import EVENTS, Bus
from noetl_mesh.infra.embedded import EmbeddedNats
from noetl_mesh.infra.payloads import STORE, is_ref

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
        bus = await Bus.connect(stack.stack.settings.nats_url, "size-test")
        sub = await bus.js.pull_subscribe(f"noetl.pevt.*.*.{final['execution_id']}", stream=EVENTS,
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
