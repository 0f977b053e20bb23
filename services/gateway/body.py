"""Strict, bounded reading of JSON request bodies (pure: no I/O).

:func:`parse_json` turns the raw bytes of a body into a value, or raises :class:`BodyError` with the
HTTP status, a message that says what is wrong, and the location in the body (``body.workload.a[3]``):

- bytes that are not UTF-8 → 400 (with the byte offset); malformed JSON → 400 (line, column);
- nesting deeper than ``max_json_depth`` → 422 (the limit and its variable named);
- more than ``max_body_values`` values (lists, mappings, strings, numbers, ...) → 413, counted on the
  bytes before anything is built: a 16 MiB body of empty lists would take about 350 MB of objects;
- integers outside the signed 64-bit range, ``NaN``, ``Infinity`` or a number that overflows a double
  → 422: JSON has no such numbers, and the event log (orjson, Postgres ``jsonb``) cannot hold them as
  sent;
- a NUL character (``\\u0000``) or an unpaired UTF-16 surrogate (``\\ud800``) in a string or a key → 422.
  They are refused, not stripped: Postgres text and ``jsonb`` cannot store NUL, a surrogate is not a
  character and cannot be encoded as UTF-8, and silently changing a value (an identifier, a
  workload key) would run something other than what was sent;
- an object shaped like a payload reference (D23, ``contracts/refs.py``) anywhere → 422: only the
  engine writes one, and the services would fetch whatever it names.

The common case costs one parse (the standard library's C scanner) plus a few C-level scans of the
text (numbers long enough to be out of range, ``\\u0000`` and surrogate escapes, brackets); the value
is walked (to say where) only when a scan finds something that may have to be refused.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any

from noetl_mesh import limits
from noetl_mesh.contracts import refs
from noetl_mesh.limits import LimitExceeded

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# digits -> 0, e/E -> e, signs -> s, anything else -> space: number shapes found by substring search
_NUMBER_SHAPES = bytes(ord("0") if chr(c).isdigit() and c < 128 else ord("e") if c in b"eE"
                       else ord("s") if c in b"+-" else ord(" ") for c in range(256))
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_PREVIEW = 40  # characters of a refused number or key shown in a message
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_STORE = refs.STORE.encode()  # a payload reference (D23) in a body: only the engine writes one


def value_count(raw: bytes) -> int:
    """At most how many values a JSON text holds (each is a container or follows a comma), counted
    without parsing: commas and brackets, first in the raw bytes (an upper bound, a few ms for 16 MiB),
    and, only when that is over the limit, again outside strings."""
    def count(b: bytes) -> int:
        return b.count(b",") + b.count(b"[") + b.count(b"{") + 1
    n = count(raw)
    return n if n <= limits.current().max_body_values else count(_STRING.sub(b"", raw))


class BodyError(ValueError):
    """A request body the gateway refuses: ``status`` (400/422), ``type``, ``message``, ``location``."""

    def __init__(self, status: int, type: str, message: str, location: str = "body"):
        super().__init__(message)
        self.status, self.type, self.message, self.location = status, type, message, location


class _Refused:
    """A number JSON (or the event log) cannot hold, left in the value by the parser's hooks so that
    the walk can say where it stands."""

    __slots__ = ("text", "why")

    def __init__(self, text: str, why: str):
        self.text, self.why = text, why


def location(path: tuple[str | int, ...], root: str = "body") -> str:
    """``("workload", "a", 3)`` → ``body.workload.a[3]``; odd keys are quoted as JSON strings (so a NUL
    or a surrogate shows as its escape) and cut after a few dozen characters."""
    out = [root]
    for part in path:
        if isinstance(part, int):
            out.append(f"[{part}]")
        elif len(part) <= _PREVIEW and _IDENTIFIER.match(part):
            out.append(f".{part}")
        else:
            quoted = json.dumps(part[:_PREVIEW])
            out.append(f"[{quoted[:-1]}…\"]" if len(part) > _PREVIEW else f"[{quoted}]")
    return "".join(out)


def decode_utf8(raw: bytes) -> str:
    """The body as text; bytes that are not UTF-8 are a 400 naming the first bad byte's offset."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyError(400, "not_utf8", f"the body is not UTF-8: byte {exc.start} (0x{raw[exc.start]:02x}): "
                                         f"{exc.reason}") from None


