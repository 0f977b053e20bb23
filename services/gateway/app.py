"""gateway: the HTTP API, a thin shell over NATS.

Reads are request/reply calls to the event-recorder (``noetl.q.*``); commands are events published to
JetStream (``playbook.execution.requested``, ``execution.cancelled``). The gateway keeps no state and
owns no database: any number of replicas can run behind a load balancer.

Error mapping: a recorder ``not_found`` is 404, ``invalid_playbook`` 422, ``bad_request`` 400; NATS
unreachable or a service not answering (``unavailable``/``timeout``) is 503; anything else 502.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Literal

import nats.errors
import uvicorn
import yaml
from fastapi import Body, FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from noetl_mesh.core.events import make_event, new_execution_id, stable_id
from noetl_mesh.core.state import FINAL
from noetl_mesh.infra import tracing
from noetl_mesh.infra.payloads import MARKER, PayloadMissing
from noetl_mesh.infra.bus import (
    Q_CATALOG_GET,
    Q_CATALOG_LIST,
    Q_CATALOG_REGISTER,
    Q_CREDENTIAL_DELETE,
    Q_CREDENTIAL_GET,
    Q_CREDENTIAL_LIST,
    Q_CREDENTIAL_PUT,
    Q_EXECUTION_EVENTS,
    Q_EXECUTION_GET,
    Q_EXECUTION_LIST,
    Q_RECORDER_PING,
    Bus,
    BusError,
    dumps,
)
from noetl_mesh.lang.validate import parse_yaml, validate_cached


log = logging.getLogger("noetl.gateway")

YAML_TYPES = ("application/x-yaml", "application/yaml", "text/yaml", "text/x-yaml", "text/plain")
STATUS_OF_KIND = {"not_found": 404, "invalid_playbook": 422, "bad_request": 400, "conflict": 409,
                  "unavailable": 503, "timeout": 503}
SOURCES = ("path", "catalog_id", "playbook")


# --------------------------------------------------------------------------------- request bodies
class CatalogRegistration(BaseModel):
    model_config = ConfigDict(extra="forbid")
    content: str = Field(description="the playbook's YAML text")


class ExecutionRequest(BaseModel):
    """Start an execution of exactly one of: a catalog ``path`` (latest, or ``version``), a
    ``catalog_id``, or an inline ``playbook`` (YAML text or the parsed mapping)."""

    model_config = ConfigDict(extra="forbid")
    path: str | None = None
    version: int | None = None
    catalog_id: int | None = None
    playbook: str | dict[str, Any] | None = None
    workload: dict[str, Any] | None = None
    parent_execution_id: str | None = None

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
    description: str | None = None


class CancelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str | None = None


class Accepted(BaseModel):
    execution_id: str
    status: Literal["PENDING", "CANCELLING"]


class Health(BaseModel):
    status: Literal["ok", "degraded"]
    nats: bool
    recorder: bool


# --------------------------------------------------------------------------------- the app
class _Shell:
    """The NATS side of the gateway: one request or publish per call, each inside a span."""

    def __init__(self, bus: Bus):
        self.bus = bus

    async def ask(self, subject: str, payload: dict[str, Any], timeout: float = 10.0) -> Any:
        try:
            return await self.bus.request(subject, payload, timeout=timeout)
        except BusError as exc:
            raise _http_error(exc) from exc
        except nats.errors.Error as exc:
            raise HTTPException(503, f"NATS is unavailable: {type(exc).__name__}: {exc}") from exc

    async def publish(self, event: dict[str, Any]) -> None:
        try:
            await self.bus.publish_event(event)
        except nats.errors.Error as exc:
            raise HTTPException(503, f"could not publish {event['name']}: {type(exc).__name__}: {exc}") from exc


def _http_error(exc: BusError) -> HTTPException:
    status = STATUS_OF_KIND.get(exc.kind, 502)
    if exc.kind == "invalid_playbook":
        return HTTPException(422, {"message": "invalid playbook", "errors": exc.details or []})
    if status == 503:
        return HTTPException(503, f"service unavailable: {exc.message}")
    if status == 502:
        return HTTPException(502, f"upstream error ({exc.kind}): {exc.message}")
    return HTTPException(status, exc.message)


def _invalid(diagnostics: list[Any]) -> HTTPException:
    errors = [{"location": d.location, "message": d.message, "severity": d.severity}
              for d in diagnostics if d.severity == "error"]
    return HTTPException(422, {"message": "invalid playbook", "errors": errors})


def create_app(bus: Bus) -> FastAPI:
    tracing.setup("gateway")  # spans need a real provider for trace context to propagate
    shell = _Shell(bus)
    app = FastAPI(title="NoETL mesh gateway", version="0.1.0",
                  description="Playbook catalog and executions, over the NATS event log.")
    app.state.bus = bus

    # ------------------------------------------------------------------ catalog
    @app.post("/api/catalog", status_code=201, tags=["catalog"], openapi_extra={"requestBody": {
        "required": True, "content": {
            "application/json": {"schema": CatalogRegistration.model_json_schema()},
            "application/x-yaml": {"schema": {"type": "string"}},
            "text/plain": {"schema": {"type": "string"}}}}})
    async def register_playbook(request: Request) -> dict[str, Any]:
        """Register a playbook: JSON ``{"content": "<yaml>"}`` or the raw YAML text as the body.
        Each registration of a path gets the next version."""
        ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
        raw = await request.body()
        if ctype in YAML_TYPES:
            try:
                content = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise HTTPException(400, f"the body is not UTF-8: {exc}") from exc
        elif ctype == "application/json" or ctype.endswith("+json"):
            try:
                content = CatalogRegistration.model_validate_json(raw or b"null").content
            except ValidationError as exc:
                raise HTTPException(422, exc.errors(include_url=False, include_context=False)) from exc
        else:
            raise HTTPException(415, f"send application/json {{content}} or YAML ({', '.join(YAML_TYPES)})")
        with tracing.span("gateway POST /api/catalog"):
            reply = await shell.ask(Q_CATALOG_REGISTER, {"content": content})
        reply.setdefault("warnings", [])
        return reply

    @app.get("/api/catalog", tags=["catalog"])
    async def list_catalog(path: str | None = None) -> list[dict[str, Any]]:
        """Catalog entries, newest first (``path`` filters one playbook's versions)."""
        with tracing.span("gateway GET /api/catalog"):
            return await shell.ask(Q_CATALOG_LIST, {"path": path} if path else {})

    @app.get("/api/catalog/by-path/{path:path}", tags=["catalog"])
    async def get_catalog_by_path(path: str, version: int | None = None) -> dict[str, Any]:
        """One playbook by path: the latest version, or ``version``."""
        with tracing.span("gateway GET /api/catalog/by-path"):
            return await shell.ask(Q_CATALOG_GET, {"path": path, "version": version})

    @app.get("/api/catalog/{catalog_id}", tags=["catalog"])
    async def get_catalog(catalog_id: int) -> dict[str, Any]:
        with tracing.span("gateway GET /api/catalog/{id}"):
            return await shell.ask(Q_CATALOG_GET, {"id": catalog_id})

    # ------------------------------------------------------------------ executions
    @app.post("/api/executions", status_code=202, response_model=Accepted, tags=["executions"])
    async def start_execution(body: ExecutionRequest) -> dict[str, Any]:
        """Start an execution. The playbook is resolved and validated here, so a bad reference (404)
        or an invalid playbook (422, every error listed) is reported at once."""
        with tracing.span("gateway POST /api/executions") as span:
            catalog: dict[str, Any] | None = None
            if body.playbook is not None:
                doc, diags = (parse_yaml(body.playbook) if isinstance(body.playbook, str)
                              else (body.playbook, []))
                diags = diags or validate_cached(doc).diagnostics
                if any(d.severity == "error" for d in diags):
                    raise _invalid(diags)
            else:
                ref = {"id": body.catalog_id} if body.catalog_id is not None else {
                    "path": body.path, "version": body.version}
                entry = await shell.ask(Q_CATALOG_GET, ref)
                catalog = {"path": entry["path"], "version": entry["version"]}
                doc = yaml.safe_load(entry["content"])
            execution_id = new_execution_id()
            span.set_attribute("noetl.execution_id", execution_id)
            await shell.publish(make_event(
                "playbook.execution.requested", execution_id, event_id=stable_id("request", execution_id),
                source="gateway", status="in_progress",
                data={"playbook": doc, "catalog": catalog, "workload": body.workload or {},
                      "parent_execution_id": body.parent_execution_id}))
        return {"execution_id": execution_id, "status": "PENDING"}

    @app.get("/api/executions", tags=["executions"])
    async def list_executions(limit: int = Query(50, ge=1, le=1000),
                              status: Literal["PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED"] | None = None,
                              ) -> list[dict[str, Any]]:
        """Executions, newest first."""
        with tracing.span("gateway GET /api/executions"):
            return await shell.ask(Q_EXECUTION_LIST, {"limit": limit, "status": status})

    @app.get("/api/executions/{execution_id}", tags=["executions"])
    async def get_execution(execution_id: str, brief: bool = Query(False, description=(
            "only the status projection and the event count (cheap: for polling); without it the "
            "state is rebuilt from every recorded event"))) -> dict[str, Any]:
        """The execution's state, rebuilt from its recorded events: status, workload, ctx, steps."""
        with tracing.span("gateway GET /api/executions/{id}"):
            reply = await shell.ask(Q_EXECUTION_GET, {"execution_id": execution_id, "brief": brief})
            try:
                return await bus.payloads.expand(reply) if MARKER in dumps(reply) else reply  # D23: values
            except PayloadMissing as exc:  # the object outlived its retention
                raise HTTPException(410, f"execution {execution_id}: {exc}") from None

    @app.get("/api/executions/{execution_id}/events", tags=["executions"])
    async def get_execution_events(execution_id: str, offset: int = Query(0, ge=0),
                                   limit: int = Query(100, ge=0, le=1000)) -> dict[str, Any]:
        """The execution's events in log order, a page at a time."""
        with tracing.span("gateway GET /api/executions/{id}/events"):
            return await shell.ask(Q_EXECUTION_EVENTS,
                                   {"execution_id": execution_id, "offset": offset, "limit": limit})

    @app.post("/api/executions/{execution_id}/cancel", status_code=202, response_model=Accepted,
              tags=["executions"])
    async def cancel_execution(execution_id: str, body: CancelRequest | None = Body(None)) -> dict[str, Any]:
        """Ask for cancellation (409 when the execution has already finished)."""
        with tracing.span("gateway POST /api/executions/{id}/cancel"):
            current = await shell.ask(Q_EXECUTION_GET, {"execution_id": execution_id})
            if current["status"] in FINAL:
                raise HTTPException(409, f"execution {execution_id} is already {current['status']}")
            await shell.publish(make_event(
                "execution.cancelled", execution_id, event_id=stable_id("cancel", execution_id),
                source="gateway", data={"reason": body.reason if body else None}))
        return {"execution_id": execution_id, "status": "CANCELLING"}

    # ------------------------------------------------------------------ credentials (D24)
    @app.post("/api/credentials", status_code=201, tags=["credentials"])
    async def put_credential(body: CredentialBody) -> dict[str, Any]:
        """Create or replace a credential; the answer has no data."""
        with tracing.span("gateway POST /api/credentials"):
            return await shell.ask(Q_CREDENTIAL_PUT, body.model_dump())

    @app.get("/api/credentials", tags=["credentials"])
    async def list_credentials() -> list[dict[str, Any]]:
        """Every credential's name, kind, description and times (never its data)."""
        with tracing.span("gateway GET /api/credentials"):
            return await shell.ask(Q_CREDENTIAL_LIST, {})

    @app.get("/api/credentials/{name}", tags=["credentials"])
    async def get_credential(name: str, include_data: bool = Query(False, description=(
            "also return the decrypted data"))) -> dict[str, Any]:
        with tracing.span("gateway GET /api/credentials/{name}"):
            return await shell.ask(Q_CREDENTIAL_GET, {"name": name, "include_data": include_data})

    @app.delete("/api/credentials/{name}", status_code=204, tags=["credentials"])
    async def delete_credential(name: str) -> Response:
        with tracing.span("gateway DELETE /api/credentials/{name}"):
            await shell.ask(Q_CREDENTIAL_DELETE, {"name": name})
        return Response(status_code=204)

    # ------------------------------------------------------------------ health
    @app.get("/health", response_model=Health, tags=["health"],
             responses={503: {"model": Health, "description": "NATS is unreachable"}})
    async def health() -> Any:
        connected = bus.nc.is_connected
        recorder = False
        if connected:
            try:
                recorder = bool((await bus.request(Q_RECORDER_PING, {}, timeout=1.0)).get("ok"))
            except Exception:  # noqa: BLE001 - any failure means "not answering"
                recorder = False
        body = {"status": "ok" if connected and recorder else "degraded", "nats": connected, "recorder": recorder}
        return body if connected else JSONResponse(body, status_code=503)

    return app


# --------------------------------------------------------------------------------- the service
class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside a process that owns its signals: no handler installed, stopped by ``stop()``."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class GatewayService:
    name = "gateway"

    def __init__(self, bus: Bus, host: str = "127.0.0.1", port: int = 0):
        self.bus = bus
        self.host = host
        self.port = port
        self.app: FastAPI | None = None
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("the gateway is not started")
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        self.app = create_app(self.bus)
        config = uvicorn.Config(self.app, host=self.host, port=self.port, log_level="warning", lifespan="off")
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
            self._server.should_exit = True
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, 10)
            except (asyncio.TimeoutError, SystemExit):
                self._task.cancel()
            except Exception:  # noqa: BLE001
                log.exception("gateway server failed")
            self._task = None
        self._server = None
