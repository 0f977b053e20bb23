"""``kind: shell`` on a whole stack (D33), through the gateway, as a playbook author (role ``developer``):
commands and pipelines run and hand back their output; the worker's files, the NATS credentials,
``/etc/shadow``, a TCP socket and a program the task wrote are refused; a fork bomb fails alone with its
limit while another execution completes; what a command leaves running is killed when its task ends
(and at its timeout); a non-zero exit is an error a policy routes."""
from __future__ import annotations

import json
import os
import time
from typing import Any, Iterator

import pytest

from noetl_mesh.client import GatewayClient

from conftest import developer, filling_nobodys_processes, start_stack, stop_stack

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def doc(name: str, tasks: list[dict[str, Any]]) -> dict:
    return {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": name, "path": f"tests/shell_{name}"},
            "workflow": [{"step": "start", "tool": tasks}]}


def run_all(handle, docs: list[tuple[dict, dict]]) -> list[tuple[dict, dict[str, dict], str]]:
    """Start every playbook at once as the developer: each one's final status, its outcomes by task and
    all its events as text."""
    async def go():
        async with GatewayClient(handle.url, token=handle.developer) as c:
            ids = [await c.start(d, workload) for d, workload in docs]
            out = []
            for eid in ids:
                final = await c.wait(eid, timeout=120)
                events = await c.all_events(eid)
                outcomes = {e["task"]: e["data"]["outcome"] for e in events if e["name"] == "task.processed"}
                out.append((final, outcomes, json.dumps(events)))
            return out

    return handle.run(go(), 200)


def gone(pid: int) -> bool:
    """No such process: killed and reaped (the fork server adopts what a task leaves behind)."""
    return not os.path.exists(f"/proc/{pid}")


def wait_gone(match, deadline: float = 30.0) -> list[int]:
    """Poll until no live process's command line satisfies ``match``; those still there otherwise."""
    end = time.monotonic() + deadline
    while True:
        left = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        cmd = f.read().split(b"\0")
                except OSError:
                    continue
                if match(cmd) and not gone(int(entry)):
                    left.append(int(entry))
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.1)


@pytest.fixture(scope="module")
def stack(module_pg) -> Iterator[Any]:
    nats, loop, handle = start_stack(module_pg)
    handle.nats = nats
    handle.developer = developer(handle)
    yield handle
    stop_stack(nats, loop, handle)


def shell(name: str, command: Any, **fields: Any) -> dict:
    key = "cmds" if isinstance(command, list) else "command"
    return {"name": name, "kind": "shell", key: command, **fields}


CONTINUE = {"policy": {"rules": [{"else": {"then": {"do": "continue"}}}]}}


def test_commands_and_pipelines_run_with_only_the_environment_they_are_given(stack):
    [(final, outcomes, _)] = run_all(stack, [(doc("echo", [
        shell("pipe", "echo 'b a c' | tr ' ' '\\n' | sort | paste -sd, -"),
        shell("env", ["test \"$GREETING\" = 'hello world'", "env | cut -d= -f1 | sort | paste -sd, -"],
              env={"GREETING": "{{ workload.greeting }}", "COUNT": 3}),
    ]), {"greeting": "hello world"})])
    assert final["status"] == "COMPLETED", final
    pipe = outcomes["pipe"]
    assert pipe["result"] == {"exit_code": 0, "stdout": "a,b,c\n", "stderr": ""}
    assert pipe["shell"]["exit_code"] == 0 and pipe["shell"]["commands_run"] == 1
    env = outcomes["env"]
    assert env["shell"]["commands_run"] == 2
    names = set(env["result"]["stdout"].strip().split(","))
    # what the task gave, PATH, HOME/TMPDIR (its scratch), LANG; and what the shell sets itself
    assert names - {"PWD", "SHLVL", "_", "OLDPWD"} == {"GREETING", "COUNT", "PATH", "HOME", "TMPDIR", "LANG"}, names
    assert not any(n.startswith("NOETL") for n in names)


def test_a_shell_task_reads_nothing_of_the_worker_nor_reaches_the_network_nor_runs_its_own_programs(stack):
    creds = str(stack.nats.auth.directory)
    seeds = [p for p in os.listdir(creds) if p.endswith((".nk", ".creds"))]
    assert seeds
    port = stack.nats_url.rsplit(":", 1)[1]
    attempts = {
        "worker_cmdline": f"cat /proc/{os.getpid()}/cmdline",
        "worker_environ": f"cat /proc/{os.getpid()}/environ",
        "parent_cmdline": "cat /proc/$PPID/cmdline",
        "creds_listing": f"ls {creds}",
        "seed": f"cat {creds}/{seeds[0]}",
        "shadow": "cat /etc/shadow",
        "nats": f"exec 3<>/dev/tcp/127.0.0.1/{port}",
        "python_socket": "python3 -c 'import socket; socket.socket(socket.AF_INET)'",
        "own_program": "cp /bin/echo ./mine && ./mine never",
        "signal_the_worker": f"kill -9 {os.getpid()}",
        "signal_everyone": "kill -9 -1",
    }
    tasks = [shell(name, command, shell="bash", spec=CONTINUE) for name, command in attempts.items()]
    [(final, outcomes, events)] = run_all(stack, [(doc("probe", tasks), {})])
    assert final["status"] == "COMPLETED", final
    for name in attempts:
        out = outcomes[name]
        assert out["status"] == "error" and out["error"]["kind"] == "shell_exit", (name, out)
        assert out["error"]["exit_code"] != 0
        stderr = out["error"]["stderr"]
        assert "Permission denied" in stderr or "Operation not permitted" in stderr, (name, stderr)
        assert out["result"]["stdout"] == "", (name, out["result"])
    assert outcomes["own_program"]["error"]["exit_code"] == 126  # found, not allowed to run
    secret = open(os.path.join(creds, seeds[0])).read().strip()
    assert secret not in events and "root:" not in events
    os.kill(os.getpid(), 0)  # (the worker is this process)


