"""Access control, pure: roles and permissions, token formats and hashing, password hashing, session
expiry arithmetic, the lockout policy, principals, audit records and input rules. No I/O (argon2 is CPU
and memory only); the sessions service (services/sessions/) is the shell around it, docs/security.md
the operator's view.

Roles and permissions: :data:`MATRIX` maps each role to its named permissions and :func:`allowed`
answers for a set of roles; a route or request declares one permission. Unknown roles grant nothing;
an unknown permission name is a programming error and raises.

Tokens: a bearer token is ``noetl_s_`` (a login session) or ``noetl_t_`` (an API token) followed by 43
characters of URL-safe base64 (256 random bits). Nothing keeps the token itself: its id is
:func:`token_id`, a one-way derivation (SHA-256 with a domain label, 128 bits as hex) that names its KV
key. Reading the store shows ids, and an id grants nothing: only the token derives to it. No pepper and
no slow hash: the tokens are random, so a slow hash would only cost every request time.
"""
from __future__ import annotations

import hashlib
import ipaddress
import math
import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Iterable

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError

# ------------------------------------------------------------------------------ roles and permissions
ROLES = ("admin", "developer", "operator", "viewer")
DEFAULT_ROLE = "viewer"

PERMISSIONS: dict[str, str] = {
    "catalog.read": "read playbooks in the catalog",
    "catalog.write": "register playbooks: new paths, and new versions of the paths one owns",
    "catalog.any": "register new versions of any catalog path, whoever owns it",
    "execution.read": "read executions: status, events, lists",
    "execution.start": "start executions",
    "execution.cancel.own": "cancel executions the caller started",
    "execution.cancel.any": "cancel any execution",
    "credential.list": "list credentials: names, kinds, descriptions (never their data)",
    "credential.write": "add, replace and delete credentials",
    "credential.read_data": "read a credential's secret data",
    "user.admin": "add users, list them, disable and enable them, set their roles and passwords",
    "token.own": "create, list and revoke one's own API tokens",
    "token.any": "list and revoke anyone's API tokens",
    "session.own": "list and revoke one's own sessions",
    "session.any": "list and revoke anyone's sessions",
    "audit.read": "read the audit log",
}

_READ = frozenset({"catalog.read", "execution.read", "token.own", "session.own"})
MATRIX: dict[str, frozenset[str]] = {
    "viewer": _READ,
    "developer": _READ | {"catalog.write", "execution.start", "execution.cancel.own", "credential.list"},
    "operator": _READ | {"execution.cancel.own", "execution.cancel.any", "credential.list"},
    "admin": frozenset(PERMISSIONS),
}


def allowed(roles: Iterable[str] | None, permission: str) -> bool:
    """Whether any of ``roles`` grants ``permission``."""
    if permission not in PERMISSIONS:
        raise ValueError(f"unknown permission {permission!r}; known: {', '.join(PERMISSIONS)}")
    if not isinstance(roles, (list, tuple, set, frozenset)):
        return False
    return any(permission in MATRIX.get(role, ()) for role in roles if isinstance(role, str))


def permissions(roles: Iterable[str]) -> list[str]:
    """Every permission the roles grant, in the order of :data:`PERMISSIONS`."""
    return [p for p in PERMISSIONS if allowed(list(roles), p)]


# ------------------------------------------------------------------------------------------- tokens
SESSION_PREFIX, API_PREFIX = "noetl_s_", "noetl_t_"
TOKEN_KINDS = {SESSION_PREFIX: "session", API_PREFIX: "token"}
_TOKEN = re.compile(r"^noetl_[st]_[A-Za-z0-9_-]{43}\Z")
ID = re.compile(r"^[0-9a-f]{32}\Z")  # user, session and token ids


def new_token(kind: str) -> str:
    """A new bearer token: ``kind`` is ``session`` or ``token``."""
    prefix = SESSION_PREFIX if kind == "session" else API_PREFIX if kind == "token" else None
    if prefix is None:
        raise ValueError(f"unknown token kind {kind!r}")
    return prefix + secrets.token_urlsafe(32)


def token_kind(token: Any) -> str | None:
    """``session`` or ``token`` for a well-formed bearer token, else None (never raises)."""
    if not isinstance(token, str) or not _TOKEN.match(token):
        return None
    return TOKEN_KINDS[token[:8]]


# The ids of a live session or API token: the sessions service takes a principal naming one as who
# asks (checking that it is live), so they are never written where others read (events, views).
PROOF_KEYS = ("session_id", "token_id")


