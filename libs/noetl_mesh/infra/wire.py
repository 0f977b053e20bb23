"""The wire, below every other module of ``infra``: the JSON codec of every message, the server's error
codes a service acts on, and what handling one delivered JetStream message means (:func:`handle_one`).
It imports nothing of the project, so ``bus``, ``payloads``, ``pinned`` and ``membership`` read it
without importing each other."""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

import orjson
from nats.aio.msg import Msg

log = logging.getLogger("noetl.bus")

NO_PLACEMENT = 10005  # JetStream: no suitable peers for placement (a cluster still forming: ask again)


def dumps(value: Any) -> bytes:
    return orjson.dumps(value, default=str, option=orjson.OPT_NON_STR_KEYS)


def loads(data: bytes) -> Any:
    return orjson.loads(data)


# errors no retry can cure: the message cannot be decoded or folded, its decision made or encoded
# (handle_one drops it). A RecursionError or an ArithmeticError is the same again on every delivery:
# retried, it would hold up its partition for the minutes of its 50 deliveries.
UNHANDLEABLE = (ValueError, KeyError, TypeError, AttributeError, RecursionError, ArithmeticError)


async def handle_one(msg: Msg, handle: Callable[[Msg], Awaitable[None]]) -> str | None:
    """``handle(msg)``, and what its failure means: None when it was handled; ``"dropped ..."`` when it
    raised an error that no retry can cure (:data:`UNHANDLEABLE`: it cannot be decoded or folded, its
    decision made or encoded), the message terminated, loudly, so that it does not hold up what follows;
    ``"retrying ..."`` for any other error (NATS, a service not answering), the message nak'ed with a
    delay that grows with its deliveries (never in a tight loop). Cancelled mid-message, it is handed
    back at once, not after ``ack_wait``."""
    try:
        await handle(msg)
        return None
    except asyncio.CancelledError:
        try:
            await asyncio.wait_for(msg.nak(), 1.0)
        except BaseException:  # noqa: BLE001
            pass
        raise
    except UNHANDLEABLE as exc:
        log.exception("dropping %s (delivery %s): it cannot be handled", msg.subject, msg.metadata.num_delivered)
        try:
            await msg.term()
        except Exception:  # noqa: BLE001
            pass
        return f"dropped {msg.subject}: {type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - transient: retry later
        log.exception("handler failed on %s (delivery %s)", msg.subject, msg.metadata.num_delivered)
        try:
            await msg.nak(delay=min(30.0, 0.5 * msg.metadata.num_delivered))
        except Exception:  # noqa: BLE001
            pass
        return f"retrying {msg.subject}: {type(exc).__name__}: {exc}"
