"""pytest imports test modules by their base name (no packages): two test files of one name, one in
tests/unit and one in tests/integration, stop the whole run at collection."""
from pathlib import Path


def test_test_module_names_are_unique():
    tests = Path(__file__).parents[1]
    names = [p.name for p in tests.glob("*/test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []
