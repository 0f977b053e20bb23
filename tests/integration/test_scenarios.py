"""Every scenario of tests/scenarios.py (D3-D27 of docs/dsl.md as this engine covers them) through the
in-process reference engine and through the distributed stack: both must give the prescribed outcome,
and the same one."""
from __future__ import annotations

import asyncio
import json

import pytest

from noetl_mesh.core.local import run_local
from noetl_mesh.core.state import summary
from noetl_mesh.sandbox.policy import Policy, parse_destinations
from noetl_mesh.tools import close_tools, default_tools
from scenarios import SCENARIOS

pytestmark = pytest.mark.integration
IDS = [f"{s.id}[{s.decisions}]" for s in SCENARIOS]


def workload_of(scenario, api):
    return json.loads(json.dumps(scenario.workload).replace("API", api.url))


def comparable(s):
    return {k: s[k] for k in ("status", "ctx", "steps", "workload")}


@pytest.fixture(scope="module")
def allow_net(fixture_api) -> str:
    """The scenarios' tasks call the fixture API: the stack's workers may reach it, nothing more (D33)."""
    return fixture_api.endpoint


async def _local(doc, workload, allow_net):
    tools = default_tools(policy=Policy(allow=parse_destinations(allow_net)))  # the same for the reference
    try:
        return await run_local(doc, workload=workload, tools=tools)
    finally:
        await close_tools(tools)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=IDS)
def test_scenario_local_engine(scenario, fixture_api, allow_net):
    run = asyncio.run(_local(scenario.doc(fixture_api.url), workload_of(scenario, fixture_api), allow_net))
    scenario.expect(summary(run.state), run.log)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=IDS)
def test_scenario_through_gateway(scenario, stack, fixture_api, allow_net):
    status, events = stack.execute(scenario.doc(fixture_api.url), workload_of(scenario, fixture_api))
    scenario.expect(status, events)
    reference = asyncio.run(_local(scenario.doc(fixture_api.url), workload_of(scenario, fixture_api), allow_net))
    expected = comparable(summary(reference.state))
    got = comparable(status)
    if scenario.id not in ("namespaces",):  # execution ids differ by design
        assert got == expected
    assert sorted(e["name"] for e in events) == sorted(e["name"] for e in reference.log)
