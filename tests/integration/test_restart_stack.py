"""D32 restart from a step on a real stack (NATS, Postgres, every service): through the gateway and
`noetl restart`, what each execution's log and status say, the refusals, who may, a big result carried
by reference, and replay of the new execution's log alone."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import httpx
import pytest

from noetl_mesh import limits
from noetl_mesh.client import GatewayError

from noetl_mesh.core.state import fold, summary

pytestmark = pytest.mark.integration

# c fails while workload.broken: its task's policy says so (a noop, no sandbox needed)
CHAIN = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: chain, path: restart/chain}
workload: {broken: true, day: mon}
workflow:
  - step: a
    tool:
      kind: noop
      result: {rows: 3}
      spec: {policy: {rules: [{else: {then: {do: continue, set_ctx: {loaded: "{{ outcome.result.rows }}"}}}}]}}
    next: {arcs: [{step: b, args: {n: "{{ event.result.rows }}"}}]}
  - step: b
    tool: {kind: noop, result: "{{ args.n * 10 }}"}
    next: {arcs: [{step: c, args: {total: "{{ event.result }}"}}]}
  - step: c
    tool:
      kind: noop
      result: "{{ args.total + ctx.loaded }}"
      spec: {policy: {rules: [{when: "{{ workload.broken }}", then: {do: fail}}, {else: {then: {do: continue}}}]}}
    next: {arcs: [{step: d}]}
  - step: d
    tool: {kind: noop, result: "{{ c.result }} on {{ workload.day }}"}
"""

FORK = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: fork, path: restart/fork}
workload: {broken: true}
workflow:
  - step: start
    tool: {kind: noop, result: go}
    next: {spec: {mode: inclusive}, arcs: [{step: left, args: {side: L}}, {step: right, args: {side: R}}]}
  - step: left
    tool:
      kind: noop
      result: "{{ args.side }}"
      spec: {policy: {rules: [{when: "{{ workload.broken }}", then: {do: fail}}, {else: {then: {do: continue}}}]}}
    next: {arcs: [{step: join, args: {l: "{{ event.result }}"}}]}
  - step: right
    tool: {kind: noop, result: "{{ args.side }}"}
    next: {arcs: [{step: join, args: {r: "{{ event.result }}"}}]}
  - step: join
    tool: {kind: noop, result: "{{ args }}"}
"""

LOOP = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: loop, path: restart/loop}
workload: {bad: 3}
workflow:
  - step: prep
    tool: {kind: noop, result: [1, 2, 3, 4]}
    next: {arcs: [{step: each}]}
  - step: each
    loop: {in: "{{ prep.result }}", iterator: x}
    tool:
      kind: noop
      result: "{{ iter.x * 2 }}"
      spec: {policy: {rules: [{when: "{{ iter.x == workload.bad }}", then: {do: fail}}, {else: {then: {do: continue}}}]}}
    next: {arcs: [{step: sum, when: "{{ event.name == 'loop.done' }}"}]}
  - step: sum
    tool: {kind: noop, result: "{{ each.result | sum }}"}
"""

# a result far over the 256 KiB a message carries inline (D23): it travels, and is carried over, by reference
BIG = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: big, path: restart/big}
workload: {broken: true}
workflow:
  - step: make
    tool: {kind: noop, result: "{{ 'x' * 400000 }}"}
    next: {arcs: [{step: use}]}
  - step: use
    tool:
      kind: noop
      result: "{{ make.result | length }}"
      spec: {policy: {rules: [{when: "{{ workload.broken }}", then: {do: fail}}, {else: {then: {do: continue}}}]}}
"""

WAITING = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: waiting, path: restart/waiting}
workflow:
  - step: hold
    tool: {kind: wait, signal: never, timeout: 1h}
"""


def run(stack, doc, workload=None):
    return stack.execute(doc, workload)


def restart(stack, execution_id, step, workload=None, token=None):
    """The restart through the gateway, then the new execution's status and events once it ended."""

    async def go():
        async with stack.client(**({"token": token} if token else {})) as client:
            answer = await client.restart(execution_id, step, workload)
            status = await client.wait(answer["execution_id"], timeout=60)
            return answer, status, await client.all_events(answer["execution_id"])

    return stack.run(go(), 80)


