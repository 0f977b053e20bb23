"""Large values out of messages and event rows (D23): the NATS object store ``noetl_payloads``.

A value too big to travel inline is stored once (content-addressed: the key is its SHA-256) and
replaced by a reference ``{store, key, size, checksum}``. Publishers call :meth:`PayloadStore.shrink`
on what they send; receivers call :meth:`PayloadStore.expand` on what they fold or render, so the
engine's core and every template see plain values. References are stable: the same value always gives
the same reference, so a republished event is still the same event (D21).

Retention: the bucket keeps an object for ``retention_s`` seconds (default 7 days, the events
stream's max age: an execution older than that cannot be rebuilt anyway; ``NOETL_PAYLOAD_RETENTION``
overrides it for a *new* bucket). Storing a value whose object is older than half the retention
writes it again, so a reference made now stays readable for at least half the retention.
"""
from __future__ import annotations

import asyncio
import base64
import collections
import datetime
import hashlib
import os
import re
from typing import Any

from nats.js.api import ObjectStoreConfig
from nats.js.errors import NotFoundError, ObjectNotFoundError

from . import metrics
from .wire import dumps, loads

from ..contracts.refs import MARKER, STORE, is_ref  # noqa: E402,F401 - what a reference is, in one place
from ..contracts.subjects import PAYLOADS_BUCKET as BUCKET  # noqa: E402
DEFAULT_LIMIT = 256 * 1024  # D23 default for executor.spec.policy.limits.max_payload_bytes
DEFAULT_RETENTION_S = 7 * 24 * 3600.0
# An object is read message by message (its metadata, then each chunk by subject), never through a
# consumer: a consumer's configuration is whatever its creator sends, and a push consumer's deliveries
# go to any subject it names, so no service's NATS user may create one on this stream (nats_auth.py).
GET_TIMEOUT_S = 10.0  # plus a second per MiB; then TimeoutError, and the message is retried
STREAM = f"OBJ_{BUCKET}"
CHUNKS_AHEAD = 16  # chunks asked for at once
MAX_OBJECT_BYTES = 1 << 30  # an object's metadata saying more is not ours


class OverBudget(Exception):
    """Reading references back would pass the bytes allowed (:meth:`PayloadStore.expand`)."""


