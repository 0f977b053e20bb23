"""The execution core (fold + decide) run in-process: routing, joins, admission, failures, loops, ctx,
completion, replay, and the same outcome under random interleavings of services and workers."""
from __future__ import annotations

import asyncio
import copy

import pytest
import yaml

from noetl_mesh.core.local import run_local
from noetl_mesh.core.state import apply, fold, summary
from noetl_mesh.testing.fakes import FakeHttp
from noetl_mesh.tools.noop import NoopTool


def play(workflow, workload=None, **root):
    return {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "t", "path": "t/t"},
            "workload": workload or {}, "workflow": yaml.safe_load(workflow) if isinstance(workflow, str) else workflow,
            **root}


def run(doc, seed=None, workload=None):
    tools = {"noop": NoopTool(), "http": FakeHttp()}
    return asyncio.run(run_local(doc, tools=tools, seed=seed, workload=workload))


def outcome(doc, **kw):
    r = run(doc, **kw)
    return summary(r.state), r


def names(r, step=None):
    return [e["name"] for e in r.log if step is None or e["step"] == step]


# ------------------------------------------------------------------------------------------ basics
LINEAR = """
- step: start
  tool: {kind: noop, result: 1}
  next: {arcs: [{step: b, args: {x: "{{ event.result + 1 }}"}}]}
- step: b
  tool: {kind: noop, result: "{{ args.x * 10 }}"}
  next: {arcs: [{step: end}]}
- step: end
  tool: {kind: noop}
"""


def test_linear_chain_results_args_and_events():
    s, r = outcome(play(LINEAR))
    assert s["status"] == "COMPLETED"
    assert s["steps"]["b"] == {"status": "done", "runs": 1, "result": 20}
    assert s["steps"]["end"]["result"] is None  # D10: noop without result passes _prev (none)
    order = names(r)
    assert order[:4] == ["playbook.execution.requested", "playbook.request.evaluated", "workflow.started", "token.enqueued"]
    assert order[-2:] == ["workflow.finished", "playbook.processed"]
    assert order.index("step.done") < order.index("next.evaluated")


def test_earlier_step_results_readable_by_name():
    doc = play("""
- step: start
  tool: {kind: noop, result: {n: 5}}
  next: {arcs: [{step: b}]}
- step: b
  tool: {kind: noop, result: "{{ start.result.n * 2 }}"}
""")
    s, _ = outcome(doc)
    assert s["steps"]["b"]["result"] == 10


def test_workload_override_deep_merges():
    doc = play(LINEAR.replace("result: 1", "result: '{{ workload.a.b + workload.c }}'"), workload={"a": {"b": 1, "k": 0}, "c": 1})
    s, _ = outcome(doc, workload={"a": {"b": 5}})
    assert s["workload"] == {"a": {"b": 5, "k": 0}, "c": 1}
    assert s["steps"]["start"]["result"] == 6


def test_invalid_playbook_fails_execution():
    doc = play(LINEAR)
    doc["workflow"][0]["next"]["arcs"][0]["step"] = "nowhere"
    s, r = outcome(doc)
    assert s["status"] == "FAILED"
    evaluated = next(e for e in r.log if e["name"] == "playbook.request.evaluated")
    assert evaluated["status"] == "error" and "nowhere" in evaluated["data"]["errors"][0]


def test_step_without_tool_is_done_at_once_with_null():
    doc = play("""
- step: start
  next: {arcs: [{step: end}]}
- step: end
  tool: {kind: noop, result: ok}
""")
    s, r = outcome(doc)
    assert s["steps"]["start"] == {"status": "done", "runs": 1, "result": None}
    assert names(r, "start")[:4] == ["token.enqueued", "step.admitted", "step.started", "step.done"]


# ------------------------------------------------------------------------------------------ arcs
def test_exclusive_first_match_wins():
    doc = play("""
- step: start
  tool: {kind: noop, result: 5}
  next:
    arcs:
      - {step: small, when: "{{ event.result < 3 }}"}
      - {step: big, when: "{{ event.result >= 3 }}"}
      - {step: also, when: "{{ true }}"}
- {step: small, tool: {kind: noop}}
- {step: big, tool: {kind: noop}}
- {step: also, tool: {kind: noop}}
""")
    s, _ = outcome(doc)
    assert set(s["steps"]) == {"start", "big"}


