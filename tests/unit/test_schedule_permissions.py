"""The scheduler's NATS user (infra/nats_auth.py): it alone touches the schedules stream and bucket (a
schedule message fires executions), it writes execution requests as itself, and only the gateway may
ask it. Enforced by the server: tests/integration/test_schedules.py."""
from __future__ import annotations

import pytest

from noetl_mesh.infra.nats_auth import SERVICES, WRITERS, permissions

INBOX = "_INBOX.UKEY"
OTHERS = ("gateway", "admission", "router", "loop-coordinator", "event-recorder", "sessions", "worker-default")


def matches(pattern: str, subject: str) -> bool:
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or (token != "*" and token != s[i]):
            return False
    return len(p) == len(s)


def may(user: str, action: str, subject: str) -> bool:
    rules = permissions(user, partitions=4, inbox=INBOX)[action]
    return any(matches(p, subject) for p in rules["allow"]) and not any(matches(p, subject) for p in rules["deny"])


SCHEDULES_API = ("noetl.schedule.def.s1", "noetl.schedule.fire.s1", "$KV.noetl_schedules.s1",
                 "$JS.API.STREAM.PURGE.NOETL_SCHEDULES", "$JS.API.STREAM.INFO.KV_noetl_schedules",
                 "$JS.API.DIRECT.GET.KV_noetl_schedules.$KV.noetl_schedules.s1",
                 "$JS.API.STREAM.MSG.GET.NOETL_SCHEDULES", "$JS.API.CONSUMER.DURABLE.CREATE.NOETL_SCHEDULES.scheduler",
                 "$JS.API.CONSUMER.MSG.NEXT.NOETL_SCHEDULES.scheduler", "$JS.ACK.NOETL_SCHEDULES.scheduler.1.2.3.4.5")


@pytest.mark.parametrize("user", OTHERS)
def test_only_the_scheduler_touches_the_schedules(user):
    for subject in SCHEDULES_API:
        assert not may(user, "publish", subject), (user, subject)
    assert not may(user, "subscribe", "noetl.q.schedule.add")
    assert not may(user, "publish", "noetl.evt.scheduler.ctl.x1")


def test_what_the_scheduler_may_do():
    assert "scheduler" in SERVICES and "scheduler" in WRITERS
    for subject in (*SCHEDULES_API[:1], *SCHEDULES_API[2:], "noetl.evt.scheduler.ctl.x1", "$JS.API.STREAM.INFO.NOETL_EVENTS",
                    "$JS.API.STREAM.PURGE.KV_noetl_schedules"):
        assert may("scheduler", "publish", subject), subject
    assert may("scheduler", "subscribe", "noetl.q.schedule.add") and may("scheduler", "subscribe", f"{INBOX}.x")
    for subject in ("noetl.schedule.fire.s1",  # only the server fires
                    "noetl.evt.gateway.ctl.x1", "noetl.evt.router.ctl.x1", "noetl.cmd.default.x1", "noetl.cancel.x1",
                    "$JS.API.STREAM.PURGE.NOETL_EVENTS", "$JS.API.STREAM.CREATE.NOETL_SCHEDULES",
                    "$JS.API.STREAM.DELETE.NOETL_SCHEDULES", "$JS.API.CONSUMER.DELETE.NOETL_SCHEDULES.scheduler",
                    "$KV.noetl_sessions.x", "$KV.noetl_members.scheduler.x", "noetl.q.sessions.bootstrap"):
        assert not may("scheduler", "publish", subject), subject
    for subject in ("noetl.q.catalog.get", "noetl.q.sessions.validate", "_INBOX.other.x", "noetl.schedule.fire.s1"):
        assert not may("scheduler", "subscribe", subject), subject
    assert permissions("scheduler", partitions=4, inbox=INBOX).get("allow_responses") is True


def test_the_gateway_asks_the_scheduler():
    for verb in ("add", "list", "get", "pause", "resume", "delete"):
        assert may("gateway", "publish", f"noetl.q.schedule.{verb}")
    for user in OTHERS[1:]:
        assert not may(user, "publish", "noetl.q.schedule.add"), user
