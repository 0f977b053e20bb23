"""The AsyncAPI document (``noetl asyncapi``, the gateway's /asyncapi.json): valid AsyncAPI 3.0, every
subject the code uses listed in it, and the messages the engine really sends valid against its
schemas. The AsyncAPI 3.0.0 JSON Schema is vendored from the ``@asyncapi/specs`` package (6.11.1,
Apache-2.0: tests/data/NOTICE) because no PyPI package ships it."""
from __future__ import annotations

import ast
import asyncio
import copy
import io
import json
import re
from contextlib import redirect_stdout
from pathlib import Path

import httpx
import jsonschema
import pytest

from noetl_mesh.cli import main
from noetl_mesh.contracts import messages, subjects
from noetl_mesh.contracts.asyncapi import document
from noetl_mesh.core.local import run_local
from noetl_mesh.infra import nats_auth

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "tests" / "data" / "asyncapi-3.0.0.schema.json").read_text())


@pytest.fixture(scope="module")
def doc() -> dict:
    return document()


def test_the_document_is_valid_asyncapi_3(doc):
    validator = jsonschema.Draft7Validator(SCHEMA)
    assert [e.message for e in validator.iter_errors(doc)] == []
    broken = copy.deepcopy(doc)  # the schema is strict enough to notice a mistake of ours
    broken["operations"]["commands.send"]["action"] = "publish"  # AsyncAPI 2's word
    assert list(validator.iter_errors(broken))


def test_every_reference_resolves(doc):
    def refs(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "$ref":
                    yield v
                else:
                    yield from refs(v)
        elif isinstance(node, list):
            for v in node:
                yield from refs(v)

    found = set(refs(doc))
    assert "#/components/schemas/Event" in found and "#/components/messages/Command" in found
    for ref in found:
        node = doc
        for part in ref.removeprefix("#/").split("/"):
            assert part in node, f"{ref}: no {part!r}"
            node = node[part]


def test_every_stream_bucket_and_store_is_described(doc):
    names = {s["name"] for s in doc["x-noetl-streams"]}
    assert set(nats_auth.ALL_STREAMS) <= names  # every stream the services' permissions name
    channels = {c["address"] for c in doc["channels"].values() if c["address"]}
    assert {"$KV.noetl_members.{service}.{replica}", "$O.noetl_payloads.{part}.{id}",
            "noetl.evt.{writer}.{class}.{execution_id}", "noetl.cmd.{pool}.{execution_id}.{lane}"} <= channels
    requests = [c for c in subjects.CHANNELS if c.kind == "request"]
    by_queue = {q: sum(1 for c in requests if c.queue == q)
                for q in ("event-recorder", "credentials", "sessions", "scheduler", None)}
    assert by_queue == {"event-recorder": 14, "credentials": 6, "sessions": 18, "scheduler": 6,
                        None: 9}  # None: $SRV discovery
    for c in requests:  # each request has its reply channel: the answer and the error
        assert set(doc["channels"][f"{c.id}-reply"]["messages"]) == {c.reply, "ErrorReply"}


# ------------------------------------------------------------------------------ subjects in the code
SUBJECT = re.compile(r"^(noetl|\$KV|\$O|\$JS\.EVENT|\$SRV)\.[A-Za-z0-9_.*>\-\x00]*$")


def _literals(path: Path):
    """Subject-like string literals of a module: plain strings, and f-strings with each interpolation
    as one ``*`` token; a prefix ending in ``.`` (``"noetl.q.schedule." + verb``) as ``prefix.>``.
    Logger names (``getLogger("noetl.x")``) are not subjects."""
    tree = ast.parse(path.read_text(), str(path))
    loggers = {id(n.args[0]) for n in ast.walk(tree) if isinstance(n, ast.Call) and n.args
               and getattr(n.func, "attr", getattr(n.func, "id", None)) == "getLogger"}
    inner = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    for node in ast.walk(tree):
        if id(node) in loggers or id(node) in inner:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        elif isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "\x00" for v in node.values)
        else:
            continue
        if not SUBJECT.match(text) or " " in text:
            continue
        text = re.sub(r"[^.]*\x00[^.]*", "*", text)
        yield node.lineno, text + (">" if text.endswith(".") else "")


