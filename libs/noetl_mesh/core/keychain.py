"""Keychain resolution and secret masking (D24), pure apart from the clock and the environment.

A playbook's root ``keychain`` lists *declarations* ``{name, kind, ...}``; commands carry them as they
are, never the secrets. The worker resolves them when a command starts into a :class:`Keychain`
``{name: entry}`` (what ``{{ keychain.<name>.<field> }}`` and a tool's ``auth: <name>`` read):

- ``static``: the declaration's own fields (``name`` and ``kind`` removed);
- ``env``: ``{value: <the worker's environment variable var>}``, only for a variable the worker pool
  exposes to playbooks: ``NOETL_KEYCHAIN_ENV`` on the worker, a comma-separated list of names and
  ``*`` patterns (``API_TOKEN,PARTNER_*``), empty by default; a ``NOETL_*`` variable (the engine's own
  settings) never. Any other variable, or one that is not set, is a *denied* entry: a task that reads it
  fails with an error naming the variable and the setting (:class:`Keychain`);
- ``credential``: the stored credential's data (``credential: <stored name>``, default the entry's
  name), fetched over request/reply from the credentials service for the command the worker holds
  (``noetl.q.credential.resolve.<pool>``, with the command's place in ``NOETL_COMMANDS``: :meth:`KeychainCache.bound`)
  and cached per execution for ``ttl`` seconds (:class:`KeychainCache`). A credential that is not
  stored: no entry; one the service refuses: a denied entry.

Everything the worker publishes goes through :func:`mask`: the *secret* values of resolved entries
(:func:`secrets_of`: every field but a few that name where and who — user, host, port, database... —
and of a connection string its password) are replaced by ``***`` wherever they occur, as they are or
encoded (URL-encoded, JSON-escaped, base64, HTTP basic auth: :class:`Masker`). While a command runs,
its secrets are also masked in every log record of the worker process (:class:`LogMasking`,
:func:`install_log_masking`).

The ``secrets`` tool fetches a stored credential the keychain declares (:meth:`KeychainCache.credential`
through the same bound resolution); its values are remembered per execution
(:meth:`KeychainCache.known_secrets`) and masked in every event the worker publishes after the fetch,
for that command and the later commands of the execution that this worker runs. A different worker
only masks the values it has itself fetched or resolved.
"""
from __future__ import annotations

import base64
import fnmatch
import json
import logging
import os
import re
import threading
import time
from typing import Any, Awaitable, Callable, Iterable, Mapping
from urllib.parse import parse_qsl, unquote, urlsplit

import orjson

from .standing import STANDING_TTL


MASK = "***"
MIN_SECRET = 4
DEFAULT_TTL = STANDING_TTL  # a credential kept per execution: its roles, or its users', changed count within it (D24)
ENV_SETTING = "NOETL_KEYCHAIN_ENV"  # the worker's environment variables playbooks may read (D24)
ENGINE_ENV = "NOETL_"  # the engine's own settings: never exposed to playbooks

# (execution_id, declarations) -> {entry name: resolved entry}
Resolver = Callable[[str, list], Awaitable[Mapping[str, Any]]]
# (execution_id, stored credential names, grant) -> {stored name: data}; the grant names the command
# the worker holds ({seq, subject} in NOETL_COMMANDS), None for a resolver that needs none
Fetch = Callable[[str, list, Any], Awaitable[Mapping[str, Any]]]


class KeychainDenied(Exception):
    """A keychain entry a task may not read (a variable the pool does not expose, a credential the
    store refused): its message says which and why. Not a LookupError, so that a template reading the
    entry fails with it rather than with "undefined"."""


class KeychainRefused(Exception):
    """The credential store refused a resolution (not granted: undeclared, finished, ...)."""


class Keychain(dict):
    """A resolved keychain: ``{name: entry}``, plus the *denied* entries (``denied``: name -> why),
    which are not in it; reading one (``keychain[name]``, ``.get(name)``, a template's
    ``keychain.<name>``) raises :class:`KeychainDenied` with that reason."""

    def __init__(self, entries: Mapping[str, Any] = (), denied: Mapping[str, str] | None = None):
        super().__init__(entries)
        self.denied: dict[str, str] = dict(denied or {})

    def __missing__(self, key: Any) -> Any:
        if key in self.denied:
            raise KeychainDenied(self.denied[key])
        raise KeyError(key)

    def get(self, key: Any, default: Any = None) -> Any:
        if key not in self and key in self.denied:
            raise KeychainDenied(self.denied[key])
        return super().get(key, default)

    def __bool__(self) -> bool:
        return bool(len(self) or self.denied)


