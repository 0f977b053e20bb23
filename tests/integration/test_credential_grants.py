"""Credentials are capabilities (D24, docs/security.md "Credentials"), on a real stack: a worker's NATS
user gets a credential's data only for a command it holds, of its own pool, for a name the command's
keychain declares, while the execution runs. Every forged or replayed resolution is refused and
audited, every grant audited; playbooks with keychain credentials work as before."""
from __future__ import annotations

import asyncio
import base64
import os
import time
from typing import Any, Iterator

import httpx
import orjson
import pytest
from nats.js.api import ConsumerConfig

from conftest import pg_endpoint, start_stack, stop_stack
from noetl_mesh.contracts.subjects import LANES, lane_filter
from noetl_mesh.infra.bus import COMMANDS, Bus, BusError, credential_resolve_subject
from noetl_mesh.infra.payloads import is_ref

pytestmark = pytest.mark.integration

KEY = base64.b64encode(os.urandom(32)).decode()
DB_PASSWORD = "grant-db-pw-Xq72"
OTHER_TOKEN = "not-yours-token-81Zp"
API_TOKEN = "api-token-Ld03"

HELD = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: held, path: tests/grants/held}
keychain:
  - {name: db, kind: credential, credential: grant_db}
workflow:
  - step: start
    spec: {pool: other, policy: {lifecycle: {timeout_s: TIMEOUT}}}
    tool: {kind: noop, result: never-run}
    next: {arcs: [{step: end, when: "{{ event.error.kind == 'timeout' }}"}]}
  - step: end
    tool: {kind: noop, result: done}
