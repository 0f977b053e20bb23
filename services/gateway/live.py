"""The console's live streams: server-sent events fed from NATS.

The event-recorder publishes a notice once a batch of events is committed (``noetl.live.x.<execution
id>``, and ``noetl.live.list`` when executions started or ended: services/event_recorder/live.py). A
gateway subscribes only for what is on someone's screen: one :class:`Topic` per execution watched (and
one for the executions list), shared by every stream that watches it, subscribed while at least one
does and unsubscribed after the last leaves. The recorders send only the notices someone watches: a
gateway tells them (``noetl.watch.live``) when a topic opens, before its first stream says hello, and
every :data:`ANNOUNCE_EVERY` s all its topics, and at once when a recorder that starts asks
(``noetl.live.ask``); a topic not said again for :data:`WATCH_TTL` s gets no more notices.

A stream (:func:`stream`) writes, as server-sent events:

- ``hello`` once; ``events`` — what was recorded since the last write: counts by event name and the
  newest events (at most :data:`TAIL` per write); ``state`` — the execution's view after the new
  events (core/view.py, asked of the recorder once per topic however many streams watch it, at most
  every :data:`MIN_STATE_INTERVAL` s, or twice the time the last view took; and after
  :data:`IDLE_REFRESH` s without a notice while the execution runs); ``executions`` — ids
  of executions that started or ended (the list page reads its page again); ``resync`` — after a NATS
  reconnection, when notices may have been lost: read everything again; ``bye`` — the stream ends,
  ``reason`` saying why: ``lifetime`` (``live_stream_seconds`` passed), ``revoked`` (its session or
  token was revoked, or its user disabled: ``cause`` is the notice's reason), ``unauthorized`` (its
  token no longer validates or lacks the permission), ``busy``; a comment every :data:`HEARTBEAT` s
  keeps proxies from closing an idle stream.

Revocation ends a stream at once, not at its next check: the gateway's revocation notices
(``noetl.sessions.revoked``, auth.py) reach :meth:`Hub.revoked`, which ends every stream of the
session or token a notice names, and makes every stream of the user a notice names without an id (a
user disabled, a password or role change) check its token again now. A notice missed (NATS away) is
caught by the check every :data:`RECHECK` s.

Everything is bounded: what a stream has not written yet is merged into one pending record (counts, a
tail of :data:`TAIL` events, one state), so a slow reader costs memory that does not grow with the
event rate; streams per gateway (``max_live_streams``) and per session or token
(``max_live_streams_per_session``) are limited; a stream lasts ``live_stream_seconds`` and checks its
token again every :data:`RECHECK` s.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import secrets
import time
from typing import Any, AsyncIterator, Awaitable, Callable

import orjson

from noetl_mesh import limits
from noetl_mesh.infra.bus import LIVE_ASK, LIVE_LIST, LIVE_WATCH, Bus, live_subject

log = logging.getLogger("noetl.gateway.live")

TAIL = 50  # newest events kept per pending write
MAX_CHANGED = 200  # execution ids per `executions` write (more: `more` counts them)
HEARTBEAT = 15.0  # seconds between comments on an idle stream
RECHECK = 30.0  # seconds between two checks of the stream's token
COALESCE = 0.25  # seconds a stream waits after a write before the next (notices in between are merged)
MIN_STATE_INTERVAL = 0.5  # seconds between two views of one execution
IDLE_REFRESH = 5.0  # seconds without a notice after which an unfinished execution's view is read anyway
LIST = "*"  # the key of the executions list's topic
ANNOUNCE_EVERY = 5.0  # seconds between two announcements to the recorders of every topic (event_recorder/live.py)
WATCH_TTL = 15.0  # how long the recorders keep sending a topic's notices without hearing of it again
ANNOUNCED_PER_MESSAGE = 1000


class Busy(Exception):
    """A stream refused: too many at once (``status`` 503 for the gateway, 429 for one session)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


