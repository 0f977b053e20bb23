"""Starting services: one by name (``noetl service``), or the whole stack embedded (``noetl up``,
``noetl run``, the integration tests), in this process or one process per service."""
from __future__ import annotations

import asyncio
import importlib
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from .infra.bus import DEFAULT_PARTITIONS, Bus, BusError
from .infra import logs, metrics, tracing
from .infra.launching import EXIT_PORT_TAKEN
from .infra.probes import PortTaken, ProbeServer, port_free, readiness

log = logging.getLogger("noetl.stack")

CONTROL_PLANE = ("event-recorder", "admission", "router", "loop-coordinator", "scheduler")
ALL_SERVICES = (*CONTROL_PLANE, "credentials", "sessions", "worker", "gateway")
SINGLE = ("event-recorder", "credentials", "sessions")  # one replica unless asked for more
GATEWAY_ONLY = ("gateway", "sessions", "scheduler")  # reached only through the gateway (logins, users, schedules)


NEEDS_POSTGRES = ("event-recorder", "credentials")  # the services given the Postgres connection string
CREDENTIAL_KEY_ENV = ("NOETL_CREDENTIAL_KEY", "NOETL_CREDENTIAL_KEY_OLD")  # given to the credentials service only
SCALABLE = ("event-recorder", "credentials", "admission", "router", "loop-coordinator", "scheduler", "sessions",
            "worker")  # any number of replicas
MAX_REPLICAS = 64  # per service in one stack runner


def parse_replicas(text: str | None) -> dict[str, int]:
    """``noetl up --replicas admission=2,router=2,worker=3``: replicas per service. ValueError naming
    the mistake (an unknown or unscalable service, a count that is not 1..MAX_REPLICAS)."""
    counts: dict[str, int] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep:
            raise ValueError(f"--replicas {part.strip()!r}: write SERVICE=N, e.g. worker=3")
        if name == "gateway":
            raise ValueError(f"--replicas {name}: one per stack (it listens on --port)")
        if name not in SCALABLE:
            raise ValueError(f"--replicas {name!r}: not a service; scalable: {', '.join(SCALABLE)}")
        try:
            n = int(value)
        except ValueError:
            n = 0
        if not 1 <= n <= MAX_REPLICAS:
            raise ValueError(f"--replicas {name}={value.strip()}: a number of replicas from 1 to {MAX_REPLICAS}")
        counts[name] = n
    return counts


def topology(replicas: int = 1, workers: int = 1, counts: dict[str, int] | None = None) -> list[tuple[str, str]]:
    """The services of a stack runner, in start order, each with its key (``admission-0``, a log file's
    name): one recorder, one credentials service, one sessions service, ``replicas`` of each
    control-plane service and the scheduler, ``workers`` workers, one gateway; ``counts``
    (:func:`parse_replicas`) overrides."""
    counts = counts or {}
    out = []
    for name in ("event-recorder", "credentials", "sessions", *CONTROL_PLANE[1:], "worker"):
        default = 1 if name in SINGLE else workers if name == "worker" else replicas
        n = counts.get(name, default)
        single = n == 1 and name in SINGLE
        out += [(name, name if single else f"{name}-{i}") for i in range(n)]
    return out + [("gateway", "gateway")]


