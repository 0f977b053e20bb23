"""The recorder's reading of one partition: a pinned pull that feeds the writer, and cumulative acks.

Each partition ``N`` of the events stream has a durable of the recorder, ``event-recorder-p<N>``
(filter ``noetl.pevt.<N>.>``, ``AckPolicy.ALL``, a pinned-client priority group as the control
plane's: infra/pinned.py), so recorders scale out the way the control plane does: replicas share the
partitions through the members bucket (infra/membership.py), and the server delivers a partition's
messages to one pinned reader at a time. A recorder reads each partition it owns through a
:class:`Feed`: one pull request open at a time, its deliveries put on the recorder's one queue, from
which one writer takes batches of any partitions (service.py), records them, and hands each feed back
the messages that are now recorded (:meth:`Feed.settle`).

Acknowledging. Acking a message acks every message of its partition with a lower stream sequence.
That is only safe when nothing below it is unrecorded, which is not so when another recorder (one
that died, or handed the partition over) still holds fetched messages. The feed knows it is alone
when the delivery sequences it recorded since the consumer's ack floor have no gap (deliveries are
numbered by the consumer, whoever they went to); then it acks the highest stream sequence. After a
gap it asks the server: when the consumer's unacknowledged messages are all ones this feed holds, it
acks; otherwise it holds its acks. Holding them for longer than ``GAP_READ_AFTER``, it reads the
partition's messages below its own that it does not hold straight from the stream (a delivery lost on
the way, or another reader's fetch) and records them like deliveries: then an ack of its own covers
them, and the log is whole at once instead of when the server redelivers them (at ``ack_wait``). A
feed that stops acks what it can, gives back (``nak``) what it could not, and gives up the pin, so
that the next owner starts at once.
"""
from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime, timezone
from types import SimpleNamespace
from typing import Any

from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from noetl_mesh.infra.bus import EVENTS, dumps, loads
from noetl_mesh.infra.pinned import GROUP, ack_choice, nak, unpin

log = logging.getLogger("noetl.event-recorder")

DURABLE = "event-recorder"  # the prefix of the partitions' durables; before them, the one durable's name
REQUEST = 250  # messages per pull request of one partition
EXPIRES = 0.5  # seconds a pull request stays open (a stopping feed waits for its end)
GAP_READ_AFTER = 1.0  # seconds of held acks before the feed reads what it lacks below them from the stream
GAP_READ_MAX = 2_000  # stream reads per look at a gap (the next look goes on from there)


def durable(partition: int) -> str:
    return f"{DURABLE}-p{partition}"


def subject(partition: int) -> str:
    return f"noetl.pevt.{partition}.>"