def _code_subjects() -> list[tuple[str, str]]:
    out = []
    for base in ("libs/noetl_mesh", "services"):
        for path in sorted((ROOT / base).rglob("*.py")):
            for line, text in _literals(path):
                out.append((f"{path.relative_to(ROOT)}:{line}", text))
    return out


# names that look like subjects but are not (span attributes, KV keys, token-id domain)
NOT_SUBJECTS = re.compile(r"^noetl\.(execution_id|parent_execution_id|step|step_run_id|iteration|task|attempt|"
                          r"tool\.kind|status|pool|event|service|path|schedule_id|policy\.([a-z]+|\*)|token-id|sessions\.\*"
                          r"|sessions\.user\.\*\.\*|sessions\.user\.\*\.>)$")


def test_every_subject_the_code_uses_is_listed():
    used = [(where, s) for where, s in _code_subjects() if not NOT_SUBJECTS.match(s)]
    assert len(used) > 40  # the scan sees the code's subjects
    assert ("libs/noetl_mesh/contracts/subjects.py" in {w.split(":")[0] for w, _ in used})
    unlisted = [(where, s) for where, s in used if not subjects.listed(s)]
    assert unlisted == []


def test_a_subject_not_listed_is_caught(tmp_path):
    module = tmp_path / "x.py"
    module.write_text('import logging\nlog = logging.getLogger("noetl.bus")\n'
                      'A = "noetl.q.catalog.get"\nB = f"noetl.reports.{kind}.{eid}"\nC = "noetl.q.reports." + v\n')
    found = [s for _, s in _literals(module)]
    assert found == ["noetl.q.catalog.get", "noetl.reports.*.*", "noetl.q.reports.>"]
    assert [subjects.listed(s) for s in found] == [True, False, False]


def test_every_permission_names_a_listed_subject():
    for user in ("gateway", "admission", "router", "loop-coordinator", "event-recorder", "sessions", "scheduler",
                 "worker-default"):
        perms = nats_auth.permissions(user, partitions=2, inbox="_INBOX.X")
        for direction in ("publish", "subscribe"):
            for s in perms[direction]["allow"]:
                if SUBJECT.match(s) and not s.startswith("$JS.API"):
                    assert subjects.listed(s), (user, direction, s)


def test_the_subject_helpers_fill_their_channels():
    by_id = {c.id: subjects.pattern(c.address) for c in subjects.CHANNELS}

    def matches(subject: str, channel: str) -> bool:
        return subjects.overlaps(subject, by_id[channel]) and "*" not in subject

    assert matches(subjects.command_subject("p", "e1", 3), "commands")
    assert subjects.overlaps(subjects.command_subject("p", "e1", 3), subjects.lane_filter("p", 3))
    assert not subjects.overlaps(subjects.command_subject("p", "e1", 3), subjects.lane_filter("p", 4))
    # the consumer of earlier versions' subjects reads no lane
    assert not subjects.overlaps(subjects.command_subject("p", "e1", 3), subjects.pool_filter("p"))
    assert matches(subjects.cancel_subject("e1"), "cancel")
    assert matches(subjects.timer_subject("e1", "t1"), "timers")
    assert matches(subjects.timer_target("e1"), "events")
    assert matches(subjects.batch_subject_of("worker", "ctl", "e1"), "events")
    assert matches(subjects.stored_subject(3, "ctl", "e1", "router"), "events-stored")
    assert matches(subjects.audit_subject("user.added", "-"), "audit")
    assert matches(subjects.schedule_fire_subject("s1"), "schedule-fire")
    assert not subjects.overlaps("noetl.cmd.p.e1", by_id["cancel"])


