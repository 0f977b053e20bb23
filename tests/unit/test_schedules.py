"""Schedules, pure (core/schedules.py): the cron iterator against known answers (time zones and
daylight-saving days included, and against brute force), validation with located errors, the header
values of the schedule message, fire times and the idempotent ids of the executions firings start."""
from __future__ import annotations

from datetime import datetime, timezone
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from noetl_mesh.core import schedules as S
from noetl_mesh.core.events import refused, writer_of
from noetl_mesh.core.schedules import Cron, ScheduleError, cron_next, parse_cron

UTC = ZoneInfo("UTC")
NY = ZoneInfo("America/New_York")
NOW = datetime(2026, 6, 1, 12, 0, 0, tzinfo=timezone.utc).timestamp()


def ep(text: str, tz: ZoneInfo = UTC) -> int:
    return int(datetime.fromisoformat(text).replace(tzinfo=tz).timestamp())


def local(epoch: int, tz: ZoneInfo = UTC) -> str:
    return datetime.fromtimestamp(epoch, tz).isoformat()


def fires(expr: str, start: str, n: int, tz: ZoneInfo = UTC) -> list[str]:
    cron, t, out = parse_cron(expr), ep(start, tz), []
    for _ in range(n):
        t = cron_next(cron, tz, t)
        out.append(local(t, tz))
    return out


def errors(body: dict, now: float = NOW) -> list[dict]:
    with pytest.raises(ScheduleError) as exc:
        S.check(body, now=now, max_bytes=64 * 1024)
    return exc.value.errors


# ------------------------------------------------------------------------------------ cron: parsing
def test_cron_fields_lists_ranges_steps_names_and_macros():
    c = parse_cron("5/20 0-10/5,30 9-17/4 1,15 JAN-mar mon-FRI")
    assert c.seconds == {5, 25, 45} and c.minutes == {0, 5, 10, 30} and c.hours == {9, 13, 17}
    assert c.days == {1, 15} and c.months == {1, 2, 3} and c.weekdays == {1, 2, 3, 4, 5}
    assert not c.dom_star and not c.dow_star
    assert parse_cron("@hourly").text == "0 0 * * * *" and parse_cron("@weekly").weekdays == {0}
    star = parse_cron("0 0 0 ? * */1")
    assert star.dom_star and star.dow_star and star.weekdays == set(range(7))
    assert not parse_cron("0 0 0 * * */2").dow_star  # a step over 1 is not "every day" (the server's rule)


@pytest.mark.parametrize("expr, says", [
    ("* * * * *", "six fields.*five fields\\? add the seconds"),
    ("60 * * * * *", "field 1 \\(second\\) '60': 60 is outside 0-59"),
    ("* * 24 * * *", "field 3 \\(hour\\)"),
    ("* * * 0 * *", "field 4 \\(day of month\\) '0': 0 is outside 1-31"),
    ("* * * * 13 *", "field 5 \\(month\\)"),
    ("* * * * * 7", "field 6 \\(day of week\\) '7': 7 is outside 0-6"),
    ("* * * * * sunday", "'sunday' is not a number or a name"),
    ("* * * * foo *", "'foo' is not one of jan"),
    ("*/0 * * * * *", "step '0'"),
    ("1,,2 * * * * *", "empty item"),
    ("*-5 * * * * *", "'\\*' is not a number"),
    ("+5 * * * * *", "'\\+5' is not a number"),
    ("5-1 * * * * *", "starts after it ends"),
    ("? * * * * *", "'\\?' is only for the day fields"),
])
def test_cron_errors_name_the_field(expr, says):
    with pytest.raises(ScheduleError, match=says) as exc:
        parse_cron(expr)
    assert all(e["location"] == "cron" for e in exc.value.errors)


def test_cron_lists_every_bad_field_at_once():
    with pytest.raises(ScheduleError) as exc:
        parse_cron("61 61 * * * 9")
    assert [e["message"][:9] for e in exc.value.errors] == ["field 1 (", "field 2 (", "field 6 ("]


