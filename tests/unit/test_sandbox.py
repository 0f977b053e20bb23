"""Sandboxed tasks (D33) on this machine's kernel: what a python or duckdb task can no longer reach,
the limits that stop it, and that the worker carries on. Real processes, Landlock and seccomp; no
NATS or Postgres (the stack-level tests are in tests/integration/test_sandbox_stack.py)."""
from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import socket
import struct
import threading

import pytest

from noetl_mesh import limits
from noetl_mesh.sandbox import landlock, seccomp
from noetl_mesh.sandbox.policy import Policy
from noetl_mesh.sandbox.supervisor import Supervisor, read_paths
from noetl_mesh.tools.base import ToolContext
from noetl_mesh.tools.duckdb import DuckdbTool
from noetl_mesh.tools.python import PythonTool

pytestmark = pytest.mark.timeout(120)


def ctx(timeout=None) -> ToolContext:
    return ToolContext(execution_id="e1", step="s", task_name="t", timeout=timeout)


def run_tasks(calls, *, policy: Policy | None = None, secret_paths=(), kind: str = "python"):
    """Run ``(task, spec)`` calls in order with one sandbox; their outcomes."""
    sandbox = Supervisor(policy or Policy(), secret_paths=secret_paths)
    tool = PythonTool(sandbox) if kind == "python" else DuckdbTool(sandbox)

    async def main():
        try:
            return [await tool.run(task, spec, ctx(spec.get("timeout"))) for task, spec in calls]
        finally:
            await sandbox.close()

    return asyncio.run(main())


@pytest.fixture
def secrets(tmp_path, monkeypatch):
    """A stand-in for a stack's home: a credentials folder with a seed and a token, and a marker in the
    worker's environment."""
    home = tmp_path / "home"
    (home / "nats-creds").mkdir(parents=True)
    (home / "nats-creds" / "admin.nk").write_text("SUAAAASECRETSEED\n")
    (home / "admin.token").write_text("noetl_token_secret\n")
    monkeypatch.setenv("NOETL_TEST_SECRET_MARKER", "marker-value-42")
    return home


def test_a_python_task_reads_nothing_of_the_worker(secrets):
    calls = [
        {"code": "import os\nresult = open(f'/proc/{os.getppid()}/cmdline').read()"},
        {"code": "result = open('/proc/1/environ').read()"},
        {"code": f"import os\nresult = os.listdir({str(secrets / 'nats-creds')!r})"},
        {"code": f"result = open({str(secrets / 'nats-creds' / 'admin.nk')!r}).read()"},
        {"code": f"result = open({str(secrets / 'admin.token')!r}).read()"},
        {"code": "result = open('/etc/passwd').read()"},
        {"code": "import socket\nsocket.create_connection(('127.0.0.1', 4222), timeout=2)"},
        {"code": "import os\nos.kill(os.getppid(), 9)"},
    ]
    outs = run_tasks([(c, {}) for c in calls], secret_paths=[str(secrets)])
    for call, out in zip(calls, outs):
        assert out["status"] == "error", (call, out)
        assert out["error"]["kind"] == "sandbox", (call, out["error"])
        assert "D33" in out["error"]["message"]
        assert out["result"] is None
        text = repr(out)
        assert "SECRETSEED" not in text and "noetl_token_secret" not in text and "marker-value" not in text
    env = run_tasks([({"code": "import os\nresult = dict(os.environ)"}, {})])[0]
    assert env["status"] == "ok"
    assert set(env["result"]) == {"HOME", "TMPDIR", "PATH", "LANG", "PYTHONIOENCODING"}  # a clean environment
    assert "NOETL_TEST_SECRET_MARKER" in os.environ


def test_a_trusted_pool_runs_user_code_unconfined(secrets):
    """The same reads succeed with the sandbox off: the sandbox, not an accident, stopped them above."""
    out, = run_tasks([({"code": f"result = open({str(secrets / 'admin.token')!r}).read()"}, {})],
                     policy=Policy(enabled=False))
    assert out["status"] == "ok" and out["result"] == "noetl_token_secret\n"


