"""Who may write which event (core/events.py MAY_WRITE) against what the deciders and the worker really
write: every scenario, child executions (requests, results, cancels, the depth limit), loops, admission
errors and lost commands run on the in-process engine, and each event's writer must be allowed to write
it; every entry of the table must be written by one of these runs (no permission nobody uses)."""
from __future__ import annotations

import asyncio
import json
from collections import defaultdict

import pytest
import yaml

from noetl_mesh.core import decide, schedules
from noetl_mesh.core.events import CONTROL_PLANE, MAY_WRITE, engine_stopped, make_event, refused, split_by_writer, writer_of, writers_of
from noetl_mesh.core.local import run_local
from noetl_mesh.core.state import ExecutionState, apply
from noetl_mesh.testing.fixture_api import FixtureApi
from noetl_mesh.tools import close_tools, default_tools
from scenarios import SCENARIOS


def book(path, workflow, **root):
    return {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": path.split("/")[-1], "path": path},
            "workflow": yaml.safe_load(workflow), **root}


SLOW = book("t/slow", "\n".join(f"- step: s{i}\n  tool: {{kind: noop}}\n  next: {{arcs: [{{step: s{i + 1}}}]}}"
                                for i in range(20)) + "\n- step: s20\n  tool: {kind: noop}\n")
CHILD = book("t/child", """
- step: start
  tool: {kind: noop, result: "{{ args.x }}"}
""")
SELF = book("t/self", """
- step: start
  tool: {kind: playbook, path: t/self}
""", executor={"spec": {"policy": {"limits": {"max_depth": 2}}}})
SELF_IN_LOOP = book("t/self_loop", """
- step: start
  loop: {in: "{{ [0] }}", iterator: x}
  tool: {kind: playbook, path: t/self_loop}
""", executor={"spec": {"policy": {"limits": {"max_depth": 1}}}})
CHILD_RUNS = [
    (book("t/p1", """
- step: start
  tool: {kind: noop}
  next: {spec: {mode: inclusive}, arcs: [{step: call}, {step: boom}]}
- step: call
  tool: {kind: playbook, path: t/slow}
- step: boom
  tool: {kind: noop, result: "{{ nope.nothing }}"}
"""), [SLOW]),  # the parent's router cancels a running child; the child's router reports to the parent
    (book("t/p2", """
- step: start
  loop: {in: "{{ [0, 1, 2] }}", iterator: x, spec: {mode: parallel}}
  tool:
    - {name: boom, kind: noop, result: "{{ nope.x if iter.x == 1 else 1 }}"}
    - {name: call, kind: playbook, path: t/slow}
"""), [SLOW]),  # the loop-coordinator requests and cancels iterations' children
    (book("t/p3", """
- step: start
  loop: {in: "{{ [1, 2] }}", iterator: x}
  tool: {kind: playbook, path: t/child, args: {x: "{{ iter.x }}"}}
- step: gate
  tool: {kind: noop}
"""), [CHILD]),
    (SELF, [SELF]),  # admission refuses a step run's child past the depth limit
    (SELF_IN_LOOP, [SELF_IN_LOOP]),  # the loop-coordinator refuses an iteration's child past the limit
    (book("t/p4", """
- step: start
  tool: {kind: noop, result: 1}
  next: {arcs: [{step: gate}]}
- step: gate
  spec: {policy: {admit: {rules: [{when: "{{ nope.nothing }}", then: {allow: true}}]}}}
  tool: {kind: noop}
- step: bare
"""), []),  # an admit rule that cannot be evaluated: admission starts and fails the run
    (book("t/p5", """
- step: start
  next: {arcs: [{step: end}]}
- step: end
  loop: {in: "{{ {} }}", iterator: x}
  tool: {kind: noop}
"""), []),  # a tool-less step (admission starts and ends it); an empty loop
]