class PayloadMissing(KeyError):
    """A reference whose object is gone (expired past the retention, or deleted). A ``KeyError``, so a
    control-plane message that needs it is dropped as poison (logged), not retried 50 times."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "payload missing"


class PayloadStore:
    def __init__(self, js, cache_bytes: int = 64 * 1024 * 1024, retention_s: float | None = None, replicas: int = 1,
                 service: str = "noetl"):
        self.js, self.replicas, self.service = js, replicas, service
        self.retention_s = retention_s or float(os.environ.get("NOETL_PAYLOAD_RETENTION", DEFAULT_RETENTION_S))
        self._bucket = None
        self._cache: collections.OrderedDict[str, tuple[int, Any]] = collections.OrderedDict()
        self._cache_bytes, self._cached = cache_bytes, 0

    async def bucket(self):
        if self._bucket is None:
            try:
                self._bucket = await self.js.object_store(BUCKET)
            except NotFoundError:  # missing: create it
                self._bucket = await self.js.create_object_store(BUCKET, config=ObjectStoreConfig(
                    description="noetl payload references (D23)", ttl=self.retention_s, replicas=self.replicas))
        return self._bucket

    async def put(self, value: Any) -> dict[str, Any]:
        data = dumps(value)
        digest = hashlib.sha256(data).hexdigest()
        bucket = await self.bucket()
        try:
            info = await bucket.get_info(digest)
            if _age_s(info.mtime) > self.retention_s / 2:  # refresh: this reference must outlive it
                await bucket.put(digest, data)
                self._count("put", len(data))
        except (ObjectNotFoundError, NotFoundError):
            await bucket.put(digest, data)
            self._count("put", len(data))
        self._remember(digest, len(data), value)
        return {"store": STORE, "key": digest, "size": len(data), "checksum": f"sha256:{digest}"}

    async def get(self, ref: dict[str, Any]) -> Any:

        key = ref["key"]
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key][1]
        try:
            timeout = GET_TIMEOUT_S + float(ref.get("size") or 0) / (1 << 20)
            data = await asyncio.wait_for(self._read(key), timeout)
        except (ObjectNotFoundError, NotFoundError):
            raise PayloadMissing(f"payload {key} ({ref.get('size')} bytes) is no longer in {BUCKET}: objects are "
                                 f"kept {self.retention_s:.0f} s (NOETL_PAYLOAD_RETENTION)") from None
        self._count("get", len(data))
        if hashlib.sha256(data).hexdigest() != key:
            raise ValueError(f"payload {key} does not match its checksum")
        value = loads(data)
        self._remember(key, len(data), value)
        return value

    async def _read(self, key: str) -> bytes:
        """Object ``key``'s bytes: its metadata (the last message of its meta subject), then its chunks
        (:meth:`_chunks`), as the object store lays them out. Raises ObjectNotFoundError when it is gone, ValueError when it is not whole. The same
        value stored again meanwhile (a refresh, or two writers at once) gives it new chunks and purges
        the old ones: it is read again, from its new metadata."""
        meta_subject = f"$O.{BUCKET}.M.{base64.urlsafe_b64encode(key.encode()).decode()}"
        for _ in range(3):
            info = await self._meta(meta_subject)
            size, chunks = int(info.get("size") or 0), int(info.get("chunks") or 0)
            if size > MAX_OBJECT_BYTES or chunks > max(size, 1):
                raise ValueError(f"payload {key}: its metadata says {size} bytes in {chunks} chunks")
            try:
                parts = await self._chunks(f"$O.{BUCKET}.C.{info['nuid']}", chunks, size)
            except NotFoundError:  # its chunks purged as it was read: stored again, or deleted
                if (await self._meta(meta_subject)).get("nuid") != info["nuid"]:
                    continue
                raise ConnectionError(f"payload {key}: a chunk could not be read; asked again later") from None
            got = sum(len(p) for p in parts)
            if got != size:
                raise ValueError(f"payload {key}: {got} bytes of its chunks, not the {size} its metadata says")
            return b"".join(parts)
        raise ConnectionError(f"payload {key}: stored again each time it was read; asked again later")

    async def _chunks(self, subject: str, chunks: int, size: int) -> list[bytes]:
        """The first ``chunks`` messages of ``subject``, in order: the first by subject, then the ones
        after it asked for side by side at the sequences that follow (an object's chunks are stored one
        after another unless another object's came between), each taken only if it is of ``subject``;
        from the first that is not, the next by subject. NotFoundError when one is gone."""
        parts, seq, got = [], 0, 0
        ahead: list[Any] = [None]  # the first: by subject
        while len(parts) < chunks and got <= size:
            for msg in ahead:
                adjacent = msg is not None and msg.subject == subject
                if not adjacent:
                    msg = await self.js.get_msg(STREAM, seq=seq + 1, subject=subject, next=True)
                parts.append(msg.data or b"")
                seq, got = msg.seq, got + len(parts[-1])
                if not adjacent:
                    break
            ahead = await asyncio.gather(*(self._at(seq + 1 + i) for i in range(min(CHUNKS_AHEAD, chunks - len(parts)))))
        return parts

    async def _at(self, seq: int) -> Any:
        try:
            return await self.js.get_msg(STREAM, seq=seq)
        except NotFoundError:
            return None

    async def _meta(self, subject: str) -> dict:
        meta = await self.js.get_last_msg(STREAM, subject)  # NotFoundError: gone
        info = loads(meta.data) if meta.data else {}
        if not isinstance(info, dict) or info.get("deleted") or not info.get("nuid"):
            raise ObjectNotFoundError
        return info

    def _count(self, op: str, size: int) -> None:
        metrics.PAYLOAD_BYTES.labels(self.service, op).inc(size)
        metrics.PAYLOAD_OBJECTS.labels(self.service, op).inc()

    def _remember(self, key: str, size: int, value: Any) -> None:
        if key in self._cache:
            self._cache.move_to_end(key)
            return
        if size > self._cache_bytes // 4:
            return
        self._cache[key] = (size, value)
        self._cached += size
        while self._cached > self._cache_bytes:
            _, (s, _) = self._cache.popitem(last=False)
            self._cached -= s

    async def shrink(self, value: Any, limit: int = DEFAULT_LIMIT) -> Any:
        """``value`` with every part whose JSON is over ``limit`` bytes replaced by a reference:
        the biggest containers are split first; one still too big is stored whole."""

        if is_ref(value):
            return value
        if len(dumps(value)) <= limit:
            return value
        if isinstance(value, dict):
            out = {k: await self.shrink(v, limit) for k, v in value.items()}
        elif isinstance(value, list):
            out = [await self.shrink(v, limit) for v in value]
        else:
            return await self.put(value)
        return out if len(dumps(out)) <= limit else await self.put(value)

    async def expand(self, value: Any, budget: list[int] | None = None) -> Any:
        """``value`` with every reference replaced by what it refers to (recursively). ``budget``: a
        one-item list of the bytes the references may stand for, the references inside what they stand
        for included; each reference's size is taken from it before its object is read, and
        :class:`OverBudget` is raised when it would go below zero (the list then says by how much)."""
        if is_ref(value):
            if budget is not None:
                budget[0] -= int(value.get("size") or 0)
                if budget[0] < 0:
                    raise OverBudget()
            return await self.expand(await self.get(value), budget)
        if isinstance(value, dict):
            return {k: await self.expand(v, budget) for k, v in value.items()}
        if isinstance(value, list):
            return [await self.expand(v, budget) for v in value]
        return value


_FRACTION = re.compile(r"(\.\d{6})\d+")


def _age_s(mtime: Any) -> float:
    """Seconds since an object's ``mtime`` (RFC 3339 with nanoseconds); 0 when unreadable."""
    try:
        when = datetime.datetime.fromisoformat(_FRACTION.sub(r"\1", str(mtime)).replace("Z", "+00:00"))
    except ValueError:
        return 0.0
    return (datetime.datetime.now(datetime.timezone.utc) - when).total_seconds()
