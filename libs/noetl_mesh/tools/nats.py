"""The ``nats`` tool (D8, D24, D33): publish, request, JetStream publish, key-value and object store
operations on a NATS server the playbook names -- never the engine's own.

Fields: ``operation`` (required, one of :data:`OPERATIONS`); ``url`` (aliases ``servers``, ``server``:
a URL, a comma-separated list or a list; ``nats://`` or ``tls://``, port 4222 by default), or the
``url`` of the ``auth`` entry; ``auth``: the name of a keychain entry (D24) with the credentials --
``user``/``username`` and ``password``, ``token``, ``nkey_seed`` (alias ``seed``) or ``creds`` (the text
of a ``.creds`` file), or NoETL's ``nats_user``, ``nats_password``, ``nats_token`` -- and optionally
``url`` (or ``nats_url``). Credentials come only from the keychain: a URL with a
user or password in it is refused. Per operation: ``subject``, ``data`` (alias ``payload``),
``headers``, ``bucket``, ``key`` (a KV key or an object's name), ``value`` (kv_put; alias of ``data``),
``stream`` (js_publish: the stream expected to store it), ``pattern`` (kv_keys: a glob the keys must
match), ``encoding`` and ``timeout``.

Payloads: ``data`` as text is sent as its UTF-8 bytes, anything else as JSON; with ``encoding: base64``
a text is decoded from base64 first. What comes back (a reply, a KV value, an object) is decoded as
UTF-8 and parsed when it is JSON (``encoding: json``, the default), kept as text (``text``) or given as
base64 (``base64``; bytes that are not UTF-8 always are).

Bounds: one connection per task, closed when it ends (with its inbox subscription: nothing is left
subscribed); the task's ``timeout`` (else ``spec.timeout``, 30 s) covers connecting and the operation,
at most ``task_max_seconds``; what is sent and what is read is at most ``max_result_bytes``
(``limit_exceeded`` before sending, ``result_too_large`` while reading: an object is refused from its
size, and the client's protocol reader holds no message bigger than the limit (or 1 MiB, NATS's
default ``max_payload``, when the limit is smaller) -- a server that sends one, whatever its
``max_payload`` says, has the connection closed on it).

Destinations (D33): each server's host is resolved here and every address checked with the worker
pool's policy (:mod:`noetl_mesh.sandbox.net`); the client is given the checked addresses only (TLS
still checks the certificate against the host name), does not reconnect, and so never dials the
servers a cluster announces (``connect_urls``). The engine's own NATS servers are refused whatever the
allow-list says. A refusal is ``sandbox`` (not retryable).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import fnmatch
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from .. import limits
from ..core.keychain import masker
from ..sandbox.net import Refused, Resolver, allowed_addresses, is_address
from ..sandbox.policy import Policy
from .base import ResultTooLarge, ToolContext, bounded, error, json_size, ok, timeout_seconds

__all__ = ["NatsTool", "OPERATIONS", "parse", "encode", "decode", "Request"]

DEFAULT_TIMEOUT = 30.0  # KIND_DEFAULTS["nats"]["timeout"]
CONNECT_TIMEOUT = 10.0  # the most one server's connection may take (within the task's timeout)
READER_FLOOR = 1024 * 1024  # the reader holds at least NATS's default max_payload (JetStream's API answers)
DEFAULT_PORT = 4222

# operation -> the fields it needs
OPERATIONS: dict[str, tuple[str, ...]] = {
    "publish": ("subject",),
    "request": ("subject",),
    "js_publish": ("subject",),
    "kv_get": ("bucket", "key"),
    "kv_put": ("bucket", "key", "data"),
    "kv_delete": ("bucket", "key"),
    "kv_keys": ("bucket",),
    "object_get": ("bucket", "key"),
    "object_put": ("bucket", "key", "data"),
    "object_delete": ("bucket", "key"),
}
ENCODINGS = ("json", "text", "base64")
# a keychain entry's fields, each with its names (NoETL's nats_* spellings too)
_SECRET = {
    "user": ("user", "username", "nats_user"),
    "password": ("password", "nats_password"),
    "token": ("token", "nats_token"),
    "seed": ("nkey_seed", "nkeys_seed", "seed"),
    "creds": ("creds",),
}
_URL = ("url", "servers", "server", "nats_url")


class _BadTask(Exception):
    pass


@dataclass(frozen=True)
class Server:
    """One server of the task: ``scheme`` (``nats`` or ``tls``), ``host`` as written, ``port``."""

    scheme: str
    host: str
    port: int

    def url(self, address: str) -> str:
        where = f"[{address}]" if ":" in address else address
        return f"{self.scheme}://{where}:{self.port}"

    def __str__(self) -> str:
        return self.url(self.host)


@dataclass(frozen=True)
class Request:
    """A task read and checked (:func:`parse`): what to connect to, as whom, and what to do."""

    operation: str
    servers: tuple[Server, ...]
    credentials: Mapping[str, Any] = field(default_factory=dict)  # nats-py connect() keywords
    subject: str | None = None
    bucket: str | None = None
    key: str | None = None
    payload: bytes = b""
    headers: Mapping[str, str] | None = None
    stream: str | None = None
    pattern: str | None = None
    encoding: str = "json"
    timeout: float | None = None

    def secrets(self) -> list[str]:
        """The credential values an error message must not show."""
        return [str(v) for k, v in self.credentials.items() if k != "user" and v]


# ------------------------------------------------------------------------------------------ parse


def _servers(value: Any, where: str) -> tuple[Server, ...]:
    items = value if isinstance(value, (list, tuple)) else str(value).split(",") if isinstance(value, str) else None
    if items is None:
        raise _BadTask(f"{where} must be a URL, a comma-separated list or a list, got {type(value).__name__}")
    out: list[Server] = []
    for raw in items:
        text = str(raw).strip()
        if not text:
            continue
        try:
            parts = urlsplit(text if "://" in text else f"nats://{text}")
            port = parts.port or DEFAULT_PORT
        except ValueError:
            raise _BadTask(f"{where}: {text[:100]!r} is not a server URL") from None
        if parts.scheme not in ("nats", "tls"):
            raise _BadTask(f"{where}: {text[:100]!r}: the scheme must be nats:// or tls://")
        if parts.username or parts.password:
            raise _BadTask(f"{where}: a server URL may not carry a user or password: put the credentials in a "
                           "keychain entry and name it with 'auth' (D24)")
        if not parts.hostname or parts.path not in ("", "/") or parts.query:
            raise _BadTask(f"{where}: {text[:100]!r} is not host:port")
        out.append(Server(parts.scheme, parts.hostname, port))
    if not out:
        raise _BadTask(f"{where} names no server")
    return tuple(out)


def _credentials(auth: Any, keychain: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
    """(nats-py's connect keywords, the entry's url or None) of the keychain entry ``auth`` names."""
    if auth in (None, ""):
        return {}, None
    if not isinstance(auth, str):
        raise _BadTask("'auth' must name a keychain entry (D24): credentials come from the keychain only")
    entry = keychain.get(auth) if isinstance(keychain, Mapping) else None
    if not isinstance(entry, Mapping):
        raise _BadTask(f"auth {auth!r} names no keychain entry")
    for nested in ("data", "value", "values"):  # entries may keep their fields one level down
        if not any(k in entry for names in (*_SECRET.values(), _URL) for k in names) \
                and isinstance(entry.get(nested), Mapping):
            entry = entry[nested]
    where = f"auth {auth!r}"
    found: dict[str, str] = {}  # user, password, token, seed, creds -> the entry's value
    for field_, names in _SECRET.items():
        for k in names:
            v = entry.get(k)
            if v in (None, ""):
                continue
            if not isinstance(v, str):
                raise _BadTask(f"{where}: {k!r} must be text, got {type(v).__name__}")
            found.setdefault(field_, v)
    given = [name for name, keys in (("user/password", ("user", "password")), ("token", ("token",)),
                                     ("nkey_seed", ("seed",)), ("creds", ("creds",))) if any(k in found for k in keys)]
    if len(given) > 1:
        raise _BadTask(f"{where} gives {' and '.join(given)}: give one way to authenticate")
    out: dict[str, Any] = {}
    if "user" in found or "password" in found:
        if "user" not in found or "password" not in found:
            raise _BadTask(f"{where}: a user needs a password and a password a user")
        out = {"user": found["user"], "password": found["password"]}
    elif "token" in found:
        out = {"token": found["token"]}
    elif "seed" in found:
        out = {"nkeys_seed_str": found["seed"]}
    elif "creds" in found:
        out = {"user_credentials": found["creds"]}
    return out, next((entry[k] for k in _URL if entry.get(k) not in (None, "")), None)


def encode(data: Any, encoding: str) -> bytes:
    """The bytes sent for ``data``: text as UTF-8 (decoded from base64 with ``encoding: base64``),
    bytes as they are, None as nothing, anything else as compact JSON."""
    if data is None:
        return b""
    if isinstance(data, (bytes, bytearray)):
        return bytes(data)
    if isinstance(data, str):
        if encoding == "base64":
            try:
                return base64.b64decode(data, validate=True)
            except (binascii.Error, ValueError):
                raise _BadTask("'data' is not base64 (encoding: base64)") from None
        return data.encode()
    try:
        return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()
    except (TypeError, ValueError) as e:
        raise _BadTask(f"'data' cannot be sent as JSON: {e}") from None


def decode(raw: bytes, encoding: str) -> Any:
    """What a task gets for bytes it read: base64 (``encoding: base64``, or bytes that are not UTF-8),
    else the text, parsed when it is JSON and ``encoding`` is ``json``; None for no bytes."""
    if not raw:
        return None
    if encoding != "base64":
        try:
            text = raw.decode()
        except UnicodeDecodeError:
            pass
        else:
            if encoding == "json":
                try:
                    return json.loads(text)
                except ValueError:
                    pass
            return text
    return base64.b64encode(raw).decode("ascii")


def _text(task: Mapping[str, Any], name: str) -> str | None:
    value = task.get(name)
    if value in (None, ""):
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise _BadTask(f"'{name}' must be text, got {type(value).__name__}")
    text = str(value)
    if any(c.isspace() for c in text) and name != "key":
        raise _BadTask(f"'{name}' {text[:100]!r} has white space")
    return text


def parse(task: Mapping[str, Any], keychain: Mapping[str, Any] | None = None) -> Request:
    """The :class:`Request` of a rendered task, or ``_BadTask`` saying which field is wrong and why."""
    operation = task.get("operation")
    if operation not in OPERATIONS:
        raise _BadTask(f"nats task needs 'operation', one of {', '.join(OPERATIONS)}"
                       + (f"; got {str(operation)[:60]!r}" if operation not in (None, "") else ""))
    credentials, entry_url = _credentials(task.get("auth"), keychain or {})
    url = next((task[k] for k in ("url", "servers", "server") if task.get(k) not in (None, "", [])), None)
    if url is None and entry_url is None:
        raise _BadTask("nats task needs 'url' (alias 'servers'): the server to connect to, or an 'auth' "
                       "keychain entry that gives one")
    if url is not None:
        servers = _servers(url, "'url'")
    else:
        servers = _servers(entry_url, f"auth {task['auth']!r}: 'url'")
    encoding = task.get("encoding") or "json"
    if encoding not in ENCODINGS:
        raise _BadTask(f"'encoding' must be one of {', '.join(ENCODINGS)}, got {str(encoding)[:40]!r}")
    data = task.get("data", task.get("payload"))
    if operation == "kv_put" and data is None:
        data = task.get("value")
    fields = {"subject": _text(task, "subject"), "bucket": _text(task, "bucket"), "key": _text(task, "key"),
              "data": data}
    missing = [f for f in OPERATIONS[operation] if fields[f] is None]
    if missing:
        raise _BadTask(f"nats {operation} needs {' and '.join(repr(m) for m in missing)}")
    headers = task.get("headers")
    if headers is not None:
        if not isinstance(headers, Mapping):
            raise _BadTask(f"'headers' must be a mapping, got {type(headers).__name__}")
        headers = {str(k): v if isinstance(v, str) else json.dumps(v, separators=(",", ":"))
                   for k, v in headers.items() if v is not None}
    timeout = task.get("timeout")
    if timeout is not None and timeout_seconds(timeout, None) is None and timeout not in (0, "0"):
        raise _BadTask(f"'timeout' must be seconds, got {str(timeout)[:40]!r}")
    sends = operation in ("publish", "request", "js_publish", "kv_put", "object_put")
    payload = encode(data, encoding) if sends else b""
    limit = limits.current().max_result_bytes
    if len(payload) > limit:
        raise limits.LimitExceeded("max_result_bytes", len(payload), what=f"the data of a nats {operation}")
    return Request(operation=operation, servers=servers, credentials=credentials, subject=fields["subject"],
                   bucket=fields["bucket"], key=fields["key"], payload=payload, headers=headers or None,
                   stream=_text(task, "stream"), pattern=_text(task, "pattern"), encoding=encoding, timeout=timeout_seconds(timeout, None))


def task_seconds(request: Request, spec_timeout: Any) -> tuple[float, str]:
    """The task's deadline: its ``timeout`` field, else ``spec.timeout`` (30 s), at most
    ``task_max_seconds``; and how to say it."""
    ceiling = float(limits.current().task_max_seconds)
    seconds = request.timeout if request.timeout is not None else timeout_seconds(spec_timeout, DEFAULT_TIMEOUT)
    if seconds is None or seconds > ceiling:
        return ceiling, f"{ceiling:g}s (task_max_seconds, NOETL_LIMIT_TASK_MAX_SECONDS)"
    return seconds, f"{seconds:g}s"


# ------------------------------------------------------------------------------------- operations


def _check_size(n: int, read: str) -> None:
    if n > limits.current().max_result_bytes:
        raise ResultTooLarge(n, read)


def _bounded_client(limit: int) -> Any:
    """A nats-py client whose protocol reader holds at most ``limit`` bytes (plus a control line) at a
    time: a message the server announces bigger than that -- a reply, a KV value, an object chunk, from
    a server that ignores its own ``max_payload`` -- closes the connection instead of being buffered;
    ``client.overflowed`` then says so, and ``client.gone`` is set when the connection closes. (nats-py
    reads into ``client._ps``, made once per client.)"""
    from nats.aio.client import Client
    from nats.errors import ProtocolError
    from nats.protocol.parser import MAX_CONTROL_LINE_SIZE, Parser

    class BoundedParser(Parser):
        async def parse(self, data: bytes = b"") -> None:
            if len(self.buf) + len(data) > limit + MAX_CONTROL_LINE_SIZE:
                client.overflowed = True
                raise ProtocolError
            await super().parse(data)

    client = Client()
    client.overflowed = False
    client.gone = asyncio.Event()
    client._ps = BoundedParser(client)
    return client


async def _close(nc: Any) -> None:
    """Close a task's connection (its inbox subscription with it), whatever state it is in."""
    try:
        await asyncio.shield(nc.close())
    except Exception:  # noqa: BLE001 - the connection is gone either way
        pass


