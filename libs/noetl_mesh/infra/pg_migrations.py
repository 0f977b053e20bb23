"""Schema migrations in Postgres, one runner for every service that owns tables (the event-recorder,
the credentials service): numbered DDL applied once each, in order, in one transaction, under an
advisory lock so that replicas starting together apply them once; each service keeps its own version
table."""
from __future__ import annotations

from collections.abc import Sequence

from psycopg import AsyncConnection, sql


async def apply(conn: AsyncConnection, migrations: Sequence[tuple[int, str, str]], *, table: str, lock: int) -> int:
    """Apply the ``(version, description, ddl)`` not yet in ``table``; returns the version now in place."""
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock,))
        await conn.execute(sql.SQL("""CREATE TABLE IF NOT EXISTS {} (
            version int PRIMARY KEY, description text, applied_at timestamptz NOT NULL DEFAULT now())""").format(
            sql.Identifier(table)))
        cur = await conn.execute(sql.SQL("SELECT coalesce(max(version), 0) FROM {}").format(sql.Identifier(table)))
        current = (await cur.fetchone())[0]
        for version, description, ddl in migrations:
            if version > current:
                await conn.execute(ddl)
                await conn.execute(sql.SQL("INSERT INTO {} (version, description) VALUES (%s, %s)").format(
                    sql.Identifier(table)), (version, description))
                current = version
    return current
