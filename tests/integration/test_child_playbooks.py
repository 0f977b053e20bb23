"""Nested playbooks through the gateway on the real stack (NATS, Postgres, every service), with one
worker of concurrency 1: a parent waiting on its child holds no worker slot, so parent -> child ->
grandchild completes; child failures, loops of children, the depth limit, cancellation, and a control
plane restarted while a child runs."""
from __future__ import annotations

import asyncio
from typing import Iterator

import pytest

from noetl_mesh.client import GatewayClient, GatewayError
from noetl_mesh.infra.bus import Bus
from noetl_mesh.stack import start_service, stop_service

from conftest import StackHandle, start_stack, stop_stack

GRANDCHILD = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: grandchild, path: nested/grandchild}
workload: {n: 0, pause: 0}
workflow:
  - step: start
    tool:
      kind: python
      args: {n: "{{ workload.n }}", pause: "{{ workload.pause }}"}
      code: |
        import time
        def main(n, pause):
            time.sleep(pause)
            return n * 2
    next: {arcs: [{step: end}]}
  - step: end
    tool: {kind: noop, result: "{{ start.result + 1 }}"}
"""

CHILD = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: child, path: nested/child}
workload: {pause: 0}
workflow:
  - step: start
    tool:
      - {name: first, kind: noop, result: "{{ args.x }}"}
      - name: deeper
        kind: playbook
        path: nested/grandchild
        workload: {n: "{{ first.result }}", pause: "{{ workload.pause }}"}
    next: {arcs: [{step: end, args: {g: "{{ event.result.steps.end.result }}"}}]}
  - step: end
    tool: {kind: noop, result: "{{ args.g * 100 }}"}
"""

PARENT = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: parent, path: nested/parent}
workload: {x: 7, pause: 0}
workflow:
  - step: start
    tool:
      - {name: call, kind: playbook, path: nested/child, args: {x: "{{ workload.x }}"},
         workload: {pause: "{{ workload.pause }}"}}
      - {name: pick, kind: noop, result: "{{ call.result.steps.end.result }}"}
    next: {arcs: [{step: end}]}
  - step: end
    tool: {kind: noop, result: "{{ start.result + 1 }}"}
"""

FAILING = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: failing, path: nested/failing}
workflow:
  - step: start
    tool: {kind: python, code: "def main():\\n    raise ValueError('child says no')"}
"""

HANDLES_FAILURE = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: handles, path: nested/handles}
workflow:
  - step: start
    tool:
      kind: playbook
      path: nested/failing
      spec:
        policy:
          rules:
            - when: "{{ outcome.error.kind == 'child_failed' }}"
              then: {do: continue, set_ctx: {why: "{{ outcome.error.cause.message }}"}}
    next: {arcs: [{step: end, when: "{{ event.name == 'step.done' }}"}]}
  - step: end
    tool: {kind: noop, result: handled}
"""

LOOP_PARENT = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: loop_parent, path: nested/loop_parent}
workflow:
  - step: start
    loop: {in: "{{ [1, 2, 3, 4] }}", iterator: x, spec: {mode: parallel, max_in_flight: 4}}
    tool:
      - {name: call, kind: playbook, path: nested/looped}
      - {name: pick, kind: noop, result: "{{ call.result.steps.start.result }}"}
"""

LOOPED = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: looped, path: nested/looped}
workflow:
  - step: start
    loop: {in: "{{ ['a', 'b'] }}", iterator: y}
    tool: {kind: noop, result: "{{ iter.y ~ iter.parent.x }}"}
"""

RECURSIVE = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: recursive, path: nested/recursive}
executor: {spec: {policy: {limits: {max_depth: 2}}}}
workflow:
  - step: start
    tool: {kind: playbook, path: nested/recursive}
"""


@pytest.fixture(scope="module")
def nested(module_pg) -> Iterator[StackHandle]:
    nats, loop, handle = start_stack(module_pg)
    # one worker slot for the whole stack: waiting parents must not hold it
    for worker in handle.stack.services("worker"):
        worker.concurrency = 1

    async def register():
        async with GatewayClient(handle.url, token=handle.token) as client:
            for text in (GRANDCHILD, CHILD, PARENT, FAILING, HANDLES_FAILURE, LOOP_PARENT, LOOPED, RECURSIVE, DEEP_CHILD,
                         DEEP_PARENT):
                await client.register(text)

    handle.run(register())
    yield handle
    stop_stack(nats, loop, handle)


