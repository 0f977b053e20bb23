"""Schedules (D31), pure: a catalog playbook started by ``cron``, ``every`` or ``at``.

NATS does the timing. A schedule is one message in the stream ``NOETL_SCHEDULES`` at
``noetl.schedule.def.<id>`` with the header ``Nats-Schedule`` (:func:`headers`); the server publishes a
copy of it to ``noetl.schedule.fire.<id>`` (same stream) at each firing, with ``Nats-Schedule-Next``.
The scheduler service turns each firing into one ``playbook.execution.requested`` whose execution id
derives from the schedule and the fire time (:func:`execution_id`), so a redelivered firing, or two
replicas, start it once. The definitions themselves (playbook, workload, creator, paused) are records in
the KV bucket ``noetl_schedules``: the record is the truth, the schedule message follows it, and each
firing is checked against it (:func:`on_firing`). docs/schedules.md tells the whole story.

This module: validation of a request with located errors (:func:`check`; durations and instants are
the language's, lang/durations.py), a six-field cron parser and iterator that computes what the server computes (its algorithm, time
zones and daylight-saving changes included: :func:`cron_next`), next fire times, the header values,
the fire time of a firing and the request it makes. No I/O, no clock: ``now`` is always a parameter.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from datetime import date, datetime, timezone
from typing import Any
from zoneinfo import ZoneInfo, available_timezones

import orjson

from ..lang.durations import parse_duration, parse_instant  # the language's durations and instants
from ..lang.paths import path_problem  # a schedule names a catalog path: the catalog's rule
from .events import execution_requested, stable_id
from . import access
from .access import allowed

# ------------------------------------------------------------------------------------ names
from ..contracts.subjects import SCHEDULE_DEF_PREFIX as DEF_PREFIX
from ..contracts.subjects import SCHEDULE_FIRE_PREFIX as FIRE_PREFIX
from ..contracts.subjects import SCHEDULE_Q_PREFIX as Q_PREFIX
from ..contracts.subjects import SCHEDULE_SUBJECTS as SUBJECTS
from ..contracts.subjects import SCHEDULE_VERBS as VERBS
from ..contracts.subjects import SCHEDULES as STREAM
from ..contracts.subjects import SCHEDULES_BUCKET as BUCKET  # KV: id -> definition record
SOURCE = "scheduler"  # the writer of the requests it makes (core/events.py MAY_WRITE)
DURABLE = "scheduler"  # its consumer of the firings

ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}\Z")  # one subject token and one KV key
MAX_EXPRESSION = 256  # characters of a cron expression
MAX_EVERY = 366 * 86400  # seconds
MAX_NEXT = 100  # next fire times asked at once
CRON_YEARS = 5  # the server finds a cron's next instant within 5 years, or refuses the pattern
INT64_MAX = 2**63 - 1
FIELDS = ("path", "version", "workload", "cron", "timezone", "every", "at", "name")


def def_subject(schedule_id: str) -> str:
    return DEF_PREFIX + schedule_id


def fire_subject(schedule_id: str) -> str:
    return FIRE_PREFIX + schedule_id


def id_of_subject(subject: str) -> str | None:
    """The schedule id of a schedule or firing subject, None for anything else."""
    for prefix in (DEF_PREFIX, FIRE_PREFIX):
        if subject.startswith(prefix) and ID.match(subject[len(prefix):]):
            return subject[len(prefix):]
    return None


# ------------------------------------------------------------------------------------ errors
class ScheduleError(ValueError):
    """An invalid schedule: ``errors`` lists each problem with its ``location`` (a field of the
    request: ``cron``, ``workload``, ...; empty for the whole), ``message`` and ``type`` (``invalid``, or
    ``too_large`` for a schedule over ``max_schedule_bytes``)."""

    def __init__(self, errors: list[dict[str, str]]):
        self.errors = errors
        first = errors[0]
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        super().__init__(f"{first['location'] or 'schedule'}: {first['message']}{more}")


def _error(location: str, message: str, type: str = "invalid") -> dict[str, str]:
    return {"location": location, "message": message, "type": type}


# ------------------------------------------------------------------------------------ instants
def iso(epoch: float) -> str:
    """An instant as RFC 3339 in UTC, to the second (the server's @at format)."""
    return datetime.fromtimestamp(int(epoch), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ------------------------------------------------------------------------------------ time zones
_ZONE = re.compile(r"^[A-Za-z][A-Za-z0-9_+-]*(/[A-Za-z0-9_+-]+){0,3}\Z")


@functools.cache
def _zones() -> frozenset[str]:
    return frozenset(available_timezones())


def zone(name: Any) -> ZoneInfo:
    """The IANA time zone ``name`` (exact spelling, as the server's own lookup wants it)."""
    if not isinstance(name, str) or len(name) > 64 or not _ZONE.match(name) or name == "Local":
        raise ValueError(f"{name!r:.80} is not an IANA time zone name (like Europe/Paris or America/New_York)")
    if name not in _zones() and name != "UTC":
        raise ValueError(f"time zone {name!r} is not known (IANA names are case-sensitive: Europe/Paris)")
    return ZoneInfo(name)


# ------------------------------------------------------------------------------------ cron
MACROS = {"@yearly": "0 0 0 1 1 *", "@annually": "0 0 0 1 1 *", "@monthly": "0 0 0 1 * *",
          "@weekly": "0 0 0 * * 0", "@daily": "0 0 0 * * *", "@midnight": "0 0 0 * * *", "@hourly": "0 0 * * * *"}
MONTHS = {m: i + 1 for i, m in enumerate(("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct",
                                          "nov", "dec"))}
DAYS = {d: i for i, d in enumerate(("sun", "mon", "tue", "wed", "thu", "fri", "sat"))}
# name, low, high, names, whether ``?`` may stand for ``*``
_CRON_FIELDS = (("second", 0, 59, None, False), ("minute", 0, 59, None, False), ("hour", 0, 23, None, False),
                ("day of month", 1, 31, None, True), ("month", 1, 12, MONTHS, False),
                ("day of week", 0, 6, DAYS, True))
_VALUE = re.compile(r"^(\d{1,2}|[A-Za-z]{3})\Z")


@dataclass(frozen=True)
class Cron:
    """A parsed six-field cron expression: ``second minute hour day-of-month month day-of-week``.
    ``dom_star``/``dow_star``: the field holds ``*`` (or ``?``) without a step over 1; as for the
    server (and cron(5)), when both day fields are restricted a day matches either, else both."""

    text: str
    seconds: frozenset[int]
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]
    dom_star: bool
    dow_star: bool

    def day_matches(self, moment: datetime) -> bool:
        dom = moment.day in self.days
        dow = moment.isoweekday() % 7 in self.weekdays  # Sunday is 0
        return (dom and dow) if (self.dom_star or self.dow_star) else (dom or dow)


def parse_cron(text: Any, location: str = "cron") -> Cron:
    """Parse a six-field cron expression (or a macro: ``@hourly``, ``@daily``, ``@weekly``,
    ``@monthly``, ``@yearly``). Fields take ``*``, numbers, names (``jan``-``dec``, ``sun``-``sat``),
    ranges ``a-b``, steps ``*/n``, ``a-b/n`` and ``a/n`` (a to the end), and lists ``x,y``. Stricter
    than the server where it is lax (``*-5``, ``1,,2``, ``+5`` are refused here), never laxer: what
    parses here means the same there. ScheduleError with every problem, located at ``location``."""
    if not isinstance(text, str):
        raise ScheduleError([_error(location, f"a cron expression is a string, got {type(text).__name__}")])
    if len(text) > MAX_EXPRESSION:
        raise ScheduleError([_error(location, f"a cron expression is at most {MAX_EXPRESSION} characters")])
    expanded = MACROS.get(text.strip().lower(), text)
    parts = expanded.split()
    if len(parts) != 6:
        hint = f" (five fields? add the seconds first: '0 {' '.join(parts)}')" if len(parts) == 5 else ""
        raise ScheduleError([_error(location, f"a cron expression has six fields: second minute hour "
                                              f"day-of-month month day-of-week; got {len(parts)}{hint}")])
    errors: list[dict[str, str]] = []
    values: list[frozenset[int]] = []
    stars: list[bool] = []
    for i, (part, spec) in enumerate(zip(parts, _CRON_FIELDS)):
        try:
            bits, star = _cron_field(part, *spec)
        except ValueError as exc:
            errors.append(_error(location, f"field {i + 1} ({spec[0]}) {part!r}: {exc}"))
            bits, star = frozenset(), False
        values.append(bits)
        stars.append(star)
    if errors:
        raise ScheduleError(errors)
    return Cron(" ".join(parts), *values, dom_star=stars[3], dow_star=stars[5])


def _cron_field(text: str, name: str, low: int, high: int, names: dict[str, int] | None,
                question: bool) -> tuple[frozenset[int], bool]:
    out: set[int] = set()
    star = False
    for item in text.split(","):
        if not item:
            raise ValueError("an empty item in a list")
        span, _, step_text = item.partition("/")
        step = 1
        if step_text or "/" in item:
            if not step_text.isdigit() or len(step_text) > 2 or int(step_text) == 0:
                raise ValueError(f"the step {step_text!r} must be a number from 1 to 99")
            step = int(step_text)
        if span in ("*", "?"):
            if span == "?" and not question:
                raise ValueError("'?' is only for the day fields")
            start, end = low, high
            star = star or step == 1
        else:
            first, dash, last = span.partition("-")
            start = _cron_value(first, low, high, names)
            end = _cron_value(last, low, high, names) if dash else (high if step_text else start)
            if start > end:
                raise ValueError(f"the range {span!r} starts after it ends")
        out.update(range(start, end + 1, step))
    return frozenset(out), star


def _cron_value(text: str, low: int, high: int, names: dict[str, int] | None) -> int:
    if not _VALUE.match(text):
        raise ValueError(f"{text!r} is not a number" + (" or a name" if names else ""))
    if text.isdigit():
        value = int(text)
    elif names is None or text.lower() not in names:
        raise ValueError(f"{text!r} is not " + (f"one of {', '.join(names)}" if names else "a number"))
    else:
        value = names[text.lower()]
    if not low <= value <= high:
        raise ValueError(f"{value} is outside {low}-{high}")
    return value


_EPOCH_DAY = date(1970, 1, 1).toordinal()


def _offset(epoch: int, tz: ZoneInfo) -> int:
    return int(datetime.fromtimestamp(epoch, tz).utcoffset().total_seconds())


def _local(epoch: int, tz: ZoneInfo) -> datetime:
    return datetime.fromtimestamp(epoch, tz)


def _go_date(year: int, month: int, day: int, hour: int, minute: int, second: int, tz: ZoneInfo) -> int:
    """Epoch seconds of a local date and time as Go's ``time.Date`` makes it (which the server's cron
    uses): out-of-range values carry over (month 13, day 32), a time in a daylight-saving gap takes
    the offset after the change (02:30 that does not exist is 01:30 of the offset before), a time
    that happens twice is the first."""
    year += (month - 1) // 12
    month = (month - 1) % 12 + 1
    days = date(year, month, 1).toordinal() + day - 1 - _EPOCH_DAY
    wall = days * 86400 + hour * 3600 + minute * 60 + second  # the local clock read as if UTC
    return wall - _offset(wall - _offset(wall, tz), tz)


def cron_next(cron: Cron, tz: ZoneInfo, after: int) -> int | None:
    """The first instant (epoch seconds) after ``after`` at which the server fires ``cron`` in ``tz``;
    None when none is within five years. The server's algorithm (robfig/cron's): fields are searched
    from the month down, each increment wrapping back to the month; days and months step in local
    calendar time, hours, minutes and seconds in absolute time. So on a daylight-saving day, an hour
    that does not exist is skipped (``0 30 2 * * *`` does not fire that day) and an hour that
    happens twice fires twice (``0 30 1 * * *`` at 01:30 before and after the clocks go back)."""
    t = after + 1
    truncated = False
    year_limit = _local(t, tz).year + CRON_YEARS
    while True:  # each pass re-checks every field from the month down ("WRAP" in the server)
        lt = _local(t, tz)
        if lt.year > year_limit:
            return None
        wrapped = False
        while lt.month not in cron.months:
            if not truncated:
                truncated = True
                t = _go_date(lt.year, lt.month, 1, 0, 0, 0, tz)
                lt = _local(t, tz)
            t = _go_date(lt.year, lt.month + 1, lt.day, lt.hour, lt.minute, lt.second, tz)
            lt = _local(t, tz)
            if lt.month == 1:
                wrapped = True
                break
        if wrapped:
            continue
        while not cron.day_matches(lt):
            if not truncated:
                truncated = True
                t = _go_date(lt.year, lt.month, lt.day, 0, 0, 0, tz)
                lt = _local(t, tz)
            t = _go_date(lt.year, lt.month, lt.day + 1, lt.hour, lt.minute, lt.second, tz)
            lt = _local(t, tz)
            if lt.day == 1:
                wrapped = True
                break
        if wrapped:
            continue
        while lt.hour not in cron.hours:
            if not truncated:
                truncated = True
                t = _go_date(lt.year, lt.month, lt.day, lt.hour, 0, 0, tz)
            t += 3600
            lt = _local(t, tz)
            if lt.hour == 0:
                wrapped = True
                break
        if wrapped:
            continue
        while lt.minute not in cron.minutes:
            if not truncated:
                truncated = True
                t -= t % 60
            t += 60
            lt = _local(t, tz)
            if lt.minute == 0:
                wrapped = True
                break
        if wrapped:
            continue
        while lt.second not in cron.seconds:
            truncated = True
            t += 1
            lt = _local(t, tz)
            if lt.second == 0:
                wrapped = True
                break
        if wrapped:
            continue
        return t


def cron_previous(cron: Cron, tz: ZoneInfo, before: int, near: int) -> int | None:
    """The last instant of ``cron`` before ``before``, searched from ``near`` back in growing windows
    (2 s to 34 years); None when there is none."""
    for window in (2, 64, 4096, 262144, 16777216, 1073741824):
        start = min(near, before - 1) - window
        last = None
        t = cron_next(cron, tz, start)
        while t is not None and t < before:
            last = t
            t = cron_next(cron, tz, t)
        if last is not None:
            return last
    return None


# ------------------------------------------------------------------------------------ a schedule
def check(body: Any, *, now: float, max_bytes: int) -> dict[str, Any]:
    """A schedule request (the fields of ``POST /api/schedules``) as a normalized definition:
    ``{path, version, workload, spec, id?}``, ``spec`` one of ``{"cron", "timezone"}``, ``{"every"}``
    (whole seconds), ``{"at"}`` (RFC 3339, UTC). ScheduleError lists every problem with its field."""
    if not isinstance(body, dict):
        raise ScheduleError([_error("", f"a schedule is a JSON object, got {type(body).__name__}")])
    errors = [_error(str(k)[:64], "not a field of a schedule (" + ", ".join(FIELDS) + ")")
              for k in body if k not in FIELDS]
    out: dict[str, Any] = {}
    path = body.get("path")
    problem = path_problem(path)
    if problem is not None:
        errors.append(_error("path", f"the catalog path of the playbook to start: {problem}"))
    else:
        out["path"] = path
    version = body.get("version")
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)
                                or not 1 <= version <= INT64_MAX):
        errors.append(_error("version", "a catalog version is a whole number from 1 (none: the latest at each firing)"))
    out["version"] = version
    workload = body.get("workload")
    if workload is not None and not isinstance(workload, dict):
        errors.append(_error("workload", f"the workload is a JSON object, got {type(workload).__name__}"))
    out["workload"] = workload or {}
    name = body.get("name")
    if name is not None:
        if not isinstance(name, str) or not ID.match(name):
            errors.append(_error("name", "a schedule name is 1 to 64 letters, digits, '-' and '_', starting with a "
                                         "letter or digit (it is the schedule's id)"))
        else:
            out["id"] = name
    given = [k for k in ("cron", "every", "at") if body.get(k) is not None]
    if len(given) != 1:
        errors.append(_error("", f"give exactly one of cron, every or at (got {', '.join(given) or 'none'})"))
    if body.get("timezone") is not None and given != ["cron"]:
        errors.append(_error("timezone", "a time zone goes with cron only (every and at do not depend on one)"))
    if len(given) == 1:
        try:
            out["spec"] = _spec(given[0], body, now)
        except ScheduleError as exc:
            errors += exc.errors
    if not errors:
        try:
            size = len(orjson.dumps(out))
        except TypeError as exc:  # an integer past 64 bits, nesting past 255 levels
            raise ScheduleError([_error("workload", f"cannot be stored as JSON: {exc}")]) from None
        if size > max_bytes:
            errors.append(_error("workload", f"the schedule is {size:,} bytes of JSON, over max_schedule_bytes "
                                             f"({max_bytes:,}; NOETL_LIMIT_MAX_SCHEDULE_BYTES)", "too_large"))
    if errors:
        raise ScheduleError(errors)
    return out