def refusal(stack, execution_id, body, token=None) -> tuple[int, dict]:
    resp = httpx.post(f"{stack.url}/api/executions/{execution_id}/restart", json=body, trust_env=False, timeout=30,
                      headers={"Authorization": f"Bearer {token or stack.token}"})
    return resp.status_code, resp.json().get("detail") or resp.json()


def tasks(events, step):
    return sum(1 for e in events if e["name"] == "task.started" and e["step"] == step)


def test_a_chain_restarted_from_its_failed_third_step_completes_without_running_the_first_two(stack):
    old, old_events = run(stack, CHAIN)
    assert old["status"] == "FAILED" and old["steps"]["c"]["status"] == "failed"
    answer, new, events = restart(stack, old["execution_id"], "c", {"broken": False})
    assert new["status"] == "COMPLETED", new
    cut = next(e for e in old_events if e["name"] == "step.started" and e["step"] == "c")
    assert answer["restarted_from"] == {"execution": old["execution_id"], "step": "c", "upto_event": cut["event_id"]}
    # a and b: one task each in the old log, none in the new; c and d run in the new one
    assert [tasks(old_events, s) for s in "abcd"] == [1, 1, 1, 0]
    assert [tasks(events, s) for s in "abcd"] == [0, 0, 1, 1]
    assert new["steps"]["d"]["result"] == "33 on mon" and new["ctx"] == {"loaded": 3}
    assert new["steps"]["a"] == {"status": "done", "runs": 0, "result": {"rows": 3}, "restored": True}
    # the changed workload: merged over the old one, for the new execution only
    assert new["workload"] == {"broken": False, "day": "mon"}
    # both executions show the link; the old one is otherwise unchanged
    assert new["restarted_from"]["execution"] == old["execution_id"]

    async def look():
        async with stack.client() as client:
            return (await client.status(old["execution_id"]), await client.all_events(old["execution_id"]),
                    await client.status(new["execution_id"], brief=True),
                    await client._call("GET", f"/api/executions/{old['execution_id']}/state"),
                    await client._call("GET", f"/api/executions/{new['execution_id']}/state"))

    again, again_events, brief, old_view, new_view = stack.run(look())
    assert again["status"] == "FAILED" and again["restarts"] == [new["execution_id"]]
    assert len(again_events) == len(old_events) and again["workload"] == {"broken": True, "day": "mon"}
    assert brief["restarted_from"] == old["execution_id"]  # the projection
    assert old_view["restarts"] == [new["execution_id"]] and new_view["restarted_from"]["step"] == "c"
    assert new_view["steps"]["a"]["restored"] and new_view["runs"]["a"]["shown"][0]["restored"]


def test_replay_of_the_new_log_alone_is_the_state_the_services_hold(stack):
    old, _ = run(stack, CHAIN)
    _, new, events = restart(stack, old["execution_id"], "c", {"broken": False})
    replayed = fold(events)
    assert {e["execution_id"] for e in events} == {new["execution_id"]}  # nothing read from the old log
    assert summary(replayed) == {k: new[k] for k in summary(replayed)}
    # a finished execution's state leaves the services' caches (IDLE); what a service folds when it
    # needs the execution again is its rebuild from the stream: the same as the replay of the new log
    from noetl_mesh.infra.control import IDLE

    xid = new["execution_id"]
    services = [svc for name in ("admission", "router") for svc in stack.stack.services(name) if xid in svc.cache]
    assert services and all(svc.cache[xid] is IDLE for svc in services)
    held = [stack.run(svc._rebuild(xid, svc.partition_of[xid], 2**62)) for svc in services]
    for state in held:
        assert summary(state) == summary(replayed)
        assert {r: (x.restored, x.status) for r, x in state.runs.items()} == \
            {r: (x.restored, x.status) for r, x in replayed.runs.items()}