def test_inclusive_all_matches_fire():
    doc = play("""
- step: start
  tool: {kind: noop, result: 5}
  next:
    spec: {mode: inclusive}
    arcs:
      - {step: small, when: "{{ event.result < 3 }}"}
      - {step: big, when: "{{ event.result >= 3 }}"}
      - {step: also}
- {step: small, tool: {kind: noop}}
- {step: big, tool: {kind: noop}}
- {step: also, tool: {kind: noop}}
""")
    s, _ = outcome(doc)
    assert set(s["steps"]) == {"start", "big", "also"}


FAILING = """
- step: start
  tool: {kind: http, url: "error:500"}
  next:
    arcs:
      - {step: on_ok}
      - {step: on_fail, when: "{{ event.name == 'step.failed' }}"}
- {step: on_ok, tool: {kind: noop}}
- {step: on_fail, tool: {kind: noop, result: "{{ args | length }}"}}
"""


def test_arc_without_when_never_matches_failure_and_failure_routed():
    s, _ = outcome(play(FAILING))
    assert s["status"] == "COMPLETED"  # the failure was handled by an arc (D15)
    assert s["steps"]["start"]["status"] == "failed"
    assert "on_ok" not in s["steps"] and "on_fail" in s["steps"]


def test_call_error_alias_in_when():
    s, _ = outcome(play(FAILING.replace("'step.failed'", "'call.error'")))
    assert "on_fail" in s["steps"]


def test_event_error_in_arc_context():
    doc = play(FAILING.replace("result: \"{{ args | length }}\"", "result: \"{{ args.kind }}\"").replace(
        "{step: on_fail, when: \"{{ event.name == 'step.failed' }}\"}",
        "{step: on_fail, when: \"{{ event.name == 'step.failed' }}\", args: {kind: \"{{ event.error.kind }}\"}}"))
    s, _ = outcome(doc)
    assert s["steps"]["on_fail"]["result"] == "http_error"


def test_unhandled_failure_fail_fast_fails_execution():
    doc = play("""
- step: start
  next: {spec: {mode: inclusive}, arcs: [{step: bad}, {step: slow}]}
- step: bad
  tool: {kind: http, url: "error:404"}
  next: {arcs: [{step: after}]}
- step: slow
  tool: {kind: noop}
  next: {arcs: [{step: after2}]}
- {step: after, tool: {kind: noop}}
- {step: after2, tool: {kind: noop}}
""")
    s, r = outcome(doc)
    assert s["status"] == "FAILED"
    assert "after" not in s["steps"]
    finished = next(e for e in r.log if e["name"] == "workflow.finished")
    assert finished["data"]["error"]["kind"] == "http_error"


def test_unhandled_failure_best_effort_ends_branch_only():
    doc = play("""
- step: start
  next: {spec: {mode: inclusive}, arcs: [{step: bad}, {step: good}]}
- step: bad
  spec: {policy: {failure: {mode: best_effort}}}
  tool: {kind: http, url: "error:404"}
  next: {arcs: [{step: after}]}
- step: good
  tool: {kind: noop, result: 1}
  next: {arcs: [{step: after2}]}
- {step: after, tool: {kind: noop}}
- {step: after2, tool: {kind: noop}}
""")
    s, _ = outcome(doc)
    # D18: a best_effort failure ends its branch only; the execution completes and the failed step
    # keeps its status
    assert s["status"] == "COMPLETED"
    assert s["steps"]["bad"]["status"] == "failed"
    assert s["steps"]["after2"]["status"] == "done" and "after" not in s["steps"]


# ------------------------------------------------------------------------------------------ joins
FORK_JOIN = """
- step: start
  next:
    spec: {mode: inclusive}
    arcs:
      - {step: a, when: "{{ workload.a }}", args: {from_start: 1}}
      - {step: b, when: "{{ workload.b }}"}
      - {step: c, when: "{{ workload.c }}"}
- step: a
  tool: {kind: noop, result: A}
  next: {arcs: [{step: join, args: {a: "{{ event.result }}", who: a}}]}
- step: b
  tool: [{kind: noop, result: B1}, {kind: noop, result: B2}]
  next: {arcs: [{step: join, args: {b: "{{ event.result }}", who: b}}]}
- step: c
  tool: {kind: noop, result: C}
  next: {arcs: [{step: join, args: {c: "{{ event.result }}", who: c}}]}
- step: join
  tool: {kind: noop, result: "{{ args }}"}
"""


