"""The credential store (D24): Postgres rows encrypted at rest, served over request/reply.

Values are kept as ``AES-GCM(key, nonce, json(data), associated data = the credential's name)`` with a
random 96-bit nonce per write. The key comes from configuration:

- ``NOETL_CREDENTIAL_KEY``: base64 of 32 bytes;
- otherwise the file ``$NOETL_HOME/credential.key`` (default ``.noetl/credential.key``), generated on
  the first write (mode 600) when it does not exist.

Rotation: start the recorder with the new key in ``NOETL_CREDENTIAL_KEY`` and the previous one in
``NOETL_CREDENTIAL_KEY_OLD``; every row that the new key cannot open but the old one can is
re-encrypted under the new key before the recorder answers (:func:`rotate`).

Subjects (:mod:`noetl_mesh.core.keychain`): ``put`` ``{name, kind, data, description}``, ``list``,
``get`` ``{name, include_data}``, ``delete`` ``{name}``, and ``resolve`` ``{names, execution_id}``
(``{name: data}`` for the stored ones: what workers ask when a command starts). Only ``get`` with
``include_data`` and ``resolve`` ever answer secret data; nothing here logs it.
"""
from __future__ import annotations

import base64
import logging
import os
import re
from pathlib import Path
from typing import Any

import orjson
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from noetl_mesh.infra.bus import (
    Q_CREDENTIAL_DELETE,
    Q_CREDENTIAL_GET,
    Q_CREDENTIAL_LIST,
    Q_CREDENTIAL_PUT,
    Q_CREDENTIAL_RESOLVE,
    BusError,
)

log = logging.getLogger("noetl.event-recorder.credentials")

MIGRATION = (2, "credential store", """
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
""")

NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,127}$")
KIND = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")
KEY_ENV, OLD_KEY_ENV = "NOETL_CREDENTIAL_KEY", "NOETL_CREDENTIAL_KEY_OLD"
_META = ("name", "kind", "description", "created_at", "updated_at")


# ------------------------------------------------------------------------------------------- keys
def _decode_key(text: str, where: str) -> bytes:
    try:
        key = base64.b64decode(text.strip(), validate=True)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{where} is not base64: {exc}") from None
    if len(key) != 32:
        raise ValueError(f"{where} must be base64 of 32 bytes, got {len(key)} bytes")
    return key


def key_file() -> Path:
    return Path(os.environ.get("NOETL_HOME") or ".noetl") / "credential.key"


def load_key(create: bool) -> bytes | None:
    """The configured key: ``NOETL_CREDENTIAL_KEY``, else the key file (generated when ``create``)."""
    if os.environ.get(KEY_ENV):
        return _decode_key(os.environ[KEY_ENV], KEY_ENV)
    path = key_file()
    if path.exists():
        return _decode_key(path.read_text(), str(path))
    if not create:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    text = base64.b64encode(AESGCM.generate_key(bit_length=256)).decode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    log.warning("no %s: generated a credential key in %s (keep it: stored credentials need it)", KEY_ENV, path)
    return _decode_key(text, str(path))


def encrypt(key: bytes, name: str, data: Any) -> tuple[bytes, bytes]:
    nonce = os.urandom(12)
    return AESGCM(key).encrypt(nonce, orjson.dumps(data), name.encode()), nonce


def decrypt(key: bytes, name: str, blob: bytes, nonce: bytes) -> Any:
    return orjson.loads(AESGCM(key).decrypt(bytes(nonce), bytes(blob), name.encode()))


