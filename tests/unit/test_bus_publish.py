"""Bus.publish_all writes a decision's commands only once its events are stored: a worker's report of
a command must never reach the log before the events that decided it (a rebuild folds the log in
order and would drop the report)."""
from __future__ import annotations

import asyncio

from noetl_mesh.core.events import make_event
from noetl_mesh.infra.bus import Bus


class FakeJetStream:
    """Records what is published; each PubAck arrives when the test says."""

    def __init__(self):
        self.written: list[str] = []
        self.acks: list[asyncio.Future] = []

    async def publish_async(self, subject, payload, stream=None, headers=None):
        self.written.append(subject)
        ack = asyncio.get_running_loop().create_future()
        self.acks.append(ack)
        return ack

    def ack_all(self):
        for ack in self.acks:
            if not ack.done():
                ack.set_result(None)


def test_commands_and_timers_wait_for_the_events_to_be_stored():
    bus = Bus.__new__(Bus)
    bus.js = FakeJetStream()
    event = make_event("step.scheduled", "e1", event_id="s1", source="admission", step="a", step_run_id="r1")
    command = {"command_id": "c1", "pool": "default", "execution_id": "e1", "step": "a"}
    timer = {"execution_id": "e1", "timer_id": "t1", "due": 2e9,
             "event": make_event("timer.fired", "e1", event_id="f1", source="timer")}

    async def main():
        publishing = asyncio.create_task(bus.publish_all([event], [command], timers=[timer]))
        await asyncio.sleep(0.05)
        assert [s.split(".")[1] for s in bus.js.written] == ["evt"]  # the command waits for the event's PubAck
        bus.js.ack_all()
        await asyncio.sleep(0.05)
        assert [s.split(".")[1] for s in bus.js.written] == ["evt", "cmd", "sched"] and not publishing.done()
        bus.js.ack_all()
        await asyncio.wait_for(publishing, 1)

    asyncio.run(main())


def test_no_command_is_sent_when_the_events_are_not_stored():
    bus = Bus.__new__(Bus)
    bus.js = FakeJetStream()
    event = make_event("step.scheduled", "e1", event_id="s1", source="admission", step="a", step_run_id="r1")
    other = make_event("playbook.execution.requested", "e2", event_id="q1", source="admission")
    command = {"command_id": "c1", "pool": "default", "execution_id": "e1", "step": "a"}

    async def main():
        publishing = asyncio.create_task(bus.publish_all([other, event], [command]))
        await asyncio.sleep(0.05)
        assert [s.split(".")[1] for s in bus.js.written] == ["evt", "evt"]  # one message per execution
        bus.js.acks[0].set_result(None)
        bus.js.acks[1].set_exception(ConnectionError("no response from stream"))
        try:
            await asyncio.wait_for(publishing, 1)
        except ConnectionError:
            pass
        else:
            raise AssertionError("publish_all should have failed")
        assert [s.split(".")[1] for s in bus.js.written] == ["evt", "evt"]  # the command never left

    asyncio.run(main())


def test_a_request_is_answered_at_an_inbox_only():
    """NATS lets a responder publish to whatever reply subject the requester names, past the
    responder's own permissions: a service answers a request whose reply is an inbox, and no other."""
    from types import SimpleNamespace

    bus = Bus.__new__(Bus)
    bus.name, bus.endpoints = "noetl-probe", {}
    callbacks, answered, asked = [], [], []

    class Nc:
        async def subscribe(self, subject, queue=None, cb=None):
            callbacks.append(cb)

    async def handler(request):
        asked.append(request)
        return {"ok": True}

    def message(reply):
        async def respond(data):
            answered.append((reply, data))
        return SimpleNamespace(data=b'{"x": 1}', reply=reply, headers=None, respond=respond)

    bus.nc = Nc()

    async def main():
        await bus.serve("noetl.q.probe", handler, "probe")
        for reply in ("noetl.cancel.x1", "$KV.noetl_members.admission.x", "", "_INBOX.", "_INBOX.Ukey.abc"):
            await callbacks[0](message(reply))

    asyncio.run(main())
    assert [r for r, _ in answered] == ["_INBOX.Ukey.abc"] and asked == [{"x": 1}]
    assert bus.endpoints["noetl.q.probe"].failed == 4 and "not an inbox" in bus.endpoints["noetl.q.probe"].last_error
