"""The ``http`` tool (D8, D28) on one shared ``httpx.AsyncClient`` per tool instance.

Fields: ``method`` (default GET), ``url`` (alias ``endpoint``), ``params``, ``headers``, ``json``,
``body`` (alias ``data``: a string or bytes is sent as is, a mapping form-encoded, anything else as
JSON), ``timeout`` (seconds or ``{connect, read, write, pool}``; wins over ``spec.timeout``), ``auth``
(``{"type": "bearer", "token"}``, ``{"type": "basic", "username", "password"}``, ``[user, password]``,
or the name of a keychain entry holding such fields, D24).

Outcome: ``result`` is the body, parsed when the content type is ``application/json`` or ``*+json``,
else text; ``http: {status, headers}`` always. Status >= 400 is an error (``http_error``, retryable
for 408, 429 and 5xx) with the body still in ``result``. Transport failures: ``http_connect_error``
(cannot connect), ``timeout``, ``http_transport_error`` (the connection broke), all retryable; a bad
URL or auth is ``invalid_task`` (not retryable). A body over ``limits.max_result_bytes`` is
``result_too_large`` (not retryable): refused from its ``Content-Length``, else read in chunks and
abandoned as soon as it passes the limit.

Destinations (D33): every connection the client makes -- the first request's, each redirect hop's, each
retry's -- goes through :class:`_GuardedBackend`, which resolves the host itself, drops the addresses the
worker pool's policy closes (:mod:`noetl_mesh.sandbox.net`), and connects to an allowed one by address;
TLS still checks the certificate against the URL's host name. A refused connection is the outcome
``sandbox`` (not retryable), naming the address, why it is closed and how to open it. A proxy from the
worker's environment (``trust_env``: ``HTTP(S)_PROXY``, ``ALL_PROXY``, ``NO_PROXY``) is the operator's:
the connection to the proxy is checked like any other, and a target written as an address is checked
too; a target written as a name is resolved by the proxy, whose own rules apply to it.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

import httpcore
import httpx

from ..sandbox.net import Refused, Resolver, allowed_addresses, check_address, is_address
from ..sandbox.policy import Policy
from .base import ResultBudget, ResultTooLarge, ToolContext, error, ok, task_timeout, timeout_seconds

__all__ = ["HttpTool"]

DEFAULT_TIMEOUT = 30.0  # KIND_DEFAULTS["http"]["timeout"]
_RETRYABLE = frozenset({408, 429})


class _BadTask(Exception):
    pass


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def _timeout(field: Any, spec_timeout: Any) -> httpx.Timeout:
    """The task's ``timeout`` field wins over the effective spec's (D28); a mapping sets parts."""
    default = DEFAULT_TIMEOUT if isinstance(spec_timeout, Mapping) else timeout_seconds(spec_timeout, DEFAULT_TIMEOUT)
    value = field if field is not None else spec_timeout
    if isinstance(value, Mapping):
        parts = {k: timeout_seconds(value[k], default) if k in value else default
                 for k in ("connect", "read", "write", "pool")}
        return httpx.Timeout(default, **parts)
    return httpx.Timeout(timeout_seconds(value, default))


def _auth(auth: Any, keychain: Mapping[str, Any]) -> tuple[httpx.Auth | None, dict[str, str]]:
    """``(httpx auth, extra headers)`` for the task's ``auth`` field."""
    if auth is None or auth == "" or auth == {}:
        return None, {}
    if isinstance(auth, str):
        entry = keychain.get(auth) if isinstance(keychain, Mapping) else None
        if not isinstance(entry, Mapping):
            raise _BadTask(f"auth {auth!r} names no keychain entry")
        auth = entry
    if isinstance(auth, (list, tuple)):
        if len(auth) != 2:
            raise _BadTask("auth as a list must be [user, password]")
        return httpx.BasicAuth(str(auth[0]), str(auth[1])), {}
    if isinstance(auth, Mapping):
        kind = str(auth.get("type") or "").lower()
        if not kind:
            kind = "bearer" if "token" in auth else "basic" if ("username" in auth or "user" in auth) else ""
        if kind == "bearer":
            token = auth.get("token")
            if token is None:
                raise _BadTask("bearer auth needs 'token'")
            return None, {"Authorization": f"Bearer {token}"}
        if kind == "basic":
            user = auth.get("username", auth.get("user"))
            if user is None:
                raise _BadTask("basic auth needs 'username'")
            return httpx.BasicAuth(str(user), str(auth.get("password") or "")), {}
        if kind in ("header", "api_key"):
            name = auth.get("header") or auth.get("name") or "X-API-Key"
            value = auth.get("value", auth.get("key", auth.get("token")))
            if value is None:
                raise _BadTask("header auth needs 'value'")
            return None, {str(name): str(value)}
        raise _BadTask(f"unsupported auth type {kind or '(none)'!r}")
    raise _BadTask(f"unsupported auth value of type {type(auth).__name__}")