def test_a_duckdb_task_reads_no_file_outside_its_scratch(secrets, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "ok.csv").write_text("a,b\n1,2\n")
    calls = [
        {"command": "select * from read_csv('/etc/passwd')"},
        {"command": f"select * from read_text({str(secrets / 'nats-creds' / 'admin.nk')!r})"},
        {"command": "select * from read_text('/proc/self/environ')"},
        {"command": f"attach {str(secrets / 'x.duckdb')!r}"},
        {"command": "set enable_external_access = true"},
        {"command": "select 1", "db_path": str(secrets / "y.duckdb")},
    ]
    outs = run_tasks([(c, {}) for c in calls], policy=Policy(data_dirs=(str(data),)), secret_paths=[str(secrets)],
                     kind="duckdb")
    for call, out in zip(calls, outs):
        assert out["status"] == "error", (call, out)
        assert out["error"]["kind"] in ("sandbox", "duckdb_error"), (call, out["error"])
        assert "SECRETSEED" not in repr(out)
    assert [o["error"]["kind"] for o in outs[:2]] == ["sandbox", "sandbox"]
    assert not (secrets / "x.duckdb").exists() and not (secrets / "y.duckdb").exists()
    # what it may use: its scratch directory, the pool's data directories
    good = run_tasks([({"command": f"select * from read_csv({str(data / 'ok.csv')!r})"}, {}),
                      ({"command": "copy (select 42 as x) to 'mine.csv'; select * from read_csv('mine.csv')"}, {}),
                      ({"command": "create table t as select 1 as a", "db_path": str(data / "keep.duckdb")}, {})],
                     policy=Policy(data_dirs=(str(data),)), kind="duckdb")
    assert [o["status"] for o in good] == ["ok", "ok", "ok"], good
    assert good[0]["result"]["rows"] == [{"a": 1, "b": 2}]
    assert good[1]["result"]["rows"] == [{"x": 42}]
    assert (data / "keep.duckdb").exists()


def test_limits_stop_a_fork_bomb_a_huge_allocation_and_a_spinning_loop():
    with limits.override(task_max_cpu_seconds=1, task_max_memory_bytes=512 * 1024 * 1024):
        fork, alloc, spin, proc, after = run_tasks([
            ({"code": "import os\nwhile True:\n    os.fork()"}, {}),
            ({"code": "x = bytearray(4 * 1024 ** 3)"}, {}),
            ({"code": "while True:\n    pass"}, {"timeout": 60}),
            ({"code": "import subprocess\nsubprocess.run(['sh', '-c', 'echo hi'])"}, {}),
            ({"code": "result = 'still here'"}, {}),
        ])
    assert fork["error"]["kind"] == "sandbox" and "one process" in fork["error"]["message"]
    assert alloc["error"]["kind"] == "limit_exceeded" and "task_max_memory_bytes" in alloc["error"]["message"]
    assert spin["error"]["kind"] == "limit_exceeded" and "task_max_cpu_seconds" in spin["error"]["message"]
    assert proc["error"]["kind"] == "sandbox"
    assert after["status"] == "ok" and after["result"] == "still here"