@dataclass
class Settings:
    nats_url: str
    pg_dsn: str | None = None
    pool: str = "default"
    concurrency: int = 8
    host: str = "127.0.0.1"
    port: int = 0
    ack_wait: float = 30.0
    replicas: int | None = None  # of streams, buckets, object stores when created (NOETL_REPLICAS, else 1)
    partitions: int | None = None  # of the events stream when created (NOETL_PARTITIONS, else DEFAULT_PARTITIONS)
    # NATS credentials (infra/nats_auth.py): a directory holds one file per user (each service takes its
    # own, the stack's setup the admin's); a file is used by every service; None connects without
    nats_creds: str | None = None
    # the metrics port (/metrics, /livez, /readyz, infra/probes.py): None serves none, 0 any free port
    metrics_port: int | None = None
    metrics_optional: bool = False  # metrics_port is only the default: when it is taken, serve none
    metrics_host: str | None = None  # NOETL_METRICS_HOST, else 127.0.0.1
    log_format: str | None = None  # text or json (process stacks pass it to each service)
    # what the workers' tasks may reach beyond the default (D33): NOETL_SANDBOX_ALLOW_NET for the workers
    # (``--allow-net``); None: the environment's
    allow_net: str | None = None
    # the sandboxed task kinds whose fork servers a worker starts ahead, besides python's (D33): comma
    # separated, NOETL_SANDBOX_WARM for the workers; None: the environment's (default: every kind)
    sandbox_warm: str | None = None
    # the stack's home (noetl up --home, noetl service --home): where a service keeps its files (the
    # credentials service its key file, unless NOETL_CREDENTIAL_KEY is set); None: none
    home: str | None = None

    def creds_for(self, service: str) -> str | None:
        """The credentials file of ``service`` (``admin`` for the stack's setup)."""
        if not self.nats_creds or not os.path.isdir(self.nats_creds):
            return self.nats_creds
        from .infra.nats_auth import NatsAuth

        return NatsAuth(self.nats_creds).for_service(service, self.pool)


_CLASSES = {"admission": "admission.service.AdmissionService", "router": "router.service.RouterService",
            "loop-coordinator": "loop_coordinator.service.LoopCoordinatorService",
            "event-recorder": "event_recorder.service.RecorderService", "worker": "worker.service.WorkerService",
            "credentials": "credentials.service.CredentialsService",
            "gateway": "gateway.app.GatewayService", "sessions": "sessions.service.SessionsService",
            "scheduler": "scheduler.service.SchedulerService"}


def service_class(name: str) -> type:
    """A service's class, imported when asked for (a process imports only the services it runs)."""
    if name not in _CLASSES:
        raise ValueError(f"unknown service {name!r}; known: {', '.join(ALL_SERVICES)}")
    module, _, cls = _CLASSES[name].rpartition(".")
    return getattr(importlib.import_module(f"{__package__}.services.{module}"), cls)


def make_service(name: str, bus: Bus, settings: Settings):
    cls = service_class(name)
    if name == "event-recorder":
        if not settings.pg_dsn:
            raise ValueError("the event-recorder needs a Postgres DSN (--pg-dsn or NOETL_PG_DSN)")
        return cls(bus, pg_dsn=settings.pg_dsn)
    if name == "credentials":
        if not settings.pg_dsn:
            raise ValueError("the credentials service needs a Postgres DSN (--pg-dsn or NOETL_PG_DSN)")
        return cls(bus, pg_dsn=settings.pg_dsn, home=settings.home)
    if name == "worker":
        return cls(bus, pool=settings.pool, concurrency=settings.concurrency, ack_wait=settings.ack_wait,
                   allow_net=settings.allow_net, warm=settings.sandbox_warm)
    if name == "gateway":
        return cls(bus, host=settings.host, port=settings.port)
    return cls(bus)


@dataclass
class Running:
    name: str
    bus: Bus
    service: Any
    micro: Any = None  # its NATS micro service registration (infra/micro.py)


async def start_service(name: str, settings: Settings) -> Running:
    """Connect as the service's NATS user, start it and register it as a NATS micro service (what
    ``nats micro ls`` and ``noetl ps`` list: infra/micro.py); the streams it needs are made by
    :func:`setup` (the service waits for them). Its log records, spans and metrics carry its name."""
    from .infra import micro

    logs.set_service(name)
    tracing.setup(name)
    bus = await Bus.connect(settings.nats_url, f"noetl-{name}", settings.creds_for(name))
    try:
        service = make_service(name, bus, settings)
        try:
            await service.start()
            registered = await micro.register(name, bus, service)
        except BaseException:
            await asyncio.shield(_quietly(service.stop()))  # whatever it had started
            raise
    except BaseException:
        await _quietly(bus.close())
        raise
    metrics.started(name)
    return Running(name, bus, service, registered)