# ------------------------------------------------------------------------------------ cron: known answers
def test_cron_next_in_utc():
    assert fires("*/15 * * * * *", "2026-01-01T00:00:00", 3) == [
        "2026-01-01T00:00:15+00:00", "2026-01-01T00:00:30+00:00", "2026-01-01T00:00:45+00:00"]
    assert fires("0 0 9-17/4 * * mon-fri", "2026-01-02T16:00:00", 3) == [  # Friday 17:00, then Monday
        "2026-01-02T17:00:00+00:00", "2026-01-05T09:00:00+00:00", "2026-01-05T13:00:00+00:00"]
    assert fires("0 0 0 29 2 *", "2026-03-01T00:00:00", 2) == ["2028-02-29T00:00:00+00:00", "2032-02-29T00:00:00+00:00"]
    assert fires("0 0 0 31 * *", "2026-01-31T00:00:00", 2) == ["2026-03-31T00:00:00+00:00", "2026-05-31T00:00:00+00:00"]
    assert fires("59 59 23 31 12 *", "2026-12-31T23:59:58", 1) == ["2026-12-31T23:59:59+00:00"]
    assert cron_next(parse_cron("0 0 0 30 2 *"), UTC, 0) is None  # never: past the five years


def test_cron_day_of_month_or_day_of_week():
    # both restricted: either matches (the 13th, and every Friday); one is *: both must
    assert fires("0 0 0 13 * fri", "2026-02-01T00:00:00", 4) == [
        "2026-02-06T00:00:00+00:00", "2026-02-13T00:00:00+00:00", "2026-02-20T00:00:00+00:00", "2026-02-27T00:00:00+00:00"]
    assert fires("0 0 0 13 * fri", "2026-03-01T00:00:00", 2) == ["2026-03-06T00:00:00+00:00", "2026-03-13T00:00:00+00:00"]
    assert fires("0 0 0 * * fri", "2026-02-01T00:00:00", 2) == ["2026-02-06T00:00:00+00:00", "2026-02-13T00:00:00+00:00"]
    assert fires("0 0 0 1-31 * fri", "2026-02-01T00:00:00", 2) == ["2026-02-02T00:00:00+00:00", "2026-02-03T00:00:00+00:00"]
    assert fires("0 0 0 13 * */1", "2026-02-01T00:00:00", 1) == ["2026-02-13T00:00:00+00:00"]  # */1 is a star


def test_cron_in_time_zones():
    kolkata = ZoneInfo("Asia/Kolkata")  # +05:30
    assert [local(ep(t, kolkata)) for t in fires("0 0 0 * * *", "2026-06-01T12:00:00", 1, kolkata)] == [
        "2026-06-01T18:30:00+00:00"]
    lord_howe = ZoneInfo("Australia/Lord_Howe")  # a 30-minute daylight-saving shift
    assert fires("0 0 9 * * *", "2026-06-01T00:00:00", 1, lord_howe) == ["2026-06-01T09:00:00+10:30"]


def test_cron_on_daylight_saving_days_as_the_server_does():
    # New York springs forward on 2026-03-08 (02:00 -> 03:00): 02:30 does not exist that day, no firing
    assert fires("0 30 2 * * *", "2026-03-07T12:00:00", 2, NY) == ["2026-03-09T02:30:00-04:00", "2026-03-10T02:30:00-04:00"]
    assert fires("0 30 3 * * *", "2026-03-07T12:00:00", 1, NY) == ["2026-03-08T03:30:00-04:00"]
    # ... and falls back on 2026-11-01 (02:00 -> 01:00): 01:30 happens twice, and fires twice
    assert fires("0 30 1 * * *", "2026-10-31T12:00:00", 3, NY) == [
        "2026-11-01T01:30:00-04:00", "2026-11-01T01:30:00-05:00", "2026-11-02T01:30:00-05:00"]
    # hourly through the change: every real hour once (23 hours on the spring day)
    spring = fires("0 0 * * * *", "2026-03-08T00:00:00", 23, NY)
    assert len(set(spring)) == 23 and spring[1] == "2026-03-08T03:00:00-04:00" and spring[-1].startswith("2026-03-09T00")


