"""Graceful shutdown of `noetl service NAME` processes on SIGTERM: a worker stopped mid-task hands its
command back (nak: another worker runs it at once, not after ack_wait), a router leaves its
membership group at once; both exit 0, and the execution they were working on completes."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import nats
import pytest

from conftest import start_stack, stop_stack
from noetl_mesh.client import GatewayError
from noetl_mesh.infra import micro
from noetl_mesh.infra.membership import PREFIX, STREAM
from noetl_mesh.infra.nats_auth import connect_options
from noetl_mesh.stack import start_service

pytestmark = pytest.mark.integration
ACK_WAIT = 30  # what a command not handed back would wait before its redelivery
TASK = 4  # seconds the step runs
PLAYBOOK = {
    "apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "sigterm", "path": "tests/sigterm"},
    "workflow": [
        {"step": "start", "tool": {"kind": "python", "code": f"import time\ntime.sleep({TASK})\nresult = 7"},
         "next": {"arcs": [{"step": "after"}]}},
        {"step": "after", "tool": {"kind": "noop", "result": "{{ start.result + 1 }}"}},
    ],
}


def service(handle, name: str, log_path) -> subprocess.Popen:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("NOETL_")}, "NOETL_SHUTDOWN_GRACE": "0.5"}
    with open(log_path, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "noetl_mesh.cli", "service", name, "--nats-url", handle.nats_url,
                                 "--nats-creds", handle.stack.settings.nats_creds, "--ack-wait", str(ACK_WAIT)]
                                if name == "worker" else
                                [sys.executable, "-m", "noetl_mesh.cli", "service", name, "--nats-url", handle.nats_url,
                                 "--nats-creds", handle.stack.settings.nats_creds],
                                stdout=out, stderr=subprocess.STDOUT, env=env)


async def admin(handle):
    return await nats.connect(handle.nats_url, **connect_options(handle.admin))


def test_sigterm_hands_back_the_work_leaves_the_group_and_exits_0(module_pg, tmp_path):
    server, loop, handle = start_stack(module_pg, workers=0)  # the only worker: a process of its own
    worker = router = None
    try:
        worker = service(handle, "worker", tmp_path / "worker.log")
        router = service(handle, "router", tmp_path / "router.log")

        async def joined() -> tuple[int, int]:
            nc = await admin(handle)
            try:
                pings = await micro.ask_all(nc, "PING", timeout=1.0)
                members = await nc.jetstream().stream_info(STREAM, subjects_filter=f"{PREFIX}router.>")
                return (sum(p["name"] == "noetl-worker-default" for p in pings),
                        len(members.state.subjects or {}))
            finally:
                await nc.close()

        deadline = time.monotonic() + 60
        while handle.run(joined()) != (1, 2):  # the worker answers; two routers are in the group
            assert time.monotonic() < deadline and worker.poll() is None and router.poll() is None, \
                (tmp_path / "worker.log").read_text()[-2000:]
            time.sleep(0.3)

        async def start_and_wait_for_the_task() -> str:
            async with handle.client() as client:
                eid = await client.start(PLAYBOOK)
                deadline = time.monotonic() + 30
                while True:
                    try:
                        if any(e["name"] == "task.started" for e in await client.all_events(eid)):
                            return eid
                    except GatewayError as exc:  # not recorded yet
                        assert exc.status == 404, exc
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.1)

        eid = handle.run(start_and_wait_for_the_task())
        time.sleep(0.5)  # well into the task
        stopped = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        router.send_signal(signal.SIGTERM)
        assert worker.wait(20) == 0, (tmp_path / "worker.log").read_text()[-3000:]
        assert router.wait(20) == 0, (tmp_path / "router.log").read_text()[-3000:]
        assert time.monotonic() - stopped < 10
        log = (tmp_path / "worker.log").read_text()
        assert "handing back 1 running commands for redelivery" in log and "worker: stopped in" in log
        assert handle.run(joined()) == (0, 1)  # the router left the group at once, not after the TTL
        assert "Traceback" not in log and "Traceback" not in (tmp_path / "router.log").read_text()

        handle.stack.running.append(handle.run(start_service("worker", handle.stack.settings)))  # another worker

        async def finish() -> dict:
            async with handle.client() as client:
                return await client.wait(eid, timeout=ACK_WAIT)

        status = handle.run(finish(), timeout=ACK_WAIT + 10)
        assert status["status"] == "COMPLETED", status
        assert status["steps"]["after"]["result"] == 8
        assert time.monotonic() - stopped < ACK_WAIT - 5  # handed back, not waited out
    finally:
        for proc in (worker, router):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        stop_stack(server, loop, handle)


def test_a_service_whose_default_metrics_port_is_taken_runs_without_one(module_pg, tmp_path):
    """The default metrics port is found taken by binding it (two services starting on one host at once
    both saw it free when it was looked at first): the service warns and runs on, and stops cleanly."""
    import socket

    from noetl_mesh.cli import DEFAULT_METRICS_PORT

    nats_server, loop, handle = start_stack(module_pg, workers=0)
    holder = socket.socket()
    try:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        deadline = time.monotonic() + 120
        while True:  # a service another test (another worker) started may hold it for a while
            try:
                holder.bind(("127.0.0.1", DEFAULT_METRICS_PORT))
                break
            except OSError:
                assert time.monotonic() < deadline, f"port {DEFAULT_METRICS_PORT} stayed taken for 120 s"
                time.sleep(0.5)
        holder.listen()
        log_path = tmp_path / "router.log"
        proc = service(handle, "router", log_path)
        deadline = time.monotonic() + 60
        while b"no metrics port" not in log_path.read_bytes():
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        time.sleep(1)
        assert proc.poll() is None, log_path.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log_path.read_text()
    finally:
        holder.close()
        stop_stack(nats_server, loop, handle)
