"""The executions list (GET /api/executions: the recorder's ``execution_list``) on a table of N
executions, embedded Postgres: ms per page of 5, newest first, unfiltered and by status, and the plan.

    python bench/bench_executions_list.py [N]     # default 100,000
"""
from __future__ import annotations

import asyncio
import sys
import time

import psycopg

from noetl_mesh.infra.embedded import provision_postgres
from noetl_mesh.services.event_recorder import schema, service


async def main(n: int) -> None:
    pg = provision_postgres(fast=True)
    try:
        dsn = pg.create_database("bench_list")
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await schema.migrate(conn)
            await conn.execute(
                "INSERT INTO execution (execution_id, path, status, created_at, requested_by)"
                " SELECT md5(g::text), 'p/x', CASE WHEN g %% 3 = 0 THEN 'COMPLETED' ELSE 'FAILED' END,"
                " now() - g * interval '1 second', 'u' || (g %% 5) FROM generate_series(1, %s) g", (n,))
            await conn.execute("ANALYZE execution")
        before = ("DROP INDEX execution_listed, execution_listed_status, execution_listed_user, execution_listed_path;"
                  " CREATE INDEX execution_created ON execution (created_at DESC);"
                  " CREATE INDEX execution_status_created ON execution (status, created_at DESC); ANALYZE execution")
        for indexes in ("in the list's order (migration 8)", "created_at DESC (before migration 8)"):
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                if indexes.startswith("created_at"):
                    await conn.execute(before)
                for label, where in (("unfiltered", ""), ("status FAILED", "WHERE status = 'FAILED'")):
                    q = (f"SELECT {', '.join(service._EXECUTION_COLUMNS)}, ({service._STARTER_NAME}) FROM execution"
                         f" {where} ORDER BY created_at DESC NULLS LAST, execution_id OFFSET 0 LIMIT 5")
                    t = time.perf_counter()
                    for _ in range(20):
                        await (await conn.execute(q)).fetchall()
                    ms = (time.perf_counter() - t) / 20 * 1000
                    plan = [r[0] for r in await (await conn.execute("EXPLAIN " + q)).fetchall()]
                    top = next(line.strip() for line in plan[1:] if line.strip().startswith("->"))
                    print(f"{n:,} executions, indexes {indexes}, {label}: {ms:.2f} ms per page; {top[3:].split('  (')[0]}")
    finally:
        pg.stop()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 100_000))