# ------------------------------------------------------------------------------------------ store
class CredentialStore:
    def __init__(self, recorder: Any):
        self.recorder = recorder
        self._key: bytes | None = None

    def key(self, create: bool = False) -> bytes:
        if self._key is None:
            self._key = load_key(create)
        if self._key is None:
            raise BusError("unavailable", f"no credential key: set {KEY_ENV} (the store's key file {key_file()} "
                                          "does not exist)")
        return self._key

    def _open(self, name: str, blob: bytes, nonce: bytes) -> Any:
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
        old, new = _decode_key(old_text, OLD_KEY_ENV), self.key(create=True)
        done = 0
        async with self.recorder._connection() as conn:
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

    # -------------------------------------------------------------- handlers
    async def put(self, req: dict[str, Any]) -> dict[str, Any]:
        name, kind = _name(req), req.get("kind", "generic")
        if not isinstance(kind, str) or not KIND.match(kind):
            raise BusError("bad_request", "kind must be a short word such as 'postgres', 'http' or 'generic'")
        data = req.get("data")
        if not isinstance(data, dict) or not data:
            raise BusError("bad_request", "data must be a non-empty mapping of the credential's fields")
        description = req.get("description")
        if description is not None and not isinstance(description, str):
            raise BusError("bad_request", "description must be a string")
        from .schema import unstorable  # (schema imports this module)

        if description is not None and (reason := unstorable(description)):
            raise BusError("bad_request", f"description {reason}: Postgres cannot store it")
        try:
            blob, nonce = encrypt(self.key(create=True), name, data)
        except TypeError as exc:  # orjson: an unpaired surrogate, an integer over 64 bits
            raise BusError("bad_request", f"data cannot be stored: {exc}") from None
        async with self.recorder._connection() as conn:
            cur = await conn.execute(
                """INSERT INTO credential (name, kind, description, data, nonce) VALUES (%s, %s, %s, %s, %s)
                   ON CONFLICT (name) DO UPDATE SET kind = excluded.kind, description = excluded.description,
                       data = excluded.data, nonce = excluded.nonce, updated_at = now()
                   RETURNING name, kind, description, created_at, updated_at""",
                (name, kind, description, blob, nonce))
            row = await cur.fetchone()
        return _meta(row)

    async def list(self, req: dict[str, Any]) -> list[dict[str, Any]]:
        async with self.recorder._connection() as conn:
            rows = await (await conn.execute(
                "SELECT name, kind, description, created_at, updated_at FROM credential ORDER BY name")).fetchall()
        return [_meta(r) for r in rows]

    async def get(self, req: dict[str, Any]) -> dict[str, Any]:
        name = _name(req)
        include = req.get("include_data", False)
        if not isinstance(include, bool):
            raise BusError("bad_request", "include_data must be true or false")
        async with self.recorder._connection() as conn:
            row = await (await conn.execute(
                "SELECT name, kind, description, created_at, updated_at, data, nonce FROM credential WHERE name = %s",
                (name,))).fetchone()
        if row is None:
            raise BusError("not_found", f"credential {name!r} does not exist")
        out = _meta(row[:5])
        if include:
            out["data"] = self._open(name, row[5], row[6])
        return out

    async def delete(self, req: dict[str, Any]) -> dict[str, Any]:
        name = _name(req)
        async with self.recorder._connection() as conn:
            cur = await conn.execute("DELETE FROM credential WHERE name = %s RETURNING name", (name,))
            row = await cur.fetchone()
        if row is None:
            raise BusError("not_found", f"credential {name!r} does not exist")
        return {"name": name, "deleted": True}

    async def resolve(self, req: dict[str, Any]) -> dict[str, Any]:
        names = req.get("names")
        if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
            raise BusError("bad_request", "names must be a list of credential names")
        if not names:
            return {}
        async with self.recorder._connection() as conn:
            rows = await (await conn.execute(
                "SELECT name, data, nonce FROM credential WHERE name = ANY(%s)", (list(set(names)),))).fetchall()
        log.info("resolved %d of %d credential(s) for execution %s", len(rows), len(set(names)),
                 req.get("execution_id"))
        return {name: self._open(name, blob, nonce) for name, blob, nonce in rows}


def _name(req: dict[str, Any]) -> str:
    name = req.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise BusError("bad_request", "name must be an identifier (letters, digits, '_', '.', '-'; "
                                      "starting with a letter or '_')")
    return name


def _meta(row: tuple) -> dict[str, Any]:
    return {k: (v.isoformat() if hasattr(v, "isoformat") else v) for k, v in zip(_META, row)}


async def serve(recorder: Any) -> CredentialStore:
    """Re-encrypt rows after a key change (if configured), then answer the credential subjects."""
    store = CredentialStore(recorder)
    await store.rotate()
    for subject, handler in ((Q_CREDENTIAL_PUT, store.put), (Q_CREDENTIAL_LIST, store.list),
                             (Q_CREDENTIAL_GET, store.get), (Q_CREDENTIAL_DELETE, store.delete),
                             (Q_CREDENTIAL_RESOLVE, store.resolve)):
        await recorder._serve(subject, handler)
    recorder.credentials = store
    return store


__all__ = ["MIGRATION", "CredentialStore", "serve", "load_key", "encrypt", "decrypt", "key_file"]
