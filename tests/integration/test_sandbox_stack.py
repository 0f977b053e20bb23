"""Sandboxed tasks (D33) on a whole `noetl up --replicas worker=2` stack, as a playbook author with the
`developer` role would attack it: the worker's command line and environment, the stack's credentials
folder and admin token, a NATS connection with any seed found; DuckDB reading files; a fork bomb, a
4 GB allocation and a spinning loop. Every attempt fails inside the task, nothing leaks into what the
stack stores, and an ordinary execution started beside them completes."""
from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest

from noetl_mesh.client import GatewayClient

from conftest import filling_nobodys_processes, noetl_up

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
ENV = {k: v for k, v in os.environ.items() if not k.startswith("NOETL_")}
PASSWORD = "a long password"

PROBE = r'''
import os, socket
def attempt(fn):
    try:
        value = fn()
        return {"ok": True, "value": str(value)[:200]}
    except BaseException as e:
        return {"ok": False, "type": type(e).__name__, "errno": getattr(e, "errno", None), "message": str(e)[:300]}
def read(path):
    with open(path, "rb") as f:
        return f.read()
def nats():
    host, port = nats_url.split("//", 1)[1].split(":")
    s = socket.create_connection((host, int(port)), timeout=3)
    return s.recv(100)
result = {
    "worker_cmdline": attempt(lambda: read(f"/proc/{worker_pid}/cmdline")),
    "worker_environ": attempt(lambda: read(f"/proc/{worker_pid}/environ")),
    "parent_cmdline": attempt(lambda: read(f"/proc/{os.getppid()}/cmdline")),
    "init_environ": attempt(lambda: read("/proc/1/environ")),
    "creds_listing": attempt(lambda: os.listdir(home + "/nats-creds")),
    "admin_seed": attempt(lambda: read(home + "/nats-creds/admin.nk")),
    "worker_seed": attempt(lambda: read(home + "/nats-creds/worker-default.nk")),
    "admin_token": attempt(lambda: read(home + "/admin.token")),
    "credential_key": attempt(lambda: read(home + "/credential.key")),
    "nats": attempt(nats),
    "environment": sorted(os.environ),
}
'''


def playbook(name: str, tool: str) -> str:
    return (f"apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {{name: {name}, path: tests/sandbox_{name}}}\n"
            f"workflow:\n  - step: start\n    tool:\n{tool}")


def python_task(code: str, args: str = "{}", spec: str = "{}") -> str:
    return f"      - {{name: t, kind: python, args: {args}, spec: {spec}, code: {json.dumps(code)}}}\n"


@pytest.fixture(scope="module")
def up() -> Iterator[dict[str, Any]]:
    root = tempfile.mkdtemp(prefix="noetl-sandbox-up-")  # Postgres's own user must reach its data directory
    os.chmod(root, 0o755)
    home = Path(root) / "home"
    env = {**ENV, "XDG_CONFIG_HOME": os.path.join(root, "config")}
    proc, text = noetl_up(["--home", str(home), "--replicas", "worker=2"], env, timeout=180, cwd=root,
                          start_new_session=True)
    try:
        info = json.loads((home / "stack.json").read_text())
        yield {"url": re.search(r"gateway: (http://\S+)", text).group(1), "home": home, "info": info,
               "token": (home / "admin.token").read_text().strip(), "root": root}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(90)
        except Exception:  # noqa: BLE001
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        logs = "".join(p.read_text(errors="replace") for p in home.glob("worker*.log")) if home.exists() else ""
        shutil.rmtree(root, ignore_errors=True)
        assert "sandbox UNAVAILABLE" not in logs


def developer(up: dict[str, Any]) -> str:
    async def make() -> str:
        async with GatewayClient(up["url"], token=up["token"]) as admin:
            try:
                await admin.add_user("sandbox-dev", ["developer"], password=PASSWORD)
            except Exception:  # noqa: BLE001 - made by an earlier test of the module
                pass
        async with GatewayClient(up["url"], token="") as c:
            c.use(None)
            await c.login("sandbox-dev", PASSWORD)
            return (await c.create_token("sandbox attack"))["token"]
    return asyncio.run(make())


def run_all(up: dict[str, Any], token: str, docs: list[tuple[str, dict]]) -> list[tuple[dict, list[dict]]]:
    """Start every playbook at once as the developer; each one's final status and events."""
    async def go():
        async with GatewayClient(up["url"], token=token) as c:
            ids = [await c.start(doc, workload) for doc, workload in docs]
            out = []
            for eid in ids:
                await c.wait(eid, timeout=180)
                out.append((await c.status(eid), await c.all_events(eid)))
            return out
    return asyncio.run(go())


