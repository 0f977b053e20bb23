"""TLS settings of the connections between hosts, read from the environment (docs/operations.md,
Containers: TLS). Certificates: infra/certs.py (``noetl certs``).

| setting | who reads it | what |
|---|---|---|
| ``NOETL_NATS_TLS_CA`` | every NATS client: services, ``noetl setup``/``bootstrap``/``ps``/``inspect`` | the CA file the NATS server's certificate must verify against (its name must be the URL's host) |
| ``NOETL_NATS_TLS_CERT``, ``NOETL_NATS_TLS_KEY`` | the same | a client certificate and its key, for a server that asks for one (``verify: true``) |
| ``tls://`` in ``NOETL_NATS_URL`` | the same | TLS with the system's authorities when no CA is set |
| ``NOETL_NATS_TLS_FIRST`` | the same | ``1`` (default): the TLS handshake before anything else (the server's ``handshake_first``), so a man in the middle cannot say "no TLS here"; ``0`` for a server without it |
| ``NOETL_GATEWAY_CA`` | the command line and its HTTP client (``GatewayClient``) | the CA file an ``https://`` gateway's certificate must verify against (default: the system's) |
| ``NOETL_GATEWAY_TLS_CERT``, ``NOETL_GATEWAY_TLS_KEY`` | ``noetl service gateway`` | serve HTTPS (uvicorn's TLS) with this certificate and key |
| ``NOETL_PG_PASSWORD_FILE`` | ``noetl service`` (event-recorder, credentials) | the Postgres password, kept in a file instead of ``NOETL_PG_DSN`` |

Without any of them nothing changes: the local stacks (``noetl up``, ``noetl run``) talk over loopback
in the clear. A setting that names a file that cannot be used is one line naming the setting
(:class:`TlsSettingError`); a certificate that does not verify is one line naming where and why
(:func:`verify_failure`).
"""
from __future__ import annotations

import asyncio
import os
import ssl
from typing import Any, Mapping
from urllib.parse import urlsplit

NATS_CA, NATS_CERT, NATS_KEY, NATS_FIRST = ("NOETL_NATS_TLS_CA", "NOETL_NATS_TLS_CERT", "NOETL_NATS_TLS_KEY",
                                            "NOETL_NATS_TLS_FIRST")
GATEWAY_CA, GATEWAY_CERT, GATEWAY_KEY = "NOETL_GATEWAY_CA", "NOETL_GATEWAY_TLS_CERT", "NOETL_GATEWAY_TLS_KEY"
PG_PASSWORD_FILE = "NOETL_PG_PASSWORD_FILE"
CLOSE_WAIT = 1.0  # seconds a NATS connection is given to close before it is cut (bounded_close)


class TlsSettingError(ValueError):
    """A TLS setting that cannot be used (a missing or unreadable file, not a certificate, a key without
    its certificate): a mistake in the settings, never retried."""


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror and not isinstance(exc, ssl.SSLError):
        return exc.strerror
    text = str(exc.args[1] if isinstance(exc, ssl.SSLError) and len(exc.args) > 1 else exc) or type(exc).__name__
    return text.split(" (_ssl.c")[0]


def client_context(ca: str | None, ca_setting: str, cert: str | None = None, key: str | None = None,
                   cert_settings: str = "") -> ssl.SSLContext:
    """A client's context: the server's certificate verified against ``ca`` (the system's authorities
    when None) and its name checked; ``cert``/``key``: a client certificate."""
    try:
        ctx = ssl.create_default_context(cafile=ca or None)
    except (OSError, ssl.SSLError) as exc:
        what = "cannot read the file" if isinstance(exc, OSError) and not isinstance(exc, ssl.SSLError) else \
            "not a PEM certificate"
        raise TlsSettingError(f"{ca_setting}={ca}: {what} ({_reason(exc)})") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert or key:
        if not (cert and key):
            raise TlsSettingError(f"{cert_settings}: give both (a client certificate and its key), or neither")
        try:
            ctx.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise TlsSettingError(f"{cert_settings} ({cert}, {key}): cannot load the client certificate "
                                  f"({_reason(exc)})") from None
    return ctx


def bounded_close() -> None:
    """Make nats-py's wait for a closed connection short (:data:`CLOSE_WAIT`, then the socket is cut).
    nats-py 2.16 waits for the old connection to close before it connects again; over TLS that wait
    was asyncio's SSL shutdown, which waits 30 s for the peer's close_notify: a service on a node that
    stopped answering moved to another node 30 s after its pings had given the node up (measured:
    31.5 s with pings every 0.5 s, tests/integration/test_tls.py). And a connection whose TLS upgrade
    failed (a certificate that does not verify) was waited for forever: the upgrade had replaced the
    stream's protocol, so its close was never seen, and the first connect hung instead of failing."""
    from nats.aio.transport import TcpTransport

    if getattr(TcpTransport.wait_closed, "bounded", False):
        return

    async def wait_closed(self) -> None:
        writer = self._io_writer
        if writer is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(writer.wait_closed()), CLOSE_WAIT)
        except asyncio.TimeoutError:
            for w in {writer, self._bare_io_writer} - {None}:
                w.transport.abort()

    wait_closed.bounded = True  # type: ignore[attr-defined]
    TcpTransport.wait_closed = wait_closed