async def start_service_retrying(name: str, settings: Settings, *, max_delay: float = 10.0) -> Running:
    """:func:`start_service` until it succeeds: a dependency that is not there yet (NATS restarting,
    JetStream not ready, a stream not created yet) is waited for with a growing delay, each failure
    logged in one line; a mistake in the settings (ValueError) is not retried."""
    delay = 0.5
    while True:
        try:
            return await start_service(name, settings)
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - anything else may pass: retry
            log.warning("%s could not start (%s: %s); retrying in %.1fs", name, type(exc).__name__, exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_delay)


async def setup(settings: Settings) -> None:
    """Create the streams, the membership bucket and the payload store (or adopt existing ones), as the
    ``admin`` NATS user: services may not create them (``noetl setup``, the stack runners)."""
    bus = await Bus.connect(settings.nats_url, "noetl-setup", settings.creds_for("admin"))
    try:
        await bus.setup(settings.partitions or int(os.environ.get("NOETL_PARTITIONS", DEFAULT_PARTITIONS)),
                        replicas=settings.replicas)
    finally:
        await bus.close()


async def _quietly(awaitable) -> None:
    try:
        await awaitable
    except Exception:  # noqa: BLE001 - best effort cleanup
        pass


async def stop_service(running: Running, throwaway: bool = False) -> None:
    """Leave the micro services first (the gateway's readiness and ``noetl ps`` stop counting this
    replica), then stop the service, then close its connection. ``throwaway``: the NATS server goes
    next, so nothing is handed back to another replica (Bus.throwaway)."""
    running.bus.throwaway = throwaway
    t0 = time.monotonic()
    watch = asyncio.get_running_loop().call_later(SLOW_STOP, _slow_stop, running.name, asyncio.current_task())
    try:
        if running.micro is not None:  # nats.micro drains each subscription (a flush each): bounded here
            await _quietly(asyncio.wait_for(running.micro.stop(), 2))
        await running.service.stop()
    finally:
        await running.bus.close()
        watch.cancel()
        metrics.stopped(running.name)
        if time.monotonic() - t0 > SLOW_STOP:
            log.warning("%s stopped after %.1f s", running.name, time.monotonic() - t0)


SLOW_STOP = 15.0  # a service's stop waits out at most a few bounded graces; longer than this is said


def _slow_stop(name: str, task: asyncio.Task | None) -> None:
    """A service still stopping after SLOW_STOP seconds: say where it waits."""
    log.warning("%s is still stopping after %g s; it waits in:\n%s", name, SLOW_STOP, awaiting(task))


def awaiting(task: asyncio.Task | None) -> str:
    """Where a suspended task waits: its chain of awaits, outermost first (``Task.get_stack`` gives
    only the outermost frame of a suspended coroutine)."""
    lines, obj = [], getattr(task, "get_coro", lambda: None)()
    while obj is not None and len(lines) < 40:
        frame = getattr(obj, "cr_frame", None) or getattr(obj, "gi_frame", None) or getattr(obj, "ag_frame", None)
        if frame is not None:
            lines.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        nxt = getattr(obj, "cr_await", None) or getattr(obj, "gi_yieldfrom", None) or getattr(obj, "ag_await", None)
        if nxt is None and frame is None:
            lines.append(f"  {obj!r}"[:300])  # a future: what it is
        obj = nxt
    return "\n".join(lines)