@pytest.mark.parametrize("seed", [None, 1, 2, 3, 4, 5, 6, 7])
def test_join_fires_once_after_every_taken_branch(seed):
    s, _ = outcome(play(FORK_JOIN, {"a": True, "b": True, "c": True}), seed=seed)
    assert s["status"] == "COMPLETED"
    assert s["steps"]["join"]["runs"] == 1
    # D16: args merged in the workflow order of the source steps, a later key replaces an earlier one
    assert s["steps"]["join"]["result"] == {"a": "A", "b": "B2", "c": "C", "who": "c"}


@pytest.mark.parametrize("seed", [None, 11, 12, 13])
def test_branch_not_taken_does_not_block_join(seed):
    s, _ = outcome(play(FORK_JOIN, {"a": True, "b": False, "c": True}), seed=seed)
    assert s["steps"]["join"] == {"status": "done", "runs": 1, "result": {"a": "A", "c": "C", "who": "c"}}


def test_admission_denial_does_not_block_join():
    doc = play(FORK_JOIN, {"a": True, "b": True, "c": True})
    doc["workflow"][2]["spec"] = {"policy": {"admit": {"rules": [{"else": {"then": {"allow": False}}}]}}}
    s, r = outcome(doc)
    assert s["steps"]["b"] == {"status": "skipped", "runs": 0, "result": None}
    assert s["steps"]["join"]["runs"] == 1 and "b" not in s["steps"]["join"]["result"]
    assert "step.skipped" in names(r, "b")


def test_best_effort_failure_does_not_block_join():
    doc = play(FORK_JOIN, {"a": True, "b": True, "c": True})
    doc["workflow"][3]["tool"] = {"kind": "http", "url": "error:500"}
    doc["workflow"][3]["spec"] = {"policy": {"failure": {"mode": "best_effort"}}}
    s, _ = outcome(doc)
    assert s["steps"]["join"]["runs"] == 1
    # D18: a best_effort failure ends its branch; the execution completes, the step keeps its status
    assert s["status"] == "COMPLETED"
    assert s["steps"]["c"]["status"] == "failed"


def test_join_any_fires_per_token():
    doc = play(FORK_JOIN, {"a": True, "b": True, "c": True})
    doc["workflow"][4]["spec"] = {"join": "any"}
    s, _ = outcome(doc)
    assert s["steps"]["join"]["runs"] == 3


def test_inclusive_arcs_into_a_join_two_places_from_one_step():
    doc = play("""
- step: start
  tool: {kind: noop, result: 1}
  next:
    spec: {mode: inclusive}
    arcs:
      - {step: join, args: {first: 1}}
      - {step: join, when: "{{ event.result > 5 }}", args: {second: 2}}
      - {step: join, args: {third: 3}}
- step: join
  tool: {kind: noop, result: "{{ args }}"}
""")
    s, _ = outcome(doc)
    assert s["steps"]["join"] == {"status": "done", "runs": 1, "result": {"first": 1, "third": 3}}


CYCLE_BEFORE_JOIN = """
- step: start
  next: {spec: {mode: inclusive}, arcs: [{step: poll, args: {n: 0}}, {step: side}]}
- step: poll
  tool:
    - name: bump
      kind: noop
      result: "{{ args.n + 1 }}"
  next:
    arcs:
      - {step: poll, when: "{{ event.result < 3 }}", args: {n: "{{ event.result }}"}}
      - {step: join, args: {polled: "{{ event.result }}"}}
- step: side
  tool: {kind: noop, result: s}
  next: {arcs: [{step: join, args: {side: "{{ event.result }}"}}]}
- step: join
  tool: {kind: noop, result: "{{ args }}"}
"""


@pytest.mark.parametrize("seed", [None, 21, 22, 23, 24, 25])
def test_back_edge_cycle_upstream_of_a_join(seed):
    s, _ = outcome(play(CYCLE_BEFORE_JOIN), seed=seed)
    assert s["status"] == "COMPLETED"
    assert s["steps"]["poll"]["runs"] == 3
    assert s["steps"]["join"] == {"status": "done", "runs": 1, "result": {"polled": 3, "side": "s"}}