def _spec(kind: str, body: dict[str, Any], now: float) -> dict[str, Any]:
    value = body[kind]
    if kind == "cron":
        errors: list[dict[str, str]] = []
        try:
            cron = parse_cron(value)
        except ScheduleError as exc:
            errors += exc.errors
        tz_name = body.get("timezone")
        try:
            tz = zone(tz_name) if tz_name is not None else ZoneInfo("UTC")
        except ValueError as exc:
            errors.append(_error("timezone", str(exc)))
        if errors:
            raise ScheduleError(errors)
        spec: dict[str, Any] = {"cron": cron.text}
        if tz_name is not None:
            spec["timezone"] = tz_name
        if cron_next(cron, tz, int(now)) is None:
            raise ScheduleError([_error("cron", f"{cron.text!r} never fires in the next {CRON_YEARS} years "
                                                "(a day that no month has?)")])
        return spec
    try:
        if kind == "every":
            seconds = parse_duration(value)
            if seconds < 1 or seconds != int(seconds):
                raise ValueError(f"{value!r} is {seconds:g} s: every is a whole number of seconds, at least 1")
            if seconds > MAX_EVERY:
                raise ValueError(f"{value!r} is {seconds:g} s, over the maximum of {MAX_EVERY} s (366 days)")
            return {"every": int(seconds)}
        at = parse_instant(value)
        if at != int(at):
            raise ValueError(f"{value!r}: at is to the second")
        if at <= now:
            raise ValueError(f"{value!r} is in the past (now is {iso(now)})")
        return {"at": iso(at)}
    except (ValueError, OverflowError, OSError) as exc:
        raise ScheduleError([_error(kind, str(exc))]) from None


