"""The limits table: one home, every limit documented, clear messages."""
import re
from pathlib import Path

import pytest

from noetl_mesh import limits

DOC = (Path(__file__).parents[2] / "docs" / "limits.md").read_text()


@pytest.mark.parametrize("limit", limits.LIMITS, ids=lambda l: l.name)
def test_every_limit_is_documented_with_its_variable(limit):
    row = next((line for line in DOC.splitlines() if line.startswith(f"| `{limit.name}` ")), None)
    assert row is not None, f"docs/limits.md has no row for {limit.name}"
    assert f"`{limit.env}`" in row


def test_environment_overrides_and_rejects_nonsense():
    got = limits.from_environment({"NOETL_LIMIT_MAX_BODY_BYTES": "1234"})
    assert got.max_body_bytes == 1234
    assert got.max_steps == 1_000
    with pytest.raises(ValueError, match="NOETL_LIMIT_MAX_STEPS"):
        limits.from_environment({"NOETL_LIMIT_MAX_STEPS": "many"})
    with pytest.raises(ValueError, match="positive"):
        limits.from_environment({"NOETL_LIMIT_MAX_STEPS": "0"})


def test_message_names_the_limit_where_and_how_to_change_it():
    with limits.override(max_body_bytes=1024):
        exc = limits.LimitExceeded("max_body_bytes", 4096, where="POST /api/executions")
    msg = str(exc)
    assert msg.startswith("POST /api/executions: the request body is 4 KiB")
    assert "max_body_bytes = 1 KiB" in msg and "NOETL_LIMIT_MAX_BODY_BYTES" in msg


def test_override_is_scoped_and_checks_names():
    before = limits.current().max_steps
    with limits.override(max_steps=3):
        assert limits.current().max_steps == 3
    assert limits.current().max_steps == before
    with pytest.raises(AttributeError):
        with limits.override(no_such_limit=1):
            pass


FLOOD = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: flood, path: t/flood}
executor: {spec: {max_steps: STEPS}}
workflow:
  - step: start
    spec: {max_steps: STEPS}
    tool:
      kind: noop
      spec:
        policy:
          rules:
            - when: "{{ true }}"
              then: {do: retry, attempts: ATTEMPTS, delay: 0}
"""


def test_a_retry_or_a_jump_cycle_cannot_be_made_to_run_without_bound():
    """One request must not write events for ever: a retry rule's attempts and max_steps are bounded
    by engine limits, checked as the playbook is validated (where, and which limit to raise)."""
    from noetl_mesh.lang.validate import validate_text

    def errors(steps: int, attempts: int) -> list[str]:
        return [str(d) for d in validate_text(FLOOD.replace("STEPS", str(steps)).replace("ATTEMPTS", str(attempts))).errors]

    assert errors(100_000, 100) == []
    found = errors(10 ** 9, 10 ** 12)
    assert len(found) == 3, found  # the executor's max_steps, the step's, the rule's attempts
    assert sum("over the limit max_task_visits = 100,000 visits" in e for e in found) == 2
    assert any("then.attempts" in e and "max_task_attempts = 100 attempts" in e and
               "NOETL_LIMIT_MAX_TASK_ATTEMPTS" in e for e in found)
    with limits.override(max_task_attempts=1000):
        assert errors(100, 1000) == []


CYCLE = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: cycle, path: t/cycle}
workflow:
  - step: start
    tool: {kind: noop}
    next: {arcs: [{step: start}]}
"""


def test_an_arc_cycle_ends_at_max_step_runs():
    """An arc back to its own step is a loop the author meant, or not: it ends FAILED once the execution
    has started more than max_step_runs step runs, each of which every control-plane fold holds."""
    import asyncio

    import yaml

    from noetl_mesh.core.local import run_local

    with limits.override(max_step_runs=40):
        run = asyncio.run(run_local(yaml.safe_load(CYCLE)))
    [finished] = [e for e in run.log if e["name"] == "workflow.finished"]
    error = finished["data"]["error"]
    assert run.state.status == "FAILED" and error["kind"] == "limit_exceeded", error
    assert "is 41 step runs, over the limit max_step_runs = 40 step runs" in error["message"]
    assert len(run.state.runs) == 41