class _Budget:
    """A writer for an object's chunks that stops past ``max_result_bytes``."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.size = 0

    def write(self, chunk: bytes) -> int:
        self.size += len(chunk)
        if self.size > limits.current().max_result_bytes:
            raise ResultTooLarge(None, "the object's chunks")
        self.chunks.append(bytes(chunk))
        return len(chunk)


def _reply(r: Request, msg: Any) -> dict:
    _check_size(len(msg.data), "the reply")
    return {"subject": r.subject, "data": decode(msg.data, r.encoding), "headers": dict(msg.headers or {})}


async def _operate(nc: Any, r: Request, seconds: float) -> dict:
    import nats.js.errors as jse

    op = r.operation
    if op == "publish":
        await nc.publish(r.subject, r.payload, headers=r.headers)
        await nc.flush(timeout=seconds)
        return {"subject": r.subject, "bytes": len(r.payload)}
    if op == "request":
        return _reply(r, await nc.request(r.subject, r.payload, timeout=seconds, headers=r.headers))
    js = nc.jetstream(timeout=seconds)
    if op == "js_publish":
        ack = await js.publish(r.subject, r.payload, timeout=seconds, stream=r.stream, headers=r.headers)
        return {"stream": ack.stream, "seq": ack.seq, "duplicate": bool(ack.duplicate)}
    if op.startswith("kv_"):
        kv = await js.key_value(r.bucket)
        if op == "kv_get":
            entry = await kv.get(r.key)
            _check_size(len(entry.value or b""), "the value")
            return {"bucket": r.bucket, "key": r.key, "value": decode(entry.value or b"", r.encoding),
                    "revision": entry.revision}
        if op == "kv_put":
            return {"bucket": r.bucket, "key": r.key, "revision": await kv.put(r.key, r.payload)}
        if op == "kv_delete":
            await kv.delete(r.key)
            return {"bucket": r.bucket, "key": r.key}
        try:
            keys = sorted(await kv.keys())
        except jse.NoKeysError:
            keys = []
        if r.pattern is not None:
            keys = [k for k in keys if fnmatch.fnmatchcase(k, r.pattern)]
        _check_size(json_size(keys), "the keys")
        return {"bucket": r.bucket, "keys": keys, "count": len(keys)}
    obs = await js.object_store(r.bucket)
    if op == "object_get":
        info = await obs.get_info(r.key)
        _check_size(info.size or 0, "the object")
        sink = _Budget()
        await obs.get(r.key, writeinto=sink)
        raw = b"".join(sink.chunks)
        return {"bucket": r.bucket, "key": r.key, "data": decode(raw, r.encoding), "size": len(raw),
                "digest": info.digest}
    if op == "object_put":
        info = await obs.put(r.key, r.payload)
        return {"bucket": r.bucket, "key": r.key, "size": info.size, "digest": info.digest}
    await obs.delete(r.key)
    return {"bucket": r.bucket, "key": r.key}


# ------------------------------------------------------------------------------------------- errors


def _outcome_of(e: BaseException, r: Request, where: str) -> dict:
    """The error outcome of an exception of nats-py, its message masked."""
    import nats.errors as ne
    import nats.js.errors as jse

    target = (f"subject {r.subject!r}" if r.subject else f"bucket {r.bucket!r}"
              + (f" key {r.key!r}" if r.key else ""))
    said = (getattr(e, "description", None) or str(e) or type(e).__name__).strip()
    text = f"nats {r.operation} on {where}, {target}: "
    if isinstance(e, ne.NoRespondersError):
        return error("nats_no_responders", text + "no responders (nothing is subscribed to that subject)", True)
    if isinstance(e, jse.NoStreamResponseError):
        return error("nats_no_responders", text + "no stream stores that subject", False)
    if isinstance(e, (jse.KeyNotFoundError, jse.KeyDeletedError)):
        return error("nats_not_found", text + "no such key", False)
    if isinstance(e, (jse.ObjectNotFoundError, jse.ObjectDeletedError)):
        return error("nats_not_found", text + "no such object", False)
    if isinstance(e, jse.BucketNotFoundError):
        return error("nats_not_found", text + "no such bucket", False)
    if isinstance(e, jse.NotFoundError):
        return error("nats_not_found", text + said, False)
    if isinstance(e, (ne.TimeoutError, asyncio.TimeoutError, TimeoutError)):
        return error("nats_timeout", text + "no answer in time", True)
    if isinstance(e, (ne.MaxPayloadError,)):
        return error("limit_exceeded", text + f"the data is over the server's max_payload ({said})", False)
    if isinstance(e, (jse.ServiceUnavailableError, jse.ServerError)):
        return error("nats_error", text + said, True)
    if isinstance(e, (ne.BadSubjectError, jse.InvalidKeyError, jse.InvalidBucketNameError,
                      jse.InvalidObjectNameError, ne.BadHeaderError)):
        return error("invalid_task", text + said, False)
    return error("nats_error", text + f"{type(e).__name__}: {said}", False)


class _Failed(Exception):
    """The operation failed: ``outcome`` is the task's error outcome."""

    def __init__(self, outcome: dict):
        super().__init__(outcome["error"]["message"])
        self.outcome = outcome