# ------------------------------------------------------------------------------------ pure parts
class Pending:
    """What one stream has not written yet, merged: bounded whatever the rate of notices."""

    def __init__(self) -> None:
        self.count = 0
        self.names: collections.Counter = collections.Counter()
        self.tail: collections.deque = collections.deque(maxlen=TAIL)
        self.state: dict[str, Any] | None = None
        self.changed: dict[str, str] = {}
        self.more = 0
        self.resync = False
        self.ended: dict[str, Any] | None = None  # the bye of a revocation: the stream ends at once
        self.recheck: str | None = None  # why the stream's token must be checked again now
        self.wake = asyncio.Event()

    def add_notice(self, notice: dict[str, Any]) -> None:
        """An execution's notice: counts and the newest events."""
        n = notice.get("count")
        self.count += n if isinstance(n, int) and n > 0 else 0
        names = notice.get("names")
        if isinstance(names, dict):
            for name, c in list(names.items())[:64]:
                if isinstance(name, str) and isinstance(c, int) and c > 0:
                    if name in self.names or len(self.names) < 64:
                        self.names[name] += c
        for event in (notice.get("events") or ())[-TAIL:]:
            if isinstance(event, dict):
                self.tail.append(event)
        self.wake.set()

    def add_listed(self, notice: dict[str, Any]) -> None:
        """The list's notice: which executions started, were evaluated or ended."""
        for item in (notice.get("executions") or ())[:MAX_CHANGED]:
            xid = item.get("execution_id") if isinstance(item, dict) else None
            if isinstance(xid, str):
                if xid in self.changed or len(self.changed) < MAX_CHANGED:
                    self.changed[xid] = str(item.get("event"))
                else:
                    self.more += 1
        if isinstance(notice.get("more"), int):
            self.more += max(0, notice["more"])
        self.wake.set()

    def set_state(self, state: dict[str, Any]) -> None:
        self.state = state
        self.wake.set()

    def take(self) -> list[tuple[str, Any]]:
        """The server-sent events to write now, and a fresh start."""
        out: list[tuple[str, Any]] = []
        if self.resync:
            out.append(("resync", {}))
        if self.count or self.tail:
            out.append(("events", {"count": self.count, "names": dict(self.names), "events": list(self.tail)}))
        if self.changed or self.more:
            out.append(("executions", {"changed": list(self.changed), "more": self.more}))
        if self.state is not None:
            out.append(("state", self.state))
        self.count, self.more, self.resync, self.state = 0, 0, False, None
        self.names.clear()
        self.tail.clear()
        self.changed.clear()
        self.wake.clear()
        return out


def sse(event: str, data: Any) -> bytes:
    """One server-sent event: ``event: <name>`` and its JSON on one ``data:`` line."""
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data, default=str) + b"\n\n"


# ------------------------------------------------------------------------------------ topics
class Topic:
    """One NATS subscription (an execution's notices, or the list's) and the streams watching it."""

    def __init__(self, hub: "Hub", key: str):
        self.hub, self.key = hub, key
        self.listeners: set[Pending] = set()
        self.sub: Any = None
        self.dirty = asyncio.Event()
        self.refresher: asyncio.Task | None = None

    async def open(self) -> None:
        subject = LIVE_LIST if self.key == LIST else live_subject(self.key)
        self.sub = await self.hub.bus.nc.subscribe(subject, cb=self._on_msg)
        if self.key != LIST and self.hub.fetch_state is not None:
            self.refresher = asyncio.create_task(self._refresh(), name=f"live state {self.key}")

    async def close(self) -> None:
        if self.refresher is not None:
            self.refresher.cancel()
            await asyncio.gather(self.refresher, return_exceptions=True)
        if self.sub is not None:
            with contextlib.suppress(Exception):
                await self.sub.unsubscribe()

    async def _on_msg(self, msg: Any) -> None:
        try:
            notice = orjson.loads(msg.data)
        except orjson.JSONDecodeError:
            return
        if not isinstance(notice, dict):
            return
        for listener in self.listeners:
            (listener.add_listed if self.key == LIST else listener.add_notice)(notice)
        self.dirty.set()

    async def _refresh(self) -> None:
        """One view of the execution after new notices, shared by every stream of the topic; and, until
        it has finished, one after :data:`IDLE_REFRESH` s without a notice: notices are at most once,
        and those of what was recorded before the recorders heard of this topic never come (an
        execution that ended meanwhile would otherwise never say so)."""
        finished = False
        while True:
            try:  # not asyncio.wait_for: on Python 3.11 it can swallow the cancel that ends this loop
                async with asyncio.timeout(None if finished else IDLE_REFRESH):
                    await self.dirty.wait()
            except TimeoutError:
                pass
            self.dirty.clear()
            started = time.monotonic()
            try:
                state = await self.hub.fetch_state(self.key)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the next notice asks again
                log.debug("live state of %s not read: %s", self.key, exc)
                state = None
            took = time.monotonic() - started
            if state is not None:
                finished = bool(state.get("finished"))
                for listener in self.listeners:
                    listener.set_state(state)
            await asyncio.sleep(max(MIN_STATE_INTERVAL, 2 * took))


