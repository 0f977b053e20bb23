"""Whom a worker runs commands for (D33), against a sessions service that answers what the test says:
an active user on any pool; nobody disabled, on any pool; on a pool that names roles, the starter
within the roles its request carried. When that service does not answer, a pool that names no roles
runs the command; one that names roles hands it back (the error reaches the command's retry)."""
from __future__ import annotations

import asyncio

import pytest

from noetl_mesh.infra.bus import BusError
from noetl_mesh.sandbox import policy as sandbox
from noetl_mesh.services.worker.service import WorkerService


class Sessions:
    def __init__(self, answer):
        self.answer, self.asked = answer, 0

    async def request(self, subject, payload, timeout=10.0, expand=False):
        self.asked += 1
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def refusal(answer, command, roles=None):
    worker = WorkerService(Sessions(answer), pool="vault" if roles else "default")
    worker.policy = sandbox.from_env({sandbox.ENV["roles"]: roles} if roles else {})  # what start() reads
    return asyncio.run(worker._refusal(command)), worker.bus.asked


ANN = {"requested_by": {"user_id": "u1", "username": "ann", "roles": ["developer"]},
       "authored_by": {"user_id": "u1", "username": "ann"}}
ACTIVE = {"exists": True, "active": True, "roles": ["admin", "developer"]}


def test_an_active_user_runs_and_a_disabled_one_runs_nothing_on_any_pool():
    assert refusal(ACTIVE, ANN) == (None, 1)  # asked once for both: kept
    why, _ = refusal({**ACTIVE, "active": False}, ANN)
    assert why == "this execution was started by ann, who is disabled or removed: it runs no further task (D33)"
    assert refusal({"exists": False, "active": False, "roles": []}, ANN)[0].endswith("it runs no further task (D33)")
    assert refusal(ACTIVE, {}) == (None, 0)  # no user to check: a stack without users


def test_on_a_pool_with_roles_the_starter_counts_with_the_roles_its_request_carried():
    why, _ = refusal(ACTIVE, ANN, roles="admin")
    assert "who holds admin, developer now and whose request carried developer" in why
    full = {**ANN, "requested_by": {**ANN["requested_by"], "roles": ["admin", "developer"]}}
    assert refusal(ACTIVE, full, roles="admin")[0] is None
    old = {**ANN, "requested_by": {"user_id": "u1", "username": "ann"}}  # recorded before requests carried roles
    assert refusal(ACTIVE, old, roles="admin")[0] is None


def test_without_the_sessions_service_only_a_pool_with_roles_waits():
    away = BusError("unavailable", "no service answers noetl.q.users.standing")
    assert refusal(away, ANN)[0] is None
    with pytest.raises(BusError):
        refusal(away, ANN, roles="admin")
    why, _ = refusal(BusError("bad_request", "user_id: not an id"), ANN)
    assert why.startswith("the standing of the user who started this execution cannot be checked")


def test_a_report_that_cannot_be_encoded_is_unsendable_not_a_retry():
    """The worker fails the step engine_error on Unsendable (running the command again would send the
    same report again); any other error of the bus stays a retry."""
    from noetl_mesh.services.worker.service import EventBatcher, Unsendable

    class Bus:
        def __init__(self, error):
            self.error = error

        async def send_events(self, events, limit=None, flat=False):
            raise self.error

    async def report(error):
        batcher = EventBatcher(Bus(error))
        await batcher.add({"name": "step.done"})
        await batcher.close()

    with pytest.raises(Unsendable, match="TypeError: Integer exceeds 64-bit range"):
        asyncio.run(report(TypeError("Integer exceeds 64-bit range")))
    with pytest.raises(ConnectionError):
        asyncio.run(report(ConnectionError("no responders")))


def test_a_worker_takes_the_routers_cancel_notice_only():
    """At noetl.cancel.<execution>: the router's notice (no reply, its fields, its execution's subject)
    stops the execution's commands; a server's delivery there (a push consumer's, which a compromised
    worker could point at this subject) or any other body is ignored."""
    from types import SimpleNamespace

    import orjson

    def message(body, subject="noetl.cancel.x1", reply=""):
        return SimpleNamespace(data=orjson.dumps(body) if not isinstance(body, bytes) else body, subject=subject,
                               reply=reply)

    worker = WorkerService(Sessions(ACTIVE))
    command = {"command_id": "c", "execution_id": "x1", "pool": "default", "step": "s"}
    for ignored in (message(command), message({"execution_id": "x1"}, reply="$JS.ACK.NOETL_COMMANDS.lane-default-p0.1"),
                    message({"execution_id": "x2"}), message(b"not json"), message(["x1"])):
        asyncio.run(worker._on_cancel(ignored))
    assert "x1" not in worker.finished and "x2" not in worker.finished
    asyncio.run(worker._on_cancel(message({"execution_id": "x1", "status": "CANCELLED"})))
    assert "x1" in worker.finished


def test_a_standing_is_kept_its_ttl_and_an_error_a_second():
    from noetl_mesh.core.standing import StandingCache

    now, asked, answers = [0.0], [], [{"active": True}, RuntimeError("away"), {"active": False}]

    async def ask(uid):
        asked.append(uid)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    cache = StandingCache(ask, clock=lambda: now[0])

    async def main():
        assert await cache.get("u1", 10) == {"active": True}
        now[0] = 9.9
        assert await cache.get("u1", 10) == {"active": True} and asked == ["u1"]  # kept
        now[0] = 10.1
        for _ in range(2):  # asked again; the error kept a second, raised to each caller
            with pytest.raises(RuntimeError):
                await cache.get("u1", 10)
        assert len(asked) == 2
        now[0] = 11.2
        assert await cache.get("u1", 10) == {"active": False} and len(asked) == 3

    asyncio.run(main())
