"""A command whose reader goes away (`noetl events ID | head -1`) ends quietly: no message, status 141
(the shell's 128 + SIGPIPE), not "cannot reach the gateway"."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

LOOP = {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "many", "path": "tests/pipes_many"},
        "workflow": [{"step": "start", "loop": {"in": "{{ range(300) | list }}", "iterator": "i"},
                      "tool": {"kind": "noop", "result": "{{ iter.i }}"}}]}


def test_events_into_a_closed_pipe_end_quietly(stack):
    status, events = stack.execute(LOOP, timeout=120)
    assert status["status"] == "COMPLETED" and len(events) > 600
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("NOETL_")}, "NOETL_TOKEN": stack.token}
    for args in (["events", status["execution_id"]], ["status", status["execution_id"]]):
        noetl = subprocess.Popen([sys.executable, "-m", "noetl_mesh.cli", *args, "--gateway", stack.url],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        first = noetl.stdout.readline()  # what `head -1` reads; then it goes away
        noetl.stdout.close()
        err = noetl.stderr.read().decode()
        code = noetl.wait(60)
        assert first.strip(), args
        if args[0] == "events":  # 1 MB of events: more than a pipe holds, so it met the closed pipe
            assert code == 141, (code, err)
        assert code in (0, 141) and err == "", (args, code, err)


OK = {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "fine", "path": "tests/ls_fine"},
      "workflow": [{"step": "start", "tool": {"kind": "noop", "result": 1}}]}
BAD = {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "bad", "path": "tests/ls_bad"},
       "workflow": [{"step": "start", "tool": {"kind": "python", "code": "raise ValueError('no')"}}]}


def test_ls_lists_executions_newest_first_with_the_consoles_filters(stack):
    first, _ = stack.execute(OK)
    bad, _ = stack.execute(BAD)
    last, _ = stack.execute(OK)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("NOETL_")}, "NOETL_TOKEN": stack.token}

    def ls(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "noetl_mesh.cli", "ls", *args, "--gateway", stack.url],
                              capture_output=True, text=True, env=env, timeout=60)

    table = ls("--playbook", "tests/ls_fine")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["EXECUTION", "STATUS", "PLAYBOOK", "STARTED", "BY", "CREATED", "TOOK"]
    ids = [line.split()[0] for line in lines[1:]]
    assert ids == [last["execution_id"], first["execution_id"]]  # newest first, only that playbook's
    assert all(" COMPLETED " in line and " admin " in line for line in lines[1:])
    failed = ls("--status", "failed", "--json")
    assert failed.returncode == 0 and bad["execution_id"] in [r["execution_id"] for r in json.loads(failed.stdout)]
    assert all(r["status"] == "FAILED" for r in json.loads(failed.stdout))
    one = ls("--limit", "1")
    assert len(one.stdout.splitlines()) == 2 and "--offset 1 for the next page" in one.stderr
    assert ls("--limit", "0").returncode == 2


NAP = {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "nap", "path": "tests/pipes_nap"},
       "workflow": [{"step": "start", "tool": {"name": "pause", "kind": "wait", "duration": "2s"},
                     "next": {"arcs": [{"step": "end"}]}},
                    {"step": "end", "tool": {"kind": "noop", "result": "woke"}}]}


def test_status_and_events_as_tables_yaml_or_json_with_the_apis_filters_and_follow(stack):
    import yaml

    env = {**{k: v for k, v in os.environ.items() if not k.startswith("NOETL_")}, "NOETL_TOKEN": stack.token}

    def noetl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "noetl_mesh.cli", *args, "--gateway", stack.url],
                              capture_output=True, text=True, env=env, timeout=timeout)

    status, _ = stack.execute(LOOP, timeout=120)
    eid = status["execution_id"]
    piped = noetl("status", eid)  # a pipe: JSON, as scripts expect
    assert json.loads(piped.stdout)["status"] == "COMPLETED"
    as_yaml = noetl("status", eid, "-o", "yaml")
    assert yaml.safe_load(as_yaml.stdout) == json.loads(piped.stdout)
    done = noetl("events", eid, "-o", "table", "--name", "loop.iteration.done", "--iteration", "7")
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["TIMESTAMP", "NAME", "STEP", "TASK", "ITERATION", "ATTEMPT", "STATUS"]
    assert len(lines) == 2 and " loop.iteration.done " in lines[1] and " 7 " in lines[1]
    two = json.loads(noetl("events", eid, "--name", "step.started", "--name", "loop.done").stdout)
    assert sorted(e["name"] for e in two) == ["loop.done", "step.started"]

    async def start() -> str:
        async with stack.client() as client:
            return await client.start(NAP)

    eid = stack.run(start())
    follow = noetl("events", eid, "--follow", "-o", "json", timeout=120)  # returns when the execution ends
    assert follow.returncode == 0, follow.stderr
    followed = [json.loads(line) for line in follow.stdout.splitlines()]
    names = [e["name"] for e in followed]
    assert names[0] == "playbook.execution.requested" and names[-1] == "playbook.processed"
    assert "wait.ended" in names
    ids = [e["event_id"] for e in followed]
    assert len(ids) == len(set(ids))  # each event once
    assert ids == [e["event_id"] for e in json.loads(noetl("events", eid).stdout)]  # the whole log, in order
