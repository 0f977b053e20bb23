"""The reader of one partition of the control plane: many messages per pull request, in log order, and
alone (docs/architecture.md, "Partitions").

A partition's durable (control.py) is a *pinned-client* consumer (a JetStream priority group): the
server delivers its messages to one reader only, the one it pinned, whose pull requests carry the pin
id the server gave it (header ``Nats-Pin-Id``); another reader's request waits, or is refused with
status 423. So the pinned reader may hold up to :data:`BATCH` messages of its partition at once and
handle them in order as they arrive: one pull request per batch instead of one per message.

The pin moves when its reader stops pulling for :data:`PIN_TIMEOUT` (it died, or its event loop is
stuck), or when a reader handing its partition away unpins it. The newly pinned reader cannot tell
at once whether another reader still holds messages of the partition that came before the ones it is
now given. So on anything irregular — its first delivery, a new pin id, a 423, a redelivery, a gap in
the consumer's sequence, its own handler failing — it *resyncs*: it keeps what it receives, unhandled,
and asks the consumer how many messages are unacknowledged, until it holds every one of them (they
come back to the pinned reader when their holder gives them back or their ``ack_wait`` runs out, or
the holder handles and acknowledges them); then it handles what it holds in stream order. Within a
partition, no message is handled before an earlier one, by any reader. ``on_resync`` tells the
service that its cached states of the partition may be stale (control.py rebuilds them, D22).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from nats.aio.msg import Msg

from .wire import dumps, handle_one, loads

log = logging.getLogger("noetl.pinned")

GROUP = "owner"  # the consumers' priority group
PIN_TIMEOUT = 10.0  # a pinned reader that has not pulled for this long loses its pin
BATCH = 64  # messages per pull request, and the consumer's max_ack_pending
POLL = 0.25  # how often a waiting reader looks at its stop flag
RESYNC_WAIT = 0.2  # between two looks at the consumer while resyncing


def consumer_config(config: dict[str, Any], max_ack_pending: int = BATCH) -> dict[str, Any]:
    """A partition durable's priority settings, added to its consumer configuration."""
    return {**config, "max_ack_pending": max_ack_pending, "priority_policy": "pinned_client", "priority_groups": [GROUP],
            "priority_timeout": int(PIN_TIMEOUT * 1e9)}


