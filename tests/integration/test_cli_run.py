"""D26: `noetl run FILE [--workload JSON] [--json]` as scripts use it: a real process, an embedded
stack started and stopped for it, exit codes, and exactly one JSON object on stdout."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import SLOW, noetl_up

pytestmark = pytest.mark.integration
EXAMPLES = Path(__file__).parents[2] / "examples"


ENV = {k: v for k, v in os.environ.items() if not k.startswith("NOETL_")}  # an embedded stack, always


def noetl(*args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "noetl_mesh.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env or ENV)


def test_run_json_contract_and_workload_merge():
    proc = noetl("run", str(EXAMPLES / "hello.yaml"), "--json", "--workload", '{"greeting": "hi", "extra": {"a": 1}}')
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1  # exactly one JSON object on stdout
    out = json.loads(lines[0])
    assert set(out) == {"execution_id", "status", "workload", "ctx", "steps", "error", "events"}
    assert out["status"] == "COMPLETED" and out["error"] is None
    assert out["workload"]["greeting"] == "hi" and out["workload"]["extra"] == {"a": 1}
    assert out["workload"]["numbers"] == [3, 1, 4, 1, 5, 9, 2, 6]  # merged over, not replaced
    assert out["steps"]["aggregate"] == {"status": "done", "runs": 1, "result": "hi: 8 squares add up to 173"}
    assert out["ctx"] == {"total": 173}
    assert all(set(e) == {"name", "step", "task", "iteration", "attempt"} for e in out["events"])
    names = [e["name"] for e in out["events"]]
    assert names[0] == "playbook.execution.requested" and names[-1] == "playbook.processed"
    processed = [e for e in out["events"] if e["name"] == "task.processed"]
    assert [(e["step"], e["task"], e["attempt"]) for e in processed][:1] == [("start", "start_task", 1)]


def test_run_on_its_own_stack_starts_no_gateway_and_checks_the_workload_itself():
    """Nobody else can reach the stack `noetl run` starts: it runs no gateway (FastAPI is not even
    imported), and the command checks on the way in what the gateway would, saying who refused."""
    code = ("import sys; from noetl_mesh.cli.app import main; rc = main(['run', sys.argv[1], '--json']); "
            "print('gateway modules:', sorted(m for m in ('fastapi', 'uvicorn', 'noetl_mesh.services.gateway.app') "
            "if m in sys.modules), file=sys.stderr); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, str(EXAMPLES / "hello.yaml")], capture_output=True, text=True,
                          timeout=120, env=ENV)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["status"] == "COMPLETED"
    assert proc.stderr.splitlines()[-1] == "gateway modules: []"
    proc = noetl("run", str(EXAMPLES / "hello.yaml"), "--workload", '{"pad": "%s"}' % ("x" * 200),
                 env={**ENV, "NOETL_LIMIT_MAX_WORKLOAD_BYTES": "100"})
    assert proc.returncode == 1
    assert proc.stderr == ("noetl: the embedded stack answered 413: workload: the workload (JSON) is 210 bytes, over "
                           "the limit max_workload_bytes = 100 bytes (set NOETL_LIMIT_MAX_WORKLOAD_BYTES to change it)\n")


FORGED = {"store": "nats-object:noetl_payloads", "key": "ab", "size": 1, "checksum": "c"}


def test_a_payload_reference_written_by_the_user_is_refused_before_anything_runs(tmp_path):
    """Only the engine writes a payload reference (D23). One in `--workload` is a bad argument (exit 2,
    said at once; before, the run hung until `--timeout`: the control plane dropped the request whose
    reference it could not read back); one in the playbook is invalid, at its line."""
    proc = noetl("run", str(EXAMPLES / "hello.yaml"), "--timeout", "60", "--workload", json.dumps({"x": FORGED}))
    assert proc.returncode == 2
    assert proc.stderr.startswith("noetl: --workload at x: an object whose keys are exactly store, key, size and "
                                  "checksum"), proc.stderr
    pb = tmp_path / "forged.yaml"
    pb.write_text(f"""
apiVersion: noetl.io/v2
kind: Playbook
metadata: {{name: forged, path: tests/forged}}
workload: {{deep: [{json.dumps(FORGED)}]}}
workflow:
  - step: start
    tool: {{kind: noop}}