class Feed:
    """Pulls partition ``partition`` onto ``out`` (``(feed, message)`` pairs) while the writer keeps
    that queue under ``limit``; acknowledges what :meth:`settle` is told was recorded."""

    def __init__(self, bus: Any, partition: int, out: asyncio.Queue, *, limit: int):
        self.bus, self.nc, self.partition, self.out, self.limit = bus, bus.nc, partition, out, limit
        self.durable = durable(partition)
        self.sub: Any = None
        self.pin: str | None = None
        self.owed = 0  # deliveries the open pull request may still make
        self.deadline = 0.0  # when it has expired (with a margin)
        self.closing = False  # asks for nothing more; what still arrives is given back once the pin is released
        self.closed = False  # the pin is released: what it holds is given back at once
        self.late: list[Msg] = []  # to give back (nak) once the pin is released
        self.cfloor = 0  # the consumer's delivery ack floor: every delivery at or below it is acked, or this feed's
        self.sfloor = 0  # stream sequence at and below which the partition is recorded and acknowledged
        self.held: dict[int, Msg] = {}  # recorded, not acknowledged yet: stream sequence -> latest delivery
        self.delivered: set[int] = set()  # delivery sequences recorded since ``cfloor``
        self.inflight: dict[int, int] = {}  # delivered, not recorded yet (queued, or being written): stream seq -> n
        self.num_pending = 0  # the last delivery's count of messages left in the partition
        self.holding_since: float | None = None  # when its acks began to wait for messages it does not hold
        self.gap_task: asyncio.Task | None = None  # reading those from the stream
        self.gap_next = 0  # the stream sequence the next look at the gap starts from

    # ------------------------------------------------------------------ pulling
    async def open(self) -> None:
        self.sub = await self.nc.subscribe(self.nc.new_inbox(), cb=self._on_msg)
        if self.closing:  # handed over while subscribing
            await self.sub.unsubscribe()
            return
        await self._read_floor()
        await self.request()

    async def request(self) -> None:
        """Open a pull request unless one is open, the feed is closing, or the writer has enough."""
        if self.closing or self.sub is None or (self.owed > 0 and time.monotonic() < self.deadline) \
                or self.out.qsize() >= self.limit:
            return
        body: dict[str, Any] = {"batch": REQUEST, "expires": int(EXPIRES * 1e9), "group": GROUP}
        if self.pin:
            body["id"] = self.pin
        self.owed, self.deadline = REQUEST, time.monotonic() + EXPIRES + 0.5
        try:
            await self.nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{EVENTS}.{self.durable}", dumps(body),
                                  reply=self.sub.subject)
        except Exception as exc:  # noqa: BLE001 - disconnected: the writer asks again after its next batch
            self.owed = 0
            log.debug("%s: pull request not sent (%s)", self.durable, exc)

    async def _on_msg(self, msg: Msg) -> None:
        status = msg.headers.get("Status") if msg.headers else None
        if status is None:
            self.owed -= 1
            if self.closed:  # the pin is released: the next reader takes it
                await nak(msg)
                return
            if self.closing:  # kept, and given back once the pin is released: a nak now would come back here
                self.late.append(msg)
                return
            pin = msg.headers.get("Nats-Pin-Id") if msg.headers else None
            if pin is not None:
                self.pin = pin
            seq = msg.metadata.sequence.stream
            self.inflight[seq] = self.inflight.get(seq, 0) + 1
            self.out.put_nowait((self, msg))
            if self.owed <= 0:
                await self.request()
            return
        self.owed = 0  # any status ends the request: 408 expired, 409 (max waiting, leader change...), 423
        if status == "423":  # pinned to another reader: ask without an id, and wait for the pin
            self.pin = None
        elif status not in ("404", "408"):
            log.warning("%s: pull request ended with %s %s", self.durable, status, msg.headers.get("Description"))
            await asyncio.sleep(0.5)
        await self.request()

    # ------------------------------------------------------------------ acknowledging
    async def give_back(self, msgs: list[Msg]) -> None:
        """Messages of this feed the writer will not record: given back once the pin is released (at
        once when it already is), for the partition's next reader."""
        for msg in msgs:
            self._landed(msg.metadata.sequence.stream)
            if self.closed:
                await nak(msg)
            else:
                self.late.append(msg)

    async def settle(self, msgs: list[Msg]) -> None:
        """``msgs`` (this feed's, in delivery order) are recorded: acknowledge what is safe to. A feed
        whose pin is released acks nothing (it may not be alone any more): it gives them back, and the
        next reader records them again."""
        if self.closed:
            await self.give_back(msgs)
            return
        for msg in msgs:
            seq = msg.metadata.sequence
            self._landed(seq.stream)
            if seq.stream > self.sfloor:
                self.held[seq.stream] = msg
            if seq.consumer:  # a delivery (a message read from the stream has none)
                self.num_pending = msg.metadata.num_pending
                if seq.consumer > self.cfloor:
                    self.delivered.add(seq.consumer)
        await self._ack()

    def _landed(self, seq: int) -> None:
        n = self.inflight.get(seq, 0) - 1
        if n > 0:
            self.inflight[seq] = n
        else:
            self.inflight.pop(seq, None)

    def _alone(self) -> bool:
        """Every delivery since the ack floor was this feed's, and is recorded."""
        return bool(self.delivered) and max(self.delivered) - self.cfloor == len(self.delivered)

    async def _ack(self) -> None:
        """Ack the highest recorded stream sequence below anything delivered and not recorded yet,
        when nothing another reader holds is below it."""
        if not self.held:
            return
        if not self._alone():
            info = await self._read_floor()
            if info is None or not self.held:
                return  # NATS did not say: ask again with the next batch
            mine = self.held.keys() | {s for s in self.inflight if s > self.sfloor}
            if not self._alone() and (info.get("num_ack_pending") or 0) > len(mine):
                if self.holding_since is None:
                    self.holding_since = time.monotonic()
                    log.info("%s: holding the ack of %d recorded messages: messages below seq %d were delivered "
                             "and not recorded here (lost on the way, or another reader's)", self.durable,
                             len(self.held), max(self.held))
                if self.gap_task is None or self.gap_task.done():  # a look at the gap, once held long enough
                    self.gap_task = asyncio.create_task(self._read_gap(), name=f"{self.durable} gap")
                return
        self.holding_since = None
        # The same choice as the control plane's readers (pinned.ack_choice): the highest recorded
        # stream sequence below anything delivered and not recorded, whose delivery is above the floor,
        # unless acking it would put a recorded message above it out of reach (then wait, and ack it all
        # at once). What is in flight comes back recorded, or redelivered: a barrier only.
        top = ack_choice({s: m.metadata.sequence.consumer for s, m in self.held.items()},
                         [(s, 0) for s in self.inflight if s not in self.held], (self.cfloor, self.sfloor), final=True)
        if top is None:
            return
        dseq = self.held[top].metadata.sequence.consumer
        try:  # a plain ack, in order on this connection; one that is lost covers nothing, and what it
            await self.held[top].ack()  # would have covered is covered by the next, or recorded again
        except Exception as exc:  # noqa: BLE001 - they will be redelivered and recorded again: harmless
            log.warning("%s: ack of seq %s failed: %s", self.durable, top, exc)
            return
        self.cfloor, self.sfloor = dseq, top  # the server's floor now
        self.delivered = {d for d in self.delivered if d > dseq}
        for seq in [s for s in self.held if s <= top]:
            del self.held[seq]

    async def tend(self) -> None:
        """The writer is idle: acks still held are tried again, as its next batch would, so that a
        partition gone quiet (or a consumer info NATS did not answer) still reads its gap and acks
        within about ``GAP_READ_AFTER``, not at ``ack_wait``."""
        if self.held and not self.closing and not self.closed:
            await self._ack()

    async def _read_gap(self) -> None:
        """Once the acks have been held for ``GAP_READ_AFTER`` (and still are): read the partition's
        messages between the ack floor and the highest one this feed holds that it neither holds nor
        has in flight, from the stream, and queue them for recording (at most ``GAP_READ_MAX`` reads a
        look; the next look goes on from there). Recorded, they count as this feed's."""
        if self.holding_since is not None:
            await asyncio.sleep(max(0.0, self.holding_since + GAP_READ_AFTER - time.monotonic()))
        if self.holding_since is None or not self.held or self.closing:
            return  # acked meanwhile (the messages came back), or stopping
        below = max(self.held)
        seq, reads, found = max(self.sfloor + 1, self.gap_next), 0, 0
        while seq < below and reads < GAP_READ_MAX and not self.closing:
            reads += 1
            try:  # the partition's next message at or after seq
                stored = await self.bus.js.get_msg(EVENTS, seq=seq, subject=subject(self.partition), next=True)
            except NotFoundError:
                break  # none left
            except Exception as exc:  # noqa: BLE001 - the next look tries again
                log.info("%s: reading seq %d from the stream failed (%s)", self.durable, seq, exc)
                break
            if stored.seq is None or stored.seq >= below:
                break
            seq = stored.seq
            if seq > self.sfloor and seq not in self.held and seq not in self.inflight:
                self.inflight[seq] = 1
                self.out.put_nowait((self, StoredMessage(stored)))
                found += 1
            seq += 1
        self.gap_next = seq
        if found:
            log.warning("%s: recording %d messages below seq %d read from the stream (delivered, but not to this "
                        "reader or lost on the way)", self.durable, found, below)

    async def _read_floor(self) -> dict[str, Any] | None:
        """The consumer's ack floor (and what it holds below it dropped); None when NATS did not say."""
        try:
            reply = await self.nc.request(f"$JS.API.CONSUMER.INFO.{EVENTS}.{self.durable}", b"", timeout=2)
            info = loads(reply.data)
        except Exception as exc:  # noqa: BLE001
            log.info("%s: consumer info failed (%s)", self.durable, exc)
            return None
        if not isinstance(info, dict) or "error" in info:
            log.info("%s: consumer info refused: %s", self.durable, info.get("error") if isinstance(info, dict) else info)
            return None
        # The server's floor, unless it is below this feed's own last ack: a replicated consumer reports
        # the floor of its store, which an ack reaches only after the cluster has taken it, while its
        # pending count is current. Taking the lagging floor would hold again (and count as this
        # feed's) redeliveries that the ack already covered. (An ack is sent only above the floor the
        # feed knows, so the server does not ignore it unless another reader acked higher meanwhile;
        # then its floor is the higher one, and is taken.)
        floor = info.get("ack_floor") or {}
        self.cfloor = max(self.cfloor, int(floor.get("consumer_seq") or 0))
        self.sfloor = max(self.sfloor, int(floor.get("stream_seq") or 0))
        for seq in [s for s in self.held if s <= self.sfloor]:
            del self.held[seq]
        self.delivered = {d for d in self.delivered if d > self.cfloor}
        return info

    # ------------------------------------------------------------------ stopping
    async def close(self, grace: float) -> None:
        """Stop asking; once what was delivered is recorded (for up to ``grace`` seconds), ack what is
        safe to; once the open request has ended, give the pin up (so that the next owner is pinned at
        once), then give back everything else. On a throw-away stack nobody reads next: it just goes."""
        self.closing = True
        if self.gap_task is not None:
            self.gap_task.cancel()
        until = time.monotonic() + grace
        while self.inflight and time.monotonic() < until:
            await asyncio.sleep(0.02)
        await self._ack()
        if not self.bus.throwaway:
            while self.owed > 0 and time.monotonic() < self.deadline:  # until the open request ends (its 408)
                await asyncio.sleep(0.02)
            await unpin(self.nc, EVENTS, self.durable)
        self.closed = True
        if not self.bus.throwaway:  # recorded but not ackable alone, and what arrived late: the next reader's
            for msg in [*self.held.values(), *self.late]:
                await nak(msg)
        self.held.clear()
        self.late.clear()
        if self.sub is not None:
            try:
                await self.sub.unsubscribe()
            except Exception:  # noqa: BLE001
                pass


class StoredMessage:
    """A message of the partition read from the stream (nats-py's ``RawStreamMsg``), not delivered:
    recorded as a delivery is; it has no delivery to ack or give back (an ack of a delivery above it
    covers it; given back, the server still holds it for the partition's next reader)."""

    def __init__(self, stored: Any):
        self.subject, self.data, self.headers = stored.subject or "", stored.data or b"", stored.headers
        self.metadata = SimpleNamespace(sequence=SimpleNamespace(stream=stored.seq, consumer=0), num_pending=0,
                                        timestamp=stored.time or datetime.now(timezone.utc))

    async def ack(self) -> None:
        pass

    async def nak(self, delay: float | None = None) -> None:
        pass


__all__ = ["Feed", "StoredMessage", "DURABLE", "durable", "subject", "REQUEST"]