def definition(fields: dict[str, Any], *, schedule_id: str, generation: str, created_by: dict[str, Any],
               now: float) -> dict[str, Any]:
    """The stored record of a checked schedule (:func:`check`). ``generation`` tells this schedule's
    firings from those of an earlier schedule of the same id."""
    return {"id": fields.get("id") or schedule_id, "path": fields["path"], "version": fields.get("version"),
            "workload": fields.get("workload") or {}, "spec": dict(fields["spec"]), "paused": False,
            "created_by": created_by, "created_at": iso(now), "updated_at": iso(now), "generation": generation}


def with_paused(record: dict[str, Any], paused: bool, now: float, reason: str | None = None) -> dict[str, Any]:
    """Paused or resumed at ``now``; ``reason``: why the scheduler paused it itself (kept until resumed)."""
    out = {**record, "paused": paused, "updated_at": iso(now)}
    out.pop("paused_reason", None)
    if paused and reason:
        out["paused_reason"] = reason
    return out


def creator_refusal(record: dict[str, Any], standing: Any) -> str | None:
    """Why a firing may not start an execution for the schedule's creator any more (None: it may).
    ``standing``: the sessions service's answer for the creator (``{exists, active, roles}``). A
    schedule acts for its creator at every firing, so it stops when the creator could not start the
    execution itself: deleted, disabled, or without a role that may start executions; and, made with
    an API token (:func:`standing_request`), once that token is revoked or expired."""
    who = record.get("created_by") or {}
    name = who.get("username") or who.get("user_id") or "?"
    if not isinstance(standing, dict) or not standing.get("exists"):
        return f"its creator {name} no longer exists"
    if not standing.get("active"):
        return f"its creator {name} is disabled"
    if not allowed(standing.get("roles") or [], "execution.start"):
        return f"its creator {name} no longer has a role that may start executions"
    if "token_active" in standing and not standing["token_active"]:
        return f"the API token {name} created it with is revoked or expired"
    return None


