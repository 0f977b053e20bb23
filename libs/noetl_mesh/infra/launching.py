"""A server's launch that a signal must not split.

The command line's signal handler raises in plain code (``cli.common.Signals``), so that a half-started
stack stops at once. Raised inside ``subprocess.Popen`` after the child has been created (Popen still
reading whether its exec worked), it would lose the child: a server running, known to nobody, left
behind by the command. While :func:`launching` runs, the handler hands its exception to :func:`defer`
instead, and it is raised as the launch ends, when the process is held and its owner's cleanup stops it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

_deferred: list[BaseException] | None = None  # a list while a launch runs


def defer(exc: BaseException) -> bool:
    """Keep a signal handler's ``exc`` for the end of the launch under way (True); False when none runs
    (the handler raises it itself)."""
    if _deferred is None:
        return False
    _deferred.append(exc)
    return True


@contextlib.contextmanager
def launching() -> Iterator[None]:
    """Start a process and take hold of it inside; what a signal handler deferred meanwhile is raised
    at the end (the launch's own error, if it failed, goes first: the signal is still recorded)."""
    global _deferred
    outer, _deferred = _deferred, []
    try:
        yield
    finally:
        pending, _deferred = _deferred, outer
    if pending:
        raise pending[0]


EXIT_PORT_TAKEN = 6  # a service's exit status when its metrics port is another's (``noetl service``)