def outcome_of(events: list[dict]) -> dict:
    done = [e for e in events if e["name"] == "task.processed"]
    assert done, [e["name"] for e in events]
    return done[-1]["data"]["outcome"]


def test_a_developers_python_task_reads_nothing_of_the_worker_or_the_stack(up):
    token = developer(up)
    home = str(up["home"])
    worker_pid = up["info"]["pids"]["worker-0"]
    secrets = [(up["home"] / "nats-creds" / "admin.nk").read_text().strip(), up["token"]]
    doc = playbook("probe", python_task(PROBE, args=json.dumps({"home": home, "worker_pid": worker_pid,
                                                                 "nats_url": up["info"]["nats"]})))
    uncaught = playbook("uncaught", python_task(f"result = open({json.dumps(home + '/admin.token')}).read()"))
    duck = playbook("duck", "".join(
        f"      - {{name: d{i}, kind: duckdb, command: {json.dumps(sql)}, spec: {{policy: {{rules: [{{else: {{then: {{do: continue}}}}}}]}}}}}}\n"
        for i, sql in enumerate([
            "select * from read_csv('/etc/passwd')",
            f"select * from read_text('{home}/nats-creds/admin.nk')",
            f"select * from read_text('{home}/admin.token')",
        ])))
    (probe_status, probe_events), (unc_status, unc_events), (duck_status, duck_events) = run_all(
        up, token, [(doc, {}), (uncaught, {}), (duck, {})])

    assert probe_status["status"] == "COMPLETED", probe_status
    result = outcome_of(probe_events)["result"]
    for name, got in result.items():
        if name == "environment":
            assert not any(v.startswith("NOETL") for v in got) and "HOME" in got, got
            continue
        assert got["ok"] is False, (name, got)
        if name == "credential_key" and not (up["home"] / "credential.key").exists():
            assert got["errno"] == 2  # (a stack keeps it elsewhere when NOETL_CREDENTIAL_KEY is set)
            continue
        assert got["errno"] in (1, 13), (name, got)  # EPERM, EACCES: refused, not merely missing
    # the task got a clear error when it did not catch it
    assert unc_status["status"] == "FAILED"
    err = outcome_of(unc_events)["error"]
    assert err["kind"] == "sandbox" and "D33" in err["message"] and "admin.token" in err["message"]
    # duckdb: each read refused, the step went on (the policy continues)
    duck_outcomes = [e["data"]["outcome"] for e in duck_events if e["name"] == "task.processed"]
    assert len(duck_outcomes) == 3
    assert all(o["status"] == "error" and o["error"]["kind"] == "sandbox" for o in duck_outcomes), duck_outcomes
    # nothing secret anywhere the stack keeps
    stored = json.dumps([probe_events, unc_events, duck_events])
    for secret in secrets:
        assert secret not in stored
    assert "root:x:0:0" not in stored


def test_a_developers_shell_task_reads_nothing_of_the_worker_or_the_stack(up):
    token = developer(up)
    home = str(up["home"])
    worker_pid = up["info"]["pids"]["worker-0"]
    host, port = up["info"]["nats"].split("//", 1)[1].split(":")
    attempts = {
        "worker_cmdline": f"cat /proc/{worker_pid}/cmdline",
        "worker_environ": f"cat /proc/{worker_pid}/environ",
        "creds_listing": f"ls {home}/nats-creds",
        "admin_seed": f"cat {home}/nats-creds/admin.nk",
        "admin_token": f"cat {home}/admin.token",
        "nats": f"exec 3<>/dev/tcp/{host}/{port}",
        "shadow": "cat /etc/shadow",
        "signal_the_worker": f"kill -9 {worker_pid}",
    }
    tasks = "".join(f"      - {{name: {name}, kind: shell, shell: bash, command: {json.dumps(cmd)}, spec: "
                    f"{{policy: {{rules: [{{else: {{then: {{do: continue}}}}}}]}}}}}}\n" for name, cmd in attempts.items())
    tasks += "      - {name: who, kind: shell, command: 'id -u; env | cut -d= -f1 | sort | paste -sd, -'}\n"
    [(status, events)] = run_all(up, token, [(playbook("shell_probe", tasks), {})])
    assert status["status"] == "COMPLETED", status
    outcomes = {e["task"]: e["data"]["outcome"] for e in events if e["name"] == "task.processed"}
    for name in attempts:
        err = outcomes[name]["error"]
        assert err["kind"] == "shell_exit" and err["exit_code"] != 0, (name, err)
        assert "Permission denied" in err["stderr"] or "Operation not permitted" in err["stderr"], (name, err)
    uid, names = outcomes["who"]["result"]["stdout"].split()
    assert uid == "65534" if os.geteuid() == 0 else uid == str(os.geteuid())  # nobody, when the worker is root
    assert not any(n.startswith("NOETL") for n in names.split(","))
    stored = json.dumps(events)
    for secret in [(up["home"] / "nats-creds" / "admin.nk").read_text().strip(), up["token"]]:
        assert secret not in stored
    os.kill(worker_pid, 0)


