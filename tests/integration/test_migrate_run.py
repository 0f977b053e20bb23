"""Legacy playbooks (tests/fixtures/migrate) migrated by `noetl migrate` and run with the real tools
(python, http against the local fixture API, duckdb, postgres): each gives the results its legacy
form was written to give (expected.json), through the in-process engine; and `noetl run --migrate`
runs a legacy playbook on a real embedded stack."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from noetl_mesh.core.local import run_local
from noetl_mesh.core.state import summary
from noetl_mesh.lang.migrate import migrate_text
from noetl_mesh.lang.validate import load_playbook
from noetl_mesh.sandbox.policy import Policy, parse_destinations
from noetl_mesh.tools import close_tools, default_tools

from conftest import pg_endpoint

pytestmark = pytest.mark.integration
FIXTURES = Path(__file__).parents[1] / "fixtures" / "migrate"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())


async def _run(doc, workload=None, credentials=None, allow_net=""):
    """``allow_net``: the endpoints its tasks may reach (D33): the fixture API's, the database's."""
    tools = default_tools(policy=Policy(allow=parse_destinations(allow_net)))
    try:
        return await run_local(doc, workload=workload, tools=tools, credentials=credentials)
    finally:
        await close_tools(tools)


def check(name: str, out: dict) -> None:
    want = EXPECTED[name]
    assert out["status"] == want["status"], out
    for step, result in want["steps"].items():
        assert out["steps"][step]["status"] == "done", (step, out["steps"][step])
        assert out["steps"][step]["result"] == result, step
    for step in want.get("skipped", []):
        assert step not in out["steps"]  # never reached: its arc was not taken
    for key, value in want.get("ctx", {}).items():
        assert out["ctx"][key] == value


def migrated(name: str) -> dict:
    path = FIXTURES / f"{name}.yaml"
    m = migrate_text(path.read_text(), source=path)
    assert m.complete, [str(p) for p in m.problems]
    return load_playbook(m.text).document


@pytest.mark.parametrize("name", ["heavy_loop", "hello_world", "case_routing", "control_flow_workbook",
                                  "step_set_reads_itself", "unrouted_end", "arc_set_ctx",
                                  "pipeline_task_set", "policy_error_reads", "error_field_values",
                                  "step_input_script", "artifact_get"])
def test_migrated_fixture_runs_and_gives_its_results(name):
    check(name, summary(asyncio.run(_run(migrated(name))).state))


def test_migrated_http_pipeline_reads_the_body_and_the_status(fixture_api):
    run = asyncio.run(_run(migrated("http_pipeline"), workload={"api_url": fixture_api.url},
                           allow_net=fixture_api.endpoint))
    check("http_pipeline", summary(run.state))


def test_migrated_result_spellings_read_the_body_the_status_and_the_rows(fixture_api):
    run = asyncio.run(_run(migrated("result_spellings"), workload={"api_url": fixture_api.url},
                           allow_net=fixture_api.endpoint))
    check("result_spellings", summary(run.state))


def test_migrated_step_output_select_stores_the_selected_part(fixture_api):
    run = asyncio.run(_run(migrated("step_output_select"), workload={"api_url": fixture_api.url},
                           allow_net=fixture_api.endpoint))
    check("step_output_select", summary(run.state))


@pytest.mark.parametrize("name", ["paginate_by_retry", "cursor_loop"])
def test_migrated_pagination_by_retry_collects_every_page(fixture_api, name):
    run = asyncio.run(_run(migrated(name), workload={"api_url": fixture_api.url}, allow_net=fixture_api.endpoint))
    check(name, summary(run.state))
    if name == "paginate_by_retry":  # page 2 answered 503 once: the call was retried (on_error), not failed
        assert [e["attempt"] for e in run.log if e["name"] == "task.started"
                and e["task"] == "fetch_all_assessments_page"] == [1, 1, 2, 1]


@pytest.mark.parametrize("name", ["cursor_table", "cursor_steps"])
def test_migrated_cursor_loop_over_a_table_reads_every_batch(pg_dsn, name):
    run = asyncio.run(_run(migrated(name), credentials={"pg_local": {"dsn": pg_dsn}}, allow_net=pg_endpoint(pg_dsn)))
    check(name, summary(run.state))


def test_migrated_postgres_playbook_runs_with_the_stored_credential(pg_dsn):
    run = asyncio.run(_run(migrated("postgres_crud"), credentials={"pg_local": {"dsn": pg_dsn}},
                           allow_net=pg_endpoint(pg_dsn)))
    check("postgres_crud", summary(run.state))


def test_run_migrate_runs_a_legacy_playbook_on_the_embedded_stack(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("NOETL_")}
    legacy = FIXTURES / "hello_world.yaml"
    proc = subprocess.run([sys.executable, "-m", "noetl_mesh.cli", "run", str(legacy), "--json"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2 and "not part of the language" not in proc.stdout  # as it is: invalid
    proc = subprocess.run([sys.executable, "-m", "noetl_mesh.cli", "run", "--migrate", str(legacy), "--json"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "migrated in memory" in proc.stderr
    out = json.loads(proc.stdout)
    check("hello_world", out)
    assert legacy.read_text().startswith("# The smallest legacy playbook")  # the file itself is untouched
