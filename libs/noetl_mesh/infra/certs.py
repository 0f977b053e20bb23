"""A development certificate authority and the certificates of a container stack (``noetl certs``).

One directory (0700) holds, each key 0600 and each certificate 0644:

| file | what | names (subject alternative names) | extended key usage |
|---|---|---|---|
| ``ca.crt``, ``ca.key`` | the authority that signs the rest; every client trusts ``ca.crt`` | — | — |
| ``nats.crt``, ``.key`` | every NATS node's client port (one certificate for all nodes: a client that found a node by its address checks it against the name of the node it first reached) | ``nats``, ``nats-2``, ``nats-3``, ``localhost``, ``127.0.0.1``, ``::1``, ``--nats-host`` and ``--host`` | server |
| ``nats-route.crt``, ``.key`` | the routes between NATS nodes, both ways: subject ``CN=noetl-nats-route``, the one identity a node accepts as a route | ``nats``, ``nats-2``, ``nats-3``, ``localhost``, ``127.0.0.1``, ``::1`` and ``--nats-host`` | server, client |
| ``postgres.crt``, ``.key`` | the Postgres server | ``postgres``, ``localhost``, ``127.0.0.1``, ``::1`` | server |
| ``gateway.crt``, ``.key`` | every gateway replica (the proxy's upstream) | ``gateway``, ``localhost``, ``127.0.0.1``, ``::1`` | server |
| ``proxy.crt``, ``.key`` | the proxy in front of the gateways: what clients see | ``proxy``, ``localhost``, ``127.0.0.1``, ``::1`` and ``--host`` | server |
| ``client-<name>.crt``, ``.key`` | ``--client NAME``: a client certificate (NATS with ``verify: true``) | — (subject ``CN=<name>``) | client |
| ``postgres.password`` | the Postgres user's password (random), read by the server and the services that connect | — | — |

Idempotent: what exists and still fits is kept. A certificate is made again when it is missing, not
signed by ``ca.crt``, lacks a name it should carry, does not match its key, or ends within
:data:`RENEW_DAYS`; a bought or company authority's files can stand in for any of them (then the
directory holds no ``ca.key``, and anything missing or unfit is an error naming the file and why).
``reader``: a uid that may read the keys the project image's services read (``gateway.key``,
``postgres.password``, the client keys): a POSIX ACL entry, as for the NATS seeds (nats_auth.grant_read).
``nats_hosts`` (``--nats-host``): other names of the NATS nodes themselves, which the nodes' routes dial
and verify as well as the clients: the StatefulSet's ``nats-0.nats``, ... in Kubernetes (deploy/k8s).
"""
from __future__ import annotations

import datetime as dt
import ipaddress
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .nats_auth import _write_private, grant_read

CA_DAYS = 3650
LEAF_DAYS = 397  # what browsers and most clients accept for a server certificate
RENEW_DAYS = 30  # a certificate that ends sooner is made again
LOCAL = ("localhost", "127.0.0.1", "::1")
NATS_NODES = ("nats", "nats-2", "nats-3")  # docker-compose.yml and deploy/docker-compose.cluster.yml
ROUTE_SUBJECT = "CN=noetl-nats-route"  # deploy/nats-cluster.conf's cluster authorization user
PASSWORD_FILE = "postgres.password"
SERVER, CLIENT = ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH


@dataclass(frozen=True)
class Leaf:
    name: str  # the files' stem
    common_name: str
    sans: tuple[str, ...]
    usages: tuple[x509.ObjectIdentifier, ...] = (SERVER,)
    readable: bool = False  # the services' uid reads its key (--reader)


def leaves(hosts: Iterable[str] = (), clients: Iterable[str] = (), nats_hosts: Iterable[str] = ()) -> list[Leaf]:
    """The certificates of a stack: ``hosts`` are extra names of the published services (NATS and the
    proxy), ``clients`` the client certificates to make, ``nats_hosts`` extra names of the NATS nodes
    (their client port and their routes: both certificates carry them)."""
    extra = tuple(dict.fromkeys(h for h in hosts if h))
    nodes = tuple(dict.fromkeys((*NATS_NODES, *(h for h in nats_hosts if h))))
    out = [Leaf("nats", "nats", tuple(dict.fromkeys((*nodes, *LOCAL, *extra)))),
           Leaf("nats-route", ROUTE_SUBJECT.split("=", 1)[1], (*nodes, *LOCAL), (SERVER, CLIENT)),
           Leaf("postgres", "postgres", ("postgres", *LOCAL)),
           Leaf("gateway", "gateway", ("gateway", *LOCAL), readable=True),
           Leaf("proxy", "proxy", ("proxy", *LOCAL, *extra))]
    for name in dict.fromkeys(clients):
        if not name or not all(c.isalnum() or c in "-_." for c in name):
            raise ValueError(f"--client {name!r}: letters, digits, '-', '_' and '.' only (a file name and a CN)")
        out.append(Leaf(f"client-{name}", name, (), (CLIENT,), readable=True))
    return out


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key) -> str:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()


def _cert_pem(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode()


def _write_public(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def make_ca(days: int = CA_DAYS) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = _new_key()
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "noetl-mesh"),
                      x509.NameAttribute(NameOID.COMMON_NAME, f"noetl-mesh development CA {secrets.token_hex(4)}")])
    now = _now()
    public = key.public_key()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .sign(key, hashes.SHA256()))
    return key, cert


