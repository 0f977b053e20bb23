"""One output layer for the command line: what a command answers, as a table or YAML for people, or
JSON for programs. ``-o table|yaml|json`` chooses; without it, a terminal gets a table (a list) or YAML
(anything else) and a pipe gets JSON, so scripts that read a command's output keep reading JSON."""
from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO

__all__ = ["FORMATS", "emit", "table", "chosen"]

FORMATS = ("table", "yaml", "json")
_CELL = 60  # characters a table cell shows at most


def chosen(fmt: str | None, out: TextIO | None = None) -> str:
    """The format to use: the one asked for, else table/YAML on a terminal and JSON on a pipe."""
    if fmt:
        return fmt
    stream = out or sys.stdout
    return "table" if stream.isatty() else "json"


def _cell(value: Any) -> str:
    if value is None:
        return ""
    text = value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False,
                                                           separators=(",", ":"))
    text = text.replace("\n", " ")
    return text if len(text) <= _CELL else text[:_CELL - 1] + "…"


def table(rows: Sequence[dict], columns: Sequence[str] | None = None) -> str:
    """Rows as aligned columns: ``columns`` when given, else every key that holds a plain value in some
    row, in the order first seen (nested values shown as compact JSON, long ones cut)."""
    if not rows:
        return "(none)"
    if columns is None:
        seen: list[str] = []
        for row in rows:
            for key, value in row.items():
                if key not in seen and not isinstance(value, (dict, list)):
                    seen.append(key)
        columns = seen or list(rows[0])
    grid = [[c.upper() for c in columns]] + [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in grid) for i in range(len(columns))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in grid)


def emit(value: Any, fmt: str | None = None, columns: Sequence[str] | None = None, out: TextIO | None = None) -> None:
    """Print a command's answer in the chosen format (see :func:`chosen`)."""
    stream = out or sys.stdout
    kind = chosen(fmt, stream)
    if kind == "json":
        text = json.dumps(value, indent=2, default=str)
    elif kind == "table" and isinstance(value, list) and all(isinstance(v, dict) for v in value):
        text = table(value, columns)
    else:  # yaml, or a table asked of something that is not a list of records
        from .cli import _yamlish

        text = _yamlish(json.loads(json.dumps(value, default=str)))
    print(text, file=stream)