@dataclass
class InProcessStack:
    """Every service as its own NATS client in this event loop."""

    settings: Settings
    replicas: int = 1
    workers: int = 1
    token_file: str | None = None  # where the first admin's API token is kept (see bootstrap)
    counts: dict[str, int] | None = None  # replicas per service, over replicas/workers (parse_replicas)
    # False: no gateway, nor what only its users reach (sessions, the scheduler), nor a first admin
    # (noetl run: its command line is the stack's only client, over NATS: client.StackClient)
    gateway: bool = True
    running: list[Running] = field(default_factory=list)
    token: str | None = None
    probes: ProbeServer | None = None  # the process's metrics port, when settings.metrics_port is set

    async def start(self) -> "InProcessStack":
        await setup(self.settings)
        names = [name for name, _ in topology(self.replicas, self.workers, self.counts)
                 if self.gateway or name not in GATEWAY_ONLY]
        if self.settings.metrics_port is not None:  # one server for the process: services by label
            self.probes = ProbeServer(asyncio.get_running_loop(), self.settings.metrics_host,
                                      self.settings.metrics_port).start()
            for key in _keys(names):
                self.probes.expect(key)
        self.running = list(await asyncio.gather(*(start_service(n, self.settings) for n in names)))
        if self.probes is not None:
            for key, r in zip(_keys(names), self.running):
                self.probes.add(key, readiness(r.service, r.bus))
        if self.gateway:
            self.token = await bootstrap(self.settings, self.token_file)
        return self

    @property
    def metrics_url(self) -> str | None:
        return self.probes.url if self.probes is not None else None

    @property
    def gateway_url(self) -> str:
        return next(r.service.url for r in self.running if r.name == "gateway")

    def services(self, name: str) -> list[Any]:
        return [r.service for r in self.running if r.name == name]

    async def stop(self, ordered: bool = True, throwaway: bool = False) -> None:
        """``ordered``: workers and gateway first, then the control plane, the recorder last (it drains
        the log); else every service at once. ``throwaway``: the NATS server goes next (``noetl run``'s
        own), so nothing is handed back to another replica (Bus.throwaway)."""
        order = {"gateway": 0, "worker": 1, "sessions": 2, "admission": 2, "router": 2, "loop-coordinator": 2,
                 "scheduler": 2, "credentials": 2, "event-recorder": 3}
        for rank in range(4) if ordered else (None,):
            await asyncio.gather(*(stop_service(r, throwaway=throwaway) for r in self.running
                                   if rank is None or order[r.name] == rank),
                                 return_exceptions=True)
        self.running.clear()
        tracing.flush()
        if self.probes is not None:
            self.probes.stop()
            self.probes = None


def _keys(names: list[str]) -> list[str]:
    """Each service's name, numbered when it runs more than once (``router-1``)."""
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, -1) + 1
        out.append(n if names.count(n) == 1 else f"{n}-{seen[n]}")
    return out


async def bootstrap(settings: Settings, token_file: str | None = None, username: str = "admin",
                    timeout: float = 60.0) -> str | None:
    """The first admin of a new stack: the sessions service creates it (only while no user exists) and
    answers with an API token for it, kept in ``token_file`` (mode 0600) when given. A stack that has
    users already answers with the token kept there, or None (log in)."""
    from .services.sessions.service import Q_BOOTSTRAP

    bus = await Bus.connect(settings.nats_url, "noetl-setup", settings.creds_for("admin"))  # only admin may
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                reply = await bus.request(Q_BOOTSTRAP, {"username": username}, timeout=10)
                break
            except BusError as exc:  # the sessions service is still starting
                if exc.kind not in ("unavailable", "timeout") or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
    finally:
        await bus.close()
    if reply.get("created"):
        if token_file:
            fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(reply["token"] + "\n")
        return reply["token"]
    if token_file and os.path.exists(token_file):
        with open(token_file) as f:
            return f.read().strip() or None
    return None