def test_go_date_carries_over_and_places_gaps_like_go():
    assert S._go_date(2026, 13, 1, 0, 0, 0, UTC) == ep("2027-01-01T00:00:00")
    assert S._go_date(2026, 1, 32, 0, 0, 0, UTC) == ep("2026-02-01T00:00:00")
    assert S._go_date(2026, 3, 8, 2, 30, 0, NY) == ep("2026-03-08T06:30:00")  # in the gap: 01:30 EST
    assert S._go_date(2026, 11, 1, 1, 30, 0, NY) == ep("2026-11-01T05:30:00")  # twice: the first (EDT)


@st.composite
def crons(draw):
    def field(low, high):
        kind = draw(st.sampled_from(["*", "n", "range", "step", "list"]))
        a = draw(st.integers(low, high))
        b = draw(st.integers(a, high))
        return {"*": "*", "n": str(a), "range": f"{a}-{b}", "step": f"{a}-{b}/{draw(st.integers(1, 7))}",
                "list": f"{a},{b}"}[kind]
    return " ".join([field(0, 59), field(0, 59), field(0, 23), field(1, 31), "*", field(0, 6)])


def first_match(cron: Cron, start: int, horizon: int) -> int | None:
    """The first second after ``start`` (before ``start + horizon``) whose UTC fields match, found by
    walking the clock: a day, an hour or a minute that cannot match is skipped whole."""
    t = start + 1
    while t < start + horizon:
        d = datetime.fromtimestamp(t, timezone.utc)
        if not cron.day_matches(d) or d.month not in cron.months:
            t += 86400 - t % 86400
        elif d.hour not in cron.hours:
            t += 3600 - t % 3600
        elif d.minute not in cron.minutes:
            t += 60 - t % 60
        elif d.second not in cron.seconds:
            t += 1
        else:
            return t
    return None


@settings(max_examples=200, deadline=None)
@given(crons(), st.integers(ep("2026-01-01T00:00:00"), ep("2027-01-01T00:00:00")))
def test_cron_next_is_the_first_matching_second_in_utc(expr, start):
    """Without daylight saving the iterator is plain: the first second after start whose fields match."""
    cron = parse_cron(expr)
    got, horizon = cron_next(cron, UTC, start), 62 * 86400
    expected = first_match(cron, start, horizon)
    assert got == expected or (expected is None and (got is None or got >= start + horizon)), (expr, got, expected)


def test_previous_instant():
    cron = parse_cron("*/5 * * * * *")
    assert S.cron_previous(cron, UTC, ep("2026-01-01T00:00:10"), ep("2026-01-01T00:00:05")) == ep("2026-01-01T00:00:05")
    yearly = parse_cron("@yearly")
    assert S.cron_previous(yearly, UTC, ep("2027-01-01T00:00:00"), ep("2026-03-01T00:00:00")) == ep("2026-01-01T00:00:00")


# ------------------------------------------------------------------------------------ validation
def test_check_normalizes_each_kind():
    assert S.check({"path": "p/a", "cron": "@daily", "timezone": "Europe/Paris"}, now=NOW, max_bytes=1 << 20) == {
        "path": "p/a", "version": None, "workload": {}, "spec": {"cron": "0 0 0 * * *", "timezone": "Europe/Paris"}}
    assert S.check({"path": "p", "every": "PT5M", "version": 3, "workload": {"x": 1}, "name": "nightly-1"},
                   now=NOW, max_bytes=1 << 20) == {"path": "p", "version": 3, "workload": {"x": 1}, "id": "nightly-1",
                                                    "spec": {"every": 300}}
    assert S.check({"path": "p", "at": "2026-06-01T14:00:00+02:00"}, now=NOW - 1, max_bytes=1 << 20)["spec"] == {
        "at": "2026-06-01T12:00:00Z"}


def test_check_lists_every_error_with_its_location():
    found = errors({"path": "", "version": 0, "workload": [1], "cron": "* * *", "every": 5, "timezone": "Mars/Base",
                    "name": "a.b", "colour": "red"})
    by = {e["location"]: e["message"] for e in found}
    assert set(by) == {"colour", "path", "version", "workload", "name", "", "timezone"}
    assert "exactly one of cron, every or at (got cron, every)" in by[""]
    assert "cron only" in by["timezone"]