def shown(principal: Any) -> Any:
    """A principal as events and views may carry it: without the ids of its session or token."""
    return {k: v for k, v in principal.items() if k not in PROOF_KEYS} if isinstance(principal, dict) else principal


def token_id(token: str) -> str:
    """The id (and KV key part) of a bearer token: one-way, so the store never holds what grants access."""
    return hashlib.sha256(b"noetl.token-id\x00" + token.encode()).hexdigest()[:32]


def new_id() -> str:
    return secrets.token_hex(16)


# ---------------------------------------------------------------------------------------- passwords
MIN_PASSWORD_CHARS = 8
# argon2id with OWASP's recommended minimum (t=2, m=19 MiB, p=1: one thread per hash, ~45 ms of CPU),
# not RFC 9106's 64 MiB / 4 lanes profile (six times the CPU, four threads): on a small host that profile
# made every validation wait while logins hashed (bench/bench_auth.py). The parameters travel inside each
# hash, so changing them later only rehashes at the next login.
HASHER = PasswordHasher(time_cost=2, memory_cost=19 * 1024, parallelism=1)
_dummy_hash: str | None = None


def password_problem(password: Any, max_bytes: int) -> str | None:
    """Why ``password`` is not acceptable as a new password, or None."""
    if not isinstance(password, str):
        return "the password must be a string"
    if len(password) < MIN_PASSWORD_CHARS:
        return f"the password must have at least {MIN_PASSWORD_CHARS} characters"
    if len(password.encode()) > max_bytes:
        return f"the password is longer than {max_bytes} bytes (max_password_bytes)"
    return None


def hash_password(password: str, hasher: PasswordHasher = HASHER) -> str:
    return hasher.hash(password)


def verify_password(stored: str | None, password: str, hasher: PasswordHasher = HASHER) -> bool:
    """Check ``password`` against an argon2 hash; with no hash (unknown user, or a user without a
    password) a dummy hash is checked anyway, so the answer takes as long either way."""
    global _dummy_hash
    if not stored:
        if _dummy_hash is None:
            _dummy_hash = hasher.hash(secrets.token_urlsafe(16))
        stored = _dummy_hash  # made from a random secret: never matches
    try:
        return hasher.verify(stored, password)
    except (VerifyMismatchError, VerificationError, InvalidHashError):
        return False


def needs_rehash(stored: str, hasher: PasswordHasher = HASHER) -> bool:
    try:
        return hasher.check_needs_rehash(stored)
    except (InvalidHashError, ValueError):
        return True


# ---------------------------------------------------------------------------------------- time
def iso(t: float) -> str:
    """A UTC instant as ISO 8601 with milliseconds (readable in ``nats kv get``)."""
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def epoch(value: str | None) -> float | None:
    if not value:
        return None
    return datetime.fromisoformat(value).timestamp()


# ---------------------------------------------------------------------------------------- sessions
@dataclass(frozen=True)
class SessionPolicy:
    lifetime: float  # absolute: from login
    idle: float  # without activity
    refresh_interval: float  # at most one activity write per this

    def ends_at(self, rec: dict[str, Any]) -> float:
        """When the session ends unless it is refreshed first: idle or absolute, whichever is first."""
        return min(epoch(rec["last_activity_at"]) + self.idle, epoch(rec["expires_at"]))

    def live(self, rec: dict[str, Any], now: float) -> bool:
        """Whether the session still grants access (a malformed record does not)."""
        try:
            return now < self.ends_at(rec) and ID.match(rec["session_id"]) is not None
        except (KeyError, TypeError, ValueError):
            return False

    def ttl(self, rec: dict[str, Any], now: float) -> int:
        """The key's TTL in whole seconds (NATS counts seconds), at least 1: ``live`` is checked on
        every read, so the key outliving the session by under a second grants nothing."""
        return max(1, math.ceil(self.ends_at(rec) - now))

    def refresh_due(self, rec: dict[str, Any], now: float) -> bool:
        return now - epoch(rec["last_activity_at"]) >= self.refresh_interval


def session_record(session_id: str, user: dict[str, Any], now: float, lifetime: float, client_ip: str | None,
                   idp_subject: str | None = None) -> dict[str, Any]:
    """The KV value of a new session (never the token)."""
    return {
        "session_id": session_id,
        "user_id": user["user_id"],
        "username": user["username"],
        "email": user.get("email"),
        "display_name": user.get("display_name"),
        "roles": list(user["roles"]),
        "created_at": iso(now),
        "expires_at": iso(now + lifetime),
        "last_activity_at": iso(now),
        "client_ip": client_ip,
        "idp_subject": idp_subject,
    }