def shown_dsn(dsn: str | None) -> str | None:
    """A connection string fit to print: its password replaced by ``***``."""
    if not dsn:
        return dsn
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    try:
        parts = conninfo_to_dict(dsn)
    except Exception:  # noqa: BLE001 - not a DSN psycopg reads: show nothing of it
        return "(a connection string)"
    if parts.get("password"):
        parts["password"] = "***"
    return make_conninfo(**parts)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a service of a stack (the gateway, a metrics endpoint), chosen
    below the kernel's ephemeral range as the embedded servers' are (``embedded.free_port``): one the
    kernel gives out is also the next outgoing connection's, and a busy machine took it first."""
    from .infra.embedded import free_port as below_ephemeral

    return below_ephemeral()


@dataclass
class ProcessStack:
    """Every service in its own OS process (``noetl service NAME``), as in a deployment. With
    ``supervise`` (``noetl up``), a service that exits is started again, with a growing delay when it
    keeps exiting."""

    settings: Settings
    replicas: int = 1
    workers: int = 1
    log_dir: str | None = None
    supervise: bool = False
    token_file: str | None = None  # where the first admin's API token is kept (see bootstrap)
    counts: dict[str, int] | None = None  # replicas per service, over replicas/workers (parse_replicas)
    token: str | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)
    metrics_ports: dict[str, int] = field(default_factory=dict)  # each service's metrics port, by key
    _specs: dict[str, tuple[str, dict]] = field(default_factory=dict)
    _supervisor: asyncio.Task | None = None

    def spawn(self, name: str, key: str | None = None, **extra: Any) -> subprocess.Popen:
        s = self.settings
        args = [sys.executable, "-m", "noetl_mesh.cli", "service", name, "--nats-url", s.nats_url]
        if s.nats_creds:
            args += ["--nats-creds", s.creds_for(name)]  # each service its own user
        env = dict(os.environ)
        env.pop("NOETL_PG_DSN", None)
        if s.pg_dsn and name in NEEDS_POSTGRES:  # in its environment: a command line is every user's to read
            env["NOETL_PG_DSN"] = s.pg_dsn
        if name != "credentials":  # the credential key is the credentials service's alone (a worker never has it)
            for var in CREDENTIAL_KEY_ENV:
                env.pop(var, None)
        if s.home:
            args += ["--home", s.home]
        if name == "worker":
            args += ["--pool", s.pool, "--concurrency", str(s.concurrency), "--ack-wait", str(s.ack_wait)]
        if name == "gateway":
            args += ["--host", s.host, "--port", str(extra.get("port", s.port))]
        key = key or name
        if key not in self.metrics_ports:  # its own port (kept across restarts): BASE + n, or a free one
            base = s.metrics_port
            self.metrics_ports[key] = base + len(self.metrics_ports) if base else free_port()
        elif not s.metrics_port and not port_free(s.metrics_host or "127.0.0.1", self.metrics_ports[key]):
            # a free port picked for it was taken by someone else meanwhile (between the pick and its
            # bind, or while it was down): the service would exit on it at every restart; a new free one
            self.metrics_ports[key] = free_port()
        args += ["--metrics-port", str(self.metrics_ports[key])]
        if s.metrics_host:
            args += ["--metrics-host", s.metrics_host]
        if s.log_format:
            args += ["--log-format", s.log_format]
        out = open(os.path.join(self.log_dir, f"{key}.log"), "ab") if self.log_dir else subprocess.DEVNULL
        if name == "worker" and s.allow_net is not None:  # D33: its sandbox policy reads it at start
            env["NOETL_SANDBOX_ALLOW_NET"] = s.allow_net
        if name == "worker" and s.sandbox_warm is not None:
            env["NOETL_SANDBOX_WARM"] = s.sandbox_warm
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        if out is not subprocess.DEVNULL:
            out.close()  # the child has its own descriptor
        self.procs[key] = proc
        self._specs[key] = (name, extra)
        return proc

    async def _watch(self, poll: float = 0.5, max_delay: float = 30.0, stable: float = 60.0) -> None:
        """Start again every service that exited. The delay doubles (up to ``max_delay``) while a service
        keeps exiting within ``stable`` seconds of its start, and is back to ``poll`` once it stays up."""
        delay: dict[str, float] = {}
        due: dict[str, float] = {}
        started: dict[str, float] = {key: time.monotonic() for key in self.procs}
        while True:
            await asyncio.sleep(poll)
            now = time.monotonic()
            for key, proc in list(self.procs.items()):
                if proc.poll() is None:
                    if now - started.get(key, now) > stable:
                        delay.pop(key, None)
                    continue
                if key not in due:
                    wait = delay.get(key, 0.0)
                    delay[key] = min(max(2 * wait, 1.0), max_delay)
                    due[key] = now + wait
                    log.warning("service %s exited with status %s; starting it again in %.1fs",
                                key, proc.returncode, wait)
                if now >= due[key]:
                    del due[key]
                    name, extra = self._specs[key]
                    self.spawn(name, key, **extra)
                    started[key] = time.monotonic()
                    self.restarts[key] = self.restarts.get(key, 0) + 1

    async def start(self) -> "ProcessStack":
        await setup(self.settings)
        self.port = self.settings.port or free_port()
        for name, key in topology(self.replicas, self.workers, self.counts):
            if name == "gateway":
                self.spawn(name, key, port=self.port)
            else:
                self.spawn(name, key)
        await self._started("/health")
        if self.supervise:
            self._supervisor = asyncio.create_task(self._watch(), name="supervisor")
        self.token = await bootstrap(self.settings, self.token_file)
        try:  # every service answering (the gateway's /ready), so that the first request does not get a 503
            await self._started("/ready")
        except TimeoutError:
            log.warning("not every service answered within 60 s of the start: %s/ready says which; "
                        "requests that need them are answered 503 until they do", self.gateway_url)
        return self

    async def _started(self, path: str, timeout: float = 60, tries: int = 5) -> None:
        """Until the gateway answers ``path``. A service that exits as it starts fails the start, unless
        it could not listen on a port chosen here (bound by another process between the choice and the
        service's bind: a busy machine): its metrics port (status 6), or the gateway's own port (uvicorn's
        startup failure, 3). That one starts again on another port, a few times."""
        if self.supervise:  # its supervisor starts whatever exits again
            return await wait_http(f"{self.gateway_url}{path}", timeout=timeout)
        deadline = time.monotonic() + timeout
        while True:
            try:
                return await wait_http(f"{self.gateway_url}{path}", timeout=max(1.0, deadline - time.monotonic()),
                                       procs=self.procs)
            except ServiceExited as exc:
                metrics = exc.status == EXIT_PORT_TAKEN and not self.settings.metrics_port
                listen = exc.key == "gateway" and exc.status == UVICORN_STARTUP_FAILED and not self.settings.port
                if not (metrics or listen) or tries <= 0:
                    raise
                tries -= 1
                name, extra = self._specs[exc.key]
                if listen and port_free(self.settings.host, self.port):
                    raise  # it failed for another reason than its port
                if listen:
                    self.port = extra["port"] = free_port()
                log.warning("%s: a port chosen for it was taken; starting it on another", exc.key)
                self.spawn(name, exc.key, **extra)  # a metrics port not free is chosen again too

    @property
    def gateway_url(self) -> str:
        return f"http://{self.settings.host}:{self.port}"

    @property
    def metrics_urls(self) -> dict[str, str]:
        """Each service's metrics port (``/metrics``, ``/livez``, ``/readyz``), by key."""
        host = self.settings.metrics_host or os.environ.get("NOETL_METRICS_HOST") or "127.0.0.1"
        host = "127.0.0.1" if host == "0.0.0.0" else host
        return {key: f"http://{host}:{port}" for key, port in self.metrics_ports.items()}

    def kill(self, key: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[key]
        proc.send_signal(sig)
        proc.wait(10)

    async def stop(self) -> None:
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.gather(self._supervisor, return_exceptions=True)
            self._supervisor = None
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


UVICORN_STARTUP_FAILED = 3  # uvicorn's exit status when it cannot start (its port taken)


class ServiceExited(RuntimeError):
    def __init__(self, key: str, status: int | None):
        super().__init__(f"service {key} exited with status {status} during start")
        self.key, self.status = key, status


async def wait_http(url: str, timeout: float, procs: dict[str, subprocess.Popen] | None = None) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(trust_env=False) as client:
        while time.monotonic() < deadline:
            for key, proc in (procs or {}).items():
                if proc.poll() is not None:
                    raise ServiceExited(key, proc.returncode)
            try:
                if (await client.get(url, timeout=1)).status_code < 500:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    raise TimeoutError(f"{url} did not answer within {timeout}s")


# A service allocates a few dicts per event it handles. At CPython's default thresholds (700, 10, 10) the
# collector ran every few messages and, often enough, walked every module, class and function the
# process had loaded: a fifth of the recorder's CPU in a 100,000-item loop (docs/performance.md, "the
# garbage collector").
GC_THRESHOLDS = (10_000, 20, 20)


def tune_gc() -> None:
    """Once a long-running process has started its services: freeze what it holds (modules, classes,
    the services' own objects; the collector never walks them again) and collect the young generation
    every ``GC_THRESHOLDS[0]`` allocations."""
    import gc

    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


async def serve_forever(name: str, settings: Settings) -> None:
    """``noetl service NAME``: run one service until SIGTERM/SIGINT. Its dependencies are waited for
    (retried with a growing delay), never a reason to exit; that includes the streams, which it does
    not create (``noetl setup`` or the stack runners do, as the admin user). Its metrics port (when
    ``settings.metrics_port`` is not None) answers from the start: ``/livez`` at once, ``/readyz`` once
    the service has started and while it is ready.

    The signal stops it gracefully (``stop_service``): it leaves the NATS micro services, stops
    fetching, finishes or hands back (nak) what it holds, leaves the membership group, closes its
    connection; then the process exits 0. A failure while stopping is logged, not raised: what was not
    handed back is redelivered after ``ack_wait`` anyway."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    received: list[str] = []

    def on_signal(sig: signal.Signals) -> None:
        received.append(sig.name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    logs.set_service(name)
    probes = None
    if settings.metrics_port is not None:
        try:
            probes = ProbeServer(loop, settings.metrics_host, settings.metrics_port).start()
        except PortTaken as exc:
            if not settings.metrics_optional:
                raise
            # the default port, taken (another service on this host): the service runs without one
            log.warning("%s: %s: no metrics port (give one with --metrics-port, 0 for any free one)", name, exc)
    if probes is not None:
        probes.expect(name)
        log.info("%s: metrics, liveness and readiness on %s (/metrics, /livez, /readyz)", name, probes.url)
    try:
        starting = asyncio.create_task(start_service_retrying(name, settings))
        await asyncio.wait([starting, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            return
        running = starting.result()
        if probes is not None:
            probes.add(name, readiness(running.service, running.bus))
        if name == "gateway":
            print(f"gateway listening on {running.service.url}", flush=True)
        log.info("%s: started", name)
        tune_gc()
        await stop.wait()
        log.info("%s: stopping (%s)", name, received[0] if received else "asked")
        began = time.monotonic()
        if probes is not None:
            probes.remove(name)
        try:
            await stop_service(running)
        except Exception as exc:  # noqa: BLE001 - stopping anyway; what it held is redelivered after ack_wait
            log.warning("%s: stopping failed (%s: %s)", name, type(exc).__name__, exc)
        log.info("%s: stopped in %.1fs", name, time.monotonic() - began)
    finally:
        tracing.flush()
        if probes is not None:
            probes.stop()