def _str_map(value: Any, what: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _BadTask(f"{what} must be a mapping, got {type(value).__name__}")
    out = {}
    for k, v in value.items():
        if v is None:
            continue
        if isinstance(v, bool):
            v = "true" if v else "false"
        elif isinstance(v, (dict, list)):
            v = json.dumps(v, separators=(",", ":"))
        out[str(k)] = str(v)
    return out


def _params(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, str):
        return value  # a query string
    if not isinstance(value, Mapping):
        raise _BadTask(f"params must be a mapping, got {type(value).__name__}")
    out: dict[str, Any] = {}
    for k, v in value.items():
        if v is None:
            continue
        if isinstance(v, bool):
            v = "true" if v else "false"
        elif isinstance(v, list):
            v = [("true" if x else "false") if isinstance(x, bool) else x for x in v]
        elif isinstance(v, dict):
            v = json.dumps(v, separators=(",", ":"))
        out[str(k)] = v
    return out


def _form(body: Mapping[str, Any]) -> dict[str, Any]:
    """A mapping body as form fields: scalars as text, lists repeated, maps as JSON text."""
    out: dict[str, Any] = {}
    for k, v in body.items():
        if v is None:
            v = ""
        elif isinstance(v, bool):
            v = "true" if v else "false"
        elif isinstance(v, dict):
            v = json.dumps(v, separators=(",", ":"))
        elif isinstance(v, list):
            v = [str(x) for x in v]
        else:
            v = str(v)
        out[str(k)] = v
    return out


# ------------------------------------------------------------------------------ destinations (D33)


class _GuardedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend with the pool's policy in front: a host is resolved here, its closed
    addresses dropped, and the connection made to an allowed address (the others in turn when it
    fails), so what is checked is what is connected to. TLS is started by httpcore afterwards with the
    URL's host name, so certificates are still checked against the name."""

    def __init__(self, policy: Policy, resolver: Resolver | None = None,
                 inner: httpcore.AsyncNetworkBackend | None = None) -> None:
        self.policy, self.resolver = policy, resolver
        self.inner = inner or httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options: Any = None) -> httpcore.AsyncNetworkStream:
        import anyio

        try:
            with anyio.fail_after(timeout):
                addresses = await allowed_addresses(self.policy, "http", host, port, self.resolver)
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"resolving {host} took more than {timeout:g}s") from None
        except OSError as e:
            raise httpcore.ConnectError(f"cannot resolve {host}: {e.strerror or e}") from None
        failure: Exception | None = None
        for address in addresses:
            try:
                return await self.inner.connect_tcp(address, port, timeout=timeout, local_address=local_address,
                                                    socket_options=socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as e:
                failure = e
        assert failure is not None
        raise failure

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Any = None) -> httpcore.AsyncNetworkStream:
        raise Refused("http", f"the unix socket {path} is local, closed to tasks on this worker pool (D33)")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