"""


@pytest.fixture(scope="module")
def grants(module_pg, fixture_api) -> Iterator[Any]:
    """A stack with the pools default (a worker runs it) and other (none does: the tests hold its
    commands with worker-other's own credentials), and three stored credentials."""
    old = os.environ.get("NOETL_CREDENTIAL_KEY")
    os.environ["NOETL_CREDENTIAL_KEY"] = KEY
    # its tasks call the fixture API and the module's Postgres (D33: nothing else)
    nats, loop, handle = start_stack(module_pg, pools=("default", "other"),
                                     allow_net=f"{fixture_api.endpoint},{pg_endpoint(module_pg)}")
    try:
        with httpx.Client(base_url=handle.url, trust_env=False, headers=handle.headers) as gw:
            for name, data in (("grant_db", {"user": "postgres", "password": DB_PASSWORD, "host": "localhost"}),
                               ("other_secret", {"token": OTHER_TOKEN}),
                               ("grant_api", {"user": "svc", "token": API_TOKEN}),
                               ("grant_pg", {"dsn": module_pg})):
                assert gw.post("/api/credentials", json={"name": name, "data": data}).status_code == 201
        yield handle
    finally:
        stop_stack(nats, loop, handle)  # the forged requests are the credentials service's to refuse: no violation
        if old is None:
            os.environ.pop("NOETL_CREDENTIAL_KEY", None)
        else:
            os.environ["NOETL_CREDENTIAL_KEY"] = old


class Worker:
    """A connection with a worker pool's own NATS credentials (what a compromised worker has)."""

    def __init__(self, handle: Any, pool: str):
        self.handle, self.pool = handle, pool

    async def __aenter__(self) -> "Worker":
        self.bus = await Bus.connect(self.handle.nats_url, f"test-worker-{self.pool}",
                                     self.handle.stack.settings.creds_for("admin").replace("admin.nk",
                                                                                            f"worker-{self.pool}.nk"))
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.bus.close()

    async def hold(self, execution_id: str, timeout: float = 30) -> Any:
        """Fetch (and never acknowledge) the execution's command from the pool's lanes, as a worker does."""
        subs = [await self.bus.durable(COMMANDS, f"lane-{self.pool}-p{lane}", lane_filter(self.pool, lane),
                                       max_ack_pending=10_000, max_deliver=10) for lane in range(LANES)]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for sub in subs:
                try:
                    for msg in await sub.fetch(1, timeout=0.2):
                        if msg.subject.split(".")[3] == execution_id:
                            return msg
                        await msg.nak()
                except (asyncio.TimeoutError, Exception) as exc:  # noqa: BLE001 - an empty fetch
                    if "timeout" not in type(exc).__name__.lower():
                        raise
        raise AssertionError(f"no command of {execution_id} for pool {self.pool}")

    async def resolve(self, names: list[str], execution_id: str, command: dict | None, pool: str | None = None) -> Any:
        body: dict[str, Any] = {"names": names, "execution_id": execution_id}
        if command is not None:
            body["command"] = command
        return await self.bus.request(credential_resolve_subject(pool or self.pool), body, timeout=10)


def grant_of(msg: Any) -> dict[str, Any]:
    return {"seq": msg.metadata.sequence.stream, "subject": msg.subject}


async def refused(call, reason: str) -> str:
    with pytest.raises(BusError) as caught:
        await call
    assert caught.value.kind in ("forbidden", "bad_request"), caught.value
    assert (caught.value.details or {}).get("reason") == reason, (reason, caught.value.message, caught.value.details)
    return caught.value.message


async def start(handle: Any, doc: str) -> str:
    async with handle.client() as client:
        return await client.start(doc)


async def audit(handle: Any, action: str) -> list[dict]:
    async with httpx.AsyncClient(base_url=handle.url, trust_env=False, headers=handle.headers) as gw:
        resp = await gw.get("/api/audit", params={"action": action, "limit": 1000})
        assert resp.status_code == 200, resp.text
        return resp.json()


def test_a_workers_seed_resolves_only_for_a_command_it_holds(grants):
    """The penetration test's request, and every way around the grant, with worker seeds: a request that
    names no command, an execution that does not exist, a name the keychain does not declare, another
    pool's command, the execution finished (its command still held: a completed execution's commands are
    not purged), a cancelled execution's command (purged). One resolution is granted: the declared name,
    for the command held, by its pool."""

    async def main() -> tuple[str, str]:
        eid = await start(grants, HELD.replace("TIMEOUT", "2"))
        async with Worker(grants, "other") as other, Worker(grants, "default") as default:
            msg = await other.hold(eid)
            held = grant_of(msg)
            granted = await other.resolve(["grant_db"], eid, held)
            assert granted == {"grant_db": {"user": "postgres", "password": DB_PASSWORD, "host": "localhost"}}
            # the penetration test's request: no command named
            assert "command must be" in await refused(default.resolve(["grant_db"], "nope", None), "bad_request")
            await refused(other.resolve(["grant_db"], "nope", None), "bad_request")
            # an execution that does not exist: no such command; a real command named for another execution
            await refused(other.resolve(["grant_db"], "nope", {"seq": 10 ** 9, "subject": "noetl.cmd.other.nope"}),
                          "no_command")
            await refused(other.resolve(["grant_db"], "nope", {**held, "subject": "noetl.cmd.other.nope"}),
                          "no_command")
            await refused(other.resolve(["grant_db"], "nope", held), "wrong_execution")
            # a name outside the execution's keychain
            message = await refused(other.resolve(["other_secret"], eid, held), "undeclared")
            assert "'other_secret'" in message and "declared: 'grant_db'" in message
            await refused(other.resolve(["grant_db", "other_secret"], eid, held), "undeclared")
            # another pool's command, asked by worker-default on its own subject
            await refused(default.resolve(["grant_db"], eid, held), "wrong_pool")
            # the answer asked for at a subject that is not an inbox: never sent, and audited
            await other.bus.nc.publish(credential_resolve_subject("other"), orjson.dumps(
                {"names": ["grant_db"], "execution_id": eid, "command": held}), reply="noetl.cancel.redirected")
            await other.bus.nc.flush()
            # the execution finishes (its run times out and the failure is routed: COMPLETED) while the
            # command is still held: replayed, it is refused
            async with grants.client() as client:
                status = await client.wait(eid, timeout=60)
            assert status["status"] == "COMPLETED", status
            await refused(other.resolve(["grant_db"], eid, held), "finished")
            # a cancelled execution's queued commands are purged: replayed, there is no such command
            cancelled = await start(grants, HELD.replace("TIMEOUT", "600"))
            msg2 = await other.hold(cancelled)
            assert await other.resolve(["grant_db"], cancelled, grant_of(msg2))
            async with grants.client() as client:
                await client.cancel(cancelled)
                assert (await client.wait(cancelled, timeout=60))["status"] == "CANCELLED"
            await refused(other.resolve(["grant_db"], cancelled, grant_of(msg2)), "no_command")
            return eid, cancelled

    eid, cancelled = grants.run(main(), timeout=180)

    async def records() -> tuple[list[dict], list[dict]]:
        return await audit(grants, "credential.refused"), await audit(grants, "credential.resolved")

    refusals, grants_ = grants.run(records())
    reasons = [r["details"]["reason"] for r in refusals]
    for reason, n in (("bad_request", 2), ("no_command", 3), ("wrong_execution", 1), ("undeclared", 2),
                      ("wrong_pool", 1), ("finished", 1), ("bad_reply", 1)):
        assert reasons.count(reason) == n, (reason, reasons)
    assert all(r["outcome"] == "denied" and r["actor"]["kind"] == "worker" for r in refusals)
    assert {r["actor"]["username"] for r in refusals} == {"worker-default", "worker-other"}
    pool = next(r for r in refusals if r["details"]["reason"] == "wrong_pool")
    assert pool["actor"]["username"] == "worker-default" and pool["target"]["execution_id"] == eid
    finished = next(r for r in refusals if r["details"]["reason"] == "finished")
    assert finished["target"] == {"execution_id": eid, "credentials": ["grant_db"]}
    assert finished["details"]["command"]["subject"].startswith(f"noetl.cmd.other.{eid}.")  # its lane last
    ok = [r for r in grants_ if r["target"]["execution_id"] in (eid, cancelled)]
    assert all(r["outcome"] == "ok" and r["target"]["credentials"] == ["grant_db"] for r in ok)
    assert all(r["details"]["found"] == ["grant_db"] for r in ok)
    # the test's two, and the real worker's for the step `end` (it resolves the keychain as it starts)
    assert sorted((r["actor"]["username"], r["target"]["execution_id"], r["details"]["step"]) for r in ok) == sorted(
        [("worker-other", eid, "start"), ("worker-other", cancelled, "start"), ("worker-default", eid, "end")])
    # who started the execution, once the recorder has it (the first command may come before)
    assert next(r for r in ok if r["details"]["step"] == "end")["details"]["requested_by"]
    text = str(refusals) + str(grants_)
    assert DB_PASSWORD not in text and OTHER_TOKEN not in text  # names, never values


PLAYBOOK = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: works, path: tests/grants/works}
workload: {api: API}
keychain:
  - {name: api, kind: credential, credential: grant_api}
  - {name: pg, kind: credential, credential: grant_pg}
