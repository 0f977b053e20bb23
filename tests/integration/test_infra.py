"""Integration tests for the embedded NATS / Postgres harness."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import nats
import psycopg
import pytest
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import KeyWrongLastSequenceError
from psycopg.conninfo import conninfo_to_dict

from noetl_mesh.infra.embedded import (
    ENV_NATS_URL,
    ENV_PG_DSN,
    EmbeddedNats,
    EmbeddedPostgres,
    InfraError,
    NatsServer,
    PostgresServer,
    provision_nats,
    provision_postgres,
)


pytestmark = pytest.mark.integration


def _unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); check its state
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


# ----------------------------------------------------------------------------- NATS


def test_jetstream_durable_pull_consumer(nats_url: str) -> None:
    stream, subject = _unique("S"), _unique("jobs")

    async def scenario() -> list[bytes]:
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            await js.add_stream(name=stream, subjects=[f"{subject}.>"])
            for i in range(3):
                ack = await js.publish(f"{subject}.created", f"msg-{i}".encode())
                assert ack.stream == stream and ack.seq == i + 1
            sub = await js.pull_subscribe(
                f"{subject}.>", durable="worker", config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT)
            )
            msgs = await sub.fetch(3, timeout=5)
            for msg in msgs:
                await msg.ack_sync()
            info = await js.consumer_info(stream, "worker")
            assert info.num_pending == 0 and info.num_ack_pending == 0
            assert [m.metadata.sequence.stream for m in msgs] == [1, 2, 3]
            return [m.data for m in msgs]
        finally:
            await nc.close()

    assert asyncio.run(scenario()) == [b"msg-0", b"msg-1", b"msg-2"]


def test_key_value_revisions(nats_url: str) -> None:
    bucket = _unique("kv")

    async def scenario() -> None:
        nc = await nats.connect(nats_url)
        try:
            kv = await nc.jetstream().create_key_value(bucket=bucket, history=5)
            rev1 = await kv.put("run.1.state", b"pending")
            entry = await kv.get("run.1.state")
            assert entry.value == b"pending" and entry.revision == rev1
            rev2 = await kv.update("run.1.state", b"running", last=rev1)
            assert rev2 > rev1
            with pytest.raises(KeyWrongLastSequenceError):
                await kv.update("run.1.state", b"stale writer", last=rev1)
            entry = await kv.get("run.1.state")
            assert entry.value == b"running" and entry.revision == rev2
        finally:
            await nc.close()

    asyncio.run(scenario())


def test_nats_starts_fast_and_stops_clean() -> None:
    started = time.monotonic()
    server = EmbeddedNats(max_payload=2 * 1024 * 1024).start()
    elapsed = time.monotonic() - started
    print(f"nats-server ready in {elapsed:.3f}s")
    pid, workdir = server.pid, server.store_dir.parent if server.store_dir else None
    try:
        assert server.url.startswith("nats://127.0.0.1:") and server.log_path and server.log_path.exists()

        async def max_payload() -> int:
            nc = await nats.connect(server.url)
            try:
                return nc.max_payload
            finally:
                await nc.close()

        assert asyncio.run(max_payload()) == 2 * 1024 * 1024
    finally:
        server.stop()
    assert pid is not None and not _pid_alive(pid)
    assert workdir is not None and not workdir.exists()


@pytest.mark.parametrize("server", ["nats", "postgres"])
def test_a_signal_inside_the_launch_stops_the_server_it_started(server: str, shared_tmp_dir: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The command line's SIGTERM lands while Popen has created the server's process but not yet returned
    it (a loaded machine: the child execs, Popen still waits on the exec pipe): the start raises the
    interruption, and the server it launched is stopped, not left running unknown to anyone."""
    import signal
    import subprocess

    from noetl_mesh.cli.common import Interrupted, Signals
    from noetl_mesh.infra import embedded

    launched: list[int] = []
    real = subprocess.Popen

    def popen(cmd, *args, **kwargs):  # the signal comes inside the server's Popen, after the child exists
        proc = real(cmd, *args, **kwargs)
        if not kwargs.get("start_new_session"):
            return proc  # not a server (initdb, cp, postgres --version): it ends by itself
        launched.append(proc.pid)
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):  # Python runs the handler at the next bytecode boundary: here
            time.sleep(0.001)
        return proc

    monkeypatch.setattr(embedded.subprocess, "Popen", popen)
    # a kept data directory (noetl up's): a server is not ended by its directory's removal
    start = ((lambda: EmbeddedNats(store_dir=shared_tmp_dir / "js").start()) if server == "nats"
             else (lambda: EmbeddedPostgres(shared_tmp_dir / "pgdata", fast=True).start()))
    with Signals() as signals, pytest.raises(Interrupted):
        start()
    assert signals.received == signal.SIGTERM and launched
    for pid in launched:  # stopped by the start itself: nothing running
        assert not _pid_alive(pid), f"{server} pid {pid} left running"