def test_fork_bombs_fail_alone_with_their_limit_and_leave_nothing_behind(stack):
    bomb = doc("bomb", [shell("bomb", "bomb() { bomb | bomb & }; bomb; wait", spec={"timeout": 600})])
    loop = doc("loop", [shell("loop", "while true; do sleep 987655 & done", spec={"timeout": 600})])
    beside = doc("beside", [{"name": "py", "kind": "python", "code": "import time\ntime.sleep(1)\nresult = 42"}])
    fine = doc("fine", [shell("fine", "echo fine")])
    with filling_nobodys_processes():
        (b_final, b_out, _), (l_final, l_out, _), (p_final, p_out, _) = run_all(stack, [(bomb, {}), (loop, {}),
                                                                                       (beside, {})])
    assert p_final["status"] == "COMPLETED" and p_out["py"]["result"] == 42, p_out
    for final, out in ((b_final, b_out["bomb"]), (l_final, l_out["loop"])):
        assert final["status"] == "FAILED"
        err = out["error"]
        assert err["kind"] == "limit_exceeded" and "shell_max_processes" in err["message"], err
        assert "NOETL_LIMIT_SHELL_MAX_PROCESSES" in err["message"] and "could not start a process" in err["message"]
    assert l_out["loop"]["result"]["exit_code"] is None  # stopped at the limit, not at its timeout
    assert wait_gone(lambda cmd: cmd[0] in (b"bash", b"/bin/bash") and b"bomb()" in b" ".join(cmd)) == []
    assert wait_gone(lambda cmd: cmd[:2] == [b"sleep", b"987655"]) == []
    [(f_final, f_out, _)] = run_all(stack, [(fine, {})])
    assert f_final["status"] == "COMPLETED" and f_out["fine"]["result"]["stdout"] == "fine\n"
    [(again, outcomes, _)] = run_all(stack, [(doc("again", [shell("again", "echo again")]), {})])
    assert again["status"] == "COMPLETED" and outcomes["again"]["result"]["stdout"] == "again\n"


def test_what_a_command_leaves_running_is_killed_when_its_task_ends_and_at_its_timeout(stack):
    [(final, outcomes, _), (t_final, t_out, _)] = run_all(stack, [
        (doc("linger", [shell("linger", "sleep 987651 & nohup sleep 987652 >/dev/null 2>&1 & echo $!")]), {}),
        (doc("slow", [shell("slow", "sleep 987653 & sleep 987654", spec={"timeout": 2})]), {}),
    ])
    assert final["status"] == "COMPLETED", (final, outcomes)
    pid = int(outcomes["linger"]["result"]["stdout"])
    assert wait_gone(lambda cmd: cmd[:1] == [b"sleep"] and cmd[1:2] in ([b"987651"], [b"987652"])) == []
    assert gone(pid)
    assert t_final["status"] == "FAILED" and t_out["slow"]["error"]["kind"] == "timeout"
    assert wait_gone(lambda cmd: cmd[:1] == [b"sleep"] and cmd[1:2] in ([b"987653"], [b"987654"])) == []


def test_a_non_zero_exit_is_an_error_a_policy_routes(stack):
    route = {"policy": {"rules": [
        {"when": "{{ outcome.error.kind == 'shell_exit' and outcome.error.exit_code == 3 }}",
         "then": {"do": "jump", "to": "recover"}},
        {"else": {"then": {"do": "fail"}}}]}}
    tasks = [shell("fails", ["echo some output", "echo 'it went wrong' >&2; exit 3", "echo never"], spec=route),
             shell("skipped", "echo skipped"),
             shell("recover", "echo \"recovered from {{ fails.result.exit_code }}\"")]
    [(final, outcomes, _)] = run_all(stack, [(doc("route", tasks), {})])
    assert final["status"] == "COMPLETED", final
    fails = outcomes["fails"]
    assert fails["status"] == "error" and fails["error"]["exit_code"] == 3
    assert fails["error"]["stderr"] == "it went wrong\n" and "exited with code 3" in fails["error"]["message"]
    assert "command 2 of 3" in fails["error"]["message"]
    assert fails["result"]["stdout"] == "some output\n" and fails["shell"]["commands_run"] == 2
    assert "skipped" not in outcomes
    assert outcomes["recover"]["result"]["stdout"] == "recovered from 3\n"


def test_a_credential_reaches_a_command_only_through_the_keychain_and_is_masked(stack):
    token = "tok-Vq93-very-secret"
    playbook = doc("keychain", [shell("use", ['test "$API_TOKEN" = "' + token + '" && echo "token is $API_TOKEN"',
                                              "echo \"home: ${NOETL_HOME:-unset}\""],
                                      env={"API_TOKEN": "{{ keychain.api.token }}"})])
    playbook["keychain"] = [{"name": "api", "kind": "static", "token": token}]
    [(final, outcomes, events)] = run_all(stack, [(playbook, {})])
    assert final["status"] == "COMPLETED", (final, outcomes)
    assert outcomes["use"]["result"]["stdout"] == "token is ***\nhome: unset\n"
    assert token not in json.dumps(outcomes)  # (the playbook itself holds it: a static entry)
