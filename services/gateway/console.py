"""The web console (``/ui``) and the routes only it needs; the rest of what it shows comes from the
same API as the CLI, with the same tokens and roles (docs/console.md).

- ``/ui``: the console's files, shipped in the package (``services/gateway/ui``): no CDN, no build
  step. Public like ``/docs`` (the files hold no data); every call they make sends the session token
  as ``Authorization: Bearer`` — the console keeps it in the tab's ``sessionStorage``, never in a
  cookie, so there is no cross-site request forgery to defend against — and the page forbids any
  script but its own (``Content-Security-Policy``).
- ``GET /api/executions/{id}/state``: the execution as it stood after event ``upto`` (or the event of
  log sequence ``seq``): the engine's fold of the log up to there, as core/view.py shows it (time
  travel, D22); with ``net=true`` the playbook's net too.
- ``GET /api/executions/{id}/runs/{run_id}/result``: one step run's whole result, as a download.
- ``GET /api/executions/{id}/timeline``: the execution's step runs, task attempts, waits and loop
  iterations with their times, bounded (a big loop as counts per slice of time): the Gantt chart
  (core/timeline.py).
- ``GET /api/stats/executions``: executions per status over time, the slowest playbooks and the failures
  by error kind, in a time range (the overview page).
- ``GET /api/catalog/{id}/lint``: a catalog entry's validation diagnostics and lint findings at their
  lines, and its net.
- ``GET /api/live/executions`` and ``GET /api/live/executions/{id}``: server-sent events fed from NATS
  (live.py).
"""
from __future__ import annotations

import re
import time
from pathlib import Path as FsPath
from typing import Any

from fastapi import FastAPI, Path, Query, Request
from fastapi.responses import Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.types import Receive, Scope, Send

from noetl_mesh import limits
from noetl_mesh.core import access, view
from noetl_mesh.infra import tracing
from noetl_mesh.contracts.subjects import Q_EXECUTION_STATS, Q_EXECUTION_TIMELINE
from noetl_mesh.core import timeline
from noetl_mesh.infra.bus import Q_CATALOG_GET, Q_EXECUTION_RESULT, Q_EXECUTION_STATE, dumps

from noetl_mesh.services.gateway import auth, headers, live
from noetl_mesh.services.gateway.app import _Shell, problem
from noetl_mesh.services.gateway.auth import need
from noetl_mesh.services.gateway.body import INT64_MAX

UI_DIR = FsPath(__file__).parent / "ui"
UI = "/ui"
EXECUTION_ID = r"^[A-Za-z0-9_-]{1,128}$"  # what can be one NATS subject token (live streams)
# Only the console's own files: scripts, styles, images, connections to this gateway (headers.py).
CSP = headers.policy(default_src="'self'", script_src="'self'", style_src="'self'", img_src="'self' data:",
                     connect_src="'self'", object_src="'none'", form_action="'self'")
UI_HEADERS = headers.page(CSP)


