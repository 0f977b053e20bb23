"""``noetl ps`` and ``noetl inspect streams|consumers|kv|objects``: what runs and what NATS holds,
read-only, asked of NATS directly as its ``admin`` user (the operator's view, as the ``nats`` CLI has
it: ``nats micro stats``, ``nats stream ls``, ``nats consumer ls``, ``nats kv ls``, ``nats object ls``).

Where: ``--nats-url`` (else ``NOETL_NATS_URL``, else the NATS of the ``noetl up`` running from
``--home``/``NOETL_HOME``/``.noetl``) as ``--nats-creds`` (else ``NOETL_NATS_CREDS``, a seed file or a
directory holding ``admin.nk``, else the home's ``nats-creds/admin.nk``). Nothing goes through the
gateway: an operator inspecting NATS holds NATS credentials, and the view works while the gateway is
down. The requests are the JetStream API's (``$JS.API.STREAM.LIST``, ``CONSUMER.LIST``, ``CONSUMER.INFO``)
and the micro services' ``$SRV.STATS``; the rows are built from their JSON by the pure functions below.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from .common import EXIT_INVALID, EXIT_OK, EXIT_UNREACHABLE, fail
from .output import aligned

if TYPE_CHECKING:
    from datetime import datetime  # imported where it is used: not at every `noetl`'s start

NS = 1_000_000_000  # the JetStream API's durations are nanoseconds
MAX_PAGES = 100  # of 256 streams or consumers each: enough for any noetl deployment, bounded
SERVICE_ORDER = ("gateway", "sessions", "admission", "router", "loop-coordinator", "scheduler", "event-recorder",
                 "credentials", "worker")


class Unreachable(Exception):
    """NATS cannot be reached (exit 4)."""


class Refused(Exception):
    """NATS refused the credentials or a request (exit 2: check the credentials)."""


# ------------------------------------------------------------------------------------- pure: rows
def ranges(values: list[int] | None) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``0-2,5,7-8``; ``-`` for none."""
    if not values:
        return "-"
    out, run = [], [values[0]]
    for v in values[1:]:
        if v == run[-1] + 1:
            run.append(v)
            continue
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [v]
    out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(out)


def duration(seconds: float | None) -> str:
    """``3725`` -> ``1h2m``; ``-`` when unknown."""
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60}m"
    return f"{s // 86400}d{s % 86400 // 3600}h"


def size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _started(value: Any, now: datetime) -> float | None:
    from datetime import datetime, timezone

    if not isinstance(value, str):
        return None
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    when = when if when.tzinfo else when.replace(tzinfo=timezone.utc)
    return max(0.0, (now - when).total_seconds())