workflow:
  - step: start
    tool:
      - name: call
        kind: http
        method: POST
        url: "{{ workload.api }}/echo"
        auth: api
        json: {token: "{{ keychain.api.token }}", user: "{{ keychain.api.user }}"}
      - name: query
        kind: postgres
        auth: pg
        command: "SELECT current_user AS who, 1 AS one"
      - name: fetched
        kind: secrets
        secret: api
    next: {arcs: [{step: undeclared}]}
  - step: undeclared
    tool:
      - name: steal
        kind: secrets
        secret: other_secret
        spec:
          policy:
            rules:
              - when: "{{ outcome.error.kind == 'secret_not_declared' }}"
                then: {do: continue, set_ctx: {refused: "{{ outcome.error.kind }}"}}
"""


def test_a_playbook_with_keychain_credentials_still_works(grants, fixture_api):
    status, events = grants.execute(PLAYBOOK.replace("API", fixture_api.url), timeout=60)
    assert status["status"] == "COMPLETED", status
    outcomes = {e["task"]: e["data"]["outcome"] for e in events if e["name"] == "task.processed"}
    # http: the task sent the real token (the echo holds it, masked); the user is no secret
    assert outcomes["call"]["status"] == "ok" and outcomes["call"]["result"] == {"echo": {"token": "***", "user": "svc"}}
    # postgres with a DSN from the keychain: the rows readable (the user is not masked)
    query = outcomes["query"]
    assert query["status"] == "ok", query
    assert query["result"]["rows"][0]["one"] == 1 and query["result"]["rows"][0]["who"] != "***"
    assert outcomes["fetched"]["result"] == {"user": "svc", "token": "***"}
    assert status["ctx"]["refused"] == "secret_not_declared"  # the secrets tool: declared names only
    assert API_TOKEN not in str(events) and OTHER_TOKEN not in str(events)


def test_a_keychain_carried_by_reference_still_resolves(grants):
    """A command too big for a message carries its keychain as a D23 reference: the credentials service
    reads the declarations from the payload store."""
    # 2,000 small entries: the keychain is over max_payload_bytes (256 KiB) while each entry is under it,
    # so the command carries the whole keychain as one reference
    padding = "\n".join(f"  - {{name: pad{i}, kind: static, v: {'x' * 150}}}" for i in range(2000))
    doc = f"""
apiVersion: noetl.io/v2
kind: Playbook
metadata: {{name: big, path: tests/grants/big}}
keychain:
  - {{name: db, kind: credential, credential: grant_db}}
{padding}
workflow:
  - step: start
    tool: {{kind: noop, result: "{{{{ keychain.db.user }}}}:{{{{ keychain.db.password }}}}"}}
