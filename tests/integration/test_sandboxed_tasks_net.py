"""D33 on a whole stack, through the gateway, as a playbook author (role ``developer``) would try it: an
http task may not read the NATS monitoring port, a service's metrics port or the cloud metadata address,
nor follow a redirect to loopback; a postgres task may not reach the embedded Postgres (the event log);
the endpoints a stack opens work, their neighbours do not, and the engine's own NATS endpoint stays
closed whatever the allow-list says."""
from __future__ import annotations

from typing import Any, Iterator

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from noetl_mesh.client import GatewayClient

from conftest import developer, pg_endpoint, start_stack, stop_stack

pytestmark = pytest.mark.integration


def probe(handle, token: str, task: dict[str, Any]) -> tuple[dict, dict]:
    """Run a playbook of one task (named ``probe``) as ``token``'s user: (the execution, the task's outcome)."""
    doc = {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "probe", "path": "tests/net_probe"},
           "workflow": [{"step": "start", "tool": [{"name": "probe", **task}]}]}

    async def go():
        async with GatewayClient(handle.url, token=token) as client:
            eid = await client.start(doc)
            final = await client.wait(eid, timeout=60)
            return final, await client.all_events(eid)

    final, events = handle.run(go(), 90)
    [processed] = [e for e in events if e["name"] == "task.processed" and e["task"] == "probe"]
    return final, processed["data"]["outcome"]


def refused(final: dict, outcome: dict) -> str:
    """The refusal's message, after checking it is one: the task and the execution failed with the
    error kind ``sandbox``, not retried."""
    assert outcome["status"] == "error", outcome
    assert outcome["error"]["kind"] == "sandbox" and outcome["error"]["retryable"] is False, outcome["error"]
    assert final["status"] == "FAILED" and final["error"]["kind"] == "sandbox"
    return outcome["error"]["message"]


@pytest.fixture(scope="module")
def opened_api(module_pg, fixture_api) -> Iterator[Any]:
    """A stack whose workers may reach the fixture API and nothing else (besides the default), with a
    metrics port; and a developer's token."""
    nats, loop, handle = start_stack(module_pg, allow_net=fixture_api.endpoint, settings_kw={"metrics_port": 0})
    handle.nats = nats
    handle.developer = developer(handle)
    yield handle
    stop_stack(nats, loop, handle)


def test_an_http_task_cannot_read_the_nats_monitoring_port(opened_api):
    url = f"{opened_api.nats.monitor_url}/varz"
    port = url.rsplit(":", 1)[1].split("/")[0]
    final, outcome = probe(opened_api, opened_api.developer, {"kind": "http", "url": url})
    assert refused(final, outcome) == (f"http task refused: 127.0.0.1 is a loopback address, closed to tasks on this "
                                       f"worker pool (D33); open it with NOETL_SANDBOX_ALLOW_NET=127.0.0.1:{port} "
                                       f"(noetl run/up: --allow-net 127.0.0.1:{port})")
    assert outcome["result"] is None and outcome["http"]["status"] is None


def test_an_http_task_cannot_read_a_services_metrics_port(opened_api):
    assert opened_api.metrics_url.startswith("http://127.0.0.1:")
    final, outcome = probe(opened_api, opened_api.developer, {"kind": "http", "url": f"{opened_api.metrics_url}/metrics"})
    assert "127.0.0.1 is a loopback address" in refused(final, outcome)


def test_an_http_task_cannot_reach_the_cloud_metadata_address(opened_api):
    """Refused before any connection is tried: the outcome is the refusal, not a timeout. This machine
    sends nothing to that address, even when the check is broken: the worker's backend is first asked
    in-process, with a connector that fails the test if it is ever called."""
    import asyncio

    from noetl_mesh.sandbox.net import Refused
    from noetl_mesh.sandbox.policy import Policy
    from noetl_mesh.tools.http import _GuardedBackend

    class NeverConnects:
        async def connect_tcp(self, host, port, **kw):
            pytest.fail(f"the backend would have connected to {host}:{port}")

    with pytest.raises(Refused):
        asyncio.run(_GuardedBackend(Policy(), inner=NeverConnects()).connect_tcp("169.254.169.254", 80, timeout=5))
    final, outcome = probe(opened_api, opened_api.developer,
                           {"kind": "http", "url": "http://169.254.169.254/latest/meta-data/", "timeout": 30})
    assert refused(final, outcome).startswith("http task refused: 169.254.169.254 is a cloud metadata address, "
                                              "closed to tasks on this worker pool (D33)")


