"""Validation findings with the place in the document they belong to."""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Iterable, Literal

Path = tuple[str | int, ...]


@dataclass(frozen=True)
class Diagnostic:
    severity: Literal["error", "warning"]
    location: str  # e.g. workflow[3].step=fetch.tool[1].spec.policy
    message: str
    path: Path = ()
    line: int | None = None  # 1-based, when the document was read from text
    column: int | None = None

    def __str__(self) -> str:
        text = f"{self.severity}: {self.location or '<document>'}: {self.message}"
        if self.line is not None and not self.location.startswith("line "):
            text += f" (line {self.line}, column {self.column})"
        return text


def locate(doc: Any, path: Path) -> str:
    """Render a path into the raw document as text; a workflow step is named after its index."""
    out = ""
    node = doc
    for i, key in enumerate(path):
        out += f"[{key}]" if isinstance(key, int) else (f".{_short(key)}" if out else _short(key))
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            node = None
        if i == 1 and path[0] == "workflow" and isinstance(node, dict) and isinstance(node.get("step"), str):
            out += f".step={_short(node['step'])}"
    return out


def _short(key: Any, size: int = 60) -> str:
    text = str(key)
    return text if len(text) <= size else text[: size - 3] + "..."


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` when one candidate is close, else ``""``."""
    close = difflib.get_close_matches(str(word), sorted(set(candidates)), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""