def test_back_edge_fires_step_on_its_own_each_time():
    doc = play("""
- step: start
  tool: {kind: noop, result: 0}
  next: {arcs: [{step: loop, args: {i: 0}}]}
- step: loop
  tool: {kind: noop, result: "{{ args.i + 1 }}"}
  next:
    arcs:
      - {step: loop, when: "{{ event.result < 5 }}", args: {i: "{{ event.result }}"}}
      - {step: done}
- {step: done, tool: {kind: noop, result: "{{ loop.result }}"}}
""")
    s, _ = outcome(doc)
    assert s["steps"]["loop"]["runs"] == 5 and s["steps"]["done"]["result"] == 5


# ------------------------------------------------------------------------------------------ admission
def test_admission_rules_first_match_and_args():
    doc = play("""
- step: start
  next: {spec: {mode: inclusive}, arcs: [{step: gate, args: {n: 1}}, {step: gate2, args: {n: 9}}]}
- step: gate
  spec:
    policy:
      admit:
        rules:
          - when: "{{ args.n > 5 }}"
            then: {allow: true}
          - else: {then: {allow: false}}
  tool: {kind: noop, result: in}
- step: gate2
  spec:
    policy:
      admit:
        rules:
          - when: "{{ args.n > 5 }}"
            then: {allow: true}
          - else: {then: {allow: false}}
  tool: {kind: noop, result: in}
""")
    s, _ = outcome(doc)
    assert s["steps"]["gate"]["status"] == "skipped" and s["steps"]["gate2"]["status"] == "done"


# ------------------------------------------------------------------------------------------ ctx (D12)
def test_set_ctx_visible_to_later_tasks_and_steps():
    doc = play("""
- step: start
  tool:
    - name: a
      kind: noop
      result: 7
      spec: {policy: {rules: [{else: {then: {do: continue, set_ctx: {seven: "{{ outcome.result }}"}}}}]}}
    - name: b
      kind: noop
      result: "{{ ctx.seven + 1 }}"
  next: {arcs: [{step: later}]}
- step: later
  tool: {kind: noop, result: "{{ ctx.seven * 2 }}"}
""")
    s, r = outcome(doc)
    assert s["ctx"] == {"seven": 7}
    assert s["steps"]["start"]["result"] == 8 and s["steps"]["later"]["result"] == 14
    assert "ctx.patched" in names(r)


# ------------------------------------------------------------------------------------------ loops (D19)
LOOP = """
- step: start
  loop:
    in: "{{ workload.items }}"
    iterator: item
    spec: {mode: MODE, max_in_flight: 2}
  tool:
    - name: f
      kind: noop
      result: "{{ iter.item * 10 + iter.index }}"
  next: {arcs: [{step: after, when: "{{ event.name == 'loop.done' }}", args: {r: "{{ event.result }}", n: "{{ event.done }}"}}]}
- step: after
  tool: {kind: noop, result: "{{ args }}"}
"""


@pytest.mark.parametrize("mode,seed", [("sequential", None), ("parallel", None), ("parallel", 31), ("parallel", 32)])
def test_loop_results_ordered_by_index(mode, seed):
    s, r = outcome(play(LOOP.replace("MODE", mode), {"items": [1, 2, 3, 4, 5]}), seed=seed)
    assert s["steps"]["start"] == {"status": "done", "runs": 1, "result": [10, 21, 32, 43, 54]}
    assert s["steps"]["after"]["result"] == {"r": [10, 21, 32, 43, 54], "n": 5}
    assert names(r).count("loop.iteration.done") == 5 and names(r).count("loop.done") == 1


def test_parallel_loop_respects_max_in_flight():
    s, r = outcome(play(LOOP.replace("MODE", "parallel"), {"items": list(range(9))}), seed=5)
    in_flight = peak = 0
    for e in r.log:
        if e["name"] == "loop.iteration.started":
            in_flight += 1
            peak = max(peak, in_flight)
        elif e["name"] in ("loop.iteration.done", "loop.iteration.failed"):
            in_flight -= 1
    assert peak == 2


