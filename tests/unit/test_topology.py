"""What a stack runner starts (`noetl up --replicas`, stack.topology) and how commands find a running
`noetl up` (home.py)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from noetl_mesh.cli import main
from noetl_mesh.home import gateway_url, running_stack
from noetl_mesh.stack import parse_replicas, topology


def stand_in() -> subprocess.Popen:
    """A process standing in for a running `noetl up` (its command line says so once it has started)."""
    import time

    up = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "noetl", "up"])
    while b"noetl" not in open(f"/proc/{up.pid}/cmdline", "rb").read():
        time.sleep(0.01)
    return up


def test_replicas_are_parsed_and_every_mistake_named():
    assert parse_replicas(None) == {} and parse_replicas("") == {}
    assert parse_replicas("admission=2,router=2, worker=3") == {"admission": 2, "router": 2, "worker": 3}
    for text, message in (("worker", "write SERVICE=N"), ("workers=2", "'workers': not a service"),
                          ("worker=0", "from 1 to 64"), ("worker=x", "from 1 to 64"), ("worker=65", "from 1 to 64"),
                          ("gateway=2", "it listens on --port")):
        with pytest.raises(ValueError, match=message):
            parse_replicas(text)


def test_topology_starts_one_recorder_and_gateway_and_the_replicas_asked_for():
    assert topology() == [("event-recorder", "event-recorder"), ("credentials", "credentials"), ("sessions", "sessions"),
                          ("admission", "admission-0"), ("router", "router-0"), ("loop-coordinator", "loop-coordinator-0"),
                          ("scheduler", "scheduler-0"), ("worker", "worker-0"), ("gateway", "gateway")]
    assert parse_replicas("event-recorder=2") == {"event-recorder": 2}
    keys = [key for _, key in topology(counts=parse_replicas("admission=2,router=2,worker=3,sessions=2,event-recorder=2"))]
    assert keys == ["event-recorder-0", "event-recorder-1", "credentials", "sessions-0", "sessions-1", "admission-0", "admission-1", "router-0", "router-1",
                    "loop-coordinator-0", "scheduler-0", "worker-0", "worker-1", "worker-2", "gateway"]
    assert [n for n, _ in topology(replicas=2, workers=0)].count("router") == 2  # the tests' way
    assert "worker" not in [n for n, _ in topology(workers=0)]


def test_up_refuses_bad_replicas_and_a_busy_port_before_starting_anything(tmp_path, capsys):
    import socket

    assert main(["up", "--home", str(tmp_path / "h"), "--replicas", "router=many"]) == 2
    assert capsys.readouterr().err == "noetl: --replicas router=many: a number of replicas from 1 to 64\n"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["up", "--home", str(tmp_path / "h"), "--port", str(port)]) == 2
    assert capsys.readouterr().err == f"noetl: --port {port}: the port is in use (another gateway or program listens there)\n"
    assert not (tmp_path / "h").exists()


def test_commands_find_the_gateway_of_the_noetl_up_running_from_the_home(tmp_path, monkeypatch, capsys):
    for var in ("NOETL_GATEWAY_URL", "NOETL_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    assert running_stack() is None and gateway_url() == "http://127.0.0.1:8082"
    home = tmp_path / ".noetl"
    home.mkdir()
    up = stand_in()
    try:
        (home / "stack.json").write_text(json.dumps({"pid": up.pid, "gateway": "http://127.0.0.1:1",
                                                      "nats": "nats://127.0.0.1:2"}))
        assert running_stack()["nats"] == "nats://127.0.0.1:2" and gateway_url() == "http://127.0.0.1:1"
        assert main(["status", "x1"]) == 4  # it asks that gateway (which is not there)
        assert capsys.readouterr().err.startswith("noetl: cannot reach the gateway at http://127.0.0.1:1 (")
        assert main(["status", "x1", "--home", str(tmp_path / "other")]) == 4  # another home: the default URL
        err = capsys.readouterr().err
        assert "cannot reach the gateway at http://127.0.0.1:8082" in err
        assert f"no noetl up runs from {tmp_path / 'other'}: start one there (noetl up), or point at one with " \
               "--home DIR, NOETL_HOME=DIR or --gateway URL" in err  # where it looked, and how to say elsewhere
        monkeypatch.setenv("NOETL_GATEWAY_URL", "http://127.0.0.1:3")
        assert gateway_url() == "http://127.0.0.1:3"  # the environment first
        monkeypatch.delenv("NOETL_GATEWAY_URL")
        monkeypatch.setenv("NOETL_HOME", str(tmp_path / "other"))
        assert running_stack() is None
        assert running_stack(str(home))["gateway"] == "http://127.0.0.1:1"
    finally:
        up.kill()
        up.wait()
    assert running_stack(str(home)) is None  # its process is gone: a killed stack is no running stack


def test_a_process_stack_gives_the_database_and_the_credential_key_only_to_who_needs_them(tmp_path, monkeypatch):
    """Each service process's environment: the Postgres DSN for the recorder and the credentials service,
    the credential key for the credentials service alone (a compromised worker finds neither), and every
    service its home (--home) on its command line."""
    from noetl_mesh.stack import ProcessStack, Settings

    seen: dict[str, tuple[list[str], dict[str, str]]] = {}

    class Recorded:
        def __init__(self, args, env=None, **kw):
            seen[args[4]] = (args, env)

    monkeypatch.setattr(subprocess, "Popen", Recorded)
    monkeypatch.setenv("NOETL_CREDENTIAL_KEY", "a-key-from-the-shell")
    monkeypatch.setenv("NOETL_CREDENTIAL_KEY_OLD", "an-old-key")
    stack = ProcessStack(Settings(nats_url="nats://x", pg_dsn="host=h password=pg-pw", home=str(tmp_path)))
    for name in ("event-recorder", "credentials", "worker", "gateway", "router"):
        stack.spawn(name)
    for name, (args, env) in seen.items():
        assert args[args.index("--home") + 1] == str(tmp_path)
        assert "pg-pw" not in " ".join(args)
        assert ("NOETL_PG_DSN" in env) == (name in ("event-recorder", "credentials")), name
        assert ("NOETL_CREDENTIAL_KEY" in env) == ("NOETL_CREDENTIAL_KEY_OLD" in env) == (name == "credentials"), name


def test_a_slow_stop_says_where_it_waits():
    """What a stop that takes too long logs: the chain of awaits down to the one that waits."""
    import asyncio

    from noetl_mesh.stack import awaiting

    async def drain():
        await asyncio.sleep(30)

    async def stop():
        await drain()

    async def main():
        task = asyncio.create_task(stop())
        await asyncio.sleep(0)
        try:
            return awaiting(task)
        finally:
            task.cancel()

    where = asyncio.run(main()).splitlines()
    assert [line.rsplit(" in ", 1)[1] for line in where[:3]] == ["stop", "drain", "sleep"]
