"""The gateway's access control, pure parts: every route declares one permission (read from the app
itself), the principal cache (time, revocation notices, races), bearer headers, client addresses and
the refusal messages."""
from __future__ import annotations

import pytest
from fastapi import HTTPException

from noetl_mesh.core import access
from noetl_mesh.services.gateway import auth
from noetl_mesh.services.gateway.app import create_app


class NoBus:
    """create_app touches no bus while it builds the routes."""


@pytest.fixture(scope="module")
def app():
    return create_app(NoBus())  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ declarations
def test_every_route_declares_exactly_one_permission_or_a_public_marker(app):
    found = auth.declarations(app.routes)
    assert len(found) >= 30
    undeclared = [route for route, permission in found.items() if permission is None]
    assert undeclared == []
    for (method, path), permission in found.items():
        assert permission in (auth.PUBLIC, auth.SIGNED_IN) or permission in access.PERMISSIONS, (method, path)
    public = sorted(path for (_, path), p in found.items() if p == auth.PUBLIC)
    assert public == ["/", "/api/auth/login", "/asyncapi.json", "/docs", "/docs/assets", "/docs/oauth2-redirect", "/health",
                      "/openapi.json", "/ready", "/redoc", "/ui"]  # /ui: the console's files (they hold no data); /: to /ui/
    signed_in = sorted(f"{m} {p}" for (m, p), perm in found.items() if perm == auth.SIGNED_IN)
    assert signed_in == ["GET /api/auth/whoami", "POST /api/auth/logout", "POST /api/users/{user_id}/password"]
    # the ones the roles are about
    assert found[("GET", "/api/credentials/{name}")] == "credential.list"  # include_data: credential.read_data inside
    assert found[("POST", "/api/credentials")] == "credential.write"
    assert found[("POST", "/api/executions/{execution_id}/cancel")] == "execution.cancel.own"  # .any inside
    assert found[("POST", "/api/executions")] == "execution.start"
    assert found[("GET", "/api/audit")] == "audit.read"
    # the console's own routes read what execution.read and catalog.read allow
    for path in ("/api/executions/{execution_id}/state", "/api/executions/{execution_id}/runs/{run_id}/result",
                 "/api/executions/{execution_id}/timeline", "/api/stats/executions",
                 "/api/live/executions", "/api/live/executions/{execution_id}"):
        assert found[("GET", path)] == "execution.read", path
    assert found[("GET", "/api/catalog/{catalog_id}/lint")] == "catalog.read"


def test_a_route_added_without_a_declaration_is_refused(app):
    from fastapi import FastAPI

    bare = FastAPI()

    @bare.get("/api/declared")
    async def declared(who: dict = auth.need("execution.read")) -> dict:
        return who

    @bare.get("/api/forgotten")
    async def forgotten() -> dict:
        return {}

    @bare.get("/api/twice")
    async def twice(a: dict = auth.need("execution.read"), b: dict = auth.need("audit.read")) -> dict:
        return {}

    found = auth.declarations(bare.routes)
    assert found[("GET", "/api/declared")] == "execution.read"
    assert found[("GET", "/api/forgotten")] is None and found[("GET", "/api/twice")] is None
    with pytest.raises(RuntimeError, match="GET /api/forgotten, GET /api/twice"):
        auth.check_declarations(bare)
    with pytest.raises(ValueError, match="unknown permission"):
        auth.need("execution.delete")