@pytest.mark.parametrize("body, location, says", [
    ({"path": "p"}, "", "got none"),
    ({"path": "p", "cron": "0 0 0 * * *", "timezone": "europe/paris"}, "timezone", "not known"),
    ({"path": "p", "cron": "0 0 0 * * *", "timezone": "Local"}, "timezone", "not an IANA"),
    ({"path": "p", "cron": "0 0 0 * * *", "timezone": "../../etc/passwd"}, "timezone", "not an IANA"),
    ({"path": "p", "cron": "0 0 0 31 2 *"}, "cron", "never fires"),
    ({"path": "p", "every": "500ms"}, "every", "at least 1"),
    ({"path": "p", "every": 1.5}, "every", "whole number"),
    ({"path": "p", "every": "400d"}, "every", "over the maximum"),
    ({"path": "p", "every": "soon"}, "every", "not a duration"),
    ({"path": "p", "at": "2026-06-01T11:00:00Z"}, "at", "in the past"),
    ({"path": "p", "at": "2026-07-01T11:00:00"}, "at", "no time zone"),
    ({"path": "p", "at": "tomorrow"}, "at", "not an ISO-8601 instant"),
    ({"path": "p\x00x", "every": 5}, "path", "it holds '\\x00'"),
    ({"path": "../../etc/passwd", "every": 5}, "path", "segment '..' starts with '.'"),
    ({"path": "reports/./daily", "every": 5}, "path", "segment '.' starts with '.'"),
    ({"path": "/etc/passwd", "every": 5}, "path", "empty segment"),
    ({"path": "reports//daily", "every": 5}, "path", "empty segment"),
    ({"path": "reports\\daily", "every": 5}, "path", "it holds '\\\\'"),
    ({"path": "x" * 1025, "every": 5}, "path", "1025 characters"),
    ({"path": 7, "every": 5}, "path", "not a string"),
    ({"path": "p", "every": 5, "version": True}, "version", "whole number"),
])
def test_check_refuses(body, location, says):
    found = errors(body)
    assert any(e["location"] == location and says in e["message"] for e in found), found


def test_check_refuses_what_json_cannot_store():
    deep: dict = {}
    for _ in range(300):
        deep = {"d": deep}
    for workload in ({"n": 2**70}, deep):
        assert errors({"path": "p", "every": 5, "workload": workload})[0]["location"] == "workload"


def test_check_bounds_the_size():
    with pytest.raises(ScheduleError) as exc:
        S.check({"path": "p", "every": 5, "workload": {"blob": "x" * 2000}}, now=NOW, max_bytes=1000)
    assert exc.value.errors[0]["type"] == "too_large" and "max_schedule_bytes" in exc.value.errors[0]["message"]


# ------------------------------------------------------------------------------------ the schedule message
def record(spec: dict, **kw) -> dict:
    fields = {"path": "pb/daily", "workload": {"n": 1}, **spec}
    return S.definition(S.check(fields, now=NOW, max_bytes=1 << 20), schedule_id="s1", generation="g1",
                        created_by={"user_id": "u1", "username": "ann"}, now=NOW) | kw


def test_headers_of_each_kind():
    assert S.headers(record({"cron": "0 */5 * * * *", "timezone": "Europe/Paris"}), 3600) == {
        "Nats-Schedule": "0 */5 * * * *", "Nats-Schedule-Target": "noetl.schedule.fire.s1",
        "Nats-Schedule-TTL": "3600s", "Nats-Schedule-Time-Zone": "Europe/Paris"}
    assert S.headers(record({"every": "1m"}), 60)["Nats-Schedule"] == "@every 60s"
    assert S.headers(record({"at": "2027-01-01T00:00:00Z"}), 60)["Nats-Schedule"] == "@at 2027-01-01T00:00:00Z"
    assert "Nats-Schedule-Time-Zone" not in S.headers(record({"cron": "@daily"}), 60)
    assert S.id_of_subject("noetl.schedule.fire.s1") == "s1" and S.id_of_subject("noetl.schedule.fire.a.b") is None


