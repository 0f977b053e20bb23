"""The sessions service's storage: three NATS KV buckets, their keys, and compare-and-set writes that
carry a per-message TTL (nats-server 2.11+: the buckets' streams allow ``Nats-TTL``).

| bucket | keys | TTL |
|---|---|---|
| ``noetl_sessions`` | ``noetl.sessions.<session id>`` (a session), ``noetl.sessions.user.<user id>.<session id>`` (a user's index) | the session's: idle or absolute expiry, whichever is first; the index entry: the absolute lifetime |
| ``noetl_users`` | ``user.<user id>``, ``name.<hash of username>`` (unique names), ``oidc.<hash of issuer and subject>``, ``token.<token id>``, ``tokens.<user id>.<token id>`` (a user's index), ``bootstrap`` | none; API tokens with an expiry carry it |
| ``noetl_logins`` | ``user.<hash of username>``, ``address.<hash of address>`` (failed-login counters) | ``login_lock_seconds`` after the last failure |

A key's TTL belongs to the message that carries it, so every write of an expiring key states its TTL
again (a write without one would make the key permanent). NATS removes the key when it runs out; no
process sweeps. The buckets set no ``subject_delete_marker_ttl``, so an expired key leaves no delete
marker (nothing watches these buckets: gateways hear of revocations by notice, and an expiry needs no
notice because every read checks the times). A revocation purges the key, leaving a purge marker that itself expires after
``MARKER_TTL``; a compare-and-set write against a purged or expired key fails (its last sequence is
the marker's, or 0), so nothing brings a removed key back.
"""
from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import nats
import orjson
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import APIError, BadRequestError, BucketNotFoundError, NotFoundError

from noetl_mesh.core.access import key_part
from noetl_mesh.infra.bus import NO_PLACEMENT

PLACEMENT_ATTEMPTS = 60  # half a second apart
log = logging.getLogger("noetl.sessions.store")

from noetl_mesh.contracts.subjects import LOGINS_BUCKET as LOGINS  # noqa: E402
from noetl_mesh.contracts.subjects import SESSIONS_BUCKET as SESSIONS  # noqa: E402
from noetl_mesh.contracts.subjects import USERS_BUCKET as USERS  # noqa: E402
MARKER_TTL = 60  # seconds a purge marker stays (then the key is gone without a trace)
WRONG_LAST = (10071, 10164)  # JSStreamWrongLastSequence(Constant)Err
_DELETED = ("DEL", "PURGE")


def session_key(session_id: str) -> str:
    return f"noetl.sessions.{session_id}"


def session_index(user_id: str, session_id: str = "*") -> str:
    return f"noetl.sessions.user.{user_id}.{session_id}"


def user_key(user_id: str = "*") -> str:
    return f"user.{user_id}"


def name_key(username: str) -> str:
    return f"name.{key_part(username)}"


def oidc_key(issuer: str, subject: str) -> str:
    return f"oidc.{key_part(issuer + chr(10) + subject)}"


def token_key(token_id: str) -> str:
    return f"token.{token_id}"


def token_index(user_id: str, token_id: str = "*") -> str:
    return f"tokens.{user_id}.{token_id}"


BOOTSTRAP = "bootstrap"


def failed_user_key(username: str) -> str:
    return f"user.{key_part(username)}"


def failed_address_key(address: str) -> str:
    return f"address.{key_part(address)}"


class Conflict(Exception):
    """A compare-and-set write lost: the key exists (create) or changed or is gone (update)."""


def seconds(ttl: float | None) -> int | None:
    return None if ttl is None else max(1, math.ceil(ttl))