def test_the_opened_endpoint_works_its_neighbour_does_not_and_a_redirect_to_loopback_is_refused(opened_api,
                                                                                              fixture_api):
    final, outcome = probe(opened_api, opened_api.developer,
                           {"kind": "http", "url": f"{fixture_api.url}/assessments", "params": {"pageSize": 2}})
    assert final["status"] == "COMPLETED" and outcome["result"]["data"]["paging"] == {"page": 1, "hasMore": True}
    port = int(fixture_api.endpoint.rsplit(":", 1)[1])
    final, outcome = probe(opened_api, opened_api.developer, {"kind": "http", "url": f"http://127.0.0.1:{port + 1}/"})
    assert f"NOETL_SANDBOX_ALLOW_NET=127.0.0.1:{port + 1} " in refused(final, outcome)
    target = f"{opened_api.nats.monitor_url}/connz"
    final, outcome = probe(opened_api, opened_api.developer,
                           {"kind": "http", "url": f"{fixture_api.url}/redirect", "params": {"to": target}})
    assert refused(final, outcome).startswith(f"http task refused: a redirect to {target}: 127.0.0.1 is a loopback "
                                              "address, closed to tasks on this worker pool (D33)")


def test_a_postgres_task_cannot_reach_the_embedded_postgres(opened_api, module_pg):
    """The stack's own database (its event log) is on loopback: closed by default."""
    final, outcome = probe(opened_api, opened_api.developer,
                           {"kind": "postgres", "dsn": module_pg, "command": "select count(*) as n from credential"})
    endpoint = pg_endpoint(module_pg)
    assert refused(final, outcome) == (f"postgres task refused: 127.0.0.1 is a loopback address, closed to tasks on "
                                       f"this worker pool (D33); open it with NOETL_SANDBOX_ALLOW_NET={endpoint} "
                                       f"(noetl run/up: --allow-net {endpoint})")
    final, outcome = probe(opened_api, opened_api.developer,  # by name, and as libpq's local socket
                           {"kind": "postgres", "dsn": module_pg.replace("127.0.0.1", "localhost"), "command": "select 1"})
    assert "localhost:" in refused(final, outcome) and "resolves to 127.0.0.1" in outcome["error"]["message"]
    final, outcome = probe(opened_api, opened_api.developer,
                           {"kind": "postgres", "dsn": "host=/tmp dbname=postgres user=postgres", "command": "select 1"})
    assert "host '/tmp' is a unix-socket directory" in refused(final, outcome)


def test_a_stack_that_opens_its_postgres_reaches_it_and_not_the_port_next_to_it(pg_dsn):
    nats, loop, handle = start_stack(pg_dsn, allow_net=pg_endpoint(pg_dsn))
    try:
        token = developer(handle)
        final, outcome = probe(handle, token, {"kind": "postgres", "dsn": pg_dsn, "command": "select 41 + 1 as n"})
        assert final["status"] == "COMPLETED" and outcome["result"]["rows"] == [{"n": 42}]
        parts = conninfo_to_dict(pg_dsn)
        neighbour = make_conninfo(pg_dsn, port=str(int(parts["port"]) + 1))
        final, outcome = probe(handle, token, {"kind": "postgres", "dsn": neighbour, "command": "select 1"})
        assert f"NOETL_SANDBOX_ALLOW_NET=127.0.0.1:{int(parts['port']) + 1} " in refused(final, outcome)
    finally:
        stop_stack(nats, loop, handle)


def test_the_engines_nats_endpoint_stays_closed_whatever_the_allow_list_opens(pg_dsn):
    """All of loopback opened: the worker's own NATS server is still refused, to http, postgres and nats
    tasks."""
    nats, loop, handle = start_stack(pg_dsn, allow_net="127.0.0.0/8")
    try:
        token = developer(handle)
        port = nats.url.rsplit(":", 1)[1]
        for task in ({"kind": "http", "url": f"http://127.0.0.1:{port}/"},
                     {"kind": "postgres", "dsn": f"host=127.0.0.1 port={port} dbname=x user=y", "command": "select 1"},
                     {"kind": "nats", "operation": "kv_get", "url": nats.url, "bucket": "noetl_users", "key": "admin"}):
            final, outcome = probe(handle, token, task)
            assert refused(final, outcome).endswith(
                f"127.0.0.1:{port} is the engine's own NATS server, closed to tasks on this worker pool (D33); it "
                "stays closed whatever NOETL_SANDBOX_ALLOW_NET says"), task
    finally:
        stop_stack(nats, loop, handle)


def test_an_http_task_cannot_reach_what_listens_on_the_worker_hosts_own_address(opened_api):
    """A program on the worker's host that listens on every interface (0.0.0.0: a sidecar, a metrics
    port in a container) is not open to tasks through the host's own non-loopback address either."""
    import socket
    import threading

    from noetl_mesh.sandbox.net import host_addresses

    own = [a for a in host_addresses() if ":" not in a and not a.startswith("127.")]
    assert own, "this machine has an interface address besides loopback"
    server = socket.create_server(("0.0.0.0", 0))
    port = server.getsockname()[1]
    accepted: list[Any] = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    try:
        final, outcome = probe(opened_api, opened_api.developer, {"kind": "http", "url": f"http://{own[0]}:{port}/"})
        assert refused(final, outcome) == (
            f"http task refused: {own[0]} is an address of the worker's own host, closed to tasks on this worker "
            f"pool (D33); open it with NOETL_SANDBOX_ALLOW_NET={own[0]}:{port} (noetl run/up: --allow-net "
            f"{own[0]}:{port})")
        assert accepted == []  # nothing connected
    finally:
        server.close()
