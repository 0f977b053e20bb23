"""Which replica of a control-plane service reads which partitions: membership in NATS KV.

Every replica puts ``<service>.<replica id>`` into the KV bucket ``noetl_members`` (bucket TTL
``NOETL_MEMBERSHIP_TTL``, default 6 s, fixed when the bucket is created) every third of the TTL and reads the group back; the sorted
member list deals the partitions out (partition ``p`` to member ``p mod n``). A replica that stops
deletes its key; one that dies drops out when its key expires. The others take its partitions at their
next read. The group is read from the bucket's stream (its subjects, one per live key) rather than
with a KV watcher, which can wait forever for a key that expired while it was listing.

Ownership is an optimisation, never a correctness condition: the per-partition durables deliver to
one pinned reader at a time, which resyncs before it goes on whenever another may have held messages
(:mod:`.pinned`), dropping its cached states. So while membership changes — or when the KV
cannot be read, when a replica owns every partition — two replicas may read one partition for a moment,
which only costs cache rebuilds.
"""
from __future__ import annotations

import asyncio
import logging
import os
import uuid
from typing import Callable

from nats.js.errors import BadRequestError, BucketNotFoundError, NotFoundError

from .wire import NO_PLACEMENT

log = logging.getLogger("noetl.membership")

from ..contracts.subjects import MEMBERS_BUCKET as BUCKET  # noqa: E402
STREAM = f"KV_{BUCKET}"  # the bucket's stream
PREFIX = f"$KV.{BUCKET}."  # its subjects: one per key
BEAT = b"1"  # what a replica puts: a key holding anything else is no replica's (below)
MAX_MEMBERS = 64  # keys of a group read at a beat; more, and the replica reads every partition


def assign(partitions: int, members: list[str], me: str) -> set[int]:
    """The partitions ``me`` reads: every n-th of the sorted members' deal; all of them when ``me`` is
    not (or not yet) a member, so a replica that cannot see the group still does the work."""
    ordered = sorted(set(members))
    if me not in ordered:
        return set(range(partitions))
    i, n = ordered.index(me), len(ordered)
    return {p for p in range(partitions) if p % n == i}


class Membership:
    def __init__(self, js, group: str, partitions: int, on_change: Callable[[set[int]], None],
                 ttl: float | None = None, replicas: int = 1) -> None:
        self.js, self.group, self.partitions, self.on_change = js, group, partitions, on_change
        self.replicas = replicas
        self.ttl = ttl or float(os.environ.get("NOETL_MEMBERSHIP_TTL", 6))
        self.me = f"{group}.{uuid.uuid4().hex[:12]}"
        self.owned: set[int] = set(range(partitions))
        self.members: list[str] = []
        self.kv = None
        self.task: asyncio.Task | None = None
        self.stopping = False

    async def start(self) -> None:
        """Join; a failure here only means reading every partition until a later beat succeeds."""
        try:
            await asyncio.wait_for(self.beat(), 10)
        except Exception as exc:  # noqa: BLE001
            log.warning("membership of %s: cannot join the group yet (%s); reading every partition", self.me, exc)
        self.task = asyncio.create_task(self._run(), name=f"membership-{self.group}")

    async def _bucket(self):
        """Open (or create) the bucket; its TTL, fixed when it was created, sets the heartbeat."""
        if self.kv is None:
            try:
                kv = await self.js.key_value(BUCKET)
            except (BucketNotFoundError, NotFoundError):
                try:
                    kv = await self.js.create_key_value(bucket=BUCKET, ttl=self.ttl, history=1,
                                                        description="noetl control-plane replicas",
                                                        replicas=self.replicas)
                except BadRequestError as exc:  # created meanwhile by a replica with another TTL: use it
                    if exc.err_code == NO_PLACEMENT:  # a forming cluster: the caller asks again
                        raise
                    kv = await self.js.key_value(BUCKET)
            ttl = (await kv.status()).ttl
            if ttl:
                self.ttl = float(ttl)
            else:
                log.warning("bucket %s has no TTL: replicas that die are never dropped; recreate it", BUCKET)
            self.kv = kv
        return self.kv

    async def stop(self) -> None:
        self.stopping = True
        if self.task is not None:
            # A cancel can still be swallowed inside the beat: nats-py waits for its replies with
            # asyncio.wait_for, which on Python 3.11 loses a cancel that lands as the reply comes. The
            # loop then ends at its next turn (``stopping``).
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        if self.kv is None or self.js._nc.is_closed or not self.js._nc.is_connected:
            return  # the key expires
        try:  # leave at once (no delete marker left behind): the others take over at their next read
            await asyncio.wait_for(self.js.purge_stream(STREAM, subject=f"{PREFIX}{self.me}"), 2)
        except Exception:  # noqa: BLE001 - best effort: otherwise the key expires
            pass

    async def _run(self) -> None:
        failing_since = None
        while not self.stopping:
            await asyncio.sleep(self.ttl / 3)
            try:
                # not asyncio.wait_for: on Python 3.11 it swallows a cancel that comes as the beat ends,
                # and stop() then waited for this loop forever
                async with asyncio.timeout(self.ttl / 3):
                    await self.beat()
                if failing_since is not None:
                    log.info("membership of %s: the group is readable again", self.me)
                failing_since = None
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - KV trouble: keep the share a while, then read everything
                now = asyncio.get_running_loop().time()
                if failing_since is None:
                    failing_since = now
                    log.warning("membership of %s: cannot reach the group (%s)", self.me, exc)
                if now - failing_since >= self.ttl:  # the others no longer count this replica
                    self._set(set(range(self.partitions)))

    async def beat(self) -> None:
        """Heartbeat, then read the group: the keys of the bucket's stream under ``<group>.`` (one
        request; no watcher, so no race with keys expiring meanwhile), each another replica's only if it
        holds a heartbeat. The NATS server answers a JetStream API request to whatever reply subject the
        requester names, a key of this bucket among them, and no permission stops it: such keys hold the
        server's JSON, and counting them would deal the partitions out to replicas that do not exist."""
        kv = await self._bucket()
        await kv.put(self.me, BEAT)
        info = await self.js.stream_info(STREAM, subjects_filter=f"{PREFIX}{self.group}.>")
        subjects = (info.state.subjects or {}) if info.state else {}
        others = sorted(subject[len(PREFIX):] for subject in subjects if subject != PREFIX + self.me)
        if len(others) > MAX_MEMBERS:  # no stack runs that many: keys someone had the server write
            log.warning("membership of %s: %d keys in the group, more than %d replicas: reading every partition",
                        self.me, len(others), MAX_MEMBERS)
            self.members = [self.me]
            self._set(set(range(self.partitions)))
            return
        beats = await asyncio.gather(*(self._holds_beat(name) for name in others))
        self.members = sorted([self.me, *(name for name, ok in zip(others, beats) if ok)])
        self._set(assign(self.partitions, self.members, self.me))

    async def _holds_beat(self, name: str) -> bool:
        try:
            return (await self.js.get_last_msg(STREAM, PREFIX + name)).data == BEAT
        except NotFoundError:  # expired or left meanwhile
            return False

    def _set(self, owned: set[int]) -> None:
        if owned != self.owned:
            log.info("%s reads partitions %s (%d members)", self.me, sorted(owned), len(self.members))
            self.owned = owned
        self.on_change(owned)  # every beat: the owner also restarts a reader that ended
