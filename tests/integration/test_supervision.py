"""Supervision: services wait for their dependencies instead of exiting, and a supervised process
stack (``noetl up``) starts again a service that exits."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from noetl_mesh.client import GatewayClient
from noetl_mesh.infra.bus import Bus
from noetl_mesh.infra.embedded import EmbeddedNats
from noetl_mesh.infra.nats_auth import NatsAuth
from noetl_mesh.stack import ProcessStack, Settings, free_port, setup

pytestmark = pytest.mark.integration

CHAIN = {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "c", "path": "tests/c"},
         "workflow": [{"step": "a", "tool": {"kind": "noop", "result": 1}, "next": {"arcs": [{"step": "b"}]}},
                      {"step": "b", "tool": {"kind": "noop", "result": "{{ a.result + 1 }}"}}]}


def test_a_service_started_before_nats_waits_for_it_quietly(tmp_path):
    """... and then for the streams, which it may not create: ``noetl setup`` (the admin) does."""
    port = free_port()
    auth = NatsAuth(tmp_path / "creds").ensure()
    log_path = tmp_path / "admission.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "noetl_mesh.cli", "service", "admission",
                                 "--nats-url", f"nats://127.0.0.1:{port}", "--nats-creds", auth.for_service("admission")],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    nats = None
    try:
        time.sleep(4)
        assert proc.poll() is None, log_path.read_text()
        nats = EmbeddedNats(port=port, auth=auth).start()
        deadline = time.monotonic() + 15  # its next attempt (the delay doubles, up to 5 s) connects
        while "connected to NATS" not in log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        deadline = time.monotonic() + 30  # connected, it says it waits for the events stream
        while "stream NOETL_EVENTS does not exist yet" not in log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, log_path.read_text()
        asyncio.run(setup(Settings(nats_url=nats.url, nats_creds=str(auth.directory))))

        async def consumers() -> set[str]:
            bus = await Bus.connect(nats.url, "probe", auth.admin)
            try:
                for _ in range(200):
                    try:
                        names = {c.name async for c in _consumers(bus)}
                        if "admission-all-p0" in names:
                            return names
                    except Exception:  # noqa: BLE001 - the stream may not exist yet
                        pass
                    await asyncio.sleep(0.1)
                return set()
            finally:
                await bus.close()

        assert "admission-all-p0" in asyncio.run(consumers()), log_path.read_text()
        assert proc.poll() is None
        assert nats.violations() == []
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)
        if nats is not None:
            nats.stop()
    text = log_path.read_text()
    assert "Traceback" not in text, text  # waiting is logged in lines, not as tracebacks
    assert "retrying" in text
    assert "stream NOETL_EVENTS does not exist yet" in text


async def _consumers(bus):
    for info in await bus.js.consumers_info("NOETL_EVENTS"):
        yield info


def test_supervised_stack_starts_a_killed_service_again(pg_dsn, tmp_path, monkeypatch):
    monkeypatch.setenv("NOETL_CONTROL_ACK_WAIT", "2")
    auth = NatsAuth(tmp_path / "creds").ensure()
    nats = EmbeddedNats(auth=auth).start()

    squatter = socket.socket()

    async def go():
        stack = ProcessStack(Settings(nats_url=nats.url, pg_dsn=pg_dsn, ack_wait=2.0, nats_creds=str(auth.directory)),
                             log_dir=str(tmp_path), supervise=True)
        await stack.start()
        try:
            for key in ("router-0", "worker-0"):
                old, port = stack.procs[key].pid, stack.metrics_ports[key]
                os.kill(old, signal.SIGKILL)
                stack.procs[key].wait(10)
                if key == "router-0":  # someone else takes the port picked for its metrics while it is down
                    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    squatter.bind(("127.0.0.1", port))
                    squatter.listen()
                for _ in range(100):
                    await asyncio.sleep(0.1)
                    if stack.procs[key].pid != old and stack.procs[key].poll() is None:
                        break
                assert stack.procs[key].pid != old and stack.restarts[key] == 1
            # back on a port of its own, not exiting at every restart on the taken one
            assert stack.metrics_ports["router-0"] != squatter.getsockname()[1]
            async with httpx.AsyncClient(trust_env=False, timeout=2) as probe:
                deadline = time.monotonic() + 30
                while True:
                    try:
                        if (await probe.get(f"{stack.metrics_urls['router-0']}/livez")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    assert time.monotonic() < deadline, (tmp_path / "router-0.log").read_text()
                    await asyncio.sleep(0.2)
            assert stack.restarts["router-0"] == 1 and stack.procs["router-0"].poll() is None
            async with GatewayClient(stack.gateway_url, token=stack.token) as client:
                eid = await client.start(CHAIN)
                return await client.wait(eid, timeout=60)
        finally:
            await stack.stop()

    try:
        final = asyncio.run(go())
    finally:
        squatter.close()
        nats.stop()
    assert final["status"] == "COMPLETED" and final["steps"]["b"]["result"] == 2