""")
    proc = noetl("run", str(pb), "--timeout", "60")
    assert proc.returncode == 2
    assert "is a payload reference, which only the engine writes (D23) (line 5, column" in proc.stderr, proc.stderr


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
    assert out["error"]["kind"] == "python_error" and out["error"]["message"] == "boom"
    assert "RuntimeError: boom" in out["error"]["traceback"]
    # for people: the error as YAML, its traceback a block, no Python reprs
    proc = noetl("run", str(pb))
    assert proc.returncode == 1, proc.stderr
    assert re.search(r"^execution \w+: FAILED in [\d.]+s\n  start  failed\nerror:\n  kind: python_error\n  message: boom\n"
                     r"  retryable: false\n  traceback: \|\n    Traceback \(most recent call last\):\n", proc.stdout, re.M)
    assert "{'" not in proc.stdout and "Traceback" not in proc.stderr


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
    lines = proc.stdout.strip().splitlines()
    assert re.fullmatch(r"execution \w+: COMPLETED in [\d.]+s", lines[-5])
    assert lines[-4:] == ["  start   done", "  eu      done  {orders: 120, region: eu}",
                          "  us      done  {orders: 80, region: us}", "  report  done  {total_orders: 200}"]


def test_run_shows_loop_progress_when_piped():
    proc = noetl("run", str(EXAMPLES / "loop.yaml"))
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^  loop               start 3/3 iterations, [\d.]+/s, [\d.]+s\n  loop.done          start$",
                     proc.stdout, re.M), proc.stdout
    assert "\r" not in proc.stdout and "\x1b" not in proc.stdout  # no bar: stdout is a pipe


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


def test_run_progress_shows_a_wait_and_its_end(tmp_path):
    pb = tmp_path / "nap.yaml"
    pb.write_text("""
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: nap, path: tests/nap}
workflow:
  - step: start
    tool: {name: pause, kind: wait, duration: 1s}
""")
    proc = noetl("run", str(pb))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any(re.fullmatch(r"\s+waiting\s+start pause: 1 s", line) for line in lines), proc.stdout
    assert any(re.fullmatch(r"\s+wait.ended\s+start pause: ok", line) for line in lines), proc.stdout
    assert "None" not in proc.stdout


# ------------------------------------------------------------------------------ stopping early
def test_run_timeout_is_a_message_and_exit_3(tmp_path):
    pb = tmp_path / "slow.yaml"
    pb.write_text(SLOW)
    proc = noetl("run", str(pb), "--timeout", "2")  # within noetl()'s 120 s: the hour-long task was cancelled
    assert proc.returncode == 3, proc.stderr
    assert re.fullmatch(r"noetl: execution \w+ did not finish within 2s \(--timeout\): cancelling it and stopping "
                        r"the embedded stack\n", proc.stderr), proc.stderr


def _children(pid: int) -> dict[int, str]:
    """The processes whose parent is ``pid``, with their command lines."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out[int(entry)] = cmd
    return out


