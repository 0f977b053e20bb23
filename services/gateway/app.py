"""gateway: the HTTP API, a thin shell over NATS.

Reads are request/reply calls to the event-recorder (``noetl.q.*``); commands are events published to
JetStream (``playbook.execution.requested``, ``execution.cancelled``). The gateway keeps no state and
owns no database: any number of replicas can run behind a load balancer.

Hostile input. Every request passes :class:`_Guard` first: a request id (``X-Request-ID``), NUL in
the URL refused, and the body bounded by ``max_body_bytes`` (Content-Length checked before anything is
read, then a running count while a chunked body arrives: 413 naming the limit). A JSON body is parsed
strictly by :func:`body.parse_json` before pydantic sees it (depth, 64-bit integers, NaN, NUL and
unpaired surrogates refused with their location), through the dependency :func:`json_body`: a route
takes its body as ``body: Model = json_body(Model)``. CPU-heavy work (a big body, a playbook's parse
and validation) runs in a thread, two at a time, so the event loop keeps answering.

Errors have one shape, ``{"detail": {"message": str, "location": str | null, "errors": [...]}}``
(``errors``: one item per problem found in the input, each with ``location`` and ``message``), and a
client's mistake is never a 5xx:

| cause | status |
|---|---|
| malformed JSON, undecodable bytes, NUL in the URL; recorder ``bad_request`` | 400 |
| no token, or one the sessions service refuses; ``unauthenticated`` | 401 + ``WWW-Authenticate: Bearer`` |
| the caller's roles lack the route's permission; ``forbidden`` | 403 |
| recorder ``not_found`` | 404 |
| recorder ``conflict``; cancelling a finished execution | 409 |
| a payload reference past its retention | 410 |
| body over ``max_body_bytes``, workload over ``max_workload_bytes``; recorder ``too_large`` | 413 |
| a body that is not JSON (or not YAML where YAML is allowed) | 415 |
| invalid fields, depth, numbers, NUL, surrogates; an invalid playbook | 422 |
| sessions ``locked`` (too many failed logins) | 429 + ``Retry-After`` |
| NATS disconnected or reconnecting; recorder or sessions ``unavailable`` / ``timeout`` | 503 + ``Retry-After`` |
| another recorder error kind | 502 |
| anything else: a bug | 500 with ``request_id`` (logged with it) |

Access control (:mod:`.auth`, docs/security.md "The gateway"): every route declares one permission
(``who: dict = need("catalog.read")``, its first parameter, so an unauthenticated request is refused
before its body is read), or ``need(SIGNED_IN)`` / ``need(PUBLIC)``; :func:`auth.check_declarations`
refuses to build an app with a route that declares none. The caller's principal comes from the sessions
service (``noetl.q.sessions.validate``, cached at most 1 s per token, dropped at once on
``noetl.sessions.revoked``); sessions errors map as: ``unauthenticated`` 401 (with
``WWW-Authenticate: Bearer``), ``forbidden`` 403, ``locked`` 429 and ``unavailable`` 503 (both with
``Retry-After``). The routes under ``/api/auth``, ``/api/sessions``, ``/api/users``, ``/api/tokens``
and ``/api/audit`` are thin maps onto the sessions service's subjects, with the caller's principal and
address added to each request.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import secrets
import time
from datetime import datetime, timezone
from typing import Annotated, Any, Callable, Literal, TypeVar

import nats.errors
import orjson
import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, RootModel, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException

from noetl_mesh import limits
from noetl_mesh.core import restart
from noetl_mesh.core.events import cancel_requested, execution_requested, make_event, new_execution_id
from noetl_mesh.core.state import FINAL
from noetl_mesh.infra import bounded, metrics, micro, tracing
from noetl_mesh.infra.nats_auth import READY_SERVICES
from noetl_mesh.infra.payloads import MARKER, OverBudget, PayloadMissing, is_ref
from noetl_mesh.infra.bus import (
    Q_CATALOG_GET,
    Q_CATALOG_LIST,
    Q_CATALOG_REGISTER,
    Q_CREDENTIAL_DELETE,
    Q_CREDENTIAL_ROLES,
    Q_CREDENTIAL_GET,
    Q_CREDENTIAL_LIST,
    Q_CREDENTIAL_PUT,
    Q_EXECUTION_EVENTS,
    Q_EXECUTION_GET,
    Q_EXECUTION_LIST,
    Q_EXECUTION_SEED,
    Q_EXECUTION_WAITS,
    Q_RECORDER_PING,
    Bus,
    BusError,
    dumps,
)
from noetl_mesh.contracts import refs
from noetl_mesh.contracts.subjects import STATUS_OF_KIND
from noetl_mesh.lang.validate import parse_and_validate, parse_yaml
from noetl_mesh.limits import LimitExceeded
from noetl_mesh.core import access, signals
from noetl_mesh.core import credentials as credential_rules
from noetl_mesh.services.gateway import auth
from noetl_mesh.services.gateway.auth import PUBLIC, SIGNED_IN, need
from noetl_mesh.services.gateway.body import INT64_MAX, BodyError, decode_utf8, location, parse_json
from noetl_mesh.services.gateway.docs import mount as mount_docs
from noetl_mesh.services.sessions import service as sessions


log = logging.getLogger("noetl.gateway")

YAML_TYPES = ("application/x-yaml", "application/yaml", "text/yaml", "text/x-yaml", "text/plain")
SOURCES = ("path", "catalog_id", "playbook")
RETRY_AFTER = {"Retry-After": "1"}  # seconds: NATS reconnects every 0.5 s
CLOSE = {"Connection": "close"}  # after a 413: the server closes instead of reading the rest of the body
NATS_TIMEOUT = 10.0  # seconds for a query's reply or a publish's acknowledgement
HEAVY_BYTES = 64 * 1024  # bodies from this size are parsed and validated in a thread
T = TypeVar("T")


# --------------------------------------------------------------------------------- request bodies
class CatalogRegistration(BaseModel):
    model_config = ConfigDict(extra="forbid")
    content: str = Field(description="the playbook's YAML text")


class ExecutionRequest(BaseModel):
    """Start an execution of exactly one of: a catalog ``path`` (latest, or ``version``), a
    ``catalog_id``, or an inline ``playbook`` (YAML text or the parsed mapping)."""

    model_config = ConfigDict(extra="forbid")
    path: str | None = Field(None, max_length=1024)
    version: int | None = Field(None, ge=1, le=INT64_MAX)
    catalog_id: int | None = Field(None, ge=0, le=INT64_MAX)
    playbook: str | dict[str, Any] | None = None
    workload: dict[str, Any] | None = None
    parent_execution_id: str | None = Field(None, max_length=128)

    @model_validator(mode="wrap")
    @classmethod
    def _exactly_one_source(cls, data: Any, handler: Any) -> "ExecutionRequest":
        # wrap, so that a missing or doubled source is listed together with the field errors
        problems: list[InitErrorDetails] = []
        if isinstance(data, dict):
            given = [k for k in SOURCES if data.get(k) is not None]
            if len(given) != 1:
                problems.append(InitErrorDetails(
                    type=PydanticCustomError(
                        "exactly_one_source", "give exactly one of path, catalog_id or playbook (got {got})",
                        {"got": ", ".join(given) or "none"}),
                    loc=(), input=data))
            if data.get("version") is not None and data.get("path") is None:
                problems.append(InitErrorDetails(
                    type=PydanticCustomError("version_without_path", "version goes with path"),
                    loc=("version",), input=data.get("version")))
        try:
            result = handler(data)
        except ValidationError as exc:
            raise ValidationError.from_exception_data(
                cls.__name__, [*_init_errors(exc), *problems]) from None
        if problems:
            raise ValidationError.from_exception_data(cls.__name__, problems)
        return result


def _init_errors(exc: ValidationError) -> list[InitErrorDetails]:
    out: list[InitErrorDetails] = []
    for err in exc.errors(include_url=False):
        detail: dict[str, Any] = {"type": err["type"], "loc": err["loc"], "input": err.get("input")}
        if err.get("ctx"):
            detail["ctx"] = err["ctx"]
        if err["type"] not in _BUILTIN_TYPES:
            detail["type"] = PydanticCustomError(err["type"], err["msg"])
            detail.pop("ctx", None)
        out.append(detail)  # type: ignore[arg-type]
    return out


try:
    from pydantic_core.core_schema import ErrorType  # the built-in error types

    _BUILTIN_TYPES = set(getattr(ErrorType, "__args__", ()))
except ImportError:  # pragma: no cover
    _BUILTIN_TYPES = set()


class CredentialBody(BaseModel):
    """A stored credential (D24): its fields in ``data`` are encrypted at rest and never listed."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_.-]{0,127}$", description="an identifier")
    kind: str = Field("generic", pattern=r"^[A-Za-z][A-Za-z0-9_-]{0,63}$",
                      description="what it is for: postgres, http, generic, ...")
    data: dict[str, Any] = Field(min_length=1, description="the secret fields")
    description: str | None = Field(None, max_length=4096)
    roles: list[str] | None = Field(None, max_length=len(access.ROLES), description=(
        "who may use it from a playbook (D24): whoever starts the execution and whoever wrote its playbooks "
        "must each hold one of these roles, or be one of its `users`; a new credential's default: admin; a "
        "replaced one keeps its own. `[]`: its users only"))
    users: list[Annotated[str, Field(min_length=1, max_length=200)]] | None = Field(
        None, max_length=credential_rules.MAX_USERS, description=(
            "users (usernames or user ids) who may use it whatever their roles (D24); a replaced one keeps its own"))