def standing_request(record: dict[str, Any]) -> dict[str, Any] | None:
    """What to ask the sessions service (``users.standing``) before a firing: the creator, and the API
    token it used, if any (a schedule made with a token acts no longer than the token lives: a revoked
    token's automation stops; one made in a session is the user's own, and outlives the session)."""
    who = record.get("created_by") or {}
    if not isinstance(who.get("user_id"), str):
        return None
    ask: dict[str, Any] = {"user_id": who["user_id"]}
    if who.get("kind") == "token" and isinstance(who.get("token_id"), str):
        ask["token_id"] = who["token_id"]
    return ask


def kind(record: dict[str, Any]) -> str:
    return next(k for k in ("cron", "every", "at") if k in record["spec"])


def finished(record: dict[str, Any], now: float) -> bool:
    """An ``at`` schedule whose instant has come: the server fired it once and dropped it."""
    return kind(record) == "at" and parse_instant(record["spec"]["at"]) <= now


def headers(record: dict[str, Any], fire_ttl: int) -> dict[str, str]:
    """The NATS headers of the schedule message: the pattern, the target (in the same stream), the
    time zone of a cron, and the TTL of each firing (a firing nobody took within it is dropped)."""
    spec = record["spec"]
    if "cron" in spec:
        pattern = spec["cron"]
    elif "every" in spec:
        pattern = f"@every {int(spec['every'])}s"
    else:
        pattern = f"@at {spec['at']}"
    out = {"Nats-Schedule": pattern, "Nats-Schedule-Target": fire_subject(record["id"]),
           "Nats-Schedule-TTL": f"{int(fire_ttl)}s"}
    if spec.get("timezone"):
        out["Nats-Schedule-Time-Zone"] = spec["timezone"]
    return out