TIME = book("t/time", """
- step: start
  tool:
    - {name: nap, kind: wait, duration: 2s}
    - {name: ok, kind: wait, signal: approve, timeout: 1h, schema: {type: object}}
  next: {spec: {delay: 1m}, arcs: [{step: each}]}
- step: each
  spec: {policy: {lifecycle: {timeout_s: 30}}}
  loop: {in: "{{ [1, 2] }}", iterator: x}
  tool: [{name: w, kind: wait, signal: "go-{{ iter.x }}", schema: {type: integer}}, {name: slow, kind: wait, duration: 1h}]
  next: {arcs: [{step: slow_step, when: "{{ event.error.kind == 'timeout' }}"}]}
- step: slow_step
  spec: {policy: {lifecycle: {timeout_s: 5}}}
  tool: {kind: wait, duration: 1h}
  next: {arcs: [{step: done, when: "{{ event.error.kind == 'timeout' }}"}]}
- step: done
  tool: {kind: noop}
""")  # D29, D30: delays, waits, signals (step runs' and iterations', checked against their schemas in the
# control plane: signal.checked), timeouts of a step and a loop step


async def _run(doc, workload=None, catalog=(), signals=()):
    tools = default_tools()
    try:
        return await run_local(doc, workload=workload, tools=tools, signals=signals,
                               catalog={b["metadata"]["path"]: b for b in catalog})
    finally:
        await close_tools(tools)


LOGS: list[list[dict]] = []  # every run's events, as the written fixture made them


@pytest.fixture(scope="module")
def written():
    """(writer, event name) -> how often, over every run (run_local's root request is the gateway's)."""
    seen: dict[tuple[str, str], int] = defaultdict(int)
    bad: list[tuple[str, str, str]] = []

    def note(run) -> None:
        LOGS.append(run.events)
        for e in run.events:
            writer = writer_of(e["source"])
            why = refused(writer, e) if writer else f"unknown source {e['source']!r}"
            if why:
                bad.append((e["source"], e["name"], why))
            seen[(writer, e["name"])] += 1

    api = FixtureApi().start()
    try:
        for s in SCENARIOS:
            doc = s.doc(api.url)
            note(asyncio.run(_run(doc, json.loads(json.dumps(s.workload).replace("API", api.url)))))
        for doc, catalog in CHILD_RUNS:
            note(asyncio.run(_run(doc, catalog=catalog)))
        run = asyncio.run(_run(TIME, signals=[(0, "approve", {}), (70, "go-1", 1), (70, "go-2", 2)]))
        assert run.state.status == "COMPLETED" and "done" in run.state.runs_of, [e["name"] for e in run.log]
        note(run)
    finally:
        api.stop()
    # a lost command (admission) and a worker that cannot read its command (worker:<pool>)
    command = {"command_id": "c1", "execution_id": "x", "step": "s", "step_run_id": "r",
               "chunk": [{"iteration": 0, "command_id": "c1-0"}, {"iteration": 1, "command_id": "c1-1"}]}
    single = {"command_id": "c2", "execution_id": "x", "step": "s", "step_run_id": "r2"}
    for source in ("admission", "worker:default"):
        for c in (command, single):
            for e in decide.lost_command(c, 10, source=source):
                why = refused(writer_of(source), e)
                if why:
                    bad.append((source, e["name"], why))
                seen[(writer_of(source), e["name"])] += 1
    seen[("gateway", "execution.cancelled")] += 1  # POST /api/executions/{id}/cancel (services/gateway)
    for source in CONTROL_PLANE:  # an execution a control-plane service cannot go on with (infra/control.py)
        e = engine_stopped("x", source, "TypeError: ...")
        why = refused(writer_of(source), e)
        if why:
            bad.append((source, e["name"], why))
        seen[(writer_of(source), e["name"])] += 1
    # a schedule's firing (services/scheduler, core/schedules.py)
    record = schedules.definition(schedules.check({"path": "t/child", "every": 5}, now=0, max_bytes=1 << 20),
                                  schedule_id="s1", generation="g", created_by={"user_id": "u"}, now=0)
    firing = schedules.on_firing("noetl.schedule.fire.s1", {"id": "s1", "generation": "g"}, record,
                                 {"Nats-Scheduler": "noetl.schedule.def.s1"}, 5.0, 5.0).start
    why = refused(writer_of(firing["source"]), firing)
    if why:
        bad.append((firing["source"], firing["name"], why))
    seen[(writer_of(firing["source"]), firing["name"])] += 1
    return seen, bad


