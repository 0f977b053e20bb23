"""Starting services: one by name (``noetl service``), or the whole stack embedded (``noetl up``,
``noetl run``, the integration tests), in this process or one process per service."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from .infra.bus import DEFAULT_PARTITIONS, Bus
from .infra import tracing

CONTROL_PLANE = ("event-recorder", "admission", "router", "loop-coordinator")
ALL_SERVICES = (*CONTROL_PLANE, "worker", "gateway")


@dataclass
class Settings:
    nats_url: str
    pg_dsn: str | None = None
    pool: str = "default"
    concurrency: int = 8
    host: str = "127.0.0.1"
    port: int = 0
    ack_wait: float = 30.0


def make_service(name: str, bus: Bus, settings: Settings):
    if name == "admission":
        from .services.admission.service import AdmissionService

        return AdmissionService(bus)
    if name == "router":
        from .services.router.service import RouterService

        return RouterService(bus)
    if name == "loop-coordinator":
        from .services.loop_coordinator.service import LoopCoordinatorService

        return LoopCoordinatorService(bus)
    if name == "event-recorder":
        from .services.event_recorder.service import RecorderService

        if not settings.pg_dsn:
            raise ValueError("the event-recorder needs a Postgres DSN (--pg-dsn or NOETL_PG_DSN)")
        return RecorderService(bus, pg_dsn=settings.pg_dsn)
    if name == "worker":
        from .services.worker.service import WorkerService

        return WorkerService(bus, pool=settings.pool, concurrency=settings.concurrency, ack_wait=settings.ack_wait)
    if name == "gateway":
        from .services.gateway.app import GatewayService

        return GatewayService(bus, host=settings.host, port=settings.port)
    raise ValueError(f"unknown service {name!r}; known: {', '.join(ALL_SERVICES)}")


@dataclass
class Running:
    name: str
    bus: Bus
    service: Any


async def start_service(name: str, settings: Settings, *, setup: bool = False) -> Running:
    tracing.setup(name)
    bus = await Bus.connect(settings.nats_url, f"noetl-{name}")
    if setup:
        await bus.setup(int(os.environ.get("NOETL_PARTITIONS", DEFAULT_PARTITIONS)))
    service = make_service(name, bus, settings)
    await service.start()
    return Running(name, bus, service)


async def stop_service(running: Running) -> None:
    try:
        await running.service.stop()
    finally:
        await running.bus.close()


@dataclass
class InProcessStack:
    """Every service as its own NATS client in this event loop."""

    settings: Settings
    replicas: int = 1
    workers: int = 1
    running: list[Running] = field(default_factory=list)

    async def start(self) -> "InProcessStack":
        setup = await Bus.connect(self.settings.nats_url, "noetl-setup")
        await setup.setup(int(os.environ.get("NOETL_PARTITIONS", DEFAULT_PARTITIONS)))
        await setup.close()
        names = ["event-recorder"] + [n for n in CONTROL_PLANE[1:] for _ in range(self.replicas)]
        names += ["worker"] * self.workers + ["gateway"]
        self.running = list(await asyncio.gather(*(start_service(n, self.settings) for n in names)))
        return self

    @property
    def gateway_url(self) -> str:
        return next(r.service.url for r in self.running if r.name == "gateway")

    def services(self, name: str) -> list[Any]:
        return [r.service for r in self.running if r.name == name]

    async def stop(self) -> None:
        # workers and gateway first, then the control plane, the recorder last (it drains the log)
        order = {"gateway": 0, "worker": 1, "admission": 2, "router": 2, "loop-coordinator": 2, "event-recorder": 3}
        for rank in range(4):
            await asyncio.gather(*(stop_service(r) for r in self.running if order[r.name] == rank),
                                 return_exceptions=True)
        self.running.clear()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ProcessStack:
    """Every service in its own OS process (``noetl service NAME``), as in a deployment."""

    settings: Settings
    replicas: int = 1
    workers: int = 1
    log_dir: str | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def spawn(self, name: str, key: str | None = None, **extra: Any) -> subprocess.Popen:
        s = self.settings
        args = [sys.executable, "-m", "noetl_mesh.cli", "service", name, "--nats-url", s.nats_url]
        if s.pg_dsn:
            args += ["--pg-dsn", s.pg_dsn]
        if name == "worker":
            args += ["--pool", s.pool, "--concurrency", str(s.concurrency), "--ack-wait", str(s.ack_wait)]
        if name == "gateway":
            args += ["--host", s.host, "--port", str(extra.get("port", s.port))]
        key = key or name
        out = open(os.path.join(self.log_dir, f"{key}.log"), "ab") if self.log_dir else subprocess.DEVNULL
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[key] = proc
        return proc

    async def start(self) -> "ProcessStack":
        setup = await Bus.connect(self.settings.nats_url, "noetl-setup")
        await setup.setup(int(os.environ.get("NOETL_PARTITIONS", DEFAULT_PARTITIONS)))
        await setup.close()
        self.port = self.settings.port or free_port()
        self.spawn("event-recorder")
        for name in CONTROL_PLANE[1:]:
            for i in range(self.replicas):
                self.spawn(name, f"{name}-{i}")
        for i in range(self.workers):
            self.spawn("worker", f"worker-{i}")
        self.spawn("gateway", port=self.port)
        await wait_http(f"{self.gateway_url}/health", timeout=60, procs=self.procs)
        return self

    @property
    def gateway_url(self) -> str:
        return f"http://{self.settings.host}:{self.port}"

    def kill(self, key: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[key]
        proc.send_signal(sig)
        proc.wait(10)

    async def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
        self.procs.clear()


async def wait_http(url: str, timeout: float, procs: dict[str, subprocess.Popen] | None = None) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(trust_env=False) as client:
        while time.monotonic() < deadline:
            for key, proc in (procs or {}).items():
                if proc.poll() is not None:
                    raise RuntimeError(f"service {key} exited with status {proc.returncode} during start")
            try:
                if (await client.get(url, timeout=1)).status_code < 500:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    raise TimeoutError(f"{url} did not answer within {timeout}s")


async def serve_forever(name: str, settings: Settings) -> None:
    """``noetl service NAME``: run one service until SIGTERM/SIGINT."""
    running = await start_service(name, settings, setup=True)  # creates the streams when missing
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if name == "gateway":
        print(f"gateway listening on {running.service.url}", flush=True)
    await stop.wait()
    await stop_service(running)