def test_a_task_cannot_write_outside_its_scratch_which_is_gone_afterwards(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    first, second, third = run_tasks([
        ({"code": "import os\nopen('kept.txt', 'w').write('x')\nresult = os.getcwd()"}, {}),
        ({"code": f"open({str(outside / 'x.txt')!r}, 'w').write('x')"}, {}),
        ({"code": "import os\nresult = [os.getcwd(), sorted(os.listdir('.'))]"}, {}),
    ])
    assert first["status"] == "ok"
    assert not os.path.exists(first["result"])  # removed with the task
    assert second["error"]["kind"] == "sandbox" and not (outside / "x.txt").exists()
    assert third["result"][0] != first["result"] and "kept.txt" not in third["result"][1]


def test_a_sandbox_that_cannot_hold_refuses_user_code_and_says_why():
    """A secret inside what tasks may read (here: site-packages) makes the sandbox refuse, not run."""
    site_dir = next(p for p in read_paths(Policy()) if p.endswith("site-packages"))
    out, = run_tasks([({"code": "result = 1"}, {})], secret_paths=[os.path.join(site_dir, "secret.nk")])
    assert out["status"] == "error" and out["error"]["kind"] == "sandbox"
    assert "cannot sandbox" in out["error"]["message"] and "secret.nk" in out["error"]["message"]
    sup = Supervisor(Policy(), secret_paths=[os.path.join(site_dir, "secret.nk")])
    asyncio.run(sup.start())
    assert sup.describe().startswith("sandbox UNAVAILABLE") and "NOETL_SANDBOX=off" in sup.describe()


def test_the_view_never_holds_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    view = read_paths(Policy())
    assert str(tmp_path) not in view and "" not in view
    assert not any(p == "/" for p in view)


# ------------------------------------------------------------------------------ the kernel layers


def _in_child(fn) -> int:
    """Run ``fn`` in a forked child; its exit status (0 when fn returned True)."""
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(0 if fn() else 1)
        except BaseException:  # noqa: BLE001
            os._exit(2)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_the_system_call_filter_refuses_what_it_lists_and_keeps_threads():
    def body() -> bool:
        seccomp.install(seccomp.program(task_pid=os.getpid(), network=False))
        results = []
        for attempt in (lambda: socket.socket(socket.AF_INET), lambda: socket.socket(socket.AF_UNIX),
                        lambda: os.fork(), lambda: os.kill(os.getppid(), 0), lambda: os.chmod("/tmp", 0o777)):
            try:
                attempt()
                results.append(False)
            except PermissionError:
                results.append(True)
        a, b = socket.socketpair()  # pipes and socket pairs stay
        t = threading.Thread(target=lambda: None)
        t.start()
        t.join()
        os.kill(os.getpid(), 0)  # itself
        return all(results)

    assert _in_child(body) == 0


def test_the_filter_opens_inet_sockets_only_when_the_network_is_open():
    def body() -> bool:
        seccomp.install(seccomp.program(task_pid=os.getpid(), network=True))
        socket.socket(socket.AF_INET).close()
        socket.socket(socket.AF_INET6).close()
        try:
            socket.socket(socket.AF_UNIX)
            return False
        except PermissionError:
            return True

    assert _in_child(body) == 0


def test_the_filter_program_is_well_formed_for_both_machines():
    for machine in ("x86_64", "aarch64"):
        for pid in (None, 1234):
            code = seccomp.program(task_pid=pid, network=False, machine=machine)
            assert len(code) % 8 == 0 and 0 < len(code) // 8 < 4096
            last = struct.unpack("<HBBI", code[-8:])
            assert last == (0x06, 0, 0, 0x7FFF0000)  # ends by allowing what it did not refuse
    with pytest.raises(seccomp.SeccompError):
        seccomp.program(task_pid=None, network=False, machine="riscv64")


def test_landlock_hides_everything_but_the_listed_paths(tmp_path):
    if landlock.abi() < 1:
        pytest.fail("this kernel has no Landlock: the sandbox cannot work here")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "f").write_text("ok")
    (tmp_path / "hidden").write_text("secret")

    def body() -> bool:
        ctypes.CDLL(None).prctl(38, 1, 0, 0, 0)
        landlock.restrict([(str(allowed), landlock.READ)], network=False)
        if open(allowed / "f").read() != "ok":
            return False
        for path in (tmp_path / "hidden", "/etc/hostname"):
            try:
                open(path).read()
                return False
            except PermissionError:
                pass
        try:
            open(allowed / "new", "w")
            return False
        except PermissionError:
            return True

    assert _in_child(body) == 0