class CredentialRoles(BaseModel):
    """Who may use a stored credential from a playbook (D24)."""

    model_config = ConfigDict(extra="forbid")
    roles: list[str] = Field(max_length=len(access.ROLES), description=(
        "roles, one of which whoever starts the execution and whoever wrote its playbooks must each hold "
        "(unless named in `users`); `[]`: its users only"))
    users: list[Annotated[str, Field(min_length=1, max_length=200)]] | None = Field(
        None, max_length=credential_rules.MAX_USERS, description=(
            "users (usernames or user ids) who may use it whatever their roles; not given: kept"))


class SignalPayload(RootModel[Any]):
    """D30: the signal's payload, any JSON value (checked against the wait's ``schema``)."""


class RestartRequest(BaseModel):
    """D32: restart a finished execution from one of its steps; ``workload`` is merged over the old
    execution's workload for the new execution only."""

    model_config = ConfigDict(extra="forbid")
    from_step: str = Field(min_length=1, max_length=1024, description="the step to go on from")
    workload: dict[str, Any] | None = Field(None, description="merged over the old execution's workload")


class Restarted(BaseModel):
    execution_id: str = Field(description="the new execution")
    status: Literal["PENDING"]
    restarted_from: dict[str, Any] = Field(description="{execution, step, upto_event}")


class CancelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str | None = Field(None, max_length=4096)


class LoginRequest(BaseModel):
    """A password login (``username`` and ``password``) or an OIDC one (``id_token``, optional ``nonce``)."""

    model_config = ConfigDict(extra="forbid")
    username: str | None = Field(None, max_length=256)
    password: str | None = Field(None, max_length=4096, json_schema_extra={"format": "password"})
    id_token: str | None = Field(None, max_length=65536)
    nonce: str | None = Field(None, max_length=1024)

    @model_validator(mode="after")
    def _one_method(self) -> "LoginRequest":
        if (self.id_token is None) == (self.username is None and self.password is None):
            raise ValueError("give username and password, or id_token (not both)")
        if self.id_token is None and (self.username is None or self.password is None):
            raise ValueError("a password login needs both username and password")
        return self


class UserBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    username: str = Field(max_length=256)
    password: str | None = Field(None, max_length=4096, json_schema_extra={"format": "password"})
    email: str | None = Field(None, max_length=256)
    display_name: str | None = Field(None, max_length=256)
    roles: list[str] = Field(default_factory=lambda: [access.DEFAULT_ROLE], max_length=len(access.ROLES),
                             description=f"of {', '.join(access.ROLES)}")


class RolesBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    roles: list[str] = Field(max_length=len(access.ROLES), description=f"of {', '.join(access.ROLES)}")


class PasswordBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    password: str = Field(max_length=4096, json_schema_extra={"format": "password"})
    current_password: str | None = Field(None, max_length=4096, json_schema_extra={"format": "password"},
                                         description="needed to change one's own password, when one is set")


class TokenBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=64)
    roles: list[str] | None = Field(None, max_length=len(access.ROLES),
                                    description="a subset of the caller's (default: the caller's)")
    expires_in: int | None = Field(None, ge=1, le=sessions.MAX_TOKEN_SECONDS, description=(
        "seconds; at most what the caller's session or token has left (default: all of it)"))


class Accepted(BaseModel):
    execution_id: str
    status: Literal["PENDING", "CANCELLING"]


class Health(BaseModel):
    status: Literal["ok"]


class NatsCheck(BaseModel):
    ok: bool
    state: Literal["connected", "connecting", "reconnecting", "disconnected", "closed"]


class RecorderCheck(BaseModel):
    model_config = ConfigDict(extra="allow")
    ok: bool = Field(description="answers noetl.q.recorder.ping with ok")
    error: str | None = None
    database: bool | None = Field(None, description="as the recorder reports it, when it does")
    consumer: bool | None = Field(None, description="as the recorder reports it, when it does")
    lag: int | None = None


class ServiceCheck(BaseModel):
    ok: bool = Field(description="at least one replica answered $SRV.PING.noetl-<service> within 1 s")
    replicas: int = Field(description="the replicas that answered")
    error: str | None = None


class Ready(BaseModel):
    status: Literal["ready", "not_ready"]
    nats: NatsCheck
    recorder: RecorderCheck
    services: dict[str, ServiceCheck] = Field(
        description="the control plane (admission, router, loop-coordinator, event-recorder, sessions), each as "
                    "its NATS micro service answers")


class ErrorDetail(BaseModel):
    message: str
    location: str | None = Field(description="where in the request: body.workload.a[3], query.limit, ...")
    errors: list[dict[str, Any]] = Field(description="one item per problem in the input: location, message, type")
    request_id: str | None = Field(None, description="only on a 500: the id the gateway's log has")


class ErrorBody(BaseModel):
    detail: ErrorDetail


# --------------------------------------------------------------------------------- errors
def problem(status: int, message: str, location: str | None = None, errors: list[dict[str, Any]] | None = None,
            headers: dict[str, str] | None = None) -> HTTPException:
    """An error answer in the API's one shape."""
    return HTTPException(status, {"message": message, "location": location, "errors": errors or []}, headers)


def _detail(detail: Any) -> dict[str, Any]:
    if isinstance(detail, dict) and "message" in detail:
        return {"location": None, "errors": [], **detail}
    return {"message": str(detail), "location": None, "errors": []}


def _pydantic_problem(errors: list[dict[str, Any]], root: str | None = None) -> HTTPException:
    """pydantic's errors in the API's shape (without their ``input``: it may be large, or a secret)."""
    items = []
    for err in errors:
        loc = tuple(p if isinstance(p, int) else str(p) for p in ((root, *err["loc"]) if root else err["loc"]))
        where = location(loc[1:], str(loc[0])) if loc else "body"
        items.append({"location": where, "message": err["msg"], "type": err["type"]})
    first = items[0] if items else {"location": None, "message": "invalid request"}
    more = f" (and {len(items) - 1} more)" if len(items) > 1 else ""
    return problem(422, f"{first['location']}: {first['message']}{more}", first["location"], items)


def _body_problem(exc: BodyError) -> HTTPException:
    return problem(exc.status, exc.message, exc.location,
                   [{"location": exc.location, "message": exc.message, "type": exc.type}])


def _http_error(exc: BusError, where: str | None = None) -> HTTPException:
    status = STATUS_OF_KIND.get(exc.kind)
    if exc.kind == "invalid_playbook":
        return problem(422, "invalid playbook", where, _diagnostics(exc.details))
    if status in (429, 503):
        text = exc.message if status == 429 else f"service unavailable: {exc.message}"
        return problem(status, text, headers={"Retry-After": auth.retry_seconds(exc.details)})
    if status is None:
        return problem(502, f"upstream error ({exc.kind}): {exc.message}")
    if status == 401:
        return problem(401, exc.message, headers={"WWW-Authenticate": auth.INVALID})
    return problem(status, exc.message, where if status in (400, 413) else None)


def _diagnostics(items: Any) -> list[dict[str, Any]]:
    """The errors among a validator's diagnostics (objects here, dicts from the recorder)."""
    out = []
    for d in items if isinstance(items, list) else []:
        get = d.get if isinstance(d, dict) else (lambda key, default=None, d=d: getattr(d, key, default))
        if get("severity", "error") == "error":
            item = {"location": get("location"), "message": get("message"), "severity": "error"}
            for key in ("line", "column"):  # where in the YAML text, when the playbook came as text
                if get(key) is not None:
                    item[key] = get(key)
            out.append(item)
    return out