def test_a_fork_join_restarted_from_one_branch_takes_the_other_as_it_stood(stack):
    old, old_events = run(stack, FORK)
    assert old["status"] == "FAILED"
    cut = next(i for i, e in enumerate(old_events) if e["name"] == "step.started" and e["step"] == "left")
    # the other branch as it stood when left started: done and routed (its token on the join's place),
    # or not yet (it runs again)
    right_done = any(e["name"] == "next.evaluated" and e["step"] == "right" for e in old_events[:cut])
    _, new, events = restart(stack, old["execution_id"], "left", {"broken": False})
    assert new["status"] == "COMPLETED", new
    assert new["steps"]["join"] == {"status": "done", "runs": 1, "result": {"l": "L", "r": "R"}}
    assert tasks(events, "start") == 0 and tasks(events, "left") == 1 and tasks(events, "join") == 1
    assert tasks(events, "right") == (0 if right_done else 1)


def test_a_loop_step_is_restarted_whole(stack):
    old, old_events = run(stack, LOOP)
    assert old["status"] == "FAILED"
    assert sum(1 for e in old_events if e["name"] == "loop.iteration.failed") == 1
    _, new, events = restart(stack, old["execution_id"], "each", {"bad": None})
    assert new["status"] == "COMPLETED" and new["steps"]["sum"]["result"] == 20
    assert sorted(e["iteration"] for e in events if e["name"] == "loop.iteration.started") == [0, 1, 2, 3]
    assert tasks(events, "prep") == 0


def test_a_big_result_is_carried_over_by_reference_not_copied(stack):
    old, old_events = run(stack, BIG)
    assert old["status"] == "FAILED"
    done = next(e for e in old_events if e["name"] == "step.done" and e["step"] == "make")
    ref = done["data"]["result"]
    assert isinstance(ref, dict) and ref.get("store") and ref.get("key")  # the log holds a reference
    _, new, events = restart(stack, old["execution_id"], "use", {"broken": False})
    assert new["status"] == "COMPLETED" and new["steps"]["use"]["result"] == 400_000
    request = events[0]
    assert request["name"] == "playbook.execution.requested"
    carried = request["data"]["seed"]["runs"][0]["result"]
    assert carried == ref  # the same object: the value was never read and stored again


def test_who_may_restart_and_what_is_refused(stack):
    old, _ = run(stack, CHAIN)
    xid = old["execution_id"]

    async def tokens():
        async with stack.client() as admin:
            return ((await admin.create_token("restart-viewer", roles=["viewer"]))["token"],
                    (await admin.create_token("restart-developer", roles=["developer"]))["token"])

    viewer, developer = stack.run(tokens())
    status, detail = refusal(stack, xid, {"from_step": "c"}, token=viewer)
    assert status == 403 and "execution.start" in detail["message"]
    status, detail = refusal(stack, "no-such-execution", {"from_step": "c"})
    assert status == 404 and "no-such-execution" in detail["message"]
    status, detail = refusal(stack, xid, {"from_step": "cc"})
    assert status == 422 and detail["location"] == "body.from_step"
    assert "has no step 'cc' (did you mean 'c'?)" in detail["message"]
    status, detail = refusal(stack, xid, {"from_step": "d"})
    assert status == 422 and "step 'd' never started" in detail["message"]
    status, _ = refusal(stack, xid, {"from_step": "c", "workload": [1]})
    assert status == 422
    # a running execution: 409
    async def waiting():
        async with stack.client() as client:
            eid = await client.start(WAITING)
            while True:  # the test waits for the stack
                try:
                    if (await client.status(eid, brief=True))["status"] == "RUNNING":
                        return eid
                except GatewayError as exc:  # not recorded yet
                    assert exc.status == 404
                await asyncio.sleep(0.05)

    running = stack.run(waiting(), 60)
    status, detail = refusal(stack, running, {"from_step": "hold"})
    assert status == 409 and "is RUNNING" in detail["message"]

    async def cancel_and_look():
        async with stack.client() as client:
            await client.cancel(running)
            return await client.status(xid)

    assert "restarts" not in stack.run(cancel_and_look())  # no refusal above started anything
    # a developer may (execution.start)
    answer, new, _ = restart(stack, xid, "c", {"broken": False}, token=developer)
    assert new["status"] == "COMPLETED"

    async def old_one():
        async with stack.client() as client:
            return await client.status(xid)

    assert stack.run(old_one())["restarts"] == [answer["execution_id"]]