def test_the_loop_coordinator_has_nothing_to_decide_once_it_is_idle(written):
    """It acknowledges an idle execution's events unread (infra/control.py): fold each log, and after
    ``flat`` every event must have needed no decision of it."""
    idle_runs = 0
    for log in LOGS:
        states: dict[str, ExecutionState] = {}
        for e in log:
            state = states.setdefault(e["execution_id"], ExecutionState(e["execution_id"]))
            was_idle = decide.flat(state)
            if apply(state, e) and was_idle:
                d = decide.loops(state, e)
                assert not (d.events or d.commands or d.foreign or d.timers or d.cancel_runs), (e["name"], d)
        idle_runs += sum(decide.flat(s) for s in states.values())
    assert idle_runs > 20  # most scenarios have no loop


def test_every_event_the_engine_writes_is_allowed_for_its_writer(written):
    seen, bad = written
    assert not bad, bad


def test_every_permission_in_the_table_is_used(written):
    seen, _ = written
    unused = sorted((w, n) for w, names in MAY_WRITE.items() for n in names if (w, n) not in seen)
    assert not unused, f"the table allows what no writer writes: {unused}"


def test_the_runs_cover_the_shared_names():
    """The names several writers share are the ones docs/architecture.md §1 lists."""
    assert set(writers_of("playbook.execution.requested")) == {"gateway", "admission", "loop-coordinator", "scheduler"}
    assert set(writers_of("execution.cancelled")) == {"gateway", "admission", "router", "loop-coordinator"}
    assert set(writers_of("playbook.child.finished")) == {"router", "admission", "loop-coordinator"}
    assert set(writers_of("step.failed")) == {"worker", "admission", "loop-coordinator", "router"}  # router: timeouts
    assert set(writers_of("timer.scheduled")) == {"admission", "router", "loop-coordinator"}
    assert set(writers_of("wait.started")) == set(writers_of("wait.ended")) == {"admission", "loop-coordinator"}
    assert set(writers_of("workflow.finished")) == {"router"}


@pytest.mark.parametrize("source, writer", [
    ("worker:default", "worker"), ("worker:gpu-1", "worker"), ("worker", "worker"), ("router", "router"),
    ("loop-coordinator", "loop-coordinator"), ("worker:", None), ("routerx", None), ("", None), (None, None),
    (7, None), ("event-recorder", None), ("admission:x", None),
])
def test_writer_of_a_source(source, writer):
    assert writer_of(source) == writer


def test_a_worker_cannot_write_control_plane_events_or_speak_for_another_writer():
    ev = make_event("workflow.finished", "x", event_id="e1", source="worker:default")
    assert refused("worker", ev) == "worker may not write 'workflow.finished'"
    lying = make_event("workflow.finished", "x", event_id="e2", source="router")
    assert "is not the writer 'worker'" in refused("worker", lying)  # on the worker's subject, claiming router
    ok = make_event("step.done", "x", event_id="e3", source="worker:default")
    kept, dropped = split_by_writer("worker", [ok, ev, lying, "junk", {"name": "step.done"}])
    assert kept == [ok]
    assert [why for _, why in dropped][2:] == ["not an event: str", "source None is not the writer 'worker' of the subject"]
    assert refused("nobody", ok) == "'nobody' is not a writer"
