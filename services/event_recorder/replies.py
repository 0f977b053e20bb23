"""Query replies within a byte budget (``limits.max_reply_bytes``, 768 KiB by default).

NATS refuses a message over the server's ``max_payload`` (1 MiB): a reply over it never reaches the
requester, who times out. So every reply of the recorder is measured before it is sent, and one over
the budget has its biggest values replaced by D23 references (``infra/payloads.py``): the receiver
expands them (``PayloadStore.expand``). Pages of events are cut by bytes first (:func:`page`), so
that only an event bigger than the whole budget needs references.
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable

import orjson

from noetl_mesh.infra.bus import dumps
from noetl_mesh.infra.payloads import is_ref

Put = Callable[[Any], Awaitable[dict[str, Any]]]  # a value -> its reference (PayloadStore.put)

# A part is never squeezed below this many bytes: a reference is about 190, so replacing a smaller
# part gains too little to be worth an object.
FLOOR = 1024
PAGE_OVERHEAD = 256  # {"events": [...], "total": ..., "offset": ..., "limit": ..., "next_offset": ...}


async def fit(value: Any, budget: int, put: Put, *, whole: bool = False) -> Any:
    """``value`` with its biggest parts replaced by references until its JSON is at most ``budget``
    bytes. A container is opened before it is replaced: its biggest child first, fitted into what the
    whole can spare, then the next, until the whole fits; only a container still too big then (made of
    many small parts) is replaced whole, and only when ``whole`` (the top level never is: the caller
    decides what a reply that cannot fit becomes)."""
    total = len(dumps(value))
    if total <= budget or is_ref(value):
        return value
    if isinstance(value, (dict, list)) and value:
        out: Any = dict(value) if isinstance(value, dict) else list(value)
        keys = list(value) if isinstance(value, dict) else range(len(value))
        sizes = {k: len(dumps(value[k])) for k in keys}
        for k in sorted(keys, key=sizes.__getitem__, reverse=True):
            if total <= budget or sizes[k] <= FLOOR:
                break
            out[k] = await fit(value[k], max(sizes[k] - (total - budget), FLOOR), put, whole=True)
            total += len(dumps(out[k])) - sizes[k]
        if total <= budget or not whole:
            return out
    return await put(value) if whole else value


async def page(events: list[dict[str, Any]], budget: int, put: Put) -> tuple[orjson.Fragment, int]:
    """The JSON array of the leading events that fit in ``budget`` (for the reply as it is), and how
    many they are: at least one, a first event bigger than the budget going with its big values as
    references."""
    room = budget - PAGE_OVERHEAD
    data = dumps(events)
    if len(data) <= room:  # the common case: the whole page, serialised once
        return orjson.Fragment(data), len(events)
    parts: list[bytes] = []
    room -= 2
    for event in events:
        part = dumps(event)
        if len(part) + 1 > room:
            if parts:
                break
            part = dumps(await fit(event, room - 1, put))
        parts.append(part)
        room -= len(part) + 1
    return orjson.Fragment(b"[" + b",".join(parts) + b"]"), len(parts)


__all__ = ["fit", "page", "FLOOR"]