def env_allowed(var: str, setting: str | None) -> bool:
    """Whether ``var`` is one of the worker's variables the pool exposes (``NOETL_KEYCHAIN_ENV``)."""
    if var.startswith(ENGINE_ENV):
        return False
    patterns = [p.strip() for p in (setting or "").split(",") if p.strip()]
    return any(fnmatch.fnmatchcase(var, p) for p in patterns)


def declarations_of(keychain: Any) -> list[dict[str, Any]]:
    """The well-formed declarations of a command's ``keychain`` (a list of ``{name, kind, ...}``)."""
    if not isinstance(keychain, list):
        return []
    return [dict(d) for d in keychain
            if isinstance(d, Mapping) and isinstance(d.get("name"), str) and d.get("kind") in ("static", "env", "credential")]


def stored_name(declaration: Mapping[str, Any]) -> str:
    stored = declaration.get("credential")
    return stored if isinstance(stored, str) and stored else declaration["name"]


def declared_credential(keychain: Any, name: str) -> str | None:
    """The stored credential that ``name`` stands for in a keychain's ``credential`` declarations (an
    entry's name, or a stored name one of them gives), None when none declares it."""
    decls = [d for d in declarations_of(keychain) if d["kind"] == "credential"]
    for d in decls:
        if d["name"] == name:
            return stored_name(d)
    return name if any(stored_name(d) == name for d in decls) else None


async def resolve(keychain: Any, execution_id: str, resolver: Resolver | None = None, *,
                  environ: Mapping[str, str] | None = None) -> Keychain:
    """The :class:`Keychain` of a command's declarations. ``resolver`` resolves the ``credential``
    entries (none without it). A ``keychain`` that is already a mapping is taken as resolved."""
    if isinstance(keychain, Mapping):
        return keychain if isinstance(keychain, Keychain) else Keychain(keychain)
    env = os.environ if environ is None else environ
    out = Keychain()
    credentials: list[dict[str, Any]] = []
    for d in declarations_of(keychain):
        kind, name = d["kind"], d["name"]
        if kind == "static":
            out[name] = {k: v for k, v in d.items() if k not in ("name", "kind")}
        elif kind == "env":
            var = d.get("var") or name
            if not isinstance(var, str):
                out.denied[name] = f"keychain entry {name!r}: var must be the name of an environment variable"
            elif not env_allowed(var, env.get(ENV_SETTING)):
                out.denied[name] = (f"keychain entry {name!r} reads the environment variable {var}, which this worker "
                                    f"pool does not expose to playbooks: add it to {ENV_SETTING} on the worker "
                                    f"(now {env.get(ENV_SETTING) or 'empty'!r})" if not var.startswith(ENGINE_ENV) else
                                    f"keychain entry {name!r} reads the environment variable {var}: the engine's "
                                    f"own settings ({ENGINE_ENV}*) are never exposed to playbooks")
            elif var not in env:
                out.denied[name] = f"keychain entry {name!r}: the environment variable {var} is not set on this worker"
            else:
                out[name] = {"value": env[var]}
        else:
            credentials.append(d)
    if credentials and resolver is not None:
        try:
            resolved = await resolver(execution_id, credentials)
        except KeychainRefused as refused:
            for d in credentials:
                out.denied[d["name"]] = f"keychain entry {d['name']!r} (credential {stored_name(d)!r}): {refused}"
            return out
        for d in credentials:
            if d["name"] in (resolved or {}):
                out[d["name"]] = resolved[d["name"]]
    return out