def test_the_openapi_description_names_each_routes_permission_and_the_bearer_scheme(app):
    spec = app.openapi()
    assert spec["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    cancel = spec["paths"]["/api/executions/{execution_id}/cancel"]["post"]
    assert cancel["security"] == [{"bearer": []}]
    assert "`execution.cancel.own` (roles admin, developer, operator)" in cancel["description"]
    assert spec["paths"]["/health"]["get"]["security"] == []
    assert spec["paths"]["/api/auth/login"]["post"]["security"] == []


# ------------------------------------------------------------------------------ the cache
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def principal(user: str = "u" * 32, **ids: str) -> dict:
    return {"user_id": user, "roles": ["viewer"], "kind": "session" if "session_id" in ids else "token", **ids}


def test_a_validation_is_kept_at_most_ttl_seconds():
    clock = Clock()
    cache = auth.PrincipalCache(ttl=1.0, clock=clock)
    key = cache.key("noetl_s_" + "a" * 43)
    assert cache.put(key, principal(session_id="s1"), cache.epoch)
    clock.now += 0.999
    assert cache.get(key)["session_id"] == "s1"
    clock.now += 0.001
    assert cache.get(key) is None and len(cache) == 0


def test_revocation_notices_drop_by_session_by_token_or_every_entry_of_a_user():
    cache = auth.PrincipalCache(ttl=60, clock=Clock())
    a, b, c, d = (cache.key(f"noetl_s_{i}" + "x" * 42) for i in range(4))
    cache.put(a, principal("u1", session_id="s1"), cache.epoch)
    cache.put(b, principal("u1", token_id="t1"), cache.epoch)
    cache.put(c, principal("u1", session_id="s2"), cache.epoch)
    cache.put(d, principal("u2", session_id="s3"), cache.epoch)
    assert cache.drop({"session_id": "s1", "user_id": "u1", "reason": "logout"}) == 1
    assert cache.get(a) is None and cache.get(b) and cache.get(c)
    assert cache.drop({"token_id": "t1", "user_id": "u1"}) == 1 and cache.get(b) is None
    assert cache.drop({"session_id": "unknown", "user_id": "u1"}) == 0  # an id names one entry, not the user
    assert cache.drop({"user_id": "u1", "reason": "user_disabled"}) == 1  # s2: the user's last one
    assert cache.get(c) is None and cache.get(d)["session_id"] == "s3"
    assert cache.drop({"reason": "nonsense"}) == 0 and len(cache) == 1


def test_a_validation_in_flight_when_a_notice_arrives_is_not_cached():
    cache = auth.PrincipalCache(ttl=60, clock=Clock())
    key = cache.key("noetl_t_" + "b" * 43)
    epoch = cache.epoch  # the validation starts
    cache.drop({"user_id": "someone else", "reason": "roles_changed"})  # meanwhile: any notice
    assert not cache.put(key, principal(token_id="t1"), epoch)
    assert cache.get(key) is None
    assert cache.put(key, principal(token_id="t1"), cache.epoch)


def test_the_cache_is_bounded_and_keyed_by_a_digest_not_the_token():
    clock = Clock()
    cache = auth.PrincipalCache(ttl=1.0, clock=clock, max_entries=3)
    tokens = [f"noetl_t_{i:02d}" + "c" * 41 for i in range(5)]
    for t in tokens[:3]:
        cache.put(cache.key(t), principal(token_id=t[-8:]), cache.epoch)
    clock.now += 2  # all expired: swept to make room
    cache.put(cache.key(tokens[3]), principal(token_id="new"), cache.epoch)
    assert len(cache) == 1
    for t in tokens[:2]:
        cache.put(cache.key(t), principal(token_id=t[-8:]), cache.epoch)
    cache.put(cache.key(tokens[4]), principal(token_id="last"), cache.epoch)  # full of live ones: all dropped
    assert len(cache) == 1 and cache.get(cache.key(tokens[4]))["token_id"] == "last"
    key = cache.key(tokens[0])
    assert len(key) == 16 and tokens[0].encode() not in key
    assert key != auth.PrincipalCache().key(tokens[0])  # a per-process key: no known derivation of the token


# ------------------------------------------------------------------------------ headers, addresses, messages
GOOD = "noetl_s_" + "A" * 43


@pytest.mark.parametrize("header, message, challenge", [
    (None, "this needs a token", auth.REALM),
    ("  ", "this needs a token", auth.REALM),
    ("Basic dXNlcjpwdw==", "must be 'Bearer <token>'", auth.REALM),
    ("Bearer", "must be 'Bearer <token>'", auth.REALM),
    ("Bearer abc", "not a noetl token", auth.INVALID),
    ("Bearer " + GOOD + "x", "not a noetl token", auth.INVALID),
    ("Bearer noetl_x_" + "A" * 43, "not a noetl token", auth.INVALID),
])
def test_bearer_headers_that_are_refused_say_why(header, message, challenge):
    with pytest.raises(HTTPException) as refused:
        auth.bearer(header)
    assert refused.value.status_code == 401 and message in refused.value.detail["message"]
    assert refused.value.headers == {"WWW-Authenticate": challenge}


def test_bearer_reads_the_token_whatever_the_scheme_case():
    assert auth.bearer(f"Bearer {GOOD}") == GOOD == auth.bearer(f"bearer   {GOOD} ")


def test_the_client_address_believes_forwarded_for_only_from_trusted_proxies():
    trusted = auth.trusted_networks("10.0.0.0/8, 127.0.0.1")
    assert auth.client_address("203.0.113.9", "1.2.3.4", trusted) == "203.0.113.9"  # not from a proxy
    assert auth.client_address("127.0.0.1", "198.51.100.7", []) == "127.0.0.1"  # no proxy trusted
    assert auth.client_address("127.0.0.1", "198.51.100.7", trusted) == "198.51.100.7"
    # a client that sends its own header cannot choose its address: read from the nearest hop
    assert auth.client_address("127.0.0.1", "6.6.6.6, 198.51.100.7, 10.1.2.3", trusted) == "198.51.100.7"
    assert auth.client_address("127.0.0.1", "junk, 10.1.2.3", trusted) == "10.1.2.3"  # malformed: stop there
    assert auth.client_address("127.0.0.1", "10.9.9.9", trusted) == "10.9.9.9"  # every hop trusted
    assert auth.client_address(None, "1.2.3.4", trusted) is None
    assert auth.client_address("::1", None, trusted) == "::1"
    with pytest.raises(ValueError, match="NOETL_TRUSTED_PROXIES: 'nowhere'"):
        auth.trusted_networks("nowhere")


def test_a_refusal_names_the_permission_the_roles_that_grant_it_and_the_callers():
    assert auth.denied_message("execution.cancel.any", ["developer"]) == \
        "this needs the permission execution.cancel.any (roles admin, operator); you have developer"
    assert auth.denied_message("credential.read_data", []).endswith("(roles admin); you have no role")


def test_who_started_an_execution_carries_ids_names_and_the_requests_roles_only():
    session = {"user_id": "u1", "username": "ann", "email": "ann@example.com", "roles": ["developer"],
               "kind": "session", "session_id": "s1", "expires_at": "x", "idle_expires_at": "y"}
    # never the id of the session or token: the sessions service takes it as proof of who asks
    assert auth.requested_by(session) == {"user_id": "u1", "username": "ann", "kind": "session", "roles": ["developer"]}
    token = {"user_id": "u2", "username": "ci", "roles": ["viewer"], "kind": "token", "token_id": "t1",
             "token_name": "deploy"}
    assert auth.requested_by(token) == {"user_id": "u2", "username": "ci", "kind": "token", "roles": ["viewer"]}


def test_retry_after_from_the_sessions_details():
    assert auth.retry_seconds({"retry_after": 7.2}) == "8" and auth.retry_seconds({"retry_after": 0.1}) == "1"
    assert auth.retry_seconds(None) == "1" and auth.retry_seconds({"retry_after": True}) == "1"