def test_a_fork_bomb_a_huge_allocation_and_a_spin_fail_alone_with_their_limits(up):
    token = developer(up)
    docs = [
        (playbook("bomb", python_task("import os\nwhile True:\n    os.fork()")), {}),
        (playbook("alloc", python_task("x = bytearray(4 * 1024 ** 3)\nresult = len(x)")), {}),
        (playbook("spin", python_task("while True:\n    pass", spec="{timeout: 3}")), {}),
        (playbook("fine", python_task("result = sum(range(10))")), {}),
    ]
    (bomb, bomb_ev), (alloc, alloc_ev), (spin, spin_ev), (fine, fine_ev) = run_all(up, token, docs)
    assert [s["status"] for s in (bomb, alloc, spin)] == ["FAILED"] * 3
    assert outcome_of(bomb_ev)["error"]["kind"] == "sandbox"
    assert "one process" in outcome_of(bomb_ev)["error"]["message"]
    alloc_err = outcome_of(alloc_ev)["error"]
    assert alloc_err["kind"] == "limit_exceeded" and "task_max_memory_bytes" in alloc_err["message"]
    assert outcome_of(spin_ev)["error"]["kind"] == "timeout"
    assert fine["status"] == "COMPLETED" and outcome_of(fine_ev)["result"] == 45
    # both workers are still the processes they were
    info = json.loads((up["home"] / "stack.json").read_text())
    for key in ("worker-0", "worker-1"):
        os.kill(info["pids"][key], 0)


def _sleeps(seconds: str) -> int:
    """The processes running ``sleep <seconds>``, from /proc."""
    count = 0
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if f.read().split(b"\0")[:2] == [b"sleep", seconds.encode()]:
                    count += 1
        except OSError:
            continue
    return count


def test_a_shell_task_that_fills_its_process_allowance_leaves_other_tasks_theirs(up):
    """Every shell task of a root host runs as `nobody` and the kernel counts `nobody`'s processes
    together. A task's allowance (`shell_max_processes` beyond what `nobody` runs) is counted when the
    task starts: one task that filled its own (here: as many `sleep`s as it may start, then waiting)
    does not take another execution's, started after it. Before, the allowance was counted when the task
    process was forked ahead, before the hog's processes existed, and the second task could not fork."""
    token = developer(up)
    mark = f"120.{os.getpid()}"  # this run's hog's sleeps
    hog = playbook("hog", f"      - {{name: t, kind: shell, command: 'for i in $(seq 300); do sleep {mark} & done"
                          f" 2>/dev/null; sleep {mark}'}}\n")
    other = playbook("other", "      - {name: t, kind: shell, command: 'for i in 1 2 3 4 5 6 7 8; do sleep 0.2 & done;"
                              " wait; echo forked'}\n")

    async def go() -> tuple[dict, list[dict]]:
        async with GatewayClient(up["url"], token=token) as c:
            hog_id = await c.start(hog)
            try:
                for _ in range(600):  # the hog has started what it may (shell_max_processes: 128)
                    if _sleeps(mark) >= 100:
                        break
                    await asyncio.sleep(0.1)
                else:
                    raise AssertionError(f"the hog started {_sleeps(mark)} sleeps")
                eid = await c.start(other)
                await c.wait(eid, timeout=120)
                return await c.status(eid), await c.all_events(eid)
            finally:
                await c.cancel(hog_id)
                await c.wait(hog_id, timeout=120)

    with filling_nobodys_processes():
        status, events = asyncio.run(go())
    assert status["status"] == "COMPLETED", outcome_of(events)
    assert outcome_of(events)["result"]["stdout"].strip() == "forked"
