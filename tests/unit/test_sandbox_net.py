"""D33, the network part: the addresses a task's connection may go to (sandbox/net.py), checked on what
is really connected to by the http tool (its network backend: every hop, every connection) and pinned
by the postgres tool. Host names resolve through a stub; the servers listen on 127.0.0.1/127.0.0.2 only."""
from __future__ import annotations

import asyncio
import datetime
import ssl
import threading
from typing import Any

import httpcore
import pytest

from noetl_mesh.sandbox.net import Refused, allowed_addresses, resolve_endpoints
from noetl_mesh.sandbox.policy import Policy, from_env, parse_destinations
from noetl_mesh.testing.fixture_api import FixtureApi, QuietHTTPServer, _Handler
from noetl_mesh.tools.base import ToolContext
from noetl_mesh.tools.http import HttpTool, _GuardedBackend
from noetl_mesh.tools.postgres import PostgresTool, _BadTask, _ConnectError, _pinned

pytestmark = pytest.mark.timeout(60)


def allowing(text: str) -> Policy:
    return Policy(allow=parse_destinations(text))


class Resolver:
    """A stub resolver: ``{name: [addresses]}``, or a list of answers given in turn (DNS rebinding)."""

    def __init__(self, names: dict[str, Any]):
        self.names, self.asked = names, []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append(host)
        answer = self.names.get(host)
        if answer is None:
            raise OSError(-2, "Name or service not known")
        if answer and isinstance(answer[0], list):  # answers in turn
            return answer.pop(0) if len(answer) > 1 else answer[0]
        return answer


def run(coro):
    return asyncio.run(coro)


def ctx() -> ToolContext:
    return ToolContext(execution_id="e1", step="s", task_name="t", timeout=10)


# ============================================================================ addresses and refusals


def test_an_address_as_written_is_checked_without_resolving():
    stub = Resolver({})
    with pytest.raises(Refused) as refused:
        run(allowed_addresses(Policy(), "http", "127.0.0.1", 8765, stub))
    assert str(refused.value) == ("http task refused: 127.0.0.1 is a loopback address, closed to tasks on this worker "
                                  "pool (D33); open it with NOETL_SANDBOX_ALLOW_NET=127.0.0.1:8765 (noetl run/up: "
                                  "--allow-net 127.0.0.1:8765)")
    assert refused.value.kind == "sandbox" and stub.asked == []
    assert run(allowed_addresses(allowing("127.0.0.1:8765"), "http", "127.0.0.1", 8765, stub)) == ["127.0.0.1"]
    with pytest.raises(Refused, match=r"::1 is a loopback address.*NOETL_SANDBOX_ALLOW_NET=\[::1\]:80 "):
        run(allowed_addresses(Policy(), "http", "::1", 80, stub))
    with pytest.raises(Refused, match="169.254.169.254 is a cloud metadata address"):
        run(allowed_addresses(Policy(), "http", "169.254.169.254", 80, stub))


def test_a_name_keeps_only_its_allowed_addresses_and_a_refusal_names_it():
    stub = Resolver({"mixed.test": ["127.0.0.1", "127.0.0.2"], "local.test": ["127.0.0.1", "::1"]})
    assert run(allowed_addresses(allowing("127.0.0.2:80"), "http", "mixed.test", 80, stub)) == ["127.0.0.2"]
    with pytest.raises(Refused) as refused:
        run(allowed_addresses(Policy(), "postgres", "local.test", 5432, stub))
    assert str(refused.value).startswith("postgres task refused: local.test:5432 resolves to 127.0.0.1, ::1: "
                                         "127.0.0.1 is a loopback address, closed to tasks")
    with pytest.raises(OSError):
        run(allowed_addresses(Policy(), "http", "nowhere.test", 80, stub))