def _describe(pid: int) -> str:
    """A process's command line and parent, for a failure's message."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
    except OSError:
        return "gone"
    return f"{cmd} (parent {ppid})"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_noetl_run_with_its_nats_and_postgres(tmp_path, sig):
    pb = tmp_path / "slow.yaml"
    pb.write_text(SLOW)
    proc = subprocess.Popen([sys.executable, "-m", "noetl_mesh.cli", "run", str(pb)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.monotonic() + 120
        lines = []
        while not any("step.started" in line for line in lines):  # the task runs: everything is up
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines) + proc.stderr.read()
            lines.append(proc.stdout.readline())
        children = _children(proc.pid)
        nats = [pid for pid, cmd in children.items() if "nats-server" in cmd]
        pg = [pid for pid, cmd in children.items() if "postgres" in cmd.split(" ")[0]]
        runners = [pid for pid, cmd in children.items() if "sandbox.forkserver" in cmd]
        assert len(nats) == 1 and len(pg) == 1 and runners, children
        nats_dir = Path(re.search(r"--ports_file_dir (\S+)", children[nats[0]]).group(1))
        pg_dir = Path(re.search(r" -D (\S+)", children[pg[0]]).group(1)).parent
        assert nats_dir.is_dir() and (pg_dir / "data" / "PG_VERSION").exists()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)  # the task (an hour's sleep) is cancelled, not waited for
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + sig, err
    assert re.fullmatch(rf"noetl: interrupted \({sig.name}\): cancelling execution \w+ and stopping the embedded "
                        r"stack\n", err), err
    deadline = time.monotonic() + 10  # orphans would be reparented and stay; the reaped ones go
    while any(_alive(pid) for pid in nats + pg + runners) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in nats + pg + runners if _alive(pid)]
    assert not nats_dir.exists() and not pg_dir.exists()


def test_a_signal_while_the_servers_start_stops_them(tmp_path):
    """A signal while the embedded stack's servers start (here: as soon as the NATS server runs) stops
    what has started, and nothing is left running."""
    pb = tmp_path / "slow.yaml"
    pb.write_text(SLOW)
    proc = subprocess.Popen([sys.executable, "-m", "noetl_mesh.cli", "run", str(pb)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.monotonic() + 60
        nats: list[int] = []
        while not nats:
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
            nats = [pid for pid, cmd in _children(proc.pid).items() if "nats-server" in cmd]
        proc.send_signal(signal.SIGTERM)
        seen = set(nats)  # whatever it starts until it exits (Postgres may start after the signal)
        while proc.poll() is None and time.monotonic() < deadline:
            seen |= {pid for pid, cmd in _children(proc.pid).items() if "sandbox" not in cmd}
            time.sleep(0.01)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert re.fullmatch(r"noetl: interrupted \(SIGTERM\): (cancelling execution \w+ and )?stopping the embedded "
                        r"stack\n", err), err
    # a sandbox fork server caught starting (before its exec, named like its parent) ends when it reads
    # its parent's end of the control socket closed: on a loaded machine only after its imports
    deadline = time.monotonic() + 60
    while any(_alive(pid) for pid in seen) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {pid: _describe(pid) for pid in seen if _alive(pid)}
    assert not left, left


def test_a_second_noetl_up_on_a_home_says_one_runs_there(tmp_path):
    import shutil
    import tempfile

    env = {**ENV, "XDG_CONFIG_HOME": str(tmp_path / "config")}
    root = tempfile.mkdtemp(prefix="noetl-up-")  # Postgres's own user must reach its data directory
    os.chmod(root, 0o755)
    home = Path(root) / "home"
    proc, text = noetl_up(["--in-process", "--home", str(home)], env)
    try:
        url = re.search(r"gateway: (http://\S+)", text).group(1)
        info = json.loads((home / "stack.json").read_text())
        assert info["pid"] == proc.pid and info["gateway"] == url
        second = noetl("up", "--in-process", "--home", str(home), env=env, timeout=60)
        assert second.returncode == 5 and second.stdout == ""
        assert second.stderr == (f"noetl: a noetl stack already runs from {home} (pid {proc.pid}): gateway {url}, "
                                 f"NATS {info['nats']}; use it (noetl commands find it with --home {home} or NOETL_HOME={home}), stop it (Ctrl-C where "
                                 f"it runs, or kill {proc.pid}), or start another with --home DIR\n")
        assert noetl("status", "nope", "--gateway", url, env=env).returncode == 1  # the first one still serves: 404
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(root, ignore_errors=True)
    assert proc.returncode == 0
    assert not (home / "stack.json").exists()


# ------------------------------------------------------------------------------ the examples as the README says
def test_the_pagination_example_without_its_api_fails_naming_the_url():
    proc = noetl("run", str(EXAMPLES / "pagination.yaml"), "--workload", '{"api_url": "http://127.0.0.1:1"}',
                 "--allow-net", "127.0.0.1:1")
    assert proc.returncode == 1, proc.stderr
    assert "iteration.failed   fetch_all_endpoints[0] (GET http://127.0.0.1:1/assessments: cannot connect" in proc.stdout
    assert ("message: '2 of 2 endpoint(s) could not be read from http://127.0.0.1:1: is the API running "
            "(python -m noetl_mesh.testing.fixture_api), and open to the workers (noetl run --allow-net "
            "127.0.0.1:8765)?'") in proc.stdout


def test_the_pagination_example_without_allow_net_is_refused_saying_how_to_open_it():
    """D33: loopback is closed to tasks; the refusal is not retried and names the flag that opens it."""
    proc = noetl("run", str(EXAMPLES / "pagination.yaml"), "--workload", '{"api_url": "http://127.0.0.1:1"}', "--json")
    assert proc.returncode == 1, proc.stderr
    out = json.loads(proc.stdout)
    assert out["error"]["message"].startswith("2 of 2 endpoint(s) could not be read from http://127.0.0.1:1")
    fetches = [e for e in out["events"] if e["name"] == "task.processed" and e["task"] == "fetch_page"]
    assert len(fetches) == 2 and all(e["attempt"] == 1 for e in fetches)  # refused once each, not retried
    proc = noetl("run", str(EXAMPLES / "pagination.yaml"), "--workload", '{"api_url": "http://127.0.0.1:1"}')
    assert ("GET http://127.0.0.1:1/assessments" not in proc.stdout
            and "http task refused: 127.0.0.1 is a loopback address, closed to tasks on this worker pool (D33); "
                "open it with NOETL_SANDBOX_ALLOW_NET=127.0.0.1:1 (noetl run/up: --allow-net 127.0.0.1:1)" in proc.stdout)


def test_allow_net_is_checked_before_anything_starts():
    proc = noetl("run", str(EXAMPLES / "hello.yaml"), "--allow-net", "127.0.0.1:99999")
    assert proc.returncode == 2
    assert proc.stderr == "noetl: --allow-net: '127.0.0.1:99999': the port must be a number from 1 to 65535\n"
    proc = noetl("run", str(EXAMPLES / "hello.yaml"), env={**ENV, "NOETL_SANDBOX_ALLOW_NET": "not a host"})
    assert proc.returncode == 2
    assert proc.stderr == "noetl: NOETL_SANDBOX_ALLOW_NET: 'not a host' is neither an address, a network nor a host name\n"
    proc = noetl("run", str(EXAMPLES / "hello.yaml"), "--gateway", "http://127.0.0.1:1", "--allow-net", "10.0.0.1")
    assert proc.returncode == 2 and "the workers behind http://127.0.0.1:1 have their own setting" in proc.stderr


def test_the_pagination_example_with_the_fixture_api_started_as_the_readme_says(tmp_path):
    from noetl_mesh.stack import free_port

    port = free_port()
    api = subprocess.Popen([sys.executable, "-m", "noetl_mesh.testing.fixture_api", "--port", str(port)],
                           stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert api.stdout.readline() == f"fixture API at http://127.0.0.1:{port} (Ctrl-C stops it)\n"
        proc = noetl("run", str(EXAMPLES / "pagination.yaml"), "--json", "--allow-net", f"127.0.0.1:{port}",
                     "--workload", json.dumps({"api_url": f"http://127.0.0.1:{port}"}))
    finally:
        api.send_signal(signal.SIGINT)
        api.wait(10)
    assert api.returncode == 0
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["steps"]["validate_results"]["result"] == {"endpoints": 2, "items": 25}


def test_the_child_example_runs_on_its_own():
    proc = noetl("run", str(EXAMPLES / "nested_child.yaml"), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["steps"]["report"]["result"] == "mean 4.0, max 5"
    proc = noetl("run", str(EXAMPLES / "nested_child.yaml"), "--json", "--workload", '{"temps": [1, 2, 6]}')
    assert json.loads(proc.stdout)["steps"]["report"]["result"] == "mean 3.0, max 6"


def test_run_on_a_shared_nats_hands_its_partitions_back_when_done(fresh_nats, pg_dsn):
    """On someone else's NATS (NOETL_NATS_URL) the stack's readers stop as replicas do: each gives its
    partition's pin up, so that another replica reading there is not kept waiting (on its own NATS,
    thrown away next, they skip that)."""
    import asyncio
    import json

    import nats

    env = {**ENV, "NOETL_NATS_URL": fresh_nats.url, "NOETL_PG_DSN": pg_dsn}
    proc = noetl("run", str(EXAMPLES / "hello.yaml"), env=env)
    assert proc.returncode == 0, proc.stderr

    async def pinned() -> tuple[list[str], list[str]]:
        nc = await nats.connect(fresh_nats.url)
        try:
            names = json.loads((await nc.request("$JS.API.CONSUMER.NAMES.NOETL_EVENTS", b"")).data)["consumers"]
            out = []
            for name in names:
                info = json.loads((await nc.request(f"$JS.API.CONSUMER.INFO.NOETL_EVENTS.{name}", b"")).data)
                if any(g.get("pinned_client_id") for g in info.get("priority_groups") or ()):
                    out.append(name)
            return out, names
        finally:
            await nc.close()

    still, names = asyncio.run(pinned())
    assert any(n.startswith("router-all-p") for n in names) and still == []
    # its own NATS gets one partition (thrown away with it); a shared one the default count, which the
    # stream keeps for every stack after
    assert {n for n in names if n.startswith("router-all-p")} == {f"router-all-p{p}" for p in range(16)}