class PinnedReader:
    """Reads ``durable`` of ``stream`` until ``stop`` is set, calling ``handle`` for each message in
    stream order. A handler's error is what :func:`wire.handle_one` says it is (a message that cannot
    be decoded or folded is terminated; any other is handed back with a delay), and nothing after a
    message handed back is handled before it. ``counts`` (a :class:`micro.Consumer`) counts."""

    def __init__(self, bus: Any, stream: str, durable: str, handle: Callable[[Msg], Awaitable[None]],
                 stop: asyncio.Event, *, expires: float = 1.0, counts: Any = None,
                 on_resync: Callable[[], None] | None = None, batch: int = BATCH):
        self.bus, self.nc, self.stream, self.durable, self.handle, self.stop = bus, bus.nc, stream, durable, handle, stop
        self.expires, self.counts, self.on_resync, self.batch = expires, counts, on_resync, batch
        self.queue: asyncio.Queue[Msg] = asyncio.Queue()
        self.pin: str | None = None
        self.next_consumer_seq: int | None = None
        self.irregular = True  # the first delivery resyncs: another reader may hold earlier messages
        self.owed = 0  # messages the open pull request may still deliver
        self.deadline = 0.0  # when it expires (plus a margin)
        self.resyncs = 0
        self.kept: list[Msg] = []  # held when the reader failed: given back once it has unpinned
        self.sub: Any = None

    # ------------------------------------------------------------------------------------ the loop
    async def run(self) -> None:
        async def put(msg: Msg) -> None:
            self.queue.put_nowait(msg)

        self.sub = await self.nc.subscribe(self.nc.new_inbox(), cb=put)
        try:
            while not self.stop.is_set():
                msg = await self._next()
                if msg is None:
                    continue
                if self.irregular or self._irregular(msg):
                    await self._resync({msg.metadata.sequence.stream: msg})
                else:
                    await self._one(msg)
        finally:
            await self._release()

    async def _next(self) -> Msg | None:
        """The next delivery, with a pull request open for more; None after a status or a quiet
        :data:`POLL` (status 423: the pin moved, so the next delivery resyncs)."""
        if self.owed <= 0 or time.monotonic() > self.deadline:
            await self._request()
        try:
            msg = self.queue.get_nowait()
        except asyncio.QueueEmpty:
            try:
                msg = await asyncio.wait_for(self.queue.get(), POLL)
            except asyncio.TimeoutError:
                return None
        status = msg.headers.get("Status") if msg.headers else None
        if status is None:
            self.owed -= 1
            pin = msg.headers.get("Nats-Pin-Id") if msg.headers else None
            if pin is not None and pin != self.pin:  # pinned anew: another reader may hold earlier messages
                self.pin, self.irregular = pin, True
            return msg
        self.owed = 0  # any status ends its request: 408 expired, 409 (max waiting, leader change...), 423
        if status == "423":
            self.pin, self.irregular = None, True
        elif status not in ("404", "408"):
            log.warning("%s: pull request ended with %s %s", self.durable, status, msg.headers.get("Description"))
            await asyncio.sleep(0.5)
        return None

    async def _request(self) -> None:
        request: dict[str, Any] = {"batch": self.batch, "expires": int(self.expires * 1e9), "group": GROUP}
        if self.pin:
            request["id"] = self.pin
        await self.nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{self.stream}.{self.durable}", dumps(request),
                              reply=self.sub.subject)
        self.owed, self.deadline = self.batch, time.monotonic() + self.expires + 0.5

    def _irregular(self, msg: Msg) -> bool:
        md = msg.metadata
        return md.num_delivered > 1 or (
            self.next_consumer_seq is not None and md.sequence.consumer != self.next_consumer_seq)

    async def _resync(self, held: dict[int, Msg]) -> None:
        """Hold deliveries until this reader holds every unacknowledged message of the consumer, then
        handle them in stream order (again, if a handler fails on one)."""
        self.resyncs += 1
        if self.on_resync is not None:
            self.on_resync()
        try:
            await self._handle_held(held)
        except BaseException:  # the reader fails (control._reader starts another): what it held is
            self.kept += held.values()  # given back once it has unpinned (_release)
            raise

    async def _handle_held(self, held: dict[int, Msg]) -> None:
        while held and not self.stop.is_set():
            self.irregular = False
            while not self.stop.is_set() and await self._unacknowledged() > len(held):
                until = time.monotonic() + RESYNC_WAIT
                while time.monotonic() < until and self.pin is not None:
                    msg = await self._next()
                    if msg is not None:  # a newer delivery replaces an older one of the same message
                        held[msg.metadata.sequence.stream] = msg
                if self.pin is None:  # the pin moved (423): the new pinned reader waits for these
                    break
            if self.stop.is_set() or self.pin is None:
                break
            for seq in sorted(held):
                msg = held.pop(seq)
                if not await self._one(msg):
                    break  # handed back: what follows waits for it, held
        for msg in held.values():  # stopping, or no longer pinned: give the rest back at once
            await nak(msg)
        if held:
            self.irregular = True

    async def _unacknowledged(self) -> float:
        """The consumer's unacknowledged messages; infinity when it cannot be asked (then ask again)."""
        try:
            info = loads((await self.nc.request(f"$JS.API.CONSUMER.INFO.{self.stream}.{self.durable}", b"",
                                                timeout=5)).data)
            return int(info["num_ack_pending"])
        except Exception as exc:  # noqa: BLE001 - NATS unreachable for a moment, an API error
            log.warning("%s: consumer info failed (%s); resyncing goes on", self.durable, exc)
            return float("inf")

    async def _one(self, msg: Msg) -> bool:
        """Handle one message; False when it was handed back to be retried (the reader resyncs)."""
        self.next_consumer_seq = msg.metadata.sequence.consumer + 1
        started = time.perf_counter_ns()
        error = await handle_one(msg, self.handle)
        if self.counts is not None:
            self.counts.record(started, error=error)
        if error and error.startswith("retrying"):
            self.irregular = True  # nothing after it before it: the next delivery resyncs
            return False
        return True

    async def _release(self) -> None:
        """Stopped: keep whatever arrives until this reader's open request has expired, then give the
        pin up, so that another reader is pinned at once (not after PIN_TIMEOUT), then give back what it
        kept (a nak while the request is open would be delivered to this reader again, and each time
        counts towards ``max_deliver``). Unpinning with a request still open could pin this reader
        again, and deliver to it once it has gone. The pin is
        given up even when this reader never learned it (the server pins a reader at its request,
        before any delivery names the pin): a reader unpinned by mistake loses only a resync. On a
        throw-away stack nobody reads next: it just goes."""
        if not self.bus.throwaway:
            late = self.kept + await self._drain(self.deadline)
            await unpin(self.nc, self.stream, self.durable)
            late += await self._drain(time.monotonic() + 0.1)  # what was already on its way
            for msg in late:  # given back only now: while its request was open, a nak came back to it
                await nak(msg)
        try:
            await self.sub.unsubscribe()
        except Exception:  # noqa: BLE001
            pass

    async def _drain(self, until: float) -> list[Msg]:
        """The deliveries that arrive until ``until`` (statuses dropped)."""
        late: list[Msg] = []
        while True:
            while not self.queue.empty():
                msg = self.queue.get_nowait()
                if msg.reply and msg.reply.startswith("$JS.ACK"):  # a delivery, not a status
                    late.append(msg)
            if time.monotonic() >= until:
                return late
            await asyncio.sleep(0.05)

async def unpin(nc: Any, stream: str, durable: str) -> None:
    """Give up the pin of ``durable``'s priority group, so that another reader is pinned at once (not
    after PIN_TIMEOUT); best effort."""
    if nc.is_closed:
        return
    try:
        await nc.request(f"$JS.API.CONSUMER.UNPIN.{stream}.{durable}", dumps({"group": GROUP}), timeout=2)
    except Exception as exc:  # noqa: BLE001 - then the pin times out (PIN_TIMEOUT)
        log.info("%s: could not unpin (%s)", durable, exc)


async def nak(msg: Msg, delay: float | None = None) -> None:
    try:
        await asyncio.wait_for(msg.nak(delay=delay) if delay else msg.nak(), 1.0)
    except BaseException:  # noqa: BLE001 - then it is redelivered after ack_wait
        pass