class _ConnectError(Exception):
    def __init__(self, message: str, auth: bool = False):
        super().__init__(message)
        self.auth = auth


# --------------------------------------------------------------------------------------------- tool


class NatsTool:
    """``kind: nats``: one connection per task to the servers the task names (D33)."""

    kind = "nats"

    def __init__(self, *, policy: Policy | None = None, resolver: Resolver | None = None,
                 connect_timeout: float = CONNECT_TIMEOUT) -> None:
        """``policy``: the worker pool's (D33; default: nothing opened beyond the default); ``resolver``:
        how host names are resolved (default: the system's; tests give a stub)."""
        self._policy = policy if policy is not None else Policy()
        self._resolver = resolver
        self._connect_timeout = connect_timeout

    async def _checked(self, r: Request) -> list[tuple[Server, str]]:
        """Every (server, address) the task may connect to, in order; Refused when none is left (the first
        refusal), _ConnectError when no name resolves."""
        out: list[tuple[Server, str]] = []
        first: Exception | None = None
        for server in r.servers:
            try:
                for address in await allowed_addresses(self._policy, "nats", server.host, server.port, self._resolver):
                    out.append((server, address))
            except (Refused, OSError) as e:
                first = first or e
        if out:
            return out
        if isinstance(first, OSError):
            raise _ConnectError(f"cannot resolve {r.servers[0].host!r}: {first.strerror or first}")
        assert first is not None
        raise first

    async def _connect(self, r: Request, seconds: float) -> tuple[Any, str]:
        """A connection to the first checked address that answers, and its ``host:port`` as the task
        wrote it. The client dials only that address and never reconnects, so servers a cluster
        announces are never dialed."""
        import nats.errors as ne
        from nats.aio.client import RawCredentials

        keywords = dict(r.credentials)
        if "user_credentials" in keywords:
            keywords["user_credentials"] = RawCredentials(keywords["user_credentials"])
        failure = "no server answered"
        for server, address in await self._checked(r):
            nc = _bounded_client(max(limits.current().max_result_bytes, READER_FLOOR))
            said: list[BaseException] = []

            async def noted(e: BaseException) -> None:
                said.append(e)

            async def quiet() -> None:
                return None

            async def closed(client: Any = nc) -> None:
                client.gone.set()

            hostname = None if is_address(server.host) else server.host
            try:
                await nc.connect(
                    servers=[server.url(address)], allow_reconnect=False, max_reconnect_attempts=1,
                    reconnect_time_wait=0, dont_randomize=True, no_echo=True, name="noetl-task",
                    connect_timeout=max(1, int(min(self._connect_timeout, seconds))),
                    tls_hostname=hostname, error_cb=noted, disconnected_cb=quiet, closed_cb=closed,
                    discovered_server_cb=quiet, **keywords)
            except (OSError, ne.Error, asyncio.TimeoutError) as e:
                await _close(nc)
                cause = next((x for x in said if not isinstance(x, ne.NoServersError)), e)
                text = (getattr(cause, "description", None) or str(cause) or type(cause).__name__).strip()
                if "authorization" in text.lower() or "authentication" in text.lower():
                    raise _ConnectError(f"{server}: the server refused the credentials ({text})", auth=True) from None
                failure = f"{server} ({address}): {text}"
                continue
            connected = nc.connected_url
            if connected is None or connected.hostname.strip("[]") != address:  # pragma: no cover - nats-py's pool
                await nc.close()
                raise Refused("nats", f"the client connected to {connected} instead of the checked {address}")
            nc.said = said
            return nc, str(server)
        raise _ConnectError(failure)

    async def _work(self, r: Request, seconds: float) -> dict:
        nc, where = await self._connect(r, seconds)
        try:
            op = asyncio.ensure_future(_operate(nc, r, seconds))
            gone = asyncio.ensure_future(nc.gone.wait())
            try:
                await asyncio.wait({op, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
                if not op.done():  # the connection closed under it (or this task is cancelled)
                    op.cancel()
                    await asyncio.wait({op})
            if nc.overflowed:
                raise ResultTooLarge(None, "a message the server sent")
            if op.cancelled():
                last = next((f": {e}" for e in reversed(nc.said) if str(e)), "")
                raise _Failed(error("nats_error", f"nats {r.operation} on {where}: the server closed the "
                                                  f"connection{last}", True))
            try:
                return op.result()
            except (ResultTooLarge, Refused):
                raise
            except Exception as e:  # noqa: BLE001 - nats-py's errors, sorted by _outcome_of
                raise _Failed(_outcome_of(e, r, where)) from None
        finally:
            await _close(nc)

    async def run(self, task: dict, spec: dict, ctx: ToolContext) -> dict:
        try:
            r = parse(task, ctx.keychain or {})
        except _BadTask as e:
            return error("invalid_task", f"step {ctx.step!r}, task {ctx.task_name!r}: {e}")
        except limits.LimitExceeded as e:
            return error("limit_exceeded", f"step {ctx.step!r}, task {ctx.task_name!r}: {e}")
        seconds, said = task_seconds(r, ctx.timeout if ctx.timeout is not None else spec.get("timeout"))
        hide = masker(r.secrets()).text
        how, work = await bounded(self._work(r, seconds), ctx.cancel, seconds + 1)
        if how == "cancelled":
            return error("cancelled", "nats task cancelled")
        if how == "timeout":
            return error("nats_timeout", f"nats {r.operation}: the task passed its timeout of {said}", True)
        try:
            return ok(work.result())
        except _Failed as e:
            e.outcome["error"]["message"] = hide(e.outcome["error"]["message"])
            return e.outcome
        except ResultTooLarge as e:
            return e.outcome(ctx)
        except Refused as e:
            return error(Refused.kind, hide(str(e)))
        except _ConnectError as e:
            return error("nats_auth_error" if e.auth else "nats_connect_error",
                         hide(f"nats {r.operation}: cannot connect: {e}"), not e.auth)
        except Exception as e:  # noqa: BLE001 - e.g. a credential nats-py cannot read
            return error("nats_error", hide(f"nats {r.operation}: {type(e).__name__}: {e}"))