def parse_json(raw: bytes, max_depth: int) -> Any:
    """The value of a JSON body, checked as described in the module's docstring."""
    text = decode_utf8(raw)
    if (n := value_count(raw)) > limits.current().max_body_values:
        raise BodyError(413, "too_many_values", str(LimitExceeded("max_body_values", n)))
    refused: list[_Refused] = []

    def on_int(t: str) -> int | _Refused:
        if len(t) <= 20 and INT64_MIN <= (value := int(t)) <= INT64_MAX:
            return value
        refused.append(_Refused(t, "is outside the signed 64-bit integer range (-2^63 .. 2^63-1)"))
        return refused[-1]

    def on_float(t: str) -> float | _Refused:
        if math.isfinite(value := float(t)):
            return value
        refused.append(_Refused(t, "is not a finite number (it overflows a double)"))
        return refused[-1]

    def on_constant(t: str) -> _Refused:  # NaN, Infinity, -Infinity: only ever called for those
        refused.append(_Refused(t, "is not a JSON number (JSON has no NaN or Infinity)"))
        return refused[-1]

    # a number can only be out of range with a run of 19 digits or a 3-digit exponent: only then are
    # the (per-number) hooks needed
    shapes = raw.translate(_NUMBER_SHAPES)
    long_numbers = b"0" * 19 in shapes or b"e000" in shapes or b"es000" in shapes
    hooks = {"parse_int": on_int, "parse_float": on_float} if long_numbers else {}
    try:
        value = json.loads(text, parse_constant=on_constant, **hooks)
    except json.JSONDecodeError as exc:
        raise BodyError(400, "json_invalid", f"malformed JSON: {exc.msg} at line {exc.lineno}, column {exc.colno} "
                                             f"(character {exc.pos})") from None
    except RecursionError:
        raise BodyError(422, "json_depth", str(LimitExceeded("max_json_depth", None, where="body"))) from None
    if (refused or b"\\u0000" in raw or _SURROGATE_ESCAPE.search(raw)
            or raw.count(b"[") + raw.count(b"{") > max_depth):
        check(value, max_depth)  # maybe something to refuse: find it, and where
    if (_STORE in raw or b"\\u" in raw) and (at := refs.forged(value)) is not None:  # an escape may spell it
        where = location(at)
        raise BodyError(422, "payload_reference", refs.refusal(where), where)
    return value


def check(value: Any, max_depth: int, root: str = "body") -> None:
    """Walk a parsed value (iteratively: any depth) and raise :class:`BodyError` at the first refused
    number, string or key, or where the nesting passes ``max_depth``."""
    # a path is linked, (parent, key), so that descending costs no copy; unwound only for a message
    stack: list[tuple[Any, int, tuple]] = [(value, 0, ())]
    while stack:
        node, depth, path = stack.pop()
        kind = type(node)
        if kind is dict:
            items: Any = node.items()
        elif kind is list:
            items = enumerate(node)
        else:
            _leaf(node, path, root)
            continue
        if depth >= max_depth:
            where = location(_unwind(path), root)
            raise BodyError(422, "json_depth", str(LimitExceeded("max_json_depth", depth + 1, where)), where)
        for key, child in items:
            if type(key) is str and ("\x00" in key or not key.isascii()):
                _string(key, (path, key), root, "key")
            kind = type(child)
            if kind is dict or kind is list:
                stack.append((child, depth + 1, (path, key)))
            elif (kind is str and ("\x00" in child or not child.isascii())) or kind is _Refused:
                _leaf(child, (path, key), root)


def _unwind(path: tuple) -> tuple:
    keys = []
    while path:
        path, key = path
        keys.append(key)
    return tuple(reversed(keys))


def _leaf(node: Any, path: tuple, root: str) -> None:
    if type(node) is str:
        _string(node, path, root, "string")
    elif isinstance(node, _Refused):
        where = location(_unwind(path), root)
        shown = node.text if len(node.text) <= _PREVIEW else f"{node.text[:_PREVIEW]}… ({len(node.text)} characters)"
        raise BodyError(422, "json_number", f"{where}: {shown} {node.why}", where)


def _string(text: str, path: tuple, root: str, what: str) -> None:
    if "\x00" in text:
        where = location(_unwind(path), root)
        raise BodyError(422, "json_nul", f"{where}: a NUL character (\\u0000) in a {what}; NUL cannot be stored "
                                         f"(Postgres text and jsonb refuse it) and is refused rather than removed",
                        where)
    if not text.isascii() and _SURROGATE.search(text):
        where = location(_unwind(path), root)
        raise BodyError(422, "json_surrogate", f"{where}: an unpaired UTF-16 surrogate in a {what}; it is not a "
                                               f"character and cannot be encoded as UTF-8", where)