def with_user(rec: dict[str, Any], user: dict[str, Any], roles: list[str] | None = None) -> dict[str, Any]:
    """A session or token record after its user changed (roles, names)."""
    return {**rec, "username": user["username"], "email": user.get("email"),
            "display_name": user.get("display_name"), "roles": list(user["roles"] if roles is None else roles)}


def principal(rec: dict[str, Any], kind: str, policy: SessionPolicy | None = None) -> dict[str, Any]:
    """What a validated token stands for: the gateway's caller."""
    out = {"user_id": rec["user_id"], "username": rec.get("username"), "email": rec.get("email"),
           "display_name": rec.get("display_name"), "roles": list(rec.get("roles") or ()), "kind": kind,
           "expires_at": rec.get("expires_at")}
    if kind == "session":
        out["session_id"] = rec["session_id"]
        if policy is not None:
            out["idle_expires_at"] = iso(epoch(rec["last_activity_at"]) + policy.idle)
    else:
        out["token_id"], out["token_name"] = rec["token_id"], rec.get("name")
    return out


def token_record(tid: str, name: str, user: dict[str, Any], roles: list[str], now: float,
                 expires_at: float | None, minted_by: dict[str, Any] | None = None) -> dict[str, Any]:
    """The KV value of a new API token (never the token). ``minted_by``: the session or token that
    made it (:func:`minter`; None for the bootstrap's)."""
    return {"token_id": tid, "name": name, "user_id": user["user_id"], "username": user["username"],
            "email": user.get("email"), "display_name": user.get("display_name"), "roles": list(roles),
            "created_at": iso(now), "expires_at": iso(expires_at) if expires_at else None, "minted_by": minted_by}


def minter(caller: dict[str, Any]) -> dict[str, Any]:
    """What a token record keeps of the principal that made it: its kind and id (never a secret)."""
    key = "session_id" if caller.get("kind") == "session" else "token_id"
    return {"kind": caller.get("kind"), key: caller.get(key)}


def minted_by(rec: dict[str, Any], ended: dict[str, Any]) -> bool:
    """Whether the token record ``rec`` was made by the session or token ``ended`` (``{session_id}`` or
    ``{token_id}``)."""
    made = rec.get("minted_by")
    if not isinstance(made, dict):
        return False
    return any(isinstance(ended.get(k), str) and made.get(k) == ended[k] for k in ("session_id", "token_id"))


def token_expiry(expires_in: Any, caller: dict[str, Any], now: float, max_seconds: int) -> float | None:
    """When a new API token ends (epoch seconds; None: never), for a caller (a principal read from the
    store). A token never outlives what makes it: a session's absolute end (``expires_at``: its idle
    expiry is not counted, a refresh moves it), a token's own expiry. Without ``expires_in`` the new
    token ends when its maker does; asking for longer is ``forbidden``, naming the longest allowed.
    Only a token without expiry makes tokens without expiry (docs/security.md §2)."""
    if expires_in is not None and (not isinstance(expires_in, int) or isinstance(expires_in, bool)
                                   or not 1 <= expires_in <= max_seconds):
        raise AccessError("bad_request", f"expires_in: whole seconds, 1 to {max_seconds}")
    ends = epoch(caller.get("expires_at"))
    if expires_in is None:
        return ends
    wanted = now + expires_in
    if ends is not None and wanted > ends:
        maker = "session" if caller.get("kind") == "session" else "API token"
        raise AccessError("forbidden", f"expires_in: a token cannot outlive the {maker} that makes it: at most "
                                       f"{max(0, math.floor(ends - now))} s (the {maker} ends at {iso(ends)})")
    return wanted


def token_live(rec: dict[str, Any], now: float) -> bool:
    """Whether the API token still grants access (a malformed record does not)."""
    try:
        ends = epoch(rec.get("expires_at"))
        return ID.match(rec["token_id"]) is not None and (ends is None or now < ends)
    except (KeyError, TypeError, ValueError):
        return False


def within(roles: Iterable[str], holder_roles: Iterable[str]) -> list[str]:
    """The ``roles`` whose permissions ``holder_roles`` all have (a developer holds viewer's)."""
    held = frozenset().union(*(MATRIX.get(r, frozenset()) for r in holder_roles))
    return [r for r in roles if MATRIX.get(r, frozenset()) <= held]