class Bucket:
    """One KV bucket, read and written through its stream (``KV_<bucket>``, subjects ``$KV.<bucket>.<key>``)."""

    def __init__(self, js, name: str, description: str, replicas: int = 1):
        self.js, self.name, self.description, self.replicas = js, name, description, replicas
        self.stream, self.prefix = f"KV_{name}", f"$KV.{name}."

    async def open(self) -> "Bucket":
        """Create the bucket if missing (file storage, one revision per key, per-message TTLs allowed);
        an existing bucket without per-message TTLs is updated to allow them. Values are read from the
        stream's leader (``STREAM.MSG.GET``), never by a direct get (docs/nats-security.md)."""
        for attempt in range(PLACEMENT_ATTEMPTS):
            try:
                await self.js.key_value(self.name)
                break
            except (BucketNotFoundError, NotFoundError):
                pass
            try:
                await self.js.create_key_value(KeyValueConfig(
                    bucket=self.name, description=self.description, history=1, storage=StorageType.FILE,
                    replicas=self.replicas))
                break
            except BadRequestError as exc:
                if exc.err_code != NO_PLACEMENT or attempt == PLACEMENT_ATTEMPTS - 1:
                    await self.js.key_value(self.name)  # created meanwhile by another replica
                    break
                # a cluster still forming (a peer not online yet) cannot place its replicas: ask again
                log.info("bucket %s: %s; asking again", self.name, exc.description)
                await asyncio.sleep(0.5)
        info = await self.js.stream_info(self.stream)
        if not info.config.allow_msg_ttl:
            info.config.allow_msg_ttl = True
            await self.js.update_stream(info.config)
        return self

    async def get(self, key: str) -> tuple[dict[str, Any], int] | None:
        """The value and revision of ``key``, None when absent, removed or unreadable: the stream
        leader's answer (a replica a moment behind never answers "absent" for a key written meanwhile)."""
        try:
            msg = await self.js.get_msg(self.stream, subject=self.prefix + key)
        except NotFoundError:
            return None
        if msg.headers and msg.headers.get("KV-Operation") in _DELETED:
            return None
        try:
            value = orjson.loads(msg.data or b"")
        except orjson.JSONDecodeError:
            value = None
        if not isinstance(value, dict):
            log.warning("bucket %s: the value of %s is not a JSON object; treated as absent", self.name, key)
            return None
        return value, msg.seq

    async def create(self, key: str, value: dict[str, Any], ttl: float | None = None) -> int:
        """Write ``key`` only if it holds nothing (a purge marker counts as nothing); Conflict otherwise."""
        try:
            return await self._write(key, value, 0, ttl)
        except Conflict:
            try:
                msg = await self.js.get_msg(self.stream, subject=self.prefix + key)
            except NotFoundError:  # expired in between: try once more
                return await self._write(key, value, 0, ttl)
            if msg.headers and msg.headers.get("KV-Operation") in _DELETED:
                return await self._write(key, value, msg.seq, ttl)
            raise

    async def update(self, key: str, value: dict[str, Any], last: int, ttl: float | None = None) -> int:
        """Write ``key`` only if its revision is still ``last``; Conflict otherwise (also when it was
        removed or expired meanwhile: an update never creates)."""
        if not last:
            raise ValueError("update needs the revision read")
        return await self._write(key, value, last, ttl)

    async def _write(self, key: str, value: dict[str, Any], last: int, ttl: float | None) -> int:
        try:
            ack = await self.js.publish(self.prefix + key, orjson.dumps(value), msg_ttl=seconds(ttl),
                                        headers={"Nats-Expected-Last-Subject-Sequence": str(last)})
        except APIError as exc:
            if exc.err_code in WRONG_LAST:
                raise Conflict(key) from None
            raise
        return ack.seq

    async def purge(self, key: str) -> None:
        """Remove ``key`` and its history; the purge marker expires after MARKER_TTL."""
        await self.js.publish(self.prefix + key, b"", msg_ttl=MARKER_TTL,
                              headers={"KV-Operation": "PURGE", "Nats-Rollup": "sub"})

    async def keys(self, pattern: str) -> list[str]:
        """The keys matching ``pattern`` (NATS wildcards) that hold a message now, purge markers
        included (a get tells them apart). One request (the stream's subject list)."""
        info = await self.js.stream_info(self.stream, subjects_filter=self.prefix + pattern)
        subjects = (info.state.subjects or {}) if info.state else {}
        return sorted(s[len(self.prefix):] for s in subjects)

    async def values(self, pattern: str) -> list[tuple[str, dict[str, Any], int]]:
        """(key, value, revision) of every live key matching ``pattern`` (64 gets at a time)."""
        keys = await self.keys(pattern)
        got: list = []
        for i in range(0, len(keys), 64):
            got += await asyncio.gather(*(self.get(k) for k in keys[i:i + 64]))
        return [(k, g[0], g[1]) for k, g in zip(keys, got) if g is not None]


UNAVAILABLE = (nats.errors.Error, asyncio.TimeoutError, ConnectionError)  # NATS or JetStream not answering
