"""The control-plane shell's cache (infra/control.py) never keeps a state folded with an event whose
decision was not published: the redelivery of that event must decide again."""
from __future__ import annotations

import asyncio

import pytest
from types import SimpleNamespace

from noetl_mesh.core.decide import Decision
from noetl_mesh.core.events import make_event
from noetl_mesh.infra.bus import handle_one
from noetl_mesh.infra.control import PartitionedService


class FlakyBus:
    """Publishing fails ``failures`` times (a stream without a leader for a moment), then works."""

    def __init__(self, failures: int, log: list | None = None):
        self.failures, self.published, self.log = failures, [], log or []

    async def execution_events(self, execution_id, partition, classes):
        return list(self.log)

    async def publish_all(self, events, commands=(), timers=(), flat=None):
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
    subject = "noetl.pevt.0.ctl.e1.gateway"
    metadata = SimpleNamespace(num_delivered=1)

    def __init__(self):
        self.acked = self.dropped = 0

    async def ack(self):
        self.acked += 1

    async def term(self):
        self.dropped += 1


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
    assert bus.published == [(["step.scheduled"], ["c-r1"])]
    assert msg.acked == 0  # its reader acks, once the handler has returned (infra/pinned.py)


def test_an_event_that_cannot_be_folded_is_dropped_alone_live_and_on_rebuild():
    """A malformed event (a ``step.done`` without its run) is dropped; the execution's later events
    are still handled, from the cached state and from a rebuild (after a resync dropped the cache)."""
    request = make_event("playbook.execution.requested", "e1", event_id="r1", source="gateway", data={})
    bad = make_event("step.done", "e1", event_id="b1", source="worker:default", data={})
    bad.pop("step_run_id", None)
    later = [make_event("execution.cancelled", "e1", event_id=f"n{i}", source="gateway") for i in (1, 2)]
    log = [(1, request), (2, bad), (3, later[0]), (4, later[1])]
    bus = FlakyBus(failures=0, log=log)
    service = Scheduler(bus)

    async def deliver(seq, event):
        msg = Delivery()
        error = await handle_one(msg, lambda m: service._handle(m, 0, SimpleNamespace(stream=seq), "e1", [event]))
        return error, msg

    async def main():
        outcomes = [await deliver(seq, event) for seq, event in log[:2]]
        assert "e1" not in service.cache  # its state may have folded part of the message: rebuilt next
        outcomes.append(await deliver(*log[2]))
        service._drop_partition(0)  # a resync: the next event rebuilds from the log
        outcomes.append(await deliver(*log[3]))
        return outcomes

    outcomes = asyncio.run(main())
    assert [bool(error) for error, _ in outcomes] == [False, True, False, False]
    assert [(m.acked, m.dropped) for _, m in outcomes] == [(0, 0), (0, 1), (0, 0), (0, 0)]  # the reader acks
    # and the execution, which cannot go on, is stopped once (dsl.md D18, "When the engine cannot go on")
    assert [names for names, _ in bus.published].count(["execution.cancelled"]) == 1


def test_a_finished_execution_leaves_the_cache_and_its_later_events_are_acknowledged_unfolded():
    """Once an execution has finished, no service has anything more to decide for it: its state is
    dropped (kept as IDLE), and a late event (a redelivery, a cancel) is handled (and acknowledged by the
    reader) without a fold or a decision. A running execution's state stays."""
    from noetl_mesh.infra.control import IDLE

    bus = FlakyBus(failures=0)
    service = Scheduler(bus)
    decided: list[str] = []
    inner = service.decide

    async def counting(state, event):
        decided.append(event["name"])
        return await inner(state, event) if event["name"] == "playbook.execution.requested" else Decision()

    service.decide = counting
    request = make_event("playbook.execution.requested", "e1", event_id="r1", source="gateway", data={})
    started = make_event("workflow.started", "e1", event_id="w1", source="router", data={})
    finished = make_event("workflow.finished", "e1", event_id="f1", source="router", data={"status": "COMPLETED"})
    late = make_event("execution.cancelled", "e1", event_id="c1", source="gateway")

    async def main():
        msgs = []
        for i, event in enumerate((request, started, finished, late), 1):
            msgs.append(Delivery())
            await service._handle(msgs[-1], 0, SimpleNamespace(stream=i), "e1", [event])
            if event is started:
                assert service.cache["e1"] is not IDLE and service.cache["e1"].status == "RUNNING"
        return msgs

    msgs = asyncio.run(main())
    assert service.cache["e1"] is IDLE
    assert decided == ["playbook.execution.requested", "workflow.started", "workflow.finished"]  # not the late one
    assert [m.acked for m in msgs] == [0, 0, 0, 0]  # the reader acks what its handler returned from


