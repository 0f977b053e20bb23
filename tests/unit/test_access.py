"""The access rules (core/access.py): the permission matrix, token formats, password hashing, session
expiry arithmetic, the lockout policy, OIDC claim mapping, audit records and input rules."""
import hashlib

import pytest
from argon2 import PasswordHasher
from hypothesis import given
from hypothesis import strategies as st

from noetl_mesh.core import access
from noetl_mesh.core.access import AccessError, LockoutPolicy, SessionPolicy, allowed, epoch, iso

CHEAP = PasswordHasher(time_cost=1, memory_cost=8, parallelism=1)  # argon2id, fast for tests
T0 = 1_700_000_000.0


# ---------------------------------------------------------------------------- roles and permissions
def test_admin_has_every_permission_and_viewer_only_reads():
    assert all(allowed(["admin"], p) for p in access.PERMISSIONS)
    assert access.permissions(["viewer"]) == ["catalog.read", "execution.read", "token.own", "session.own"]


@pytest.mark.parametrize("role, granted, refused", [
    ("developer", ["catalog.write", "execution.start", "execution.cancel.own", "credential.list", "catalog.read"],
     ["execution.cancel.any", "credential.write", "credential.read_data", "user.admin", "audit.read", "session.any"]),
    ("operator", ["execution.cancel.any", "execution.cancel.own", "execution.read", "credential.list"],
     ["execution.start", "catalog.write", "credential.read_data", "user.admin", "token.any"]),
    ("viewer", ["catalog.read", "execution.read", "session.own", "token.own"],
     ["catalog.write", "execution.start", "execution.cancel.own", "credential.list"]),
])
def test_matrix(role, granted, refused):
    assert [p for p in granted if not allowed([role], p)] == []
    assert [p for p in refused if allowed([role], p)] == []


def test_unknown_roles_grant_nothing_and_unknown_permissions_raise():
    assert not allowed(["root", "superuser"], "catalog.read")
    assert not allowed("admin", "catalog.read")  # a string is not a list of roles
    assert not allowed(None, "catalog.read")
    assert allowed(["nobody", "viewer"], "catalog.read")
    with pytest.raises(ValueError, match="unknown permission 'catalog.raed'"):
        allowed(["admin"], "catalog.raed")


@given(st.lists(st.one_of(st.text(max_size=12), st.integers(), st.none())), st.sampled_from(list(access.PERMISSIONS)))
def test_allowed_never_raises_on_hostile_roles(roles, permission):
    assert allowed(roles, permission) in (True, False)


def test_token_roles_are_within_the_creator_s_permissions():
    assert access.token_roles(["viewer"], ["developer"]) == ["viewer"]  # a developer holds viewer's permissions
    assert access.token_roles(None, ["operator"]) == ["operator"]
    with pytest.raises(AccessError, match="granting more than its creator has: developer") as exc:
        access.token_roles(["developer"], ["viewer"])
    assert exc.value.kind == "forbidden"
    with pytest.raises(AccessError, match="unknown 'root'"):
        access.token_roles(["root"], ["admin"])
    assert access.within(["viewer", "developer", "operator"], ["developer"]) == ["viewer", "developer"]


# ---------------------------------------------------------------------------- tokens
def test_tokens_have_a_kind_prefix_and_256_random_bits():
    s, t = access.new_token("session"), access.new_token("token")
    assert s.startswith("noetl_s_") and t.startswith("noetl_t_") and len(s) == len(t) == 51
    assert access.token_kind(s) == "session" and access.token_kind(t) == "token"
    assert s != access.new_token("session")
    with pytest.raises(ValueError):
        access.new_token("cookie")


@pytest.mark.parametrize("bad", [None, 42, "", "noetl_s_", "noetl_x_" + "a" * 43, "noetl_s_" + "a" * 42,
                                 "noetl_s_" + "a" * 44, "noetl_s_" + "a" * 42 + ".", "Bearer noetl_s_" + "a" * 43,
                                 "noetl_s_" + "a" * 42 + "\n", "noetl_s_" + "a" * 43 + "\n"])
def test_malformed_tokens_have_no_kind(bad):
    assert access.token_kind(bad) is None


@given(st.text(max_size=80))
def test_token_kind_never_raises(text):
    assert access.token_kind(text) in (None, "session", "token")


