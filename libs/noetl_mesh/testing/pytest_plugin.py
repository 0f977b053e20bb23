"""pytest fixtures for real NATS and Postgres servers.

Load with ``pytest_plugins = ["noetl_mesh.testing.pytest_plugin"]``. Servers start
lazily, once per session, only when a test asks for one of the fixtures below;
``NOETL_NATS_URL`` / ``NOETL_PG_DSN`` point them at external servers instead.

Fixtures:
    nats_server (session)  EmbeddedNats | ExternalNats
    nats_url               client URL of ``nats_server``
    pg_server (session)    EmbeddedPostgres | ExternalPostgres (fsync off)
    pg_template (session)  name of the template database, ``noetl_template``
    pg_template_init       session fixture returning callables ``(template_dsn) -> None``
                           run once on the template; override it to apply migrations
    pg_database_factory    ``() -> dsn``; each call creates a database from the template,
                           all dropped after the test
    pg_dsn                 DSN of a fresh database for this test

NATS authentication: the servers of ``nats_server``/``nats_url``/``fresh_nats`` are open (no users):
the low-level tests that use them exercise one adapter at a time, as the admin would. Whole stacks
(tests/integration/conftest.py ``start_stack``, the process stacks, the chaos run) start their NATS with
one user per service (``EmbeddedNats(auth=NatsAuth(dir).ensure())``, infra/nats_auth.py) and fail on
any permission violation the server logs.

It also keeps a failure whose traceback has an entry without a line number from ending the run
(``pytest_runtest_makereport`` below).

Applying migrations to every test database (e.g. in ``tests/conftest.py``)::

    @pytest.fixture(scope="session")
    def pg_template_init():
        return [apply_migrations]   # must close its connections before returning
"""

from __future__ import annotations

import uuid
from types import TracebackType
from collections.abc import Callable, Iterator

import pytest

from noetl_mesh.infra.embedded import NatsServer, PostgresServer, provision_nats, provision_postgres

TEMPLATE_DB = "noetl_template"

TemplateInit = Callable[[str], None]


@pytest.fixture(scope="session")
def nats_server() -> Iterator[NatsServer]:
    """A JetStream-enabled NATS server for the whole session."""
    server = provision_nats()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def nats_url(nats_server: NatsServer) -> str:
    return nats_server.url


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PostgresServer]:
    """One Postgres cluster for the whole session (fsync and friends off)."""
    server = provision_postgres(fast=True)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def pg_template_init() -> list[TemplateInit]:
    """Callables run once against the template database's DSN; override to add migrations."""
    return []


@pytest.fixture(scope="session")
def pg_template(pg_server: PostgresServer, pg_template_init: list[TemplateInit]) -> Iterator[str]:
    """(Re)create ``noetl_template`` and initialise it; yields its name."""
    pg_server.drop_database(TEMPLATE_DB)
    dsn = pg_server.create_database(TEMPLATE_DB)
    for init in pg_template_init:
        init(dsn)
    yield TEMPLATE_DB
    pg_server.drop_database(TEMPLATE_DB)


@pytest.fixture
def pg_database_factory(pg_server: PostgresServer, pg_template: str) -> Iterator[Callable[[], str]]:
    """Create fresh databases (``t_<uuid>``) from the template; all are dropped after the test."""
    created: list[str] = []

    def create() -> str:
        name = f"t_{uuid.uuid4().hex}"
        dsn = pg_server.create_database(name, template=pg_template)
        created.append(name)
        return dsn

    yield create
    for name in created:
        pg_server.drop_database(name)


@pytest.fixture
def pg_dsn(pg_database_factory: Callable[[], str]) -> str:
    """DSN of a database of its own for this test."""
    return pg_database_factory()


@pytest.fixture
def fresh_nats() -> Iterator[NatsServer]:
    """A NATS server of this test's own (~20 ms to start): streams and consumers start empty."""
    from noetl_mesh.infra.embedded import EmbeddedNats

    server = EmbeddedNats().start()
    try:
        yield server
    finally:
        server.stop()


# ------------------------------------------------------------------------------ failures as themselves
#
# CPython gives a traceback entry no line number (``tb_lineno`` None) when the exception arose at an
# instruction it has none for: where an asynchronous exception lands (the template watchdog raises
# one), in a handler's clean-up. pytest 9 then fails formatting the test's failure, and that internal
# error ends the whole run, every test after it unrun. Such an entry is given its function's first
# line, so the test fails alone and shows what was raised.


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # noqa: ARG001
    if call.excinfo is not None and _mend_line_numbers(call.excinfo.value):
        call.excinfo = pytest.ExceptionInfo.from_exception(call.excinfo.value)
    return (yield)


def _mend_line_numbers(exc: BaseException) -> bool:
    """Rebuild the tracebacks of ``exc`` and the exceptions chained to it where an entry has no line
    number; True when one was mended."""
    mended, seen = False, set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        todo += [e.__cause__, e.__context__]
        entries, tb = [], e.__traceback__
        while tb is not None:
            entries.append(tb)
            tb = tb.tb_next
        if all(t.tb_lineno is not None for t in entries):
            continue
        rebuilt = None
        for t in reversed(entries):
            line = t.tb_lineno if t.tb_lineno is not None else t.tb_frame.f_code.co_firstlineno
            rebuilt = TracebackType(rebuilt, t.tb_frame, t.tb_lasti, line)
        e.__traceback__ = rebuilt
        mended = True
    return mended
