"""Schedules (D31) on the real stack: NATS fires the schedule messages, two scheduler replicas (and two
of each control-plane service) turn the firings into executions, exactly one per tick, through a
restart of the schedulers; pause, resume and delete; the execution records its schedule; the gateway's
checks and roles; the CLI. And a schedule survives a restart of NATS itself (file storage)."""
from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from typing import Any

import nats
import pytest

from noetl_mesh import limits
from noetl_mesh.cli import main as cli
from noetl_mesh.client import GatewayClient, GatewayError
from noetl_mesh.core import schedules
from noetl_mesh.infra.bus import Bus, BusError
from noetl_mesh.infra.embedded import EmbeddedNats
from noetl_mesh.infra.nats_auth import NatsAuth, connect_options
from noetl_mesh.services.scheduler.store import ScheduleStore
from noetl_mesh.stack import free_port, start_service, stop_service

from conftest import new_user, start_stack, stop_stack

pytestmark = pytest.mark.integration

TICK = """apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: tick, path: tests/tick}
workload: {k: 0}
workflow:
  - step: start
    tool: {kind: noop, result: "{{ workload.k }}"}
"""
PASSWORD = "schedules-test-password"


async def paused(client: GatewayClient, schedule_id: str, timeout: float = 20) -> dict:
    """The schedule once it is paused (it pauses at its next firing), or as it is after ``timeout``."""
    deadline = time.time() + timeout
    while (got := await client.schedule(schedule_id))["status"] != "paused" and time.time() < deadline:
        await asyncio.sleep(0.2)
    return got


@pytest.fixture(scope="module")
def stack(module_pg):
    nats, loop, handle = start_stack(module_pg, replicas=2)
    handle.run(_register(handle))
    yield handle
    stop_stack(nats, loop, handle)


async def _register(handle) -> None:
    async with handle.client() as client:
        await client.register(TICK)


def fired_at(schedule_id: str, execution_ids: set[str], around: float) -> dict[str, int]:
    """The fire time of each execution a schedule started: its id derives from it (core/schedules.py)."""
    candidates = {schedules.execution_id(schedule_id, t): t for t in range(int(around) - 600, int(around) + 60)}
    return {eid: candidates[eid] for eid in execution_ids if eid in candidates}


def gaps(times: list[int]) -> int:
    """How many seconds between the first and the last have no fire time (each appears once: ids)."""
    return max(times) - min(times) + 1 - len(times)