class _GuardedTransport(httpx.AsyncHTTPTransport):
    """httpx's transport on :class:`_GuardedBackend` (httpx 0.28 takes no network backend: it is set on
    the connection pool it built). Through a proxy, a target written as an address is checked too."""

    def __init__(self, backend: _GuardedBackend, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not hasattr(self._pool, "_network_backend"):  # fail closed should httpx/httpcore change
            raise RuntimeError("httpcore's connection pool has no _network_backend: the http tool cannot "
                               "check destinations with this httpcore version")
        self._pool._network_backend = backend
        self._backend, self._proxied = backend, kwargs.get("proxy") is not None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            if self._proxied and is_address(request.url.host):
                check_address(self._backend.policy, "http", request.url.host,
                              request.url.port or (443 if request.url.scheme == "https" else 80))
            return await super().handle_async_request(request)
        except Refused as e:
            e.url = str(request.url)
            raise


class _GuardedClient(httpx.AsyncClient):
    """An ``httpx.AsyncClient`` whose every transport (the direct one and each proxy's from the
    environment) connects through :class:`_GuardedBackend`."""

    def __init__(self, *, policy: Policy, resolver: Resolver | None = None, **kwargs: Any) -> None:
        self._guard = _GuardedBackend(policy, resolver)
        super().__init__(**kwargs)
        # One client serves every task of every execution: it keeps no cookie a server sets, or one
        # execution's session would go along with another's requests (a task sends its own Cookie header)
        from http.cookiejar import DefaultCookiePolicy

        self.cookies.jar.set_policy(DefaultCookiePolicy(allowed_domains=[]))

    def _init_transport(self, transport: Any = None, **kwargs: Any) -> httpx.AsyncBaseTransport:
        if transport is not None:
            raise ValueError("the http tool's client makes its own transports")
        return _GuardedTransport(self._guard, **kwargs)

    def _init_proxy_transport(self, proxy: httpx.Proxy, **kwargs: Any) -> httpx.AsyncBaseTransport:
        return _GuardedTransport(self._guard, proxy=proxy, **kwargs)


def _refused(e: Refused, url: str) -> str:
    """The task's message: the refusal, and the redirect that led there when it was one."""
    try:
        asked, got = httpx.URL(url), httpx.URL(e.url or url)
        redirect = (asked.host, asked.port, asked.scheme) != (got.host, got.port, got.scheme)
    except httpx.InvalidURL:
        redirect = False
    return f"http task refused: a redirect to {e.url}: {e.reason}" if redirect else str(e)


class HttpTool:
    """``kind: http``. One ``httpx.AsyncClient`` per instance (per event loop), closed by ``close()``."""

    kind = "http"

    def __init__(self, *, trust_env: bool = True, follow_redirects: bool = True, verify: Any = True,
                 policy: Policy | None = None, resolver: Resolver | None = None) -> None:
        """``policy``: the worker pool's (D33; default: nothing opened beyond the default), ``resolver``:
        how host names are resolved (default: the system's; tests give a stub)."""
        self._clients: dict[bool, httpx.AsyncClient] = {}  # by whether certificates are verified
        self._loop: asyncio.AbstractEventLoop | None = None
        self._opts = {"trust_env": trust_env, "follow_redirects": follow_redirects, "verify": verify,
                      "policy": policy if policy is not None else Policy(), "resolver": resolver}

    def _get_client(self, verify: bool = True) -> httpx.AsyncClient:
        """The shared client; ``verify=False``: a second one that does not check certificates (a task's
        ``verify: false``)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._clients, self._loop = {}, loop
        client = self._clients.get(verify)
        if client is None or client.is_closed:
            opts = self._opts if verify else {**self._opts, "verify": False}
            client = self._clients[verify] = _GuardedClient(**opts)
        return client

    async def run(self, task: dict, spec: dict, ctx: ToolContext) -> dict:
        url = task.get("url") or task.get("endpoint")
        method = str(task.get("method") or "GET").upper()
        try:
            if not url or not isinstance(url, str):
                raise _BadTask("http task needs 'url' (a string)")
            kwargs: dict[str, Any] = {
                "timeout": _timeout(task.get("timeout"), ctx.timeout if ctx.timeout is not None else spec.get("timeout"))
            }
            params = _params(task.get("params"))
            if params:
                kwargs["params"] = params
            headers = _str_map(task.get("headers"), "headers")
            auth, auth_headers = _auth(task.get("auth"), ctx.keychain)
            for k, v in auth_headers.items():
                if not any(h.lower() == k.lower() for h in headers):
                    headers[k] = v
            if auth is not None:
                kwargs["auth"] = auth
            body = task["body"] if "body" in task else task.get("data")
            if task.get("json") is not None:
                kwargs["json"] = task["json"]
            elif body is not None:
                if isinstance(body, (str, bytes, bytearray)):
                    kwargs["content"] = body
                elif isinstance(body, Mapping):
                    kwargs["data"] = _form(body)
                else:
                    kwargs["content"] = json.dumps(body)
                    if not any(h.lower() == "content-type" for h in headers):
                        headers["Content-Type"] = "application/json"
            if headers:
                kwargs["headers"] = headers
            if task.get("follow_redirects") is not None:
                kwargs["follow_redirects"] = _flag(task["follow_redirects"], "follow_redirects")
            client = self._get_client(_flag(task.get("verify", True), "verify"))
            ceiling, said = task_timeout(None, None)  # the timeouts above are each operation's: this, the whole's
            async with asyncio.timeout(ceiling):
                async with client.stream(method, url, **kwargs) as resp:
                    content = await _read(resp)
        except TimeoutError:  # a server that trickles its answer, or one with no timeout at all, holds a slot no longer
            return error("timeout", f"{method} {url}: not answered in full within {said}", True, http=_http(None, {}))
        except ResultTooLarge as e:
            return e.outcome(ctx, http=_http(resp.status_code, dict(resp.headers)))
        except _BadTask as e:
            return error("invalid_task", str(e), False, http=_http(None, {}))
        except Refused as e:
            return error(Refused.kind, _refused(e, url), False, http=_http(None, {}))
        except (httpx.InvalidURL, httpx.UnsupportedProtocol) as e:
            return error("invalid_task", f"bad url {url!r}: {e}", False, http=_http(None, {}))
        except httpx.TimeoutException as e:
            what = type(e).__name__
            return error("timeout", f"{method} {url}: {what}: {e or 'timed out'}", True, http=_http(None, {}))
        except httpx.ConnectError as e:
            return error("http_connect_error", f"{method} {url}: cannot connect: {e}", True, http=_http(None, {}))
        except httpx.TransportError as e:
            return error("http_transport_error", f"{method} {url}: {type(e).__name__}: {e}", True,
                         http=_http(None, {}))
        headers_out = dict(resp.headers)
        result = _body(resp, content)
        http = _http(resp.status_code, headers_out)
        status = resp.status_code
        if status >= 400:
            retryable = status in _RETRYABLE or status >= 500
            reason = resp.reason_phrase or ""
            return error("http_error", f"{method} {url} returned HTTP {status} {reason}".rstrip(), retryable,
                         result=result, http=http)
        return ok(result, http=http)

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            if not client.is_closed:
                try:
                    await client.aclose()
                except RuntimeError:  # created on an event loop that is gone
                    pass


def _flag(value: Any, name: str) -> bool:
    """A boolean task field (rendered templates give text)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise _BadTask(f"http task '{name}' is true or false, got {str(value)[:40]!r}")


async def _read(resp: httpx.Response) -> bytes:
    """The response body (decoded from its content encoding), refused from its ``Content-Length`` when
    that is over ``max_result_bytes``, else read in chunks and abandoned as soon as it passes it."""
    budget = ResultBudget("the response body")
    length = resp.headers.get("content-length")
    if length is not None and length.strip().isdigit() and int(length) > budget.limit:
        raise ResultTooLarge(int(length), "its Content-Length")
    body = bytearray()
    async for chunk in resp.aiter_bytes():
        budget.add_bytes(len(chunk))
        body += chunk
    return bytes(body)


def _body(resp: httpx.Response, content: bytes) -> Any:
    if _is_json(resp.headers.get("content-type")):
        if not content:
            return None
        try:
            return json.loads(content)
        except ValueError:
            pass
    return content.decode(resp.encoding or "utf-8", errors="replace")


def _http(status: int | None, headers: dict) -> dict:
    return {"status": status, "headers": headers}
