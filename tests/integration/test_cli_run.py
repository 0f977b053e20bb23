"""D26: `noetl run FILE [--workload JSON] [--json]` as scripts use it: a real process, an embedded
stack started and stopped for it, exit codes, and exactly one JSON object on stdout."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
EXAMPLES = Path(__file__).parents[2] / "examples"


def noetl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "noetl_mesh.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_run_json_contract_and_workload_merge():
    proc = noetl("run", str(EXAMPLES / "hello.yaml"), "--json", "--workload", '{"greeting": "hi", "extra": {"a": 1}}')
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1  # exactly one JSON object on stdout
    out = json.loads(lines[0])
    assert set(out) == {"execution_id", "status", "workload", "ctx", "steps", "events"}
    assert out["status"] == "COMPLETED"
    assert out["workload"]["greeting"] == "hi" and out["workload"]["extra"] == {"a": 1}
    assert out["workload"]["numbers"] == [3, 1, 4, 1, 5, 9, 2, 6]  # merged over, not replaced
    assert out["steps"]["aggregate"] == {"status": "done", "runs": 1, "result": "hi: 8 squares add up to 173"}
    assert out["ctx"] == {"total": 173}
    assert all(set(e) == {"name", "step", "task", "iteration", "attempt"} for e in out["events"])
    names = [e["name"] for e in out["events"]]
    assert names[0] == "playbook.execution.requested" and names[-1] == "playbook.processed"
    processed = [e for e in out["events"] if e["name"] == "task.processed"]
    assert [(e["step"], e["task"], e["attempt"]) for e in processed][:1] == [("start", "start_task", 1)]


def test_run_failed_playbook_exits_1(tmp_path):
    pb = tmp_path / "fail.yaml"
    pb.write_text("""
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: fail, path: tests/fail}
workflow:
  - step: start
    tool: {kind: python, code: "raise RuntimeError('boom')"}
""")
    proc = noetl("run", str(pb), "--json")
    assert proc.returncode == 1, proc.stderr
    out = json.loads(proc.stdout)
    assert out["status"] == "FAILED" and out["steps"]["start"]["status"] == "failed"


def test_run_invalid_playbook_or_arguments_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {name: x, path: y}\nvars: {}\nworkflow: []\n")
    proc = noetl("run", str(bad), "--json")
    assert proc.returncode == 2 and "vars" in proc.stderr and proc.stdout == ""
    proc = noetl("run", str(EXAMPLES / "hello.yaml"), "--workload", "{not json")
    assert proc.returncode == 2 and "--workload" in proc.stderr
    proc = noetl("run", str(EXAMPLES / "hello.yaml"), "--workload", "[1]")
    assert proc.returncode == 2
    proc = noetl("run")
    assert proc.returncode == 2


def test_run_shows_progress_without_json():
    proc = noetl("run", str(EXAMPLES / "fork_join.yaml"))
    assert proc.returncode == 0, proc.stderr
    assert "step.started       eu" in proc.stdout and "step.done          report" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].endswith("COMPLETED")


def test_run_nested_example_registers_the_child_first():
    proc = noetl("run", str(EXAMPLES / "nested.yaml"), "--register", str(EXAMPLES / "nested_child.yaml"), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["status"] == "COMPLETED"
    assert out["steps"]["end"]["result"] == ["Oslo: mean 4.0, max 5", "Lisbon: mean 19.3, max 21"]
    assert sum(e["name"] == "task.suspended" for e in out["events"]) == 2  # one child per iteration


def test_run_nested_without_the_child_registered_fails_clearly(tmp_path):
    bad = tmp_path / "child.yaml"
    bad.write_text("apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {name: c}\nworkflow: []\n")
    proc = noetl("run", str(EXAMPLES / "nested.yaml"), "--register", str(bad))
    assert proc.returncode == 2 and str(bad) in proc.stderr  # every file is validated before anything runs
    proc = noetl("run", str(EXAMPLES / "nested.yaml"), "--json")
    assert proc.returncode == 1
    out = json.loads(proc.stdout)
    assert out["status"] == "FAILED"


def test_run_progress_shows_child_executions():
    proc = noetl("run", str(EXAMPLES / "nested.yaml"), "--register", str(EXAMPLES / "nested_child.yaml"))
    assert proc.returncode == 0, proc.stderr
    started = [line for line in proc.stdout.splitlines() if "child.started" in line]
    finished = [line for line in proc.stdout.splitlines() if "child.finished" in line]
    assert len(started) == 2 and all("summarise -> examples/nested_child" in line for line in started)
    assert len(finished) == 2 and all(line.endswith("COMPLETED") for line in finished)