def test_a_fork_server_that_dies_is_replaced_and_its_running_task_fails_alone():
    sandbox = Supervisor(Policy())
    tool = PythonTool(sandbox)

    async def main():
        try:
            assert (await tool.run({"code": "result = 1"}, {}, ctx()))["status"] == "ok"
            first = sandbox.server_pid()
            for _ in range(500):  # the first task's process has exited (a loaded machine takes a while)
                if not sandbox.running():
                    break
                await asyncio.sleep(0.02)
            slow = asyncio.ensure_future(tool.run({"code": "import time\ntime.sleep(60)"}, {}, ctx(120)))
            for _ in range(500):  # the slow task's process runs
                if sandbox.running():
                    break
                await asyncio.sleep(0.02)
            os.kill(first, 9)
            lost = await asyncio.wait_for(slow, 60)
            after = await tool.run({"code": "result = 2"}, {}, ctx())
            return first, lost, after, sandbox.server_pid()
        finally:
            await sandbox.close()

    first, lost, after, second = asyncio.run(main())
    assert lost["status"] == "error" and lost["error"]["kind"] == "python_crash"
    assert after["status"] == "ok" and after["result"] == 2
    assert second != first


def test_a_fork_server_that_died_before_a_task_was_sent_fails_that_task_clearly_and_is_replaced():
    """Killed between two tasks: the next task's request cannot reach it. That task fails as a crash
    saying so (it never started), not with a BrokenPipeError; the one after runs on a new server."""
    sandbox = Supervisor(Policy())
    tool = PythonTool(sandbox)

    async def main():
        try:
            assert (await tool.run({"code": "result = 1"}, {}, ctx()))["status"] == "ok"
            first = sandbox.server_pid()
            server = sandbox._servers["python"]
            loop = asyncio.get_running_loop()
            loop.remove_reader(server.ctl.fileno())  # it has not noticed yet that its server died
            os.kill(first, 9)
            await asyncio.to_thread(server.proc.wait, 10)
            lost = await tool.run({"code": "result = 2"}, {}, ctx())
            after = await tool.run({"code": "result = 3"}, {}, ctx())
            return first, lost, after, sandbox.server_pid()
        finally:
            await sandbox.close()

    first, lost, after, second = asyncio.run(main())
    assert lost["status"] == "error" and lost["error"]["kind"] == "python_crash", lost
    assert "before the task started" in lost["error"]["message"]
    assert after["status"] == "ok" and after["result"] == 3 and second != first


def test_python_and_duckdb_tasks_share_one_sandbox_without_meeting():
    """Each kind has its fork server; their task processes' scratch directories never collide."""
    sandbox = Supervisor(Policy())
    python, duck = PythonTool(sandbox), DuckdbTool(sandbox)

    async def main():
        try:
            outs = []
            for i in range(6):
                outs.append(await python.run({"code": "import os\nresult = os.getcwd()"}, {}, ctx()))
                outs.append(await duck.run({"command": "select current_setting('temp_directory') as t"}, {}, ctx()))
            return outs
        finally:
            await sandbox.close()

    outs = asyncio.run(main())
    assert [o["status"] for o in outs] == ["ok"] * 12, [o["error"] for o in outs if o["error"]]
    dirs = [o["result"] if isinstance(o["result"], str) else o["result"]["rows"][0]["t"] for o in outs]
    assert len({os.path.dirname(d.rstrip("/").removesuffix("/.duckdb_tmp")) for d in dirs}) == 2  # one root per kind
    assert len(set(dirs)) == 12


