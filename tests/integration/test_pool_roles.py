"""A worker pool that names the roles it serves (``NOETL_POOL_ROLES``, D33) runs only the commands of
executions started by a user with one of them (a child execution: by whoever started its root), on a
whole stack with real NATS and Postgres: another's commands fail with ``forbidden`` before any task runs."""
from __future__ import annotations

import asyncio
from typing import Any, Iterator

import pytest
import yaml

from conftest import StackHandle, new_user, stack_with_worker
from noetl_mesh.client import GatewayClient, GatewayError

pytestmark = pytest.mark.integration

PASSWORD = "pool roles pw 1"

ON_VAULT = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: on-vault, path: tests/pools/on-vault}
workflow:
  - step: start
    spec: {pool: vault}
    tool: {kind: noop, result: ran on vault}
"""

PARENT = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: parent, path: tests/pools/parent}
workflow:
  - step: start
    tool: {kind: playbook, path: tests/pools/on-vault}
"""


@pytest.fixture(scope="module")
def stack(module_pg) -> Iterator[StackHandle]:
    with stack_with_worker(module_pg, "vault", roles="admin,operator") as handle:
        yield handle


@pytest.fixture(scope="module")
def tokens(stack) -> dict[str, str]:
    """An API token of the admin, of a developer, and of a developer who is also an operator."""
    async def make() -> dict[str, str]:
        out = {"admin": stack.token}
        async with stack.client() as admin:
            await admin.register(ON_VAULT)
            for name, roles in (("dev", ["developer"]), ("vaulter", ["developer", "operator"])):
                await admin.add_user(name, roles, password=PASSWORD)
                async with GatewayClient(stack.url, token="") as c:
                    c.use(None)
                    await c.login(name, PASSWORD)
                    out[name] = (await c.create_token("pool roles"))["token"]
        return out

    return stack.run(make())


