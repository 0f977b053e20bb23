"""Gateway routes of schedules (D31): thin maps onto the scheduler's ``noetl.q.schedule.*``.

Who may do what: a schedule starts executions as the user who created it, so creating one needs
``execution.start``, like starting an execution; reading them ``execution.read``. Pausing and deleting
are like cancelling: one's own schedules with ``execution.cancel.own``, anyone's with
``execution.cancel.any`` (so an operator can stop a runaway schedule); resuming needs
``execution.start`` and, for another user's schedule, ``execution.cancel.any`` too. The request is
checked here first (core/schedules.py ``check``: 422 with each error's location, 413 over
``max_schedule_bytes``) and the playbook must be in the catalog (404). Created, paused, resumed and
deleted schedules are recorded in the audit log.
"""
from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, HTTPException, Path, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from noetl_mesh import limits
from noetl_mesh.core import schedules
from noetl_mesh.core.schedules import Q_PREFIX, ScheduleError
from noetl_mesh.infra import tracing
from noetl_mesh.infra.bus import Q_CATALOG_GET, BusError
from noetl_mesh.lang.paths import MAX_PATH
from noetl_mesh.services.gateway import auth
from noetl_mesh.services.gateway.app import _json_request, _Shell, json_body, problem
from noetl_mesh.services.gateway.auth import need
from noetl_mesh.services.gateway.body import INT64_MAX


def _schedule_id() -> Any:
    return Path(pattern=schedules.ID.pattern.replace("\\Z", "$"),  # pydantic's regex dialect
                description="the schedule's id (its name, when it was given one)")


class ScheduleBody(BaseModel):
    """A playbook of the catalog started on a schedule: exactly one of ``cron`` (six fields, seconds
    first, with an optional IANA ``timezone``), ``every`` (a duration) or ``at`` (an instant)."""

    model_config = ConfigDict(extra="forbid")
    path: str = Field(max_length=MAX_PATH, description="the playbook's catalog path (lang/paths.py)")
    version: int | None = Field(None, ge=1, le=INT64_MAX,
                                description="a catalog version; none: the latest at each firing")
    workload: dict[str, Any] | None = Field(None, description="merged over the playbook's workload")
    cron: str | None = Field(None, max_length=schedules.MAX_EXPRESSION,
                             description="second minute hour day-of-month month day-of-week, e.g. '0 */5 * * * *'")
    timezone: str | None = Field(None, max_length=64, description="IANA time zone of the cron (default UTC)")
    every: int | float | str | None = Field(None, description='a duration: 90, "5m", "2h", "PT5M" (at least 1 s)')
    at: str | None = Field(None, max_length=64, description="an ISO-8601 instant with its time zone")
    name: str | None = Field(None, max_length=64, description="the schedule's id (default: generated)")


def _checked(fields: dict[str, Any]) -> None:
    try:
        schedules.check(fields, now=time.time(), max_bytes=limits.current().max_schedule_bytes)
    except ScheduleError as exc:
        raise _invalid(exc.errors) from None


def _invalid(errors: list[dict[str, Any]]) -> HTTPException:
    items = [{**e, "location": f"body.{e['location']}" if e.get("location") else "body"} for e in errors]
    first = items[0]
    more = f" (and {len(items) - 1} more)" if len(items) > 1 else ""
    status = 413 if any(e.get("type") == "too_large" for e in items) else 422
    return problem(status, f"{first['location']}: {first['message']}{more}", first["location"], items)


async def _ask(request: Request, verb: str, payload: dict[str, Any]) -> Any:
    """Ask the scheduler; its ``invalid_schedule`` is a 422 with the errors located in the body."""
    try:
        return await _Shell(request.app.state.bus).ask(Q_PREFIX + verb, payload)
    except HTTPException as exc:
        cause = exc.__cause__
        if isinstance(cause, BusError) and cause.kind == "invalid_schedule":
            raise _invalid(cause.details if isinstance(cause.details, list) and cause.details else
                           [{"location": "", "message": cause.message}]) from None
        raise


async def _own(request: Request, who: dict[str, Any], schedule_id: str, verb: str) -> dict[str, Any]:
    """The schedule, when the caller created it or may act on anyone's (``execution.cancel.any``)."""
    current = await _ask(request, "get", {"id": schedule_id, "next": 0})
    auth.check_owner(request, who, (current.get("created_by") or {}).get("user_id"),
                     f" to {verb} a schedule another user created", {"schedule": schedule_id})
    return current