class Hub:
    """The gateway's topics and the count of its streams. ``fetch_state(execution_id)`` is the view a
    topic sends after new events (the recorder's ``noetl.q.execution.state``)."""

    def __init__(self, bus: Bus, fetch_state: Callable[[str], Awaitable[dict[str, Any]]] | None = None):
        self.bus = bus
        self.fetch_state = fetch_state
        self.topics: dict[str, Topic] = {}
        self.streams = 0
        self.per_session: collections.Counter = collections.Counter()
        self.holders: dict[str, set[Pending]] = {}  # session or token id -> its streams
        self.by_user: dict[str, set[Pending]] = {}  # user id -> its streams
        self._key = secrets.token_bytes(16)
        self._lock = asyncio.Lock()
        self._announcer: asyncio.Task | None = None

    def session_key(self, token: str) -> bytes:
        return hashlib.blake2b(token.encode(), key=self._key, digest_size=16).digest()

    def check(self, token: str) -> None:
        """Refuse a new stream now (:class:`Busy`) when it would not be admitted (before answering 200)."""
        self.release(self.admit(token))

    def admit(self, token: str) -> bytes:
        """Count a new stream in, or refuse it (:class:`Busy`)."""
        lim = limits.current()
        key = self.session_key(token)
        if self.streams >= lim.max_live_streams:
            raise Busy(503, f"this gateway serves {self.streams:,} live streams, its limit max_live_streams "
                            f"(set NOETL_LIMIT_MAX_LIVE_STREAMS to change it); retry shortly")
        if self.per_session[key] >= lim.max_live_streams_per_session:
            raise Busy(429, f"this session has {self.per_session[key]} live streams open, the limit "
                            f"max_live_streams_per_session (set NOETL_LIMIT_MAX_LIVE_STREAMS_PER_SESSION to "
                            "change it): close a console tab, or wait for one to end")
        self.streams += 1
        self.per_session[key] += 1
        return key

    def release(self, key: bytes) -> None:
        self.streams -= 1
        self.per_session[key] -= 1
        if self.per_session[key] <= 0:
            del self.per_session[key]

    def hold(self, listener: Pending, who: dict[str, Any]) -> None:
        """Know ``listener`` as a stream of ``who`` (a principal), so revocations reach it."""
        for index, key in ((self.holders, _ident(who)), (self.by_user, who.get("user_id"))):
            if isinstance(key, str):
                index.setdefault(key, set()).add(listener)

    def unhold(self, listener: Pending, who: dict[str, Any]) -> None:
        for index, key in ((self.holders, _ident(who)), (self.by_user, who.get("user_id"))):
            streams = index.get(key) if isinstance(key, str) else None
            if streams is not None:
                streams.discard(listener)
                if not streams:
                    del index[key]

    def revoked(self, notice: dict[str, Any] | None) -> int:
        """A revocation notice (services/sessions: ``{session_id | token_id, user_id, reason}``): the
        streams of the session or token it names end now; the streams of a user it names without an
        id check their token again now (a disabled user's fail, a password change keeps the session
        that made it); an unreadable notice (None) makes every stream check. How many streams it
        touched."""
        if not isinstance(notice, dict):
            targets = [(listener, None) for streams in self.by_user.values() for listener in streams]
            for listener, _ in targets:
                listener.recheck = "an unreadable revocation notice"
                listener.wake.set()
            return len(targets)
        cause = notice.get("reason") if isinstance(notice.get("reason"), str) else "revoked"
        ident = _ident(notice)
        if ident is not None:
            what = "session" if isinstance(notice.get("session_id"), str) else "API token"
            streams = list(self.holders.get(ident, ()))
            for listener in streams:
                listener.ended = {"reason": "revoked", "cause": cause,
                                  "message": f"the stream's {what} was revoked ({cause}): log in again"}
                listener.wake.set()
            return len(streams)
        streams = list(self.by_user.get(notice.get("user_id"), ())) if isinstance(notice.get("user_id"), str) else []
        for listener in streams:
            listener.recheck = cause
            listener.wake.set()
        return len(streams)

    async def join(self, key: str) -> Pending:
        async with self._lock:
            topic = self.topics.get(key)
            if topic is None:
                topic = Topic(self, key)
                await topic.open()
                self.topics[key] = topic
                # the recorders send only watched notices: tell them before the stream says hello, so that
                # what the page reads after hello and every notice after it meet (no flush: the client's
                # flusher sends it at once, and a flush awaited here held streams up)
                await self._announce([key])
                if self._announcer is None or self._announcer.done():
                    self._announcer = asyncio.create_task(self._announce_all(), name="live watch")
            listener = Pending()
            topic.listeners.add(listener)
            return listener

    async def leave(self, key: str, listener: Pending) -> None:
        async with self._lock:
            topic = self.topics.get(key)
            if topic is None:
                return
            topic.listeners.discard(listener)
            if not topic.listeners:
                del self.topics[key]
                await topic.close()

    async def close(self) -> None:
        if self._announcer is not None:
            self._announcer.cancel()
            await asyncio.gather(self._announcer, return_exceptions=True)
        async with self._lock:
            topics, self.topics = list(self.topics.values()), {}
        for topic in topics:
            await topic.close()

    async def _announce(self, keys: list[str]) -> None:
        """Tell the recorders these topics are watched (for :data:`WATCH_TTL` s); best effort."""
        try:
            for i in range(0, len(keys), ANNOUNCED_PER_MESSAGE):
                await self.bus.nc.publish(LIVE_WATCH, orjson.dumps(
                    {"keys": keys[i:i + ANNOUNCED_PER_MESSAGE], "ttl": WATCH_TTL}))
        except Exception as exc:  # noqa: BLE001 - NATS away: the next announcement says it again
            log.debug("live watch not announced: %s", exc)

    async def _announce_all(self) -> None:
        """While topics are open, all of them every :data:`ANNOUNCE_EVERY` s, and at once when a recorder
        that starts asks."""
        async def asked(_msg: Any) -> None:
            await self._announce(list(self.topics))

        sub = None
        try:
            sub = await self.bus.nc.subscribe(LIVE_ASK, cb=asked)
        except Exception as exc:  # noqa: BLE001 - then a starting recorder learns within ANNOUNCE_EVERY
            log.debug("cannot hear recorders asking: %s", exc)
        try:
            while self.topics:
                await asyncio.sleep(ANNOUNCE_EVERY)
                await self._announce(list(self.topics))
        finally:
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()


