"""The limits table: one home, every limit documented, clear messages."""
import re
from pathlib import Path

import pytest

from noetl_mesh import limits

DOC = (Path(__file__).parents[2] / "docs" / "limits.md").read_text()


@pytest.mark.parametrize("limit", limits.LIMITS, ids=lambda l: l.name)
def test_every_limit_is_documented_with_its_variable(limit):
    row = next((line for line in DOC.splitlines() if line.startswith(f"| `{limit.name}` ")), None)
    assert row is not None, f"docs/limits.md has no row for {limit.name}"
    assert f"`{limit.env}`" in row


def test_environment_overrides_and_rejects_nonsense():
    got = limits.from_environment({"NOETL_LIMIT_MAX_BODY_BYTES": "1234"})
    assert got.max_body_bytes == 1234
    assert got.max_steps == 1_000
    with pytest.raises(ValueError, match="NOETL_LIMIT_MAX_STEPS"):
        limits.from_environment({"NOETL_LIMIT_MAX_STEPS": "many"})
    with pytest.raises(ValueError, match="positive"):
        limits.from_environment({"NOETL_LIMIT_MAX_STEPS": "0"})


def test_message_names_the_limit_where_and_how_to_change_it():
    with limits.override(max_body_bytes=1024):
        exc = limits.LimitExceeded("max_body_bytes", 4096, where="POST /api/executions")
    msg = str(exc)
    assert msg.startswith("POST /api/executions: the request body is 4 KiB")
    assert "max_body_bytes = 1 KiB" in msg and "NOETL_LIMIT_MAX_BODY_BYTES" in msg


def test_override_is_scoped_and_checks_names():
    before = limits.current().max_steps
    with limits.override(max_steps=3):
        assert limits.current().max_steps == 3
    assert limits.current().max_steps == before
    with pytest.raises(AttributeError):
        with limits.override(no_such_limit=1):
            pass
