"""Playbooks with the outcome docs/dsl.md prescribes, shared by the tests of the in-process engine and
of the distributed stack (which must agree). ``API`` in a playbook is replaced by the fixture API's URL."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

EXAMPLES = Path(__file__).parents[1] / "examples"


@dataclass
class Scenario:
    id: str
    decisions: str
    playbook: str
    expect: Callable[[dict[str, Any], list[dict[str, Any]]], None]  # (summary, events) -> asserts
    workload: dict[str, Any] = field(default_factory=dict)

    def doc(self, api_url: str) -> dict[str, Any]:
        text = self.playbook.replace("API", api_url)
        if not text.lstrip().startswith("apiVersion"):
            text = f"apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {{name: {self.id}, path: tests/{self.id}}}\n" + text
        return yaml.safe_load(text)


def slow_chain(n: int, seconds: float, result: str = "i") -> dict:
    """``n`` python steps in a chain, each sleeping ``seconds`` and returning ``result`` (of its ``i``)."""
    steps = []
    for i in range(n):
        step = {"step": f"s{i}", "tool": {"kind": "python", "args": {"i": i},
                                          "code": f"import time\ntime.sleep({seconds})\nresult = {result}"}}
        if i < n - 1:
            step["next"] = {"arcs": [{"step": f"s{i + 1}"}]}
        steps.append(step)
    return {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "slow", "path": "tests/slow"},
            "workflow": steps}


# A three-step playbook for tests of the services around the engine (catalog, recorder, gateway).
TINY = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: tiny, path: tests/tiny}
workload: {n: 2}
workflow:
  - step: start
    tool: {kind: noop, result: "{{ workload.n }}"}
    next: {arcs: [{step: double, args: {x: "{{ event.result }}"}}]}
  - step: double
    tool: {kind: noop, result: "{{ args.x * 2 }}"}
    next: {arcs: [{step: end}]}
  - step: end
    tool: {kind: noop}
"""


def names(events, step=None):
    return [e["name"] for e in events if step is None or e.get("step") == step]


def _entry(s, ev):
    assert s["status"] == "COMPLETED"
    assert "first" not in s["steps"] and s["steps"]["begin"]["result"] == "b"


def _shapes(s, ev):
    tasks = [e["task"] for e in ev if e["name"] == "task.processed"]
    assert tasks == ["single_task", "task_0", "named", "task_2"]
    assert s["steps"]["multi"]["result"] == 3


def _max_steps(s, ev):
    assert s["status"] == "FAILED"
    failed = next(e for e in ev if e["name"] == "step.failed")
    assert failed.get("data", {}).get("error", {}).get("kind", "max_steps_exceeded") == "max_steps_exceeded"
    assert names(ev).count("task.started") == 3  # max_steps 3 visits (D5 from executor.spec, D9)


def _namespaces(s, ev):
    r = s["steps"]["second"]["result"]
    assert r["wl"] == 7 and r["ctx"] == "c" and r["arg"] == 42 and r["prev_step"] == 10
    assert r["task"] == "probe" and r["attempt"] == 1 and r["prev"] == "x" and r["by_name"] == "x"
    assert r["eid"] == s["execution_id"]


def _native(s, ev):
    r = s["steps"]["start"]["result"]
    assert r == {"list": [1, 2], "n": 3, "b": True, "none": None, "text": "n=3", "map": {"a": 1}}


def _http_outcome(s, ev):
    assert s["status"] == "COMPLETED"
    assert s["steps"]["handle"]["result"] == {"status": 404, "kind": "http_error", "retryable": False}


def _python_exception(s, ev):
    assert s["steps"]["handle"]["result"] == {"type": "KeyError", "step": "boom"}


def _retry(s, ev):
    assert s["steps"]["start"]["result"]["attempt"] == 3
    attempts = [e["attempt"] for e in ev if e["name"] == "task.processed"]
    assert attempts == [1, 2, 3]


def _noop_result(s, ev):
    assert s["steps"]["start"]["result"] == {"a": 1}  # D10 pass-through, D11 last task