async def stream(hub: Hub, key: str, token: str, *, who: dict[str, Any], hello: dict[str, Any], seconds: float,
                 still_allowed: Callable[[], Awaitable[str | None]]) -> AsyncIterator[bytes]:
    """The server-sent events of one stream on topic ``key``, for the principal ``who``, until
    ``seconds`` pass, a revocation notice ends it (``Hub.revoked``), or ``still_allowed()`` (called
    every :data:`RECHECK` s, and at once when a notice about the user asks) answers why not. The stream
    is counted (``Hub.admit``) and joins its topic once it starts, and is let go when it ends however it
    ends: a response that never started counts nothing."""
    try:
        ticket = hub.admit(token)
    except Busy as exc:  # others got in between the route's check and now
        yield sse("bye", {"reason": "busy", "message": str(exc)})
        return
    try:
        listener = await hub.join(key)
    except BaseException:
        hub.release(ticket)
        raise
    hub.hold(listener, who)
    try:
        # a notice that came between the route's check and hold() reached no stream: check once more
        # (the validation the route just made is cached unless a notice dropped it)
        why = await still_allowed()
        if why is not None:
            yield sse("bye", {"reason": "unauthorized", "message": why})
            return
        yield sse("hello", {**hello, "seconds": seconds, "heartbeat": HEARTBEAT})
        end = time.monotonic() + seconds
        checked = time.monotonic()
        reconnects = _reconnects(hub.bus)
        while True:
            if listener.ended is not None:
                yield sse("bye", listener.ended)
                return
            now = time.monotonic()
            if now >= end:
                yield sse("bye", {"reason": "lifetime", "message": "the stream's lifetime passed: open a new one"})
                return
            if listener.recheck is not None or now - checked >= RECHECK:
                cause, listener.recheck, checked = listener.recheck, None, now
                why = await still_allowed()
                if why is not None:
                    yield sse("bye", {"reason": "revoked", "cause": cause, "message": why} if cause else
                              {"reason": "unauthorized", "message": why})
                    return
            try:  # wait_for, not asyncio.timeout: under Starlette's task group a timeout scope left the
                # stream open past its lifetime and its revocation; a client's disconnect still cancels both
                await asyncio.wait_for(listener.wake.wait(), min(HEARTBEAT, end - now, RECHECK))
            except asyncio.TimeoutError:
                count = _reconnects(hub.bus)
                if count != reconnects:  # notices may have been lost while NATS was away
                    reconnects = count
                    listener.resync = True
                else:
                    yield b": keep-alive\n\n"
                    continue
            if listener.ended is not None or listener.recheck is not None:
                continue  # the top of the loop ends the stream, or checks its token, first
            for event, data in listener.take():
                yield sse(event, data)
            await asyncio.sleep(COALESCE)
    finally:
        hub.unhold(listener, who)
        hub.release(ticket)
        await hub.leave(key, listener)


def _ident(principal: dict[str, Any]) -> str | None:
    """The session or token id of a principal or a revocation notice."""
    for key in ("session_id", "token_id"):
        if isinstance(principal.get(key), str):
            return principal[key]
    return None


def _reconnects(bus: Bus) -> int:
    stats = getattr(bus.nc, "stats", None)
    return int(stats.get("reconnects", 0)) if isinstance(stats, dict) else 0


__all__ = ["Hub", "Topic", "Pending", "Busy", "stream", "sse", "LIST", "ANNOUNCE_EVERY", "WATCH_TTL"]
