"""Every service process as a NATS micro service (nats-py ``nats.micro``): what ``nats micro ls``,
``nats micro info``, ``nats micro stats`` and ``nats micro ping`` show, and what ``noetl ps`` and the
gateway's readiness read.

A process registers once, when the service runtime has started it (:func:`register`, called by
``stack.start_service``), and leaves first when it stops. Its name is ``noetl-<its NATS user>``
(``noetl-router``, ``noetl-worker-gpu``: nats_auth.micro_name), so each user may answer the ``$SRV``
subjects of its own name only; its version the package's; its id nats.micro's (one per process). It
answers ``$SRV.{PING,INFO,STATS}``, ``$SRV.<verb>.<name>`` and ``$SRV.<verb>.<name>.<id>``.

What a replica reports:

- metadata (strings): ``service`` (its noetl name), ``host``, ``pid``; ``partitions`` (the events
  partitions it reads now: control plane) and ``partition_count``; ``pool`` and ``concurrency``
  (workers); ``url`` (the gateway).
- endpoints: its request/reply subjects (:class:`Endpoint`, metadata ``kind: request``, counted by
  ``Bus.serve`` and the sessions service: requests, error replies, processing time), and the JetStream
  consumers it reads (:class:`Consumer`, metadata ``kind: consumer``, ``stream``, ``durables``): for a
  consumer, "requests" are the messages handled and "errors" those that failed (nak'ed for a retry,
  dropped, or, for the recorder, events recorded as rejected). A consumer endpoint is not a subject
  anyone may request: its ``subject`` is the consumer's filter.

Requests carry nothing and replies are the nats.micro JSON documents (``io.nats.micro.v1.*``).
"""
from __future__ import annotations

import asyncio
import os
import socket
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Iterable

import orjson
from nats.aio.client import Client
from nats.micro.service import (SEMVER_REGEX, EndpointInfo, EndpointStats, Service, ServiceConfig, ServiceInfo,
                                ServiceStats)

from .nats_auth import SRV_VERBS, micro_name, user_for

DESCRIPTIONS = {
    "gateway": "noetl HTTP API: submits executions, reads through the event-recorder",
    "admission": "noetl control plane: admits executions and step runs, sends commands to worker pools",
    "router": "noetl control plane: evaluates arcs, detects the end of executions",
    "loop-coordinator": "noetl control plane: dispatches and collects loop iterations",
    "event-recorder": "noetl event log in Postgres: records every event, answers catalog and execution queries",
    "credentials": "noetl credential store: sealed credentials, resolved for the commands workers hold",
    "sessions": "noetl logins, sessions, users, API tokens and the audit log",
    "scheduler": "noetl schedules: turns firings into execution requests",
    "worker": "noetl worker: runs the commands of its pool",
}


