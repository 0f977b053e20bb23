"""The credential table in Postgres (D24): rows sealed with the credential key (core/credentials.py).

The key comes from configuration:

- ``NOETL_CREDENTIAL_KEY``: base64 of 32 bytes;
- otherwise the file ``<home>/credential.key`` of the stack's home (``noetl up --home``, ``noetl
  service credentials --home``), generated on the first write (mode 600) when it does not exist.

Rotation: start the service with the new key in ``NOETL_CREDENTIAL_KEY`` and the previous one in
``NOETL_CREDENTIAL_KEY_OLD``; every row that the new key cannot open but the old one can is
re-encrypted under the new key before the service answers (:meth:`CredentialStore.rotate`).

The table is the one the event-recorder kept before this service existed (its migration 2): same
columns, same sealing, so existing rows keep working. This service's own migrations are numbered in
``credential_schema_version``.
"""
from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidTag
import psycopg
from psycopg import AsyncConnection
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from noetl_mesh.core.credentials import (DEFAULT_ROLES, USABLE, KEY_ENV, KEY_FILE, OLD_KEY_ENV, decode_key, decrypt, encrypt,
                                         new_key_text)
from noetl_mesh.infra import pg_migrations
from noetl_mesh.infra.bus import BusError

log = logging.getLogger("noetl.credentials")

MIGRATIONS: list[tuple[int, str, str]] = [
    (1, "credential store (the event-recorder's migration 2 made the same table)", """
CREATE TABLE IF NOT EXISTS credential (
    id          bigserial PRIMARY KEY,
    name        text NOT NULL UNIQUE,
    kind        text NOT NULL DEFAULT 'generic',
    description text,
    data        bytea NOT NULL,
    nonce       bytea NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
);
"""),
    (2, "who may use each credential from a playbook (D24): admins' playbooks only until an admin says otherwise",
     "ALTER TABLE credential ADD COLUMN IF NOT EXISTS roles text[] NOT NULL DEFAULT '{admin}';"),
    (3, "the users a credential names, who may use it whatever their roles (D24)",
     "ALTER TABLE credential ADD COLUMN IF NOT EXISTS users jsonb NOT NULL DEFAULT '[]';"
     f"ALTER TABLE credential ADD CONSTRAINT {USABLE} CHECK (cardinality(roles) > 0 OR jsonb_array_length(users) > 0);"),
]
_LOCK = 0x6E6F65746C63  # pg_advisory_xact_lock key of these migrations ("noetlc")
_META = ("name", "kind", "description", "roles", "users", "created_at", "updated_at")
_COLUMNS = ", ".join(_META)


async def migrate(conn: AsyncConnection) -> int:
    """Apply the missing migrations (replicas starting together wait on an advisory lock); the schema
    version now in place. The migration that gives credentials their roles says how many it made
    admins' only (D24), and how to give developers theirs."""
    known = await (await conn.execute("SELECT to_regclass('credential_schema_version') IS NOT NULL")).fetchone()
    before = (await (await conn.execute("SELECT coalesce(max(version), 0) FROM credential_schema_version")).fetchone())[0] \
        if known[0] else 0
    now = await pg_migrations.apply(conn, MIGRATIONS, table="credential_schema_version", lock=_LOCK)
    if before < 2 <= now:
        count = (await (await conn.execute("SELECT count(*) FROM credential")).fetchone())[0]
        if count:
            log.warning("%d stored credential(s) may now be used only by the playbooks of admins (D24: a credential's "
                        "roles, admin unless given); give developers the ones they may use: noetl credential roles "
                        "NAME developer,admin", count)
    return now


def key_file(home: str | os.PathLike | None) -> Path | None:
    """``<home>/credential.key``; None without a home (then only ``NOETL_CREDENTIAL_KEY`` works)."""
    return Path(home) / KEY_FILE if home else None


def load_key(home: str | os.PathLike | None, create: bool) -> bytes | None:
    """The configured key: ``NOETL_CREDENTIAL_KEY``, else the home's key file (generated when ``create``)."""
    if os.environ.get(KEY_ENV):
        return decode_key(os.environ[KEY_ENV], KEY_ENV)
    path = key_file(home)
    if path is None:
        return None
    if path.exists():
        return decode_key(path.read_text(), str(path))
    if not create:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    text = new_key_text()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    log.warning("no %s: generated a credential key in %s (keep it: stored credentials need it)", KEY_ENV, path)
    return decode_key(text, str(path))