def test_every_second_with_two_replicas_one_execution_per_tick(stack, monkeypatch):
    """``every: 1s`` for about 12 ticks with two schedulers: every firing the server made starts exactly
    one execution, also those made while no scheduler ran; pause stops the firings, resume restarts
    them, delete ends them; each execution completes and records its schedule and its creator."""
    schedulers = list(stack.stack.services("scheduler"))
    assert len(schedulers) == 2
    arms = []  # schedule messages written: the rest of the stream's messages are the server's firings
    arm = ScheduleStore.arm

    async def counted(self, record, fire_ttl):
        arms.append(record["id"])
        return await arm(self, record, fire_ttl)

    monkeypatch.setattr(ScheduleStore, "arm", counted)

    async def stored() -> int:
        admin = await Bus.connect(stack.nats_url, "probe", stack.admin)
        try:
            return (await admin.js.stream_info(schedules.STREAM)).state.last_seq
        finally:
            await admin.close()

    async def executions(client) -> dict[str, dict]:
        return {x["execution_id"]: x for x in await client.list_executions(limit=1000)}

    async def until(client, predicate, timeout=20.0):
        deadline = time.monotonic() + timeout
        while True:
            found = await executions(client)
            if predicate(found) or time.monotonic() > deadline:
                return found
            await asyncio.sleep(0.2)

    async def restart_schedulers() -> None:
        old = [r for r in stack.stack.running if r.name == "scheduler"]
        for r in old:
            await stop_service(r)
            stack.stack.running.remove(r)
        await asyncio.sleep(2.5)  # firings wait in the stream meanwhile
        running = await start_service("scheduler", stack.stack.settings)
        stack.stack.running.append(running)
        schedulers.append(running.service)

    async def go() -> dict[str, Any]:
        seq0 = await stored()
        async with stack.client() as client:
            me = await client.whoami()
            made = await client.schedule_add("tests/tick", every="1s", workload={"k": 7}, name="tick")
            assert made["id"] == "tick" and made["spec"] == {"every": 1} and made["status"] == "active"
            nexts = [schedules.parse_instant(t) for t in made["next_fire_times"]]
            assert len(nexts) == 5 and [b - a for a, b in zip(nexts, nexts[1:])] == [1, 1, 1, 1]
            await until(client, lambda f: len(f) >= 5)
            await restart_schedulers()
            await until(client, lambda f: len(f) >= 9)
            paused = await client.schedule_pause("tick")
            assert paused["status"] == "paused" and paused["next_fire_times"] == []
            paused_at = time.time()
            await asyncio.sleep(3)
            resuming_at = time.time()
            resumed = await client.schedule_resume("tick")
            assert resumed["status"] == "active" and resumed["next_fire_time"] is not None
            count = len(await executions(client))
            await until(client, lambda f: len(f) >= count + 3)
            await client.schedule_delete("tick")
            deleted_at = time.time()
            with pytest.raises(GatewayError) as gone:
                await client.schedule("tick")
            assert gone.value.status == 404
            assert "tick" not in [s["id"] for s in await client.schedules()]
            await asyncio.sleep(2.5)  # the server would have fired meanwhile
            firings = await stored() - seq0 - len(arms)
            final = await until(client, lambda f: len(f) >= firings, timeout=8)  # the recorder may lag
            states = {eid: await client.wait(eid, timeout=30) for eid in final}
            return {"me": me, "final": final, "states": states, "paused_at": paused_at,
                    "resuming_at": resuming_at, "deleted_at": deleted_at, "firings": firings}

    out = stack.run(go(), 120)
    final, states, firings = out["final"], out["states"], out["firings"]
    times = fired_at("tick", set(final), out["paused_at"])
    assert set(times) == set(final), "every execution is one the schedule's firings derive"
    # one execution per firing: as many as the server fired (but a firing it made as the pause or the
    # delete landed, which is dropped), each published once, ids distinct per tick
    assert arms == ["tick", "tick"] and firings - 2 <= len(final) <= firings, (firings, len(final))
    assert sum(s.started for s in schedulers) == len(final)
    # nothing fired between the pause and the resume, nor after the delete
    first = [t for t in times.values() if t <= out["paused_at"]]
    second = [t for t in times.values() if t > out["paused_at"]]
    assert min(second) > out["resuming_at"] and max(second) <= out["deleted_at"], (sorted(times.values()), out)
    # one per second, across the schedulers' restart too (a tick the server itself skips, stalled for
    # over a second on a busy machine, is the one gap allowed)
    assert len(first) >= 9 and gaps(first) <= 1, sorted(first)
    assert len(second) >= 3 and gaps(second) <= 1, sorted(second)
    assert all(s["status"] == "COMPLETED" for s in states.values())
    for eid, state in states.items():
        assert state["schedule"] == {"id": "tick", "fire_time": schedules.iso(times[eid])}
        assert state["steps"]["start"]["result"] == 7  # the schedule's workload
        assert final[eid]["requested_by"] == out["me"]["user_id"] and final[eid]["path"] == "tests/tick"


