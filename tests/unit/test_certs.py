"""`noetl certs` (infra/certs.py): the CA and each certificate carry the names, key usages and validity
the stack needs, the files have safe modes, a second run keeps everything, and what no longer fits is
made again (or, without the CA's key, named). And the TLS settings' plumbing (infra/tls.py): what
nats-py, httpx, uvicorn and the Postgres DSN get from the environment, and the one-line errors."""
from __future__ import annotations

import datetime as dt
import os
import ssl
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from noetl_mesh.cli import main
from noetl_mesh.infra import certs, tls
from noetl_mesh.infra.nats_auth import connect_options

STACK = ("nats", "nats-route", "postgres", "gateway", "proxy")


def load(path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def ext(cert: x509.Certificate, cls):
    return cert.extensions.get_extension_for_class(cls)


@pytest.fixture
def made(tmp_path):
    out = tmp_path / "tls"
    report = certs.ensure(out, hosts=["noetl.example.org", "10.1.2.3"], clients=["ops"])
    return out, report


def test_the_ca_is_a_ca_and_signs_every_certificate(made):
    out, _ = made
    ca = load(out / "ca.crt")
    basic = ext(ca, x509.BasicConstraints)
    assert basic.critical and basic.value.ca and basic.value.path_length == 0
    usage = ext(ca, x509.KeyUsage)
    assert usage.critical and usage.value.key_cert_sign and usage.value.crl_sign
    assert ca.subject == ca.issuer
    assert ca.not_valid_after_utc - ca.not_valid_before_utc >= dt.timedelta(days=certs.CA_DAYS)
    for name in (*STACK, "client-ops"):
        cert = load(out / f"{name}.crt")
        cert.verify_directly_issued_by(ca)
        assert not ext(cert, x509.BasicConstraints).value.ca
        usage = ext(cert, x509.KeyUsage)
        assert usage.critical and usage.value.digital_signature and not usage.value.key_cert_sign
        aki = ext(cert, x509.AuthorityKeyIdentifier).value.key_identifier
        assert aki == ext(ca, x509.SubjectKeyIdentifier).value.digest  # strict verifiers (Python 3.13) ask for it
        days = (cert.not_valid_after_utc - cert.not_valid_before_utc).days
        assert certs.LEAF_DAYS <= days <= certs.LEAF_DAYS + 1, (name, days)


def test_each_certificate_carries_the_names_of_the_compose_stack(made):
    out, _ = made
    names = {name: certs.sans_of(load(out / f"{name}.crt")) for name in STACK}
    local = {"localhost", "127.0.0.1", "::1"}
    assert names["nats"] == {"nats", "nats-2", "nats-3", "noetl.example.org", "10.1.2.3"} | local
    assert names["nats-route"] == {"nats", "nats-2", "nats-3"} | local  # --host is for clients, not routes
    assert names["postgres"] == {"postgres"} | local
    assert names["gateway"] == {"gateway"} | local
    assert names["proxy"] == {"proxy", "noetl.example.org", "10.1.2.3"} | local
    ip = ext(load(out / "nats.crt"), x509.SubjectAlternativeName).value.get_values_for_type(x509.IPAddress)
    assert {str(a) for a in ip} == {"127.0.0.1", "::1", "10.1.2.3"}  # addresses as IP entries, not DNS names
    assert not certs.sans_of(load(out / "client-ops.crt"))
    assert load(out / "client-ops.crt").subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "ops"


K8S_NODES = ("nats-0.nats", "nats-1.nats", "nats-2.nats")  # deploy/k8s's StatefulSet, by its headless Service


def handshake(ca: Path, crt: Path, key: Path, name: str) -> None:
    """A TLS handshake in memory: a server with crt/key, a client that trusts ca and asks for name."""
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(crt, key)
    client_ctx = ssl.create_default_context(cafile=str(ca))
    pipes = [ssl.MemoryBIO() for _ in range(4)]
    client = client_ctx.wrap_bio(pipes[0], pipes[1], server_hostname=name)
    server = server_ctx.wrap_bio(pipes[2], pipes[3], server_side=True)
    for _ in range(10):
        done = 0
        for end, outgoing, incoming in ((client, pipes[1], pipes[2]), (server, pipes[3], pipes[0])):
            try:
                end.do_handshake()
                done += 1
            except ssl.SSLWantReadError:
                pass
            incoming.write(outgoing.read())
        if done == 2:
            return
    raise AssertionError("the handshake did not finish")


def test_nats_host_names_the_nodes_for_their_clients_and_their_routes(tmp_path):
    """--nats-host: the Kubernetes StatefulSet's pod names go on both NATS certificates (a route dials
    nats-1.nats and verifies that name as a client does), not on the others; a later run with a new
    name makes both again."""
    out = tmp_path / "tls"
    assert main(["certs", "--out", str(out), *(a for n in K8S_NODES for a in ("--nats-host", n))]) == 0
    for name in ("nats", "nats-route"):
        assert set(K8S_NODES) | {"nats", "nats-2", "nats-3"} <= certs.sans_of(load(out / f"{name}.crt")), name
        for node in K8S_NODES:
            handshake(out / "ca.crt", out / f"{name}.crt", out / f"{name}.key", node)
    for name in ("postgres", "gateway", "proxy"):
        assert not set(K8S_NODES) & certs.sans_of(load(out / f"{name}.crt")), name
    plain = tmp_path / "plain"
    certs.ensure(plain)
    with pytest.raises(ssl.SSLCertVerificationError, match="Hostname mismatch"):
        handshake(plain / "ca.crt", plain / "nats-route.crt", plain / "nats-route.key", "nats-1.nats")
    lines = dict(line.split(": ", 1) for line in certs.ensure(plain, nats_hosts=["nats-5.nats"]).lines)
    assert lines[str(plain / "nats.crt")] == lines[str(plain / "nats-route.crt")] == \
        "made again (it lacks the name nats-5.nats)"
    assert lines[str(plain / "proxy.crt")] == "kept"
    handshake(plain / "ca.crt", plain / "nats-route.crt", plain / "nats-route.key", "nats-5.nats")


def test_key_usages_route_identity_and_key_pairs(made):
    out, _ = made
    eku = {name: set(ext(load(out / f"{name}.crt"), x509.ExtendedKeyUsage).value) for name in (*STACK, "client-ops")}
    server, client = ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH
    assert eku["nats-route"] == {server, client}  # a route is server and client of its peers
    assert eku["client-ops"] == {client}
    assert all(eku[name] == {server} for name in ("nats", "postgres", "gateway", "proxy"))
    assert load(out / "nats-route.crt").subject.rfc4514_string() == certs.ROUTE_SUBJECT
    conf = (Path(__file__).parents[2] / "deploy" / "nats-cluster.conf").read_text()
    assert f'user: "{certs.ROUTE_SUBJECT}"' in conf  # the identity the cluster accepts is the one made
    for name in (*STACK, "client-ops"):  # each key is its certificate's, and loads where TLS is served
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(out / f"{name}.crt", out / f"{name}.key")


def test_files_have_safe_modes(made):
    out, _ = made
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o700
    for path in out.iterdir():
        mode = stat.S_IMODE(path.stat().st_mode)
        if path.suffix == ".crt":
            assert mode == 0o644, path
        else:  # keys, the CA's key, the password
            assert path.suffix in (".key", ".password") and mode == 0o600, (path, oct(mode))
    assert not list(out.glob("*.tmp"))
    password = (out / "postgres.password").read_text()
    assert password.endswith("\n") and len(password.strip()) >= 40


def test_a_second_run_keeps_everything(made):
    out, _ = made
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    report = certs.ensure(out, clients=["ops"])  # fewer --host: a certificate with more names still fits
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert all(line.endswith(": kept") for line in report.lines), report.lines


def test_what_no_longer_fits_is_made_again(made):
    out, _ = made
    ca_before = (out / "ca.crt").read_bytes()
    (out / "gateway.crt").unlink()  # a certificate without its key's pair
    report = certs.ensure(out, hosts=["noetl.example.org", "10.1.2.3", "another.example"], clients=["ops"])
    lines = dict(line.split(": ", 1) for line in report.lines)
    assert lines[str(out / "gateway.crt")] == "made again (its certificate is missing)"
    assert lines[str(out / "nats.crt")] == "made again (it lacks the name another.example)"
    assert lines[str(out / "postgres.crt")] == "kept"
    assert (out / "ca.crt").read_bytes() == ca_before
    assert "another.example" in certs.sans_of(load(out / "proxy.crt"))
    # one that ends soon, and one signed by another authority
    leaf = certs.leaves()[2]
    key, cert = certs.issue(leaf, certs._load_key(out / "ca.key"), load(out / "ca.crt"), days=10)
    (out / "postgres.key").write_text(certs._key_pem(key))
    (out / "postgres.crt").write_text(certs._cert_pem(cert))
    other_key, other_ca = certs.make_ca()
    key, cert = certs.issue(certs.leaves()[3], other_key, other_ca)
    (out / "gateway.key").write_text(certs._key_pem(key))
    (out / "gateway.crt").write_text(certs._cert_pem(cert))
    lines = dict(line.split(": ", 1) for line in certs.ensure(out).lines)
    assert lines[str(out / "postgres.crt")].startswith("made again (it ends ")
    assert lines[str(out / "gateway.crt")] == f"made again (issued by {other_ca.subject.rfc4514_string()}, not by ca.crt)"


def test_a_new_authority_in_place_makes_every_certificate_again_and_keeps_the_password(made):
    """Rotation after a leak (docs/operations.md): ca.crt and ca.key removed, the next run makes a new
    authority and every certificate again, signed by it; the Postgres password, which the database keeps,
    stays. A CA key left without its certificate, or a key that is not the certificate's, is refused."""
    out, _ = made
    old_ca, password = load(out / "ca.crt"), (out / "postgres.password").read_bytes()
    (out / "ca.crt").unlink()
    (out / "ca.key").unlink()
    lines = dict(line.split(": ", 1) for line in certs.ensure(out, clients=["ops"]).lines)
    new_ca = load(out / "ca.crt")
    assert new_ca.subject != old_ca.subject and lines[str(out / "ca.crt")].startswith("made (a new authority")
    for name in (*STACK, "client-ops"):
        assert lines[str(out / f"{name}.crt")].startswith("made again (issued by "), name
        load(out / f"{name}.crt").verify_directly_issued_by(new_ca)
    assert (out / "postgres.password").read_bytes() == password and lines[str(out / "postgres.password")] == "kept"
    (out / "ca.crt").unlink()
    with pytest.raises(ValueError, match=r"ca.key exists without .*ca.crt"):
        certs.ensure(out)
    (out / "ca.crt").write_text(certs._cert_pem(old_ca))  # a certificate, but another key beside it
    with pytest.raises(ValueError, match=r"ca.key: not the key of .*ca.crt"):
        certs.ensure(out)


def test_brought_certificates_are_checked_not_replaced(made):
    """Your own authority: ca.crt without ca.key, your certificates in place; what is missing or
    unfit is named, with what it should carry."""
    out, _ = made
    (out / "ca.key").unlink()
    assert all(line.endswith(": kept") for line in certs.ensure(out, clients=["ops"]).lines)
    (out / "postgres.crt").unlink()
    (out / "postgres.key").unlink()
    with pytest.raises(ValueError, match=r"postgres.crt: missing, and there is no .*ca.key to sign a new one: put a "
                                         r"certificate with its key there \(signed by .*ca.crt; names: postgres, "
                                         r"localhost, 127.0.0.1, ::1\)"):
        certs.ensure(out)


def test_the_command_line(tmp_path, capsys):
    assert main(["certs", "--out", str(tmp_path / "d"), "--host", "db.example", "--client", "ops"]) == 0
    out = capsys.readouterr().out
    assert f"{tmp_path / 'd' / 'ca.crt'}: made (a new authority" in out and "client-ops.crt: made" in out
    assert main(["certs", "--out", str(tmp_path / "d")]) == 0
    assert "made" not in capsys.readouterr().out
    assert main(["certs", "--out", str(tmp_path / "d"), "--client", "../x"]) == 2
    assert "--client '../x': letters, digits" in capsys.readouterr().err
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "ca.crt").write_text("not a certificate")
    assert main(["certs", "--out", str(tmp_path / "e")]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"noetl: {tmp_path / 'e' / 'ca.crt'}: not a PEM certificate")