def issue(leaf: Leaf, ca_key, ca_cert: x509.Certificate, days: int = LEAF_DAYS,
          key: ec.EllipticCurvePrivateKey | None = None) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A certificate for ``leaf`` signed by the authority (a new key unless ``key``)."""
    key = key or _new_key()
    now = _now()
    public = key.public_key()
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, leaf.common_name)]))
               .issuer_name(ca_cert.subject).public_key(public).serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(minutes=5))
               .not_valid_after(min(now + dt.timedelta(days=days), ca_cert.not_valid_after_utc))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                            crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.ExtendedKeyUsage(list(leaf.usages)), critical=False)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()), critical=False))
    if leaf.sans:
        builder = builder.add_extension(x509.SubjectAlternativeName([_san(n) for n in leaf.sans]), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def sans_of(cert: x509.Certificate) -> set[str]:
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {*ext.get_values_for_type(x509.DNSName), *(str(a) for a in ext.get_values_for_type(x509.IPAddress))}


def usages_of(cert: x509.Certificate) -> set[x509.ObjectIdentifier]:
    try:
        return set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    except x509.ExtensionNotFound:
        return {SERVER, CLIENT}  # no restriction


def unfit(leaf: Leaf, cert: x509.Certificate, key, ca_cert: x509.Certificate,
          renew_days: int = RENEW_DAYS) -> str | None:
    """Why an existing certificate does not do for ``leaf`` (None: it does)."""
    if cert.issuer != ca_cert.subject:
        return f"issued by {cert.issuer.rfc4514_string()}, not by ca.crt"
    try:
        cert.verify_directly_issued_by(ca_cert)
    except Exception:  # noqa: BLE001 - InvalidSignature, a key of another type
        return "not signed by ca.crt's key"
    if cert.public_key().public_numbers() != key.public_key().public_numbers():
        return "its key file holds another key"
    left = cert.not_valid_after_utc - _now()
    if left < dt.timedelta(days=renew_days):
        return f"it ends {cert.not_valid_after_utc:%Y-%m-%d} (in less than {renew_days} days)"
    missing = [n for n in leaf.sans if _canonical(n) not in sans_of(cert)]
    if missing:
        return f"it lacks the name{'s' if len(missing) > 1 else ''} {', '.join(missing)}"
    if not set(leaf.usages) <= usages_of(cert):
        return "its extended key usage lacks " + " and ".join(
            "serverAuth" if u == SERVER else "clientAuth" for u in leaf.usages if u not in usages_of(cert))
    if leaf.name == "nats-route" and cert.subject.rfc4514_string() != ROUTE_SUBJECT:
        return (f"its subject is {cert.subject.rfc4514_string()!r}, not {ROUTE_SUBJECT!r} (the route identity "
                "deploy/nats-cluster.conf accepts)")
    return None


def _canonical(name: str) -> str:
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        return name


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)

    def add(self, path: Path, what: str) -> None:
        self.lines.append(f"{path}: {what}")


def _load_key(path: Path):
    return serialization.load_pem_private_key(path.read_bytes(), password=None)


def _load_cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def ensure(directory: str | os.PathLike, *, hosts: Iterable[str] = (), clients: Iterable[str] = (),
           reader: int | None = None, days: int = LEAF_DAYS, nats_hosts: Iterable[str] = ()) -> Report:
    """Make what is missing or unfit in ``directory`` (see the module's doc); answers what was done with
    each file. ValueError: something cannot be made (no ca.key to sign with, an unreadable file)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    report = Report()
    ca_crt, ca_key_path = out / "ca.crt", out / "ca.key"
    ca_key = None
    if ca_crt.exists():
        ca_cert = _read(ca_crt, _load_cert)
        if ca_key_path.exists():
            ca_key = _read(ca_key_path, _load_key)
            if ca_key.public_key().public_numbers() != ca_cert.public_key().public_numbers():
                raise ValueError(f"{ca_key_path}: not the key of {ca_crt}")
        report.add(ca_crt, "kept")
    else:
        if ca_key_path.exists():
            raise ValueError(f"{ca_key_path} exists without {ca_crt}: remove it, or put its certificate back")
        ca_key, ca_cert = make_ca()
        _write_private(ca_key_path, _key_pem(ca_key))
        _write_public(ca_crt, _cert_pem(ca_cert))
        report.add(ca_crt, "made (a new authority: keep ca.key secret, give ca.crt to every client)")
    for leaf in leaves(hosts, clients, nats_hosts):
        crt, key_path = out / f"{leaf.name}.crt", out / f"{leaf.name}.key"
        why = "missing"
        if crt.exists() and key_path.exists():
            why = unfit(leaf, _read(crt, _load_cert), _read(key_path, _load_key), ca_cert)
        elif crt.exists() != key_path.exists():
            why = f"{'its key' if crt.exists() else 'its certificate'} is missing"
        if why is None:
            report.add(crt, "kept")
        elif ca_key is None:
            raise ValueError(f"{crt}: {why}, and there is no {ca_key_path} to sign a new one: put a certificate "
                             f"with its key there (signed by {ca_crt}; names: {', '.join(leaf.sans) or 'CN=' + leaf.common_name})")
        else:
            key, cert = issue(leaf, ca_key, ca_cert, days)
            _write_private(key_path, _key_pem(key))
            _write_public(crt, _cert_pem(cert))
            report.add(crt, "made" if why == "missing" else f"made again ({why})")
        if reader is not None and leaf.readable:
            grant_read(key_path, reader)
    password = out / PASSWORD_FILE
    if password.exists():
        report.add(password, "kept")
    else:
        _write_private(password, secrets.token_urlsafe(32) + "\n")
        report.add(password, "made (the Postgres user's password)")
    if reader is not None:
        grant_read(password, reader)
    return report


def _read(path: Path, load):
    try:
        return load(path)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise ValueError(f"{path}: not a PEM {'certificate' if path.suffix == '.crt' else 'private key'} "
                         f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