DEEP_CHILD = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: deep-child, path: nested/deep_child}
workload: {n: 1}
workflow:
  - step: start
    tool:
      kind: python
      args: {n: "{{ workload.n }}"}
      code: |
        def main(n):
            x = 1
            for _ in range(n):
                x = [x]
            return {"deep": x}
"""

DEEP_PARENT = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: deep-parent, path: nested/deep_parent}
workload: {n: 1}
workflow:
  - step: start
    tool: {name: call, kind: playbook, path: nested/deep_child, workload: {n: "{{ workload.n }}"}}
"""


async def _run(handle: StackHandle, path: str, workload: dict | None = None, timeout: float = 60) -> tuple[dict, GatewayClient]:
    client = GatewayClient(handle.url, token=handle.token)
    await client.__aenter__()
    eid = await client.start(path=path, workload=workload or {})
    return await client.wait(eid, timeout=timeout), client


def run(handle: StackHandle, path: str, workload: dict | None = None, inspect=None, timeout: float = 60):
    async def go():
        final, client = await _run(handle, path, workload, timeout)
        try:
            return final, (await inspect(client, final) if inspect else None)
        finally:
            await client.__aexit__(None, None, None)

    return handle.run(go(), timeout + 20)


async def _grandchild_running(client: GatewayClient, eid: str) -> tuple[str, str]:
    """Wait until the parent's child has a child of its own; return (child, grandchild)."""
    for _ in range(400):
        try:
            status = await client.status(eid)
            if status.get("children"):
                child = await client.status(status["children"][0])
                if child.get("children"):
                    return child["execution_id"], child["children"][0]
        except GatewayError as exc:  # not recorded yet
            assert exc.status == 404
        await asyncio.sleep(0.05)
    raise AssertionError("the grandchild never started")


def test_parent_child_grandchild_with_one_worker_slot(nested):
    async def inspect(client, final):
        child = await client.status(final["children"][0])
        grandchild = await client.status(child["children"][0])
        events = await client.all_events(final["execution_id"])
        return child, grandchild, events

    final, (child, grandchild, events) = run(nested, "nested/parent", inspect=inspect)
    assert nested.stack.services("worker")[0].concurrency == 1
    assert final["status"] == "COMPLETED", final
    assert final["steps"]["end"]["result"] == 1501  # (7*2 + 1) * 100 + 1
    assert child["status"] == "COMPLETED" and child["parent_execution_id"] == final["execution_id"]
    assert child["path"] == "nested/child" and child["steps"]["end"]["result"] == 1500
    assert grandchild["parent_execution_id"] == child["execution_id"] and grandchild["steps"]["end"]["result"] == 15
    names = [e["name"] for e in events if e.get("task") == "call"]
    assert names == ["task.started", "task.suspended", "task.processed"]
    assert next(e for e in events if e["name"] == "task.suspended")["status"] == "paused"


def test_child_failure_reaches_the_parents_policy(nested):
    final, _ = run(nested, "nested/handles")
    assert final["status"] == "COMPLETED" and final["steps"]["end"]["result"] == "handled"
    assert "child says no" in final["ctx"]["why"]


def test_loop_iterations_call_children_that_see_iter_parent(nested):
    final, _ = run(nested, "nested/loop_parent")
    assert final["status"] == "COMPLETED", final
    assert final["steps"]["start"]["result"] == [["a1", "b1"], ["a2", "b2"], ["a3", "b3"], ["a4", "b4"]]
    assert len(final["children"]) == 4


def test_recursion_depth_limit_is_reported(nested):
    final, _ = run(nested, "nested/recursive")
    assert final["status"] == "FAILED"
    error = final["error"]
    assert error["kind"] == "child_failed"
    text = str(error)
    assert "recursion_limit" in text and "would nest child executions 3 deep; the limit is 2" in text