def consumers_of(stats: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Every (stream, durable) the replicas of ``stats`` (``$SRV.STATS`` replies) say they read."""
    out: dict[tuple[str, str], None] = {}
    for reply in stats:
        for e in reply.get("endpoints") or ():
            data = e.get("data") if isinstance(e, dict) else None
            if isinstance(data, dict) and data.get("kind") == "consumer" and isinstance(data.get("stream"), str):
                for durable in data.get("durables") or ():
                    if isinstance(durable, str):
                        out[(data["stream"], durable)] = None
    return list(out)


def ps_rows(stats: list[dict[str, Any]], consumers: dict[tuple[str, str], dict[str, Any]],
            now: datetime | None = None) -> list[dict[str, Any]]:
    """One row per replica: its service, id, version, partitions, uptime, what it handled and failed
    (requests and consumed messages, from its STATS), and the lag of the consumers it reads (``pending``:
    not yet delivered, ``ack_pending``: delivered, not yet acknowledged; from ``consumers``, the
    JetStream consumer infos by (stream, durable)). A consumer shared by replicas (a worker pool's, the
    scheduler's) counts in full for each of them."""
    from datetime import datetime, timezone

    now = now or datetime.now(timezone.utc)
    rows = []
    for reply in stats:
        if not isinstance(reply, dict) or not isinstance(reply.get("name"), str):
            continue
        meta = reply.get("metadata") if isinstance(reply.get("metadata"), dict) else {}
        endpoints = [e for e in reply.get("endpoints") or () if isinstance(e, dict)]
        partitions = None
        if "partitions" in meta:
            partitions = sorted(int(p) for p in str(meta["partitions"]).split(",") if p.strip().isdigit())
        reads, pending, ack_pending, redelivered = [], 0, 0, 0
        for e in endpoints:
            data = e.get("data") if isinstance(e.get("data"), dict) else {}
            if data.get("kind") != "consumer":
                continue
            for durable in data.get("durables") or ():
                info = consumers.get((data.get("stream"), durable)) or {}
                reads.append({"stream": data.get("stream"), "durable": durable,
                              "pending": info.get("num_pending"), "ack_pending": info.get("num_ack_pending"),
                              "redelivered": info.get("num_redelivered")})
                pending += info.get("num_pending") or 0
                ack_pending += info.get("num_ack_pending") or 0
                redelivered += info.get("num_redelivered") or 0
        service = str(meta.get("service") or reply["name"].removeprefix("noetl-"))
        rows.append({
            "service": service, "name": reply["name"], "id": reply.get("id"), "version": reply.get("version"),
            "host": meta.get("host"), "pid": meta.get("pid"), "pool": meta.get("pool"), "partitions": partitions,
            "uptime": _started(reply.get("started"), now),
            "handled": sum(int(e.get("num_requests") or 0) for e in endpoints),
            "failed": sum(int(e.get("num_errors") or 0) for e in endpoints),
            "last_error": next((e.get("last_error") for e in endpoints if e.get("last_error")), None),
            "pending": pending, "ack_pending": ack_pending, "redelivered": redelivered,
            "lag": pending + ack_pending, "consumers": reads,
            "endpoints": [{k: e.get(k) for k in ("name", "subject", "num_requests", "num_errors", "last_error",
                                                  "average_processing_time")} for e in endpoints],
        })
    order = {name: i for i, name in enumerate(SERVICE_ORDER)}
    rows.sort(key=lambda r: (order.get(r["service"], len(order)), r["name"], r["partitions"] or [], r["id"] or ""))
    return rows


def stream_rows(streams: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``nats stream ls``/``info``: one row per stream (raw ``$JS.API.STREAM.LIST`` infos)."""
    rows = []
    for s in streams:
        config, state = s.get("config") or {}, s.get("state") or {}
        rows.append({"name": config.get("name"), "description": config.get("description"),
                     "subjects": config.get("subjects") or [], "messages": state.get("messages", 0),
                     "bytes": state.get("bytes", 0), "first_seq": state.get("first_seq"),
                     "last_seq": state.get("last_seq"), "last_ts": state.get("last_ts"),
                     "subjects_count": state.get("num_subjects"), "consumers": state.get("consumer_count", 0),
                     "retention": config.get("retention"), "storage": config.get("storage"),
                     "replicas": config.get("num_replicas"), "max_age": (config.get("max_age") or 0) / NS or None,
                     "created": s.get("created")})
    return sorted(rows, key=lambda r: str(r["name"]))


def consumer_rows(consumers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``nats consumer ls``/``info``: one row per consumer (raw ``$JS.API.CONSUMER.LIST`` infos)."""
    rows = []
    for c in consumers:
        config = c.get("config") or {}
        filters = config.get("filter_subjects") or ([config["filter_subject"]] if config.get("filter_subject") else [])
        rows.append({"stream": c.get("stream_name"), "name": c.get("name"), "durable": bool(config.get("durable_name")),
                     "filter": filters, "ack_policy": config.get("ack_policy"),
                     "max_ack_pending": config.get("max_ack_pending"),
                     "ack_wait": (config.get("ack_wait") or 0) / NS or None,
                     "pending": c.get("num_pending", 0), "ack_pending": c.get("num_ack_pending", 0),
                     "redelivered": c.get("num_redelivered", 0), "waiting": c.get("num_waiting", 0),
                     "delivered": (c.get("delivered") or {}).get("stream_seq"),
                     "ack_floor": (c.get("ack_floor") or {}).get("stream_seq"),
                     "last_active": (c.get("delivered") or {}).get("last_active")})
    return sorted(rows, key=lambda r: (str(r["stream"]), str(r["name"])))


def kv_rows(streams: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``nats kv ls``: the key-value buckets (streams ``KV_<bucket>``)."""
    rows = []
    for s in stream_rows(streams):
        if str(s["name"]).startswith("KV_"):
            config = next(x.get("config") or {} for x in streams if (x.get("config") or {}).get("name") == s["name"])
            rows.append({"bucket": s["name"][3:], "description": s["description"], "values": s["messages"],
                         "keys": s["subjects_count"], "history": config.get("max_msgs_per_subject"),
                         "ttl": s["max_age"], "bytes": s["bytes"], "replicas": s["replicas"],
                         "storage": s["storage"], "created": s["created"]})
    return rows


def object_rows(streams: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``nats object ls``: the object stores (streams ``OBJ_<bucket>``)."""
    rows = []
    for s in stream_rows(streams):
        if str(s["name"]).startswith("OBJ_"):
            config = next(x.get("config") or {} for x in streams if (x.get("config") or {}).get("name") == s["name"])
            rows.append({"bucket": s["name"][4:], "description": s["description"], "bytes": s["bytes"],
                         "chunks": s["messages"], "ttl": s["max_age"], "replicas": s["replicas"],
                         "storage": s["storage"], "sealed": bool(config.get("sealed")), "created": s["created"]})
    return rows


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str, Callable[[Any], str]]]) -> str:
    """A plain text table: ``columns`` are (header, key, format)."""
    return aligned([[h for h, _, _ in columns]] + [[fmt(r.get(k)) for _, k, fmt in columns] for r in rows])


def _num(v: Any) -> str:
    return "-" if v is None else str(v)


def _text(v: Any) -> str:
    if v is None or v == "":
        return "-"
    if isinstance(v, list):
        return ",".join(str(x) for x in v) or "-"
    return str(v)


PS_COLUMNS = [("SERVICE", "service", _text), ("ID", "id", _text), ("VERSION", "version", _text),
              ("POOL", "pool", _text), ("PARTITIONS", "partitions", ranges), ("UPTIME", "uptime", duration),
              ("HANDLED", "handled", _num), ("FAILED", "failed", _num), ("PENDING", "pending", _num),
              ("ACK PENDING", "ack_pending", _num)]
STREAM_COLUMNS = [("STREAM", "name", _text), ("MESSAGES", "messages", _num), ("SIZE", "bytes", size),
                  ("CONSUMERS", "consumers", _num), ("RETENTION", "retention", _text),
                  ("MAX AGE", "max_age", duration), ("REPLICAS", "replicas", _num), ("SUBJECTS", "subjects", _text)]
CONSUMER_COLUMNS = [("STREAM", "stream", _text), ("CONSUMER", "name", _text), ("PENDING", "pending", _num),
                    ("ACK PENDING", "ack_pending", _num), ("REDELIVERED", "redelivered", _num),
                    ("WAITING", "waiting", _num), ("ACK FLOOR", "ack_floor", _num), ("FILTER", "filter", _text)]
KV_COLUMNS = [("BUCKET", "bucket", _text), ("KEYS", "keys", _num), ("VALUES", "values", _num),
              ("HISTORY", "history", _num), ("TTL", "ttl", duration), ("SIZE", "bytes", size),
              ("REPLICAS", "replicas", _num), ("DESCRIPTION", "description", _text)]
OBJECT_COLUMNS = [("BUCKET", "bucket", _text), ("SIZE", "bytes", size), ("CHUNKS", "chunks", _num),
                  ("TTL", "ttl", duration), ("REPLICAS", "replicas", _num), ("SEALED", "sealed", _text),
                  ("DESCRIPTION", "description", _text)]


# ------------------------------------------------------------------------------------- NATS
def where(args: argparse.Namespace) -> tuple[str, str | None]:
    """The NATS URL and admin credentials to use (see the module's doc); ValueError when there is no URL."""
    from ..home import admin_creds, running_stack
    from ..infra.nats_auth import ADMIN, SEED_SUFFIX

    stack = running_stack(args.home)
    url = args.nats_url or os.environ.get("NOETL_NATS_URL") or (stack or {}).get("nats")
    if not url:
        raise ValueError("no NATS to ask: give --nats-url (or NOETL_NATS_URL), or start `noetl up` "
                         f"(none runs from {args.home or os.environ.get('NOETL_HOME') or '.noetl'})")
    creds = args.nats_creds or os.environ.get("NOETL_NATS_CREDS") or admin_creds(args.home)
    if creds and os.path.isdir(creds):
        creds = os.path.join(creds, ADMIN + SEED_SUFFIX)
    return url, creds


class Nats:
    """One admin connection for one command: no reconnection, clear errors."""

    def __init__(self, url: str, creds: str | None, timeout: float = 5.0) -> None:
        self.url, self.creds, self.timeout = url, creds, timeout
        self.errors: list[str] = []
        self.nc = None

    async def __aenter__(self) -> "Nats":
        import asyncio

        import nats

        from ..infra import tls
        from ..infra.nats_auth import connect_options

        failed: list[Exception] = []

        async def on_error(exc: Exception) -> None:
            failed.append(exc)
            self.errors.append(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)

        options = connect_options(self.creds, self.url)  # a TLS setting that cannot be used: ValueError
        try:
            # max_reconnect_attempts=1: each server tried twice (0 would mean "for ever" to nats-py)
            self.nc = await asyncio.wait_for(nats.connect(
                [u.strip() for u in self.url.split(",") if u.strip()], name="noetl-cli", allow_reconnect=False,
                max_reconnect_attempts=1, reconnect_time_wait=0.2, connect_timeout=self.timeout, error_cb=on_error,
                **options), 2 * self.timeout + 1)
        except Exception as exc:  # noqa: BLE001 - every way of not connecting is one message
            text = " ".join([str(exc), *self.errors]).lower()
            if "authorization" in text or "authentication" in text:
                raise Refused(f"NATS at {self.url} refused the credentials ({self.creds or 'none given'}): "
                              "use the admin's (--nats-creds, NOETL_NATS_CREDS)") from None
            why = next((e for e in reversed([*failed, exc]) if tls.is_verify_failure(e)), None)
            if why is not None:  # a certificate that does not verify, or names another host
                raise Refused(f"NATS at {self.url}: {tls.verify_failure(why, os.environ.get(tls.NATS_CA), tls.NATS_CA)}") \
                    from None
            reason = self.errors[-1] if self.errors else f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            reason = next((tls.handshake_failure(e) for e in [*failed, exc] if tls.handshake_failure(e)), reason)
            raise Unreachable(f"cannot reach NATS at {self.url} ({reason})") from None
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self.nc is not None:
            await self.nc.close()

    async def api(self, subject: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """A JetStream API request (``$JS.API.<subject>``); its error, or a refusal, raises."""
        import asyncio

        import nats.errors

        try:
            msg = await self.nc.request(f"$JS.API.{subject}", json.dumps(body).encode() if body else b"",
                                        timeout=self.timeout)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as exc:
            await asyncio.sleep(0.05)  # the server's -ERR for a refused publish comes on its own
            refused = [e for e in self.errors if "permissions violation" in e.lower()]
            if refused:
                raise Refused(f"NATS refused {subject}: {refused[0]} (use the admin's credentials)") from None
            raise Unreachable(f"JetStream at {self.url} did not answer $JS.API.{subject} "
                              f"({'no JetStream' if isinstance(exc, nats.errors.NoRespondersError) else 'timeout'})") \
                from None
        reply = json.loads(msg.data)
        if isinstance(reply, dict) and isinstance(reply.get("error"), dict):
            raise Refused(f"$JS.API.{subject}: {reply['error'].get('description')}")
        return reply

    async def paged(self, subject: str, key: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for _ in range(MAX_PAGES):
            page = await self.api(subject, {"offset": len(out)})
            items = page.get(key) or []
            out += items
            if not items or len(out) >= (page.get("total") or 0):
                break
        return out

    async def streams(self) -> list[dict[str, Any]]:
        return await self.paged("STREAM.LIST", "streams")

    async def consumers(self, stream: str) -> list[dict[str, Any]]:
        return await self.paged(f"CONSUMER.LIST.{stream}", "consumers")

    async def consumer(self, stream: str, durable: str) -> dict[str, Any] | None:
        try:
            return await self.api(f"CONSUMER.INFO.{stream}.{durable}")
        except Refused:  # gone meanwhile
            return None


async def gather_ps(conn: Nats, wait: float) -> list[dict[str, Any]]:
    import asyncio

    from ..infra.micro import ask_all

    stats = await ask_all(conn.nc, "STATS", timeout=wait)
    if not stats and any("permissions violation" in e.lower() for e in conn.errors):
        raise Refused(f"NATS refused $SRV.STATS: {conn.errors[0]} (use the admin's credentials)")
    wanted = consumers_of(stats)
    infos = await asyncio.gather(*(conn.consumer(s, d) for s, d in wanted))
    return ps_rows(stats, {key: info for key, info in zip(wanted, infos) if info})


# ------------------------------------------------------------------------------------- commands
def _connected(args: argparse.Namespace, work: Callable[[Nats], Awaitable[Any]]) -> Any:
    import asyncio

    url, creds = where(args)
    timeout = getattr(args, "timeout", 5.0)

    async def main() -> Any:
        async with Nats(url, creds, timeout) as conn:
            return await work(conn)

    return asyncio.run(main())


def _run(args: argparse.Namespace, work: Callable[[Nats], Awaitable[list[dict]]], columns, empty: str) -> int:
    try:
        rows = _connected(args, work)
    except ValueError as exc:
        return fail(str(exc), EXIT_INVALID)
    except Refused as exc:
        return fail(str(exc), EXIT_INVALID)
    except Unreachable as exc:
        return fail(str(exc), EXIT_UNREACHABLE)
    if args.json:
        print(json.dumps(rows, indent=1, default=str))
    elif rows:
        print(table(rows, columns))
    else:
        print(empty, file=sys.stderr)
    return EXIT_OK


def cmd_ps(args: argparse.Namespace) -> int:
    """``noetl ps``: every running service replica, from the micro services' ``$SRV.STATS``."""
    return _run(args, lambda conn: gather_ps(conn, args.wait), PS_COLUMNS,
                f"no noetl service answered within {args.wait:g}s")


def cmd_inspect(args: argparse.Namespace) -> int:
    """``noetl inspect streams|consumers|kv|objects``: read-only views of JetStream."""
    async def streams(conn: Nats) -> list[dict]:
        found = await conn.streams()
        return [r for r in stream_rows(found) if not args.names or r["name"] in args.names]

    async def consumers(conn: Nats) -> list[dict]:
        import asyncio

        names = args.names or [r["name"] for r in stream_rows(await conn.streams())]
        found = await asyncio.gather(*(conn.consumers(n) for n in names))
        return consumer_rows([c for cs in found for c in cs])

    async def kv(conn: Nats) -> list[dict]:
        return [r for r in kv_rows(await conn.streams()) if not args.names or r["bucket"] in args.names]

    async def objects(conn: Nats) -> list[dict]:
        return [r for r in object_rows(await conn.streams()) if not args.names or r["bucket"] in args.names]

    work, columns = {"streams": (streams, STREAM_COLUMNS), "consumers": (consumers, CONSUMER_COLUMNS),
                     "kv": (kv, KV_COLUMNS), "objects": (objects, OBJECT_COLUMNS)}[args.what]
    return _run(args, work, columns, f"no {args.what}")


def add_commands(sub) -> None:
    def nats_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--nats-url", metavar="URL",
                       help="the NATS server (default: NOETL_NATS_URL, else the running `noetl up`'s)")
        p.add_argument("--nats-creds", metavar="FILE",
                       help="the NATS admin's seed file, or a directory holding admin.nk (default: NOETL_NATS_CREDS, "
                            "else the home's nats-creds/admin.nk)")
        p.add_argument("--home", metavar="DIR", help="the `noetl up` home to find NATS in (default: NOETL_HOME, "
                                                     "else .noetl)")
        p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
        p.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS",
                       help="seconds to wait for NATS to connect and for each JetStream answer")

    p = sub.add_parser("ps", help="every running service replica: partitions, uptime, handled, failed, consumer lag "
                                  "(as the NATS admin)")
    nats_options(p)
    p.add_argument("--wait", type=float, default=1.0, metavar="SECONDS",
                   help="how long to collect the replicas' answers (every replica answers once)")
    p.set_defaults(func=cmd_ps)

    p = sub.add_parser("inspect", help="what NATS holds, read-only: streams, consumers, kv buckets, object stores "
                                       "(as the NATS admin)")
    p.add_argument("what", choices=("streams", "consumers", "kv", "objects"), help="what to list")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="only these streams (consumers: of these streams) or buckets (default: all)")
    nats_options(p)
    p.set_defaults(func=cmd_inspect)
