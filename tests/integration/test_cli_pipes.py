"""A command whose reader goes away (`noetl events ID | head -1`) ends quietly: no message, status 141
(the shell's 128 + SIGPIPE), not "cannot reach the gateway"."""
from __future__ import annotations

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
