"""credentials: the credential store (D24), and the only service that hands a credential's data to a
worker. Its rules are in ``core/credentials.py``; its table in ``store.py``.

- ``noetl.q.credential.{put,list,get,roles,delete}`` (queue group ``credentials``): the gateway's API,
  which checks the caller's permissions (``credential.write``, ``credential.list``,
  ``credential.read_data`` for ``get`` with ``include_data``) and audits them; ``roles`` sets whose
  playbooks may use a credential (D24).
- ``noetl.q.credential.resolve.<pool>``: a worker of the pool asks for the keychain credentials of a
  command it holds. Granted only for that command (read back from ``NOETL_COMMANDS`` by its stream
  sequence), its execution, the names its keychain declares, a running execution (asked of the
  event-recorder), users who may use each credential (asked of the sessions service), answered to an
  inbox only; every grant and every refusal is recorded in the audit log
  (``credential.resolved``, ``credential.refused``: who, which execution, which names, never a value),
  a grant before its answer leaves.

Starting: the subjects are answered at once (``unavailable`` until the database is up and migrated, as
the recorder does); the database is tried again in the background until it is.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
import psycopg
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError
from psycopg_pool import AsyncConnectionPool

from noetl_mesh.contracts.subjects import Q_USERS_STANDING
from noetl_mesh.core import credentials as rules, standing as users
from noetl_mesh.core.credentials import Refused
from noetl_mesh.infra.bus import (COMMANDS, Q_CREDENTIAL_DELETE, Q_CREDENTIAL_GET, Q_CREDENTIAL_LIST,
                                  Q_CREDENTIAL_PUT, Q_CREDENTIAL_ROLES, Q_EXECUTION_STATUS,
                                  Bus, BusError, NoReply,
                                  credential_resolve_subject, unsubscribe_all)
from noetl_mesh.services.event_recorder.schema import transient, unstorable
from noetl_mesh.services.sessions import audit

from . import store as tables

log = logging.getLogger("noetl.credentials")
QUEUE = "credentials"
RETRY_CAP = 5.0  # seconds between attempts to reach the database, at most


class CredentialsService:
    name = "credentials"

    def __init__(self, bus: Bus, *, pg_dsn: str, home: str | None = None, pool_size: int = 2):
        self.bus, self.pg_dsn, self.home, self.pool_size = bus, pg_dsn, home, pool_size
        self.store: tables.CredentialStore | None = None
        self._pool: AsyncConnectionPool | None = None
        self._db_error = "not tried yet"
        self._subs: list[Any] = []
        self._task: asyncio.Task | None = None
        self._standing = users.StandingCache(
            lambda uid: self.bus.request(Q_USERS_STANDING, {"user_id": uid}, timeout=5))  # the sessions service's word

    async def start(self) -> None:
        await self.bus.attach()
        for subject, handler in ((Q_CREDENTIAL_PUT, self.put), (Q_CREDENTIAL_LIST, self.list),
                                 (Q_CREDENTIAL_GET, self.get), (Q_CREDENTIAL_DELETE, self.delete),
                                 (Q_CREDENTIAL_ROLES, self.set_roles)):
            self._subs.append(await self.bus.serve(subject, self._guarded(subject, handler), queue=QUEUE))
        self._subs.append(await self.bus.serve(credential_resolve_subject("*"), self.resolve, queue=QUEUE,
                                               with_msg=True, any_reply=True))  # a redirection is audited
        if not await self._open_database():
            self._task = asyncio.create_task(self._wait_for_database(), name="credentials database")

    async def ready(self) -> dict[str, Any]:
        ok = self.store is not None and bool(self._subs)
        return {"ok": ok, "database": self.store is not None,
                **({} if ok else {"error": f"the credential database is not reachable ({self._db_error})"})}

    async def stop(self) -> None:
        await unsubscribe_all(self._subs)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._pool is not None:
            await self._pool.close()
            self._pool, self.store = None, None

    # ------------------------------------------------------------------ the database
    async def _open_database(self) -> bool:
        pool = None
        try:
            conn = await asyncio.wait_for(psycopg.AsyncConnection.connect(self.pg_dsn), 10)
            async with conn:
                await tables.migrate(conn)
            pool = AsyncConnectionPool(self.pg_dsn, min_size=1, max_size=self.pool_size, open=False, name="credentials")
            await pool.open(wait=True, timeout=10)
            store = tables.CredentialStore(pool, self.home)
            await store.rotate()
        except Exception as exc:  # noqa: BLE001 - down, refusing, not migratable: reported and retried
            self._db_error = f"{type(exc).__name__}: {exc}".strip().rstrip(":")
            if pool is not None:
                await pool.close()
            return False
        self._pool, self.store = pool, store
        return True

    async def _wait_for_database(self) -> None:
        delay, attempt = 0.5, 1
        while not await self._open_database():
            log.warning("the credential database is unreachable (attempt %d: %s); next attempt in %.1fs",
                        attempt, self._db_error, delay)
            await asyncio.sleep(delay)
            delay, attempt = min(delay * 2, RETRY_CAP), attempt + 1
        log.warning("the credential database is up (attempt %d)", attempt)

    def _store(self) -> tables.CredentialStore:
        if self.store is None:
            raise BusError("unavailable", f"the credential database is not reachable yet ({self._db_error}); "
                                          "the credentials service keeps trying")
        return self.store

    def _guarded(self, subject: str, handler):
        async def guarded(req: Any, *more: Any) -> Any:
            try:
                return await handler(req if isinstance(req, dict) else {}, *more)
            except rules.Invalid as exc:
                raise BusError("bad_request", str(exc)) from None
            except BusError:
                raise
            except Exception as exc:
                if transient(exc):
                    raise BusError("unavailable", f"the credential database is unavailable: {exc}") from exc
                if isinstance(exc, psycopg.DataError):
                    raise BusError("bad_request", f"{subject}: Postgres refuses a value of the request: {exc}") from exc
                raise
        return guarded

    # ------------------------------------------------------------------ the gateway's API
    async def put(self, req: dict[str, Any]) -> dict[str, Any]:
        name, kind, data, description, roles, named = rules.put_fields(req)
        if description is not None and (reason := unstorable(description)):
            raise BusError("bad_request", f"description {reason}: Postgres cannot store it")
        return await self._store().put(name, kind, data, description, roles, named)

    async def set_roles(self, req: dict[str, Any]) -> dict[str, Any]:
        name, (roles, named) = rules.name_of(req.get("name")), rules.grant_of(req)
        found = await self._store().set_roles(name, roles, named)
        if found is None:
            raise BusError("not_found", f"credential {name!r} does not exist")
        return found

    async def list(self, req: dict[str, Any]) -> list[dict[str, Any]]:
        return await self._store().list()

    async def get(self, req: dict[str, Any]) -> dict[str, Any]:
        name, include = rules.name_of(req.get("name")), req.get("include_data", False)
        if not isinstance(include, bool):
            raise BusError("bad_request", "include_data must be true or false")
        found = await self._store().get(name, include)
        if found is None:
            raise BusError("not_found", f"credential {name!r} does not exist")
        return found

    async def delete(self, req: dict[str, Any]) -> dict[str, Any]:
        name = rules.name_of(req.get("name"))
        if not await self._store().delete(name):
            raise BusError("not_found", f"credential {name!r} does not exist")
        return {"name": name, "deleted": True}

    # ------------------------------------------------------------------ workers
    async def resolve(self, req: Any, msg: Msg) -> dict[str, Any]:
        """A worker's resolution: granted (:func:`rules.authorize`) and audited, or refused and audited."""
        ask: rules.Resolve | None = None
        try:
            ask = rules.parse_resolve(msg.subject, msg.reply, req)
            subject, command = await self._command(ask.seq)
            names = rules.authorize(ask, subject, command)
            state = await self._execution(ask.execution_id)
            rules.check_running(ask, state.get("status"))
            store = self._store()
            try:
                sealed = await store.sealed(names)
            except Exception as exc:  # noqa: BLE001 - the database: the worker retries its command
                raise BusError("unavailable", f"the credential database is unavailable: {exc}") from exc
            await self._check_roles({name: (roles, named) for name, (roles, named, _, _) in sealed.items()}, command)
        except Refused as refused:
            await self._audit_refused(msg, req, ask, refused)
            if refused.reason == "bad_reply":
                raise NoReply(refused.message) from None  # an answer to that subject could reach anyone
            kind = "bad_request" if refused.reason == "bad_request" else "forbidden"
            raise BusError(kind, refused.message, {"reason": refused.reason}) from None
        values = {name: store.open(name, blob, nonce) for name, (_, _, blob, nonce) in sealed.items()}
        try:
            await audit.record(self.bus, "credential.resolved", actor=_worker(ask.pool),
                               target={"execution_id": ask.execution_id, "credentials": names},
                               details={**ask.summary(), "found": sorted(values), "step": command.get("step"),
                                        "requested_by": state.get("requested_by"),
                                        "acting_for": _acting_for(command)})
        except Exception as exc:  # noqa: BLE001 - no record, no data
            raise BusError("unavailable", f"the audit log cannot record the resolution ({type(exc).__name__}: "
                                          f"{exc}): nothing is answered without its record") from exc
        log.info("resolved %d of %d credential(s) for execution %s (worker-%s, command %d)", len(values), len(names),
                 ask.execution_id, ask.pool, ask.seq)
        return values

    async def _check_roles(self, roles: dict[str, tuple[list[str], list[dict[str, str]]]], command: dict) -> None:
        """D24: :class:`Refused` unless every user the command acts for may use each stored credential
        it names (``roles``: stored name -> its roles and users; :func:`rules.use_refusal`); their standing is the
        sessions service's word, kept :data:`standing.STANDING_TTL` seconds. ``unavailable`` while that
        service does not answer: the worker tries again."""
        standing: dict[str, Any] = {}
        if roles and command.get("requested_by") is not None:
            for _, who in users.command_users(command):
                uid = who.get("user_id") if isinstance(who, dict) else None
                if isinstance(uid, str) and uid not in standing:
                    standing[uid] = await self._standing_of(uid)
        refused = rules.use_refusal(command, roles, standing)
        if refused is not None:
            raise refused

    async def _standing_of(self, uid: str) -> dict[str, Any]:
        try:
            return await self._standing.get(uid)
        except BusError as exc:
            if exc.kind in ("unavailable", "timeout"):
                raise BusError("unavailable", f"the standing of user {uid} cannot be checked ({exc.kind}: "
                                              f"{exc.message}): the worker tries again") from None
            raise Refused("not_allowed", f"the standing of user {uid!r}, whom the command acts for, cannot "
                                         f"be checked: {exc.kind}: {exc.message}") from None

    async def _command(self, seq: int) -> tuple[str | None, Any]:
        """The subject and the command stored at ``seq`` of ``NOETL_COMMANDS`` (its keychain expanded,
        D23); ``(None, None)`` when there is none."""
        try:
            raw = await self.bus.js.get_msg(COMMANDS, seq)
        except NotFoundError:
            return None, None
        except Exception as exc:  # noqa: BLE001 - NATS: the worker retries
            raise BusError("unavailable", f"{COMMANDS} cannot be read ({type(exc).__name__}: {exc})") from exc
        try:
            command = orjson.loads(raw.data or b"")
        except orjson.JSONDecodeError:
            return raw.subject, None
        if isinstance(command, dict) and "keychain" in command:
            try:  # the keychain, or a part of it, by reference (D23): read back
                command["keychain"] = await self.bus.expand(raw.data or b"", command["keychain"])
            except Exception as exc:  # noqa: BLE001 - gone past its retention, or the store unreachable
                raise BusError("unavailable", f"the keychain of command {seq} cannot be read: {exc}") from exc
        return raw.subject, command

    async def _execution(self, execution_id: str) -> dict[str, Any]:
        """The recorder's word on the execution (``{}``: not recorded yet)."""
        try:
            return await self.bus.request(Q_EXECUTION_STATUS, {"execution_id": execution_id}, timeout=5)
        except BusError as exc:
            if exc.kind == "not_found":
                return {}
            raise BusError("unavailable", f"cannot tell whether execution {execution_id} still runs: "
                                          f"{exc.kind}: {exc.message}") from None

    async def _audit_refused(self, msg: Msg, req: Any, ask: rules.Resolve | None, refused: Refused) -> None:
        pool = ask.pool if ask else msg.subject.rsplit(".", 1)[-1]
        summary = ask.summary() if ask else {"request": _sketch(req)}
        log.warning("refused a credential resolution of worker-%s: %s", pool, refused.message)
        try:
            await audit.record(self.bus, "credential.refused", actor=_worker(pool), outcome="denied",
                               target={"execution_id": ask.execution_id, "credentials": list(ask.names)} if ask else None,
                               details={**summary, "reason": refused.reason, "message": refused.message,
                                        "reply": (msg.reply or "")[:200]})
        except Exception:  # noqa: BLE001 - refused all the same
            log.exception("could not record the refusal in the audit log")


def _acting_for(command: dict) -> list[dict[str, Any]]:
    """The users a grant was checked against (D24), as the audit record names them."""
    return [{"as": did, **({k: who.get(k) for k in ("user_id", "username")} if isinstance(who, dict) else {})}
            for did, who in users.command_users(command)]


def _worker(pool: str) -> dict[str, Any]:
    """The audit record's actor: the NATS user that asked (the request's subject names its pool)."""
    return {"username": f"worker-{pool}"[:140], "kind": "worker"}


def _sketch(req: Any) -> Any:
    """What an audit record keeps of a malformed request: its shape, cut short."""
    text = orjson.dumps(req, default=str).decode(errors="replace") if req is not None else ""
    return text if len(text) <= 500 else text[:497] + "..."


__all__ = ["CredentialsService", "QUEUE"]
