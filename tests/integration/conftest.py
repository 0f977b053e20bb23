"""A whole stack (every service, real NATS and Postgres) running in a background event loop, shared
by the tests of a module; tests drive it through the gateway. The stack's NATS runs with authentication,
one user per service (infra/nats_auth.py): the suite running on it is the proof that each service's
permissions let it do its job, and a stack whose server logged a permission violation fails its
module's teardown. Tests that look into its NATS connect as ``handle.admin``."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import base64
import logging
import os
import shutil
import tempfile
import subprocess
import sys
import threading
import time
from typing import Any, Coroutine, Iterator

import pytest

from noetl_mesh.client import GatewayClient
from noetl_mesh.infra.embedded import EmbeddedNats
from noetl_mesh.infra.nats_auth import NatsAuth
from noetl_mesh.stack import InProcessStack, Settings
from noetl_mesh.testing.fixture_api import FixtureApi


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine, timeout: float = 120) -> Any:
        async def own() -> Any:
            try:
                return await coro
            except TimeoutError as exc:  # asyncio hands this thread a bare copy: say which wait it was
                import traceback

                raise AssertionError("a wait of the test's own timed out:\n"
                                     + "".join(traceback.format_exception(exc))) from None

        future = asyncio.run_coroutine_threadsafe(own(), self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"not done within {timeout} s; the loop's tasks:\n{self.tasks(coro)}") from None

    def tasks(self, coro: Any = None) -> str:
        """What a timeout says, so that a hang names itself: the state of ``coro`` (never started: the loop
        did not get to it) and its chain of awaits, where the loop's thread is (a loop blocked by a
        synchronous call shows it there), whether the loop still answers, then where each task waits."""
        import inspect
        import sys
        import traceback
        from types import SimpleNamespace

        from noetl_mesh.stack import awaiting

        answers = threading.Event()
        self.loop.call_soon_threadsafe(answers.set)
        alive = answers.wait(2)
        frame = sys._current_frames().get(self.thread.ident)
        head = [f"the test's coroutine: {inspect.getcoroutinestate(coro) if coro else '?'}",
                awaiting(SimpleNamespace(get_coro=lambda: coro)) if coro else "",
                f"the loop {'answers' if alive else 'does NOT answer within 2 s (blocked)'}; its thread is at:",
                "".join(traceback.format_stack(frame)[-12:]) if frame else "  (no frame)"]
        tasks = sorted(asyncio.all_tasks(self.loop), key=lambda t: getattr(t.get_coro(), "cr_await", None) is not coro)
        return "\n".join(head + [f"{t.get_name()}:\n{awaiting(t)}" for t in tasks])[:40000]

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class Capture(logging.Handler):
    """Every log record of the process, formatted: what a test searches for a secret that must not be
    there."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(self.format(record))
        except Exception:  # noqa: BLE001
            self.lines.append(str(record.msg))


class StackHandle:
    def __init__(self, loop: LoopThread, stack: InProcessStack):
        self.loop, self.stack = loop, stack

    @property
    def url(self) -> str:
        return self.stack.gateway_url

    @property
    def nats_url(self) -> str:
        return self.stack.settings.nats_url

    @property
    def metrics_url(self) -> str | None:
        """The stack's metrics port (``settings_kw={"metrics_port": 0}``): /metrics, /livez, /readyz."""
        return self.stack.metrics_url

    @property
    def admin(self) -> str:
        """The admin's NATS credentials (for tests that inspect streams)."""
        return self.stack.settings.creds_for("admin")

    @property
    def token(self) -> str:
        """The stack's admin API token (the bootstrap's): every client of the tests sends it."""
        assert self.stack.token, "the stack has no admin token (bootstrap found users already)"
        return self.stack.token

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def client(self, **kw: Any) -> GatewayClient:
        return GatewayClient(self.url, token=kw.pop("token", self.token), **kw)

    def run(self, coro: Coroutine, timeout: float = 120) -> Any:
        return self.loop.run(coro, timeout)

    def execute(self, playbook: Any, workload: dict | None = None, timeout: float = 60) -> tuple[dict, list[dict]]:
        """Submit through the gateway, wait for the end; return (status, events)."""

        async def go():
            async with self.client() as client:
                eid = await client.start(playbook, workload)
                status = await client.wait(eid, timeout=timeout)
                return status, await client.all_events(eid)

        return self.run(go(), timeout + 10)


@pytest.fixture(autouse=True)
def no_ambient_token(tmp_path_factory, monkeypatch) -> None:
    """No test reads or writes the developer's own token store, or sends a NOETL_TOKEN of the shell:
    every client gets its token explicitly."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("config")))
    monkeypatch.delenv("NOETL_TOKEN", raising=False)


@pytest.fixture(scope="module")
def throwaway_credential_key() -> Iterator[None]:
    """NOETL_CREDENTIAL_KEY set to a random key for the module (credentials it writes need no key file)."""
    old = os.environ.get("NOETL_CREDENTIAL_KEY")
    os.environ["NOETL_CREDENTIAL_KEY"] = base64.b64encode(os.urandom(32)).decode()
    yield
    if old is None:
        del os.environ["NOETL_CREDENTIAL_KEY"]
    else:
        os.environ["NOETL_CREDENTIAL_KEY"] = old


@pytest.fixture(scope="module")
def fixture_api() -> Iterator[FixtureApi]:
    api = FixtureApi().start()
    yield api
    api.stop()


async def new_user(handle: "StackHandle", name: str, roles: list[str], password: str = "a long password") -> str:
    """A new user with ``roles`` (added by the stack's admin), logged in: an API token of theirs."""
    async with handle.client() as admin:
        await admin.add_user(name, roles, password=password)
    async with GatewayClient(handle.url, token="") as c:
        c.use(None)
        await c.login(name, password)
        return (await c.create_token(f"{name} tests"))["token"]


def developer(handle: "StackHandle") -> str:
    """An API token of a new user with the role ``developer`` (who writes and runs playbooks)."""
    return handle.run(new_user(handle, "a-developer", ["developer"]))


# an execution that runs until it is cancelled (its one task sleeps for an hour)
SLOW = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: slow, path: tests/slow}
workflow:
  - step: start
    tool: {kind: python, code: "import time\\ntime.sleep(3600)\\nresult = 1", spec: {timeout: 3600}}