def install(app: FastAPI) -> None:
    """Add the schedule routes to the gateway's app (called by ``create_app``, before it checks every
    route's access declaration: FastAPI's included routers are not routes of the app it could check)."""

    @app.post("/api/schedules", status_code=201, tags=["schedules"], openapi_extra=_json_request(ScheduleBody))
    async def add_schedule(request: Request, who: dict = need("execution.start"),
                           body: ScheduleBody = json_body(ScheduleBody)) -> dict[str, Any]:
        """Start a catalog playbook on a schedule; each firing starts one execution, requested by the
        caller. Answers the schedule with its next fire times."""
        with tracing.span("gateway POST /api/schedules", service="gateway"):
            fields = body.model_dump(exclude_none=True)
            _checked(fields)
            await _Shell(request.app.state.bus).ask(Q_CATALOG_GET, {"path": body.path, "version": body.version},
                                                    "body.path")  # 404 when the catalog has no such playbook
            reply = await _ask(request, "add", {"schedule": fields, "created_by": auth.requested_by(who, proof=True)})
            await request.app.state.auditor.record("schedule.created", who, request, target={"schedule": reply["id"]},
                                                   details={"path": body.path, "spec": reply.get("spec")})
            return reply

    @app.get("/api/schedules", tags=["schedules"])
    async def list_schedules(request: Request, who: dict = need("execution.read"),
                             offset: int = Query(0, ge=0, le=2**31 - 1), limit: int = Query(100, ge=1, le=1000),
                             ) -> dict[str, Any]:
        """Schedules, newest first, without their workloads, each with its next fire time; a page is cut
        by size too (``next_offset`` says where the next starts)."""
        with tracing.span("gateway GET /api/schedules", service="gateway"):
            return await _ask(request, "list", {"offset": offset, "limit": limit})

    @app.get("/api/schedules/{schedule_id}", tags=["schedules"])
    async def get_schedule(request: Request, who: dict = need("execution.read"), schedule_id: str = _schedule_id(),
                           next: int = Query(5, ge=0, le=schedules.MAX_NEXT, description="how many next fire times")
                           ) -> dict[str, Any]:
        """One schedule with its next fire times."""
        with tracing.span("gateway GET /api/schedules/{id}", service="gateway"):
            return await _ask(request, "get", {"id": schedule_id, "next": next})

    @app.post("/api/schedules/{schedule_id}/pause", tags=["schedules"])
    async def pause_schedule(request: Request, who: dict = need("execution.cancel.own"),
                             schedule_id: str = _schedule_id()) -> dict[str, Any]:
        """Stop the firings (those not taken yet are dropped); another user's schedule needs
        ``execution.cancel.any``."""
        with tracing.span("gateway POST /api/schedules/{id}/pause", service="gateway"):
            await _own(request, who, schedule_id, "pause")
            reply = await _ask(request, "pause", {"id": schedule_id})
            await request.app.state.auditor.record("schedule.paused", who, request, target={"schedule": schedule_id})
            return reply

    @app.post("/api/schedules/{schedule_id}/resume", tags=["schedules"])
    async def resume_schedule(request: Request, who: dict = need("execution.start"),
                              schedule_id: str = _schedule_id()) -> dict[str, Any]:
        """Fire again from now on (an ``at`` whose instant has passed is 409); another user's schedule
        needs ``execution.cancel.any`` too."""
        with tracing.span("gateway POST /api/schedules/{id}/resume", service="gateway"):
            await _own(request, who, schedule_id, "resume")
            reply = await _ask(request, "resume", {"id": schedule_id})
            await request.app.state.auditor.record("schedule.resumed", who, request, target={"schedule": schedule_id})
            return reply

    @app.delete("/api/schedules/{schedule_id}", status_code=204, tags=["schedules"])
    async def delete_schedule(request: Request, who: dict = need("execution.cancel.own"),
                              schedule_id: str = _schedule_id()) -> Response:
        """Delete a schedule: no more firings; executions it started are not touched."""
        with tracing.span("gateway DELETE /api/schedules/{id}", service="gateway"):
            await _own(request, who, schedule_id, "delete")
            await _ask(request, "delete", {"id": schedule_id})
            await request.app.state.auditor.record("schedule.deleted", who, request, target={"schedule": schedule_id})
        return Response(status_code=204)
