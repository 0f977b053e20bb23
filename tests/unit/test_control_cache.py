"""The control-plane shell's cache (infra/control.py) never keeps a state folded with an event whose
decision was not published: the redelivery of that event must decide again."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from noetl_mesh.core.decide import Decision
from noetl_mesh.core.events import make_event
from noetl_mesh.infra.control import PartitionedService


class FlakyBus:
    """Publishing fails ``failures`` times (a stream without a leader for a moment), then works."""

    def __init__(self, failures: int):
        self.failures, self.published = failures, []

    async def publish_all(self, events, commands=(), timers=()):
        if self.failures:
            self.failures -= 1
            raise ConnectionError("no response from stream")
        self.published.append(([e["name"] for e in events], [c["command_id"] for c in commands]))


class Scheduler(PartitionedService):
    """Decides one event and one command for each request it folds."""

    name = "probe"

    async def decide(self, state, event):
        return Decision(events=[make_event("step.scheduled", state.execution_id, event_id=f"s-{event['event_id']}",
                                           source=self.name)],
                        commands=[{"command_id": f"c-{event['event_id']}"}])


class Delivery:
    headers = None

    def __init__(self):
        self.acked = 0

    async def ack(self):
        self.acked += 1


def test_a_decision_that_was_not_published_is_made_again_on_redelivery():
    bus = FlakyBus(failures=1)
    service = Scheduler(bus)
    request = make_event("playbook.execution.requested", "e1", event_id="r1", source="gateway", data={})
    msg, seq = Delivery(), SimpleNamespace(stream=1)

    async def main():
        try:
            await service._handle(msg, 0, seq, "e1", [request])
        except ConnectionError:
            pass
        else:
            raise AssertionError("the first publish should have failed")
        assert "e1" not in service.cache  # folded, not published: forgotten
        await service._handle(msg, 0, seq, "e1", [request])  # redelivered (no resync in between)

    asyncio.run(main())
    assert bus.published == [(["step.scheduled"], ["c-r1"])] and msg.acked == 1
