"""A worker pool's name (``spec.pool``, D5) is one token of NATS subjects: the validator refuses any
other where it is named, so no command is ever addressed to a subject it cannot be published on (it
was retried for minutes, holding up its partition's other executions)."""
from __future__ import annotations

import asyncio
import copy

import pytest

from noetl_mesh.core.local import run_local
from noetl_mesh.core.state import summary
from noetl_mesh.infra.nats_auth import check_pool
from noetl_mesh.lang.validate import validate
from noetl_mesh.tools.noop import NoopTool

BASE = {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "t", "path": "tests/t"},
        "workflow": [{"step": "start", "tool": {"kind": "noop", "result": 1}, "next": {"arcs": [{"step": "l"}]}},
                     {"step": "l", "loop": {"in": [1, 2], "iterator": "i"}, "tool": {"kind": "noop"}}]}
BAD = ["a b", "default.x", "*", ">", "", "x" * 65, "pool\n", "é", 7]


def with_pool(where: str, pool) -> dict:
    doc = copy.deepcopy(BASE)
    if where == "executor":
        doc["executor"] = {"spec": {"pool": pool}}
    elif where == "step":
        doc["workflow"][0]["spec"] = {"pool": pool}
    else:
        doc["workflow"][1]["loop"]["spec"] = {"pool": pool}
    return doc


LOCATION = {"executor": "executor.spec.pool", "step": "workflow[0].step=start.spec.pool",
            "loop": "workflow[1].step=l.loop.spec.pool"}


@pytest.mark.parametrize("where", ["executor", "step", "loop"])
@pytest.mark.parametrize("pool", BAD, ids=repr)
def test_a_pool_that_is_not_one_subject_token_is_refused_where_it_is_named(where: str, pool) -> None:
    found = [(e.location, e.message) for e in validate(with_pool(where, pool)).errors]
    said = "(D5)" if isinstance(pool, str) else "valid string"
    assert any(loc == LOCATION[where] and said in msg for loc, msg in found), found
    with pytest.raises(ValueError):  # the same rule the NATS permissions are built with
        check_pool(pool)


@pytest.mark.parametrize("where", ["executor", "step", "loop"])
@pytest.mark.parametrize("pool", ["default", "gpu-2", "etl_heavy", "P" * 64])
def test_a_pool_of_letters_digits_dashes_and_underscores_is_valid(where: str, pool: str) -> None:
    assert validate(with_pool(where, pool)).errors == []
    assert check_pool(pool) == pool


@pytest.mark.parametrize("where", ["executor", "step", "loop"])
def test_a_request_naming_such_a_pool_fails_at_its_evaluation_before_any_command(where: str) -> None:
    """Admission validates every request's playbook under today's rules (a catalog entry registered
    under earlier ones included): the execution fails with the reason, no step runs."""
    result = asyncio.run(run_local(with_pool(where, "a b"), tools={"noop": NoopTool()}))
    assert summary(result.state)["status"] == "FAILED"
    evaluated = next(e for e in result.log if e["name"] == "playbook.request.evaluated")
    assert any("pool 'a b'" in error and "(D5)" in error for error in evaluated["data"]["errors"]), evaluated
    assert not [e for e in result.log if e["name"].startswith(("step.", "loop."))]