def run_as(stack, token: str, playbook: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    async def go():
        async with stack.client(token=token) as client:
            eid = await client.start(yaml.safe_load(playbook))
            status = await client.wait(eid, timeout=60)
            return status, await client.all_events(eid)

    return stack.run(go(), 90)


def forbidden(events: list[dict[str, Any]]) -> str:
    """The message of the step run's failure, which must be ``forbidden``."""
    error = next(e for e in events if e["name"] == "step.failed")["data"]["error"]
    assert error["kind"] == "forbidden", error
    return error["message"]


@pytest.mark.parametrize("who", ["admin", "vaulter"])
def test_a_user_with_one_of_the_pools_roles_runs_on_it(stack, tokens, who: str) -> None:
    status, _ = run_as(stack, tokens[who], ON_VAULT)
    assert status["status"] == "COMPLETED", status
    assert status["steps"]["start"]["result"] == "ran on vault"


def test_another_users_step_fails_forbidden_before_any_task_runs(stack, tokens) -> None:
    status, events = run_as(stack, tokens["dev"], ON_VAULT)
    assert status["status"] == "FAILED", status
    failed = next(e for e in events if e["name"] == "step.failed")
    error = failed["data"]["error"]
    assert error["kind"] == "forbidden" and error["retryable"] is False
    assert "pool 'vault' runs only playbooks started and written by users with the role admin or operator" in error["message"]
    assert "this one was started by dev, who has developer" in error["message"]
    assert not [e for e in events if e["name"] == "task.started"]  # nothing of the user's ran


def test_a_child_on_the_pool_is_checked_against_whoever_started_its_root(stack, tokens) -> None:
    """The developer's own execution runs on the default pool; the child it starts from the catalog
    (registered by the admin) is still the developer's, and the vault pool refuses it."""
    status, events = run_as(stack, tokens["dev"], PARENT)
    assert status["status"] == "FAILED", status
    outcome = next(e for e in events if e["name"] == "task.processed")["data"]["outcome"]
    assert outcome["error"]["kind"] == "child_failed", outcome
    assert outcome["error"]["cause"]["kind"] == "forbidden", outcome
    ok, _ = run_as(stack, tokens["vaulter"], PARENT)
    assert ok["status"] == "COMPLETED", ok


def test_a_developer_cannot_register_a_version_of_an_admins_path(stack, tokens) -> None:
    """A path is its first version's registrant's: a developer cannot put code of theirs behind a path an
    admin's playbook or schedule calls without pinning a version (it would run with the admin as its
    starter, and call the admin's own playbooks with arguments of its choosing)."""
    async def register_as(who: str, content: str) -> dict:
        async with stack.client(token=tokens[who]) as client:
            return await client.register(content)

    own = ON_VAULT.replace("tests/pools/on-vault", "tests/pools/shared").replace("ran on vault", "the admin's")
    stack.run(register_as("admin", own))
    with pytest.raises(GatewayError) as refused:
        stack.run(register_as("dev", own.replace("the admin's", "the developer's")))
    assert refused.value.status == 403
    assert "catalog path 'tests/pools/shared' is admin's (who registered its first version)" in refused.value.message
    assert stack.run(register_as("admin", own))["version"] == 2  # its owner may
    vaulter = stack.run(register_as("vaulter", own.replace("shared", "vaulters")))
    assert stack.run(register_as("admin", own.replace("shared", "vaulters")))["version"] == vaulter["version"] + 1


def test_an_admins_call_of_a_developers_path_is_refused_on_the_pool(stack, tokens) -> None:
    """The author of the code is checked as well as the starter: an admin's playbook calling a path a
    developer owns does not get the developer's code run with the admin's standing on the pool."""
    async def register_as(who: str, content: str) -> dict:
        async with stack.client(token=tokens[who]) as client:
            return await client.register(content)

    stack.run(register_as("dev", ON_VAULT.replace("tests/pools/on-vault", "tests/pools/devs")))
    status, events = run_as(stack, tokens["admin"], PARENT.replace("tests/pools/on-vault", "tests/pools/devs"))
    assert status["status"] == "FAILED", status
    outcome = next(e for e in events if e["name"] == "task.processed")["data"]["outcome"]
    assert outcome["error"]["cause"]["kind"] == "forbidden", outcome
    assert "this one was written by dev, who has developer" in outcome["error"]["cause"]["message"]


def test_starting_a_developers_version_by_path_or_id_keeps_its_author(stack, tokens) -> None:
    """The gateway resolves a catalog start itself: the request names the version's registrant as its
    author, not the admin who starts it."""
    async def go() -> list[tuple[dict, list]]:
        async with stack.client(token=tokens["dev"]) as dev:
            entry = await dev.register(ON_VAULT.replace("tests/pools/on-vault", "tests/pools/direct"))
        out = []
        async with stack.client(token=tokens["admin"]) as admin:
            for ref in ({"path": "tests/pools/direct"}, {"catalog_id": entry["id"]}):
                eid = await admin.start(**ref)
                out.append((await admin.wait(eid, timeout=60), await admin.all_events(eid)))
        return out

    for status, events in stack.run(go(), 150):
        assert status["status"] == "FAILED", status
        assert "this one was written by dev, who has developer" in forbidden(events)


def test_a_restart_keeps_the_author_of_what_it_runs_again(stack, tokens) -> None:
    """An admin restarting a developer's execution runs the developer's playbook again: its author is
    still the developer."""
    two = ON_VAULT.replace("""  - step: start
    spec: {pool: vault}""", """  - step: start
    tool: {kind: noop}
    next: {arcs: [{step: mid}]}
  - step: mid
    tool: {kind: noop}
    next: {arcs: [{step: onvault}]}
  - step: onvault
    spec: {pool: vault}""")
    status, _ = run_as(stack, tokens["dev"], two)
    assert status["status"] == "FAILED", status

    async def restart() -> tuple[dict, list]:
        async with stack.client(token=tokens["admin"]) as admin:
            resp = await admin.http.post(f"/api/executions/{status['execution_id']}/restart", json={"from_step": "mid"})
            assert resp.status_code == 202, resp.text
            eid = resp.json()["execution_id"]
            return await admin.wait(eid, timeout=60), await admin.all_events(eid)

    again, events = stack.run(restart(), 90)
    assert again["status"] == "FAILED", again
    assert "this one was written by dev" in forbidden(events)


def test_a_token_with_fewer_roles_than_its_owner_gets_no_more_on_a_pool(stack, tokens) -> None:
    """An admin's API token narrowed to ``developer`` is a developer's on the pool: the roles the
    request carried count, not all its owner holds."""
    async def narrowed() -> str:
        async with stack.client() as admin:
            return (await admin.create_token("ci", roles=["developer"]))["token"]

    status, events = run_as(stack, stack.run(narrowed()), ON_VAULT)
    assert status["status"] == "FAILED", status
    assert "who holds admin now and whose request carried developer" in forbidden(events)
    assert not [e for e in events if e["name"] == "task.started"]


WAITS = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: waits, path: tests/pools/waits}
workflow:
  - step: start
    tool: {kind: wait, duration: 5s}
    next: {arcs: [{step: after}]}
  - step: after
    tool: {kind: noop, result: ran}
"""


def disabled_meanwhile(stack, monkeypatch, name: str, playbook: str, seen: str) -> tuple[dict, list[dict]]:
    """A new developer ``name`` starts ``playbook``; once its log has ``seen``, the admin disables
    them. The execution's end and its events (workers check users every 0.2 s, not 10)."""
    from noetl_mesh.services.worker import service as worker

    monkeypatch.setattr(worker, "STANDING_TTL", 0.2)  # the standing the worker keeps, how often it looks again

    async def go():
        token = await new_user(stack, name, ["developer"])
        async with stack.client() as admin:
            async with stack.client(token=token) as user:
                eid = await user.start(yaml.safe_load(playbook))
                for _ in range(600):
                    try:
                        if any(e["name"] == seen for e in await admin.all_events(eid)):
                            break
                    except GatewayError as exc:  # not recorded yet
                        if exc.status != 404:
                            raise
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError(f"{seen} never came")
            await admin.disable_user(name)
            return await admin.wait(eid, timeout=60), await admin.all_events(eid)

    return stack.run(go(), 90)