def token_roles(requested: Any, caller_roles: list[str]) -> list[str]:
    """An API token's roles: none granting more than the caller has (the caller's when none are asked for)."""
    if requested is None:
        return list(caller_roles)
    roles = role_list(requested)
    extra = [r for r in roles if r not in within(roles, caller_roles)]
    if extra:
        raise AccessError("forbidden", f"a token cannot have roles granting more than its creator has: {', '.join(extra)}")
    return roles


def token_ttl(rec: dict[str, Any], now: float) -> float | None:
    """Seconds an API token's key has left (None: no expiry)."""
    ends = epoch(rec.get("expires_at"))
    return None if ends is None else ends - now


def stale(rec: dict[str, Any], user: dict[str, Any], roles: list[str] | None = None) -> bool:
    """Whether a session or token record no longer shows its user (names, or ``roles``: the user's)."""
    return any(rec.get(k) != user.get(k) for k in ("username", "email", "display_name")) or \
        rec.get("roles") != (roles if roles is not None else user["roles"])


def scope(caller: dict[str, Any], owner: str, area: str) -> str:
    """The permission to act on ``area`` (session, token) of ``owner``: ``<area>.own`` for one's own."""
    return f"{area}.own" if owner == caller["user_id"] else f"{area}.any"


def public_user(user: dict[str, Any]) -> dict[str, Any]:
    """A user as replies show it: never the password hash."""
    out = {k: v for k, v in user.items() if k != "password_hash"}
    out["has_password"] = bool(user.get("password_hash"))
    return out


def public_session(rec: dict[str, Any], policy: SessionPolicy, caller: dict[str, Any]) -> dict[str, Any]:
    """A session as a list shows it: with its idle expiry, and whether it is the caller's."""
    return {**rec, "idle_expires_at": iso(epoch(rec["last_activity_at"]) + policy.idle),
            "current": rec["session_id"] == caller.get("session_id")}


# ---------------------------------------------------------------------------------------- lockout
@dataclass(frozen=True)
class LockoutPolicy:
    """Failed logins of one user (or one address): the first ``slow_after`` are free, each later one
    makes the next attempt wait twice as long (1 s, 2 s, 4 s, ...), and ``lock_after`` lock it for
    ``lock_seconds``. Failures are forgotten ``lock_seconds`` after the last one."""

    slow_after: int
    lock_after: int
    lock_seconds: float

    def delay(self, failures: int) -> float:
        if failures >= self.lock_after:
            return self.lock_seconds
        if failures >= self.slow_after:
            return min(2.0 ** (failures - self.slow_after), self.lock_seconds)
        return 0.0

    def retry_after(self, rec: dict[str, Any] | None, now: float) -> float:
        """Seconds to wait before the next attempt (0: go ahead)."""
        if not rec:
            return 0.0
        return max(0.0, epoch(rec["last_failure_at"]) + self.delay(int(rec["failures"])) - now)

    def failed(self, rec: dict[str, Any] | None, now: float) -> dict[str, Any]:
        return {"failures": (int(rec["failures"]) if rec else 0) + 1, "last_failure_at": iso(now)}

    def locked(self, rec: dict[str, Any] | None) -> bool:
        return bool(rec) and int(rec["failures"]) >= self.lock_after


# ---------------------------------------------------------------------------------------- OIDC
def oidc_identity(claims: dict[str, Any], roles_claim: str | None) -> dict[str, Any]:
    """A verified ID token's claims as an identity: subject, email (when verified), display name, and
    the roles named by ``roles_claim`` (a dotted path; a list or a space-separated string; unknown
    names dropped), None when the claim is not configured or absent."""
    email = claims.get("email") if isinstance(claims.get("email"), str) else None
    verified = claims.get("email_verified") in (True, "true")
    name = claims.get("name") if isinstance(claims.get("name"), str) else None
    roles = None
    if roles_claim:
        value: Any = claims
        for part in roles_claim.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if isinstance(value, str):
            value = value.split()
        if isinstance(value, list):
            roles = [r for r in ROLES if r in value]
    return {"subject": str(claims["sub"]), "issuer": str(claims["iss"]), "email": email,
            "email_verified": verified and email is not None, "display_name": name, "roles": roles}