def test_token_id_is_one_way_and_not_the_plain_hash():
    token = access.new_token("session")
    tid = access.token_id(token)
    assert tid == access.token_id(token) and access.ID.match(tid)
    assert tid not in hashlib.sha256(token.encode()).hexdigest()
    assert access.token_id(access.new_token("session")) != tid


# ---------------------------------------------------------------------------- passwords
def test_password_hash_verifies_only_the_password():
    stored = access.hash_password("correct horse battery", CHEAP)
    assert stored.startswith("$argon2id$") and "correct horse" not in stored
    assert access.verify_password(stored, "correct horse battery", CHEAP)
    assert not access.verify_password(stored, "correct horse batterY", CHEAP)
    assert not access.verify_password("not a hash", "x", CHEAP)
    assert not access.verify_password(None, "anything", CHEAP)  # unknown user: same work, never true


def test_weaker_parameters_need_a_rehash():
    assert access.needs_rehash(access.hash_password("correct horse", CHEAP))
    assert not access.needs_rehash(access.hash_password("correct horse", CHEAP), CHEAP)
    assert access.needs_rehash("garbage")


@pytest.mark.parametrize("password, problem", [
    ("short", "at least 8 characters"), (None, "must be a string"), (["x"] * 9, "must be a string"),
    ("é" * 600, "longer than 1024 bytes"), ("correct horse", None)])
def test_password_rules(password, problem):
    got = access.password_problem(password, 1024)
    assert (problem is None and got is None) or (problem in got)


# ---------------------------------------------------------------------------- sessions
def test_session_ends_at_idle_or_absolute_expiry_whichever_first():
    policy = SessionPolicy(lifetime=3600, idle=600, refresh_interval=60)
    user = {"user_id": "1" * 32, "username": "ann", "roles": ["viewer"]}
    rec = access.session_record("5" * 32, user, T0, policy.lifetime, "10.0.0.1")
    assert policy.ttl(rec, T0) == 600 and policy.live(rec, T0 + 599.9) and not policy.live(rec, T0 + 600)
    assert not policy.refresh_due(rec, T0 + 59) and policy.refresh_due(rec, T0 + 60)
    slid = {**rec, "last_activity_at": iso(T0 + 3300)}  # active near the end: the absolute expiry wins
    assert policy.ttl(slid, T0 + 3300) == 300 and not policy.live(slid, T0 + 3600)
    assert policy.ttl(slid, T0 + 3599.5) == 1  # never 0: NATS refuses a zero TTL; live() decides
    for broken in ({}, {**rec, "expires_at": "tomorrow"}, {**rec, "last_activity_at": None}, {**rec, "session_id": 7}):
        assert not policy.live(broken, T0)  # a damaged record grants nothing (and does not raise)


def test_session_record_and_principal_hold_no_token():
    policy = SessionPolicy(lifetime=3600, idle=600, refresh_interval=60)
    token = access.new_token("session")
    user = {"user_id": "a" * 32, "username": "ann", "email": "ann@example.com", "roles": ["developer"]}
    rec = access.session_record(access.token_id(token), user, T0, 3600, None, idp_subject="sub-1")
    who = access.principal(rec, "session", policy)
    assert who == {"user_id": "a" * 32, "username": "ann", "email": "ann@example.com", "display_name": None,
                   "roles": ["developer"], "kind": "session", "expires_at": iso(T0 + 3600),
                   "session_id": access.token_id(token), "idle_expires_at": iso(T0 + 600)}
    assert token not in repr(rec) + repr(who)
    assert epoch(rec["created_at"]) == T0


def test_api_token_expiry():
    rec = access.token_record("7" * 32, "ci", {"user_id": "a" * 32, "username": "ann"}, ["viewer"], T0, T0 + 60)
    assert access.token_live(rec, T0 + 59) and not access.token_live(rec, T0 + 60)
    forever = access.token_record("7" * 32, "ci", {"user_id": "a" * 32, "username": "ann"}, ["viewer"], T0, None)
    assert forever["expires_at"] is None and access.token_live(forever, T0 + 1e9)
    assert access.principal(forever, "token")["token_name"] == "ci"
    assert not access.token_live({**rec, "expires_at": 12}, T0) and not access.token_live({}, T0)