def test_memory_no_limit_would_count_is_refused_too():
    """Shared anonymous memory and in-memory files escape the data limit: the address-space limit and
    the filter stop them; and a task process cannot outlive its fork server."""
    with limits.override(task_max_memory_bytes=512 * 1024 * 1024):
        shared, memfd, orphan, ok = run_tasks([
            ({"code": "import mmap\nm = mmap.mmap(-1, 4 * 1024 ** 3)\nresult = len(m)"}, {}),
            ({"code": "import os\nfd = os.memfd_create('x')\nresult = fd"}, {}),
            ({"code": "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                      "result = [libc.prctl(1, 0, 0, 0, 0), ctypes.get_errno()]"}, {}),
            ({"code": "result = len(bytearray(64 * 1024 * 1024))"}, {}),
        ])
    assert shared["status"] == "error" and shared["error"]["kind"] == "limit_exceeded", shared
    assert "task_max_memory_bytes" in shared["error"]["message"]
    assert memfd["error"]["kind"] == "sandbox", memfd
    assert orphan["result"] == [-1, 1], orphan  # EPERM
    assert ok["result"] == 64 * 1024 * 1024


def test_a_task_runs_at_a_lower_priority_than_its_worker_and_cannot_raise_it():
    own = os.getpriority(os.PRIO_PROCESS, 0)
    nice, = run_tasks([({"code": "import os\nbefore = os.getpriority(os.PRIO_PROCESS, 0)\n"
                                 "try:\n    os.setpriority(os.PRIO_PROCESS, 0, 0)\n    raised = True\n"
                                 "except OSError:\n    raised = False\nresult = [before, raised]"}, {})])
    assert nice["result"] == [min(19, own + 10), False], nice


def test_a_task_cannot_make_the_fork_server_read_for_it(monkeypatch):
    """The end of a crashed task's standard error is read from the server's own descriptor: a link put in
    its place leads nowhere (not to another process's environment), a FIFO or /dev/zero blocks nothing."""
    monkeypatch.setenv("NOETL_TEST_SECRET_MARKER", "marker-value-42")
    me = os.getpid()
    outs = run_tasks([
        ({"code": f"import os\nos.unlink('.stderr')\nos.symlink('/proc/{me}/environ', '.stderr')\nos._exit(3)"}, {}),
        ({"code": "import os\nos.unlink('.stderr')\nos.mkfifo('.stderr')\nos._exit(3)"}, {}),
        ({"code": "import os\nos.unlink('.stderr')\nos.symlink('/dev/zero', '.stderr')\nos._exit(3)"}, {}),
        ({"code": "import sys\nsys.stderr.write('mine\\n')\nsys.stderr.flush()\nimport os\nos._exit(4)"}, {}),
        ({"code": "result = 'still served'"}, {"timeout": 30}),
    ])
    assert all(o["error"]["kind"] == "python_crash" for o in outs[:4]), outs
    assert "marker-value" not in repr(outs)
    assert outs[3]["error"]["message"].endswith("its last output: mine")
    assert outs[4]["status"] == "ok" and outs[4]["result"] == "still served"


def test_a_task_that_answers_early_and_lingers_is_killed_and_holds_its_slot_until_it_exits():
    sandbox = Supervisor(Policy())
    tool = PythonTool(sandbox)
    code = ("import os, stat, time\n"
            "for fd in range(3, 64):\n"
            "    try:\n"
            "        if stat.S_ISSOCK(os.fstat(fd).st_mode):\n"
            "            os.write(fd, b'{\"ok\": true, \"result\": \"early\", \"pid\": %d}\\n' % os.getpid())\n"
            "    except OSError:\n"
            "        pass\n"
            "time.sleep(60)\n")

    async def main():
        try:
            out = await tool.run({"code": code}, {}, ctx(120))
            pid = out["result"] and out["py"]["pid"]
            for _ in range(600):  # killed, and its exit heard (its slot freed): a guard, not a race
                if not _alive(pid) and not sandbox.running():
                    break
                await asyncio.sleep(0.05)
            return out, pid, _alive(pid), sandbox.running()  # (before close, which ends everything anyway)
        finally:
            await sandbox.close()

    out, pid, alive, running = asyncio.run(main())
    assert out["result"] == "early" and pid
    assert not alive and running == []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_no_signal_by_io_ownership_no_affinity_of_others_no_inotify_no_net_table():
    probe = ("import os, fcntl, ctypes, errno\n"
             "out = {}\n"
             "r, w = os.pipe()\n"
             "for name, cmd in (('setown', fcntl.F_SETOWN), ('setsig', 10)):\n"
             "    try:\n"
             "        fcntl.fcntl(r, cmd, os.getppid())\n"
             "        out[name] = 'allowed'\n"
             "    except OSError as e:\n"
             "        out[name] = e.errno\n"
             "try:\n"
             "    os.sched_setaffinity(os.getppid(), {0})\n"
             "    out['affinity'] = 'allowed'\n"
             "except OSError as e:\n"
             "    out['affinity'] = e.errno\n"
             "libc = ctypes.CDLL(None, use_errno=True)\n"
             "out['inotify'] = libc.inotify_init1(0), ctypes.get_errno()\n"
             "try:\n"
             "    open('/proc/self/net/tcp').read()\n"
             "    out['net'] = 'read'\n"
             "except OSError as e:\n"
             "    out['net'] = e.errno\n"
             "out['own_cgroup'] = bool(open('/proc/self/cgroup').read())\n"
             "result = out\n")
    out, = run_tasks([({"code": probe}, {})])
    res = out["result"]
    assert res["setown"] == res["setsig"] == errno.EPERM, res
    assert res["affinity"] == errno.EPERM, res
    assert res["inotify"] == [-1, errno.EPERM], res
    assert res["net"] == errno.EACCES and res["own_cgroup"] is True, res


def test_no_timeout_is_still_the_task_time_limit():
    with limits.override(task_max_seconds=1):
        out, = run_tasks([({"code": "import time\ntime.sleep(30)"}, {"timeout": 0})])
    assert out["error"]["kind"] == "timeout" and "task_max_seconds" in out["error"]["message"], out


def test_a_fork_server_whose_start_is_cancelled_is_killed_before_the_sandbox_closes():
    """A worker that stops while a fork server is still starting (the stack stopped early): the server
    is killed with the start, not left to find its scratch directory gone and say so on the worker's
    standard error until the worker exits."""
    import subprocess

    sandbox = Supervisor(Policy())

    def servers() -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(os.getpid()), "-f", "sandbox.forkserver"], capture_output=True,
                             text=True).stdout
        return [int(pid) for pid in out.split()]

    async def main():
        start = asyncio.ensure_future(sandbox.start("duckdb"))
        for _ in range(500):  # until its process runs
            if servers():
                break
            await asyncio.sleep(0.01)
        started = servers()
        start.cancel()
        await asyncio.gather(start, return_exceptions=True)
        await sandbox.close()
        return started

    started = asyncio.run(main())
    assert started  # it was caught starting
    assert not [pid for pid in started if os.path.exists(f"/proc/{pid}") and
                open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]


