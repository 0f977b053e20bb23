"""The gateway's schedule routes (services/gateway/schedules.py) over a fake bus: the permission each
declares, a request checked before anything is asked (422 located, 413), the catalog asked (404), the
scheduler's own refusals mapped, and who may pause, resume and delete whose schedule."""
from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from noetl_mesh.core.schedules import Q_PREFIX
from noetl_mesh.infra.bus import Q_CATALOG_GET, BusError
from noetl_mesh.services.gateway import auth
from noetl_mesh.services.gateway.app import create_app

PEOPLE = {f"noetl_t_{name:_<43}": {"user_id": f"{i:032x}", "username": name, "kind": "token", "token_id": "t",
                                   "roles": [name]}
          for i, name in enumerate(("admin", "developer", "operator", "viewer"), 1)}
TOKEN = {who["username"]: token for token, who in PEOPLE.items()}


class Nc:
    is_connected, is_closed, is_reconnecting, is_connecting = True, False, False, False


class Bus:
    def __init__(self):
        self.nc = Nc()
        self.asked: list[tuple[str, dict]] = []
        self.answers: dict[str, Any] = {}

    async def request(self, subject: str, payload: dict, timeout: float = 10, expand: bool = False) -> Any:
        self.asked.append((subject, payload))
        answer = self.answers.get(subject, {})
        if isinstance(answer, Exception):
            raise answer
        return answer(payload) if callable(answer) else answer


class People:
    async def principal(self, token: str) -> dict:
        return PEOPLE[token]

    async def close(self) -> None:
        pass


class Audit:
    def __init__(self):
        self.records: list[str] = []

    async def record(self, action: str, who: Any, request: Any, **fields: Any) -> None:
        self.records.append(action)

    def later(self, action: str, who: Any, request: Any, **fields: Any) -> None:
        self.records.append(action)


@pytest.fixture
def gw():
    bus = Bus()
    app = create_app(bus)  # type: ignore[arg-type]
    app.state.auth, app.state.auditor = People(), Audit()
    with TestClient(app) as client:
        client.bus, client.audit = bus, app.state.auditor
        yield client


def call(gw, method: str, path: str, who: str, **kw: Any):
    return gw.request(method, path, headers={"Authorization": f"Bearer {TOKEN[who]}"}, **kw)


def asked(gw) -> list[str]:
    return [subject for subject, _ in gw.bus.asked]


def test_the_permission_of_each_route():
    found = auth.declarations(create_app(Bus()).routes)  # type: ignore[arg-type]
    assert {k: v for k, v in found.items() if k[1].startswith("/api/schedules")} == {
        ("POST", "/api/schedules"): "execution.start", ("GET", "/api/schedules"): "execution.read",
        ("GET", "/api/schedules/{schedule_id}"): "execution.read",
        ("POST", "/api/schedules/{schedule_id}/pause"): "execution.cancel.own",
        ("POST", "/api/schedules/{schedule_id}/resume"): "execution.start",
        ("DELETE", "/api/schedules/{schedule_id}"): "execution.cancel.own"}


def test_a_bad_schedule_is_refused_before_anything_is_asked(gw):
    bad = call(gw, "POST", "/api/schedules", "developer",
               json={"path": "p", "cron": "* * * * *", "timezone": "Mars/Base", "name": "a b"})
    assert bad.status_code == 422
    errors = {e["location"] for e in bad.json()["detail"]["errors"]}
    assert errors == {"body.cron", "body.timezone", "body.name"}
    big = call(gw, "POST", "/api/schedules", "developer", json={"path": "p", "every": 5, "workload": {"x": "y" * 300_000}})
    assert big.status_code == 413 and big.json()["detail"]["location"] == "body.workload"
    extra = call(gw, "POST", "/api/schedules", "developer", json={"path": "p", "every": 5, "colour": "red"})
    assert extra.status_code == 422  # the body model forbids unknown fields
    assert call(gw, "GET", "/api/schedules/a.b", "viewer").status_code == 422  # not an id
    assert asked(gw) == []


def test_adding_asks_the_catalog_then_the_scheduler(gw):
    gw.bus.answers[Q_CATALOG_GET] = BusError("not_found", "no playbook p")
    missing = call(gw, "POST", "/api/schedules", "developer", json={"path": "p", "every": "5m"})
    assert missing.status_code == 404 and asked(gw) == [Q_CATALOG_GET]
    gw.bus.answers[Q_CATALOG_GET] = {"path": "p", "version": 2}
    gw.bus.answers[Q_PREFIX + "add"] = lambda payload: {"id": "s1", "spec": {"every": 300}}
    made = call(gw, "POST", "/api/schedules", "developer", json={"path": "p", "every": "5m", "version": 2})
    assert made.status_code == 201 and made.json()["id"] == "s1"
    subject, payload = gw.bus.asked[-1]
    assert subject == Q_PREFIX + "add" and payload["schedule"] == {"path": "p", "every": "5m", "version": 2}
    assert payload["created_by"] == {"user_id": f"{2:032x}", "username": "developer", "kind": "token", "token_id": "t",
                                     "roles": ["developer"]}
    assert gw.audit.records == ["schedule.created"]
    gw.bus.answers[Q_PREFIX + "add"] = BusError("invalid_schedule", "NATS refused",
                                                [{"location": "cron", "message": "pattern is invalid"}])
    refused = call(gw, "POST", "/api/schedules", "developer", json={"path": "p", "cron": "0 0 0 * * *"})
    assert refused.status_code == 422 and refused.json()["detail"]["errors"][0]["location"] == "body.cron"
    gw.bus.answers[Q_PREFIX + "add"] = BusError("conflict", "a schedule named 'x' exists")
    assert call(gw, "POST", "/api/schedules", "developer", json={"path": "p", "every": 9, "name": "x"}).status_code == 409
    assert call(gw, "POST", "/api/schedules", "viewer", json={"path": "p", "every": 9}).status_code == 403


@pytest.mark.parametrize("who, verb, status", [
    ("developer", "pause", 403), ("developer", "delete", 403), ("developer", "resume", 403),  # the admin's
    ("operator", "pause", 200), ("operator", "delete", 204), ("operator", "resume", 403),  # cancel.any; not start
    ("admin", "resume", 200), ("viewer", "pause", 403),
])
def test_who_may_act_on_another_users_schedule(gw, who, verb, status):
    gw.bus.answers[Q_PREFIX + "get"] = {"id": "s1", "created_by": {"user_id": f"{1:032x}"}}  # the admin's
    method, path = ("DELETE", "/api/schedules/s1") if verb == "delete" else ("POST", f"/api/schedules/s1/{verb}")
    resp = call(gw, method, path, who)
    assert resp.status_code == status, resp.text
    assert (Q_PREFIX + verb in asked(gw)) == (status < 400)


def test_one_may_act_on_ones_own(gw):
    gw.bus.answers[Q_PREFIX + "get"] = {"id": "s1", "created_by": {"user_id": f"{2:032x}"}}  # the developer's
    for verb in ("pause", "resume"):
        assert call(gw, "POST", f"/api/schedules/s1/{verb}", "developer").status_code == 200
    assert call(gw, "DELETE", "/api/schedules/s1", "developer").status_code == 204
    assert gw.audit.records == ["schedule.paused", "schedule.resumed", "schedule.deleted"]
    gw.bus.answers[Q_PREFIX + "get"] = BusError("not_found", "schedule s2 does not exist")
    assert call(gw, "POST", "/api/schedules/s2/pause", "developer").status_code == 404