def test_reader_gets_the_keys_the_services_read(tmp_path):
    out = tmp_path / "d"
    try:
        certs.ensure(out, reader=10001, clients=["ops"])
    except ValueError as exc:  # a file system without ACLs: nothing to check here
        pytest.skip(str(exc))
    readable = {p.name for p in out.iterdir() if "system.posix_acl_access" in os.listxattr(p)}
    assert readable == {"gateway.key", "postgres.password", "client-ops.key"}  # never ca.key, nor the servers' keys


# ------------------------------------------------------------------------------------ settings
def test_nats_options_follow_the_environment(made, tmp_path):
    out, _ = made
    assert tls.nats_options("nats://a:4222", {}) == {}
    opts = tls.nats_options("nats://a:4222", {tls.NATS_CA: str(out / "ca.crt")})
    assert isinstance(opts["tls"], ssl.SSLContext) and opts["tls_handshake_first"] is True
    assert opts["tls"].verify_mode == ssl.CERT_REQUIRED and opts["tls"].check_hostname
    assert opts["tls"].minimum_version >= ssl.TLSVersion.TLSv1_2
    assert tls.nats_options("nats://a:4222,tls://b:4222", {})["tls"].verify_mode == ssl.CERT_REQUIRED
    assert tls.nats_options("tls://b", {tls.NATS_FIRST: "0"})["tls_handshake_first"] is False
    with_client = tls.nats_options(None, {tls.NATS_CA: str(out / "ca.crt"), tls.NATS_CERT: str(out / "client-ops.crt"),
                                          tls.NATS_KEY: str(out / "client-ops.key")})
    assert with_client["tls"]
    with pytest.raises(tls.TlsSettingError, match=r"^NOETL_NATS_TLS_CA=/nowhere/ca.crt: cannot read the file "
                                                   r"\(No such file or directory\)$"):
        tls.nats_options(None, {tls.NATS_CA: "/nowhere/ca.crt"})
    (tmp_path / "junk.crt").write_text("junk")
    with pytest.raises(tls.TlsSettingError, match=r"^NOETL_NATS_TLS_CA=.*junk.crt: not a PEM certificate"):
        tls.nats_options(None, {tls.NATS_CA: str(tmp_path / "junk.crt")})
    with pytest.raises(tls.TlsSettingError, match="NOETL_NATS_TLS_CERT and NOETL_NATS_TLS_KEY: give both"):
        tls.nats_options(None, {tls.NATS_CERT: str(out / "client-ops.crt")})
    with pytest.raises(tls.TlsSettingError, match=r"cannot load the client certificate"):
        tls.nats_options(None, {tls.NATS_CERT: str(out / "client-ops.crt"), tls.NATS_KEY: str(out / "nats.key")})