def test_the_gateway_checks_schedules_and_roles(stack, monkeypatch):
    async def people() -> dict[str, str]:
        tokens = {}
        async with stack.client() as admin:
            for role in ("viewer", "developer", "operator"):
                await admin.add_user(f"s-{role}", [role], password=PASSWORD)
                async with GatewayClient(stack.url, token="") as c:
                    c.use(None)
                    await c.login(f"s-{role}", PASSWORD)
                    tokens[role] = (await c.create_token("schedules"))["token"]
        return tokens

    async def go(tokens) -> None:
        async with stack.client() as admin:
            async def refused(call, status, where=None):
                with pytest.raises(GatewayError) as exc:
                    await call
                assert exc.value.status == status, exc.value
                if where:
                    assert where in [e["location"] for e in exc.value.errors], exc.value.errors
                return exc.value

            err = await refused(admin.schedule_add("tests/tick", cron="* * * * *"), 422, "body.cron")
            assert "six fields" in err.message
            await refused(admin.schedule_add("tests/tick", cron="0 0 * * * *", timezone="Europe/Nowhere"), 422,
                          "body.timezone")
            await refused(admin.schedule_add("tests/tick", every="1s", at="2030-01-01T00:00:00Z"), 422, "body")
            await refused(admin.schedule_add("tests/nothing-here", every="1h"), 404)
            await refused(admin.schedule_add("tests/tick", every="1h", workload={"x": "y" * 300_000}), 413,
                          "body.workload")
            hourly = await admin.schedule_add("tests/tick", cron="0 0 * * * *", timezone="Asia/Kolkata", name="hourly")
            assert [t[14:] for t in hourly["next_fire_times"]] == ["30:00Z"] * 5  # :00 in Kolkata is :30 UTC
            await refused(admin.schedule_add("tests/tick", every="1h", name="hourly"), 409)
            listed = await admin.schedules()
            assert [s["id"] for s in listed] == ["hourly"] and "workload" not in listed[0]
            assert listed[0]["next_fire_time"] == hourly["next_fire_times"][0]
            async with GatewayClient(stack.url, token=tokens["viewer"]) as viewer:
                assert (await viewer.schedule("hourly"))["id"] == "hourly"
                await refused(viewer.schedule_add("tests/tick", every="1h"), 403)
            async with GatewayClient(stack.url, token=tokens["developer"]) as dev:
                await refused(dev.schedule_pause("hourly"), 403)  # not its own
                await refused(dev.schedule_delete("hourly"), 403)
                own = await dev.schedule_add("tests/tick", every="1h")
                assert (await dev.schedule_pause(own["id"]))["status"] == "paused"
                await dev.schedule_delete(own["id"])
                ticking = await dev.schedule_add("tests/tick", every="1s")
            # a schedule acts for its creator: disabled, the creator's schedule pauses at its next firing
            me = next(u for u in await admin.users() if u["username"] == "s-developer")
            await admin.disable_user(me["user_id"])
            got = await paused(admin, ticking["id"])
            assert got["status"] == "paused" and got["paused_reason"] == "its creator s-developer is disabled", got
            await admin.schedule_delete(ticking["id"])
            # made with an API token: the token revoked, the schedule pauses at its next firing
            ci = await admin.create_token("ci", roles=["developer"])
            async with GatewayClient(stack.url, token=ci["token"]) as automation:
                by_token = await automation.schedule_add("tests/tick", every="1s")
            # its firings carry the roles the token had, not all its owner's (a pool checks them, D33)
            assert (await admin.schedule(by_token["id"]))["created_by"]["roles"] == ["developer"]
            await admin.revoke_token(ci["token_id"])
            got = await paused(admin, by_token["id"])
            assert got["status"] == "paused" and got["paused_reason"] == "the API token admin created it with is revoked or expired", got
            await admin.schedule_delete(by_token["id"])
            async with GatewayClient(stack.url, token=tokens["operator"]) as op:
                assert (await op.schedule_pause("hourly"))["status"] == "paused"  # execution.cancel.any
                await refused(op.schedule_resume("hourly"), 403)  # resuming starts executions
            await refused(admin.schedule("no-such"), 404)
            await admin.schedule_delete("hourly")
            audit = [r["action"] for r in await admin.audit(action="schedule", limit=50)]
            assert {"schedule.created", "schedule.paused", "schedule.deleted"} <= set(audit)

            # at: one firing at its instant, then finished (resuming it is a conflict)
            at = time.time() + 2
            once = await admin.schedule_add("tests/tick", at=schedules.iso(at), name="once")
            state = await admin.wait(schedules.execution_id("once", int(at)), timeout=20)  # 404 until it fires
            assert state["status"] == "COMPLETED" and state["schedule"]["fire_time"] == once["spec"]["at"]
            assert (await admin.schedule("once"))["status"] == "finished"
            await refused(admin.schedule_resume("once"), 409)
            await admin.schedule_delete("once")

    stack.run(go(stack.run(people())), 120)

    # the command line, through the same gateway
    monkeypatch.setenv("NOETL_TOKEN", stack.token)
    gw = ["--gateway", stack.url]
    assert cli(["schedule", "add", "tests/tick", "--cron", "0 0 12 * * mon-fri", "--timezone", "Europe/Paris",
                "--workload", '{"k": 1}', "--name", "noon", *gw]) == 0
    assert cli(["schedule", "add", "tests/tick", "--every", "1h", "--at", "2030-01-01T00:00:00Z", *gw]) == 2
    for verb in ("pause", "resume", "get"):
        assert cli(["schedule", verb, "noon", *gw]) == 0
    assert cli(["schedule", "delete", "noon", *gw]) == 0
    assert cli(["schedule", "get", "noon", *gw]) == 1