# ------------------------------------------------------------------ a child's request: two lookups at once
CHILD_YAML = """apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: child, path: t/child}
workflow:
  - step: start
    tool: {kind: noop, result: 1}
"""


class ChildBus(FlakyBus):
    """The log lookup (``first_seq``) answers only once the catalog has been asked: a service that asks
    one after the other never gets its answer."""

    def __init__(self, first: int | None, log: list | None = None):
        super().__init__(0, log)
        self.first, self.asked, self.catalog_asked = first, asyncio.Event(), 0
        self.commands: list[dict] = []
        self.events: list[dict] = []
        self.counted: list[tuple[str, str]] = []  # (root, child), as the trees' counter was told
        self.totals: list[int] = []  # what it answers (default: one more each time)

    async def count_child(self, root, child):
        self.counted.append((root, child))
        return self.totals.pop(0) if self.totals else len(self.counted)

    async def first_seq(self, execution_id, partition):
        await asyncio.wait_for(self.asked.wait(), 10)
        return self.first

    async def request(self, subject, body, expand=False):
        self.catalog_asked += 1
        self.asked.set()
        await asyncio.sleep(0)
        return {"content": CHILD_YAML}

    async def publish_all(self, events, commands=(), timers=(), flat=None):
        await super().publish_all(events, commands, timers, flat)
        self.commands += commands
        self.events += events


def child_request(eid: str = "c1") -> dict:
    return make_event("playbook.execution.requested", eid, event_id="request", source="admission",
                      data={"catalog": {"path": "t/child"}, "parent_execution_id": "p1", "depth": 1,
                            "parent": {"execution_id": "p1", "step": "s", "step_run_id": "r"}})


def test_admission_asks_the_catalog_while_the_log_says_whether_a_childs_request_comes_first():
    from noetl_mesh.services.admission.service import AdmissionService

    bus = ChildBus(first=7)
    service = AdmissionService(bus)
    asyncio.run(service._handle(Delivery(), 3, SimpleNamespace(stream=7), "c1", [child_request()]))
    assert bus.catalog_asked == 1  # asked once, and its answer used
    assert [c["step"] for c in bus.commands] == ["start"]  # the child started
    assert service.resolving == {}
    assert bus.counted == [("p1", "c1")]  # counted in its tree (an old request names no root: its parent's)


@pytest.mark.parametrize("total, starts", [(3, True), (4, False)])
def test_a_child_past_its_trees_limit_fails_at_its_request(total, starts):
    """D19: admission counts a child in its root's tree as it evaluates the request; past
    max_tree_executions the request is refused, naming the limit (a total of None: this child was
    counted before, its request evaluated again: the count answers the total now)."""
    from noetl_mesh import limits
    from noetl_mesh.services.admission.service import AdmissionService

    bus = ChildBus(first=7)
    bus.totals = [total]
    request = child_request()
    request["data"]["root_execution_id"] = "root1"
    with limits.override(max_tree_executions=3):
        asyncio.run(AdmissionService(bus)._handle(Delivery(), 3, SimpleNamespace(stream=7), "c1", [request]))
    assert bus.counted == [("root1", "c1")]
    assert bool(bus.commands) is starts
    [(names, _)] = bus.published
    assert names[0] == "playbook.request.evaluated"
    if not starts:
        [evaluated] = bus.events
        assert evaluated["status"] == "error" and evaluated["data"]["kind"] == "limit_exceeded"
        [error] = evaluated["data"]["errors"]
        assert "child execution c1" in error and "is 4 executions, over the limit max_tree_executions = 3" in error
        assert "NOETL_LIMIT_MAX_TREE_EXECUTIONS" in error