SESSION = {"kind": "session", "session_id": "5" * 32, "user_id": "a" * 32, "roles": ["developer"],
           "expires_at": iso(T0 + 3600)}  # a principal: its session ends in an hour


def test_a_token_never_outlives_the_session_or_token_that_makes_it():
    top = 10 * 365 * 24 * 3600
    # a session: at most its absolute end; by default exactly that (never "no expiry")
    assert access.token_expiry(None, SESSION, T0, top) == T0 + 3600
    assert access.token_expiry(600, SESSION, T0, top) == T0 + 600
    assert access.token_expiry(3600, SESSION, T0, top) == T0 + 3600
    with pytest.raises(AccessError, match=r"cannot outlive the session that makes it: at most 3599 s") as longer:
        access.token_expiry(3601, SESSION, T0 + 1, top)
    assert longer.value.kind == "forbidden" and iso(T0 + 3600) in longer.value.message
    # a token with an expiry: the same, with its own
    token = {"kind": "token", "token_id": "6" * 32, "user_id": "a" * 32, "expires_at": iso(T0 + 60)}
    assert access.token_expiry(None, token, T0, top) == T0 + 60
    with pytest.raises(AccessError, match="cannot outlive the API token that makes it: at most 60 s"):
        access.token_expiry(61, token, T0, top)
    # only a token without expiry (the bootstrap's line) makes tokens without expiry
    forever = {**token, "expires_at": None}
    assert access.token_expiry(None, forever, T0, top) is None
    assert access.token_expiry(top, forever, T0, top) == T0 + top
    for bad in (0, -1, top + 1, 1.5, "60", True):
        with pytest.raises(AccessError, match="expires_in: whole seconds") as exc:
            access.token_expiry(bad, forever, T0, top)
        assert exc.value.kind == "bad_request"


def test_a_token_record_names_what_made_it():
    user = {"user_id": "a" * 32, "username": "ann"}
    made = access.token_record("7" * 32, "ci", user, ["viewer"], T0, T0 + 60, access.minter(SESSION))
    assert made["minted_by"] == {"kind": "session", "session_id": "5" * 32}
    assert access.minted_by(made, {"session_id": "5" * 32}) and not access.minted_by(made, {"session_id": "4" * 32})
    assert not access.minted_by(made, {"token_id": "5" * 32})  # a session id is no token id
    child = access.token_record("8" * 32, "job", user, ["viewer"], T0, T0 + 60,
                                access.minter(access.principal(made, "token")))
    assert child["minted_by"] == {"kind": "token", "token_id": "7" * 32} and access.minted_by(child, {"token_id": "7" * 32})
    boot = access.token_record("9" * 32, "bootstrap", user, ["admin"], T0, None)
    assert boot["minted_by"] is None and not access.minted_by(boot, {"token_id": None})
    assert not access.minted_by({"minted_by": "x"}, {"token_id": "x"})


# ---------------------------------------------------------------------------- lockout
def test_lockout_slows_then_locks_then_forgets():
    policy = LockoutPolicy(slow_after=3, lock_after=10, lock_seconds=900)
    rec, waits = None, []
    for n in range(1, 11):
        rec = policy.failed(rec, T0)
        waits.append(policy.retry_after(rec, T0))
    assert waits == [0, 0, 1, 2, 4, 8, 16, 32, 64, 900]
    assert policy.locked(rec) and policy.retry_after(rec, T0 + 899) == pytest.approx(1)
    assert policy.retry_after(rec, T0 + 900) == 0
    assert not policy.locked({"failures": 9, "last_failure_at": iso(T0)}) and not policy.locked(None)


def test_slow_delays_never_pass_the_lock_time():
    policy = LockoutPolicy(slow_after=1, lock_after=50, lock_seconds=30)
    assert policy.delay(40) == 30


# ---------------------------------------------------------------------------- OIDC claims
def test_oidc_identity_maps_claims_and_roles():
    claims = {"iss": "https://idp", "sub": "u-1", "email": "Ann@Example.com", "email_verified": True, "name": "Ann",
              "realm_access": {"roles": ["developer", "offline_access", "root"]}}
    ident = access.oidc_identity(claims, "realm_access.roles")
    assert ident == {"subject": "u-1", "issuer": "https://idp", "email": "Ann@Example.com", "email_verified": True,
                     "display_name": "Ann", "roles": ["developer"]}
    assert access.oidc_identity({**claims, "groups": "viewer operator"}, "groups")["roles"] == ["operator", "viewer"]
    assert access.oidc_identity(claims, None)["roles"] is None
    assert access.oidc_identity(claims, "missing.path")["roles"] is None
    unverified = access.oidc_identity({**claims, "email_verified": False}, None)
    assert unverified["email_verified"] is False


