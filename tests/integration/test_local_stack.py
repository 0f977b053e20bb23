"""`noetl up --replicas ... --port P` as a new user runs it: one process per replica, the URLs printed,
and the other commands (`ps`, `inspect`, `run`, `status`) find the stack from its directory without
any option or exported variable."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from noetl_mesh.stack import free_port
from noetl_mesh.testing.fixture_api import FixtureApi

from conftest import noetl_up

pytestmark = pytest.mark.integration
EXAMPLES = Path(__file__).parents[2] / "examples"
ENV = {k: v for k, v in os.environ.items() if not k.startswith("NOETL_")}
PROBE = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {{name: probe, path: tests/up_probe}}
workflow:
  - step: start
    tool: {{kind: http, url: "{api}/assessments"}}
    next: {{arcs: [{{step: neighbour}}]}}
  - step: neighbour
    tool: {{kind: http, url: "{neighbour}/"}}
"""


def test_up_with_replicas_and_a_port_is_found_by_the_other_commands():
    root = tempfile.mkdtemp(prefix="noetl-up-")  # Postgres's own user must reach its data directory
    os.chmod(root, 0o755)
    env = {**ENV, "XDG_CONFIG_HOME": os.path.join(root, "config")}
    port = free_port()

    def noetl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "noetl_mesh.cli", *args], capture_output=True, text=True,
                              timeout=timeout, env=env, cwd=root)

    api = FixtureApi().start()  # D33: the workers (processes) may reach it, as --allow-net says, and no more
    up, out = noetl_up(["--port", str(port), "--replicas", "admission=2,router=2,worker=3",
                        "--allow-net", api.endpoint], env, timeout=180, cwd=root)
    try:
        assert f"  gateway: http://127.0.0.1:{port} (web console at http://127.0.0.1:{port}/ui, OpenAPI docs at " \
               f"http://127.0.0.1:{port}/docs)" in out
        nats_url, monitoring = re.search(r"  NATS: (nats://\S+) \(monitoring: (http://\S+)\)", out).groups()
        with urllib.request.urlopen(f"{monitoring}/healthz", timeout=5) as r:  # the printed monitoring URL answers
            assert r.status == 200
        assert ("services: event-recorder, credentials, sessions, admission x2, router x2, loop-coordinator, scheduler, worker x3, "
                "gateway (one process each") in out
        info = json.loads(Path(root, ".noetl", "stack.json").read_text())
        assert sorted(info["metrics"]) == sorted(info["pids"].keys() - {"nats-server", "postgres"})  # each its port
        assert (info["gateway"], info["nats"], info["nats_monitoring"]) == (f"http://127.0.0.1:{port}", nats_url,
                                                                            monitoring)
        assert sorted(k for k in info["pids"] if k.startswith(("admission", "router", "worker"))) == \
            ["admission-0", "admission-1", "router-0", "router-1", "worker-0", "worker-1", "worker-2"]

        deadline = time.monotonic() + 180  # every replica answers (the processes start in their own time; a guard)
        while True:
            ps = noetl("ps", "--json", "--wait", "2")
            assert ps.returncode == 0, ps.stderr
            rows = json.loads(ps.stdout)
            counts = {s: sum(r["service"] == s for r in rows) for s in {r["service"] for r in rows}}
            want = {"event-recorder": 1, "credentials": 1, "sessions": 1, "admission": 2, "router": 2, "loop-coordinator": 1,
                    "scheduler": 1, "worker": 3, "gateway": 1}
            if counts == want:
                break
            assert time.monotonic() < deadline, counts
            time.sleep(1)
        assert {int(r["pid"]) for r in rows if r["service"] == "worker"} == \
            {info["pids"][f"worker-{i}"] for i in range(3)}  # each replica its own process

        run = noetl("run", str(EXAMPLES / "hello.yaml"), "--json")  # no --gateway: the running stack's
        assert run.returncode == 0, (run.stderr, run.stdout[-3000:],
                                     "".join(p.read_text(errors="replace")[-3000:]
                                             for p in Path(root, ".noetl").glob("worker*.log")))
        assert f"running on the noetl up of {root}/.noetl (http://127.0.0.1:{port}" in run.stderr
        eid = json.loads(run.stdout)["execution_id"]
        assert f"noetl: execution {eid} started (noetl status {eid})" in run.stderr  # said at once, before the end
        status = noetl("status", eid)  # found without --gateway, with the token `noetl up` stored
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["status"] == "COMPLETED"
        api_port = int(api.endpoint.rsplit(":", 1)[1])
        Path(root, "probe.yaml").write_text(PROBE.format(api=api.url, neighbour=f"http://127.0.0.1:{api_port + 1}"))
        probe = noetl("run", "probe.yaml", "--json")
        assert probe.returncode == 1, probe.stderr
        steps = json.loads(probe.stdout)["steps"]
        assert steps["start"]["status"] == "done" and steps["start"]["result"]["data"]["paging"]["page"] == 1
        assert steps["neighbour"]["status"] == "failed"
        assert json.loads(probe.stdout)["error"]["kind"] == "sandbox"
        streams = noetl("inspect", "streams")
        assert streams.returncode == 0 and re.search(r"^NOETL_EVENTS\s+\d+", streams.stdout, re.M), streams
        up.send_signal(signal.SIGTERM)
        up.wait(90)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        api.stop()
        shutil.rmtree(root, ignore_errors=True)
    assert up.returncode == 0