class KeychainCache:
    """Stored credentials by execution, each kept ``ttl`` seconds; ``fetch`` asks for the missing ones.
    The worker binds it to each command it runs (:meth:`bound`: the grant the credential store checks);
    unbound, it asks without a grant (the local engine, tests)."""

    def __init__(self, fetch: Fetch, ttl: float = DEFAULT_TTL, clock: Callable[[], float] = time.monotonic):
        self.fetch, self.ttl, self.clock = fetch, ttl, clock
        self._entries: dict[tuple[str, str], tuple[float, Any]] = {}  # (execution, stored name) -> (expiry, data)
        self._secrets: dict[str, tuple[float, set[str]]] = {}  # execution -> (expiry, values to mask)
        self.fetches = 0

    def bound(self, grant: Any) -> "BoundResolver":
        """This cache, asking with ``grant`` (the command the worker holds: ``{seq, subject}``)."""
        return BoundResolver(self, grant)

    async def get(self, execution_id: str, names: Iterable[str], grant: Any = None) -> dict[str, Any]:
        """``{stored name: data}`` for the names that are stored."""
        now = self.clock()
        self._expire(now)
        wanted = list(dict.fromkeys(names))
        # a snapshot before awaiting: a concurrent command may expire entries meanwhile
        have = {n: self._entries[(execution_id, n)][1] for n in wanted if (execution_id, n) in self._entries}
        missing = [n for n in wanted if n not in have]
        if missing:
            self.fetches += 1
            got = await self.fetch(execution_id, missing, grant) or {}
            for n in missing:
                have[n] = got.get(n)
                self._entries[(execution_id, n)] = (now + self.ttl, have[n])
        return {n: have[n] for n in wanted if have.get(n) is not None}

    async def __call__(self, execution_id: str, declarations: list, grant: Any = None) -> dict[str, Any]:
        decls = declarations_of(list(declarations))
        stored = await self.get(execution_id, [stored_name(d) for d in decls], grant)
        return {d["name"]: stored[stored_name(d)] for d in decls if stored_name(d) in stored}

    async def credential(self, execution_id: str, name: str, grant: Any = None) -> Any:
        """The data of the stored credential ``name`` (None when not stored), through the cache; its
        values are remembered as secrets of the execution (:meth:`known_secrets`). Fetch failures
        propagate."""
        data = (await self.get(execution_id, [name], grant)).get(name)
        if data is not None:
            self.remember(execution_id, secrets_of(data))
        return data

    def remember(self, execution_id: str, values: Iterable[str]) -> None:
        """Add ``values`` to the execution's secrets (kept ``ttl`` seconds after their last use)."""
        values = {v for v in values if isinstance(v, str) and len(v) >= MIN_SECRET}
        if not values:
            return
        now = self.clock()
        _, known = self._secrets.get(execution_id, (0.0, set()))
        self._secrets[execution_id] = (now + self.ttl, known | values)

    def known_secrets(self, execution_id: str) -> list[str]:
        """The values fetched by name for the execution on this worker (each read extends their life)."""
        now = self.clock()
        entry = self._secrets.get(execution_id)
        if entry is None:
            return []
        if entry[0] <= now:
            del self._secrets[execution_id]
            return []
        self._secrets[execution_id] = (now + self.ttl, entry[1])
        return list(entry[1])

    def _expire(self, now: float) -> None:
        for key in [k for k, (expiry, _) in self._entries.items() if expiry <= now]:
            del self._entries[key]
        for eid in [e for e, (expiry, _) in self._secrets.items() if expiry <= now]:
            del self._secrets[eid]


class BoundResolver:
    """A :class:`KeychainCache` for one command: every fetch carries the command's ``grant``."""

    def __init__(self, cache: KeychainCache, grant: Any):
        self.cache, self.grant = cache, grant

    async def __call__(self, execution_id: str, declarations: list) -> dict[str, Any]:
        return await self.cache(execution_id, declarations, self.grant)

    async def credential(self, execution_id: str, name: str) -> Any:
        return await self.cache.credential(execution_id, name, self.grant)

    def remember(self, execution_id: str, values: Iterable[str]) -> None:
        self.cache.remember(execution_id, values)

    def known_secrets(self, execution_id: str) -> list[str]:
        return self.cache.known_secrets(execution_id)