def nats_options(url: str | None = None, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """nats-py's TLS options from the environment: ``{}`` when no TLS is asked for (no
    ``NOETL_NATS_TLS_*`` and no ``tls://`` URL). TLS is then required, whatever the server's first
    words say: the handshake comes first (``NOETL_NATS_TLS_FIRST``, default on)."""
    bounded_close()  # every connection of the project's code is made with these options
    env = os.environ if environ is None else environ
    ca, cert, key = env.get(NATS_CA) or None, env.get(NATS_CERT) or None, env.get(NATS_KEY) or None
    schemes = {urlsplit(u.strip()).scheme for u in (url or "").split(",") if u.strip()}
    if not (ca or cert or key or "tls" in schemes):
        return {}
    ctx = client_context(ca, NATS_CA, cert, key, f"{NATS_CERT} and {NATS_KEY}")
    first = (env.get(NATS_FIRST) or "1").strip().lower() not in ("0", "false", "no", "off")
    return {"tls": ctx, "tls_handshake_first": first}


def gateway_verify(ca: str | None = None, environ: Mapping[str, str] | None = None) -> ssl.SSLContext | bool:
    """What an HTTP client of the gateway verifies its certificate against (httpx's ``verify``): the CA
    file ``ca``, else ``NOETL_GATEWAY_CA``, else the system's authorities (True)."""
    env = os.environ if environ is None else environ
    ca = ca or env.get(GATEWAY_CA) or None
    return client_context(ca, GATEWAY_CA) if ca else True


def gateway_server(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """uvicorn's TLS options for the gateway (``NOETL_GATEWAY_TLS_CERT``/``_KEY``): ``{}`` serves HTTP.
    The files are loaded once here, so that a bad one is one line before the server starts."""
    env = os.environ if environ is None else environ
    cert, key = env.get(GATEWAY_CERT) or None, env.get(GATEWAY_KEY) or None
    if not (cert or key):
        return {}
    if not (cert and key):
        raise TlsSettingError(f"{GATEWAY_CERT} and {GATEWAY_KEY}: give both (the gateway's certificate and its key), "
                              "or neither")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise TlsSettingError(f"{GATEWAY_CERT}={cert}, {GATEWAY_KEY}={key}: cannot load them ({_reason(exc)})") from None
    return {"ssl_certfile": cert, "ssl_keyfile": key}


def pg_dsn(dsn: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """``dsn`` with the password of ``NOETL_PG_PASSWORD_FILE`` (a file holding it, one line), if set:
    the password stays out of the environment and the compose file."""
    env = os.environ if environ is None else environ
    path = env.get(PG_PASSWORD_FILE)
    if not dsn or not path:
        return dsn
    try:
        with open(path) as f:
            password = f.readline().rstrip("\r\n")
    except OSError as exc:
        raise ValueError(f"{PG_PASSWORD_FILE}={path}: cannot read ({exc.strerror or exc})") from None
    if not password:
        raise ValueError(f"{PG_PASSWORD_FILE}={path}: the file is empty")
    from psycopg.conninfo import make_conninfo

    return make_conninfo(dsn, password=password)


def is_verify_failure(exc: BaseException | None) -> bool:
    return isinstance(exc, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(exc or "")


def verify_failure(exc: BaseException, ca: str | None, ca_setting: str) -> str:
    """Why a server's certificate did not verify, and what to set: one line."""
    reason = _reason(exc)
    if "CERTIFICATE_VERIFY_FAILED" in reason:
        reason = reason.split("certificate verify failed: ", 1)[-1]
    if "Hostname mismatch" in reason or "IP address mismatch" in reason:
        fix = "connect by a name the certificate carries (noetl certs --host NAME adds one)"
    elif ca:
        fix = f"{ca_setting}={ca} did not sign it: set {ca_setting} to the CA that did"
    else:
        fix = f"set {ca_setting} to the CA file that signed it"
    return f"its certificate does not verify ({reason}): {fix}"


def handshake_failure(exc: BaseException) -> str | None:
    """A hint for a TLS handshake that failed for another reason than verification (None: not TLS)."""
    if isinstance(exc, ssl.SSLError) and not isinstance(exc, ssl.SSLCertVerificationError):
        return (f"the TLS handshake failed ({_reason(exc)}): does the server have TLS on, with handshake_first? "
                f"({NATS_FIRST}=0 for a server without it)")
    return None
