"""The scheduler's NATS adapters: the definition records (KV ``noetl_schedules``) and the schedule
messages (``NOETL_SCHEDULES``, ``noetl.schedule.def.<id>``) that make the server fire. Made by setup
(infra/schedules.py); this only uses them, waiting for them while they do not exist yet."""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import nats.errors
import orjson
from nats.js.errors import (BadRequestError, BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError,
                            NotFoundError)

from noetl_mesh.core import schedules
from noetl_mesh.core.schedules import BUCKET, STREAM, def_subject, fire_subject
from noetl_mesh.infra.bus import BusError
from noetl_mesh.infra.schedules import UNSUPPORTED, supported

log = logging.getLogger("noetl.scheduler")
KV_STREAM = f"KV_{BUCKET}"
KV_SUBJECT = f"$KV.{BUCKET}."


class ScheduleStore:
    def __init__(self, js):
        self.js = js
        self.kv = None
        self.supported = True  # the server fires the schedule messages (nats-server 2.14+)

    async def open(self) -> None:
        """Bind the bucket (and check the stream), waiting for setup to have made them."""
        waited = said = 0.0
        while True:
            try:
                self.supported = supported((await self.js.stream_info(STREAM)).config)
                if not self.supported:
                    log.error("scheduler: %s", UNSUPPORTED)
                self.kv = await self.js.key_value(BUCKET)
                return
            except (NotFoundError, BucketNotFoundError):
                why = f"{STREAM} or the bucket {BUCKET} does not exist yet (made by `noetl setup`, as the NATS admin)"
            except (nats.errors.Error, asyncio.TimeoutError) as exc:
                why = f"JetStream does not answer ({type(exc).__name__})"
            if waited - said >= 10 or (waited and not said):
                log.warning("scheduler: waiting: %s", why)
                said = waited
            await asyncio.sleep(0.5)
            waited += 0.5

    # ------------------------------------------------------------------ records
    async def get(self, schedule_id: str) -> tuple[dict[str, Any], int] | None:
        """The record and its revision; None when there is none."""
        try:
            entry = await self.kv.get(schedule_id)
        except KeyNotFoundError:
            return None
        return (orjson.loads(entry.value), entry.revision) if entry.value else None

    async def create(self, record: dict[str, Any]) -> None:
        try:
            await self.kv.create(record["id"], orjson.dumps(record))
        except KeyWrongLastSequenceError:
            raise BusError("conflict", f"a schedule named {record['id']!r} exists") from None

    async def update(self, record: dict[str, Any], revision: int) -> None:
        """Replace the record if it is still at ``revision`` (else ``conflict``: changed meanwhile)."""
        try:
            await self.kv.update(record["id"], orjson.dumps(record), last=revision)
        except KeyWrongLastSequenceError:
            raise BusError("conflict", f"schedule {record['id']} changed meanwhile; try again") from None

    async def remove(self, schedule_id: str) -> None:
        """Remove the record without a trace (a purge of its subject: no marker is left to count)."""
        await self.js.purge_stream(KV_STREAM, subject=KV_SUBJECT + schedule_id)

    async def ids(self) -> list[str]:
        info = await self.js.stream_info(KV_STREAM, subjects_filter=KV_SUBJECT + "*")
        return sorted(s[len(KV_SUBJECT):] for s in (info.state.subjects or {}))

    async def records(self, ids: list[str] | None = None) -> dict[str, dict[str, Any]]:
        """Every schedule's record (of ``ids``, when the caller has just read them)."""
        found = await asyncio.gather(*(self.get(sid) for sid in (await self.ids() if ids is None else ids)))
        return {got[0]["id"]: got[0] for got in found if got is not None}

    # ------------------------------------------------------------------ schedule messages
    async def arm(self, record: dict[str, Any], fire_ttl: int) -> None:
        """Store (or replace) the schedule message: from now on the server fires it. A pattern the
        server refuses is ``invalid_schedule``; a server that fires nothing, ``unsupported``."""
        if not self.supported:
            raise BusError("unsupported", UNSUPPORTED)
        try:
            await self.js.publish(def_subject(record["id"]), schedules.body(record), stream=STREAM,
                                  headers=schedules.headers(record, fire_ttl))
        except BadRequestError as exc:
            raise BusError("invalid_schedule", f"NATS refused the schedule: {exc.description}",
                           [{"location": "", "message": str(exc.description), "type": "invalid"}]) from None

    async def disarm(self, schedule_id: str, firings: bool = True) -> None:
        """Remove the schedule message (the server stops firing it) and, with ``firings``, the firings
        no scheduler has taken yet."""
        await self.js.purge_stream(STREAM, subject=def_subject(schedule_id))
        if firings:
            await self.js.purge_stream(STREAM, subject=fire_subject(schedule_id))

    async def armed(self) -> set[str]:
        info = await self.js.stream_info(STREAM, subjects_filter=schedules.DEF_PREFIX + "*")
        return {sid for s in (info.state.subjects or {}) if (sid := schedules.id_of_subject(s))}

    async def anchor(self, schedule_id: str) -> float | None:
        """When the schedule message was stored (an ``every`` counts from it); None without one."""
        try:
            return (await self.js.get_last_msg(STREAM, def_subject(schedule_id))).time.timestamp()
        except NotFoundError:
            return None
