"""Keychain resolution and secret masking (D24), pure apart from the clock and the environment.

A playbook's root ``keychain`` lists *declarations* ``{name, kind, ...}``; commands carry them as they
are, never the secrets. The worker resolves them when a command starts into ``{name: entry}`` (what
``{{ keychain.<name>.<field> }}`` and a tool's ``auth: <name>`` read):

- ``static``: the declaration's own fields (``name`` and ``kind`` removed);
- ``env``: ``{value: <the worker's environment variable var>}`` (an unset variable: no entry);
- ``credential``: the stored credential's data (``credential: <stored name>``, default the entry's
  name), fetched over request/reply from the event-recorder (``noetl.q.credential.resolve``) and cached
  per execution for ``ttl`` seconds (:class:`KeychainCache`). A credential that is not stored: no entry.

Everything the worker publishes goes through :func:`mask`: each resolved string value of at least
``MIN_SECRET`` characters is replaced by ``***`` wherever it occurs.

The ``secrets`` tool fetches one stored credential by name (:meth:`KeychainCache.credential`); its
values are remembered per execution (:meth:`KeychainCache.known_secrets`) and masked in every event the
worker publishes after the fetch, for that command and the later commands of the execution that this
worker runs. A different worker only masks the values it has itself fetched or resolved.
"""
from __future__ import annotations

import os
import time
from typing import Any, Awaitable, Callable, Iterable, Mapping


MASK = "***"
MIN_SECRET = 4
DEFAULT_TTL = 60.0

# (execution_id, declarations) -> {entry name: resolved entry}
Resolver = Callable[[str, list], Awaitable[Mapping[str, Any]]]
# (execution_id, stored credential names) -> {stored name: data}
Fetch = Callable[[str, list], Awaitable[Mapping[str, Any]]]


def declarations_of(keychain: Any) -> list[dict[str, Any]]:
    """The well-formed declarations of a command's ``keychain`` (a list of ``{name, kind, ...}``)."""
    if not isinstance(keychain, list):
        return []
    return [dict(d) for d in keychain
            if isinstance(d, Mapping) and isinstance(d.get("name"), str) and d.get("kind") in ("static", "env", "credential")]


def stored_name(declaration: Mapping[str, Any]) -> str:
    stored = declaration.get("credential")
    return stored if isinstance(stored, str) and stored else declaration["name"]