def test_empty_loop_ends_at_once():
    s, r = outcome(play(LOOP.replace("MODE", "parallel"), {"items": []}))
    assert s["steps"]["start"]["result"] == []
    assert "loop.iteration.started" not in names(r)


def test_sequential_loop_sees_ctx_of_previous_iteration():
    doc = play("""
- step: start
  loop: {in: "{{ workload.items }}", iterator: x}
  tool:
    kind: noop
    result: "{{ ctx.total | default(0) + iter.x }}"
    spec: {policy: {rules: [{else: {then: {do: continue, set_ctx: {total: "{{ outcome.result }}"}}}}]}}
""", {"items": [1, 2, 3, 4]})
    s, _ = outcome(doc)
    assert s["steps"]["start"]["result"] == [1, 3, 6, 10] and s["ctx"]["total"] == 10


LOOP_FAIL = """
- step: start
  spec: {policy: {failure: {mode: MODE}}}
  loop: {in: "{{ workload.items }}", iterator: u}
  tool: {kind: http, url: "{{ iter.u }}"}
  next:
    arcs:
      - {step: ok, when: "{{ event.name == 'loop.done' }}", args: {failed: "{{ event.failed }}", done: "{{ event.done }}"}}
      - {step: bad, when: "{{ event.name == 'step.failed' }}", args: {failed: "{{ event.failed }}", total: "{{ event.total }}"}}
- {step: ok, tool: {kind: noop, result: "{{ args }}"}}
- {step: bad, tool: {kind: noop, result: "{{ args }}"}}
"""


def test_loop_fail_fast_stops_at_first_failure():
    items = ['ok:1', 'error:500', 'ok:3', 'ok:4']
    s, r = outcome(play(LOOP_FAIL.replace("MODE", "fail_fast"), {"items": items}))
    assert s["steps"]["bad"]["result"] == {"failed": 1, "total": 4}
    assert names(r).count("loop.iteration.started") == 2  # sequential: nothing after the failure
    assert s["steps"]["start"]["status"] == "failed"


def test_loop_best_effort_runs_all_and_counts():
    items = ['ok:1', 'error:500', 'ok:3']
    s, _ = outcome(play(LOOP_FAIL.replace("MODE", "best_effort"), {"items": items}))
    assert s["steps"]["ok"]["result"] == {"failed": 1, "done": 2}
    assert s["steps"]["start"]["result"] == [1, None, 3]  # D11: null for a failed iteration


def test_loop_in_must_be_a_list():
    s, r = outcome(play(LOOP.replace("MODE", "parallel"), {"items": 5}))
    assert s["status"] == "FAILED"
    failed = next(e for e in r.log if e["name"] == "step.failed")
    assert "must render to a list" in failed["data"]["error"]["message"]


# ------------------------------------------------------------------------------------------ policies end to end
def test_retry_policy_recovers_flaky_task():
    doc = play("""
- step: start
  tool:
    kind: http
    url: "flaky:2"
    spec: {policy: {rules: [{when: "{{ outcome.status == 'error' }}", then: {do: retry, attempts: 5, delay: 0}}]}}
""")
    s, r = outcome(doc)
    assert s["steps"]["start"] == {"status": "done", "runs": 1, "result": "recovered"}
    attempts = [e["attempt"] for e in r.log if e["name"] == "task.processed"]
    assert attempts == [1, 2, 3]
    assert len({e["action_id"] for e in r.log if e["name"] == "task.processed"}) == 1  # D21


# ------------------------------------------------------------------------------------------ replay and idempotency
@pytest.mark.parametrize("doc,services", [
    (play(FORK_JOIN, {"a": True, "b": True, "c": True}), ("admission", "router")),  # flat: not the loop-coordinator
    (play(LOOP.replace("MODE", "parallel"), {"items": [1, 2, 3]}), ("admission", "router", "loop-coordinator")),
])
def test_replay_equals_live_state_of_every_service(doc, services):
    r = run(doc, seed=3)
    rebuilt = summary(r.state)
    assert set(services) <= set(r.states)
    for name in services:
        live = r.states[name][r.execution_id]
        assert summary(live) == rebuilt, name
        assert set(live.runs) == set(r.state.runs)
        assert live.tokens.keys() == r.state.tokens.keys() == set()


