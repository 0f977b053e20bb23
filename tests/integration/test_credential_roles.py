"""Who may use a stored credential (D24), attacked: a developer's playbook that an admin runs, made
to call the admin's playbook with values big enough that its command travels partly by reference; the
refused child restarted (D32); a credential's roles taken away while an execution that used it runs.
Each got an admin-only credential before it was closed."""
from __future__ import annotations

import asyncio
import base64
import os
from typing import Any, Iterator

import httpx
import pytest

from conftest import new_user, start_stack, stop_stack

pytestmark = pytest.mark.integration

KEY = base64.b64encode(os.urandom(32)).decode()
TOKEN = "rt-admin-token-Zq91"


@pytest.fixture(scope="module")
def rt(module_pg) -> Iterator[Any]:
    old = os.environ.get("NOETL_CREDENTIAL_KEY")
    os.environ["NOETL_CREDENTIAL_KEY"] = KEY
    nats, loop, handle = start_stack(module_pg)
    try:
        with httpx.Client(base_url=handle.url, trust_env=False, headers=handle.headers) as gw:
            r = gw.post("/api/credentials", json={"name": "rt_admin", "data": {"user": "svc", "token": TOKEN}})
            assert r.status_code == 201 and r.json()["roles"] == ["admin"], r.text
        yield handle
    finally:
        stop_stack(nats, loop, handle)
        if old is None:
            os.environ.pop("NOETL_CREDENTIAL_KEY", None)
        else:
            os.environ["NOETL_CREDENTIAL_KEY"] = old


async def audit(handle: Any, action: str) -> list[dict]:
    async with httpx.AsyncClient(base_url=handle.url, trust_env=False, headers=handle.headers) as gw:
        resp = await gw.get("/api/audit", params={"action": action, "limit": 1000})
        assert resp.status_code == 200, resp.text
        return resp.json()


# ---------------------------------------------------------------------------------------------------------
# A command's users (starter, author, the authors above a child) never travel by reference (D23): the
# credentials service checks them as the command is stored.

ADMIN_P = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: rt-p, path: rt/admin/p}
keychain:
  - {name: api, kind: credential, credential: rt_admin}
workload: {rows: []}
workflow:
  - step: start
    loop: {in: "{{ workload.rows }}", iterator: row}
    tool: {name: fetched, kind: secrets, secret: api}
"""

DEV_D = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: rt-d, path: rt/dev/d}
executor: {spec: {policy: {limits: {max_depth: 40}}}}
workload: {level: 0, size: 10}
workflow:
  - step: start
    next: {arcs: [{step: deeper, when: "{{ workload.level < LEVELS }}"}, {step: bottom}]}
  - step: deeper
    tool: {name: call, kind: playbook, path: rt/dev/d,
           workload: {level: "{{ workload.level + 1 }}", size: "{{ workload.size }}"}}
  - step: bottom
    tool:
      - {name: a, kind: noop, result: "{{ 'x' * workload.size }}"}
      - {name: b, kind: noop, result: "{{ 'y' * workload.size }}"}
      - {name: call, kind: playbook, path: rt/admin/p, workload: {rows: ["{{ a.result }}"]},
         args: {pad: "{{ b.result }}"}}
"""