def test_one_user_cannot_take_every_schedule_of_the_stack(stack):
    async def go():
        token = await new_user(stack, "s-many", ["developer"])
        async with stack.client() as admin:
            made = []
            with limits.override(max_schedules_per_user=2):
                async with GatewayClient(stack.url, token=token) as many:
                    for _ in range(2):
                        made.append((await many.schedule_add("tests/tick", every="1h"))["id"])
                    with pytest.raises(GatewayError) as exc:
                        await many.schedule_add("tests/tick", every="1h")
                    assert exc.value.status == 409 and "s-many has 2 schedules already" in exc.value.message
                made.append((await admin.schedule_add("tests/tick", every="1h"))["id"])  # another user may
            for sid in made:
                await admin.schedule_delete(sid)

    stack.run(go(), 60)


def test_a_schedule_path_is_a_catalog_path_at_the_gateway_and_at_the_scheduler(stack):
    """``../../etc/passwd`` is no catalog path: the gateway answers 422 at body.path (before asking the
    catalog), the scheduler refuses it asked directly, and the catalog never registers such a path."""
    async def go() -> None:
        async with stack.client() as admin:
            for path in ("../../etc/passwd", "/etc/passwd", "tests//tick"):
                with pytest.raises(GatewayError) as exc:
                    await admin.schedule_add(path, every="1h")
                assert exc.value.status == 422 and exc.value.errors[0]["location"] == "body.path", exc.value
                assert "a catalog path is segments" in exc.value.message
            with pytest.raises(GatewayError) as exc:
                await admin.register(TICK.replace("path: tests/tick", "path: ../../etc/passwd"))
            assert exc.value.status == 422 and "segment '..' starts with '.'" in str(exc.value.errors)
            settings = stack.stack.settings
            bus = await Bus.connect(settings.nats_url, "test-gateway", settings.creds_for("gateway"))
            try:
                with pytest.raises(BusError) as refused:
                    await bus.request(schedules.Q_PREFIX + "add", {"schedule": {"path": "../../etc/passwd", "every": "1h"},
                                                                   "created_by": {"user_id": "0" * 32}})
                assert refused.value.kind == "invalid_schedule"
                assert [e["location"] for e in refused.value.details] == ["path"]
            finally:
                await bus.close()
            assert all(s["path"] != "../../etc/passwd" for s in await admin.schedules())

    stack.run(go())


def test_cli_lists_schedules(stack, monkeypatch, capsys):
    monkeypatch.setenv("NOETL_TOKEN", stack.token)
    gw = ["--gateway", stack.url]
    assert cli(["schedule", "add", "tests/tick", "--every", "90", "--name", "slow", *gw]) == 0
    capsys.readouterr()
    assert cli(["schedule", "list", *gw]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(s["id"], s["spec"], s["status"]) for s in listed] == [("slow", {"every": 90}, "active")]
    assert cli(["schedule", "delete", "slow", *gw]) == 0


