"""The credential store's rules (D24), pure apart from the random nonce of :func:`encrypt`: what a
stored credential may look like, how it is sealed at rest, and who may have its data.

Sealing. A credential's data is kept as ``AES-GCM(key, nonce, json(data), associated data = its
name)`` with a random 96-bit nonce per write: a row copied under another name does not open.

Credentials are capabilities. A worker gets a credential's data only for a command it holds, for the
names that command's playbook keychain declares, while the execution runs, and only a worker of the
command's pool (:func:`authorize`). The worker names the command by where it is: its stream sequence
in ``NOETL_COMMANDS`` and its subject. That stream is a work queue: a command exists there from the
moment admission or the loop-coordinator publishes it until a worker acknowledges it (or the router
purges a finished execution's commands), and every command carries the playbook's keychain
declarations, so the stored message itself is the grant: nothing to sign, nothing to forge, and it ends
when the command does. The pool is the subject the request came on, ``noetl.q.credential.resolve.<pool>``,
which only the NATS user ``worker-<pool>`` may publish to (infra/nats_auth.py); the answer goes only to
an ``_INBOX.`` subject (every user but the admin may read only its own). The execution's status comes
from the event log: a command can outlive its execution (a worker that keeps its lease on the command
of a run that timed out, D29, while the execution completed: a completed execution's commands are not
purged).

Who may use one (:func:`use_refusal`). A stored credential names its roles (``admin`` unless an admin
says otherwise, :data:`DEFAULT_ROLES`): every user a command acts for (its execution's starter, its
playbook's author, the authors above a child: :func:`command_users`) must hold one of them now,
within the roles its request carried, or be one of the users it names (``users``: a credential for one
developer, or a team, whatever their roles), or nothing is resolved. So a developer's playbook cannot
read an admin's database password by naming it in its keychain, nor one developer's playbook another's.

A refusal (:class:`Refused`) has a ``reason`` (one word, for the audit log and for tests) and a message
saying what was asked and why it is refused.
"""
from __future__ import annotations

import base64
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

import orjson
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ..contracts.subjects import COMMANDS, CREDENTIAL_RESOLVE_PREFIX, POOL_NAME, command_parts
from . import access
from .standing import command_users, user_refusal
from .keychain import declarations_of, stored_name
from .state import FINAL

NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,127}\Z")
KIND = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}\Z")
KEY_ENV, OLD_KEY_ENV = "NOETL_CREDENTIAL_KEY", "NOETL_CREDENTIAL_KEY_OLD"
KEY_FILE = "credential.key"  # in the stack's home, when NOETL_CREDENTIAL_KEY is not set
MAX_NAMES = 64  # credentials one resolution may ask for
DEFAULT_ROLES = ("admin",)  # who may use a credential stored without roles (D24)
MAX_USERS = 100  # users one credential names (D24)
USABLE = "credential_usable"  # the table's check: a credential names a role or a user (store.py)
from ..contracts.subjects import INBOX  # noqa: E402 - answers go to inboxes only


class Invalid(ValueError):
    """A request the store refuses as malformed (``bad_request``)."""


# ------------------------------------------------------------------------------------------ values
def name_of(value: Any, what: str = "name") -> str:
    if not isinstance(value, str) or not NAME.match(value):
        raise Invalid(f"{what} must be an identifier (letters, digits, '_', '.', '-'; at most 128, starting with "
                      f"a letter or '_'), got {_show(value)}")
    return value


def roles_of(value: Any) -> list[str]:
    """A credential's roles (D24): the known role names, at least one; :class:`Invalid` otherwise."""
    try:
        return access.role_list(value)
    except access.AccessError as exc:
        raise Invalid(exc.message) from None


def users_of(value: Any) -> list[dict[str, str]]:
    """The users a credential names (D24), ``[{user_id, username}]`` as the gateway found them (by
    username or id), at most :data:`MAX_USERS`, each once; :class:`Invalid` otherwise."""
    if not isinstance(value, list) or len(value) > MAX_USERS:
        raise Invalid(f"users must be a list of at most {MAX_USERS} users")
    out: dict[str, dict[str, str]] = {}
    for user in value:
        uid = user.get("user_id") if isinstance(user, dict) else None
        name = user.get("username") if isinstance(user, dict) else None
        if not isinstance(uid, str) or not access.ID.match(uid) or not isinstance(name, str) or not 0 < len(name) <= 200:
            raise Invalid(f"users: each is {{user_id, username}} of a known user, got {_show(user)}")
        out.setdefault(uid, {"user_id": uid, "username": name})
    return list(out.values())