def test_a_command_waits_in_the_lane_of_whoever_started_its_execution():
    alice = {"execution_id": "e1", "requested_by": {"user_id": "u-alice", "roles": ["developer"]}}
    lane = subjects.lane_of(alice)
    assert 0 <= lane < subjects.LANES
    # every execution alice starts, and its children (which carry her as their root's starter), share it
    assert subjects.lane_of({**alice, "execution_id": "e2"}) == lane
    # users spread over the lanes; an execution no user started (noetl run) goes by its own id
    assert len({subjects.lane_of({"requested_by": {"user_id": f"u{i}"}}) for i in range(200)}) == subjects.LANES
    assert len({subjects.lane_of({"execution_id": f"e{i}"}) for i in range(200)}) == subjects.LANES
    for odd in (None, "x", {"user_id": 7}, {"user_id": ""}):
        assert subjects.lane_of({"execution_id": "e1", "requested_by": odd}) == subjects.lane_of({"execution_id": "e1"})


# ------------------------------------------------------------------------------ real messages
CHILD = {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "c", "path": "t/child"},
         "workflow": [{"step": "start", "tool": {"kind": "noop", "result": "{{ args.n }}"}}]}
PARENT = {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "p", "path": "t/parent"},
          "workload": {"items": [1, 2, 3, 4]},
          "workflow": [
              {"step": "start", "tool": {"kind": "playbook", "path": "t/child", "args": {"n": 1}},
               "next": {"arcs": [{"step": "each"}]}},
              {"step": "each", "loop": {"in": "{{ workload.items }}", "iterator": "i",
                                        "spec": {"mode": "parallel", "max_in_flight": 16}},
               "tool": [{"name": "t", "kind": "python", "code": "raise ValueError('x')",
                         "spec": {"policy": {"rules": [{"when": "{{ outcome.status == 'error' }}",
                                                        "then": {"do": "retry", "attempts": 2, "delay": 0}}]}}}]}]}


def test_the_engines_messages_fit_their_schemas(doc, monkeypatch):
    import noetl_mesh.core.local as local

    sent = []  # every command the in-process engine hands its workers
    real = local.execute_command

    async def record(command, *args, **kw):
        sent.append(command)
        return await real(command, *args, **kw)

    monkeypatch.setattr(local, "execute_command", record)
    run = asyncio.run(run_local(PARENT, catalog={"t/child": CHILD}, sleep=lambda _: asyncio.sleep(0)))
    assert len(run.executions) == 2 and len(sent) >= 3
    assert any(c.get("chunk") for c in sent) and any(c.get("resume") for c in sent)
    for message in run.messages:
        messages.EventsMessage.model_validate(message)
    for command in sent:
        messages.Command.model_validate(command)
    # and against the document's JSON Schemas themselves (what a non-Python client would check)
    schemas = doc["components"]["schemas"]

    def check(name: str, value) -> None:
        schema = {**schemas[name], "components": {"schemas": schemas}}
        jsonschema.Draft202012Validator(schema).validate(json.loads(json.dumps(value, default=str)))

    names = set()
    for message in run.messages:
        check("EventsMessage", message)
        names |= {e["name"] for e in message}
    for command in sent:
        check("Command", command)
    assert {"playbook.execution.requested", "task.suspended", "playbook.child.finished", "loop.iteration.failed",
            "workflow.finished"} <= names
    with pytest.raises(jsonschema.ValidationError):
        check("Command", {**sent[0], "surprise": 1})  # the contract is exact
    with pytest.raises(jsonschema.ValidationError):
        check("EventsMessage", [{**run.messages[0][0], "name": "step.exploded"}])


def test_the_command_line_and_the_gateway_give_the_document(doc):
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["asyncapi"]) == 0
    printed = json.loads(out.getvalue())
    assert printed["channels"] == doc["channels"] and printed["asyncapi"] == "3.0.0"

    from noetl_mesh.services.gateway.app import create_app

    class NoBus:
        """create_app touches no bus while it builds the routes."""

    async def get():
        transport = httpx.ASGITransport(app=create_app(NoBus()))  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            return await client.get("/asyncapi.json")  # public, like /docs: no token

    served = asyncio.run(get())
    assert served.status_code == 200 and served.json()["operations"] == doc["operations"]