class CredentialStore:
    """The rows, sealed and opened with the key; every method opens one connection of ``pool``."""

    def __init__(self, pool: AsyncConnectionPool, home: str | os.PathLike | None):
        self.pool, self.home = pool, home
        self._key: bytes | None = None

    def key(self, create: bool = False) -> bytes:
        if self._key is None:
            self._key = load_key(self.home, create)
        if self._key is None:
            where = key_file(self.home)
            raise BusError("unavailable", f"no credential key: set {KEY_ENV}" + (
                f" (the key file {where} does not exist)" if where else " (the service was started without a home "
                                                                         "for its key file)"))
        return self._key

    def open(self, name: str, blob: bytes, nonce: bytes) -> Any:
        try:
            return decrypt(self.key(), name, blob, nonce)
        except InvalidTag:
            raise BusError("internal", f"credential {name!r} cannot be decrypted with the configured key "
                                       f"(rotated without {OLD_KEY_ENV}?)") from None

    async def rotate(self) -> int:
        """Re-encrypt under the current key every row that only ``NOETL_CREDENTIAL_KEY_OLD`` opens."""
        old_text = os.environ.get(OLD_KEY_ENV)
        if not old_text:
            return 0
        old, new = decode_key(old_text, OLD_KEY_ENV), self.key(create=True)
        done = 0
        async with self.pool.connection() as conn:
            async with conn.transaction():
                rows = await (await conn.execute("SELECT name, data, nonce FROM credential FOR UPDATE")).fetchall()
                for name, blob, nonce in rows:
                    try:
                        decrypt(new, name, blob, nonce)
                        continue  # already under the new key
                    except InvalidTag:
                        pass
                    try:
                        data = decrypt(old, name, blob, nonce)
                    except InvalidTag:
                        log.error("credential %r opens with neither the new nor the old key", name)
                        continue
                    blob2, nonce2 = encrypt(new, name, data)
                    await conn.execute("UPDATE credential SET data = %s, nonce = %s, updated_at = now() WHERE name = %s",
                                       (blob2, nonce2, name))
                    done += 1
        if done:
            log.warning("re-encrypted %d credential(s) under the new key", done)
        return done

    async def put(self, name: str, kind: str, data: dict[str, Any], description: str | None,
                  roles: list[str] | None = None, users: list[dict[str, str]] | None = None) -> dict[str, Any]:
        """Create or replace a credential. ``roles`` None: a new one's are :data:`DEFAULT_ROLES`, a
        replaced one keeps its own (a new password does not change who may use it); ``users`` None: a
        new one names none, a replaced one keeps its own."""
        try:
            blob, nonce = encrypt(self.key(create=True), name, data)
        except TypeError as exc:  # orjson: an unpaired surrogate, an integer over 64 bits
            raise BusError("bad_request", f"data cannot be stored: {exc}") from None
        async with self.pool.connection() as conn, _usable():
            row = await (await conn.execute(
                f"""INSERT INTO credential (name, kind, description, data, nonce, roles, users)
                    VALUES (%s, %s, %s, %s, %s, %s, %s)
                    ON CONFLICT (name) DO UPDATE SET kind = excluded.kind, description = excluded.description,
                       data = excluded.data, nonce = excluded.nonce, updated_at = now(),
                       roles = CASE WHEN %s THEN excluded.roles ELSE credential.roles END,
                       users = CASE WHEN %s THEN excluded.users ELSE credential.users END
                    RETURNING {_COLUMNS}""",
                (name, kind, description, blob, nonce, list(DEFAULT_ROLES if roles is None else roles),
                 Jsonb(users or []), roles is not None, users is not None))).fetchone()
        return _meta(row)

    async def set_roles(self, name: str, roles: list[str], users: list[dict[str, str]] | None) -> dict[str, Any] | None:
        """Who may use the credential from a playbook now (D24): its roles, and its users unless None
        (kept); None when there is no such credential."""
        async with self.pool.connection() as conn, _usable():
            row = await (await conn.execute(
                f"UPDATE credential SET roles = %s, users = coalesce(%s, users), updated_at = now() WHERE name = %s"
                f" RETURNING {_COLUMNS}", (list(roles), None if users is None else Jsonb(users), name))).fetchone()
        return None if row is None else _meta(row)


    async def list(self) -> list[dict[str, Any]]:
        async with self.pool.connection() as conn:
            rows = await (await conn.execute(
                f"SELECT {_COLUMNS} FROM credential ORDER BY name")).fetchall()
        return [_meta(r) for r in rows]

    async def get(self, name: str, include_data: bool) -> dict[str, Any] | None:
        async with self.pool.connection() as conn:
            row = await (await conn.execute(
                f"SELECT {_COLUMNS}, data, nonce FROM credential WHERE name = %s", (name,))).fetchone()
        if row is None:
            return None
        out = _meta(row[:len(_META)])
        if include_data:
            out["data"] = self.open(name, row[-2], row[-1])
        return out

    async def delete(self, name: str) -> bool:
        async with self.pool.connection() as conn:
            row = await (await conn.execute("DELETE FROM credential WHERE name = %s RETURNING name", (name,))).fetchone()
        return row is not None

    async def sealed(self, names: list[str]) -> dict[str, tuple[list[str], list[dict[str, str]], bytes, bytes]]:
        """``{name: (roles, users, sealed data, nonce)}`` of the stored ones among ``names``: who may use
        each (D24) is checked before any is opened (:meth:`open`)."""
        async with self.pool.connection() as conn:
            rows = await (await conn.execute(
                "SELECT name, roles, users, data, nonce FROM credential WHERE name = ANY(%s)",
                (list(set(names)),))).fetchall()
        return {name: (list(roles), list(users or []), blob, nonce) for name, roles, users, blob, nonce in rows}


@contextlib.asynccontextmanager
async def _usable():
    """A write that would leave a credential nobody may use (no role, no user: the table's check) is a
    ``bad_request`` (D24)."""
    try:
        yield
    except psycopg.errors.CheckViolation as exc:
        if exc.diag.constraint_name != USABLE:
            raise
        raise BusError("bad_request", "nobody could use this credential: give it a role or name a user (D24)") from None


def _meta(row: tuple) -> dict[str, Any]:
    return {k: (v.isoformat() if hasattr(v, "isoformat") else v) for k, v in zip(_META, row)}