def test_nats_failure_reports_command_and_log(nats_server: NatsServer) -> None:
    assert isinstance(nats_server, EmbeddedNats), "needs an embedded session server"
    taken = int(nats_server.url.rsplit(":", 1)[1])
    with pytest.raises(InfraError) as info:
        EmbeddedNats(port=taken, startup_timeout=5).start()
    message = str(info.value)
    assert "nats-server" in message and f"-p {taken}" in message
    assert "address already in use" in message.lower()


def test_provision_nats_honours_env(nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_NATS_URL, nats_server.url)
    server = provision_nats()
    assert server.external and server.pid is None and server.url == nats_server.url

    async def ping() -> None:
        nc = await nats.connect(server.url)
        await nc.flush()
        await nc.close()

    asyncio.run(ping())
    server.stop()  # no-op: the session server must survive it
    asyncio.run(ping())


# ----------------------------------------------------------------------------- Postgres


def test_postgres_round_trip(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("CREATE TABLE event (id serial PRIMARY KEY, kind text NOT NULL, body jsonb)")
        conn.execute(
            "INSERT INTO event (kind, body) VALUES (%s, %s::jsonb), (%s, %s::jsonb)",
            ("start", '{"step": 1}', "end", '{"step": 2}'),
        )
        conn.commit()
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute("SELECT id, kind, body FROM event ORDER BY id").fetchall()
        assert rows == [(1, "start", {"step": 1}), (2, "end", {"step": 2})]
        assert conn.execute("SELECT current_database()").fetchone() == (conninfo_to_dict(pg_dsn)["dbname"],)


@pytest.mark.parametrize("attempt", [1, 2])
def test_pg_dsn_is_isolated_per_test(pg_dsn: str, attempt: int) -> None:
    """Whichever run comes second would see the table if databases were shared."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT to_regclass('public.probe')").fetchone() == (None,)
        conn.execute("CREATE TABLE probe (attempt int)")


def test_database_factory_isolation(pg_database_factory: Callable[[], str]) -> None:
    first, second = pg_database_factory(), pg_database_factory()
    assert first != second
    with psycopg.connect(first, autocommit=True) as conn:
        conn.execute("CREATE TABLE only_here (x int)")
    with psycopg.connect(second, autocommit=True) as conn:
        assert conn.execute("SELECT to_regclass('public.only_here')").fetchone() == (None,)


def test_create_and_drop_database_with_template(pg_server: PostgresServer) -> None:
    template, clone = _unique("tpl"), _unique("clone")
    template_dsn = pg_server.create_database(template)
    try:
        with psycopg.connect(template_dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE migrated (v text)")
            conn.execute("INSERT INTO migrated VALUES ('from template')")
        clone_dsn = pg_server.create_database(clone, template=template)
        with psycopg.connect(clone_dsn) as conn:
            assert conn.execute("SELECT v FROM migrated").fetchall() == [("from template",)]
        open_conn = psycopg.connect(clone_dsn)  # DROP ... WITH (FORCE) must not be blocked by it
        try:
            pg_server.drop_database(clone)
        finally:
            open_conn.close()
    finally:
        pg_server.drop_database(clone)
        pg_server.drop_database(template)
    with psycopg.connect(pg_server.dsn("postgres")) as conn:
        names = {r[0] for r in conn.execute("SELECT datname FROM pg_database").fetchall()}
    assert template not in names and clone not in names


def test_provision_postgres_honours_env(pg_server: PostgresServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_PG_DSN, pg_server.dsn("postgres"))
    server = provision_postgres(fast=True)
    assert server.external and server.pid is None and server.port == pg_server.port
    name = _unique("ext")
    dsn = server.create_database(name)
    try:
        assert conninfo_to_dict(dsn)["dbname"] == name
        assert conninfo_to_dict(dsn)["port"] == str(pg_server.port)
        with psycopg.connect(dsn) as conn:
            assert conn.execute("SELECT current_database()").fetchone() == (name,)
    finally:
        server.drop_database(name)
    server.stop()  # no-op
    with psycopg.connect(pg_server.dsn()) as conn:
        conn.execute("SELECT 1")


@pytest.fixture
def shared_tmp_dir() -> Iterator[Path]:
    """A temp dir the unprivileged postgres user can reach (pytest's tmp_path is root-only 0700)."""
    path = Path(tempfile.mkdtemp(prefix="noetl-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_persistent_data_dir_is_reused(shared_tmp_dir: Path) -> None:
    data_dir = shared_tmp_dir / "pgdata"
    with EmbeddedPostgres(data_dir, fast=True) as pg:
        with psycopg.connect(pg.dsn(), autocommit=True) as conn:
            conn.execute("CREATE TABLE kept (v int)")
            conn.execute("INSERT INTO kept VALUES (42)")
        pid = pg.pid
    assert pid is not None and not _pid_alive(pid)
    assert (data_dir / "PG_VERSION").exists()
    with EmbeddedPostgres(data_dir, fast=True) as pg:
        with psycopg.connect(pg.dsn()) as conn:
            assert conn.execute("SELECT v FROM kept").fetchall() == [(42,)]
        assert pg.log_path is not None and "database system is ready" in pg.log_path.read_text()
    assert data_dir.exists()


def _copies(monkeypatch: pytest.MonkeyPatch, parent: Path) -> list[bool]:
    """Throw-away clusters under ``parent``; what each start's template copy returned."""
    from noetl_mesh.infra import embedded

    copies: list[bool] = []
    copy = embedded._copy_template
    monkeypatch.setattr(embedded, "_ram_tmp_dir", lambda: str(parent))
    monkeypatch.setattr(embedded, "_copy_template", lambda t, d: copies.append(copy(t, d)) or copies[-1])
    return copies


def _count_databases(pg: EmbeddedPostgres) -> int:
    with psycopg.connect(pg.dsn()) as conn:
        return conn.execute("SELECT count(*) FROM pg_database").fetchone()[0]


def test_throwaway_clusters_are_copies_of_one_initdb(shared_tmp_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    copies = _copies(monkeypatch, shared_tmp_dir)
    for _ in range(2):
        with EmbeddedPostgres(fast=True) as pg:
            assert _count_databases(pg) == 3  # postgres, template0, template1: a whole cluster
            with psycopg.connect(pg.dsn(), autocommit=True) as conn:
                conn.execute("CREATE TABLE mine (v int)")  # not seen by the next copy
    assert copies == [True, True]
    (root,) = shared_tmp_dir.glob("noetl-pg-templates-*")
    assert root.stat().st_mode & 0o077 == 0 and len([p for p in root.iterdir() if (p / "PG_VERSION").exists()]) == 1
    assert not list(shared_tmp_dir.glob("noetl-pg-data-*"))  # each copy went with its cluster


def test_a_template_directory_others_can_write_is_not_used(shared_tmp_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    root = shared_tmp_dir / f"noetl-pg-templates-{os.getuid()}"
    root.mkdir(mode=0o777)
    root.chmod(0o777)  # someone else could have put a cluster of theirs there
    copies = _copies(monkeypatch, shared_tmp_dir)
    with EmbeddedPostgres(fast=True) as pg:
        assert _count_databases(pg) == 3
    assert copies == [False] and not list(root.iterdir())
    assert "not a private directory" in caplog.text


def _refused_without_password(pg: EmbeddedPostgres) -> bool:
    try:
        psycopg.connect(f"host=127.0.0.1 port={pg.port} user=postgres dbname=postgres connect_timeout=5").close()
    except psycopg.OperationalError as e:
        return "password" in str(e)
    return False


def test_an_embedded_postgres_asks_every_client_for_its_own_password(shared_tmp_dir: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A task, or another user of the machine, that reaches 127.0.0.1 does not get the event log: the
    superuser has a random password per cluster (throw-away copies of the template included)."""
    _copies(monkeypatch, shared_tmp_dir)
    passwords = []
    for _ in range(2):
        with EmbeddedPostgres(fast=True) as pg:
            assert _refused_without_password(pg)
            assert conninfo_to_dict(pg.dsn())["password"] == pg.password
            with psycopg.connect(pg.dsn()) as conn:
                assert conn.execute("SELECT 1").fetchone() == (1,)
            passwords.append(pg.password)
            stored = pg.data_dir / "noetl-superuser-password"
            assert stored.stat().st_mode & 0o077 == 0
    assert passwords[0] != passwords[1]  # each copy of the template its own


def test_a_cluster_that_trusted_local_connections_asks_for_a_password_after_a_restart(shared_tmp_dir: Path) -> None:
    data_dir = shared_tmp_dir / "oldpg"
    with EmbeddedPostgres(data_dir, fast=True) as pg:  # made by this version, then turned into an older one's
        password = pg.password
    hba = data_dir / "pg_hba.conf"
    hba.write_text(hba.read_text().replace("scram-sha-256", "trust"))
    (data_dir / "noetl-superuser-password").unlink()
    with EmbeddedPostgres(data_dir, fast=True) as pg:
        assert pg.password and pg.password != password
        assert _refused_without_password(pg)
        assert "trust" not in "".join(line for line in hba.read_text().splitlines() if not line.startswith("#"))
    with EmbeddedPostgres(data_dir, fast=True) as pg:  # and again: the password kept is the one in use
        with psycopg.connect(pg.dsn()) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)


def test_postgres_failure_reports_command_and_log(pg_server: PostgresServer) -> None:
    """A second cluster on a taken port must fail loudly, not talk to the first one."""
    assert isinstance(pg_server, EmbeddedPostgres), "needs an embedded session server"
    with pytest.raises(InfraError) as info:
        EmbeddedPostgres(port=pg_server.port, fast=True).start()
    message = str(info.value)
    assert f"-p {pg_server.port}" in message and "postgres" in message
    assert "could not bind" in message
