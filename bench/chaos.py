"""The long chaos run: a mixed load on a stack of one process per service while services and workers
are SIGKILLed at random, NATS restarts and Postgres goes down; then every execution's log is checked
(`noetl verify`'s checks) and every outcome compared with the in-process reference engine.

    python bench/chaos.py                       # 200 executions, 30 kills, 2 NATS restarts, Postgres down 30 s
    python bench/chaos.py --executions 40 --kills 8 --pg-outage 5 --seed 3

Prints the faults, the figures and every finding; exits 1 when anything is wrong.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile

from noetl_mesh.testing.chaos import ChaosConfig, run_chaos


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--executions", type=int, default=200)
    p.add_argument("--kills", type=int, default=30)
    p.add_argument("--nats-restarts", type=int, default=2)
    p.add_argument("--pg-outages", type=int, default=1)
    p.add_argument("--pg-outage", type=float, default=30.0, help="seconds Postgres stays down")
    p.add_argument("--duration", type=float, default=90.0, help="seconds over which the faults are spread")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    cfg = ChaosConfig(executions=a.executions, kills=a.kills, nats_restarts=a.nats_restarts, pg_outages=a.pg_outages,
                      pg_outage_s=a.pg_outage, duration_s=a.duration, workers=a.workers, replicas=a.replicas,
                      seed=a.seed, finish_timeout_s=600)
    with tempfile.TemporaryDirectory(prefix="noetl-chaos-") as workdir:
        result = asyncio.run(run_chaos(cfg, workdir))
    print(result.describe())
    statuses: dict[str, int] = {}
    for final in result.finals.values():
        statuses[final.get("status")] = statuses.get(final.get("status"), 0) + 1
    print(f"statuses: {statuses}")
    print("OK" if result.ok else "FAILED")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