def test_connect_options_add_tls_to_the_credentials(made, tmp_path, monkeypatch):
    out, _ = made
    from noetl_mesh.infra.nats_auth import NatsAuth

    seed = NatsAuth(tmp_path / "creds").ensure().for_service("router")
    monkeypatch.delenv(tls.NATS_CA, raising=False)
    assert set(connect_options(seed, "nats://x:4222")) == {"nkeys_seed_str", "inbox_prefix"}
    monkeypatch.setenv(tls.NATS_CA, str(out / "ca.crt"))
    assert set(connect_options(seed, "nats://x:4222")) == {"nkeys_seed_str", "inbox_prefix", "tls", "tls_handshake_first"}
    assert set(connect_options(None)) == {"tls", "tls_handshake_first"}


def test_gateway_settings(made):
    out, _ = made
    assert tls.gateway_verify(None, {}) is True  # the system's authorities
    ctx = tls.gateway_verify(None, {tls.GATEWAY_CA: str(out / "ca.crt")})
    assert isinstance(ctx, ssl.SSLContext) and ctx.check_hostname
    with pytest.raises(tls.TlsSettingError, match=r"^NOETL_GATEWAY_CA=/x.crt: cannot read the file"):
        tls.gateway_verify(None, {tls.GATEWAY_CA: "/x.crt"})
    assert tls.gateway_server({}) == {}
    served = tls.gateway_server({tls.GATEWAY_CERT: str(out / "gateway.crt"), tls.GATEWAY_KEY: str(out / "gateway.key")})
    assert served == {"ssl_certfile": str(out / "gateway.crt"), "ssl_keyfile": str(out / "gateway.key")}
    with pytest.raises(tls.TlsSettingError, match="give both"):
        tls.gateway_server({tls.GATEWAY_KEY: str(out / "gateway.key")})
    with pytest.raises(tls.TlsSettingError, match=r"NOETL_GATEWAY_TLS_CERT=.*gateway.crt, NOETL_GATEWAY_TLS_KEY=.*"
                                                   r"proxy.key: cannot load them"):
        tls.gateway_server({tls.GATEWAY_CERT: str(out / "gateway.crt"), tls.GATEWAY_KEY: str(out / "proxy.key")})