def version() -> str:
    """The package's version when it is a semantic version (nats.micro requires one), else 0.0.0."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        found = package_version("noetl-mesh")
    except PackageNotFoundError:
        return "0.0.0"
    return found if SEMVER_REGEX.match(found) else "0.0.0"


# ----------------------------------------------------------------------------------- counters
@dataclass
class _Counts:
    handled: int = 0
    failed: int = 0
    processing_ns: int = 0
    last_error: str = ""

    def record(self, started_ns: int, n: int = 1, error: str | None = None, failed: int | None = None) -> None:
        """``n`` handled since ``started_ns`` (``time.perf_counter_ns()``); ``failed`` of them failed
        (default: all when there is an ``error``)."""
        self.handled += n
        self.processing_ns += max(0, time.perf_counter_ns() - started_ns)
        bad = failed if failed is not None else (n if error else 0)
        self.failed += bad
        if error and bad:
            self.last_error = error[:500]

    def _stats(self, name: str, subject: str, queue: str, data: Any) -> EndpointStats:
        return EndpointStats(name=name, subject=subject, queue_group=queue, num_requests=self.handled,
                             num_errors=self.failed, last_error=self.last_error, processing_time=self.processing_ns,
                             average_processing_time=self.processing_ns // self.handled if self.handled else 0,
                             data=data)


@dataclass
class Endpoint(_Counts):
    """A request/reply subject a service answers (``Bus.endpoint``)."""

    subject: str = ""
    queue: str = ""

    @property
    def name(self) -> str:  # nats.micro names: letters, digits, '-', '_'
        return "-".join(self.subject.split(".")[2:]) or self.subject.replace(".", "-")

    def info(self) -> EndpointInfo:
        return EndpointInfo(name=self.name, subject=self.subject, queue_group=self.queue, metadata={"kind": "request"})

    def stats(self) -> EndpointStats:
        return self._stats(self.name, self.subject, self.queue, None)


@dataclass
class Consumer(_Counts):
    """A JetStream consumer a service reads, and what this replica did with its messages. ``durable``
    is the consumer's name, or (``partitions`` not None) the prefix of one per partition
    (``<durable>-p<N>``), of which this replica reads ``partitions`` now (:meth:`own`), or (``lanes``)
    the prefix of one per lane of a worker pool's queue, every one of which each worker reads."""

    name: str = ""
    stream: str = ""
    subject: str = ""
    durable: str = ""
    partitions: list[int] | None = None
    lanes: int = 0
    on_change: Callable[[], None] | None = field(default=None, repr=False)

    def durables(self) -> list[str]:
        if self.lanes:
            return [f"{self.durable}-p{n}" for n in range(self.lanes)]
        if self.partitions is None:
            return [self.durable]
        return [f"{self.durable}-p{p}" for p in self.partitions]

    def own(self, partitions: Iterable[int]) -> None:
        """The partitions this replica reads now (the control plane's membership)."""
        owned = sorted(partitions)
        if owned != self.partitions:
            self.partitions = owned
            if self.on_change is not None:
                self.on_change()

    def _queue(self) -> str:
        return self.durable if self.partitions is None and not self.lanes else f"{self.durable}-p*"

    def _meta(self) -> dict[str, str]:
        return {"kind": "consumer", "stream": self.stream, "durables": ",".join(self.durables())}

    def info(self) -> EndpointInfo:
        return EndpointInfo(name=self.name, subject=self.subject, queue_group=self._queue(), metadata=self._meta())

    def stats(self) -> EndpointStats:
        data: dict[str, Any] = {"kind": "consumer", "stream": self.stream, "durables": self.durables()}
        if self.partitions is not None:
            data["partitions"] = list(self.partitions)
        return self._stats(self.name, self.subject, self._queue(), data)


# ----------------------------------------------------------------------------------- the service
def metadata(service_name: str, service: Any, consumers: list[Consumer]) -> dict[str, str]:
    """A replica's metadata (strings, as the micro protocol has them)."""
    meta = {"service": service_name, "host": socket.gethostname(), "pid": str(os.getpid())}
    for consumer in consumers:
        if consumer.partitions is not None:
            meta["partitions"] = ",".join(str(p) for p in consumer.partitions)
            meta["partition_count"] = str(getattr(getattr(service, "bus", None), "partitions", "") or "")
    if service_name == "worker":
        meta["pool"] = str(service.pool)
        meta["concurrency"] = str(service.concurrency)
    if service_name == "gateway":
        try:
            meta["url"] = service.url
        except RuntimeError:  # not listening (yet)
            pass
    return meta


class MicroService(Service):
    """nats.micro's service whose endpoints are the service's own request subjects and consumers
    (counted where they are handled, not by nats.micro's endpoint subscriptions: the services keep
    their subscriptions and their error replies), and whose metadata is read fresh for each INFO and
    STATS and whenever a consumer's partitions change (PING answers what was read last)."""

    def __init__(self, nc: Client, config: ServiceConfig, *, endpoints: Callable[[], list[Endpoint]],
                 consumers: Callable[[], list[Consumer]], meta: Callable[[], dict[str, str]]) -> None:
        super().__init__(nc, config)
        self._live_endpoints, self._live_consumers, self._live_meta = endpoints, consumers, meta
        for consumer in consumers():
            consumer.on_change = self.refresh
        self.refresh()

    def refresh(self) -> None:
        self._metadata = self._live_meta()

    def info(self) -> ServiceInfo:
        self.refresh()
        info = super().info()
        info.endpoints = [e.info() for e in self._live_endpoints()] + [c.info() for c in self._live_consumers()]
        return info

    def stats(self) -> ServiceStats:
        self.refresh()
        stats = super().stats()
        stats.endpoints = [e.stats() for e in self._live_endpoints()] + [c.stats() for c in self._live_consumers()]
        return stats