_nats_state = auth.nats_state


# --------------------------------------------------------------------------------- the guard
NOSNIFF = (b"x-content-type-options", b"nosniff")


class _Guard:
    """The outer shell of every HTTP request: a request id (``X-Request-ID`` on every answer, and
    ``request.state.request_id`` for handlers), ``X-Content-Type-Options: nosniff`` on every answer, NUL in
    the URL refused, the body bounded by ``max_body_bytes`` (never read past it), and a 500 carrying
    the request id for an exception nothing else handled (a bug: logged with the id); the request's
    duration by route template and status (``noetl_http_request_duration_seconds``)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = secrets.token_hex(8)
        scope.setdefault("state", {})["request_id"] = request_id
        t0, status = time.perf_counter(), 500
        try:
            await self._guarded(scope, receive, send, request_id)
        finally:
            route = scope.get("route")  # FastAPI's matched route: its template, never the raw path
            template = getattr(route, "path", None) or ("/docs/assets" if scope["path"].startswith("/docs/assets/")
                                                        else "unmatched")
            status = scope.get("state", {}).get("status", status)
            metrics.HTTP.labels("gateway", scope["method"], template, str(status)).observe(time.perf_counter() - t0)

    async def _guarded(self, scope: dict[str, Any], receive: Callable, send: Callable, request_id: str) -> None:
        started = False

        async def send_with_id(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                scope["state"]["status"] = message["status"]
                extra = [(b"x-request-id", request_id.encode())]
                if not any(k.lower() == b"x-content-type-options" for k, _ in message.get("headers", ())):
                    extra.append(NOSNIFF)  # every answer: a browser never guesses another type (headers.py)
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        where = f"{scope['method']} {scope['path']}"
        if "\x00" in scope["path"] or b"%00" in scope.get("query_string", b""):
            part = "path" if "\x00" in scope["path"] else "query"
            return await _answer(send_with_id, 400, {"message": f"a NUL character (%00) in the URL's {part}",
                                                     "location": part, "errors": []})
        limit = limits.current().max_body_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            return await _answer(send_with_id, 413, {"message": str(LimitExceeded("max_body_bytes", declared, where)),
                                                     "location": "body", "errors": []}, close=True)
        received = 0

        async def receive_bounded() -> dict[str, Any]:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise problem(413, str(LimitExceeded("max_body_bytes", None, where,
                                                         what="the request body (sent in chunks)")), "body",
                                  headers=CLOSE)
            return message

        try:
            await self.app(scope, receive_bounded, send_with_id)
        except Exception:
            log.exception("request %s (%s) failed", request_id, where)
            if started:
                raise  # too late for an answer: the server closes the connection
            await _answer(send_with_id, 500, {
                "message": f"internal error: the gateway's log has the details under request id {request_id}",
                "location": None, "errors": [], "request_id": request_id})


def _content_length(scope: dict[str, Any]) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


async def _answer(send: Callable, status: int, detail: dict[str, Any], close: bool = False) -> None:
    body = orjson.dumps({"detail": detail})
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status,
                "headers": headers + [(b"connection", b"close")] if close else headers})
    await send({"type": "http.response.body", "body": body})


# --------------------------------------------------------------------------------- bodies
def _media_type(request: Request) -> tuple[str, str | None]:
    """``(type, charset)`` of the request's Content-Type, lower case; ``("", None)`` when absent."""
    value = request.headers.get("content-type", "")
    media, _, params = value.partition(";")
    charset = None
    for param in params.split(";"):
        key, _, val = param.partition("=")
        if key.strip().lower() == "charset":
            charset = val.strip().strip('"').lower()
    return media.strip().lower(), charset


def _is_json(media: str) -> bool:
    return media in ("", "application/json") or (media.startswith("application/") and media.endswith("+json"))


def _check_charset(charset: str | None) -> None:
    if charset not in (None, "utf-8", "utf8"):
        raise problem(415, f"charset={charset}: bodies are UTF-8", "body")


M = TypeVar("M", bound=BaseModel)


async def read_model(request: Request, model: type[M], optional: bool = False, limit: str | None = None) -> M | None:
    """The body as ``model``: strict JSON (:func:`body.parse_json`), then pydantic, in a thread for a
    big body; errors in the API's shape. ``None`` for an empty body when ``optional``. ``limit``: a
    limit (bytes) tighter than ``max_body_bytes`` for this route, checked before the body is parsed."""
    media, charset = _media_type(request)
    if not _is_json(media):
        raise problem(415, f"the body is {media}: send JSON (application/json)", "body")
    _check_charset(charset)
    bound = getattr(limits.current(), limit) if limit else None
    declared = _content_length(request.scope)
    if bound is not None and declared is not None and declared > bound:
        raise problem(413, str(LimitExceeded(limit, declared, f"{request.method} {request.url.path}")), "body")
    raw = await request.body()
    if bound is not None and len(raw) > bound:
        raise problem(413, str(LimitExceeded(limit, len(raw), f"{request.method} {request.url.path}")), "body")
    request.state.body_bytes = len(raw)
    if optional and not raw.strip():
        return None
    try:
        if len(raw) >= HEAVY_BYTES:
            return await request.app.state.offload(_parse_model, raw, model)
        return _parse_model(raw, model)
    except BodyError as exc:
        raise _body_problem(exc) from None
    except ValidationError as exc:
        raise _pydantic_problem(exc.errors(include_url=False), "body") from None


def _parse_model(raw: bytes, model: type[M]) -> M:
    return model.model_validate(parse_json(raw, limits.current().max_json_depth))


def json_body(model: type[M], optional: bool = False, limit: str | None = None) -> Any:
    """The dependency giving a route its body: ``body: Model = json_body(Model)``. Declare the body in
    the route's OpenAPI with ``openapi_extra=_json_request(Model)``."""

    async def body(request: Request) -> M | None:
        return await read_model(request, model, optional, limit)

    return Depends(body)


def _json_request(model: type[BaseModel], required: bool = True, **other: Any) -> dict[str, Any]:
    return {"requestBody": {"required": required, "content": {
        "application/json": {"schema": model.model_json_schema()}, **other}}}


# --------------------------------------------------------------------------------- the app
class _Shell:
    """The NATS side of the gateway: one request or publish per call, answered with a 503 (and
    ``Retry-After``) at once while NATS is not connected."""

    def __init__(self, bus: Bus):
        self.bus = bus

    def _connected(self, what: str) -> None:
        state = _nats_state(self.bus.nc)
        if state != "connected":
            raise problem(503, f"NATS is {state}: {what} cannot be sent now; retry shortly", headers=RETRY_AFTER)

    async def ask(self, subject: str, payload: dict[str, Any], where: str | None = None, *,
                  expand: bool = False) -> Any:
        """``expand``: resolve the D23 references of a reply over the reply budget (for bounded values:
        a catalog entry's text; never pages of events)."""
        self._connected(f"the query {subject}")
        try:
            return await self.bus.request(subject, payload, timeout=NATS_TIMEOUT, expand=expand)
        except BusError as exc:
            raise _http_error(exc, where) from exc
        except nats.errors.MaxPayloadError as exc:
            raise problem(413, f"the request to {subject} is {len(dumps(payload)):,} bytes, over the NATS server's "
                               f"max_payload ({self.bus.nc.max_payload:,} bytes)", where) from exc
        except (nats.errors.Error, TimeoutError) as exc:  # the connection went away meanwhile
            raise problem(503, f"NATS is unavailable: {type(exc).__name__}: {exc}", headers=RETRY_AFTER) from exc

    async def publish(self, event: dict[str, Any], where: str) -> None:
        self._connected(event["name"])
        try:
            await asyncio.wait_for(self.bus.publish_event(event), NATS_TIMEOUT)
        except orjson.JSONEncodeError as exc:  # e.g. a YAML playbook's integer past 64 bits
            raise problem(422, f"{where}: cannot be stored as JSON: {exc}", where) from None
        except (nats.errors.Error, TimeoutError) as exc:
            raise problem(503, f"could not publish {event['name']}: {type(exc).__name__}: {exc}",
                          headers=RETRY_AFTER) from exc


# FastAPI >= 0.165 traces and measures every request itself when an OpenTelemetry provider is set, and
# asks whether one is (an environment lookup) on every request: the gateway's spans are its own
# (infra/tracing.py), its metrics Prometheus', so FastAPI's are off
_NO_NATIVE_TELEMETRY = ({"telemetry": {"tracing": False, "metrics": False, "logs": False}}
                        if "telemetry" in inspect.signature(FastAPI.__init__).parameters else {})