def test_a_disabled_users_execution_runs_no_further_task_on_any_pool(stack, monkeypatch) -> None:
    """Disabled while its execution waits, on the default pool (which names no roles): the next step's
    command is refused, and the execution fails saying why."""
    status, events = disabled_meanwhile(stack, monkeypatch, "leaver", WAITS, "wait.started")
    assert status["status"] == "FAILED", status
    assert "started by leaver, who is disabled or removed: it runs no further task" in forbidden(events)
    assert not [e for e in events if e["name"] == "step.started" and e["step"] == "after"]


SLEEPS = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: sleeps, path: tests/pools/sleeps}
workflow:
  - step: start
    tool:
      kind: python
      code: |
        import time
        def main():
            time.sleep(120)
            return "woke"
    next: {arcs: [{step: after}]}
  - step: after
    tool: {kind: noop, result: ran}
"""


def test_a_task_running_when_its_user_is_disabled_is_stopped(stack, monkeypatch) -> None:
    """Disabled while its task runs (a python task that would sleep 120 s): the worker, checking the
    users of its running commands again, stops it; the run fails forbidden, saying so."""
    status, events = disabled_meanwhile(stack, monkeypatch, "sleeper", SLEEPS, "task.started")
    assert status["status"] == "FAILED", status  # within 60 s: the task alone would take 120
    message = forbidden(events)
    assert "started by sleeper, who is disabled or removed" in message and "stopped while it ran" in message
    assert not [e for e in events if e["name"] == "step.started" and e["step"] == "after"]
    assert not [e for e in events if e["name"] == "task.processed"]  # it never woke


BIG_LOOP = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: big-loop, path: tests/pools/big-loop}
workload: {items: []}
workflow:
  - step: start
    spec: {pool: vault}
    loop: {in: "{{ workload.items }}", iterator: it, spec: {mode: parallel, max_in_flight: 256}}
    tool: {kind: noop, result: "{{ iter.index }}"}
"""


def test_a_refused_chunk_of_iterations_sent_by_reference_fails_each_iteration(stack, tokens) -> None:
    """32 iterations of 10 KB each go in one chunk, over max_payload_bytes: the command carries the
    chunk by reference (D23). Refused, each of its iterations fails forbidden (before, the worker gave
    up on a chunk it had not read, and the loop stayed RUNNING)."""
    async def go():
        async with stack.client(token=tokens["dev"]) as dev:
            eid = await dev.start(yaml.safe_load(BIG_LOOP), {"items": ["x" * 10_000] * 32})
            return await dev.wait(eid, timeout=60), await dev.all_events(eid)

    status, events = stack.run(go(), 90)
    assert status["status"] == "FAILED", status
    failed = [e for e in events if e["name"] == "loop.iteration.failed"]
    assert failed and all(e["data"]["error"]["kind"] == "forbidden" for e in failed), failed[:1]
    assert not [e for e in events if e["name"] == "task.started"]


def test_a_playbook_above_a_child_is_checked_as_its_author_is(stack, tokens) -> None:
    """An admin's playbook calls a developer's, which calls the admin's own playbook on the pool, with
    arguments of the developer's choosing: starter and author of that last child are the admin, but a
    playbook above it was written by the developer, and the pool refuses it."""
    dev_caller = PARENT.replace("name: parent", "name: dev-caller").replace("tests/pools/parent", "tests/pools/dev-caller")
    admin_top = PARENT.replace("name: parent", "name: admin-top").replace("tests/pools/parent", "tests/pools/admin-top") \
        .replace("path: tests/pools/on-vault", "path: tests/pools/dev-caller")

    async def register() -> None:
        async with stack.client(token=tokens["dev"]) as dev:
            await dev.register(dev_caller)
        async with stack.client() as admin:
            await admin.register(admin_top)

    stack.run(register())
    status, events = run_as(stack, tokens["admin"], admin_top)
    assert status["status"] == "FAILED", status
    cause = next(e for e in events if e["name"] == "task.processed")["data"]["outcome"]["error"]["cause"]
    assert cause["kind"] == "child_failed" and cause["cause"]["kind"] == "forbidden", cause
    assert "this one was called by a playbook written by dev, who has developer" in cause["cause"]["message"]


def test_a_version_registered_with_a_narrowed_token_counts_with_the_tokens_roles(stack, tokens) -> None:
    """An admin's API token narrowed to developer registers a playbook: on the pool its author counts
    with the roles that registration carried, as a starter does, not with all the admin holds."""
    async def go():
        async with stack.client() as admin:
            narrowed = (await admin.create_token("ci-register", roles=["developer"]))["token"]
        async with stack.client(token=narrowed) as ci:
            await ci.register(ON_VAULT.replace("tests/pools/on-vault", "tests/pools/by-ci"))
        async with stack.client() as admin:
            eid = await admin.start(path="tests/pools/by-ci")
            return await admin.wait(eid, timeout=60), await admin.all_events(eid)

    status, events = stack.run(go(), 90)
    assert status["status"] == "FAILED", status
    assert "written by admin, who holds admin now and whose request carried developer" in forbidden(events)