def test_a_tasks_process_limit_stays_within_the_hard_limit_it_inherited():
    """``set_nproc`` never asks for more than the process's hard ``RLIMIT_NPROC`` (a process that is not
    root cannot raise it: the task would fail before running); below it, the limit is what was asked."""
    import resource

    from noetl_mesh.sandbox import confine

    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            resource.setrlimit(resource.RLIMIT_NPROC, (1000, 1000))
            confine.set_nproc(5000)
            high = resource.getrlimit(resource.RLIMIT_NPROC)
            confine.set_nproc(700)
            low = resource.getrlimit(resource.RLIMIT_NPROC)
            code = 0 if (high, low) == ((1000, 1000), (700, 700)) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_more_tasks_than_task_processes_outside_a_worker_wait_their_turn_and_all_run():
    """Tasks of no lane (``noetl run``, a local loop's iterations) beyond ``max_task_processes`` wait for a
    process and run; a process is held by one lane at most all but ``lane_reserve`` at a time."""
    from noetl_mesh import limits
    from noetl_mesh.sandbox import supervisor

    async def main():
        sandbox = Supervisor(Policy())
        tool = PythonTool(sandbox)

        async def one(i: int, lane: int | None) -> tuple[int, float]:
            supervisor.LANE.set(lane)
            out = await tool.run({"code": f"import time\nresult = [{i}, time.time()]\ntime.sleep(0.3)"}, {}, ctx(30))
            return out["result"]

        try:
            alone = await asyncio.gather(*(one(i, None) for i in range(3)))
            # one lane's three tasks and another's one: the other lane's starts with the first two
            laned = await asyncio.gather(*(one(i, 4) for i in range(3)), one(9, 7))
            return alone, laned
        finally:
            await sandbox.close()

    with limits.override(max_task_processes=2, lane_reserve=1):
        alone, laned = asyncio.run(main())
    assert [r[0] for r in alone] == [0, 1, 2]
    started = {i: t for i, t in laned}
    assert started[9] < max(started[0], started[1], started[2])  # not after all three of lane 4