def bus_resolver(request: Callable[..., Awaitable[Any]], pool: str, ttl: float = DEFAULT_TTL,
                 timeout: float = 10.0) -> KeychainCache:
    """The worker's resolver over request/reply (``bus_resolver(bus.request, pool)``), to be bound to
    each command (:meth:`KeychainCache.bound`): it asks the credentials service on
    ``noetl.q.credential.resolve.<pool>``; a refusal (``forbidden``) is :class:`KeychainRefused`."""
    from ..contracts.subjects import credential_resolve_subject

    subject = credential_resolve_subject(pool)

    async def fetch(execution_id: str, names: list, grant: Any) -> Mapping[str, Any]:
        try:
            return await request(subject, {"names": list(names), "execution_id": execution_id, "command": grant},
                                 timeout=timeout)
        except Exception as exc:
            if getattr(exc, "kind", None) in ("forbidden", "bad_request"):  # infra BusError: the store refused
                raise KeychainRefused(getattr(exc, "message", str(exc))) from None
            raise

    return KeychainCache(fetch, ttl=ttl)


def dict_resolver(store: Mapping[str, Any], ttl: float = DEFAULT_TTL) -> KeychainCache:
    """A resolver over an in-memory ``{stored name: data}`` (the local engine, tests)."""

    async def fetch(execution_id: str, names: list, grant: Any = None) -> Mapping[str, Any]:
        return {n: store[n] for n in names if n in store}

    return KeychainCache(fetch, ttl=ttl)


# ------------------------------------------------------------------------------------------ masking
_USER_KEYS = ("username", "user", "login")
# A credential's fields that say where and as whom, never masked (masking "postgres" as a user turns the
# error kind postgres_error into ***_error). Every other field is a secret: a password, token, key,
# secret, private key, or a field of unknown meaning (safe by default).
PUBLIC_FIELDS = frozenset({"user", "username", "login", "user_name", "host", "hostname", "port", "database",
                           "dbname", "db", "schema", "region", "sslmode"})
# Connection strings: masked as a whole and, apart, their password (and secret query parameters), so the
# rest of what a driver says about one (its host, its user) stays readable.
CONNECTION_FIELDS = frozenset({"dsn", "url", "uri", "conninfo", "connection_string", "connection_url",
                               "connection_uri", "database_url"})
_PASSWORD_KEYS = frozenset({"password", "passwd", "pass", "pwd", "secret", "token", "api_key", "apikey", "key",
                            "client_secret", "access_token"})