def test_a_schedule_survives_a_restart_of_nats():
    """The schedule message lives in a file-stored stream: after NATS restarts, it is still there and
    the server fires it again (one catch-up firing for the ticks it was down, not one each)."""
    store = tempfile.mkdtemp(prefix="noetl-sched-nats-")
    port = free_port()
    server = EmbeddedNats(store_dir=store, port=port).start()

    async def firings(bus, sub, wait: float) -> list:
        got, deadline = [], time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                for msg in await sub.fetch(10, timeout=0.5):
                    got.append(msg)
                    await msg.ack_sync()
            except Exception:  # noqa: BLE001 - an empty fetch, or the server away
                await asyncio.sleep(0.1)
        return got

    async def go() -> None:
        nonlocal server
        bus = await Bus.connect(server.url, "probe")
        try:
            await bus.setup(2)
            store_ = ScheduleStore(bus.js)
            await store_.open()
            record = schedules.definition(schedules.check({"path": "p", "every": 1}, now=time.time(), max_bytes=4096),
                                          schedule_id="r1", generation="g", created_by={}, now=time.time())
            await store_.create(record)
            await store_.arm(record, 3600)
            sub = await bus.durable(schedules.STREAM, "probe", schedules.FIRE_PREFIX + "*", max_ack_pending=10)
            before = await firings(bus, sub, 2.5)
            assert len(before) >= 1
            server.stop()
            await asyncio.sleep(2.0)
            server = EmbeddedNats(store_dir=store, port=port).start()
            restarted = time.time()
            after = await firings(bus, sub, 3.5)
            assert (await store_.get("r1"))[0] == record and "r1" in await store_.armed()
            late = [m for m in after if m.metadata.timestamp.timestamp() >= restarted - 0.5]
            assert len(late) >= 2  # it fires again after the restart
            stamps = [m.metadata.timestamp.timestamp() for m in late]
            assert all(b - a > 0.4 for a, b in zip(stamps, stamps[1:]))  # no burst of missed ticks
        finally:
            await bus.close()

    try:
        asyncio.run(go())
    finally:
        server.stop()
        shutil.rmtree(store, ignore_errors=True)


def test_only_the_scheduler_may_touch_the_schedules(tmp_path):
    """Enforced by the server: another service's credentials cannot write a schedule message (it would
    fire executions), a firing, a definition, nor purge them; the scheduler's can."""
    auth = NatsAuth(tmp_path / "creds").ensure()
    server = EmbeddedNats(auth=auth).start()

    async def as_user(user: str):
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc).lower())

        nc = await nats.connect(server.url, error_cb=on_error, allow_reconnect=False,
                                **connect_options(auth.file(user)))
        return nc, nc.jetstream(timeout=0.3), errors  # a refused request is never answered

    async def go() -> None:
        admin = await Bus.connect(server.url, "setup", auth.admin)
        await admin.setup(2)
        await admin.close()
        for user in ("gateway", "worker-default"):
            nc, js, errors = await as_user(user)
            try:
                for call in (js.publish("noetl.schedule.def.evil", b"{}", stream=schedules.STREAM,
                                        headers={"Nats-Schedule": "@every 1s",
                                                 "Nats-Schedule-Target": "noetl.schedule.fire.evil"}),
                             js.publish("noetl.schedule.fire.evil", b"{}", stream=schedules.STREAM),
                             js.publish("$KV.noetl_schedules.evil", b"{}"),
                             js.purge_stream(schedules.STREAM), js.key_value(schedules.BUCKET)):
                    with pytest.raises(Exception):  # noqa: B017 - refused: never answered
                        await call
                await nc.flush()
                await asyncio.sleep(0.1)
                assert sum("permissions violation" in e for e in errors) >= 5, (user, errors)
            finally:
                await nc.close()
        scheduler = await Bus.connect(server.url, "scheduler", auth.for_service("scheduler"))
        try:
            store = ScheduleStore(scheduler.js)
            await store.open()
            assert await store.armed() == set() and await store.records() == {}
        finally:
            await scheduler.close()
        assert len(server.violations()) >= 10

    try:
        asyncio.run(go())
    finally:
        server.stop()
