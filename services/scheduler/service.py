"""scheduler: starts catalog playbooks on schedules (D31). NATS fires them; this service keeps the
schedule messages in step with their records and turns each firing into one execution request.

- ``noetl.q.schedule.{add,list,get,pause,resume,delete}`` (request/reply, queue group ``scheduler``):
  the records in KV, the schedule messages in ``NOETL_SCHEDULES``.
- the firings (``noetl.schedule.fire.*``, durable ``scheduler``, shared by the replicas): each is
  decided by ``schedules.on_firing`` against its record and, unless paused or deleted, published as a
  ``playbook.execution.requested`` whose ids derive from the schedule and the fire time.
- every ``reconcile_every`` seconds (and at start): ``schedules.reconcile`` re-arms a record left
  without its schedule message, and disarms a message whose record is gone or paused (a replica that
  died between the two writes).
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any

from noetl_mesh import limits
from noetl_mesh.core import schedules
from noetl_mesh.core.events import carried_roles
from noetl_mesh.core.schedules import DURABLE, FIRE_PREFIX, Q_PREFIX, STREAM, ScheduleError
from noetl_mesh.infra import tracing
from noetl_mesh.infra.bus import Bus, BusError, loads, pull_loop, release, unsubscribe_all
from noetl_mesh.infra.micro import Consumer

from noetl_mesh.services.sessions.service import Q_USERS_STANDING

from .store import ScheduleStore

log = logging.getLogger("noetl.scheduler")
PRINCIPAL_KEYS = ("user_id", "username", "kind", "session_id", "token_id")
FETCH_TIMEOUT = 1.0  # the firings' long poll; a stopping scheduler is gone within it


class SchedulerService:
    name = "scheduler"

    def __init__(self, bus: Bus, ack_wait: float = 30.0, reconcile_every: float = 60.0):
        self.bus = bus
        self.store = ScheduleStore(bus.js)
        self.ack_wait, self.reconcile_every = ack_wait, reconcile_every
        self.stop_event = asyncio.Event()
        self.subs: list[Any] = []
        self.tasks: list[asyncio.Task] = []
        self.started = 0  # requests published by this replica
        self.firings = Consumer(name="firings", stream=STREAM, subject=FIRE_PREFIX + "*", durable=DURABLE)
        self.consumers = [self.firings]  # what `nats micro stats` and `noetl ps` show (infra/micro.py)

    async def start(self) -> None:
        await self.bus.attach()
        await self.store.open()
        for verb in schedules.VERBS:
            self.subs.append(await self.bus.serve(Q_PREFIX + verb, getattr(self, verb), queue=self.name))
        sub = await self.bus.durable(STREAM, DURABLE, FIRE_PREFIX + "*", max_ack_pending=64,
                                     ack_wait=self.ack_wait, max_deliver=20)
        self.tasks = [asyncio.create_task(self._firings(sub), name="scheduler-fire"),
                      asyncio.create_task(self._reconciling(), name="scheduler-reconcile")]

    async def ready(self) -> dict[str, Any]:
        """Answering its subjects and reading the firings."""
        ok = bool(self.subs) and bool(self.tasks) and not any(t.done() for t in self.tasks) \
            and not self.stop_event.is_set()
        return {"ok": ok, **({} if ok else {"error": "not reading the firings"})}

    async def stop(self) -> None:
        self.stop_event.set()
        await unsubscribe_all(self.subs)
        # an open fetch ends within its timeout
        _, late = await asyncio.wait(self.tasks, timeout=self.bus.grace(2 * FETCH_TIMEOUT + 3)) if self.tasks else ((), ())
        for task in late:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    # ------------------------------------------------------------------ firings
    async def _firings(self, sub) -> None:
        linger = FETCH_TIMEOUT + 0.2  # stopped mid-fetch: the server may deliver until the request expires
        try:
            # one at a time: a fetch for more waits its whole timeout for them, delaying the first
            await pull_loop(sub, self.fire, self.stop_event, timeout=FETCH_TIMEOUT, counts=self.firings)
            linger = 0.2
        finally:
            await release(sub, self.bus.grace(linger))  # what arrives late goes back at once, not after ack_wait

    async def fire(self, msg) -> None:
        fired = loads(msg.data)  # not JSON: pull_loop drops it
        found = await self.store.get(fired["id"]) if isinstance(fired, dict) and isinstance(fired.get("id"), str) \
            and schedules.ID.match(fired["id"]) else None
        decision = schedules.on_firing(msg.subject, fired, found[0] if found else None, msg.headers or {},
                                       msg.metadata.timestamp.timestamp(), time.time())
        if decision.start is not None:
            record, revision = found
            # the schedule acts for its creator: not once the creator could not start it (no answer: retried)
            ask = schedules.standing_request(record)
            standing = await self.bus.request(Q_USERS_STANDING, ask) if ask else None
            refusal = schedules.creator_refusal(record, standing)
            if refusal is not None:
                log.warning("scheduler: schedule %s paused: %s", record["id"], refusal)
                await self.store.update(schedules.with_paused(record, True, time.time(), refusal), revision)
                await self.store.disarm(record["id"])
                await msg.ack_sync()
                return
            eid = decision.start["execution_id"]
            with tracing.span("scheduler playbook.execution.requested", service=self.name, execution_id=eid,
                              **{"noetl.schedule_id": str(fired.get("id"))}):
                await self.bus.publish_event(decision.start)  # Nats-Msg-Id: the request's event id
            self.started += 1
        else:
            log.info("scheduler: firing dropped: %s", decision.reason)
            if decision.stale:
                await self.store.disarm(fired["id"], firings=False)
        await msg.ack_sync()

    async def _reconciling(self) -> None:
        while not self.stop_event.is_set():
            try:
                records, armed = await self.store.records(), await self.store.armed()
                to_arm, to_disarm = schedules.reconcile(records, armed, time.time())
                for record in to_arm:
                    log.warning("scheduler: schedule %s had no schedule message: armed again", record["id"])
                    await self.store.arm(record, limits.current().schedule_fire_ttl)
                for sid in to_disarm:
                    log.warning("scheduler: schedule message %s has no active schedule: removed", sid)
                    await self.store.disarm(sid)
            except Exception as exc:  # noqa: BLE001 - NATS away: the next round tries again
                log.warning("scheduler: reconcile failed (%s: %s)", type(exc).__name__, exc)
            try:
                await asyncio.wait_for(self.stop_event.wait(), self.reconcile_every)
            except asyncio.TimeoutError:
                pass

    # ------------------------------------------------------------------ requests
    async def add(self, req: dict[str, Any]) -> dict[str, Any]:
        now, lim = time.time(), limits.current()
        try:
            fields = schedules.check(req.get("schedule"), now=now, max_bytes=lim.max_schedule_bytes)
        except ScheduleError as exc:
            raise BusError("invalid_schedule", str(exc), exc.errors) from None
        ids = await self.store.ids()
        if len(ids) >= lim.max_schedules:
            raise BusError("conflict", f"there are {lim.max_schedules} schedules already, the limit max_schedules "
                                       "(NOETL_LIMIT_MAX_SCHEDULES): delete one first")
        who = req.get("created_by") if isinstance(req.get("created_by"), dict) else {}
        created_by: dict[str, Any] = {k: str(who[k])[:256] for k in PRINCIPAL_KEYS if who.get(k) is not None}
        roles = carried_roles(who.get("roles"))
        if roles is not None:  # the roles the request carried: its firings carry them (D33)
            created_by["roles"] = roles
        uid = created_by.get("user_id")
        if uid is not None and sum((r.get("created_by") or {}).get("user_id") == uid
                                   for r in (await self.store.records(ids)).values()) >= lim.max_schedules_per_user:
            raise BusError("conflict", f"{created_by.get('username') or uid} has {lim.max_schedules_per_user} schedules "
                                       "already, the limit max_schedules_per_user (NOETL_LIMIT_MAX_SCHEDULES_PER_USER): "
                                       "delete one first")
        record = schedules.definition(
            fields, schedule_id=secrets.token_hex(8), generation=secrets.token_hex(8), now=now, created_by=created_by)
        await self.store.create(record)
        try:
            await self.store.arm(record, lim.schedule_fire_ttl)
        except BusError:
            await self.store.remove(record["id"])
            raise
        return schedules.view(record, now, anchor=now)

    async def get(self, req: dict[str, Any]) -> dict[str, Any]:
        record, _ = await self._record(req)
        n = req.get("next") if isinstance(req.get("next"), int) else 5
        anchor = await self.store.anchor(record["id"])
        return schedules.view(record, time.time(), max(0, min(n, schedules.MAX_NEXT)), anchor)

    async def list(self, req: dict[str, Any]) -> dict[str, Any]:
        now = time.time()
        records = sorted((await self.store.records()).values(), key=lambda r: (r["created_at"], r["id"]), reverse=True)
        anchors = await asyncio.gather(*(self.store.anchor(r["id"]) if "every" in r["spec"] else _none()
                                         for r in records))
        views = [schedules.view(r, now, 1, a, full=False) for r, a in zip(records, anchors)]
        offset = req.get("offset") if isinstance(req.get("offset"), int) and req["offset"] >= 0 else 0
        limit = req.get("limit") if isinstance(req.get("limit"), int) and req["limit"] > 0 else 100
        return schedules.page(views, offset, min(limit, 1000), limits.current().max_reply_bytes)

    async def pause(self, req: dict[str, Any]) -> dict[str, Any]:
        record, revision = await self._record(req)
        if not record["paused"]:
            record = schedules.with_paused(record, True, time.time())
            await self.store.update(record, revision)
        await self.store.disarm(record["id"])
        return schedules.view(record, time.time())

    async def resume(self, req: dict[str, Any]) -> dict[str, Any]:
        record, revision = await self._record(req)
        now = time.time()
        if schedules.finished(record, now):
            raise BusError("conflict", f"schedule {record['id']} was due at {record['spec']['at']}: that has passed")
        if record["paused"]:
            record = schedules.with_paused(record, False, now)
            await self.store.update(record, revision)
            await self.store.arm(record, limits.current().schedule_fire_ttl)
        return schedules.view(record, now, anchor=await self.store.anchor(record["id"]))

    async def delete(self, req: dict[str, Any]) -> dict[str, Any]:
        record, _ = await self._record(req)
        await self.store.remove(record["id"])  # first: a firing from now on finds no record and is dropped
        await self.store.disarm(record["id"])
        return {"id": record["id"], "deleted": True}

    async def _record(self, req: dict[str, Any]) -> tuple[dict[str, Any], int]:
        sid = req.get("id")
        if not isinstance(sid, str) or not schedules.ID.match(sid):
            raise BusError("bad_request", f"{str(sid)[:80]!r} is not a schedule id")
        found = await self.store.get(sid)
        if found is None:
            raise BusError("not_found", f"schedule {sid} does not exist")
        return found


async def _none() -> None:
    return None