def test_the_loop_coordinator_reads_a_flat_execution_until_it_knows_it_is_flat():
    """A playbook without loop steps: every ctl message after its evaluation travels as ``flat``, which
    the loop-coordinator does not read; admission and the router read them all."""
    from noetl_mesh.core import decide

    flat = run(play(FORK_JOIN, {"a": True, "b": True, "c": True}), seed=3)
    read = [[e["name"] for e in m] for m, c in zip(flat.messages, flat.classes)
            if c in decide.CONSUMES["loop-coordinator"]]
    assert read[0] == ["playbook.execution.requested"] and read[1][0] == "playbook.request.evaluated"
    assert len(read) == 2 and decide.flat(flat.states["loop-coordinator"][flat.execution_id])
    assert {"flat", "info"} >= set(flat.classes[2:]) and "flat" in flat.classes
    looped = run(play(LOOP.replace("MODE", "parallel"), {"items": [1, 2, 3]}))
    assert "flat" not in looped.classes and not decide.flat(looped.state)
    assert {"flat"} == {c for m, c in zip(flat.messages, flat.classes) if _worker_ended(m)}  # told by the command
    assert {"ctl"} == {c for m, c in zip(looped.messages, looped.classes) if _worker_ended(m)}


def _worker_ended(message):
    return message[0]["source"].startswith("worker") and any(e["name"] == "step.done" for e in message)


def test_folding_duplicates_changes_nothing():
    r = run(play(CYCLE_BEFORE_JOIN))
    once = summary(fold(r.log))
    state = fold(r.log)
    assert not any(apply(state, copy.deepcopy(e)) for e in r.log)  # every redelivery is a no-op
    assert summary(state) == once


def test_decisions_are_deterministic_ids():
    r1 = run(play(LINEAR))
    r2 = run(play(LINEAR))
    # different executions, same shape: event ids differ, names and order are identical
    assert names(r1) == names(r2)
    assert {e["event_id"] for e in r1.log}.isdisjoint({e["event_id"] for e in r2.log})


def test_a_chunk_no_worker_can_read_fails_its_iterations_by_their_range(monkeypatch):
    """D23: a chunk of iterations sent by reference whose payload is gone (past its retention) cannot
    list its iterations; its command names their range, so the worker (or admission, for a lost
    command) fails each of them, and the loop ends instead of waiting for them for ever."""
    import asyncio

    from noetl_mesh.core import decide, local

    real, lost = local.execute_command, []

    async def lose_the_first_chunk(command, tools, publish, **kwargs):
        if command.get("chunk") and not lost:
            lost.append(command)
            gone = {**command, "chunk": {"ref": "gone"}}  # as received: a reference that cannot be read
            for event in decide.lost_command(gone, 0, source="worker:default", error={
                    "kind": "payload_missing", "message": "the chunk is gone", "retryable": False}):
                await publish(event)
            return
        return await real(command, tools, publish, **kwargs)

    monkeypatch.setattr(local, "execute_command", lose_the_first_chunk)
    doc = {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "chunks", "path": "t/chunks"},
           "workflow": [{"step": "start", "loop": {"in": "{{ range(40) | list }}", "iterator": "i",
                                                   "spec": {"mode": "parallel", "max_in_flight": 16,
                                                            "policy": {"failure": {"mode": "continue"}}}},
                         "tool": {"kind": "noop", "result": "{{ iter.i }}"}}]}
    run = asyncio.run(local.run_local(doc))
    [chunk] = lost
    first, end = chunk["iterations"]
    assert [e["iteration"] for e in chunk["chunk"]] == list(range(first, end)) and end - first == 2
    assert run.state.status == "COMPLETED", [e["name"] for e in run.log][-5:]  # failure mode continue
    failed = [e for e in run.log if e["name"] == "loop.iteration.failed"]
    assert sorted(e["iteration"] for e in failed) == list(range(first, end))
    assert {e["data"]["error"]["kind"] for e in failed} == {"payload_missing"}
    done = [e for e in run.log if e["name"] == "loop.iteration.done"]
    assert len(done) == 40 - (end - first)
    result = run.state.step_results()["start"]["result"]
    assert result[first:end] == [None, None] and result[end] == end