def test_upcoming_fire_times():
    every = record({"every": 10})
    assert S.upcoming(every, NOW + 25, 3, anchor=NOW + 0.6) == [int(NOW) + 31, int(NOW) + 41, int(NOW) + 51]
    cron = record({"cron": "*/20 * * * * *"})
    assert S.upcoming(cron, NOW + 1, 2) == [int(NOW) + 20, int(NOW) + 40]
    # the server looks for a cron's next instant after the time its message was stored, not rounded:
    # stored at :19.6 it first fires at :20 (measured on nats-server 2.15: stored at :29.58, :39.18 and
    # :49.88, "*/10 * * * * *" fired at :30, :40 and :50)
    assert S.upcoming(cron, NOW + 19.6, 1, anchor=NOW + 19.6) == [int(NOW) + 20]
    at = record({"at": "2026-06-02T00:00:00Z"})
    assert S.upcoming(at, NOW, 3) == [ep("2026-06-02T00:00:00")] and S.upcoming(at, NOW + 86400, 3) == []
    assert S.upcoming(S.with_paused(every, True, NOW), NOW, 3) == []
    view = S.view(at, NOW + 86400)
    assert view["status"] == "finished" and view["next_fire_time"] is None and "generation" not in view
    assert S.view(S.with_paused(every, True, NOW), NOW)["status"] == "paused"
    assert "workload" not in S.view(every, NOW, full=False) and S.view(every, NOW)["workload"] == {"n": 1}


# ------------------------------------------------------------------------------------ firings
def test_fire_time_from_the_servers_next():
    every = record({"every": 5})
    assert S.fire_time(every, "2026-06-01T12:00:10Z", NOW + 5.003) == int(NOW) + 5
    cron = record({"cron": "0 */15 * * * *", "timezone": "Asia/Kolkata"})
    # a late firing (stored 40 s after its time) still names its own instant
    assert S.fire_time(cron, "2026-06-01T17:45:00+05:30", NOW + 40.2) == int(NOW)
    assert S.fire_time(cron, None, NOW + 40.2) == int(NOW) + 40  # no header: the stored second
    assert S.fire_time(cron, "garbage", NOW + 40.2) == int(NOW) + 40
    at = record({"at": "2026-06-02T00:00:00Z"})
    assert S.fire_time(at, "purge", NOW + 86400.5) == ep("2026-06-02T00:00:00")


def fired_by(next_time: str | None = None, scheduler: str | None = "noetl.schedule.def.s1") -> dict[str, str]:
    """The headers the server writes on a firing."""
    return {k: v for k, v in (("Nats-Scheduler", scheduler), ("Nats-Schedule-Next", next_time)) if v is not None}


def test_a_firing_starts_one_derived_execution():
    rec = record({"every": 5})
    fired = {"id": "s1", "generation": "g1"}
    one = S.on_firing("noetl.schedule.fire.s1", fired, rec, fired_by("2026-06-01T12:00:10Z"), NOW + 5.01, NOW + 6)
    again = S.on_firing("noetl.schedule.fire.s1", fired, rec, fired_by("2026-06-01T12:00:10Z"), NOW + 5.01, NOW + 40)
    later = S.on_firing("noetl.schedule.fire.s1", fired, rec, fired_by("2026-06-01T12:00:15Z"), NOW + 10.01, NOW + 11)
    req = one.start
    assert req["execution_id"] == again.start["execution_id"] == S.execution_id("s1", int(NOW) + 5)
    assert req["event_id"] == again.start["event_id"] and later.start["execution_id"] != req["execution_id"]
    assert len(req["execution_id"]) == 24 and S.execution_id("s2", int(NOW) + 5) != req["execution_id"]
    assert req["name"] == "playbook.execution.requested" and req["source"] == "scheduler"
    assert refused(writer_of(req["source"]), req) is None
    assert req["data"] == {"playbook": None, "catalog": {"path": "pb/daily", "version": None}, "workload": {"n": 1},
                           "parent_execution_id": None, "requested_by": {"user_id": "u1", "username": "ann"},
                           "schedule": {"id": "s1", "fire_time": "2026-06-01T12:00:05Z"}}


