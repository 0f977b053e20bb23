"""Catalog paths: the one rule for what names a playbook in the catalog (``metadata.path``) and what a
schedule names to start (``POST /api/schedules`` ``path``, checked by the gateway and again by the
scheduler). A path is a key, never a file name, but it travels into logs, URLs
(``/api/catalog/by-path/{path}``), subjects' payloads and the console, so it is kept to what reads
the same everywhere: segments of letters, digits, ``_``, ``-`` and ``.`` separated by single ``/``,
none empty, none starting with ``.`` (so no ``.`` or ``..`` segment and nothing hidden), no leading or
trailing ``/``, at most :data:`MAX_PATH` characters.
"""
from __future__ import annotations

import re
from typing import Any

MAX_PATH = 1024  # characters
SEGMENT = r"[A-Za-z0-9_-][A-Za-z0-9_.-]*"
CATALOG_PATH = re.compile(rf"^{SEGMENT}(?:/{SEGMENT})*\Z")
RULE = ("a catalog path is segments of letters, digits, '_', '-' and '.' separated by '/' (none empty, none "
        f"starting with '.', no '/' at either end), at most {MAX_PATH} characters, e.g. 'reports/daily'")


def path_problem(value: Any) -> str | None:
    """Why ``value`` is not a catalog path (a sentence naming the rule and what broke it), or None."""
    if not isinstance(value, str):
        return f"not a string ({type(value).__name__}): {RULE}"
    if len(value) > MAX_PATH:
        return f"{len(value)} characters: {RULE}"
    if CATALOG_PATH.match(value):
        return None
    segments = value.split("/")
    if not value:
        why = "it is empty"
    elif "" in segments:
        why = "it has an empty segment (a '/' at an end, or '//')"
    elif any(s.startswith(".") for s in segments):
        bad = next(s for s in segments if s.startswith("."))
        why = f"segment {bad[:40]!r} starts with '.'"
    else:
        char = next(c for c in value if not (c.isascii() and (c.isalnum() or c in "_-./")))
        why = f"it holds {char!r}"
    return f"{why}: {RULE}"
