"""A payload reference (D23): the object ``{store, key, size, checksum}`` that stands in a message for a
value kept in the payload object store.

Only the engine writes references. Its services replace every reference they receive by the value it
stands for, so one written by a user (in a task's result, in what a template builds, in a playbook or a
request) would make them fetch and copy whatever it names, as many times as it is repeated. Values of
that shape are therefore refused where user data enters the engine (:func:`forged`): a task's outcome
(core/pipeline.py), a playbook (lang/validate.py), a request body (the gateway's body.py), a workload
merged from two (core/decide.py, the gateway's restart). What a template makes is checked with the
other values the log cannot hold (:func:`unsendable`, lang/templates.py).
"""
from __future__ import annotations

import threading
from typing import Any

import orjson

from .subjects import PAYLOADS_BUCKET

STORE = f"nats-object:{PAYLOADS_BUCKET}"
MARKER = f'"store":"{STORE}"'.encode()  # in the compact JSON of every reference: a cheap test on bytes
_KEYS = frozenset({"store", "key", "size", "checksum"})
WHY = (f"an object whose keys are exactly store, key, size and checksum, with store {STORE!r}, is a payload "
       "reference, which only the engine writes (D23)")
INT_MIN, INT_MAX = -(1 << 63), (1 << 64) - 1  # the integers the log's JSON encoder (orjson) writes
_INFINITE = (float("inf"), float("-inf"))


def is_ref(value: Any) -> bool:
    return isinstance(value, dict) and value.get("store") == STORE and value.keys() == _KEYS


def forged(value: Any) -> tuple[Any, ...] | None:
    """The path (keys and indexes) to the first object in ``value`` shaped like a payload reference, or
    None. An explicit stack: user data may nest deeper than Python's recursion."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if isinstance(item, dict):
            if is_ref(item):
                return path
            stack.extend((v, (*path, k)) for k, v in item.items() if isinstance(v, (dict, list, tuple)))
        elif isinstance(item, (list, tuple)):
            stack.extend((v, (*path, i)) for i, v in enumerate(item) if isinstance(v, (dict, list, tuple)))
    return None


def _number_problem(value: Any) -> str | None:
    kind = type(value)
    if kind is int and not INT_MIN <= value <= INT_MAX:
        return "an integer outside 64 bits (-2^63 .. 2^64-1), which the event log cannot hold"
    if kind is float and (value != value or value in _INFINITE):
        return "a number that is not finite, which JSON cannot hold"
    return None


def unsendable(value: Any, max_depth: int = 64) -> tuple[tuple[Any, ...], str] | None:
    """The path to the first part of ``value`` that cannot travel as a value the user wrote, and why:
    an object shaped like a payload reference, an integer outside 64 bits, a number that is not finite
    (JSON has none: it would become null), a key that is none of text, a finite number or an integer of
    64 bits, a list or mapping nested deeper than ``max_depth`` levels (``max_value_depth``: the event
    log's encoder stops at 254, its envelope included); None when every part can."""
    max_depth = min(max_depth, MAX_DEPTH)
    stack: list[tuple[Any, tuple[Any, ...]]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if (problem := _number_problem(item)) is not None:
            return path, problem
        if isinstance(item, (dict, list, tuple)) and len(path) >= max_depth:
            return path, TOO_DEEP.format(max_depth)
        if isinstance(item, dict):
            if is_ref(item):
                return path, WHY
            for k, v in item.items():
                if type(k) not in (str, int, float, bool, type(None)) or _number_problem(k) is not None:
                    return (*path, k), "a key JSON cannot hold (a text, a finite number, an integer of 64 bits)"
                stack.append((v, (*path, k)))
        elif isinstance(item, (list, tuple)):
            stack.extend((v, (*path, i)) for i, v in enumerate(item))
    return None


_ENCODER_DEPTH = 254  # the lists and mappings orjson nests at most
MAX_DEPTH = 200  # max_value_depth at most: the rest is the envelope's (events, a parent's view of a child)
_pads = threading.local()  # per thread: (levels, the outer list, the innermost list) of lists to encode in
TOO_DEEP = "lists and mappings nested deeper than {} levels (the limit max_value_depth)"


def encoded_within(value: Any, depth: int) -> bytes:
    """``value``'s JSON as the bus writes it; a ``TypeError`` ("Recursion limit reached") when it nests
    more than ``depth`` levels: orjson's own bound counts that as it encodes, with the value placed
    under ``254 - depth`` levels of lists (built once per thread), which are then cut off the text: one
    encode, no walk of the value in Python (about 1.4 µs more than a plain encode at depth 64)."""
    pad = _ENCODER_DEPTH - min(depth, MAX_DEPTH)
    if not pad:
        return orjson.dumps(value, default=str, option=orjson.OPT_NON_STR_KEYS)
    levels = getattr(_pads, "levels", None)
    if levels is None or levels[0] != pad:
        inner: list[Any] = [None]
        outer = inner
        for _ in range(pad - 1):
            outer = [outer]
        levels = _pads.levels = (pad, outer, inner)
    _, outer, inner = levels
    inner[0] = value
    try:
        data = orjson.dumps(outer, default=str, option=orjson.OPT_NON_STR_KEYS)
    finally:
        inner[0] = None
    return data[pad:len(data) - pad]


def too_deep(value: Any, depth: int) -> bool:
    """Whether lists and mappings nest more than ``depth`` levels in ``value`` (one encode, in C): for
    what a playbook's own structure builds around values it reads (``set_ctx: {v: {a: "{{ ctx.v }}"}}``
    on a back-edge grows a level a pass), which no single template made."""
    if not value or not isinstance(value, (dict, list, tuple)):
        return False
    try:
        encoded_within(value, depth)
    except TypeError as exc:
        return nested_too_deep(exc)
    return False


def nested_too_deep(exc: BaseException) -> bool:
    """Whether :func:`encoded_within` raised ``exc`` because the value nests too deep (orjson's
    ``TypeError``, "Recursion limit reached"), not because a part of it cannot be encoded."""
    return isinstance(exc, TypeError) and "Recursion limit" in str(exc)


def shown(path: tuple[Any, ...]) -> str:
    """``path`` as ``a.b[2].c``."""
    out = ""
    for key in path:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out


def refusal(where: str) -> str:
    """Why a value at ``where`` is refused."""
    return f"{where}: {WHY}"
