"""Who a command acts for, and whether each of them still may, pure (D33, D24): a worker pool that
names the roles it serves and a stored credential check the same users the same way. The standing of a
user (``{active, roles}``) is the sessions service's word, asked by the shell and kept
:data:`STANDING_TTL` seconds."""
from __future__ import annotations

import time
from typing import Any, Awaitable, Callable, Iterable

STANDING_TTL = 10.0  # seconds a service keeps a user's standing: a role taken away, or a disabled user, counts within it


def command_users(command: Any) -> list[tuple[str, Any]]:
    """Who a command acts for, as ``(what they did, who)``: whoever started its execution (a child: its
    root's starter), whoever wrote the playbook it runs and, for a child, whoever wrote each playbook
    above it. A worker's pool (D33) and a stored credential (D24) check each of them."""
    if not isinstance(command, dict):
        return []
    called = command.get("called_by")
    if called is not None and not isinstance(called, list):
        called = [None]  # not a list of authors: an author not known, refused where roles are named
    return [("started", command.get("requested_by")), ("written", command.get("authored_by")),
            *(("called by a playbook written", c) for c in called or ())]


def user_refusal(did: str, who: Any, standing: Any, roles: Iterable[str] | None, named: bool = False) -> str | None:
    """Why the user ``who`` (a command's, :func:`command_users`, who ``did`` it) does not pass, given
    the sessions service's word on them now (``standing``: ``{active, roles}``) and the ``roles`` one of
    which they must hold (None: any user still active), unless ``named`` (what they would use names them:
    being active is enough). A user holds a role within the roles the request that started the
    execution, or registered the playbook, carried (an API token's may be fewer than its owner's); None
    when they pass. The sentence reads after "this execution was"."""
    name = (who.get("username") or who.get("user_id")) if isinstance(who, dict) else None
    if not isinstance(standing, dict) or not standing.get("active"):
        return f"{did} by {name}, who is disabled or removed"
    if roles is None or named:
        return None
    wanted = frozenset(roles)
    holds = [r for r in standing.get("roles") or () if isinstance(r, str)]
    carried = who.get("roles")
    held = [r for r in holds if r in carried] if isinstance(carried, list) else holds
    if not wanted.isdisjoint(held):
        return None
    if held != holds:
        return (f"{did} by {name}, who holds {', '.join(holds) or 'no role'} now and whose request carried "
                f"{', '.join(carried) or 'no role'}")
    return f"{did} by {name}, who has {', '.join(holds) or 'no role'}"


class StandingCache:
    """Users' standing by id, each answer kept ``ttl`` seconds; ``ask(user_id)`` asks for one (the
    sessions service). An error it raises is kept :data:`ERROR_TTL` seconds and raised again meanwhile
    (each command would otherwise wait out the same request)."""

    ERROR_TTL = 1.0
    MAX_USERS = 10_000  # past it, everything kept is forgotten

    def __init__(self, ask: Callable[[str], Awaitable[Any]], clock: Callable[[], float] = time.monotonic):
        self.ask, self.clock = ask, clock
        self._kept: dict[str, tuple[float, Any]] = {}  # user id -> (until, the answer or the error)

    async def get(self, uid: str, ttl: float = STANDING_TTL) -> Any:
        now = self.clock()
        until, got = self._kept.get(uid, (0.0, None))
        if until <= now:
            try:
                got, until = await self.ask(uid), now + ttl
            except Exception as exc:  # noqa: BLE001 - kept, and raised to each caller meanwhile
                got, until = exc, now + self.ERROR_TTL
            if len(self._kept) > self.MAX_USERS:
                self._kept.clear()
            self._kept[uid] = (until, got)
        if isinstance(got, Exception):
            raise got
        return got