def put_fields(req: Mapping[str, Any]) -> tuple[str, str, dict[str, Any], str | None, list[str] | None,
                                                 list[dict[str, str]] | None]:
    """``(name, kind, data, description, roles, users)`` of a put request (``roles``, ``users`` None: not
    given), or :class:`Invalid`."""
    name = name_of(req.get("name"))
    kind = req.get("kind", "generic")
    if not isinstance(kind, str) or not KIND.match(kind):
        raise Invalid("kind must be a short word such as 'postgres', 'http' or 'generic'")
    data = req.get("data")
    if not isinstance(data, dict) or not data:
        raise Invalid("data must be a non-empty mapping of the credential's fields")
    description = req.get("description")
    if description is not None and not isinstance(description, str):
        raise Invalid("description must be a string")
    roles, users = grant_of(req, roles_required=False)
    return name, kind, data, description, roles, users


def grant_of(req: Mapping[str, Any], roles_required: bool = True) -> tuple[list[str] | None, list[dict[str, str]] | None]:
    """``(roles, users)``: who may use a credential, as a request sets it (D24); either None when not
    given. The roles may be none (``[]``) unless the request also clears the users: a credential of its
    users alone (the store refuses one that neither a role nor a user could use, :data:`USABLE`)."""
    users = None if req.get("users") is None else users_of(req.get("users"))
    value = req.get("roles")
    if value is None and not roles_required:
        return None, users
    return ([] if value == [] and users != [] else roles_of(value)), users


def decode_key(text: str, where: str) -> bytes:
    try:
        key = base64.b64decode(text.strip(), validate=True)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{where} is not base64: {exc}") from None
    if len(key) != 32:
        raise ValueError(f"{where} must be base64 of 32 bytes, got {len(key)} bytes")
    return key


def new_key_text() -> str:
    return base64.b64encode(AESGCM.generate_key(bit_length=256)).decode()


def encrypt(key: bytes, name: str, data: Any) -> tuple[bytes, bytes]:
    """``(ciphertext, nonce)``; TypeError for data JSON cannot carry (an unpaired surrogate, a huge int)."""
    nonce = os.urandom(12)
    return AESGCM(key).encrypt(nonce, orjson.dumps(data), name.encode()), nonce


def decrypt(key: bytes, name: str, blob: bytes, nonce: bytes) -> Any:
    """The data; ``cryptography.exceptions.InvalidTag`` under another key or name."""
    return orjson.loads(AESGCM(key).decrypt(bytes(nonce), bytes(blob), name.encode()))


