"""OIDC login: verify an ID token from the configured issuer against its published keys.

Discovery reads ``<issuer>/.well-known/openid-configuration`` (its ``issuer`` must equal the configured
one) for ``jwks_uri``; the key set is cached for ``oidc_jwks_max_age`` and fetched again at once for a
token whose ``kid`` is unknown (a key rotation), at most once per ``oidc_jwks_min_interval`` so a flood
of made-up key ids costs the provider nothing. Only asymmetric algorithms are accepted (never ``none``
or an HMAC, which would let the public key act as a shared secret); the token must carry ``iss``,
``aud``, ``sub``, ``exp`` and ``iat``. The provider must be https, except on a loopback address.

Configuration (:meth:`OidcConfig.from_environment`): ``NOETL_OIDC_ISSUER``, ``NOETL_OIDC_AUDIENCE``
(the client id the tokens are issued for), ``NOETL_OIDC_ROLES_CLAIM`` (dotted path, e.g.
``realm_access.roles`` or ``groups``), ``NOETL_OIDC_DEFAULT_ROLE`` (``viewer``),
``NOETL_OIDC_AUTO_PROVISION`` (``false``).
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import jwt
import orjson

from noetl_mesh import limits
from noetl_mesh.core.access import DEFAULT_ROLE, ROLES, AccessError

log = logging.getLogger("noetl.sessions.oidc")

ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA")
REQUIRED_CLAIMS = ["iss", "aud", "sub", "exp", "iat"]


@dataclass(frozen=True)
class OidcConfig:
    issuer: str
    audience: str
    roles_claim: str | None = None
    default_role: str = DEFAULT_ROLE
    auto_provision: bool = False
    algorithms: tuple[str, ...] = ALGORITHMS
    leeway: float = 60.0  # clock skew allowed on exp, iat, nbf
    timeout: float = 5.0  # per HTTP request to the provider

    def __post_init__(self) -> None:
        _check_url(self.issuer, "the OIDC issuer")
        if not self.audience:
            raise ValueError("the OIDC audience (client id) is required")
        if self.default_role not in ROLES:
            raise ValueError(f"the OIDC default role {self.default_role!r} is not one of {', '.join(ROLES)}")
        bad = [a for a in self.algorithms if a not in ALGORITHMS]
        if bad:
            raise ValueError(f"OIDC algorithms {bad} are not allowed; allowed: {', '.join(ALGORITHMS)}")

    @classmethod
    def from_environment(cls, env: dict[str, str] | None = None) -> "OidcConfig | None":
        env = os.environ if env is None else env
        if not env.get("NOETL_OIDC_ISSUER"):
            return None
        return cls(issuer=env["NOETL_OIDC_ISSUER"], audience=env.get("NOETL_OIDC_AUDIENCE", ""),
                   roles_claim=env.get("NOETL_OIDC_ROLES_CLAIM") or None,
                   default_role=env.get("NOETL_OIDC_DEFAULT_ROLE") or DEFAULT_ROLE,
                   auto_provision=env.get("NOETL_OIDC_AUTO_PROVISION", "").lower() in ("1", "true", "yes"))


def _check_url(url: str, what: str) -> None:
    parts = urlsplit(url)
    if parts.scheme == "https" and parts.hostname:
        return
    if parts.scheme == "http" and parts.hostname:
        host = parts.hostname
        try:
            if host == "localhost" or ipaddress.ip_address(host).is_loopback:
                return
        except ValueError:
            pass
    raise ValueError(f"{what} {url!r} must be an https URL (http only on a loopback address)")


def unauthenticated(message: str) -> AccessError:
    return AccessError("unauthenticated", f"ID token refused: {message}")


class OidcVerifier:
    def __init__(self, config: OidcConfig, client: httpx.AsyncClient | None = None):
        self.config = config
        self.client = client or httpx.AsyncClient(timeout=config.timeout, follow_redirects=False)
        self._keys: dict[str | None, tuple[jwt.PyJWK, str | None]] = {}  # kid -> (key, its declared alg)
        self._fetched_at = 0.0  # when the key set was last fetched (monotonic)
        self._attempted_at = 0.0  # when a fetch was last tried
        self._lock = asyncio.Lock()
        self.fetches = 0  # key set fetches so far (tests, metrics)

    async def close(self) -> None:
        await self.client.aclose()

    async def verify(self, id_token: Any, nonce: Any = None) -> dict[str, Any]:
        """The token's claims, or AccessError (unauthenticated: why; unavailable: the provider)."""
        if not isinstance(id_token, str) or not id_token:
            raise AccessError("bad_request", "id_token: a string")
        if len(id_token) > limits.current().oidc_max_bytes:
            raise unauthenticated(f"longer than oidc_max_bytes = {limits.current().oidc_max_bytes} bytes "
                                  "(set NOETL_LIMIT_OIDC_MAX_BYTES to change it)")
        try:
            header = jwt.get_unverified_header(id_token)
        except jwt.PyJWTError:
            raise unauthenticated("not a JWT") from None
        alg, kid = header.get("alg"), header.get("kid")
        if alg not in self.config.algorithms:
            raise unauthenticated(f"algorithm {alg!r} is not accepted")
        if kid is not None and not isinstance(kid, str):
            raise unauthenticated("kid must be a string")
        key = await self._key(kid, alg)
        try:
            claims = jwt.decode(id_token, key=key.key, algorithms=[alg], audience=self.config.audience,
                                issuer=self.config.issuer, leeway=self.config.leeway,
                                options={"require": REQUIRED_CLAIMS})
        except jwt.ExpiredSignatureError:
            raise unauthenticated("it has expired") from None
        except jwt.InvalidAudienceError:
            raise unauthenticated("it was not issued for this service (aud)") from None
        except jwt.InvalidIssuerError:
            raise unauthenticated("it was issued by another issuer (iss)") from None
        except jwt.InvalidSignatureError:
            raise unauthenticated("its signature does not verify") from None
        except jwt.PyJWTError as exc:
            raise unauthenticated(str(exc)) from None
        if nonce is not None and claims.get("nonce") != nonce:
            raise unauthenticated("the nonce does not match")
        if not isinstance(claims.get("sub"), str) or not claims["sub"]:
            raise unauthenticated("sub must be a non-empty string")
        return claims

    async def _key(self, kid: str | None, alg: str) -> jwt.PyJWK:
        if not self._keys:
            await self._refetch(limits.current().oidc_jwks_min_interval if self._attempted_at else None)
        elif time.monotonic() - self._fetched_at >= limits.current().oidc_jwks_max_age:
            try:
                await self._refetch(None)
            except AccessError as exc:  # the provider is down: the keys it published still verify
                log.warning("OIDC: keeping the cached key set: %s", exc.message)
        if not self._keys:
            raise AccessError("unavailable", "the OIDC issuer's key set has no usable keys (or could not be "
                                             "fetched; tried again at most every oidc_jwks_min_interval)")
        key = self._find(kid, alg)
        if key is None:  # a rotation? fetch again, rarely
            await self._refetch(limits.current().oidc_jwks_min_interval)
            key = self._find(kid, alg)
        if key is None:
            raise unauthenticated(f"no key {kid!r} for {alg} in the issuer's key set")
        return key

    def _find(self, kid: str | None, alg: str) -> jwt.PyJWK | None:
        if kid is not None:
            entry = self._keys.get(kid)
        else:  # no kid: only when the set has exactly one key
            entry = next(iter(self._keys.values())) if len(self._keys) == 1 else None
        if entry is None or (entry[1] and entry[1] != alg):  # a key published for another algorithm
            return None
        return entry[0]

    async def _refetch(self, min_interval: float | None) -> None:
        """Fetch the key set (once for concurrent callers); with ``min_interval``, only if the last
        attempt is at least that old."""
        started = time.monotonic()
        async with self._lock:
            if self._fetched_at > started:  # another caller fetched while this one waited
                return
            if min_interval is not None and time.monotonic() - self._attempted_at < min_interval:
                return
            self._attempted_at = time.monotonic()
            self.fetches += 1
            discovery = await self._get_json(self.config.issuer.rstrip("/") + "/.well-known/openid-configuration")
            if discovery.get("issuer") != self.config.issuer:
                raise AccessError("unavailable", f"the OIDC discovery document names issuer "
                                                 f"{str(discovery.get('issuer'))[:200]!r}, not {self.config.issuer!r}")
            uri = discovery.get("jwks_uri")
            try:
                _check_url(uri if isinstance(uri, str) else "", "the issuer's jwks_uri")
            except ValueError as exc:
                raise AccessError("unavailable", str(exc)) from None
            jwks = await self._get_json(uri)
            keys: dict[str | None, tuple[jwt.PyJWK, str | None]] = {}
            for data in jwks.get("keys") if isinstance(jwks.get("keys"), list) else []:
                if not isinstance(data, dict) or data.get("use", "sig") != "sig":
                    continue
                try:
                    key = jwt.PyJWK(data)
                except (jwt.PyJWKError, jwt.InvalidKeyError, KeyError, TypeError, ValueError):
                    continue  # a key type or algorithm this library does not know: skipped
                kid, declared = data.get("kid"), data.get("alg")
                keys[kid if isinstance(kid, str) else None] = (key, declared if isinstance(declared, str) else None)
            self._keys, self._fetched_at = keys, time.monotonic()

    async def _get_json(self, url: str) -> dict[str, Any]:
        cap = limits.current().oidc_max_bytes
        try:
            async with self.client.stream("GET", url, headers={"Accept": "application/json"}) as resp:
                if resp.status_code != 200:
                    raise AccessError("unavailable", f"the OIDC provider answered {resp.status_code} for {url}")
                body = bytearray()
                async for chunk in resp.aiter_bytes():
                    body += chunk
                    if len(body) > cap:
                        raise AccessError("unavailable", f"{url} is larger than oidc_max_bytes = {cap} bytes")
        except httpx.HTTPError as exc:
            raise AccessError("unavailable", f"the OIDC provider cannot be reached ({type(exc).__name__})") from None
        try:
            doc = orjson.loads(bytes(body))
        except orjson.JSONDecodeError:
            raise AccessError("unavailable", f"{url} is not JSON") from None
        if not isinstance(doc, dict):
            raise AccessError("unavailable", f"{url} is not a JSON object")
        return doc