# ---------------------------------------------------------------------------------------- audit
ACTION = re.compile(r"^[a-z][a-z_]{0,31}\.[a-z][a-z_]{0,31}\Z")  # area.verb: one subject token each
AUDIT_ACTIONS = (
    "session.login", "session.login_failed", "session.logout", "session.revoked",
    "user.bootstrapped", "user.added", "user.disabled", "user.enabled", "user.roles_changed",
    "user.password_changed", "token.created", "token.revoked", "access.denied",
)


def audit_subject(action: str, user_id: str | None) -> str:
    """``noetl.audit.<area>.<verb>.<user id or ->``: filters by action, by user or both are subject filters."""
    from ..contracts.subjects import audit_subject as subject

    return subject(action, user_id if user_id and ID.match(user_id) else "-")


def audit_record(action: str, *, actor: dict[str, Any] | None, now: float, client_ip: str | None = None,
                 target: dict[str, Any] | None = None, outcome: str = "ok",
                 details: dict[str, Any] | None = None) -> dict[str, Any]:
    """One audit record: who (``actor``: a principal, or what is known of a failed caller), did what
    (``action``, ``target``), when, from where, and with which ``outcome`` (ok, failed, denied)."""
    if not ACTION.match(action or ""):
        raise ValueError(f"audit action {action!r} must be <area>.<verb> in lower case")
    if outcome not in ("ok", "failed", "denied"):
        raise ValueError(f"audit outcome {outcome!r} must be ok, failed or denied")
    who = None
    if actor:
        who = {k: actor.get(k) for k in ("user_id", "username", "kind", "session_id", "token_id") if actor.get(k)}
    return {"audit_id": new_id(), "at": iso(now), "action": action, "outcome": outcome, "actor": who,
            "client_ip": client_ip, "target": target or None, "details": details or None}


# ---------------------------------------------------------------------------------------- input rules
USERNAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@+-]{0,127}\Z")
EMAIL = re.compile(r"^[^@\s]{1,64}@[^@\s]{1,189}\Z")
TOKEN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 ._-]{0,63}\Z")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class AccessError(Exception):
    """A refusal with a kind of the sessions API (unauthenticated, forbidden, bad_request, ...)."""

    def __init__(self, kind: str, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.kind, self.message, self.retry_after = kind, message, retry_after


def username(value: Any) -> str:
    """A username as stored (lower case), or AccessError."""
    if not isinstance(value, str) or not USERNAME.match(value):
        raise AccessError("bad_request", "username: 1-128 characters of letters, digits and . _ @ + -, "
                                         "starting with a letter or digit")
    return value.lower()


def new_username(value: Any) -> str:
    """A new user's username (:func:`username`), which must not read as a user id (32 hex characters):
    wherever a user is named by username or id, it would be taken for the id of another user."""
    name = username(value)
    if ID.match(name):
        raise AccessError("bad_request", "username: 32 hex characters read as a user id; choose another name")
    return name


def email(value: Any) -> str | None:
    if value in (None, ""):
        return None
    if not isinstance(value, str) or not EMAIL.match(value):
        raise AccessError("bad_request", "email: not an email address")
    return value


def display_name(value: Any) -> str | None:
    if value in (None, ""):
        return None
    if not isinstance(value, str) or len(value) > 200 or _CONTROL.search(value):
        raise AccessError("bad_request", "display_name: at most 200 characters, no control characters")
    return value


def role_list(value: Any) -> list[str]:
    """Known role names, in the order of :data:`ROLES`, at least one."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(r, str) for r in value):
        raise AccessError("bad_request", f"roles: a non-empty list of {', '.join(ROLES)}")
    unknown = [r for r in value if r not in ROLES]
    if unknown:
        raise AccessError("bad_request", f"roles: unknown {', '.join(map(repr, unknown[:5]))}; known: {', '.join(ROLES)}")
    return [r for r in ROLES if r in value]


def token_name(value: Any) -> str:
    if not isinstance(value, str) or not TOKEN_NAME.match(value):
        raise AccessError("bad_request", "name: 1-64 characters of letters, digits, spaces and . _ -")
    return value


def an_id(value: Any, what: str) -> str:
    if not isinstance(value, str) or not ID.match(value):
        raise AccessError("bad_request", f"{what}: expected 32 lower-case hex characters")
    return value


def client_ip(value: Any) -> str | None:
    """The caller's address as the gateway saw it; anything that is not an IP address is dropped."""
    if not isinstance(value, str) or len(value) > 64:
        return None
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        return None


def key_part(value: str) -> str:
    """A KV key token for an arbitrary string (usernames, addresses): hex of its hash."""
    return hashlib.sha256(value.encode()).hexdigest()[:32]