def test_a_big_command_and_a_restart_still_name_the_developer_above_the_admins_playbook(rt):
    """An admin runs a developer's playbook, which calls the admin's P, which reads an admin-only
    credential: refused, called by the developer, whether the command is small or so big (each of
    workload, args and iter ~256 KiB, 12 levels of authors above it) that its fields go by reference.
    The refused child restarted by the admin (D32) is still below the developer's playbook: refused."""

    async def main() -> dict:
        dev = await new_user(rt, "rt-dev", ["developer"])
        async with httpx.AsyncClient(base_url=rt.url, trust_env=False, headers=rt.headers) as admin, \
                httpx.AsyncClient(base_url=rt.url, trust_env=False,
                                  headers={"Authorization": f"Bearer {dev}"}) as developer:
            r = await admin.post("/api/catalog", json={"content": ADMIN_P})
            assert r.status_code == 201, r.text
            r = await developer.post("/api/catalog", json={"content": DEV_D.replace("LEVELS", "12")})
            assert r.status_code == 201, r.text
        out: dict[str, Any] = {}
        async with rt.client() as client:  # the admin starts the developer's playbook
            for label, size in (("small", 10), ("big", 262000)):
                eid = await client.start(path="rt/dev/d", workload={"size": size})
                out[label] = await client.wait(eid, timeout=240)
        out["resolved"] = [r for r in await audit(rt, "credential.resolved")
                           if "rt_admin" in (r.get("target") or {}).get("credentials", [])]
        refused = [r for r in await audit(rt, "credential.refused")
                   if "called by a playbook written by rt-dev" in r["details"].get("message", "")]
        out["refused"] = {r["target"]["execution_id"] for r in refused}
        child = refused[-1]["target"]["execution_id"]  # the audit lists the newest first: the small run's child
        async with httpx.AsyncClient(base_url=rt.url, trust_env=False, headers=rt.headers) as admin:
            r = await admin.post(f"/api/executions/{child}/restart", json={"from_step": "start"})
            assert r.status_code == 202, r.text
            new = r.json()["execution_id"]
        async with rt.client() as client:
            out["restart"] = await client.wait(new, timeout=60)
            out["restart_request"] = (await client.all_events(new))[0]["data"]
        return out

    out = rt.run(main(), 600)
    assert out["small"]["status"] == "FAILED" and out["big"]["status"] == "FAILED", out
    assert not out["resolved"], out["resolved"]  # the admin-only credential was never handed out
    assert len(out["refused"]) >= 2, out["refused"]  # both runs' children, refused as called by rt-dev
    assert out["restart"]["status"] == "FAILED", out["restart"]
    assert [w.get("username") for w in out["restart_request"]["called_by"]][-1] == "rt-dev"


# A worker keeps a resolved credential 10 s per execution: roles taken away reach a running execution.
CACHED = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: rt-cached, path: rt/dev/cached}
keychain:
  - {name: api, kind: credential, credential: rt_shared}
workflow:
  - step: start
    tool: {name: first, kind: secrets, secret: api}
    next: {arcs: [{step: pause}]}
  - step: pause
    tool: {kind: python, code: "import time\\ntime.sleep(12)\\nresult = 1", spec: {timeout: 60}}
    next: {arcs: [{step: again}]}
  - step: again
    tool: {name: second, kind: secrets, secret: api}
"""


def test_roles_taken_away_reach_a_running_execution(rt):
    async def main() -> dict:
        dev = await new_user(rt, "rt-dev2", ["developer"])
        async with httpx.AsyncClient(base_url=rt.url, trust_env=False, headers=rt.headers) as admin:
            r = await admin.post("/api/credentials", json={"name": "rt_shared", "roles": ["developer", "admin"],
                                                           "data": {"user": "svc", "token": "shared-tok-991"}})
            assert r.status_code == 201, r.text
            async with rt.client(token=dev) as client:
                eid = await client.start(CACHED)
                for _ in range(600):
                    if any(e["name"] == "step.done" and e.get("step") == "start"
                           for e in await client.all_events(eid)):
                        break
                    await asyncio.sleep(0.1)
                r = await admin.post("/api/credentials/rt_shared/roles", json={"roles": ["admin"]})
                assert r.status_code == 200, r.text
                return await client.wait(eid, timeout=120)

    running = rt.run(main(), 180)
    assert running["status"] == "FAILED", running  # its last step read the credential after the change
    steps = running["steps"]
    assert steps["start"]["result"] == {"user": "svc", "token": "***"}, steps  # before: granted
    assert steps["again"]["status"] == "failed", steps  # after: refused
