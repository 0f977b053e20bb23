"""The trees' counters (D19, ``max_tree_executions``) on a real NATS server: a child counted once
however often its request is evaluated, and a request evaluated again told the total now."""
from __future__ import annotations

import asyncio

import pytest

from noetl_mesh.infra.bus import Bus

pytestmark = pytest.mark.integration


def test_a_child_counts_once_and_its_second_evaluation_reads_the_total(fresh_nats):
    async def main() -> None:
        bus = await Bus.connect(fresh_nats.url, "tree-test")
        try:
            assert await bus.trees_unusable() is not None  # no stream before setup: counting is off
            await bus.setup(1)
            assert await bus.trees_unusable() is None
            assert [await bus.count_child("root1", c) for c in ("c1", "c2")] == [1, 2]
            assert await bus.count_child("root2", "c9") == 1  # another tree, its own count
            assert await bus.count_child("root1", "c3") == 3
            assert await bus.count_child("root1", "c1") == 3  # counted already: the total now, not 4
            with pytest.raises(ValueError, match="cannot name a subject"):
                await bus.count_child("root.*", "c4")
        finally:
            await bus.close()

    asyncio.run(main())