def body(record: dict[str, Any]) -> bytes:
    """The schedule message's body, copied into each firing: which schedule, which generation."""
    return orjson.dumps({"id": record["id"], "generation": record["generation"]})


def upcoming(record: dict[str, Any], now: float, n: int = 5, anchor: float | None = None) -> list[int]:
    """The next ``n`` fire times (epoch seconds) after ``now``; none while paused. ``anchor``: when
    the schedule message was stored (an ``every`` counts from it, rounded to the second; a cron's
    first firing comes after it); None: taken as now."""
    if record.get("paused") or n <= 0:
        return []
    spec = record["spec"]
    # after the later of now and the anchor (when the server took the schedule), to the second below: the
    # server looks for a cron's next instant after the time itself, so created at 05:02:49.7, an
    # expression every 10 s fires at 05:02:50 (rounding the anchor up announced 05:03:00)
    start = int(max(now, anchor)) if anchor is not None else int(now)
    if "at" in spec:
        at = int(parse_instant(spec["at"]))
        return [at] if at > now else []
    if "every" in spec:
        every = int(spec["every"])
        base = _round(anchor if anchor is not None else now)
        k = max(1, (int(now) - base) // every + 1)
        return [base + (k + i) * every for i in range(n)]
    cron, tz = parse_cron(spec["cron"]), zone_of(spec)
    out: list[int] = []
    t: int | None = start
    while len(out) < n and t is not None:
        t = cron_next(cron, tz, t)
        if t is not None:
            out.append(t)
    return out


def zone_of(spec: dict[str, Any]) -> ZoneInfo:
    return zone(spec["timezone"]) if spec.get("timezone") else ZoneInfo("UTC")


def _round(epoch: float) -> int:
    """Go's Round(time.Second) for positive instants: halves up."""
    return int(math.floor(epoch + 0.5))


# ------------------------------------------------------------------------------------ a firing
def fire_time(record: dict[str, Any], next_header: str | None, stored: float) -> int:
    """The scheduled instant of a firing, from the server's ``Nats-Schedule-Next`` header: for
    ``every`` the next minus the interval, for a cron its last instant before the next, for ``at`` the
    instant. The same firing redelivered gives the same time; two firings never do (the server's next
    times only grow). ``stored``: the firing's stream timestamp, the fallback without a header."""
    spec = record["spec"]
    if "at" in spec:
        return int(parse_instant(spec["at"]))
    base = int(math.floor(stored))
    try:
        following = int(parse_instant(next_header)) if next_header and next_header != "purge" else None
    except ValueError:
        following = None
    if following is None:
        return base
    if "every" in spec:
        return following - int(spec["every"])
    previous = cron_previous(parse_cron(spec["cron"]), zone_of(spec), following, base)
    return previous if previous is not None else base


def execution_id(schedule_id: str, fired_at: int) -> str:
    """The execution a firing starts: derived from the schedule and the fire time (D21), so every
    replica and every redelivery name the same one."""
    return stable_id("schedule", schedule_id, int(fired_at))


def request(record: dict[str, Any], fired_at: int, now: float) -> dict[str, Any]:
    """The ``playbook.execution.requested`` of a firing: the playbook by catalog path (and version, or
    the latest now), the workload, the schedule's creator as who requested it, and the schedule."""
    eid = execution_id(record["id"], fired_at)
    return execution_requested(
        eid, source=SOURCE, timestamp=now,
        data={"playbook": None, "catalog": {"path": record["path"], "version": record.get("version")},
              "workload": record.get("workload") or {}, "parent_execution_id": None,
              "requested_by": access.shown(record.get("created_by")),
              "schedule": {"id": record["id"], "fire_time": iso(fired_at)}})


@dataclass(frozen=True)
class Firing:
    """What to do with one firing: ``start`` this request, or drop it for ``reason``; ``stale``: the
    schedule message has no record any more and should be removed."""

    start: dict[str, Any] | None
    reason: str | None = None
    stale: bool = False


def on_firing(subject: str, fired: Any, record: dict[str, Any] | None, headers: dict[str, str], stored: float,
              now: float) -> Firing:
    """Decide a firing (``subject``, its ``headers``, and the body of the schedule message, copied)
    against the record of its schedule now. A firing is what the server wrote for the schedule message
    of the same id: ``Nats-Scheduler`` names it (no client can set that header)."""
    if not isinstance(fired, dict) or fired.get("id") != id_of_subject(subject) or fired.get("id") is None:
        return Firing(None, f"{subject}: not a firing of a schedule (its body names another or none)")
    if headers.get("Nats-Scheduler") != def_subject(fired["id"]):
        return Firing(None, f"{subject}: not written by the NATS scheduler for {def_subject(fired['id'])} "
                            f"(Nats-Scheduler: {headers.get('Nats-Scheduler')!r:.80})")
    if record is None:
        return Firing(None, f"schedule {fired['id']} does not exist (deleted)", stale=True)
    if fired.get("generation") != record.get("generation"):
        return Firing(None, f"a firing of an earlier schedule {fired['id']} (deleted, then added again)")
    if record.get("paused"):
        return Firing(None, f"schedule {fired['id']} is paused")
    return Firing(request(record, fire_time(record, headers.get("Nats-Schedule-Next"), stored), now))


def reconcile(records: dict[str, dict[str, Any]], armed: set[str],
              now: float) -> tuple[list[dict[str, Any]], list[str]]:
    """What makes the schedule messages follow the records (the truth): the records that should fire
    and have no schedule message (to arm, oldest first), and the schedule messages of schedules that
    are gone or paused (to disarm). A finished ``at`` is not armed again (the server dropped it after
    it fired)."""
    live = {sid: r for sid, r in records.items() if not r.get("paused") and not finished(r, now)}
    to_arm = sorted((r for sid, r in live.items() if sid not in armed), key=lambda r: (r["created_at"], r["id"]))
    to_disarm = sorted(sid for sid in armed if sid not in live and not (sid in records and finished(records[sid], now)))
    return to_arm, to_disarm


# ------------------------------------------------------------------------------------ answers
def view(record: dict[str, Any], now: float, n: int = 5, anchor: float | None = None,
         full: bool = True) -> dict[str, Any]:
    """A schedule as the API shows it: its record (without the generation; without the workload in a
    list, ``full=False``), its status and its next fire times."""
    out = {k: v for k, v in record.items() if k != "generation" and (full or k != "workload")}
    out["created_by"] = access.shown(record.get("created_by"))
    out["status"] = "paused" if record.get("paused") else "finished" if finished(record, now) else "active"
    times = upcoming(record, now, n, anchor)
    if full:
        out["next_fire_times"] = [iso(t) for t in times]
    out["next_fire_time"] = iso(times[0]) if times else None
    return out


def page(items: list[dict[str, Any]], offset: int, limit: int, budget: int) -> dict[str, Any]:
    """A page of a list: at most ``limit`` items from ``offset`` and at most ``budget`` bytes of JSON;
    ``next_offset`` is where the next page starts (None after the last)."""
    out: list[dict[str, Any]] = []
    size = 128
    for item in items[offset:offset + limit]:
        n = len(orjson.dumps(item, default=str)) + 1
        if out and size + n > budget:
            break
        out.append(item)
        size += n
    end = offset + len(out)
    return {"schedules": out, "total": len(items), "offset": offset,
            "next_offset": end if end < len(items) else None}