def test_a_childs_request_after_its_cancellation_starts_nothing_and_drops_its_lookup():
    """The log says the request is not first (its cancellation came before): the state is rebuilt, the
    child starts nothing, and the catalog's answer, not needed, is let go."""
    from noetl_mesh.services.admission.service import AdmissionService

    from noetl_mesh.core import decide
    from noetl_mesh.core.state import ExecutionState, apply

    cancel = make_event("execution.cancelled", "c1", event_id="cancel", source="router", data={"reason": "parent ended"})
    router = ExecutionState("c1")
    apply(router, cancel)
    finished = decide.router(router, cancel).events  # the child's router ends it at once
    bus = ChildBus(first=5, log=[(5, cancel), *((6, e) for e in finished)])
    service = AdmissionService(bus)
    asyncio.run(service._handle(Delivery(), 3, SimpleNamespace(stream=7), "c1", [child_request()]))
    assert bus.commands == [] and bus.published == []
    assert service.resolving == {}


class Retried(Delivery):
    def __init__(self):
        super().__init__()
        self.naks = 0
        self.metadata = SimpleNamespace(num_delivered=1)

    async def nak(self, delay=None):
        self.naks += 1


def test_what_no_retry_cures_is_dropped_and_what_may_pass_is_retried():
    """The same on every delivery (a value that cannot be encoded, a recursion, an overflow): dropped at
    once, not retried for the minutes of its deliveries while its partition waits behind it."""
    async def outcome(exc):
        msg = Retried()

        async def handle(_):
            raise exc

        error = await handle_one(msg, handle)
        return error.split(" ")[0], msg.dropped, msg.naks

    for exc in (TypeError("Integer exceeds 64-bit range"), RecursionError("maximum recursion depth exceeded"),
                OverflowError("int too large"), KeyError("step"), ValueError("bad JSON")):
        assert asyncio.run(outcome(exc)) == ("dropped", 1, 0), exc
    for exc in (ConnectionError("no responders"), asyncio.TimeoutError(), RuntimeError("stream without a leader")):
        assert asyncio.run(outcome(exc)) == ("retrying", 0, 1), exc


def test_an_event_that_fails_on_its_last_delivery_stops_its_execution():
    """Retried ~10 minutes (a service it needs away all along), the event is then delivered no more:
    its execution is stopped saying so, not left RUNNING. Before the last delivery it is only retried."""
    request = make_event("playbook.execution.requested", "e1", event_id="r1", source="gateway", data={})

    async def deliver(n):
        bus = FlakyBus(failures=1)
        service = Scheduler(bus)
        msg = Delivery()
        msg.metadata = SimpleNamespace(num_delivered=n)
        with_stop = bus.publish_all

        async def publish_all(events, commands=(), timers=(), flat=None):
            if events and events[0]["name"] == "execution.cancelled":
                bus.failures = 0
            await with_stop(events, commands, timers, flat)

        bus.publish_all = publish_all
        try:
            await service._handle(msg, 0, SimpleNamespace(stream=1), "e1", [request])
        except ConnectionError:
            pass
        return bus.published

    assert asyncio.run(deliver(49)) == []
    [(names, _)] = asyncio.run(deliver(50))
    assert names == ["execution.cancelled"]


def test_a_child_runs_uncounted_when_the_trees_counters_cannot_be_used():
    """A stack set up by an earlier version has no NOETL_TREES (admission says so as it starts): its
    children run, uncounted, rather than wait on a count that cannot be had."""
    from noetl_mesh.services.admission.service import AdmissionService

    bus = ChildBus(first=7)
    service = AdmissionService(bus)
    service.counting = False
    asyncio.run(service._handle(Delivery(), 3, SimpleNamespace(stream=7), "c1", [child_request()]))
    assert bus.counted == [] and [c["step"] for c in bus.commands] == ["start"]