@pytest.mark.parametrize("subject, fired, rec, headers, reason, stale", [
    ("noetl.schedule.fire.s1", {"id": "s1", "generation": "g1"}, None, fired_by(), "does not exist", True),
    ("noetl.schedule.fire.s1", {"id": "s1", "generation": "g0"}, "active", fired_by(), "earlier schedule", False),
    ("noetl.schedule.fire.s1", {"id": "s1", "generation": "g1"}, "paused", fired_by(), "is paused", False),
    ("noetl.schedule.fire.s2", {"id": "s1", "generation": "g1"}, "active", fired_by(), "names another", False),
    ("noetl.schedule.fire.s1", [1, 2], "active", fired_by(), "names another", False),
    ("noetl.schedule.fire.s1", {"id": "s1", "generation": "g1"}, "active", {}, "not written by the NATS", False),
    ("noetl.schedule.fire.s1", {"id": "s1", "generation": "g1"}, "active", fired_by(scheduler="noetl.schedule.def.s2"),
     "not written by the NATS", False),
])
def test_firings_that_start_nothing(subject, fired, rec, headers, reason, stale):
    current = None if rec is None else S.with_paused(record({"every": 5}), rec == "paused", NOW)
    decision = S.on_firing(subject, fired, current, headers, NOW, NOW)
    assert decision.start is None and reason in decision.reason and decision.stale == stale


def test_reconcile_makes_the_messages_follow_the_records():
    active, paused = record({"every": 5}), S.with_paused(record({"every": 5}) | {"id": "s2"}, True, NOW)
    due = record({"at": "2026-06-01T12:00:30Z"}) | {"id": "s3"}
    to_arm, to_disarm = S.reconcile({"s1": active, "s2": paused, "s3": due}, {"s2", "s3", "gone"}, NOW)
    assert [r["id"] for r in to_arm] == ["s1"] and to_disarm == ["gone", "s2"]
    # past its instant, an at is neither armed again nor removed (the server fired and dropped it)
    assert S.reconcile({"s3": due}, set(), NOW + 60) == ([], []) and S.reconcile({"s3": due}, {"s3"}, NOW + 60) == ([], [])


def test_pages_are_cut_by_count_and_bytes():
    items = [{"id": f"s{i}", "blob": "x" * 100} for i in range(10)]
    assert S.page(items, 0, 4, 1 << 20)["next_offset"] == 4
    small = S.page(items, 2, 100, 128 + 3 * 125)
    assert [i["id"] for i in small["schedules"]] == ["s2", "s3", "s4"] and small["next_offset"] == 5
    assert S.page(items, 8, 100, 1 << 20) == {"schedules": items[8:], "total": 10, "offset": 8, "next_offset": None}
    assert len(S.page(items, 0, 100, 10)["schedules"]) == 1  # at least one, however small the budget


def test_a_cron_is_a_value():
    assert parse_cron("0 0 0 * * *") == parse_cron("@daily") and isinstance(parse_cron("@daily"), Cron)


def test_a_firing_acts_for_the_creator_only_while_the_creator_could_start_it():
    record = {"created_by": {"user_id": "u1", "username": "ann"}}
    ok = {"exists": True, "active": True, "roles": ["developer"]}
    assert S.creator_refusal(record, ok) is None
    assert S.creator_refusal(record, {**ok, "active": False}) == "its creator ann is disabled"
    assert "no longer has a role" in S.creator_refusal(record, {**ok, "roles": ["viewer"]})
    assert "no longer exists" in S.creator_refusal(record, {"exists": False, "active": False, "roles": []})
    assert "no longer exists" in S.creator_refusal({}, None)
    # made with an API token: no longer than the token lives; made in a session: the user's own
    by_token = {"created_by": {"user_id": "u1", "username": "ann", "kind": "token", "token_id": "t1"}}
    assert S.standing_request(by_token) == {"user_id": "u1", "token_id": "t1"}
    assert S.standing_request({"created_by": {"user_id": "u1", "kind": "session", "session_id": "s1"}}) == {"user_id": "u1"}
    assert S.standing_request({}) is None
    assert S.creator_refusal(by_token, {**ok, "token_active": True}) is None
    assert S.creator_refusal(by_token, {**ok, "token_active": False}) == "the API token ann created it with is revoked or expired"
    paused = S.with_paused({"id": "x", "paused": False}, True, 0, "its creator ann is disabled")
    assert paused["paused_reason"] == "its creator ann is disabled"
    assert "paused_reason" not in S.with_paused(paused, False, 1)  # resumed: the reason goes