def create_app(bus: Bus, trusted_proxies: str | None = None) -> FastAPI:
    """``trusted_proxies``: addresses or networks whose ``X-Forwarded-For`` is believed (default: the
    environment's ``NOETL_TRUSTED_PROXIES``; none: the connection's peer is the client)."""
    tracing.setup("gateway")  # its tracer: spans exported as the OTEL_* variables say (infra/tracing.py)
    shell = _Shell(bus)
    app = FastAPI(title="NoETL mesh gateway", version="0.1.0",
                  description="Playbook catalog and executions, over the NATS event log. Every route but "
                              "/health, /ready, the docs and POST /api/auth/login needs "
                              "`Authorization: Bearer <token>`.",
                  responses={"4XX": {"model": ErrorBody}, "5XX": {"model": ErrorBody}},
                  docs_url=None, redoc_url=None,  # mount_docs: the same pages, with no CDN
                  **_NO_NATIVE_TELEMETRY)
    app.state.bus = bus
    app.state.views = Views(bus)
    app.state.auth = auth.Authenticator(bus)
    app.state.auditor = auditor = auth.Auditor(bus)
    app.state.trusted_proxies = (auth.trusted_networks(trusted_proxies) if trusted_proxies is not None
                                 else auth.trusted_from_environment())
    heavy = asyncio.Semaphore(2)
    # a signal's payload against its wait's schema: the author's patterns may backtrack without end
    app.state.schema_check = schema_check = bounded.Bounded(limits.current().signal_check_seconds,
                                                                 preload=("jsonschema",))
    checking: set[str] = set()  # the users whose signal payload is being checked: one at a time each

    async def offload(fn: Callable[..., T], *args: Any) -> T:
        async with heavy:
            return await asyncio.to_thread(fn, *args)

    async def ask_sessions(subject: str, payload: dict[str, Any], request: Request,
                           who: dict[str, Any] | None = None, where: str | None = None) -> Any:
        """A sessions request made for the caller: its principal and address added."""
        extra: dict[str, Any] = {"client_ip": auth.caller_ip(request)}
        if who is not None:
            extra["principal"] = who
        reply = await shell.ask(subject, {**payload, **extra}, where)
        if not isinstance(reply, dict):
            raise problem(502, f"upstream error: {subject} answered something that is not an object")
        return reply

    async def user_id_of(value: str | None, request: Request, who: dict[str, Any]) -> str | None:
        """A user named in a path or query: ``me``, a user id, or a username (looked up)."""
        if value is None:
            return None
        if value == "me":
            return who["user_id"]
        if access.ID.match(value):
            return value
        return (await ask_sessions(sessions.Q_USERS_GET, {"username": value}, request, who))["user"]["user_id"]

    async def users_named(values: list[str] | None, request: Request, who: dict[str, Any]) -> list[dict] | None:
        """The users a credential names (D24), each ``{user_id, username}`` as the sessions service knows
        them (a username, or a user id); 404 for one that does not exist."""
        if values is None:
            return None
        out = []
        for value in dict.fromkeys(values):
            field = "user_id" if access.ID.match(value) else "username"
            try:
                user = (await ask_sessions(sessions.Q_USERS_GET, {field: value}, request, who, "body.users"))["user"]
            except HTTPException as exc:
                if exc.status_code == 404:
                    raise problem(404, f"users: no user {value!r}", "body.users") from None
                raise
            out.append({"user_id": user["user_id"], "username": user["username"]})
        return out

    app.state.offload = offload
    app.add_middleware(_Guard)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return JSONResponse({"detail": _detail(exc.detail)}, exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def on_invalid_request(request: Request, exc: RequestValidationError) -> Response:
        err = _pydantic_problem(list(exc.errors()))
        return JSONResponse({"detail": err.detail}, 422)

    # ------------------------------------------------------------------ catalog
    @app.post("/api/catalog", status_code=201, tags=["catalog"], openapi_extra=_json_request(
        CatalogRegistration, **{t: {"schema": {"type": "string"}} for t in ("application/x-yaml", "text/plain")}))
    async def register_playbook(request: Request, who: dict = need("catalog.write")) -> dict[str, Any]:
        """Register a playbook: JSON ``{"content": "<yaml>"}`` or the raw YAML text as the body.
        Each registration of a path gets the next version."""
        media, charset = _media_type(request)
        if media in YAML_TYPES:
            _check_charset(charset)
            try:
                content, where = decode_utf8(await request.body()), "body"
            except BodyError as exc:
                raise _body_problem(exc) from None
        elif _is_json(media):
            content, where = (await read_model(request, CatalogRegistration)).content, "body.content"
        else:
            raise problem(415, f"the body is {media}: send application/json {{content}} or YAML "
                               f"({', '.join(YAML_TYPES)})", "body")
        with tracing.span("gateway POST /api/catalog", service="gateway"):
            reply = await shell.ask(Q_CATALOG_REGISTER, {
                "content": content, "registered_by": auth.requested_by(who),
                "any_path": access.allowed(who["roles"], "catalog.any")}, where)
        reply.setdefault("warnings", [])
        return reply

    @app.get("/api/catalog", tags=["catalog"])
    async def list_catalog(who: dict = need("catalog.read"), path: str | None = None) -> list[dict[str, Any]]:
        """Catalog entries, newest first (``path`` filters one playbook's versions)."""
        with tracing.span("gateway GET /api/catalog", service="gateway"):
            return await shell.ask(Q_CATALOG_LIST, {"path": path} if path else {})

    @app.get("/api/catalog/by-path/{path:path}", tags=["catalog"])
    async def get_catalog_by_path(path: str, who: dict = need("catalog.read"),
                                  version: int | None = Query(None, ge=1, le=INT64_MAX)) -> dict[str, Any]:
        """One playbook by path: the latest version, or ``version``."""
        with tracing.span("gateway GET /api/catalog/by-path", service="gateway"):
            return await shell.ask(Q_CATALOG_GET, {"path": path, "version": version}, expand=True)

    @app.get("/api/catalog/{catalog_id}", tags=["catalog"])
    async def get_catalog(who: dict = need("catalog.read"),
                          catalog_id: int = Path(ge=0, le=INT64_MAX)) -> dict[str, Any]:
        with tracing.span("gateway GET /api/catalog/{id}", service="gateway"):
            return await shell.ask(Q_CATALOG_GET, {"id": catalog_id}, expand=True)

    # ------------------------------------------------------------------ executions
    async def execution_summary(execution_id: str, brief: bool = False, reader: str | None = None) -> dict[str, Any]:
        """The recorder's summary of an execution; for one accepted a moment ago and not recorded yet,
        what the log says of it (``{execution_id, status: PENDING, requested_by}``) instead of 404.
        ``reader``: the user it is read for (the recorder folds one large execution at a time per user)."""
        try:
            return await shell.ask(Q_EXECUTION_GET, {"execution_id": execution_id, "brief": brief, "reader": reader})
        except HTTPException as exc:
            pending = await bus.pending_request(execution_id) if exc.status_code == 404 else None
            if pending is None:
                raise
            return pending

    @app.post("/api/executions", status_code=202, response_model=Accepted, tags=["executions"],
              openapi_extra=_json_request(ExecutionRequest))
    async def start_execution(request: Request, who: dict = need("execution.start"),
                              body: ExecutionRequest = json_body(ExecutionRequest)) -> dict[str, Any]:
        """Start an execution. The playbook is resolved and validated here, so a bad reference (404)
        or an invalid playbook (422, every error listed) is reported at once. The request records
        who started it (``requested_by``)."""
        with tracing.span("gateway POST /api/executions", service="gateway") as span:
            workload = body.workload or {}
            if over := limits.exceeded("max_workload_bytes", len(dumps(workload)), "body.workload"):
                raise problem(413, str(over), "body.workload")
            catalog: dict[str, Any] | None = None
            if body.playbook is not None:
                # YAML text may hold aliases that expand; a big mapping is long to walk: both in a thread
                if isinstance(body.playbook, str) or request.state.body_bytes >= HEAVY_BYTES:
                    doc, diags = await offload(parse_and_validate, body.playbook)
                else:
                    doc, diags = parse_and_validate(body.playbook)
                if any(d.severity == "error" for d in diags):
                    raise problem(422, "invalid playbook", "body.playbook", _diagnostics(diags))
            else:
                ref = {"id": body.catalog_id} if body.catalog_id is not None else {
                    "path": body.path, "version": body.version}
                entry = await shell.ask(Q_CATALOG_GET, ref, expand=True)  # a big entry's text is a reference
                catalog = {"path": entry["path"], "version": entry["version"]}
                content = entry["content"]  # validated when registered; a big one is parsed in a thread
                doc, diags = (await offload(parse_yaml, content) if len(content) >= HEAVY_BYTES
                              else parse_yaml(content))
                if diags:  # registered under other limits, say: not startable as it is
                    raise problem(422, "invalid playbook", "catalog", _diagnostics(diags))
            if body.parent_execution_id is not None:  # a link shown on the parent: only to one's own
                try:
                    parent = await execution_summary(body.parent_execution_id, brief=True)
                except HTTPException as exc:
                    if exc.status_code != 404:
                        raise
                    raise problem(422, f"no execution {body.parent_execution_id}", "body.parent_execution_id") from None
                auth.check_owner(request, who, parent.get("requested_by"),
                                 " to list an execution under one another user started",
                                 {"execution_id": body.parent_execution_id})
            execution_id = new_execution_id()
            span.set_attribute(tracing.EXECUTION_ID, execution_id)
            # the request travels in the execution's own trace (its id is the trace id), linked to this one
            with tracing.span("gateway playbook.execution.requested", service="gateway", execution_id=execution_id):
                await shell.publish(execution_requested(execution_id, {
                    "playbook": doc, "catalog": catalog, "workload": workload,
                    "parent_execution_id": body.parent_execution_id, "requested_by": auth.requested_by(who),
                    # D33: a catalog version's author is whoever registered it, not whoever starts it
                    **({"authored_by": entry.get("registered_by")} if catalog is not None else {})}),
                    "body.playbook")
        return {"execution_id": execution_id, "status": "PENDING"}

    @app.get("/api/executions", tags=["executions"])
    async def list_executions(who: dict = need("execution.read"), limit: int = Query(50, ge=1, le=1000),
                              offset: int = Query(0, ge=0, le=2**31 - 1),
                              status: Literal["PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED"] | None = None,
                              user: str | None = Query(None, pattern=r"^(me|[0-9a-f]{32})$", description=(
                                  "only the executions this user started (a user id, or `me`)")),
                              path: str | None = Query(None, max_length=1024, description="only this playbook's"),
                              id: str | None = Query(None, pattern=r"^[A-Za-z0-9_-]{1,128}$", description=(
                                  "an execution id, or the start of one (the console's search)")),
                              since: str | None = Query(None, max_length=64, description=(
                                  "created at or after: ISO 8601, or epoch seconds")),
                              until: str | None = Query(None, max_length=64, description=(
                                  "created before: ISO 8601, or epoch seconds")),
                              ) -> list[dict[str, Any]]:
        """Executions, newest first; each with ``requested_by_name``, the username of who started it."""
        from noetl_mesh.services.gateway.console import _instant

        query: dict[str, Any] = {"limit": limit, "offset": offset, "status": status}
        if user is not None:
            query["user"] = who["user_id"] if user == "me" else user
        for key, value in (("path", path or None), ("id_prefix", id), ("since", _instant(since, "query.since")),
                           ("until", _instant(until, "query.until"))):
            if value is not None:
                query[key] = value
        with tracing.span("gateway GET /api/executions", service="gateway"):
            return await shell.ask(Q_EXECUTION_LIST, query)

    @app.get("/api/executions/{execution_id}", tags=["executions"])
    async def get_execution(execution_id: str, who: dict = need("execution.read"), brief: bool = Query(False, description=(
            "only the status projection and the event count (cheap: for polling); without it the "
            "state is rebuilt from every recorded event"))) -> dict[str, Any]:
        """The execution's state, rebuilt from its recorded events: status, workload, ctx, steps."""
        with tracing.span("gateway GET /api/executions/{id}", service="gateway"):
            reply = await execution_summary(execution_id, brief=brief, reader=who["user_id"])
            return await app.state.views.expand(reply, f"execution {execution_id}", (
                "ask for ?brief=true, or read one step run's result: "
                f"GET /api/executions/{execution_id}/runs/{{run_id}}/result"))

    @app.get("/api/executions/{execution_id}/events", tags=["executions"])
    async def get_execution_events(execution_id: str, who: dict = need("execution.read"),
                                   offset: int = Query(0, ge=0, le=INT64_MAX),
                                   limit: int = Query(100, ge=0, le=1000),
                                   name: list[str] | None = Query(None, description=(
                                       "only events of these names (repeat it: at most 50)")),
                                   step: str | None = Query(None, max_length=256),
                                   task: str | None = Query(None, max_length=256),
                                   iteration: int | None = Query(None, ge=0, le=2**31 - 1),
                                   step_run_id: str | None = Query(None, max_length=256),
                                   ) -> dict[str, Any]:
        """The execution's events in log order, a page at a time; filtered by event ``name``,
        ``step``, ``task``, ``iteration`` or ``step_run_id``, ``total`` and the offsets count the
        events selected (``log_total``: the whole log's)."""
        query: dict[str, Any] = {"execution_id": execution_id, "offset": offset, "limit": limit}
        if name:
            if len(name) > 50 or any(not n or len(n) > 128 for n in name):
                raise problem(422, "query.name: at most 50 names, each of 1 to 128 characters", "query.name")
            query["names"] = name
        for key, value in (("step", step), ("task", task), ("iteration", iteration), ("step_run_id", step_run_id)):
            if value is not None:
                query[key] = value
        with tracing.span("gateway GET /api/executions/{id}/events", service="gateway"):
            try:
                return await shell.ask(Q_EXECUTION_EVENTS, query)
            except HTTPException as exc:  # accepted a moment ago, not recorded yet: no event to show yet
                if exc.status_code != 404 or await bus.pending_request(execution_id) is None:
                    raise
                filtered = set(query) - {"execution_id", "offset", "limit"}
                return {"events": [], "total": 0, "offset": offset, "limit": limit, "next_offset": None,
                        **({"log_total": 0} if filtered else {})}

    @app.post("/api/executions/{execution_id}/cancel", status_code=202, response_model=Accepted,
              tags=["executions"], openapi_extra=_json_request(CancelRequest, required=False))
    async def cancel_execution(execution_id: str, request: Request, who: dict = need("execution.cancel.own"),
                               body: CancelRequest | None = json_body(CancelRequest, optional=True)) -> dict[str, Any]:
        """Ask for cancellation (409 when the execution has already finished). One's own executions
        with ``execution.cancel.own``; another user's need ``execution.cancel.any``."""
        with tracing.span("gateway POST /api/executions/{id}/cancel", service="gateway"):
            current = await execution_summary(execution_id, brief=True)
            auth.check_owner(request, who, current.get("requested_by"), " to cancel an execution another user started",
                             {"execution_id": execution_id})
            if current["status"] in FINAL:
                raise problem(409, f"execution {execution_id} is already {current['status']}")
            reason = body.reason if body else None
            await shell.publish(cancel_requested(execution_id, reason, auth.requested_by(who)), "body")
            await auditor.record("execution.cancelled", who, request, target={"execution_id": execution_id},
                                 details={"reason": reason} if reason else None)
        return {"execution_id": execution_id, "status": "CANCELLING"}

    @app.post("/api/executions/{execution_id}/restart", status_code=202, response_model=Restarted,
              tags=["executions"], openapi_extra=_json_request(RestartRequest))
    async def restart_execution(execution_id: str, who: dict = need("execution.start"),
                                body: RestartRequest = json_body(RestartRequest)) -> dict[str, Any]:
        """Restart a finished execution from one of its steps (D32): a new execution whose initial state
        is the old one's as it stood when the step first started (ctx, the results of the steps that had
        finished, the tokens waiting), so the steps before it do not run again. The old execution is not
        changed. 404: unknown execution; 409: not finished; 422: a step its playbook has not, or that
        never started. Needs what starting the playbook needs."""
        with tracing.span("gateway POST /api/executions/{id}/restart", service="gateway") as span:
            if body.workload is not None and \
                    (over := limits.exceeded("max_workload_bytes", len(dumps(body.workload)), "body.workload")):
                raise problem(413, str(over), "body.workload")
            try:
                start = await shell.ask(Q_EXECUTION_SEED, {"execution_id": execution_id, "from_step": body.from_step,
                                                           "reader": who["user_id"]})
            except HTTPException as exc:
                cause = exc.__cause__
                if isinstance(cause, BusError) and cause.kind == "invalid_restart":
                    raise problem(422, cause.message, "body.from_step") from None
                raise
            if body.workload and MARKER in dumps(start.get("workload")):  # to merge into it: read it back (D23)
                try:
                    start["workload"] = await bus.payloads.expand(start["workload"])
                except PayloadMissing as exc:
                    raise problem(410, f"execution {execution_id}'s workload: {exc}") from None
            data = restart.request(start, workload=body.workload, requested_by=auth.requested_by(who))
            if body.workload and not is_ref(data["workload"]):
                merged = dumps(data["workload"])
                if over := limits.exceeded("max_workload_bytes", len(merged), "the merged workload"):
                    raise problem(413, str(over), "body.workload")
                if refs.MARKER in merged and (at := refs.forged(data["workload"])) is not None:  # two halves (D23)
                    where = f"body.workload.{refs.shown(at)}"
                    raise problem(422, refs.refusal(f"the merged workload at {refs.shown(at)}"), where)
            new_id = new_execution_id()
            span.set_attribute(tracing.EXECUTION_ID, new_id)
            with tracing.span("gateway playbook.execution.requested", service="gateway", execution_id=new_id):
                await shell.publish(execution_requested(new_id, data), "body")
        return {"execution_id": new_id, "status": "PENDING", "restarted_from": data["restarted_from"]}

    # ------------------------------------------------------------------ signals and waits (D30)
    @app.post("/api/executions/{execution_id}/signals/{name}", status_code=202, tags=["executions"],
              openapi_extra=_json_request(SignalPayload, required=False))
    async def send_signal(execution_id: str, request: Request,
                          name: str = Path(pattern=r"^[A-Za-z0-9_.-]{1,128}$"),
                          who: dict = need("execution.read"),
                          body: SignalPayload | None = json_body(SignalPayload, optional=True,
                                                                 limit="max_signal_bytes")) -> dict[str, Any]:
        """Send a signal to the execution: it resumes the wait task waiting for it, or is kept until
        such a wait begins. 403 for a sender the wait's ``roles`` (default: who may cancel the
        execution) do not allow; 422 for a payload its ``schema`` refuses; 409 for a second signal."""
        with tracing.span("gateway POST /api/executions/{id}/signals/{name}", service="gateway"):
            summary = await execution_summary(execution_id, reader=who["user_id"])
            payload = body.root if body is not None else None
            wait, refusal = signals.check(summary, name, payload, user_id=who["user_id"], roles=who["roles"])
            if refusal is None and wait is not None and wait.get("schema") is not None:
                if who["user_id"] in checking:  # one check at a time per user: nobody queues ahead of the rest
                    raise problem(429, f"signal {name!r}: a payload of yours is being checked against its wait's "
                                       "schema already; send the next when it is answered", "body")
                checking.add(who["user_id"])
                try:
                    refusal = await schema_check(signals.schema_refusal, name, wait["schema"], payload)
                except bounded.Overrun as exc:
                    refusal = signals.Refusal(422, f"signal {name!r}: checking the payload against the wait's "
                                                   f"schema {exc} (limit signal_check_seconds: a schema whose "
                                                   "patterns backtrack?); nothing was recorded", "body")
                except bounded.Busy as exc:
                    raise problem(503, f"signal {name!r}: the gateway is checking other payloads ({exc}); "
                                       "send it again in a moment", "body") from None
                finally:
                    checking.discard(who["user_id"])
            if refusal is not None:
                if refusal.status == 403:
                    raise auth.deny(request, who, "execution.cancel.any", f" ({refusal.message})",
                                    {"execution_id": execution_id, "signal": name})
                raise problem(refusal.status, refusal.message, refusal.location)
            event_id = signals.signal_id(execution_id, name, summary)
            by = auth.requested_by(who)
            at = datetime.now(timezone.utc).isoformat()
            # the roles the request carried (a token's may be fewer than its owner's): a wait with
            # roles that begins later checks them (D30)
            data = {"signal": name, "payload": payload, "by": by, "at": at, "roles": sorted(who["roles"])}
            if wait is not None:  # the wait it was checked for: only that wait takes it unchecked (D30)
                data["wait_id"] = wait.get("wait_id")
            event = make_event("signal.received", execution_id, event_id=event_id, source="gateway", data=data)
            shell._connected("signal.received")
            try:
                stored = await asyncio.wait_for(bus.publish_once(event), NATS_TIMEOUT)
            except (nats.errors.Error, TimeoutError) as exc:
                raise problem(503, f"could not publish the signal: {type(exc).__name__}: {exc}",
                              headers=RETRY_AFTER) from exc
            if not stored:
                raise problem(409, f"signal {name!r} was sent to execution {execution_id} at the same time by "
                                   "another request, which was taken")
            await auditor.record("execution.signalled", who, request,
                                 target={"execution_id": execution_id, "signal": name})
        return {"execution_id": execution_id, "signal": name, "signal_id": event_id,
                "status": "DELIVERED" if wait is not None else "KEPT"}

    @app.get("/api/waits", tags=["executions"])
    async def list_waits(who: dict = need("execution.read"), execution_id: str | None = None,
                         kind: Literal["signal", "time"] | None = None, mine: bool = Query(False, description=(
                             "only the waits the caller's roles may signal")),
                         limit: int = Query(100, ge=1, le=1000)) -> list[dict[str, Any]]:
        """Waits in progress (D30): the inbox of human tasks — what each waits for, its assignee and
        form, the roles that may answer it."""
        with tracing.span("gateway GET /api/waits", service="gateway"):
            query = {k: v for k, v in (("execution_id", execution_id), ("kind", kind), ("limit", limit)) if v is not None}
            rows = await shell.ask(Q_EXECUTION_WAITS, query)
        if mine:
            rows = [r for r in rows if signals.may_answer(r.get("spec"), r.get("requested_by"),
                                                          user_id=who["user_id"], roles=who["roles"])]
        return rows

    # ------------------------------------------------------------------ credentials (D24)
    @app.post("/api/credentials", status_code=201, tags=["credentials"], openapi_extra=_json_request(CredentialBody))
    async def put_credential(request: Request, who: dict = need("credential.write"),
                             body: CredentialBody = json_body(CredentialBody)) -> dict[str, Any]:
        """Create or replace a credential; the answer has no data."""
        with tracing.span("gateway POST /api/credentials", service="gateway"):
            users = await users_named(body.users, request, who)
            reply = await shell.ask(Q_CREDENTIAL_PUT, {**body.model_dump(), "users": users}, "body")
            await auditor.record("credential.written", who, request, target={"credential": body.name},
                                 details={"kind": body.kind, "fields": sorted(body.data)[:50],
                                          **{k: reply.get(k) if isinstance(reply, dict) else None
                                             for k in ("roles", "users")}})
            return reply

    @app.post("/api/credentials/{name}/roles", tags=["credentials"], openapi_extra=_json_request(CredentialRoles))
    async def set_credential_roles(name: str, request: Request, who: dict = need("credential.write"),
                                   body: CredentialRoles = json_body(CredentialRoles)) -> dict[str, Any]:
        """Set who may use a credential from a playbook (D24); the answer has no data."""
        with tracing.span("gateway POST /api/credentials/{name}/roles", service="gateway"):
            users = await users_named(body.users, request, who)
            reply = await shell.ask(Q_CREDENTIAL_ROLES, {"name": name, "roles": body.roles, "users": users}, "body")
            await auditor.record("credential.roles", who, request, target={"credential": name},
                                 details={k: reply.get(k) if isinstance(reply, dict) else None
                                          for k in ("roles", "users")})
            return reply

    @app.get("/api/credentials", tags=["credentials"])
    async def list_credentials(who: dict = need("credential.list")) -> list[dict[str, Any]]:
        """Every credential's name, kind, description, roles and times (never its data)."""
        with tracing.span("gateway GET /api/credentials", service="gateway"):
            return await shell.ask(Q_CREDENTIAL_LIST, {})

    @app.get("/api/credentials/{name}", tags=["credentials"])
    async def get_credential(name: str, request: Request, who: dict = need("credential.list"),
                             include_data: bool = Query(False, description=(
                                 "also return the decrypted data: needs credential.read_data (admin); "
                                 "recorded in the audit log"))) -> dict[str, Any]:
        if include_data and not access.allowed(who["roles"], "credential.read_data"):
            raise auth.deny(request, who, "credential.read_data", " to read a credential's data (include_data)",
                            {"credential": name})
        with tracing.span("gateway GET /api/credentials/{name}", service="gateway"):
            reply = await shell.ask(Q_CREDENTIAL_GET, {"name": name, "include_data": include_data})
            if include_data:  # no record, no secret
                await auditor.record("credential.read", who, request, required=True, target={"credential": name},
                                     details={"include_data": True})
            return reply

    @app.delete("/api/credentials/{name}", status_code=204, tags=["credentials"])
    async def delete_credential(name: str, request: Request, who: dict = need("credential.write")) -> Response:
        with tracing.span("gateway DELETE /api/credentials/{name}", service="gateway"):
            await shell.ask(Q_CREDENTIAL_DELETE, {"name": name})
            await auditor.record("credential.deleted", who, request, target={"credential": name})
        return Response(status_code=204)

    # ------------------------------------------------------------------ who: logins, sessions, users, tokens
    @app.post("/api/auth/login", tags=["auth"], openapi_extra=_json_request(LoginRequest))
    async def login(request: Request, response: Response, _: None = need(PUBLIC),
                    body: LoginRequest = json_body(LoginRequest, limit="max_login_bytes")) -> dict[str, Any]:
        """A session: ``{token, principal}``. Send the token as ``Authorization: Bearer <token>``.
        Wrong credentials are 401; too many failures 429 with ``Retry-After``."""
        response.headers["Cache-Control"] = "no-store"
        return await ask_sessions(sessions.Q_LOGIN, body.model_dump(exclude_none=True), request)

    @app.post("/api/auth/logout", tags=["auth"])
    async def logout(request: Request, who: dict = need(SIGNED_IN)) -> dict[str, Any]:
        """End the session the request carries (an API token presented here is revoked)."""
        token = auth.bearer(request.headers.get("authorization"))
        app.state.auth.forget(token)
        return await ask_sessions(sessions.Q_REVOKE, {"token": token}, request)

    @app.get("/api/auth/whoami", tags=["auth"])
    async def whoami(who: dict = need(SIGNED_IN)) -> dict[str, Any]:
        """The caller's principal and the permissions its roles grant."""
        return {**who, "permissions": access.permissions(who["roles"])}

    @app.get("/api/sessions", tags=["auth"])
    async def list_sessions(request: Request, who: dict = need("session.own"),
                            user_id: str | None = Query(None, max_length=256, description=(
                                "another user's, by id or username (needs session.any)"))) -> list[dict[str, Any]]:
        """Live sessions, newest first; ``current`` marks the caller's."""
        reply = await ask_sessions(sessions.Q_LIST, {"user_id": await user_id_of(user_id, request, who)}, request, who)
        return reply.get("sessions", [])

    @app.delete("/api/sessions", tags=["auth"])
    async def revoke_user_sessions(request: Request, who: dict = need("session.own"),
                                   user_id: str | None = Query(None, max_length=256, description=(
                                       "another user's, by id or username (needs session.any); default: the "
                                       "caller's"))) -> dict[str, Any]:
        """End every session of a user (the caller's by default, this one included)."""
        return await ask_sessions(sessions.Q_REVOKE, {"user_id": await user_id_of(user_id or "me", request, who)},
                                  request, who)

    @app.delete("/api/sessions/{session_id}", tags=["auth"])
    async def revoke_session(session_id: str, request: Request, who: dict = need("session.own")) -> dict[str, Any]:
        """End one session (another user's needs session.any)."""
        return await ask_sessions(sessions.Q_REVOKE, {"session_id": session_id}, request, who)

    @app.get("/api/users", tags=["users"])
    async def list_users(request: Request, who: dict = need("user.admin")) -> list[dict[str, Any]]:
        reply = await ask_sessions(sessions.Q_USERS_LIST, {}, request, who)
        return reply.get("users", [])

    @app.post("/api/users", status_code=201, tags=["users"], openapi_extra=_json_request(UserBody))
    async def add_user(request: Request, who: dict = need("user.admin"),
                       body: UserBody = json_body(UserBody)) -> dict[str, Any]:
        """A new user (``roles`` default viewer); without a password it logs in through OIDC only."""
        return (await ask_sessions(sessions.Q_USERS_ADD, body.model_dump(exclude_none=True), request, who, "body"))["user"]

    @app.post("/api/users/{user_id}/disable", tags=["users"])
    async def disable_user(user_id: str, request: Request, who: dict = need("user.admin")) -> dict[str, Any]:
        """Disable a user: its sessions and API tokens are revoked."""
        return await ask_sessions(sessions.Q_USERS_DISABLE, {"user_id": await user_id_of(user_id, request, who)},
                                  request, who)

    @app.post("/api/users/{user_id}/enable", tags=["users"])
    async def enable_user(user_id: str, request: Request, who: dict = need("user.admin")) -> dict[str, Any]:
        return (await ask_sessions(sessions.Q_USERS_ENABLE, {"user_id": await user_id_of(user_id, request, who)},
                                  request, who))["user"]

    @app.post("/api/users/{user_id}/roles", tags=["users"], openapi_extra=_json_request(RolesBody))
    async def set_roles(user_id: str, request: Request, who: dict = need("user.admin"),
                        body: RolesBody = json_body(RolesBody)) -> dict[str, Any]:
        """Set a user's roles: its sessions take them, its API tokens keep those it still has."""
        target = await user_id_of(user_id, request, who)
        return (await ask_sessions(sessions.Q_USERS_ROLES, {"user_id": target, "roles": body.roles},
                                   request, who, "body.roles"))["user"]

    @app.post("/api/users/{user_id}/password", tags=["users"], openapi_extra=_json_request(PasswordBody))
    async def set_password(user_id: str, request: Request, who: dict = need(SIGNED_IN),
                           body: PasswordBody = json_body(PasswordBody)) -> dict[str, Any]:
        """Change a password: one's own (``user_id`` ``me``, with ``current_password`` when one is set)
        or, with user.admin, anyone's. The user's other sessions end."""
        payload = body.model_dump(exclude_none=True)
        target = await user_id_of(user_id, request, who)
        if target != who["user_id"]:
            payload["user_id"] = target
        return (await ask_sessions(sessions.Q_USERS_PASSWORD, payload, request, who, "body"))["user"]

    @app.get("/api/tokens", tags=["tokens"])
    async def list_tokens(request: Request, who: dict = need("token.own"),
                          user_id: str | None = Query(None, max_length=256, description=(
                              "another user's, by id or username (needs token.any)"))) -> list[dict[str, Any]]:
        """Live API tokens (never the tokens themselves), newest first."""
        reply = await ask_sessions(sessions.Q_TOKENS_LIST, {"user_id": await user_id_of(user_id, request, who)},
                                   request, who)
        return reply.get("tokens", [])

    @app.post("/api/tokens", status_code=201, tags=["tokens"], openapi_extra=_json_request(TokenBody))
    async def create_token(request: Request, response: Response, who: dict = need("token.own"),
                           body: TokenBody = json_body(TokenBody)) -> dict[str, Any]:
        """A new API token for the caller: the token is in this answer only."""
        response.headers["Cache-Control"] = "no-store"
        return await ask_sessions(sessions.Q_TOKENS_CREATE, body.model_dump(exclude_none=True), request, who, "body")

    @app.delete("/api/tokens/{token_id}", tags=["tokens"])
    async def revoke_token(token_id: str, request: Request, who: dict = need("token.own")) -> dict[str, Any]:
        """Revoke an API token (another user's needs token.any)."""
        return await ask_sessions(sessions.Q_TOKENS_REVOKE, {"token_id": token_id}, request, who)

    @app.get("/api/audit", tags=["audit"])
    async def audit_log(request: Request, who: dict = need("audit.read"),
                        user: str | None = Query(None, max_length=64, description="a user id"),
                        action: str | None = Query(None, max_length=64, description="area.verb, or area"),
                        since: str | None = Query(None, max_length=64, description="ISO 8601, or epoch seconds"),
                        limit: int = Query(100, ge=1, le=1000)) -> list[dict[str, Any]]:
        """Audit records, newest first."""
        query = {"user": user, "action": action, "since": since, "limit": limit}
        reply = await ask_sessions(sessions.Q_AUDIT_LIST, {k: v for k, v in query.items() if v is not None},
                                   request, who)
        return reply.get("records", [])

    # ------------------------------------------------------------------ health
    @app.get("/", include_in_schema=False)
    async def root(_: None = need(PUBLIC)) -> Any:
        """The printed gateway URL opens the web console (the API is under /api, its docs at /docs)."""
        from fastapi.responses import RedirectResponse

        return RedirectResponse("/ui/", status_code=307)

    @app.get("/health", response_model=Health, tags=["health"])
    async def health(_: None = need(PUBLIC)) -> dict[str, Any]:
        """Liveness: the process is up and answers HTTP. Asks nothing of NATS or the recorder (a
        restart would not cure them); readiness is ``/ready``."""
        return {"status": "ok"}

    @app.get("/ready", response_model=Ready, tags=["health"],
             responses={503: {"model": Ready, "description": "not ready: each part shows why"}})
    async def ready(_: None = need(PUBLIC)) -> Any:
        """Readiness: NATS connected, the event-recorder answering its ping with ok (with the
        ``database`` and ``consumer`` states when it reports them), and at least one replica of each
        control-plane service answering its NATS micro service ping (``services``); 503 with
        ``Retry-After`` when not."""
        state = _nats_state(bus.nc)

        async def recorder_check() -> dict[str, Any]:
            if state != "connected":
                return {"ok": False, "error": f"NATS is {state}"}
            try:
                ping = await bus.request(Q_RECORDER_PING, {}, timeout=1.0)
                ping = ping if isinstance(ping, dict) else {}
                check = {"ok": ping.get("ok") is True,
                         **{k: ping[k] for k in ("database", "consumer", "lag", "recorded") if k in ping}}
                if not check["ok"]:
                    check["error"] = str(ping.get("error") or "the recorder reports it is not ok")
                return check
            except BusError as exc:
                return {"ok": False, "error": exc.message}
            except (nats.errors.Error, TimeoutError) as exc:
                return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}

        async def services_check() -> dict[str, dict[str, Any]]:
            counts = dict.fromkeys(READY_SERVICES, 0)
            why = f"NATS is {state}"
            if state == "connected":
                try:
                    counts = await micro.ping_services(bus.nc, READY_SERVICES, timeout=1.0)
                    why = "no replica answered $SRV.PING.noetl-{} within 1s"
                except (nats.errors.Error, TimeoutError) as exc:
                    why = f"{type(exc).__name__}: {exc}"
            return {name: {"ok": n > 0, "replicas": n, **({} if n else {"error": why.format(name)})}
                    for name, n in counts.items()}

        recorder, services = await asyncio.gather(recorder_check(), services_check())
        ok = state == "connected" and recorder["ok"] and all(s["ok"] for s in services.values())
        body = {"status": "ready" if ok else "not_ready", "nats": {"ok": state == "connected", "state": state},
                "recorder": recorder, "services": services}
        return body if ok else JSONResponse(body, 503, headers=RETRY_AFTER)

    from noetl_mesh.services.gateway import schedules

    schedules.install(app)  # the schedule routes (D31)
    from noetl_mesh.services.gateway import console

    console.install(app)  # the web console (/ui) and its routes: time travel, lint, live streams
    mount_docs(app)
    auth.check_declarations(app)
    return app