def _ctx(s, ev):
    assert s["ctx"] == {"count": 2, "who": "b"} and s["steps"]["c"]["result"] == "b:2"


def _toolless(s, ev):
    assert s["steps"]["route"] == {"status": "done", "runs": 1, "result": None}
    assert s["steps"]["taken"]["runs"] == 1 and "other" not in s["steps"]


def _inclusive(s, ev):
    assert set(s["steps"]) == {"start", "a", "b"}


def _fail_fast(s, ev):
    assert s["status"] == "FAILED" and "after" not in s["steps"]
    assert names(ev)[-2:] == ["workflow.finished", "playbook.processed"]


def _best_effort(s, ev):
    assert s["status"] == "COMPLETED"  # D18: a best_effort failure ends its branch, not the execution
    assert s["steps"]["other"]["status"] == "done" and s["steps"]["bad"]["status"] == "failed"


def _fork_join(s, ev):
    assert s["steps"]["report"] == {"status": "done", "runs": 1, "result": {"total_orders": 200}}
    assert "apac" not in s["steps"]


def _admission(s, ev):
    assert s["steps"]["gated"] == {"status": "skipped", "runs": 0, "result": None}
    assert s["steps"]["join"]["runs"] == 1 and s["status"] == "COMPLETED"
    assert "step.skipped" in names(ev, "gated")


def _loops(s, ev):
    assert s["steps"]["start"]["result"][2] == {"city": "Cairo", "mean": 32.666666666666664, "hot": True}
    assert s["ctx"]["hot_cities"] == ["Cairo"]
    assert names(ev).count("loop.iteration.done") == 6 and names(ev).count("loop.done") == 2


def _empty_loop(s, ev):
    assert s["steps"]["start"]["result"] == [] and s["steps"]["after"]["result"] == 0


def _pagination(s, ev):
    assert s["status"] == "COMPLETED"
    assert s["steps"]["validate_results"]["result"] == {"endpoints": 2, "items": 25}
    assert "cleanup" not in s["steps"]


def _event_order(s, ev):
    assert names(ev)[:5] == ["playbook.execution.requested", "playbook.request.evaluated", "workflow.started",
                             "token.enqueued", "step.admitted"]
    n = names(ev)
    assert n.index("step.done") < n.index("next.evaluated") < n.index("workflow.finished")


def _python_main(s, ev):
    assert s["steps"]["start"]["result"] == {"sum": 5, "kw": ["a", "b"]}


def _duckdb(s, ev):
    assert s["steps"]["aggregate"]["result"] == "hello: 8 squares add up to 173" and s["ctx"] == {"total": 173}


def _back_edge(s, ev):
    assert s["steps"]["poll"]["runs"] == 3 and s["steps"]["join"]["result"] == {"polled": 3, "side": "s"}


def _alias(s, ev):
    assert "recover" in s["steps"] and s["status"] == "COMPLETED"


