"""noetl verify's checks: every real log passes; each kind of damage is found and named."""
from __future__ import annotations

import copy

import pytest

from noetl_mesh.core.verify import verify

from test_engine import FORK_JOIN, LINEAR, play, run

LOOP = """
- step: start
  loop: {in: "{{ [1, 2, 3, 4] }}", iterator: x, spec: {mode: parallel, max_in_flight: 2}}
  tool: {kind: noop, result: "{{ iter.x * 10 }}"}
  next: {arcs: [{step: after}]}
- step: after
  tool: {kind: noop, result: "{{ start.result }}"}
"""


def log_of(doc, **kw):
    r = run(doc, **kw)
    return [e for e in r.log if e["execution_id"] == r.execution_id]


@pytest.mark.parametrize("seed", [None, 3, 7])
@pytest.mark.parametrize("workflow,workload", [(LINEAR, None), (FORK_JOIN, {"a": True, "b": True, "c": True}),
                                               (LOOP, None)], ids=["chain", "fork_join", "loop"])
def test_real_logs_pass(workflow, workload, seed):
    report = verify(log_of(play(workflow, workload), seed=seed))
    assert report.ok, report.findings
    assert report.status == "COMPLETED"


def checks(events):
    return {f.check for f in verify(events).findings}


def test_unfinished_and_replay_mismatch():
    log = log_of(play(LINEAR))
    assert "finished" in checks([e for e in log if e["name"] not in ("workflow.finished", "playbook.processed")])
    bad = copy.deepcopy(log)
    next(e for e in bad if e["name"] == "workflow.finished")["data"]["status"] = "FAILED"
    assert "replay" in checks(bad)


def test_a_run_ended_twice_and_an_event_stored_twice():
    log = log_of(play(LINEAR))
    done = next(e for e in log if e["name"] == "step.done")
    twice = log + [{**done, "event_id": "another", "name": "step.failed"}]
    found = verify(twice).findings
    assert any(f.check == "runs" and "ended 2 times" in f.message and f.step == done["step"] for f in found)
    assert "ids" in checks(log + [done])


def test_token_consumed_twice():
    log = log_of(play(LINEAR))
    admitted = [e for e in log if e["name"] == "step.admitted"]
    copy_ = copy.deepcopy(admitted[1])
    copy_["event_id"] += "x"
    copy_["data"]["run_id"] = copy_["step_run_id"] = "other-run"
    assert "tokens" in checks(log + [copy_])


def test_loop_iteration_missing_or_doubled():
    log = log_of(play(LOOP))
    ends = [e for e in log if e["name"] == "loop.iteration.done"]
    missing = [e for e in log if e is not ends[0]]
    found = verify(missing).findings
    assert any(f.check == "loops" and "never ended" in f.message for f in found)
    doubled = log + [{**ends[1], "event_id": "dup-end", "name": "loop.iteration.failed"}]
    assert any(f.check == "loops" and "ended 2 times" in f.message and f.iteration == ends[1]["iteration"]
               for f in verify(doubled).findings)


def test_command_started_after_the_finish():
    log = log_of(play(LINEAR))
    started = next(e for e in log if e["name"] == "step.started" and e["source"].startswith("worker"))
    late = {**started, "event_id": "late", "step_run_id": "run-after-finish"}
    found = verify(log + [late]).findings
    assert any(f.check == "after_finish" for f in found)
    # a run already in flight that reports after the finish is fine
    assert not any(f.check == "after_finish" for f in verify(log + [{**started, "event_id": "again"}]).findings)
