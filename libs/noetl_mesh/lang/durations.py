"""Durations and instants of the language (D29-D31): arc delays, waits, timeouts, schedules.

A duration is a number of seconds (``90``, ``1.5``), a string of units (``"500ms"``, ``"5s"``,
``"5m"``, ``"2h"``, ``"1d"``, combined as ``"1h30m"``), or ISO-8601 (``"PT5M"``, ``"P1DT2H"``). An
instant is ISO-8601 with a time zone (``"2026-12-01T09:00:00Z"``, ``"…+01:00"``). Both are bounded:
a timer lives in the events stream, so it cannot wait longer than the stream keeps messages
(``max_timer_seconds``, docs/limits.md).
"""
from __future__ import annotations

import math
import re
from datetime import datetime, timezone
from typing import Any

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_COMPACT = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_ISO = re.compile(r"P(?:(\d+(?:\.\d+)?)D)?(?:T(?:(\d+(?:\.\d+)?)H)?(?:(\d+(?:\.\d+)?)M)?(?:(\d+(?:\.\d+)?)S)?)?")
EXAMPLES = '90, "500ms", "5s", "5m", "2h", "1d", "1h30m" or ISO-8601 "PT5M"'


class DurationError(ValueError):
    pass


def parse_duration(value: Any, *, maximum: float | None = None) -> float:
    """Seconds (>= 0) of a duration; :class:`DurationError` says why a value is not one."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise DurationError(f"a duration is a number of seconds or a string like {EXAMPLES}, got {type(value).__name__}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = value.strip()
        if len(text) > 64:
            raise DurationError(f"a duration is at most 64 characters, got {len(text)}")
        seconds = _parse_text(text)
    if not math.isfinite(seconds) or seconds < 0:
        raise DurationError(f"a duration must be a finite number of seconds >= 0, got {value!r}")
    if maximum is not None and seconds > maximum:
        raise DurationError(f"{value!r} is {seconds:g} s, over the limit of {maximum:g} s (max_timer_seconds)")
    return seconds


def _parse_text(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    upper = text.upper()
    if upper.startswith("P"):
        m = _ISO.fullmatch(upper)
        if m and upper not in ("P", "PT") and not upper.endswith("T"):
            d, h, mi, s = (float(g) if g else 0.0 for g in m.groups())
            return d * 86400 + h * 3600 + mi * 60 + s
        raise DurationError(f"{text!r} is not an ISO-8601 duration (PnDTnHnMnS, e.g. PT5M)")
    pos, total = 0, 0.0
    for m in _COMPACT.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if pos != len(text) or pos == 0:
        raise DurationError(f"{text!r} is not a duration: use {EXAMPLES}")
    return total


def parse_instant(value: Any) -> float:
    """Epoch seconds of an ISO-8601 instant that names its time zone (``Z`` or an offset)."""
    if isinstance(value, datetime):
        moment = value
    elif isinstance(value, str) and len(value) <= 64:
        try:
            moment = datetime.fromisoformat(value.strip().replace("z", "Z"))
        except ValueError:
            raise DurationError(f"{value!r} is not an ISO-8601 instant (e.g. 2026-12-01T09:00:00Z)") from None
    else:
        raise DurationError(f"an instant is an ISO-8601 string (e.g. 2026-12-01T09:00:00Z), got {value!r:.80}")
    if moment.tzinfo is None:
        raise DurationError(f"{value!r} has no time zone: add Z (UTC) or an offset like +01:00")
    return moment.timestamp()


def rfc3339(epoch: float) -> str:
    """The instant as the NATS scheduler reads it: UTC, microseconds (it fires within a few ms)."""
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def is_template(value: Any) -> bool:
    return isinstance(value, str) and ("{{" in value or "{%" in value)