# ------------------------------------------------------------------------------------------ grants
class Refused(Exception):
    """A resolution that is not granted: ``reason`` is one word (audit, tests), ``message`` says why."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason, self.message = reason, message


@dataclass(frozen=True)
class Resolve:
    """What a worker asks: the stored credentials ``names`` for ``execution_id``, for the command it
    holds at stream sequence ``seq`` of ``NOETL_COMMANDS`` (stored under ``subject``)."""

    pool: str
    execution_id: str
    names: tuple[str, ...]
    seq: int
    subject: str

    def summary(self) -> dict[str, Any]:
        """What the audit log keeps of the request (no value is ever in it)."""
        return {"execution_id": self.execution_id, "names": list(self.names),
                "command": {"stream": COMMANDS, "seq": self.seq, "subject": self.subject}}


def parse_resolve(subject: str, reply: str | None, req: Any) -> Resolve:
    """The request on ``noetl.q.credential.resolve.<pool>``: ``{execution_id, names, command: {seq,
    subject}}``, answered to ``reply``. :class:`Refused` (``bad_request``) when malformed."""
    pool = subject[len(CREDENTIAL_RESOLVE_PREFIX):] if subject.startswith(CREDENTIAL_RESOLVE_PREFIX) else ""
    if not POOL_NAME.match(pool):
        raise Refused("bad_request", f"{subject}: resolutions are asked on {CREDENTIAL_RESOLVE_PREFIX}<pool>")
    if not isinstance(reply, str) or not reply.startswith(INBOX) or len(reply) <= len(INBOX):
        raise Refused("bad_reply", f"the answer of a resolution goes to an inbox ({INBOX}...), never to "
                                   f"{_show(reply)}")
    if not isinstance(req, Mapping):
        raise Refused("bad_request", "the request must be a JSON object {execution_id, names, command}")
    eid = req.get("execution_id")
    if not isinstance(eid, str) or not eid or len(eid) > 128 or "." in eid or "*" in eid or ">" in eid \
            or any(c.isspace() for c in eid):
        raise Refused("bad_request", f"execution_id must be an execution's id, got {_show(eid)}")
    names = req.get("names")
    if not isinstance(names, list) or not names or len(names) > MAX_NAMES:
        raise Refused("bad_request", f"names must be a list of 1 to {MAX_NAMES} credential names")
    try:
        clean = tuple(dict.fromkeys(name_of(n, "each name") for n in names))
    except Invalid as exc:
        raise Refused("bad_request", str(exc)) from None
    command = req.get("command")
    seq = command.get("seq") if isinstance(command, Mapping) else None
    where = command.get("subject") if isinstance(command, Mapping) else None
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1 or not isinstance(where, str) or not where:
        raise Refused("bad_request", "command must be {seq, subject}: the stream sequence and the subject of the "
                                     f"command the worker holds in {COMMANDS}")
    return Resolve(pool, eid, clean, seq, where)


def authorize(ask: Resolve, stored_subject: str | None, command: Any) -> list[str]:
    """The stored names ``ask`` may have, given the message at ``ask.seq`` of ``NOETL_COMMANDS``
    (``stored_subject`` None: there is none) and its ``command`` (its keychain expanded, D23).
    :class:`Refused` otherwise."""
    held = f"command {ask.seq} of {COMMANDS}"
    if stored_subject is None:
        raise Refused("no_command", f"{held} does not exist: no worker holds it (never sent, acknowledged, or "
                                    "purged with its finished execution)")
    if stored_subject != ask.subject:
        raise Refused("no_command", f"{held} is stored under {stored_subject}, not {ask.subject}")
    parts = command_parts(stored_subject)
    if parts is None:
        raise Refused("no_command", f"{held} ({stored_subject}) is not a command of one execution")
    pool, eid, _ = parts
    if pool != ask.pool:
        raise Refused("wrong_pool", f"{held} is for the worker pool {pool!r}; worker-{ask.pool} may not resolve "
                                    "its credentials")
    if eid != ask.execution_id or not isinstance(command, Mapping) or command.get("execution_id") != eid \
            or command.get("pool") != pool:
        raise Refused("wrong_execution", f"{held} is not a command of execution {ask.execution_id}")
    declared = {stored_name(d) for d in declarations_of(command.get("keychain")) if d["kind"] == "credential"}
    undeclared = [n for n in ask.names if n not in declared]
    if undeclared:
        raise Refused("undeclared", f"credential(s) {', '.join(map(repr, undeclared))} are not declared by the "
                                    f"keychain of execution {eid} (kind credential; declared: "
                                    f"{', '.join(map(repr, sorted(declared))) or 'none'})")
    return list(ask.names)


def check_running(ask: Resolve, status: str | None) -> None:
    """:class:`Refused` (``finished``) when the event log says the execution ended. An execution not
    recorded yet (its command exists: admission admitted it) is running."""
    if status in FINAL:
        raise Refused("finished", f"execution {ask.execution_id} has finished ({status}): its credentials are "
                                  "no longer resolved")


def use_refusal(command: Any, allowed: Mapping[str, tuple[list[str], list[dict[str, str]]]],
                standing: Mapping[str, Any]) -> Refused | None:
    """D24: a credential is used only by the playbooks of users who hold one of its roles now, or whom
    it names (``allowed``: stored name -> (roles, users)): whoever started the execution, whoever wrote
    its playbook and whoever wrote each playbook above it (:func:`command_users`), each still active, a
    role counting within the roles their request carried. ``standing``: the sessions service's word on
    each of them, by user id. An execution that no user started (a stack without users: ``noetl run``)
    has nobody to check. :class:`Refused` (``not_allowed``) naming the credential, who may use it and
    who may not; None when every one passes."""
    users = command_users(command)
    if not users or users[0][1] is None:
        return None  # an execution no user started; one that names its starter in any other way is checked
    for name, (roles, named) in allowed.items():
        ids = {u["user_id"] for u in named}
        whom = " or ".join([f"users with the role {' or '.join(roles)}"] * bool(roles)
                           + [f"the users {', '.join(u['username'] for u in named)}"] * bool(named))
        need = (f"credential {name!r} may be used only by playbooks started and written by {whom} (its "
                f"{' and '.join(['roles'] * bool(roles) + ['users'] * bool(named))}, D24: an admin sets them)")
        for did, who in users:
            uid = who.get("user_id") if isinstance(who, dict) else None
            if not isinstance(uid, str):
                return Refused("not_allowed", f"{need}; this execution was {did} by no user known" + (
                    " (a catalog version registered before authors were recorded: register it again)"
                    if did == "written" else ""))
            why = user_refusal(did, who, standing.get(uid), roles, named=uid in ids)
            if why:
                return Refused("not_allowed", f"{need}; this execution was {why}")
    return None


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


__all__ = ["NAME", "KIND", "KEY_ENV", "OLD_KEY_ENV", "KEY_FILE", "Invalid", "name_of", "put_fields", "decode_key",
           "new_key_text", "encrypt", "decrypt", "Refused", "Resolve", "parse_resolve", "authorize",
           "check_running", "roles_of", "users_of", "grant_of", "use_refusal", "DEFAULT_ROLES"]