"""
    seen: list[Any] = []
    real = grants.stack.services("credentials")[0]._command

    async def watched(seq: int) -> Any:
        seen.append(orjson.loads((await grants.stack.services("credentials")[0].bus.js.get_msg(COMMANDS, seq)).data))
        return await real(seq)

    grants.stack.services("credentials")[0]._command = watched
    try:
        status, _ = grants.execute(doc, timeout=60)
    finally:
        del grants.stack.services("credentials")[0]._command
    assert status["status"] == "COMPLETED", status
    assert seen and is_ref(seen[0]["keychain"])  # it did travel by reference
    assert status["steps"]["start"]["result"] == "***"  # user:password, the basic-auth form: masked whole

    async def check() -> None:
        records = await audit(grants, "credential.resolved")
        mine = [r for r in records if r["target"]["execution_id"] == status["execution_id"]]
        assert len(mine) == 1 and mine[0]["target"]["credentials"] == ["grant_db"]

    grants.run(check())


ROLES = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: roles, path: tests/grants/roles}
keychain:
  - {name: api, kind: credential, credential: grant_roles}
workflow:
  - step: start
    tool: {name: fetched, kind: secrets, secret: api}
"""


async def run_as(grants: Any, token: str | None, playbook: str, **body: Any) -> tuple[dict, list[dict]]:
    """Start ``playbook`` (or what ``body`` names: a catalog path) as the user of ``token`` (None: the
    admin); its final status and its events."""
    async with (grants.client(token=token) if token else grants.client()) as client:
        eid = await client.start(**body) if body else await client.start(playbook)
        return await client.wait(eid, timeout=60), await client.all_events(eid)


def refused_without(secret: str, status: dict, events: list[dict]) -> str:
    """The error of an execution whose credential was refused: it failed, and ``secret`` is nowhere."""
    assert status["status"] == "FAILED", status
    assert secret not in str(events)
    return str(next(e for e in events if e["name"] == "task.processed")["data"]["outcome"]["error"])


def test_a_credential_is_used_only_by_the_playbooks_of_users_holding_one_of_its_roles(grants):
    """D24: a credential stored without roles is an admin's: a developer's playbook naming it, or a
    developer starting an admin's playbook that names it, gets nothing (refused and audited); once an
    admin gives it the role developer, both get it, and a new password keeps its roles."""
    from conftest import new_user

    token = "roles-token-Wq18"

    async def main() -> None:
        dev = await new_user(grants, "cred-dev", ["developer"])
        async with httpx.AsyncClient(base_url=grants.url, trust_env=False, headers=grants.headers) as admin, \
                httpx.AsyncClient(base_url=grants.url, trust_env=False,
                                  headers={"Authorization": f"Bearer {dev}"}) as developer:
            stored = await admin.post("/api/credentials", json={"name": "grant_roles", "data": {"user": "svc",
                                                                                              "token": token}})
            assert stored.status_code == 201 and stored.json()["roles"] == ["admin"], stored.text

            async def run(as_dev: bool, **body: Any) -> tuple[dict, list[dict]]:
                return await run_as(grants, dev if as_dev else None, ROLES, **body)

            def refusal(status: dict, events: list[dict]) -> str:
                return refused_without(token, status, events)

            why = refusal(*await run(True))
            assert "credential 'grant_roles' may be used only by playbooks started and written by users with the " \
                   "role admin" in why and "started by cred-dev, who has developer" in why, why
            denied = [r for r in await audit(grants, "credential.refused")
                      if r["details"].get("reason") == "not_allowed"]
            assert denied and "grant_roles" in denied[-1]["target"]["credentials"], denied

            status, events = await run(False)  # the admin's own
            assert status["status"] == "COMPLETED", status
            assert status["steps"]["start"]["result"] == {"user": "svc", "token": "***"}

            registered = await admin.post("/api/catalog", json={"content": ROLES})
            assert registered.status_code == 201, registered.text
            why = refusal(*await run(True, path="tests/grants/roles"))  # the admin's playbook, started by a developer
            assert "started by cred-dev, who has developer" in why, why

            forbidden = await developer.post("/api/credentials/grant_roles/roles", json={"roles": ["developer"]})
            assert forbidden.status_code == 403, forbidden.text
            bad = await admin.post("/api/credentials/grant_roles/roles", json={"roles": ["root"]})
            assert bad.status_code == 400 and "root" in bad.text, bad.text
            missing = await admin.post("/api/credentials/no_such/roles", json={"roles": ["developer"]})
            assert missing.status_code == 404, missing.text
            given = await admin.post("/api/credentials/grant_roles/roles", json={"roles": ["developer", "admin"]})
            assert given.status_code == 200 and given.json()["roles"] == ["admin", "developer"], given.text

            for body in ({}, {"path": "tests/grants/roles"}):
                status, _ = await run(True, **body)
                assert status["status"] == "COMPLETED", status
                assert status["steps"]["start"]["result"] == {"user": "svc", "token": "***"}

            again = await admin.post("/api/credentials", json={"name": "grant_roles", "data": {"user": "svc",
                                                                                             "token": token + "2"}})
            assert again.json()["roles"] == ["admin", "developer"], again.text  # a new password, the same users
            listed = {c["name"]: c["roles"] for c in (await developer.get("/api/credentials")).json()}
            assert listed["grant_roles"] == ["admin", "developer"] and listed["grant_api"] == ["admin"], listed

    grants.run(main(), 180)


