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

Acknowledging. The durable acknowledges cumulatively (``AckPolicy.ALL``): an ack of the delivery of
stream sequence S acknowledges every message of the partition at or below S. So the handler does not
ack: the reader notes what it handled (:class:`Acks`) and acks one message for many — when it has
handled :data:`BATCH` since its last ack, when nothing has arrived for :data:`ACK_DELAY`, before it
resyncs and when it stops. It never acks past a message it holds unhandled, nor past one it handed
back. The server takes an ack only above its ack floor, which an accepted ack moves to that
delivery's (delivery sequence, stream sequence): an ack of a delivery whose delivery sequence is at
or below the floor is ignored, even when its stream sequence is above it. A resyncing reader's
redeliveries come with new, higher delivery sequences than the messages that follow them in the
stream, so :func:`ack_choice` picks the delivery to ack by both sequences, and waits rather than put
a message it still has to ack out of reach. A message that cannot be handled is terminated
(:func:`wire.handle_one`), which the server takes as an ack of it and of everything below it: the reader
has handled everything below it by then. A message handed back (``nak``) keeps every later ack below
it until it has come back and been handled. Under ``AckPolicy.ALL`` the consumer's unacknowledged
count (``num_ack_pending``) still counts each delivered message not covered by an ack, so a resyncing
reader counts what it handled and has not acknowledged yet as its own, and acks again what comes back
after an ack of its own that the consumer does not show (:meth:`PinnedReader._ack_again`).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, Iterable

from nats.aio.msg import Msg

from .wire import dumps, handle_one, loads

log = logging.getLogger("noetl.pinned")

GROUP = "owner"  # the consumers' priority group
PIN_TIMEOUT = 10.0  # a pinned reader that has not pulled for this long loses its pin
BATCH = 64  # messages per pull request; acks at the latest after this many handled
MAX_ACK_PENDING = 2 * BATCH  # the consumer's: a batch being handled, and the next one on its way
POLL = 0.25  # how often a waiting reader looks at its stop flag
RESYNC_WAIT = 0.2  # between two looks at the consumer while resyncing
ACK_DELAY = 0.05  # nothing arrived for this long: ack what was handled
ACK_MAX_DELAY = 1.0  # ack at least this often while handling (well inside ack_wait)


def ack_choice(done: dict[int, int], unhandled: Iterable[tuple[int, int]], floor: tuple[int, int], *,
               final: bool = False) -> int | None:
    """The stream sequence of the handled delivery to acknowledge, or None. ``done``: handled and not
    acknowledged, stream sequence -> delivery sequence of its latest delivery; ``unhandled``: (stream,
    delivery) of the messages this reader holds and has not handled, or handed back; ``floor``: the
    consumer's ack floor (delivery, stream). The highest handled message below every unhandled one whose
    delivery is above the floor — unless its ack would move the floor past the delivery of a message
    above it that this reader still has to handle or ack (the server would ignore that ack): then None,
    and it is acked with that message. ``final``: the unhandled ones are given back (each comes back
    with a new delivery), so only handled ones can be put out of reach."""
    cfloor, sfloor = floor
    unhandled = [(s, d) for s, d in unhandled if s > sfloor]
    barrier = min((s for s, _ in unhandled), default=None)
    top = max((s for s, d in done.items() if d > cfloor and s > sfloor and (barrier is None or s < barrier)),
              default=None)
    if top is None:
        return None
    dseq = done[top]
    above = list(done.items()) + ([] if final else unhandled)
    if any(s > top and cfloor < d < dseq for s, d in above):
        return None
    return top


class Acks:
    """What a reader has handled and not acknowledged yet, and the consumer's ack floor as far as it
    knows it (its own last ack, or the consumer's, whichever is higher)."""

    def __init__(self) -> None:
        self.done: dict[int, Msg] = {}  # stream sequence -> its latest delivery, handled, not acknowledged
        self.floor = (0, 0)  # (delivery, stream) sequences
        self.since = 0.0  # when the oldest of ``done`` was handled

    def handled(self, msg: Msg) -> None:
        seq = msg.metadata.sequence
        if seq.stream > self.floor[1]:
            if not self.done:
                self.since = time.monotonic()
            self.done[seq.stream] = msg

    def taken(self, msg: Msg) -> None:
        """The server took an ack (or a term) of ``msg`` if it was above the floor: what it covers."""
        seq = msg.metadata.sequence
        if seq.consumer > self.floor[0] and seq.stream > self.floor[1]:
            self.raise_floor(seq.consumer, seq.stream)
        else:
            self.handled(msg)  # ignored by the server: a later ack covers it

    def raise_floor(self, delivery: int, stream: int) -> None:
        self.floor = (max(self.floor[0], delivery), max(self.floor[1], stream))
        for s in [s for s in self.done if s <= self.floor[1]]:
            del self.done[s]

    def choice(self, unhandled: Iterable[tuple[int, int]], final: bool = False) -> Msg | None:
        """The delivery to ack (:func:`ack_choice`); ``unhandled``: (stream, delivery) sequences."""
        top = ack_choice({s: m.metadata.sequence.consumer for s, m in self.done.items()}, unhandled, self.floor,
                         final=final)
        return None if top is None else self.done[top]