VALID_PATHS = ("p", "reports/daily", "a-b/c_d/v1.2", "_x/-y")


@pytest.mark.parametrize("path", [*VALID_PATHS, "../../etc/passwd", "..", "a/./b", "/abs", "a/", "a//b", "a b", "a\\b",
                                  "a\x00b", "é/x", ".hidden/x", "x" * 1025])
def test_a_schedule_path_is_refused_exactly_when_the_catalog_would_refuse_it(path):
    """One rule (lang/paths.py) for the catalog's metadata.path and a schedule's path."""
    from noetl_mesh.lang.paths import path_problem
    from noetl_mesh.lang.validate import validate

    doc = {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "n", "path": path},
           "workflow": [{"step": "start", "tool": {"kind": "noop"}}]}
    catalog = [e.message for e in validate(doc).errors if tuple(e.path[:2]) == ("metadata", "path")]
    try:
        S.check({"path": path, "every": 5}, now=NOW, max_bytes=1 << 20)
        schedule = []
    except ScheduleError as exc:
        schedule = [e["message"] for e in exc.errors if e["location"] == "path"]
    assert bool(catalog) == bool(schedule) == (path not in VALID_PATHS), (catalog, schedule)
    if schedule:
        assert schedule[0].endswith(path_problem(path))
        assert any(m == path_problem(path) or "NUL" in m for m in catalog), catalog


def test_a_cron_first_fire_is_announced_as_the_server_fires_it():
    """Created at 05:02:49.7, every 10 s: the server fires at 05:02:50; the answer says so too (the
    anchor, when the server took the schedule, is not rounded up past the next instant)."""
    created = datetime(2026, 11, 27, 5, 2, 49, 700000, tzinfo=timezone.utc).timestamp()
    rec = record({"cron": "*/10 * * * * *"})
    assert S.view(rec, created, anchor=created)["next_fire_time"] == "2026-11-27T05:02:50Z"
    assert S.view(rec, created, 3, anchor=created)["next_fire_times"] == [
        "2026-11-27T05:02:50Z", "2026-11-27T05:03:00Z", "2026-11-27T05:03:10Z"]


def test_a_five_field_cron_is_told_its_own_six_field_form_once():
    with pytest.raises(S.ScheduleError) as exc:
        S.parse_cron("*/5 * * * *")
    (error,) = exc.value.errors
    assert error["message"].endswith("(five fields? add the seconds first: '0 */5 * * * *')")
    with pytest.raises(S.ScheduleError) as exc:
        S.parse_cron("15 3 * * mon")
    assert "'0 15 3 * * mon'" in exc.value.errors[0]["message"]
    from noetl_mesh.client import GatewayError

    message = f"body.spec.cron: {error['message']}"
    body = {"detail": {"message": message, "errors": [{"location": "body.spec.cron", "message": error["message"]}]}}
    assert str(GatewayError(422, body)).count("five fields?") == 1  # said once, not again as its own error


def test_the_id_of_the_token_that_made_a_schedule_is_kept_for_the_scheduler_only():
    """The scheduler keeps the token's id (revoking that token pauses the schedule); an execution it
    starts and the schedule as the API shows it never carry it: the sessions service takes a live
    token's id as proof of who asks, and every viewer reads the log."""
    maker = {"user_id": "u1", "username": "ann", "kind": "token", "token_id": "t9", "roles": ["developer"]}
    rec = S.definition(S.check({"path": "pb/daily", "every": 5}, now=NOW, max_bytes=1 << 20), schedule_id="s1",
                       generation="g1", created_by=maker, now=NOW)
    assert rec["created_by"]["token_id"] == "t9"
    fired = S.on_firing("noetl.schedule.fire.s1", {"id": "s1", "generation": "g1"}, rec,
                        fired_by("2026-06-01T12:00:10Z"), NOW + 5.01, NOW + 6)
    assert fired.start["data"]["requested_by"] == {"user_id": "u1", "username": "ann", "kind": "token",
                                                    "roles": ["developer"]}
    assert "token_id" not in S.view(rec, NOW)["created_by"]