NAMED = ROLES.replace("name: roles, path: tests/grants/roles", "name: named, path: tests/grants/named").replace(
    "credential: grant_roles", "credential: grant_named")


def test_a_credential_that_names_a_user_is_theirs_and_no_other_developers(grants):
    """D24: a credential for one developer: its roles none, its users that developer. Their own playbook
    gets it; another developer's, or the same playbook started by that other developer, gets nothing;
    an admin cannot use it by role either. Replacing its data keeps its users; an unknown user is 404."""
    from conftest import new_user

    token = "named-token-Jp52"

    async def main() -> None:
        alice = await new_user(grants, "cred-alice", ["developer"])
        bob = await new_user(grants, "cred-bob", ["developer"])
        async with httpx.AsyncClient(base_url=grants.url, trust_env=False, headers=grants.headers) as admin:
            unknown = await admin.post("/api/credentials", json={"name": "grant_named", "data": {"t": token},
                                                                 "roles": [], "users": ["nobody-here"]})
            assert unknown.status_code == 404 and "nobody-here" in unknown.text, unknown.text
            none = await admin.post("/api/credentials", json={"name": "grant_named", "data": {"t": token}, "roles": []})
            assert none.status_code == 400, none.text  # nobody at all could use it
            stored = await admin.post("/api/credentials", json={"name": "grant_named", "data": {"t": token},
                                                                "roles": [], "users": ["cred-alice"]})
            assert stored.status_code == 201, stored.text
            assert stored.json()["roles"] == [] and [u["username"] for u in stored.json()["users"]] == ["cred-alice"]

            async def run(user: str | None, **body: Any) -> tuple[dict, list[dict]]:
                return await run_as(grants, user, NAMED, **body)

            def refusal(status: dict, events: list[dict]) -> str:
                return refused_without(token, status, events)

            status, _ = await run(alice)
            assert status["status"] == "COMPLETED" and status["steps"]["start"]["result"] == {"t": "***"}, status
            why = refusal(*await run(bob))
            assert "started and written by the users cred-alice (its users, D24" in why and \
                   "started by cred-bob, who has developer" in why, why
            assert "started by" in refusal(*await run(None))  # the admin: not named, and the credential has no role

            async with grants.client(token=alice) as client:  # alice's playbook in the catalog, started by bob
                await client.register(NAMED)
            why = refusal(*await run(bob, path="tests/grants/named"))
            assert "started by cred-bob" in why, why
            status, _ = await run(alice, path="tests/grants/named")
            assert status["status"] == "COMPLETED", status

            again = await admin.post("/api/credentials", json={"name": "grant_named", "data": {"t": token + "2"}})
            assert [u["username"] for u in again.json()["users"]] == ["cred-alice"], again.text
            # its roles none: clearing its users would leave it to nobody (refused, unchanged)
            nobody = await admin.post("/api/credentials", json={"name": "grant_named", "data": {"t": token}, "users": []})
            assert nobody.status_code == 400 and "nobody could use" in nobody.text, nobody.text
            kept = await admin.post("/api/credentials/grant_named/roles", json={"roles": []})  # users kept
            assert kept.status_code == 200 and len(kept.json()["users"]) == 1, kept.text
            opened = await admin.post("/api/credentials/grant_named/roles", json={"roles": ["admin"]})
            assert opened.json()["roles"] == ["admin"] and len(opened.json()["users"]) == 1, opened.text  # users kept
            assert (await run(None))[0]["status"] == "COMPLETED"
            cleared = await admin.post("/api/credentials/grant_named/roles", json={"roles": ["admin"], "users": []})
            assert cleared.json()["users"] == [], cleared.text
            assert "started by cred-alice" in refusal(*await run(alice))
            records = [r for r in await audit(grants, "credential.roles") if r["target"]["credential"] == "grant_named"]
            assert max(records, key=lambda r: r["at"])["details"] == {"roles": ["admin"], "users": []}, records

    grants.run(main(), 180)