"""


@contextlib.contextmanager
def filling_nobodys_processes() -> Iterator[None]:
    """Held by a test that fills the process count of ``nobody`` (the shell tasks of a root worker):
    the kernel keeps one count per user for the whole host, so two such tests at once, in this run's
    other workers or in another run on the machine, would take from each other's allowance."""
    import fcntl

    with open(os.path.join(tempfile.gettempdir(), "noetl-tests-nobody-processes.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def pg_endpoint(dsn: str) -> str:
    """``HOST:PORT`` of a Postgres connection string: what a stack's workers must be allowed to reach
    for tasks that use that database (NOETL_SANDBOX_ALLOW_NET)."""
    from psycopg.conninfo import conninfo_to_dict

    parts = conninfo_to_dict(dsn)
    return f"{parts.get('host') or '127.0.0.1'}:{parts.get('port') or 5432}"


def start_stack(pg_dsn: str, pools: tuple[str, ...] = ("default",), nats_kw: dict | None = None,
                settings_kw: dict | None = None, allow_net: str = "", **kw: Any):
    """A whole stack in a background loop. ``allow_net``: what its tasks may reach beyond the default
    (D33: NOETL_SANDBOX_ALLOW_NET for its workers, whatever the environment says): nothing unless a test
    names the endpoints its tasks call (``fixture_api.endpoint``, ``pg_endpoint(dsn)``)."""
    auth = NatsAuth(tempfile.mkdtemp(prefix="noetl-creds-"), pools=pools).ensure()
    nats = EmbeddedNats(auth=auth, **(nats_kw or {})).start()
    loop = LoopThread()
    settings = Settings(nats_url=nats.url, pg_dsn=pg_dsn, nats_creds=str(auth.directory),
                        **{"allow_net": allow_net, **(settings_kw or {})})
    stack = loop.run(InProcessStack(settings, **kw).start())
    return nats, loop, StackHandle(loop, stack)


@contextlib.contextmanager
def stack_with_worker(pg_dsn: str, pool: str, **worker_kw: Any) -> Iterator["StackHandle"]:
    """A whole stack with the pools ``default`` and ``pool``, and a worker of ``pool`` made here with
    ``worker_kw`` (``roles``, ``concurrency``...), connected as the NATS user ``worker-<pool>``."""
    from noetl_mesh.infra.bus import Bus
    from noetl_mesh.services.worker.service import WorkerService

    nats, loop, handle = start_stack(pg_dsn, pools=("default", pool))
    settings = handle.stack.settings

    async def start() -> tuple[Bus, WorkerService]:
        creds = NatsAuth(settings.nats_creds).for_service("worker", pool)
        bus = await Bus.connect(settings.nats_url, f"worker-{pool}", creds)
        worker = WorkerService(bus, pool=pool, **worker_kw)
        await worker.start()
        return bus, worker

    bus, worker = handle.run(start())
    try:
        yield handle
    finally:
        async def stop() -> None:
            await worker.stop()
            await bus.close()

        handle.run(stop())
        stop_stack(nats, loop, handle)


def stop_stack(nats, loop, handle, check: bool = True) -> None:
    """Stop everything; with ``check``, fail when the server logged a permission violation. The NATS
    server goes next, so the services hand nothing back (a throw-away stop: 0.1 s instead of 3 s of
    waiting for open pull requests to end; graceful stops have their own tests)."""
    try:
        loop.run(handle.stack.stop(throwaway=True), timeout=120)
    finally:
        loop.close()
        violations = nats.violations()
        nats.stop()
        shutil.rmtree(nats.auth.directory, ignore_errors=True)
    assert not (check and violations), "the services' NATS permissions refused something they do:\n" + "\n".join(violations)


@pytest.fixture(scope="module")
def module_pg(pg_server, pg_template) -> Iterator[str]:
    import uuid

    name = f"m_{uuid.uuid4().hex[:12]}"
    dsn = pg_server.create_database(name, template=pg_template)
    yield dsn
    pg_server.drop_database(name)


@pytest.fixture(scope="module")
def allow_net() -> str:
    """What the tasks of the module's ``stack`` may reach beyond the default (D33): nothing. A module
    whose tasks call the fixture API or the embedded Postgres overrides it with exactly those endpoints."""
    return ""


@pytest.fixture(scope="module")
def stack(module_pg, allow_net) -> Iterator[StackHandle]:
    nats, loop, handle = start_stack(module_pg, allow_net=allow_net)
    yield handle
    stop_stack(nats, loop, handle)


def noetl_up(args: list[str], env: dict[str, str], timeout: float = 120, **popen: Any) -> tuple[subprocess.Popen, str]:
    """Start ``noetl up ARGS`` and read its output until it has said how to reach it (its last line
    starts ``elsewhere:``): the process and what it printed."""
    proc = subprocess.Popen([sys.executable, "-m", "noetl_mesh.cli", "up", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, **popen)
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while not any(line.startswith("elsewhere:") for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            lines.append(proc.stdout.readline())
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, "".join(lines)


async def until(predicate, timeout: float) -> None:
    """Wait (in an event loop) until ``predicate()`` is true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.05)