def test_a_tree_requests_at_most_max_tree_executions_children_at_every_depth(nested):
    """D19: the children of a root's tree are counted together, grandchildren included; past the limit
    a child fails at its request, and so the task that called it."""
    from noetl_mesh import limits
    from noetl_mesh.contracts.subjects import TREES, tree_subject

    async def count(client, final):
        bus = await Bus.connect(nested.nats_url, "probe", nested.admin)
        try:
            return (await bus.js.get_last_msg(TREES, tree_subject(final["execution_id"]))).data
        finally:
            await bus.close()

    with limits.override(max_tree_executions=1):  # admission runs in this process
        final, counted = run(nested, "nested/parent", inspect=count)  # parent -> child -> grandchild
        looped, _ = run(nested, "nested/loop_parent")  # four children of one root
    assert final["status"] == "FAILED", final
    text = str(final["error"])
    assert final["error"]["kind"] == "child_failed" and "ended FAILED" in text
    assert "'limit_exceeded'" in text  # the refused child's own error (its cause): a limit, not the playbook
    assert "the limit max_tree_executions = 1 executions" in text and "is 2 executions" in text, text
    assert counted == b'{"val":"2"}'  # the child and the grandchild, in the root's count
    assert looped["status"] == "FAILED" and len(looped["children"]) == 4
    assert "max_tree_executions" in str(looped["error"])
    with limits.override(max_tree_executions=4):
        looped, _ = run(nested, "nested/loop_parent")
    assert looped["status"] == "COMPLETED", looped


def test_a_result_nested_too_deep_fails_where_it_is_made_and_nothing_is_left_running(nested):
    """Deeper than max_value_depth (64): the child's task fails at once (before, its report could not be
    sent and the task ran again until worker_lost); a child result within it that its parent's view
    nests deeper fails the parent's task (before, the child's end could not be sent: both stayed
    RUNNING, and could not be cancelled)."""
    async def children(client, final):
        return [await client.status(c) for c in final.get("children") or ()]

    final, (child,) = run(nested, "nested/deep_parent", {"n": 250}, inspect=children)
    assert final["status"] == "FAILED" and child["status"] == "FAILED", (final, child)
    assert child["error"]["kind"] == "tool_error" and "deeper than 64 levels" in child["error"]["message"], child
    final, (child,) = run(nested, "nested/deep_parent", {"n": 62}, inspect=children)
    assert child["status"] == "COMPLETED", child
    assert final["status"] == "FAILED", final
    assert "deeper than 64 levels" in str(final["error"]), final["error"]
    ok, _ = run(nested, "nested/deep_parent", {"n": 40})
    assert ok["status"] == "COMPLETED" and ok["steps"]["start"]["result"]["status"] == "COMPLETED"


def test_cancelling_the_parent_cancels_the_running_child(nested):
    async def go():
        async with GatewayClient(nested.url, token=nested.token) as client:
            eid = await client.start(path="nested/parent", workload={"pause": 30})
            child, grandchild = await _grandchild_running(client, eid)
            await client.cancel(eid, reason="test")
            parent = await client.wait(eid, timeout=30)
            child = await client.wait(child, timeout=30)
            grand = await client.wait(grandchild, timeout=30)
            return parent, child, grand

    parent, child, grand = nested.run(go(), 120)
    assert (parent["status"], child["status"], grand["status"]) == ("CANCELLED", "CANCELLED", "CANCELLED")


def test_control_plane_restarted_while_a_child_runs(nested):
    """The waiting parent lives in the event log, not in a service: admission, router and
    loop-coordinator are replaced while the grandchild sleeps, and the chain still completes."""
    stack = nested.stack

    async def go():
        async with GatewayClient(nested.url, token=nested.token) as client:
            eid = await client.start(path="nested/parent", workload={"pause": 1.5})
            await _grandchild_running(client, eid)
            old = [r for r in stack.running if r.name in ("admission", "router", "loop-coordinator")]
            await asyncio.gather(*(stop_service(r) for r in old))
            fresh = await asyncio.gather(*(start_service(r.name, stack.settings) for r in old))
            stack.running = [r for r in stack.running if r not in old] + list(fresh)
            return await client.wait(eid, timeout=60)

    final = nested.run(go(), 120)
    assert final["status"] == "COMPLETED" and final["steps"]["end"]["result"] == 1501
