"""Admission that cannot decide: an admit rule whose template fails (D17) fails the step run with a
routable template error, never a silent skip; limits on the workload and on a loop's collection."""
from __future__ import annotations

from noetl_mesh import limits

from test_engine import names, outcome, play

BROKEN_GATE = """
- step: start
  next: {arcs: [{step: gate}]}
- step: gate
  spec:
    policy:
      admit:
        rules:
          - when: "{{ args.missing.deeper > 1 }}"
            then: {allow: true}
          - else: {then: {allow: false}}
  tool: {kind: noop, result: ran}
  next:
    arcs:
      - {step: handled, when: "{{ event.name == 'step.failed' and event.error.kind == 'template_error' }}"}
- step: handled
  tool: {kind: noop, result: "{{ 'routed' }}"}
"""


def test_admit_rule_template_error_fails_the_step_and_is_routable():
    s, r = outcome(play(BROKEN_GATE))
    assert s["status"] == "COMPLETED"
    assert s["steps"]["gate"]["status"] == "failed" and s["steps"]["gate"]["runs"] == 1
    assert s["steps"]["handled"]["result"] == "routed"
    assert "step.skipped" not in names(r)
    failed = next(e for e in r.log if e["name"] == "step.failed")
    assert failed["data"]["error"]["kind"] == "template_error"
    assert "step=gate.spec.policy.admit.rules[0].when" in failed["data"]["error"]["message"]
    assert "task.started" not in names(r, "gate")  # the pipeline never ran


def test_admit_rule_template_error_unhandled_fails_the_execution():
    doc = play(BROKEN_GATE)
    doc["workflow"][1]["next"] = {"arcs": [{"step": "handled"}]}  # only success routes
    s, _ = outcome(doc)
    assert s["status"] == "FAILED"
    assert s["steps"]["gate"]["status"] == "failed" and "handled" not in s["steps"]


def test_admit_rule_template_error_on_a_loop_step_starts_no_loop():
    doc = play(BROKEN_GATE)
    doc["workflow"][1]["loop"] = {"in": "{{ [1, 2, 3] }}", "iterator": "x"}
    for seed in (None, 1, 2):
        s, r = outcome(doc, seed=seed)
        assert s["steps"]["gate"]["status"] == "failed" and s["steps"]["handled"]["result"] == "routed"
        assert "loop.started" not in names(r) and "loop.iteration.started" not in names(r)
        failed = next(e for e in r.log if e["name"] == "step.failed")
        assert (failed["data"]["total"], failed["data"]["done"], failed["data"]["failed"]) == (0, 0, 0)


def test_workload_over_the_limit_is_refused_with_the_limit_named():
    doc = play("- step: start\n  tool: {kind: noop, result: 1}\n")
    with limits.override(max_workload_bytes=1000):
        s, r = outcome(doc, workload={"blob": "x" * 2000})
    assert s["status"] == "FAILED"
    evaluated = next(e for e in r.log if e["name"] == "playbook.request.evaluated")
    assert evaluated["status"] == "error"
    assert "max_workload_bytes" in evaluated["data"]["errors"][0]
    assert "NOETL_LIMIT_MAX_WORKLOAD_BYTES" in evaluated["data"]["errors"][0]
    assert "step.admitted" not in names(r)


def test_loop_collection_over_the_limit_fails_the_step():
    doc = play("""
- step: start
  loop: {in: "{{ range(50) | list }}", iterator: x}
  tool: {kind: noop, result: "{{ iter.x }}"}
""")
    with limits.override(max_loop_items=10):
        s, r = outcome(doc)
    assert s["status"] == "FAILED" and s["steps"]["start"]["status"] == "failed"
    failed = next(e for e in r.log if e["name"] == "step.failed")
    assert failed["data"]["error"]["kind"] == "limit_exceeded"
    assert "max_loop_items" in failed["data"]["error"]["message"]
    assert "loop.started" not in names(r)
