"""What each phase of the container tests took, and what they noticed: printed at the end of the run
(tests/containers/conftest.py), measured and never asserted."""
from __future__ import annotations

import time

TIMES: dict[str, float] = {}  # phase -> seconds
NOTES: list[str] = []


def note(line: str) -> None:
    NOTES.append(line)
    print(line, flush=True)


class timed:
    """``with timed("phase"):`` adds the block's wall-clock seconds to the phase."""

    def __init__(self, phase: str) -> None:
        self.phase = phase

    def __enter__(self) -> "timed":
        self.started = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        TIMES[self.phase] = TIMES.get(self.phase, 0.0) + time.monotonic() - self.started
