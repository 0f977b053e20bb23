"""The chaos run, short form (bench/chaos.py runs the long one): a mixed load while services and
workers are SIGKILLed at random, NATS restarts and Postgres is down for a while. Every execution ends,
every log passes `noetl verify`'s checks, and every outcome equals the in-process reference engine's."""
from __future__ import annotations

import asyncio

import pytest

from noetl_mesh.testing.chaos import ChaosConfig, run_chaos

pytestmark = pytest.mark.integration


def test_chaos_short(tmp_path):
    result = asyncio.run(run_chaos(ChaosConfig(executions=21, kills=5, nats_restarts=1, pg_outages=1,
                                               pg_outage_s=3.0, duration_s=12.0, seed=1), tmp_path))
    assert result.ok, result.describe()
    assert len(result.submitted) == 21 and len(result.faults) == 7
    statuses = {result.finals[x]["status"] for x in result.submitted}
    assert statuses == {"COMPLETED", "FAILED"}  # fail_fast ends FAILED, everything else COMPLETED