async def register(name: str, bus: Any, service: Any) -> MicroService:
    """Register a started service's process as a NATS micro service (answers until ``stop()``)."""
    user = user_for(name, getattr(service, "pool", "default"))
    consumers = lambda: list(getattr(service, "consumers", ()))  # noqa: E731 - read at each INFO/STATS
    config = ServiceConfig(name=micro_name(user), version=version(), description=DESCRIPTIONS.get(name, name),
                           metadata={"service": name})
    micro = MicroService(bus.nc, config, endpoints=lambda: list(bus.endpoints.values()), consumers=consumers,
                         meta=lambda: metadata(name, service, consumers()))
    await micro.start()
    return micro


# ----------------------------------------------------------------------------------- asking
def control_subject(verb: str, name: str | None = None, instance: str | None = None) -> str:
    if verb not in SRV_VERBS:
        raise ValueError(f"{verb!r}: one of {', '.join(SRV_VERBS)}")
    return ".".join(["$SRV", verb, *([name] if name else []), *([instance] if name and instance else [])])


async def ask_all(nc: Client, verb: str, name: str | None = None, *, timeout: float = 1.0,
                  enough: Callable[[list[dict[str, Any]]], bool] | None = None,
                  max_replies: int = 10_000, max_bytes: int = 64 * 1024 * 1024) -> list[dict[str, Any]]:
    """Every reply to ``$SRV.<verb>[.<name>]`` that arrives within ``timeout`` seconds (a micro request
    is answered by every replica, so there is no "last" reply to wait for), sooner when ``enough(replies)``
    says so. Replies that are not JSON objects are skipped; at most ``max_replies`` and ``max_bytes`` are
    kept (a hostile server or responder cannot fill the memory)."""
    replies: list[dict[str, Any]] = []
    done = asyncio.Event()
    size = 0

    async def on_reply(msg) -> None:
        nonlocal size
        if done.is_set():
            return
        size += len(msg.data)
        try:
            reply = orjson.loads(msg.data)
        except orjson.JSONDecodeError:
            return
        if isinstance(reply, dict):
            replies.append(reply)
        if len(replies) >= max_replies or size >= max_bytes or (enough is not None and enough(replies)):
            done.set()

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=on_reply)
    try:
        await nc.publish(control_subject(verb, name), b"", reply=inbox)
        try:
            await asyncio.wait_for(done.wait(), timeout)
        except asyncio.TimeoutError:
            pass
    finally:
        await sub.unsubscribe()
    return list(replies)


async def ping_services(nc: Client, services: Iterable[str], *, timeout: float = 1.0,
                        grace: float = 0.05) -> dict[str, int]:
    """How many replicas of each service (noetl names; workers: ``worker-<pool>``) answer
    ``$SRV.PING.noetl-<service>``: done when each has answered, plus a grace for their other replicas (``grace``,
    or as long as the first answers took if longer: a loaded replica answers late), or after ``timeout``.
    The gateway's readiness."""
    names = {micro_name(s): s for s in services}
    counts = dict.fromkeys(names.values(), 0)
    seen: set[str] = set()
    everyone = asyncio.Event()

    async def on_reply(msg) -> None:
        try:
            reply = orjson.loads(msg.data)
        except orjson.JSONDecodeError:
            return
        if isinstance(reply, dict) and reply.get("name") in names and reply.get("id") not in seen and len(seen) < 10_000:
            seen.add(reply.get("id"))
            counts[names[reply["name"]]] += 1
            if all(counts.values()):
                everyone.set()

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=on_reply)
    try:
        for name in names:
            await nc.publish(control_subject("PING", name), b"", reply=inbox)
        started = time.monotonic()
        try:
            await asyncio.wait_for(everyone.wait(), timeout)
            took = time.monotonic() - started
            await asyncio.sleep(min(max(grace, took), timeout - took))
        except asyncio.TimeoutError:
            pass
    finally:
        await sub.unsubscribe()
    return counts


def uptime(started: str | None, now: datetime | None = None) -> float | None:
    """Seconds since a micro STATS ``started`` (``2024-01-02T03:04:05.678Z``), None if unreadable."""
    if not isinstance(started, str):
        return None
    try:
        when = datetime.fromisoformat(started.replace("Z", "+00:00"))
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, ((now or datetime.now(timezone.utc)) - when).total_seconds())