def test_the_cli_names_the_gateway_ca_setting(monkeypatch, capsys):
    monkeypatch.setenv(tls.GATEWAY_CA, "/nowhere/ca.crt")
    assert main(["whoami", "--gateway", "https://127.0.0.1:9"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == "noetl: NOETL_GATEWAY_CA=/nowhere/ca.crt: cannot read the file (No such file or directory)"


def test_the_postgres_password_comes_from_its_file(tmp_path):
    from psycopg.conninfo import conninfo_to_dict

    assert tls.pg_dsn("host=db dbname=x", {}) == "host=db dbname=x"
    (tmp_path / "pw").write_text("s3cret 'quoted'\n")
    dsn = tls.pg_dsn("host=db dbname=x sslmode=verify-full", {tls.PG_PASSWORD_FILE: str(tmp_path / "pw")})
    assert conninfo_to_dict(dsn) == {"host": "db", "dbname": "x", "sslmode": "verify-full", "password": "s3cret 'quoted'"}
    with pytest.raises(ValueError, match=r"^NOETL_PG_PASSWORD_FILE=/nowhere: cannot read"):
        tls.pg_dsn("host=db", {tls.PG_PASSWORD_FILE: "/nowhere"})
    (tmp_path / "empty").write_text("")
    with pytest.raises(ValueError, match="the file is empty"):
        tls.pg_dsn("host=db", {tls.PG_PASSWORD_FILE: str(tmp_path / "empty")})


def test_verify_failures_say_where_and_what_to_set():
    err = ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: unable to get "
                                          "local issuer certificate (_ssl.c:1006)")
    assert tls.verify_failure(err, None, tls.NATS_CA) == ("its certificate does not verify (unable to get local issuer "
                                                          "certificate): set NOETL_NATS_TLS_CA to the CA file that signed it")
    assert tls.verify_failure(err, "/ca.crt", tls.GATEWAY_CA).endswith(
        "NOETL_GATEWAY_CA=/ca.crt did not sign it: set NOETL_GATEWAY_CA to the CA that did")
    mismatch = ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: Hostname "
                                               "mismatch, certificate is not valid for 'db'. (_ssl.c:1006)")
    assert "Hostname mismatch" in tls.verify_failure(mismatch, "/ca.crt", tls.NATS_CA)
    assert tls.verify_failure(mismatch, "/ca.crt", tls.NATS_CA).endswith("connect by a name the certificate carries "
                                                                          "(noetl certs --host NAME adds one)")
