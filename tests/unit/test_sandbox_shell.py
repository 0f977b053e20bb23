"""Shell tasks (D33) on this machine's kernel, without NATS or Postgres: the shell filter (processes and
programs yes, leaving the process group or signalling outside it no), the fields a shell task takes, its
bounded output, and a task that writes more than it keeps. Stack-level tests are in
tests/integration/test_sandboxed_tasks_shell.py."""
from __future__ import annotations

import asyncio
import os
import socket
import struct

import pytest

from noetl_mesh import limits
from noetl_mesh.sandbox import seccomp
from noetl_mesh.sandbox.policy import Policy
from noetl_mesh.sandbox.supervisor import Supervisor, execute_paths
from noetl_mesh.tools.base import ToolContext
from noetl_mesh.tools.shell import BadTask, ShellTool, commands_of, environment_of
from noetl_mesh.tools.shell_runner import Output
from test_sandbox import _in_child

pytestmark = pytest.mark.timeout(120)


def test_the_shell_filter_keeps_processes_and_programs_in_the_group_and_signals_inside_it():
    def body() -> bool:
        os.setpgid(0, 0)
        me = os.getpid()
        seccomp.install(seccomp.program(task_pid=me, network=False, shell=True, signals_scoped=False))
        refused = []
        for attempt in (lambda: socket.socket(socket.AF_INET), os.setsid, lambda: os.setpgid(0, 0),
                        lambda: os.kill(-1, 0), lambda: os.kill(os.getppid(), 0), lambda: os.killpg(os.getppid(), 0)):
            try:
                attempt()
                refused.append(False)
            except PermissionError:
                refused.append(True)
        os.kill(me, 0)
        os.kill(0, 0)  # its own group
        os.kill(-me, 0)
        child = os.fork()  # a process, and a program
        if child == 0:
            os.execv("/bin/true", ["true"])
        code = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
        return all(refused) and code == 0

    assert _in_child(body) == 0


def test_with_landlocks_signal_scope_a_shell_may_signal_one_process_never_every_one():
    def body() -> bool:
        me = os.getpid()
        seccomp.install(seccomp.program(task_pid=me, network=False, shell=True, signals_scoped=True))
        os.kill(os.getppid(), 0)  # (here only the filter; Landlock's scope refuses it in a sandbox)
        try:
            os.kill(-1, 0)
        except PermissionError:
            return True
        return False

    assert _in_child(body) == 0


def test_the_shell_filter_is_well_formed_for_both_machines():
    for machine in ("x86_64", "aarch64"):
        for scoped in (False, True):
            code = seccomp.program(task_pid=4321, network=False, machine=machine, shell=True, signals_scoped=scoped)
            assert len(code) % 8 == 0 and 0 < len(code) // 8 < 4096
            assert struct.unpack("<HBBI", code[-8:]) == (0x06, 0, 0, 0x7FFF0000)


def test_programs_come_from_the_system_binary_directories_only():
    paths = execute_paths()
    assert "/usr/bin" in paths
    assert all(p.startswith(("/usr/", "/bin", "/sbin", "/lib")) for p in paths), paths
    assert not any(p.startswith(("/tmp", "/home", "/root", "/var", "/work")) for p in paths)


def test_a_shell_tasks_fields_are_checked_with_where_and_why():
    assert commands_of({"command": "echo a"}) == ["echo a"]
    assert commands_of({"cmds": ["echo a", "echo b"]}) == ["echo a", "echo b"]
    assert commands_of({"command": ["a", 2]}) == ["a", "2"]
    for task, words in (({}, "one of 'command'"), ({"command": "a", "cmds": ["b"]}, "got both"),
                        ({"cmds": []}, "non-empty list"), ({"cmds": [{"a": 1}]}, "'cmds[0]' must be a string"),
                        ({"command": "a\0b"}, "NUL")):
        with pytest.raises(BadTask, match=words.replace("[", r"\[").replace("]", r"\]")):
            commands_of(task)
    assert environment_of({"A": 1, "B_2": True, "C": "x"}) == {"A": "1", "B_2": "true", "C": "x"}
    for env, words in (({"1A": "x"}, "not a variable name"), ({"A=B": "x"}, "not a variable name"),
                       ({"A": {"b": 1}}, "'env.A' must be a string"), ({"A": "x\0"}, "NUL"), ([1], "mapping")):
        with pytest.raises(BadTask, match=words):
            environment_of(env)


def test_output_keeps_the_head_of_stdout_and_the_tail_of_stderr_with_a_marker():
    head, tail = Output(5, "head"), Output(5, "tail")
    for part in (b"abc", b"defg", b"hij"):
        head.add(part)
        tail.add(part)
    assert head.truncated and tail.truncated and head.total == tail.total == 10
    assert head.text().startswith("abcde\n[... 5 more bytes not kept")
    assert tail.text().endswith("]\nfghij") and tail.text().startswith("[... 5 earlier bytes not kept")
    whole = Output(5)
    whole.add(b"ab")
    assert whole.text() == "ab" and not whole.truncated


def ctx(timeout=None) -> ToolContext:
    return ToolContext(execution_id="e1", step="s", task_name="t", timeout=timeout)


def test_a_shell_task_writing_more_than_it_keeps_is_cut_and_one_that_cannot_start_says_why():
    async def main():
        sandbox = Supervisor(Policy())
        tool = ShellTool(sandbox)
        try:
            with limits.override(shell_max_output_bytes=1000):
                big = await tool.run({"command": "head -c 5000000 /dev/zero | tr '\\0' x; echo oops >&2; exit 0"},
                                     {}, ctx(30))
            bad = await tool.run({"command": "echo x", "shell": "/nonexistent/sh"}, {}, ctx(30))
            return big, bad
        finally:
            await sandbox.close()

    big, bad = asyncio.run(main())
    assert big["status"] == "ok" and big["shell"]["stdout_truncated"] and not big["shell"]["stderr_truncated"]
    assert big["result"]["stdout"].startswith("x" * 1000 + "\n[... 4999000 more bytes not kept")
    assert big["result"]["stderr"] == "oops\n"
    assert bad["status"] == "error" and bad["error"]["kind"] == "shell_exit" and bad["error"]["exit_code"] == 127
    assert "/nonexistent/sh: cannot run" in bad["error"]["stderr"]


def test_a_playbook_says_where_a_shell_task_is_wrong():
    from noetl_mesh.lang.validate import validate

    def check(task: dict) -> list[str]:
        doc = {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "x", "path": "x"},
               "workflow": [{"step": "start", "tool": [{"name": "t", "kind": "shell", **task}]}]}
        return [f"{d.location}: {d.message}" for d in validate(doc).diagnostics if d.severity == "error"]

    assert check({"cmds": ["echo {{ workload.x }}"], "env": {"A": "{{ workload.y }}"}, "shell": "sh"}) == []
    assert check({"command": "echo", "cmds": ["x"]}) == [
        "workflow[0].step=start.tool[0]: a shell task takes exactly one of 'command' or 'cmds', got both"]
    assert check({}) == ["workflow[0].step=start.tool[0]: a shell task takes exactly one of 'command' or 'cmds'"]
    assert check({"command": "ls", "cwd": "/"}) == ["workflow[0].step=start.tool[0].cwd: unknown key 'cwd'"]