class _ConsoleFiles(StaticFiles):
    """The console's files with its security headers; ``/ui`` and ``/ui/`` are the page itself."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.decode().lower() not in UI_HEADERS]
                message = {**message, "headers": headers + [(k.encode(), v.encode()) for k, v in UI_HEADERS.items()]}
            await send(message)

        await super().__call__(scope, receive, with_headers)


def _instant(value: str | None, where: str) -> float | None:
    """An ISO 8601 instant (with its time zone, or UTC) or epoch seconds, as epoch seconds."""
    if value is None or value == "":
        return None
    from datetime import datetime, timezone

    try:
        return float(value)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise problem(422, f"{where}: {value!r} is neither an ISO 8601 instant nor epoch seconds", where) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


def install(app: FastAPI) -> None:
    shell = _Shell(app.state.bus)

    async def fetch_state(execution_id: str) -> dict[str, Any]:
        return await shell.ask(Q_EXECUTION_STATE, {"execution_id": execution_id})

    hub = app.state.live = live.Hub(app.state.bus, fetch_state)
    app.state.auth.on_revoked.append(hub.revoked)  # a revocation ends its live streams at once

    # ------------------------------------------------------------------ the state at a point (time travel)
    @app.get("/api/executions/{execution_id}/state", tags=["console"])
    async def execution_state(execution_id: str, who: dict = need("execution.read"),
                              upto: int | None = Query(None, ge=0, le=2**31 - 1, description=(
                                  "the state after the first `upto` events of the log (0: before any)")),
                              seq: int | None = Query(None, ge=-INT64_MAX, le=INT64_MAX, description=(
                                  "the state after the event of this log sequence (an event's `seq`)")),
                              net: bool = Query(False, description="also the playbook's net (nodes and edges)"),
                              ) -> dict[str, Any]:
        """The execution as it stood after one event: the engine's fold (D22) of the log up to there, as
        the console shows it — each step's status and run count, the tokens on places, the last runs'
        args, results and errors (large values as previews with their size), loops as counts, ctx,
        waits, children; ``position`` (events folded), ``total`` (events in the log), ``at`` (the
        event it stands after). Default: after the last event."""
        if upto is not None and seq is not None:
            raise problem(422, "give upto or seq, not both", "query")
        with tracing.span("gateway GET /api/executions/{id}/state", service="gateway", execution_id=execution_id):
            request = {"execution_id": execution_id, "net": net, "reader": who["user_id"]}
            if upto is not None:
                request["upto"] = upto
            if seq is not None:
                request["seq"] = seq
            return await shell.ask(Q_EXECUTION_STATE, request)

    @app.get("/api/executions/{execution_id}/runs/{run_id}/result", tags=["console"])
    async def run_result(execution_id: str, who: dict = need("execution.read"),
                         run_id: str = Path(max_length=256)) -> Response:
        """A step run's whole outcome (``{run_id, step, event, result, error}``), as a JSON file: what
        the console's previews link to. Values stored by reference (D23) are read back."""
        with tracing.span("gateway GET /api/executions/{id}/runs/{run_id}/result", service="gateway", execution_id=execution_id):
            reply = await shell.ask(Q_EXECUTION_RESULT, {"execution_id": execution_id, "run_id": run_id})
            reply = await app.state.views.expand(reply, f"execution {execution_id} run {run_id}",
                                                 "read its result in the run's events instead")
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{reply.get('step') or 'step'}-{run_id}")[:120]
        return Response(dumps(reply), media_type="application/json",
                        headers={"Content-Disposition": f'attachment; filename="{name}.json"'})

    # ------------------------------------------------------------------ the timeline and the overview
    @app.get("/api/executions/{execution_id}/timeline", tags=["console"])
    async def execution_timeline(execution_id: str, who: dict = need("execution.read"),
                                 since: str | None = Query(None, alias="from", max_length=64, description=(
                                     "the window's start: ISO 8601 or epoch seconds (default: the execution's)")),
                                 until: str | None = Query(None, alias="to", max_length=64, description=(
                                     "the window's end (default: when it finished, or now)")),
                                 buckets: int = Query(timeline.DEFAULT_BUCKETS, ge=1, le=timeline.MAX_BUCKETS,
                                                      description="slices of the window a big loop is counted in"),
                                 ) -> dict[str, Any]:
        """The execution's timeline, for a Gantt chart: each step run (the last 500) with when it was
        admitted, started and ended and its status; its tasks' attempts (``task.started`` to
        ``task.processed``) and waits; a loop's iterations one by one up to 100, a bigger loop as how many
        iterations started, ended done and failed in each slice of the window (never its rows). Times
        are epoch seconds; ``end`` is null while it runs (``now``: the recorder's clock)."""
        request: dict[str, Any] = {"execution_id": execution_id, "buckets": buckets, "reader": who["user_id"]}
        for key, value, where in (("from", since, "query.from"), ("to", until, "query.to")):
            moment = _instant(value, where)
            if moment is not None:
                request[key] = moment
        if "from" in request and "to" in request and request["to"] <= request["from"]:
            raise problem(422, "query.to: the window ends before it starts", "query.to")
        with tracing.span("gateway GET /api/executions/{id}/timeline", service="gateway", execution_id=execution_id):
            return await shell.ask(Q_EXECUTION_TIMELINE, request)

    @app.get("/api/stats/executions", tags=["console"])
    async def execution_stats(who: dict = need("execution.read"),
                              since: str | None = Query(None, max_length=64, description=(
                                  "created at or after: ISO 8601 or epoch seconds (default: a day before until)")),
                              until: str | None = Query(None, max_length=64, description=(
                                  "created before (default: now)")),
                              buckets: int = Query(48, ge=1, le=400, description="slices of the time range"),
                              ) -> dict[str, Any]:
        """The executions created in a time range (at most 366 days): how many per status in each slice
        of it (``by_status``) and in all (``totals``), the playbooks whose finished executions took
        longest (``slowest``: count, average, median, 95th percentile and maximum in seconds, the slowest
        execution, how many failed) and the failed executions by error kind (``failures``: count, the
        latest one and its message). Read-only, from the executions' projection."""
        request: dict[str, Any] = {"buckets": buckets}
        for key, value, where in (("since", since, "query.since"), ("until", until, "query.until")):
            moment = _instant(value, where)
            if moment is not None:
                request[key] = moment
        first, last = request.get("since"), request.get("until")
        if first is not None and last is not None and last <= first:
            raise problem(422, "query.until: the time range ends before it starts", "query.until")
        if first is not None and (last if last is not None else time.time()) - first > 366 * 86_400:
            raise problem(422, "query.since: the time range is at most 366 days", "query.since")
        with tracing.span("gateway GET /api/stats/executions", service="gateway"):
            return await shell.ask(Q_EXECUTION_STATS, request, "query")

    # ------------------------------------------------------------------ a catalog entry's findings
    @app.get("/api/catalog/{catalog_id}/lint", tags=["catalog"])
    async def catalog_lint(who: dict = need("catalog.read"), catalog_id: int = Path(ge=0, le=INT64_MAX)) -> dict[str, Any]:
        """The entry's validation diagnostics and lint findings (docs/lint.md), each at its line and
        column, and its net (nodes and edges) when it is valid."""
        with tracing.span("gateway GET /api/catalog/{id}/lint", service="gateway"):
            entry = await shell.ask(Q_CATALOG_GET, {"id": catalog_id}, expand=True)
            report, doc = await app.state.offload(_lint, entry["content"])
        return {"id": entry["id"], "path": entry["path"], "version": entry["version"], "valid": report.valid,
                "findings": [f.as_dict() for f in report.findings], "net": view.net(doc)}

    # ------------------------------------------------------------------ live streams
    def _refuse_busy(token: str) -> None:
        try:
            hub.check(token)
        except live.Busy as exc:
            raise problem(exc.status, str(exc), headers={"Retry-After": "5"}) from None

    def _still_allowed(token: str, permission: str):
        """Why a stream may go on no more (None: it may): its token revoked or expired, its roles changed."""
        async def check() -> str | None:
            try:
                who = await app.state.auth.principal(token)
            except Exception as exc:  # noqa: BLE001 - revoked, expired, or the sessions service away
                detail = getattr(exc, "detail", None)
                return detail.get("message") if isinstance(detail, dict) else str(exc)
            return None if access.allowed(who.get("roles") or [], permission) else \
                f"this needs the permission {permission}"
        return check

    def _seconds(seconds: int | None) -> float:
        cap = limits.current().live_stream_seconds
        return float(min(seconds, cap) if seconds else cap)

    @app.get("/api/live/executions", tags=["console"], response_class=StreamingResponse,
             responses={200: {"content": {"text/event-stream": {}}}})
    async def live_executions(request: Request, who: dict = need("execution.read"),
                              seconds: int | None = Query(None, ge=1, le=86_400, description=(
                                  "end the stream after this long (at most live_stream_seconds)"))) -> Response:
        """Server-sent events of the executions list: ``executions`` with the ids of executions that
        were requested, started or ended (read the list again), ``resync``, ``bye``."""
        token = auth.bearer(request.headers.get("authorization"))
        _refuse_busy(token)
        body = live.stream(hub, live.LIST, token, who=who, hello={"topic": "executions"}, seconds=_seconds(seconds),
                           still_allowed=_still_allowed(token, "execution.read"))
        return StreamingResponse(body, media_type="text/event-stream", headers=_SSE_HEADERS)

    @app.get("/api/live/executions/{execution_id}", tags=["console"], response_class=StreamingResponse,
             responses={200: {"content": {"text/event-stream": {}}}})
    async def live_execution(request: Request, who: dict = need("execution.read"),
                             execution_id: str = Path(pattern=EXECUTION_ID),
                             seconds: int | None = Query(None, ge=1, le=86_400, description=(
                                 "end the stream after this long (at most live_stream_seconds)"))) -> Response:
        """Server-sent events of one execution: ``events`` (counts by name and the newest events
        recorded), ``state`` (its view after them, as ``/state`` answers), ``resync``, ``bye``. An id
        not recorded yet is watched all the same (an execution just started)."""
        token = auth.bearer(request.headers.get("authorization"))
        _refuse_busy(token)  # an id not recorded yet is fine: an execution just started is watched from its start
        body = live.stream(hub, execution_id, token, who=who,
                           hello={"topic": "execution", "execution_id": execution_id},
                           seconds=_seconds(seconds), still_allowed=_still_allowed(token, "execution.read"))
        return StreamingResponse(body, media_type="text/event-stream", headers=_SSE_HEADERS)

    # ------------------------------------------------------------------ the files
    app.mount(UI, _ConsoleFiles(directory=UI_DIR, html=True), name="console")


_SSE_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}


def _lint(content: str) -> tuple[Any, dict[str, Any] | None]:
    from noetl_mesh.lang.lint import lint_text
    from noetl_mesh.lang.validate import validate_text

    return lint_text(content), validate_text(content).document


__all__ = ["install", "UI", "UI_DIR"]