# --------------------------------------------------------------------------------- the service
def _with_request_deadline(base: type) -> type:
    """uvicorn's HTTP protocol, closing a connection on which no request has arrived whole (line,
    headers and body) within ``http_request_seconds`` of its opening or of its last response: uvicorn
    bounds the idle time between requests (keep-alive) but not the time a request takes to arrive, so
    clients that sent a header line, or a byte of a body, every few seconds held connections (and file
    descriptors) until the gateway could take no more. A request that has arrived is never cut off
    while it is answered (a live stream lasts as long as it lasts)."""

    class Protocol(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_header_deadline()

        def _arm_header_deadline(self) -> None:
            self._header_deadline = self.loop.call_later(limits.current().http_request_seconds, self._headers_late)

        def _headers_late(self) -> None:
            cycle = self.cycle
            if (cycle is None or cycle.response_complete or cycle.more_body) and not self.transport.is_closing():
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._header_deadline.cancel()
            self._arm_header_deadline()  # the next request gets as long

        def connection_lost(self, exc: Exception | None) -> None:
            self._header_deadline.cancel()
            super().connection_lost(exc)

    return Protocol


class Views:
    """Answers whose values the log holds by reference (D23), read back before they are sent, bounded:
    at most ``max_view_bytes`` of such values in one answer (413 past it, saying what to ask instead,
    before anything is read) and at most ``VIEWS_AT_ONCE`` answers being read back at a time per
    gateway (others wait; 503 after ``VIEW_WAIT`` seconds). Unbounded, a viewer asking 50 times at once
    for an execution holding 30 MB of results took the gateway from 313 to 590 MB and its NATS
    connection down, and the object store's timeouts were 500s."""

    VIEWS_AT_ONCE = 4
    VIEW_WAIT = 10.0

    def __init__(self, bus: Bus):
        self.bus = bus
        self.slots = asyncio.Semaphore(self.VIEWS_AT_ONCE)

    async def expand(self, reply: Any, what: str, instead: str) -> Any:
        if MARKER not in dumps(reply):
            return reply
        limit = limits.current().max_view_bytes

        def too_many(total: int) -> HTTPException:
            return problem(413, f"{limits.LimitExceeded('max_view_bytes', total, what)}: the values it holds by "
                                f"reference are too many to send at once; {instead}")

        total = sum(int(r.get("size") or 0) for r in _refs_in(reply))
        if total > limit:  # before anything is read, in the common case
            raise too_many(total)
        try:
            await asyncio.wait_for(self.slots.acquire(), self.VIEW_WAIT)
        except asyncio.TimeoutError:
            raise problem(503, f"{what}: the gateway is reading back other answers' values; try again",
                          headers=RETRY_AFTER) from None
        budget = [limit]
        try:
            return await self.bus.payloads.expand(reply, budget)
        except OverBudget:
            raise too_many(limit - budget[0]) from None
        except PayloadMissing as exc:  # the object outlived its retention
            raise problem(410, f"{what}: {exc}") from None
        except (asyncio.TimeoutError, nats.errors.Error, ValueError) as exc:  # ValueError: a checksum mismatch
            raise problem(503, f"{what}: its values could not be read back now ({type(exc).__name__}: {exc}); "
                               "try again", headers=RETRY_AFTER) from None
        finally:
            self.slots.release()


def _refs_in(value: Any) -> list[dict[str, Any]]:
    """The payload references in ``value`` (an explicit stack: answers nest deep)."""
    out, todo = [], [value]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            if is_ref(item):
                out.append(item)
            else:
                todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
    return out


class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside a process that owns its signals: no handler installed, stopped by ``exit()``
    at once (uvicorn's own loop looks at ``should_exit`` every 0.1 s)."""

    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        self.exiting = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def exit(self) -> None:
        self.should_exit = True
        self.exiting.set()

    async def main_loop(self) -> None:
        counter = 0
        while not await self.on_tick(counter):  # on_tick keeps the Date header and says should_exit
            counter = (counter + 1) % 864000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.exiting.wait(), 0.1)


class GatewayService:
    name = "gateway"

    def __init__(self, bus: Bus, host: str = "127.0.0.1", port: int = 0):
        self.bus = bus
        self.host = host
        self.port = port
        self.app: FastAPI | None = None
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task | None = None
        self.tls: dict[str, str] = {}

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("the gateway is not started")
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    async def start(self) -> None:
        from noetl_mesh.infra.tls import gateway_server

        self.tls = gateway_server()  # HTTPS with NOETL_GATEWAY_TLS_CERT/_KEY; a file it cannot load: one line
        self.app = create_app(self.bus)
        # proxy_headers off: uvicorn would believe X-Forwarded-For from 127.0.0.1 by default; the client's
        # address is the gateway's decision (NOETL_TRUSTED_PROXIES, auth.client_address)
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        config = uvicorn.Config(self.app, host=self.host, port=self.port, log_level="warning", lifespan="off",
                                proxy_headers=False, http=_with_request_deadline(AutoHTTPProtocol),
                                limit_concurrency=limits.current().max_http_connections, **self.tls)
        server = _EmbeddedServer(config)
        self._task = asyncio.create_task(server.serve(), name="gateway http")
        while not server.started:
            if self._task.done():
                exc = self._task.exception() if not self._task.cancelled() else None
                raise RuntimeError(f"the gateway could not listen on {self.host}:{self.port}: {exc!r}")
            await asyncio.sleep(0.01)
        self._server = server
        if not self.port:
            self.port = server.servers[0].sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.exit()
        if self.app is not None:
            await self.app.state.live.close()
            await self.app.state.auth.close()
            self.app.state.schema_check.close(kill=True)
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, 10)
            except (asyncio.TimeoutError, SystemExit):
                self._task.cancel()
            except Exception:  # noqa: BLE001
                log.exception("gateway server failed")
            self._task = None
        self._server = None