def consumer_config(config: dict[str, Any], max_ack_pending: int = MAX_ACK_PENDING) -> dict[str, Any]:
    """A partition durable's priority settings, added to its consumer configuration."""
    return {**config, "max_ack_pending": max_ack_pending, "priority_policy": "pinned_client", "priority_groups": [GROUP],
            "priority_timeout": int(PIN_TIMEOUT * 1e9)}


class PinnedReader:
    """Reads ``durable`` of ``stream`` (an ``AckPolicy.ALL`` consumer) until ``stop`` is set, calling
    ``handle`` for each message in stream order, and acknowledges what it handled (the handler does
    not). A handler's error is what :func:`wire.handle_one` says it is (a message that cannot be
    decoded or folded is terminated; any other is handed back with a delay), and nothing after a
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
        self.acks = Acks()
        self.held: dict[int, Msg] = {}  # while resyncing: received, not handled yet
        self.returned: dict[int, Msg] = {}  # handed back (nak), not handled since: no ack passes them
        self.queued: set[tuple[int, int]] = set()  # (stream, delivery) sequences of the deliveries in ``queue``
        self.sub: Any = None

    # ------------------------------------------------------------------------------------ the loop
    async def run(self) -> None:
        async def put(msg: Msg) -> None:
            if msg.reply and msg.reply.startswith("$JS.ACK"):  # a delivery, not a status
                self.queued.add(_seqs(msg))
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
        msg = await self._take(ACK_DELAY) if self.acks.done else None
        if msg is None:
            await self._ack()  # nothing arrived for a moment: ack what was handled
            msg = await self._take(POLL)
            if msg is None:
                return None
        status = msg.headers.get("Status") if msg.headers else None
        if status is None:
            self.owed -= 1
            self.queued.discard(_seqs(msg))
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

    async def _take(self, wait: float) -> Msg | None:
        try:
            return self.queue.get_nowait()
        except asyncio.QueueEmpty:
            try:
                return await asyncio.wait_for(self.queue.get(), wait)
            except asyncio.TimeoutError:
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
        self.held = held
        try:
            await self._ack()
            await self._handle_held(held)
        except BaseException:  # the reader fails (control._reader starts another): what it held is
            self.kept += held.values()  # given back once it has unpinned (_release)
            raise
        finally:
            self.held = {}

    async def _handle_held(self, held: dict[int, Msg]) -> None:
        while held and not self.stop.is_set():
            self.irregular = False
            while not self.stop.is_set() and await self._unacknowledged(held) > len(held.keys() | self.acks.done.keys()):
                until = time.monotonic() + RESYNC_WAIT
                while time.monotonic() < until and self.pin is not None:
                    msg = await self._next()
                    if msg is not None:  # a newer delivery replaces an older one of the same message
                        held[msg.metadata.sequence.stream] = msg
                if self.pin is None:  # the pin moved (423): the new pinned reader waits for these
                    break
            if self.stop.is_set() or self.pin is None:
                break
            # it holds every unacknowledged message: one handed back and not among them is gone
            self.returned = {s: m for s, m in self.returned.items() if s in held}
            for seq in sorted(held):
                msg = held.pop(seq)
                if seq in self.acks.done:  # handled, not acked yet, redelivered: not handled again
                    self.acks.done[seq] = msg  # its new delivery is the one to ack
                    continue
                if not await self._one(msg):
                    break  # handed back: what follows waits for it, held
        for seq, msg in held.items():  # stopping, or no longer pinned: give the rest back at once
            self.returned[seq] = msg
            await nak(msg)
        if held:
            self.irregular = True

    async def _unacknowledged(self, held: dict[int, Msg]) -> float:
        """The consumer's unacknowledged messages; infinity when it cannot be asked (then ask again).
        What it holds at or below the consumer's ack floor is dropped: another reader handled it."""
        await self._ack()
        try:
            info = loads((await self.nc.request(f"$JS.API.CONSUMER.INFO.{self.stream}.{self.durable}", b"",
                                                timeout=5)).data)
            pending = int(info["num_ack_pending"])
        except Exception as exc:  # noqa: BLE001 - NATS unreachable for a moment, an API error
            log.warning("%s: consumer info failed (%s); resyncing goes on", self.durable, exc)
            return float("inf")
        # a replicated consumer may report a floor behind this reader's own last ack: the higher one holds
        floor = info.get("ack_floor") or {}
        reported = int(floor.get("stream_seq") or 0)
        self.acks.raise_floor(int(floor.get("consumer_seq") or 0), reported)
        covered = [s for s in held if s <= self.acks.floor[1]]  # handled, by this reader or another
        again = max((s for s in covered if s > reported), default=None)
        if again is not None:  # handled and acked by this reader, yet redelivered: that ack may have been lost
            await self._ack_again(held[again], reported)
        for seq in covered:
            del held[seq]
        for seq in [s for s in self.returned if s <= self.acks.floor[1]]:
            del self.returned[seq]
        return pending

    async def _ack_again(self, msg: Msg, reported: int) -> None:
        """Ack the new delivery of a message this reader handled and acked, which the consumer redelivered
        and reports unacknowledged (its floor at ``reported``): the earlier ack was lost (a node failed
        over with it), or the report lags and the server ignores this one. Without it, the consumer
        would count the message as unacknowledged forever, and the resync would wait for it."""
        seq = msg.metadata.sequence
        log.info("%s: acking seq %d again (delivery %d; the consumer reports its floor at %d)", self.durable,
                 seq.stream, seq.consumer, reported)
        try:
            await msg.ack()
        except Exception as exc:  # noqa: BLE001 - it comes back again, and this is tried again
            log.warning("%s: ack of seq %s failed: %s", self.durable, seq.stream, exc)
            return
        self.acks.raise_floor(seq.consumer, seq.stream)

    async def _ack(self, final: bool = False) -> None:
        """Acknowledge the handled messages that are safe to (:func:`ack_choice`) with one ack."""
        while self.acks.done:
            unhandled = [_seqs(m) for m in (*self.held.values(), *self.kept)] + list(self.queued)
            unhandled += [(s, 0) for s in self.returned]  # each comes back with a new delivery: a barrier only
            msg = self.acks.choice(unhandled, final=final)
            if msg is None:
                return
            try:  # a plain ack, in order on this connection; a lost one only means redeliveries (D21)
                await msg.ack()
            except Exception as exc:  # noqa: BLE001 - they are redelivered and handled again: harmless
                log.warning("%s: ack of seq %s failed: %s", self.durable, msg.metadata.sequence.stream, exc)
                return
            self.acks.taken(msg)

    async def _one(self, msg: Msg) -> bool:
        """Handle one message; False when it was handed back to be retried (the reader resyncs)."""
        self.next_consumer_seq = msg.metadata.sequence.consumer + 1
        started = time.perf_counter_ns()
        try:
            error = await handle_one(msg, self.handle)
        except BaseException:  # cancelled mid-message: handed back (handle_one)
            self.returned[msg.metadata.sequence.stream] = msg
            raise
        if self.counts is not None:
            self.counts.record(started, error=error)
        seq = msg.metadata.sequence.stream
        self.returned.pop(seq, None)
        if error and error.startswith("retrying"):
            self.returned[seq] = msg
            self.irregular = True  # nothing after it before it: the next delivery resyncs
            return False
        if error:  # terminated: the server took that as an ack, if it was above its floor
            self.acks.taken(msg)
        else:
            self.acks.handled(msg)
        if len(self.acks.done) >= self.batch or time.monotonic() - self.acks.since >= ACK_MAX_DELAY:
            await self._ack()
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
            await self._ack(final=True)  # what it handled, before the next reader counts what is unacknowledged
            late = self.kept + list(self.acks.done.values())  # handled, yet not ackable: for the next reader
            self.acks.done.clear()
            late += await self._drain(self.deadline)
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


def _seqs(msg: Msg) -> tuple[int, int]:
    seq = msg.metadata.sequence
    return seq.stream, seq.consumer


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