def test_the_fold_before_the_step_is_bounded(stack):
    """A restart folds the old execution's state events before the step's first start, at most
    max_state_events (an execution with 500,000 events costs a bounded query): past it, 413."""
    old, old_events = run(stack, CHAIN)
    before = sum(1 for e in old_events if e["name"] not in ("task.started", "task.processed", "step.started",
                                                             "step.scheduled", "playbook.processed")
                 and e["seq"] < next(x["seq"] for x in old_events if x["name"] == "step.started" and x["step"] == "c"))
    with limits.override(max_state_events=before - 1):  # the recorder runs in this process
        status, detail = refusal(stack, old["execution_id"], {"from_step": "c"})
    assert status == 413 and "max_state_events" in detail["message"]
    with limits.override(max_state_events=before):
        status, _ = refusal(stack, old["execution_id"], {"from_step": "c"})
    assert status == 202


def test_noetl_restart_follows_the_new_execution_and_says_it_in_its_exit_status(stack, tmp_path):
    old, _ = run(stack, CHAIN)
    env = {**os.environ, "NOETL_TOKEN": stack.token, "XDG_CONFIG_HOME": str(tmp_path)}

    def noetl(*args):
        return subprocess.run([sys.executable, "-m", "noetl_mesh.cli", *args, "--gateway", stack.url],
                              capture_output=True, text=True, env=env, timeout=120)

    ok = noetl("restart", old["execution_id"], "--from", "c", "--workload", '{"broken": false}', "--json")
    assert ok.returncode == 0, ok.stderr
    out = json.loads(ok.stdout)
    assert out["status"] == "COMPLETED" and out["restarted_from"]["execution"] == old["execution_id"]
    assert out["steps"]["d"]["result"] == "33 on mon"
    assert not [e for e in out["events"] if e["name"] == "task.started" and e["step"] in ("a", "b")]
    failed = noetl("restart", old["execution_id"], "--from", "c")  # still broken: it fails again
    assert failed.returncode == 1 and "FAILED" in failed.stdout and "restarts" in failed.stderr
    refused = noetl("restart", old["execution_id"], "--from", "nope")
    assert refused.returncode == 1 and "gateway answered 422" in refused.stderr and "no step 'nope'" in refused.stderr
    bad = noetl("restart", old["execution_id"], "--from", "c", "--workload", "[1]")
    assert bad.returncode == 2 and "--workload must be a JSON object" in bad.stderr


def test_a_restart_workload_that_completes_a_reference_with_the_old_one_is_422(stack):
    """The old execution's workload holds half of a payload reference (D23), the restart's body the
    other half: each passes alone, their merge would be a reference the services expand."""
    half = CHAIN.replace("workload: {broken: true, day: mon}",
                         "workload: {broken: true, day: mon, x: {store: 'nats-object:noetl_payloads', key: k}}")
    old, _ = run(stack, half)
    status, detail = refusal(stack, old["execution_id"], {"from_step": "c", "workload": {
        "broken": False, "x": {"size": 1, "checksum": "sha256:" + "0" * 64}}})
    assert status == 422 and detail["location"] == "body.workload.x", detail
    assert "only the engine writes (D23)" in detail["message"]


def test_an_execution_whose_request_went_whole_by_reference_restarts(stack):
    """A request whose fields are each under the message limit but together over it is stored whole
    as one reference (D23): the restart reads it back to find the playbook that ran."""
    doc = CHAIN.replace("result: {rows: 3}", "result: {rows: 3, note: " + "n" * 150_000 + "}")
    old, old_events = run(stack, doc, {"broken": True, "day": "mon", "pad": "p" * 150_000})
    assert old["status"] == "FAILED", old
    requested = next(e for e in old_events if e["name"] == "playbook.execution.requested")
    assert sorted(requested["data"]) == ["checksum", "key", "size", "store"], "the request is not one reference"
    _, new, _ = restart(stack, old["execution_id"], "c", {"broken": False})
    assert new["status"] == "COMPLETED", new
    assert new["steps"]["d"]["result"] == "33 on mon" and new["workload"]["pad"] == "p" * 150_000