def test_the_engine_endpoints_stay_closed_and_the_message_says_nothing_opens_them():
    policy = from_env({"NOETL_SANDBOX_ALLOW_NET": "127.0.0.0/8"}).with_engine_endpoints([("127.0.0.1", 4222)])
    with pytest.raises(Refused) as refused:
        run(allowed_addresses(policy, "http", "127.0.0.1", 4222))
    assert str(refused.value) == ("http task refused: 127.0.0.1:4222 is the engine's own NATS server, closed to tasks "
                                  "on this worker pool (D33); it stays closed whatever NOETL_SANDBOX_ALLOW_NET says")
    assert run(allowed_addresses(policy, "http", "127.0.0.1", 4223)) == ["127.0.0.1"]


def test_engine_endpoints_given_by_name_are_resolved_to_addresses():
    assert ("127.0.0.1", 4222) in resolve_endpoints([("localhost", 4222), ("127.0.0.1", 4222)])
    assert resolve_endpoints([("no-such-host.invalid", 4222)]) == []


# ========================================================================================= http


@pytest.fixture(scope="module")
def api():
    api = FixtureApi().start()
    yield api
    api.stop()


@pytest.fixture(scope="module")
def api2():
    """The fixture API on 127.0.0.2, the address the tests open (127.0.0.1 stays closed)."""
    srv = QuietHTTPServer(("127.0.0.2", 0), _Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


def http(policy: Policy, *tasks: dict, resolver: Any = None, **kw: Any) -> list[dict]:
    tool = HttpTool(trust_env=kw.pop("trust_env", False), policy=policy, resolver=resolver, **kw)

    async def main():
        try:
            return [await tool.run(task, {}, ctx()) for task in tasks]
        finally:
            await tool.close()

    return run(main())


def refused(out: dict) -> str:
    assert out["status"] == "error" and out["error"]["kind"] == "sandbox", out
    assert out["error"]["retryable"] is False and out["http"]["status"] is None
    return out["error"]["message"]


def test_http_refuses_loopback_in_every_spelling(api):
    port = api.server.server_address[1]
    for url in (f"{api.url}/assessments", f"http://2130706433:{port}/assessments",
                f"http://[::ffff:127.0.0.1]:{port}/assessments", f"http://0x7f.1:{port}/", f"http://127.1:{port}/",
                f"http://localhost:{port}/"):
        (out,) = http(Policy(), {"url": url})
        assert "127.0.0.1 is a loopback address" in refused(out), url
        assert f"NOETL_SANDBOX_ALLOW_NET=127.0.0.1:{port} (noetl run/up: --allow-net 127.0.0.1:{port})" in \
            out["error"]["message"]
    (out,) = http(allowing(api.endpoint), {"url": f"{api.url}/assessments"})
    assert out["status"] == "ok" and out["result"]["data"]["paging"]["page"] == 1


def test_http_refuses_the_metadata_address_before_any_connection():
    tried: list = []

    class Inner:
        async def connect_tcp(self, host, port, **kw):
            tried.append((host, port))
            raise AssertionError("a refused address was connected to")

    backend = _GuardedBackend(Policy(), inner=Inner())
    with pytest.raises(Refused, match="169.254.169.254 is a cloud metadata address"):
        run(backend.connect_tcp("169.254.169.254", 80, timeout=5))
    with pytest.raises(Refused, match="resolves to 169.254.169.254"):
        run(_GuardedBackend(Policy(), Resolver({"metadata.google.internal": ["169.254.169.254"]}),
                            inner=Inner()).connect_tcp("metadata.google.internal", 80, timeout=5))
    assert tried == []
    (out,) = http(Policy(), {"url": "http://169.254.169.254/latest/meta-data/"})
    assert refused(out).startswith("http task refused: 169.254.169.254 is a cloud metadata address")


def test_http_connects_to_the_allowed_address_of_a_name_that_also_resolves_to_loopback(api2):
    stub = Resolver({"both.test": ["127.0.0.1", "127.0.0.2"]})
    tried: list = []

    class Inner(httpcore.AnyIOBackend):
        async def connect_tcp(self, host, port, **kw):
            tried.append(host)
            return await super().connect_tcp(host, port, **kw)

    tool = HttpTool(trust_env=False, policy=allowing(f"127.0.0.2:{api2}"), resolver=stub)

    async def main():
        client = tool._get_client()
        client._guard.inner = Inner()
        try:
            return await tool.run({"url": f"http://both.test:{api2}/assessments"}, {}, ctx())
        finally:
            await tool.close()

    out = run(main())
    assert out["status"] == "ok" and out["result"]["data"]["paging"]["page"] == 1
    assert tried == ["127.0.0.2"]  # 127.0.0.1 was never tried


def test_http_checks_every_new_connection_so_dns_rebinding_is_refused(api2):
    """The first answer is the opened address; the next one (a new connection: the server closes each)
    is loopback: refused, though the URL is the same."""
    stub = Resolver({"rebind.test": [["127.0.0.2"], ["127.0.0.1"]]})
    first, second = http(allowing(f"127.0.0.2:{api2}"), {"url": f"http://rebind.test:{api2}/assessments"},
                         {"url": f"http://rebind.test:{api2}/assessments"}, resolver=stub)
    assert first["status"] == "ok"
    assert refused(second).startswith(f"http task refused: rebind.test:{api2} resolves to 127.0.0.1: "
                                      "127.0.0.1 is a loopback address")
    assert stub.asked == ["rebind.test", "rebind.test"]


def test_http_refuses_a_redirect_to_loopback_and_says_it_was_one(api2):
    target = "http://127.0.0.1:4222/varz"
    base = f"http://127.0.0.2:{api2}"
    followed, kept = http(allowing(f"127.0.0.2:{api2}"), {"url": f"{base}/redirect", "params": {"to": target}},
                          {"url": f"{base}/redirect", "params": {"to": target}, "follow_redirects": False})
    assert refused(followed) == (f"http task refused: a redirect to {target}: 127.0.0.1 is a loopback address, closed "
                                 "to tasks on this worker pool (D33); open it with NOETL_SANDBOX_ALLOW_NET="
                                 "127.0.0.1:4222 (noetl run/up: --allow-net 127.0.0.1:4222)")
    assert kept["status"] == "ok" and kept["http"]["status"] == 302  # not followed: nothing to refuse
    # a redirect to a name resolving to loopback: the same
    (named,) = http(allowing(f"127.0.0.2:{api2}"),
                    {"url": f"{base}/redirect", "params": {"to": f"http://inside.test:{api2}/"}},
                    resolver=Resolver({"inside.test": ["127.0.0.1"]}))
    assert "a redirect to http://inside.test:" in refused(named)


def test_a_proxy_of_the_environment_is_checked_like_any_destination(api, api2, monkeypatch):
    """trust_env: the connection goes to the proxy, so the proxy's address is checked; a target written
    as an address is checked too (the proxy would reach it for the task)."""
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.2:{api2}")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    (out,) = http(Policy(), {"url": "http://example.test/assessments"}, trust_env=True)
    assert "127.0.0.2 is a loopback address" in refused(out)
    # the proxy opened: a target written as a closed address is still refused
    (out,) = http(allowing(f"127.0.0.2:{api2}"), {"url": f"{api.url}/assessments"}, trust_env=True)
    assert "127.0.0.1 is a loopback address" in refused(out)


def test_tls_checks_the_certificate_against_the_host_name_not_the_address(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "api.test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("api.test")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    srv = QuietHTTPServer(("127.0.0.2", 0), _Handler)
    srv.socket = server_context.wrap_socket(srv.socket, server_side=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    trust = ssl.create_default_context(cafile=str(tmp_path / "cert.pem"))
    try:
        stub = Resolver({"api.test": ["127.0.0.2"], "other.test": ["127.0.0.2"]})
        good, wrong_name = http(allowing(f"127.0.0.2:{port}"), {"url": f"https://api.test:{port}/assessments"},
                                {"url": f"https://other.test:{port}/assessments"}, resolver=stub, verify=trust)
    finally:
        srv.shutdown()
        srv.server_close()
    assert good["status"] == "ok" and good["result"]["data"]["paging"]["page"] == 1
    assert wrong_name["error"]["kind"] == "http_connect_error"
    assert "CERTIFICATE_VERIFY_FAILED" in wrong_name["error"]["message"]


def test_every_transport_of_the_client_is_guarded(monkeypatch):
    """An httpx that stopped building its transports through the hooks the tool overrides would leave
    a path unchecked: the direct transport and each proxy's are the guarded kind."""
    from noetl_mesh.tools.http import _GuardedTransport

    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.2:3128")
    tool = HttpTool(trust_env=True)

    async def main():
        client = tool._get_client()
        try:
            return client._transport, [t for t in client._mounts.values() if t is not None]
        finally:
            await tool.close()

    direct, proxies = run(main())
    assert isinstance(direct, _GuardedTransport) and proxies
    assert all(isinstance(t, _GuardedTransport) for t in proxies)
    assert all(t._pool._network_backend is direct._pool._network_backend for t in proxies)


# ===================================================================================== postgres


def pinned(conninfo: str, policy: Policy = Policy(), names: dict | None = None) -> dict:
    from psycopg.conninfo import conninfo_to_dict

    return conninfo_to_dict(run(_pinned(conninfo, policy, Resolver(names or {}))))


def test_postgres_pins_each_checked_address_as_hostaddr_and_keeps_the_host_name(monkeypatch):
    for var in ("PGHOST", "PGHOSTADDR", "PGPORT"):
        monkeypatch.delenv(var, raising=False)
    got = pinned("host=db.test port=6543 dbname=x user=u password=secret",
                 names={"db.test": ["10.1.2.3", "10.1.2.4"]})
    assert got == {"host": "db.test,db.test", "hostaddr": "10.1.2.3,10.1.2.4", "port": "6543,6543",
                   "dbname": "x", "user": "u", "password": "secret",
                   "passfile": "/dev/null", "sslcertmode": "disable", "gssencmode": "disable"}
    # a list of hosts: the refused one is left out, the others kept
    got = pinned("host=a.test,b.test port=5432,5433 dbname=x", names={"a.test": ["127.0.0.1"], "b.test": ["10.0.0.5"]})
    assert (got["host"], got["hostaddr"], got["port"]) == ("b.test", "10.0.0.5", "5433")
    # the opened address, given as an address
    assert pinned("host=127.0.0.1 port=5432", allowing("127.0.0.1:5432"))["hostaddr"] == "127.0.0.1"


def test_postgres_refuses_loopback_unix_sockets_and_no_host(monkeypatch):
    for var in ("PGHOST", "PGHOSTADDR", "PGPORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(Refused, match=r"^postgres task refused: 127.0.0.1 is a loopback address, .*"
                                      r"NOETL_SANDBOX_ALLOW_NET=127.0.0.1:5432 "):
        pinned("host=127.0.0.1 port=5432 dbname=x user=postgres")
    with pytest.raises(Refused, match="host '/var/run/postgresql' is a unix-socket directory"):
        pinned("host=/var/run/postgresql dbname=x")
    with pytest.raises(Refused, match="host '@abstract' is a unix-socket directory"):
        pinned("host=@abstract dbname=x")
    with pytest.raises(Refused, match="no host given: libpq would use its local unix socket"):
        pinned("dbname=x user=postgres")
    with pytest.raises(Refused, match="localhost:5432 resolves to 127.0.0.1"):
        pinned("postgresql://postgres@localhost/x", names={"localhost": ["127.0.0.1"]})
    monkeypatch.setenv("PGHOST", "127.0.0.1")  # the worker's own libpq settings are not a task's
    with pytest.raises(Refused, match="no host given"):
        pinned("dbname=x")


@pytest.mark.parametrize("option", ["service=warehouse", "passfile=/root/.pgpass", "sslkeylogfile=/tmp/keys",
                                    "sslkey=/root/.postgresql/postgresql.key", "sslcert=/x.crt", "krbsrvname=pg",
                                    "gssencmode=prefer", "requirepeer=root", "sslrootcert=/etc/shadow"])
def test_postgres_options_that_reach_the_workers_files_or_identity_are_refused(option):
    with pytest.raises(Refused, match="D33"):
        pinned(f"host=db.test port=5432 dbname=x {option}", names={"db.test": ["10.1.2.3"]})


def test_postgres_connections_carry_no_password_file_client_certificate_or_kerberos():
    got = pinned("host=db.test port=5432 dbname=x sslmode=verify-full sslrootcert=system",
                 names={"db.test": ["10.1.2.3"]})
    assert (got["passfile"], got["sslcertmode"], got["gssencmode"]) == ("/dev/null", "disable", "disable")
    assert got["sslrootcert"] == "system"


def test_the_worker_forgets_libpqs_environment():
    from noetl_mesh.tools.postgres import forget_libpq_env

    env = {"PGPASSWORD": "worker-secret", "PGSERVICE": "x", "PGHOST": "h", "HOME": "/root", "PATH": "/bin"}
    assert sorted(forget_libpq_env(env)) == ["PGHOST", "PGPASSWORD", "PGSERVICE"]
    assert env == {"HOME": "/root", "PATH": "/bin"}


def test_postgres_hostaddr_is_checked_as_given_and_its_host_name_opens_nothing(monkeypatch):
    monkeypatch.delenv("PGPORT", raising=False)
    policy = allowing("db.internal:5432")
    with pytest.raises(Refused, match="127.0.0.1 is a loopback address"):
        pinned("host=db.internal hostaddr=127.0.0.1 port=5432 dbname=x", policy)
    assert pinned("host=db.internal hostaddr=10.0.0.7 port=5432 dbname=x", policy)["hostaddr"] == "10.0.0.7"
    # the name itself, resolved here, is what the entry opens
    assert pinned("host=db.internal port=5432", policy, {"db.internal": ["127.0.0.1"]})["hostaddr"] == "127.0.0.1"


def test_postgres_bad_lists_and_names_that_do_not_resolve():
    with pytest.raises(_BadTask, match="2 host names but 1 hostaddr values"):
        pinned("host=a,b hostaddr=10.0.0.1")
    with pytest.raises(_BadTask, match="3 ports for 2 hosts"):
        pinned("host=a,b port=1,2,3")
    with pytest.raises(_BadTask, match="not an IP address"):
        pinned("host=a hostaddr=example.com")
    with pytest.raises(_ConnectError, match="cannot resolve 'nowhere.test'"):
        pinned("host=nowhere.test dbname=x")


def test_the_postgres_tool_answers_a_refusal_with_the_sandbox_outcome():
    tool = PostgresTool()

    async def main():
        try:
            return await tool.run({"command": "select 1", "dsn": "host=127.0.0.1 port=5432 user=postgres "
                                                                  "password=pg-secret-1 dbname=postgres"}, {}, ctx())
        finally:
            await tool.close()

    out = run(main())
    assert out["status"] == "error" and out["error"]["kind"] == "sandbox" and out["error"]["retryable"] is False
    assert out["error"]["message"].startswith("postgres task refused: 127.0.0.1 is a loopback address")
    assert "pg-secret-1" not in str(out)


def test_the_policy_a_worker_logs_names_its_entries_as_they_are_written():
    p = from_env({"NOETL_SANDBOX_ALLOW_NET": "127.0.0.1:8765, [::1]:80, 10.0.0.0/8, db.internal:5432"})
    assert "allow-net 127.0.0.1:8765, [::1]:80, 10.0.0.0/8, db.internal:5432;" in p.describe()
    assert parse_destinations(", ".join(map(str, p.allow))) == p.allow  # and read back the same