# ---------------------------------------------------------------------------- audit
def test_audit_record_shape_and_subject():
    actor = {"user_id": "a" * 32, "username": "ann", "kind": "session", "session_id": "s" * 32,
             "roles": ["admin"], "email": "ann@example.com"}
    rec = access.audit_record("user.added", actor=actor, now=T0, client_ip="10.0.0.1", target={"user_id": "b" * 32})
    assert rec["action"] == "user.added" and rec["at"] == iso(T0) and rec["outcome"] == "ok"
    assert rec["actor"] == {"user_id": "a" * 32, "username": "ann", "kind": "session", "session_id": "s" * 32}
    assert access.audit_subject("user.added", "a" * 32) == f"noetl.audit.user.added.{'a' * 32}"
    assert access.audit_subject("session.login_failed", None) == "noetl.audit.session.login_failed.-"
    assert access.audit_subject("session.login", "x.>") == "noetl.audit.session.login.-"  # no subject injection
    with pytest.raises(ValueError, match="<area>.<verb>"):
        access.audit_record("login", actor=None, now=T0)
    with pytest.raises(ValueError, match="<area>.<verb>"):
        access.audit_record("user.added.>", actor=None, now=T0)
    with pytest.raises(ValueError, match="outcome"):
        access.audit_record("user.added", actor=None, now=T0, outcome="maybe")


# ---------------------------------------------------------------------------- input rules
def test_input_rules():
    assert access.username("Ann.Lee@example.com") == "ann.lee@example.com"
    for bad in ("", ".ann", "ann lee", "a" * 129, None, 7, "ann\n", "*", "ann>"):
        with pytest.raises(AccessError):
            access.username(bad)
    assert access.role_list("viewer") == ["viewer"]
    assert access.role_list(["viewer", "admin"]) == ["admin", "viewer"]
    for bad in ([], ["root"], [1], {"admin": 1}):
        with pytest.raises(AccessError):
            access.role_list(bad)
    assert access.client_ip("10.0.0.1") == "10.0.0.1" and access.client_ip("::1") == "::1"
    assert access.client_ip("testclient") is None and access.client_ip(None) is None
    assert access.an_id("a" * 32, "x") == "a" * 32
    for bad in ("A" * 32, "a" * 31, "*", "a" * 31 + ">", "a" * 32 + "\n", None):
        with pytest.raises(AccessError, match="32 lower-case hex"):
            access.an_id(bad, "session_id")
    assert access.token_name("ci deploy-1") == "ci deploy-1"
    for bad in ("", "ci\n", "x" * 65):
        with pytest.raises(AccessError):
            access.token_name(bad)
    with pytest.raises(AccessError):
        access.display_name("x\x00y")
    assert access.email("ann@example.com") == "ann@example.com" and access.email(None) is None
    with pytest.raises(AccessError):
        access.email("not an email")


def test_public_views_and_ownership():
    user = {"user_id": "1" * 32, "username": "ann", "roles": ["viewer"], "password_hash": "$argon2id$..."}
    shown = access.public_user(user)
    assert "password_hash" not in shown and shown["has_password"] is True
    assert access.public_user({**user, "password_hash": None})["has_password"] is False
    caller = {"user_id": "1" * 32, "session_id": "5" * 32}
    assert access.scope(caller, "1" * 32, "session") == "session.own"
    assert access.scope(caller, "2" * 32, "token") == "token.any"
    rec = access.session_record("5" * 32, user, T0, 3600, None)
    assert not access.stale(rec, user) and access.stale(rec, {**user, "roles": ["admin"]})
    assert access.stale(rec, {**user, "email": "new@example.com"})
    listed = access.public_session(rec, SessionPolicy(3600, 600, 60), caller)
    assert listed["current"] and listed["idle_expires_at"] == iso(T0 + 600)
    assert access.token_ttl({"expires_at": iso(T0 + 60)}, T0) == pytest.approx(60)
    assert access.token_ttl({"expires_at": None}, T0) is None