async def resolve(keychain: Any, execution_id: str, resolver: Resolver | None = None, *,
                  environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``{name: entry}`` for a command's keychain declarations. ``resolver`` resolves the
    ``credential`` entries (none without it). A ``keychain`` that is already a mapping is taken as
    resolved."""
    if isinstance(keychain, Mapping):
        return dict(keychain)
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    credentials: list[dict[str, Any]] = []
    for d in declarations_of(keychain):
        kind, name = d["kind"], d["name"]
        if kind == "static":
            out[name] = {k: v for k, v in d.items() if k not in ("name", "kind")}
        elif kind == "env":
            var = d.get("var") or d.get("env") or name
            if isinstance(var, str) and var in env:
                out[name] = {"value": env[var]}
        else:
            credentials.append(d)
    if credentials and resolver is not None:
        resolved = await resolver(execution_id, credentials)
        for d in credentials:
            if d["name"] in (resolved or {}):
                out[d["name"]] = resolved[d["name"]]
    return out


class KeychainCache:
    """Stored credentials by execution, each kept ``ttl`` seconds; ``fetch`` asks for the missing ones.
    Use the instance itself as the worker's ``keychain_resolver``."""

    def __init__(self, fetch: Fetch, ttl: float = DEFAULT_TTL, clock: Callable[[], float] = time.monotonic):
        self.fetch, self.ttl, self.clock = fetch, ttl, clock
        self._entries: dict[tuple[str, str], tuple[float, Any]] = {}  # (execution, stored name) -> (expiry, data)
        self._secrets: dict[str, tuple[float, set[str]]] = {}  # execution -> (expiry, values to mask)
        self.fetches = 0

    async def get(self, execution_id: str, names: Iterable[str]) -> dict[str, Any]:
        """``{stored name: data}`` for the names that are stored."""
        now = self.clock()
        self._expire(now)
        wanted = list(dict.fromkeys(names))
        # a snapshot before awaiting: a concurrent command may expire entries meanwhile
        have = {n: self._entries[(execution_id, n)][1] for n in wanted if (execution_id, n) in self._entries}
        missing = [n for n in wanted if n not in have]
        if missing:
            self.fetches += 1
            got = await self.fetch(execution_id, missing) or {}
            for n in missing:
                have[n] = got.get(n)
                self._entries[(execution_id, n)] = (now + self.ttl, have[n])
        return {n: have[n] for n in wanted if have.get(n) is not None}

    async def __call__(self, execution_id: str, declarations: list) -> dict[str, Any]:
        decls = declarations_of(list(declarations))
        stored = await self.get(execution_id, [stored_name(d) for d in decls])
        return {d["name"]: stored[stored_name(d)] for d in decls if stored_name(d) in stored}

    async def credential(self, execution_id: str, name: str) -> Any:
        """The data of the stored credential ``name`` (None when not stored), through the cache; its
        values are remembered as secrets of the execution (:meth:`known_secrets`). Fetch failures
        propagate."""
        data = (await self.get(execution_id, [name])).get(name)
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


def bus_resolver(request: Callable[..., Awaitable[Any]], subject: str, ttl: float = DEFAULT_TTL,
                 timeout: float = 10.0) -> KeychainCache:
    """The worker's resolver over request/reply: ``bus_resolver(bus.request, bus.Q_CREDENTIAL_RESOLVE)``."""

    async def fetch(execution_id: str, names: list) -> Mapping[str, Any]:
        return await request(subject, {"names": list(names), "execution_id": execution_id}, timeout=timeout)

    return KeychainCache(fetch, ttl=ttl)


def dict_resolver(store: Mapping[str, Any], ttl: float = DEFAULT_TTL) -> KeychainCache:
    """A resolver over an in-memory ``{stored name: data}`` (the local engine, tests)."""

    async def fetch(execution_id: str, names: list) -> Mapping[str, Any]:
        return {n: store[n] for n in names if n in store}

    return KeychainCache(fetch, ttl=ttl)


# ------------------------------------------------------------------------------------------ masking
def secrets_of(resolved: Any) -> list[str]:
    """Every string value (at any depth) of resolved entries that is long enough to mask, longest first."""
    found: set[str] = set()

    def walk(value: Any) -> None:
        if isinstance(value, str):
            if len(value) >= MIN_SECRET:
                found.add(value)
        elif isinstance(value, Mapping):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple, set)):
            for v in value:
                walk(v)

    walk(resolved)
    return sorted(found, key=len, reverse=True)


def mask(value: Any, secrets: Iterable[str]) -> Any:
    """``value`` with every occurrence of each secret in its strings (keys included) replaced by
    ``***``; returns new containers, leaves the input alone."""
    secrets = [s for s in secrets if isinstance(s, str) and len(s) >= MIN_SECRET]
    if not secrets:
        return value
    secrets.sort(key=len, reverse=True)

    def text(s: str) -> str:
        for secret in secrets:
            if secret in s:
                s = s.replace(secret, MASK)
        return s

    def walk(v: Any) -> Any:
        if isinstance(v, str):
            return text(v)
        if isinstance(v, Mapping):
            return {(text(k) if isinstance(k, str) else k): walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, tuple):
            return tuple(walk(x) for x in v)
        return v

    return walk(value)


__all__ = ["KeychainCache", "Resolver", "resolve", "mask", "secrets_of", "bus_resolver", "dict_resolver",
           "declarations_of", "stored_name", "MASK"]