SCENARIOS = [
    Scenario("entry", "D3", """
executor: {spec: {entry_step: begin}}
workflow:
  - {step: first, tool: {kind: noop, result: a}}
  - {step: begin, tool: {kind: noop, result: b}}
""", _entry),
    Scenario("shapes", "D4", """
workflow:
  - step: start
    tool: {kind: noop, result: 1}
    next: {arcs: [{step: multi}]}
  - step: multi
    tool:
      - {kind: noop, result: 1}
      - {name: named, kind: noop, result: 2}
      - {kind: noop, result: "{{ named.result + 1 }}"}
""".replace("start\n    tool: {kind: noop, result: 1}", "single\n    tool: {kind: noop, result: 1}"), _shapes),
    Scenario("max_steps", "D5 D9", """
executor: {spec: {max_steps: 3}}
workflow:
  - step: start
    tool:
      - name: spin
        kind: noop
        spec: {policy: {rules: [{else: {then: {do: jump, to: spin}}}]}}
""", _max_steps),
    Scenario("namespaces", "D6", """
workload: {n: 7}
workflow:
  - step: start
    tool:
      kind: noop
      result: 10
      spec: {policy: {rules: [{else: {then: {do: continue, set_ctx: {c: c}}}}]}}
    next: {arcs: [{step: second, args: {x: 42}}]}
  - step: second
    tool:
      - {name: first_task, kind: noop, result: x}
      - name: probe
        kind: noop
        result:
          wl: "{{ workload.n }}"
          ctx: "{{ ctx.c }}"
          arg: "{{ args.x }}"
          prev_step: "{{ start.result }}"
          task: "{{ _task }}"
          attempt: "{{ _attempt }}"
          prev: "{{ _prev }}"
          by_name: "{{ first_task.result }}"
          eid: "{{ execution_id }}"
""", _namespaces),
    Scenario("native", "D7", """
workflow:
  - step: start
    tool:
      kind: noop
      result: {list: "{{ [1, 2] }}", n: "{{ 1 + 2 }}", b: "{{ 1 < 2 }}", none: "{{ none }}", text: "n={{ 1 + 2 }}", map: "{{ {'a': 1} }}"}
""", _native),
    Scenario("http_outcome", "D8 D13 D14", """
workflow:
  - step: start
    tool: {kind: http, url: "API/missing"}
    next:
      arcs:
        - {step: never}
        - step: handle
          when: "{{ event.name == 'step.failed' }}"
          args: {status: "{{ event.error.kind }}"}
  - {step: never, tool: {kind: noop}}
  - step: handle
    tool:
      kind: noop
      result: {status: 404, kind: "{{ args.status }}", retryable: false}
""", _http_outcome),
    Scenario("python_exception", "D8 D25", """
workflow:
  - step: boom
    tool: {kind: python, code: "result = {}['missing']"}
    next:
      arcs:
        - step: handle
          when: "{{ event.name == 'step.failed' }}"
          args: {type: "{{ event.error.exception_type | default(event.error.kind) }}"}
  - step: handle
    tool: {kind: noop, result: {type: "{{ args.type }}", step: "{{ boom.status == 'failed' and 'boom' }}"}}
""", _python_exception),
    Scenario("retry", "D9 D21", """
workflow:
  - step: start
    tool:
      kind: http
      url: "API/flaky/{{ execution_id }}/2"
      spec: {policy: {rules: [{when: "{{ outcome.status == 'error' }}", then: {do: retry, attempts: 5, delay: 0.01, backoff: exponential}}]}}
""", _retry),
    Scenario("noop_result", "D10 D11", """
workflow:
  - step: start
    tool:
      - {kind: noop, result: {a: 1}}
      - {kind: noop}
""", _noop_result),
    Scenario("ctx", "D12", """
workflow:
  - step: a
    tool:
      kind: noop
      result: 1
      spec: {policy: {rules: [{else: {then: {do: continue, set_ctx: {count: 1, who: a}}}}]}}
    next: {arcs: [{step: b}]}
  - step: b
    tool:
      kind: noop
      spec: {policy: {rules: [{else: {then: {do: continue, set_ctx: {count: "{{ ctx.count + 1 }}", who: b}}}}]}}
    next: {arcs: [{step: c}]}
  - step: c
    tool: {kind: noop, result: "{{ ctx.who }}:{{ ctx.count }}"}
""", _ctx),
    Scenario("toolless_and_alias", "D13", """
workflow:
  - step: start
    tool: {kind: noop, result: 1}
    next: {arcs: [{step: route, when: "{{ event.name == 'call.done' }}"}]}
  - step: route
    next:
      arcs:
        - {step: taken, when: "{{ event.result is none }}"}
        - {step: other}
  - {step: taken, tool: {kind: noop}}
  - {step: other, tool: {kind: noop}}
""", _toolless),
    Scenario("inclusive", "D14", """
workflow:
  - step: start
    tool: {kind: noop, result: 5}
    next:
      spec: {mode: inclusive}
      arcs:
        - {step: a, when: "{{ event.result > 1 }}"}
        - {step: b}
        - {step: c, when: "{{ event.result > 9 }}"}
  - {step: a, tool: {kind: noop}}
  - {step: b, tool: {kind: noop}}
  - {step: c, tool: {kind: noop}}
""", _inclusive),
    Scenario("fail_fast", "D15 D18", """
workflow:
  - step: start
    tool: {kind: http, url: "API/status/500"}
    next: {arcs: [{step: after}]}
  - {step: after, tool: {kind: noop}}
""", _fail_fast),
    Scenario("best_effort", "D15", """
workflow:
  - step: start
    next: {spec: {mode: inclusive}, arcs: [{step: bad}, {step: other}]}
  - step: bad
    spec: {policy: {failure: {mode: best_effort}}}
    tool: {kind: python, code: "raise ValueError('no')"}
    next: {arcs: [{step: after_bad}]}
  - {step: other, tool: {kind: noop, result: 1}}
  - {step: after_bad, tool: {kind: noop}}
""", _best_effort),
    Scenario("fork_join", "D16", (EXAMPLES / "fork_join.yaml").read_text(), _fork_join),
    Scenario("admission", "D16 D17", """
workflow:
  - step: start
    next: {spec: {mode: inclusive}, arcs: [{step: gated, args: {n: 1}}, {step: open}]}
  - step: gated
    spec:
      policy:
        admit:
          rules:
            - when: "{{ args.n > 5 }}"
              then: {allow: true}
            - else: {then: {allow: false}}
    tool: {kind: noop}
    next: {arcs: [{step: join}]}
  - step: open
    tool: {kind: noop}
    next: {arcs: [{step: join}]}
  - {step: join, tool: {kind: noop}}
""", _admission),
    Scenario("back_edge_before_join", "D16", """
workflow:
  - step: start
    next: {spec: {mode: inclusive}, arcs: [{step: poll, args: {n: 0}}, {step: side}]}
  - step: poll
    tool: {kind: noop, result: "{{ args.n + 1 }}"}
    next:
      arcs:
        - {step: poll, when: "{{ event.result < 3 }}", args: {n: "{{ event.result }}"}}
        - {step: join, args: {polled: "{{ event.result }}"}}
  - step: side
    tool: {kind: noop, result: s}
    next: {arcs: [{step: join, args: {side: "{{ event.result }}"}}]}
  - {step: join, tool: {kind: noop, result: "{{ args }}"}}
""", _back_edge),
    Scenario("loops", "D11 D12 D19", (EXAMPLES / "loop.yaml").read_text(), _loops),
    Scenario("empty_loop", "D19", """
workflow:
  - step: start
    loop: {in: "{{ [] }}", iterator: x, spec: {mode: parallel}}
    tool: {kind: noop}
    next: {arcs: [{step: after, args: {n: "{{ event.result | length }}"}}]}
  - {step: after, tool: {kind: noop, result: "{{ args.n }}"}}
""", _empty_loop),
    Scenario("pagination", "D8 D9 D15 D19", (EXAMPLES / "pagination.yaml").read_text(), _pagination,
             workload={"api_url": "API"}),
    Scenario("event_order", "D20", """
workflow:
  - {step: start, tool: {kind: noop}}
""", _event_order),
    Scenario("python_main", "D25", """
workflow:
  - step: start
    tool:
      kind: python
      args: {a: 2, b: 3}
      code: |
        def main(a, b, **kw):
            return {"sum": a + b, "kw": sorted([*kw, "a", "b"])[:2]}
""", _python_main),
    Scenario("duckdb", "D27", (EXAMPLES / "hello.yaml").read_text(), _duckdb),
    Scenario("call_error_alias", "D13", """
workflow:
  - step: start
    tool: {kind: http, url: "API/status/503"}
    next: {arcs: [{step: recover, when: "{{ event.name == 'call.error' }}"}]}
  - {step: recover, tool: {kind: noop}}
""", _alias),
]