_LIBPQ_PASSWORD = re.compile(r"(?:^|\s)password\s*=\s*('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)


def _public(key: Any) -> bool:
    return isinstance(key, str) and key.lower() in PUBLIC_FIELDS


def connection_secrets(text: str) -> list[str]:
    """The password of a connection string (``scheme://user:password@host/...``, or libpq's
    ``password=...``) and its query parameters other than public ones."""
    found: list[str] = []
    for m in _LIBPQ_PASSWORD.finditer(text):
        value = m.group(1)
        found.append(value[1:-1].replace("\\'", "'") if value.startswith("'") else value)
    if "://" in text:
        try:
            parts = urlsplit(text)
            if parts.password:
                found += [parts.password, unquote(parts.password)]
            found += [v for k, v in parse_qsl(parts.query) if v and not _public(k)]
        except ValueError:
            pass
    return found


def secrets_of(resolved: Any) -> list[str]:
    """The secret string values (at any depth) of resolved entries that are long enough to mask,
    longest first: every field's but the public ones' (:data:`PUBLIC_FIELDS`); of a connection string
    (:data:`CONNECTION_FIELDS`) the whole and its password apart; and, for an entry holding a user
    (``username``/``user``/``login``) and a password (``password``, ``token``, ``secret``...),
    ``"<user>:<password>"``: what HTTP basic auth encodes."""
    found: set[str] = set()

    def add(value: str) -> None:
        if len(value) >= MIN_SECRET:
            found.add(value)

    def walk(value: Any, key: Any = None) -> None:
        if isinstance(value, str):
            if _public(key):
                return
            add(value)
            if isinstance(key, str) and key.lower() in CONNECTION_FIELDS:
                for part in connection_secrets(value):
                    add(part)
        elif isinstance(value, Mapping):
            user = next((value[k] for k in _USER_KEYS if isinstance(value.get(k), str) and value[k]), None)
            for k, v in value.items():
                if user is not None and k in _PASSWORD_KEYS and isinstance(v, str) and v:
                    found.add(f"{user}:{v}")
                walk(v, k)
        elif isinstance(value, (list, tuple, set)):
            for v in value:
                walk(v, key)

    walk(resolved)
    return sorted(found, key=len, reverse=True)


# characters no URL encoder changes (``~`` is left alone by Python and browsers, not by Java's URLEncoder)
_UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._")
_B64_PLAIN = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")


def _hex_any_case(text: str) -> str:
    """A regex for ``text`` (``%2F``, ``\\u00e9``) whose hex digits match in either case."""
    return re.sub(r"[A-Fa-f]", lambda m: f"[{m.group(0).upper()}{m.group(0).lower()}]", re.escape(text))


def _char_pattern(c: str) -> str:
    """Every form one character of a secret takes in text: itself; percent-encoded (``%XX`` per UTF-8
    byte, hex in either case; ``+`` for a space, as in query strings and forms); JSON-escaped
    (``\\"``, ``\\\\``, ``\\n``, ``\\u00e9``, ``\\/``)."""
    if c in _UNRESERVED:
        return re.escape(c)  # no encoder changes these
    forms = {re.escape(c), _hex_any_case("".join(f"%{b:02X}" for b in c.encode()))}
    if c == " ":
        forms.add(re.escape("+"))
    escaped = json.dumps(c)[1:-1]
    if escaped != c:
        forms.add(_hex_any_case(escaped))
    if c == "/":
        forms.add(re.escape("\\/"))
    return "(?:" + "|".join(sorted(forms, key=len, reverse=True)) + ")"


def _base64_pattern(secret: str) -> str:
    """Base64 of the secret alone: standard or URL-safe alphabet, padded or not (the padding and the
    ``+``/``/`` also percent-encoded or JSON-escaped, as inside a query string or a JSON text)."""
    encoded = base64.b64encode(secret.encode()).decode().rstrip("=")
    out = []
    for c in encoded:
        if c == "+":
            out.append("(?:[+\\-]|%2[Bb])")
        elif c == "/":
            out.append("(?:[/_]|%2[Ff]|\\\\/)")
        else:
            out.append(c)
    return "".join(out) + "(?:=|%3[Dd]){0,2}"


def _anchor(text: str, plain: frozenset[str]) -> str:
    """The longest run of ``plain`` characters of ``text``: present in every encoded form."""
    best = run = ""
    for c in text:
        run = run + c if c in plain else ""
        if len(run) > len(best):
            best = run
    return best


class Masker:
    """Masks one set of secrets (D24) in one pass: every form of each secret (as it is, URL-encoded,
    JSON-escaped, base64, HTTP basic auth: see :func:`_char_pattern` and :func:`_base64_pattern`) is one
    alternative of a single compiled regex, built once per set of secrets (:func:`masker`).

    Most values hold no secret at all, so a value is first serialised (orjson, C speed) and searched
    for *anchors* (for each secret the longest run of characters that no encoding changes): a value
    without any anchor is returned as it is, without a walk."""

    __slots__ = ("secrets", "_regex", "_anchors", "_byte_anchors")

    def __init__(self, secrets: Iterable[str]):
        self.secrets = tuple(sorted({s for s in secrets if isinstance(s, str) and len(s) >= MIN_SECRET},
                                    key=len, reverse=True))
        alternatives: list[str] = []
        anchors: set[str] = set()
        for secret in self.secrets:
            alternatives.append("".join(_char_pattern(c) for c in secret))
            alternatives.append(_base64_pattern(secret))
            anchors.add(_anchor(secret, _UNRESERVED))
            anchors.add(_anchor(base64.b64encode(secret.encode()).decode(), _B64_PLAIN))
        # an anchor that contains another is implied by it
        kept = sorted(anchors, key=len)
        kept = [a for i, a in enumerate(kept) if not any(b in a for b in kept[:i])]
        self._anchors = tuple(kept)
        self._byte_anchors = tuple(a.encode() for a in kept)
        self._regex = re.compile("|".join(alternatives)) if alternatives else None

    def __bool__(self) -> bool:
        return self._regex is not None

    def text(self, s: str) -> str:
        """``s`` with every form of every secret replaced by ``***``."""
        if self._regex is None:
            return s
        for anchor in self._anchors:
            if anchor in s:
                return self._regex.sub(MASK, s)
        return s

    def __call__(self, value: Any) -> Any:
        """``value`` with its strings (keys included) masked; new containers where something was
        masked, the value itself when nothing was."""
        if self._regex is None or value is None:
            return value
        try:
            blob = orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)
        except (TypeError, ValueError):  # not plain JSON (e.g. a tool's own objects): walk it all
            return self._walk(value)
        for anchor in self._byte_anchors:
            if anchor in blob:
                return self._walk(value)
        return value

    def _walk(self, v: Any) -> Any:
        if isinstance(v, str):
            return self.text(v)
        if isinstance(v, Mapping):
            return {(self.text(k) if isinstance(k, str) else k): self._walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [self._walk(x) for x in v]
        if isinstance(v, tuple):
            return tuple(self._walk(x) for x in v)
        return v


_MASKERS: dict[frozenset[str], Masker] = {}
_MASKERS_MAX = 256


def masker(secrets: Iterable[str]) -> Masker:
    """The :class:`Masker` of a set of secrets, built once (the last few hundred sets are kept)."""
    key = frozenset(secrets)
    found = _MASKERS.get(key)
    if found is None:
        if len(_MASKERS) >= _MASKERS_MAX:
            _MASKERS.clear()
        found = _MASKERS[key] = Masker(key)
    return found


def mask(value: Any, secrets: Iterable[str]) -> Any:
    """``value`` with every occurrence of each secret, in any of its encoded forms, in its strings (keys
    included) replaced by ``***``; returns new containers, leaves the input alone."""
    return masker(secrets)(value)


# ---------------------------------------------------------------------------------------------- logs
class LogMasking(logging.Filter):
    """Masks the secrets of the commands running in this process in every log record — the message
    with its arguments, and the text of an exception — whatever the logger (the worker's own, httpx,
    httpcore, psycopg...). :func:`install_log_masking` applies it to every record as it is made."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._running: dict[Any, frozenset[str]] = {}
        self._masker = Masker(())

    def track(self, key: Any, secrets: Iterable[str]) -> None:
        """The command ``key`` runs with ``secrets`` (called again when they change)."""
        secrets = frozenset(secrets)
        with self._lock:
            if self._running.get(key) == secrets:
                return
            self._running[key] = secrets
            self._masker = masker(frozenset().union(*self._running.values()))

    def forget(self, key: Any) -> None:
        """The command ``key`` ended."""
        with self._lock:
            if self._running.pop(key, None) is not None:
                self._masker = masker(frozenset().union(*self._running.values()))

    def filter(self, record: logging.LogRecord) -> bool:
        m = self._masker
        if not m:
            return True
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a broken format is logging's to report
            return True
        masked = m.text(message)
        if masked != message:
            record.msg, record.args = masked, None
        if record.exc_info and not record.exc_text:
            text = logging.Formatter().formatException(record.exc_info)
            masked = m.text(text)
            if masked != text:
                record.exc_text = masked
        if record.stack_info:
            record.stack_info = m.text(record.stack_info)
        return True


LOG_MASKING = LogMasking()
_installed = False


def install_log_masking() -> LogMasking:
    """Mask :data:`LOG_MASKING`'s secrets in every log record of this process (through the record
    factory, so records of every logger and for every handler are masked when made), and keep httpx
    and httpcore, which log each request's URL with its query string, at WARNING unless they were set.
    Idempotent."""
    global _installed
    if not _installed:
        _installed = True
        make = logging.getLogRecordFactory()

        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = make(*args, **kwargs)
            LOG_MASKING.filter(record)
            return record

        logging.setLogRecordFactory(factory)
    for name in ("httpx", "httpcore"):
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.WARNING)
    return LOG_MASKING


__all__ = ["KeychainCache", "BoundResolver", "Keychain", "KeychainDenied", "KeychainRefused", "Resolver", "resolve",
           "env_allowed", "declared_credential", "connection_secrets", "ENV_SETTING", "PUBLIC_FIELDS", "mask", "masker", "Masker", "secrets_of", "bus_resolver",
           "dict_resolver", "declarations_of", "stored_name", "MASK", "LOG_MASKING", "LogMasking",
           "install_log_masking"]
