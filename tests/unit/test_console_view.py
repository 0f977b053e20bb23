"""The console's pure parts: the playbook's net, the view of a folded state at any point of a log (time
travel, D22), bounded previews, the recorder's notices and counters, the gateway's merging of live
notices, SSE framing, instants."""
from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from noetl_mesh.core import view
from noetl_mesh.core.local import run_local
from noetl_mesh.core.state import fold
from noetl_mesh.infra.bus import INFO_EVENTS, LOOP_EVENTS, DISPATCH_EVENTS
from noetl_mesh.lang.validate import validate_file, validate_text
from noetl_mesh.services.event_recorder import live as notices_mod
from noetl_mesh.services.event_recorder import schema
from noetl_mesh.services.gateway import live
from noetl_mesh.services.gateway.console import _instant
from noetl_mesh.services.gateway.app import HTTPException

ROOT = Path(__file__).resolve().parents[2]
FORK_JOIN = validate_file(ROOT / "examples" / "fork_join.yaml").document

CYCLE = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: cycle, path: t/cycle}
workflow:
  - step: start
    next: {arcs: [{step: work}]}
  - step: work
    loop: {in: "{{ range(3) | list }}", iterator: i, spec: {mode: parallel, max_in_flight: 2}}
    tool: {kind: noop, result: 1}
    next:
      arcs:
        - {step: work, when: "{{ ctx.again | default(false) }}"}
        - {step: end}
  - step: end
    tool: {kind: noop, result: 2}
"""


def ctl_only(events):
    skip = INFO_EVENTS | LOOP_EVENTS | DISPATCH_EVENTS
    return [e for e in events if e["name"] not in skip]


# ------------------------------------------------------------------------------------------ the net
def test_the_net_of_fork_join_names_its_join_entry_and_arcs():
    net = view.net(FORK_JOIN)
    nodes = {n["id"]: n for n in net["nodes"]}
    assert net["entry"] == "start" and nodes["start"]["entry"] and nodes["start"]["router"] == "inclusive"
    assert nodes["report"]["join"] and not nodes["eu"]["join"] and nodes["eu"]["kinds"] == ["python"]
    edges = {e["id"]: e for e in net["edges"]}
    assert set(edges) == {"start#0->eu", "start#1->us", "start#2->apac", "eu#0->report", "us#0->report",
                          "apac#0->report"}
    assert edges["start#0->eu"]["when"] == "{{ 'eu' in workload.regions }}"
    assert edges["start#0->eu"]["args"] == {"region": "eu"} and not any(e["back"] for e in edges.values())


def test_back_edges_loops_and_join_any_are_marked():
    doc = validate_text(CYCLE).document
    net = view.net(doc)
    nodes = {n["id"]: n for n in net["nodes"]}
    assert nodes["work"]["loop"] == {"mode": "parallel", "max_in_flight": 2, "iterator": "i"}
    edges = {e["id"]: e for e in net["edges"]}
    assert edges["work#0->work"]["back"] and not edges["work#1->end"]["back"] and not edges["start#0->work"]["back"]
    any_join = {**FORK_JOIN, "workflow": [{**s, "spec": {"join": "any"}} if s["step"] == "report" else s
                                          for s in FORK_JOIN["workflow"]]}
    report = next(n for n in view.net(any_join)["nodes"] if n["id"] == "report")
    assert report["join_any"] and not report["join"]
    assert view.net(None) == {"entry": None, "nodes": [], "edges": []}


# ------------------------------------------------------------------------------- the view in time
def test_time_travel_shows_the_join_waiting_then_fired_with_the_engines_fold():
    run = asyncio.run(run_local(FORK_JOIN))
    log = run.log_of(run.execution_id)
    admitted = next(i for i, e in enumerate(log) if e["name"] == "step.admitted" and e["step"] == "report")
    before = view.execution_view(fold(ctl_only(log[:admitted]), run.execution_id))
    assert before["steps"]["report"] == {"status": "waiting", "runs": 0, "skipped": 0, "active": 0, "tokens": 2}
    assert {t["place"] for t in before["tokens"]} == {"eu#0->report", "us#0->report"}
    assert before["steps"]["eu"]["status"] == before["steps"]["us"]["status"] == "done"
    assert before["steps"]["apac"]["status"] == "idle" and before["status"] == "RUNNING"
    after = view.execution_view(fold(ctl_only(log), run.execution_id))
    assert after["steps"]["report"]["status"] == "done" and after["tokens"] == [] and after["finished"]
    assert after["runs"]["report"]["shown"][0]["args"] == {"eu_orders": 120, "us_orders": 80}
    assert after["runs"]["report"]["shown"][0]["result"] == {"total_orders": 200}
    # the whole log and its ctl events fold to the same view (what the recorder folds)
    whole = view.execution_view(fold(log, run.execution_id))
    assert whole["steps"] == after["steps"] and whole["ctx"] == after["ctx"]
    assert view.execution_view(fold([], run.execution_id))["steps"] == {}


def test_previews_bound_every_value_and_say_how_big_it_was():
    assert view.preview("short") == "short" and view.preview(None) is None and view.preview(12) == 12
    big = [{"i": i, "pad": "x" * 20} for i in range(100_000)]
    p = view.preview(big, 1024)
    assert p["$items"] == 100_000 and p["$size"] == len(orjson.dumps(big)) and len(p["$preview"].encode()) <= 1024
    assert view.preview("é" * 2000, 1024)["$size"] == 2 + 2 * 2000
    wide = {f"k{i}": i for i in range(1000)}
    bounded = view._bounded_mapping(wide, 64)
    assert len(bounded) == view.MAX_KEYS + 1 and bounded["$more"] == 1000 - view.MAX_KEYS


def test_a_view_is_fitted_to_the_reply_budget():
    run = asyncio.run(run_local(validate_text(CYCLE).document))
    state = fold(run.log_of(run.execution_id), run.execution_id)
    for run_ in state.runs.values():
        run_.result = "r" * 50_000
    roomy = view.fitted(state, 10**7)
    assert roomy["trimmed"] == 0 and roomy["runs"]["work"]["shown"][0]["result"]["$size"] == 50_002
    tight = view.fitted(state, 1500)
    assert tight["trimmed"] > 0 and (len(orjson.dumps(tight)) <= 1500 or tight["trimmed"] == len(view.FITS))
    assert tight["steps"]["work"]["status"] == "done"


def test_loop_progress_counts_and_the_terminal_counts_win():
    counts = view.loop_counts([("r1", "loop.iteration.started", 10, None, None),
                               ("r1", "loop.iteration.done", 6, 100.0, 103.0),
                               ("r1", "loop.iteration.failed", 1, 101.0, 102.0), (None, "loop.iteration.done", 9, 0, 0)])
    assert counts == {"r1": {"started": 10, "done": 6, "failed": 1, "first_at": 100.0, "last_at": 103.0}}
    running = view.loop_progress(counts["r1"], 100, None, "parallel", 16)
    assert running == {"total": 100, "done": 6, "failed": 1, "in_flight": 3, "rate": 2.3, "mode": "parallel",
                       "max_in_flight": 16}
    ended = view.loop_progress(counts["r1"], 100, {"total": 100, "done": 99, "failed": 1})
    assert ended["done"] == 99 and ended["in_flight"] == 0
    assert view.loop_progress(counts["r1"], 100, None, over=True)["in_flight"] == 0  # cancelled


# ------------------------------------------------------------------------------ the recorder's parts
def test_notices_of_a_batch_are_bounded_and_in_log_order():
    records = [(i, {"event_id": f"e{i}", "execution_id": "x1", "name": "loop.iteration.done", "step": "s",
                    "iteration": i, "data": {"result": "big" * 100}}) for i in range(500)]
    records.append((900, {"event_id": "w", "execution_id": "x1", "name": "workflow.finished",
                          "data": {"status": "COMPLETED"}}))
    records.append((901, {"event_id": "o", "execution_id": "x.2", "name": "workflow.started"}))  # not a token
    per, listed = notices_mod.notices(records)
    assert list(per) == ["x1"]
    n = per["x1"]
    assert n["count"] == 501 and n["names"] == {"loop.iteration.done": 500, "workflow.finished": 1}
    assert n["status"] == "COMPLETED" and len(n["events"]) == notices_mod.LAST_EVENTS
    assert [e["seq"] for e in n["events"]] == sorted(e["seq"] for e in n["events"]) and n["events"][-1]["seq"] == 900
    assert all("data" not in e for e in n["events"]) and len(orjson.dumps(n)) < 8000
    assert listed == {"executions": [{"execution_id": "x1", "event": "workflow.finished"}], "more": 0}
    assert notices_mod.notices([(1, {"event_id": "a", "execution_id": "x", "name": "step.done"})])[1] is None


def test_notices_are_made_only_for_what_someone_watches():
    records = [(1, {"event_id": "a", "execution_id": "x1", "name": "workflow.started"}),
               (2, {"event_id": "b", "execution_id": "x2", "name": "step.done"}),
               (3, {"event_id": "c", "execution_id": "x2", "name": "workflow.finished", "data": {"status": "FAILED"}})]
    per, listed = notices_mod.notices(records, lambda key: key == "x2")
    assert list(per) == ["x2"] and per["x2"]["count"] == 2 and per["x2"]["status"] == "FAILED"
    assert listed is None  # nobody watches the list
    per, listed = notices_mod.notices(records, lambda key: key == notices_mod.LIST)
    assert per == {} and [e["execution_id"] for e in listed["executions"]] == ["x1", "x2"]


def test_interest_keeps_announced_keys_for_their_ttl_and_ignores_what_is_not_a_key():
    interest = notices_mod.Interest(everything_until=10.0)
    assert interest.wants("anything", 9.9) and not interest.wants("anything", 10.0)  # a starting recorder
    taken = interest.announce({"keys": ["x1", "*", "a.b", 5, None, "x" * 200], "ttl": 15}, now=100.0)
    assert taken == 2 and interest.wants("x1", 114.9) and interest.wants("*", 100.0)
    assert not interest.wants("x1", 115.0) and not interest.wants("a.b", 100.0)
    interest.announce({"keys": ["x1"], "ttl": 10 ** 9}, now=200.0)  # a ttl is cut to MAX_TTL
    assert interest.wants("x1", 200.0 + notices_mod.MAX_TTL - 1) and not interest.wants("x1", 200.0 + notices_mod.MAX_TTL)
    for bad in (None, [], {"keys": "x1"}, {"keys": ["x9"], "ttl": "long"}, {"keys": ["x8"], "ttl": True}):
        interest.announce(bad, now=300.0)
    assert interest.wants("x9", 300.0 + notices_mod.TTL - 1) and interest.wants("x8", 301.0)  # a bad ttl: the default
    many = notices_mod.Interest()
    many.announce({"keys": [f"k{i}" for i in range(notices_mod.MAX_KEYS + 5)]}, now=0.0)
    assert len(many.keys) == notices_mod.MAX_KEYS  # at most MAX_KEYS from one announcement


def test_the_state_condition_is_the_partial_indexs_predicate():
    ddl = dict((v, d) for v, _, d in schema.MIGRATIONS)[5]
    assert f"WHERE {schema.STATE_EVENTS_SQL};" in ddl and schema.LOOP_EVENTS_SQL in ddl
    for name in ("task.started", "loop.iteration.done", "loop.started", "step.started"):
        assert f"'{name}'" in schema.STATE_EVENTS_SQL
    assert "'step.done'" not in schema.STATE_EVENTS_SQL and "'workflow.finished'" not in schema.STATE_EVENTS_SQL


# ------------------------------------------------------------------------------- the gateway's parts
def test_pending_merges_notices_whatever_their_rate():
    async def go():
        p = live.Pending()
        for k in range(1000):
            p.add_notice({"count": 3, "names": {"loop.iteration.done": 2, f"n{k}": 1},
                          "events": [{"seq": 3 * k + j} for j in range(3)]})
        p.set_state({"status": "RUNNING"})
        assert p.wake.is_set()
        out = dict(p.take())
        assert out["events"]["count"] == 3000 and len(out["events"]["events"]) == live.TAIL
        assert out["events"]["events"][-1] == {"seq": 2999} and len(out["events"]["names"]) == 64
        assert out["events"]["names"]["loop.iteration.done"] == 2000 and out["state"] == {"status": "RUNNING"}
        assert p.take() == [] and not p.wake.is_set()
        for k in range(500):
            p.add_listed({"executions": [{"execution_id": f"x{k}", "event": "workflow.started"}]})
        out = dict(p.take())
        assert len(out["executions"]["changed"]) == live.MAX_CHANGED and out["executions"]["more"] == 300
        p.add_notice({"count": "many", "names": "no", "events": [1, None]})  # odd notices change nothing
        assert p.take() == []

    asyncio.run(go())


def test_stream_admission_is_limited_per_session_and_in_total():
    from noetl_mesh import limits

    hub = live.Hub(bus=None)  # type: ignore[arg-type]
    with limits.override(max_live_streams=3, max_live_streams_per_session=2):
        a1, a2 = hub.admit("tok-a"), hub.admit("tok-a")
        with pytest.raises(live.Busy) as busy:
            hub.check("tok-a")
        assert busy.value.status == 429 and "max_live_streams_per_session" in str(busy.value)
        hub.admit("tok-b")
        with pytest.raises(live.Busy) as full:
            hub.admit("tok-c")
        assert full.value.status == 503
        hub.release(a1)
        hub.check("tok-c")
        hub.release(a2)
        assert hub.streams == 1 and list(hub.per_session.values()) == [1]


def test_a_revocation_notice_ends_its_sessions_streams_and_rechecks_its_users():
    async def go():
        hub = live.Hub(bus=None)  # type: ignore[arg-type]
        ann_s = {"user_id": "u1", "kind": "session", "session_id": "s1"}
        ann_t = {"user_id": "u1", "kind": "token", "token_id": "t1"}
        bob = {"user_id": "u2", "kind": "session", "session_id": "s2"}
        streams = {name: live.Pending() for name in ("ann_s", "ann_s2", "ann_t", "bob")}
        for name, who in (("ann_s", ann_s), ("ann_s2", ann_s), ("ann_t", ann_t), ("bob", bob)):
            hub.hold(streams[name], who)
        assert hub.revoked({"session_id": "s1", "user_id": "u1", "reason": "logout"}) == 2
        for name in ("ann_s", "ann_s2"):
            assert streams[name].wake.is_set() and streams[name].ended == {
                "reason": "revoked", "cause": "logout",
                "message": "the stream's session was revoked (logout): log in again"}
        assert streams["ann_t"].ended is None and not streams["bob"].wake.is_set()
        assert hub.revoked({"token_id": "t1", "user_id": "u1", "reason": "revoked"}) == 1
        assert "API token was revoked" in streams["ann_t"].ended["message"]
        # a notice naming only the user: each of its streams checks its token now (not ended blindly)
        assert hub.revoked({"user_id": "u2", "reason": "user_disabled"}) == 1
        assert streams["bob"].recheck == "user_disabled" and streams["bob"].ended is None
        assert hub.revoked(None) == 4 and streams["ann_t"].recheck == "an unreadable revocation notice"
        assert hub.revoked({"session_id": "nobody's", "reason": "logout"}) == 0
        for name, who in (("ann_s", ann_s), ("ann_s2", ann_s), ("ann_t", ann_t), ("bob", bob)):
            hub.unhold(streams[name], who)
        assert hub.holders == {} and hub.by_user == {}

    asyncio.run(go())


def test_server_sent_events_are_one_json_line_each():
    frame = live.sse("state", {"a": "line\nbreak", "n": 1})
    assert frame == b'event: state\ndata: {"a":"line\\nbreak","n":1}\n\n'


def test_instants_are_iso_or_epoch_seconds():
    assert _instant("1700000000", "q") == 1_700_000_000.0
    assert _instant("2023-11-14T22:13:20Z", "q") == 1_700_000_000.0
    assert _instant("2023-11-14T22:13:20", "q") == 1_700_000_000.0  # no zone: UTC
    assert _instant("", "q") is None and _instant(None, "q") is None
    with pytest.raises(HTTPException) as bad:
        _instant("yesterday", "query.since")
    assert bad.value.status_code == 422


WAITING = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: waiting, path: t/waiting}
workflow:
  - step: start
    tool: {kind: noop, result: 1}
    next: {spec: {mode: inclusive}, arcs: [{step: approve}, {step: each}]}
  - step: approve
    tool: [{name: ask, kind: wait, signal: approve, timeout: 1h}]
  - step: each
    loop: {in: "{{ range(2) | list }}", iterator: i, spec: {mode: parallel, max_in_flight: 2}}
    tool: [{name: ask, kind: wait, signal: "go-{{ iter.i }}", timeout: 1h}]
"""


def iterations(log):
    """Each loop run's iteration counts, as the recorder counts them (view.loop_counts of grouped rows)."""
    groups: dict[tuple[str, str], int] = {}
    for e in log:
        if e["name"].startswith("loop.iteration."):
            groups[(e["step_run_id"], e["name"])] = groups.get((e["step_run_id"], e["name"]), 0) + 1
    return view.loop_counts([(run, name, n, 0.0, 0.0) for (run, name), n in groups.items()])


def test_a_step_waiting_for_a_signal_is_waiting_not_running():
    """D30: a run suspended at a wait task is drawn waiting (a loop: every iteration in flight waits)."""
    run = asyncio.run(run_local(validate_text(WAITING).document, signals=[(1, "approve", True), (2, "go-0", 1)]))
    log = run.log_of(run.execution_id)
    started = [i for i, e in enumerate(log) if e["name"] == "wait.started"]
    ended = [i for i, e in enumerate(log) if e["name"] == "wait.ended"]
    assert len(started) == 3 and len(ended) == 3  # the third at its timeout: the local clock jumps to it
    # the recorder folds the ctl events and counts a loop's iterations from the whole log up to the point
    both = max(started) + 1
    counts = iterations(log[:both])
    state = fold(ctl_only(log[:both]), run.execution_id)
    seen = view.execution_view(state, loops=counts)
    assert seen["steps"]["approve"]["status"] == "waiting" and seen["steps"]["each"]["status"] == "waiting"
    assert seen["runs"]["approve"]["shown"][0]["status"] == "waiting"
    # once approve is answered it runs on (and is done); the loop, one iteration answered and ended, waits
    # for the other one
    answered = next(i for i, e in enumerate(log) if e["name"] == "loop.iteration.done") + 1
    assert ended[1] < answered < ended[2]
    later = fold(ctl_only(log[:answered]), run.execution_id)
    seen = view.execution_view(later, loops=iterations(log[:answered]))
    assert seen["steps"]["approve"]["status"] == "done"
    assert seen["steps"]["each"]["status"] == "waiting"


FAILING_LOOP = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: failing_loop, path: t/failing_loop}
workflow:
  - step: start
    spec: {policy: {failure: {mode: best_effort}}}
    loop: {in: "{{ workload.items }}", iterator: i}
    tool:
      kind: noop
      result: "{{ iter.i }}"
      spec: {policy: {rules: [{when: "{{ iter.i < 0 }}", then: {do: fail}}, {else: {then: {do: continue}}}]}}
"""


@pytest.mark.parametrize("items, status", [([-1, -2, -3], "failed"), ([-1, 2, 3], "partial"), ([1, 2], "done")])
def test_a_loop_whose_iterations_failed_is_not_done(items, status):
    """best_effort: the loop ends loop.done with its counts; every iteration failed is failed, some partial."""
    doc = validate_text(FAILING_LOOP).document
    run = asyncio.run(run_local(doc, request={"workload": {"items": items}}))
    log = run.log_of(run.execution_id)
    done = next(e for e in log if e["name"] == "loop.done")
    ended = {done["step_run_id"]: done["data"]}
    seen = view.execution_view(fold(ctl_only(log), run.execution_id), ended_counts=ended)
    assert seen["status"] == "COMPLETED"
    assert seen["steps"]["start"]["status"] == status and seen["runs"]["start"]["shown"][0]["status"] == status


# ------------------------------------------------------------------------------------- the timeline
def timeline_of(log, xid, *, finished=True, now=None, buckets=10):
    """core/timeline.build over rows made from a whole log as the recorder's queries select them."""
    from noetl_mesh.core import timeline

    rows = [(i, e["name"], e["step"], e["step_run_id"], e["timestamp"],
             {k: (e["data"] or {}).get(k) for k in ("total", "done", "failed")} if e["name"] == "loop.done" else None)
            for i, e in enumerate(log) if e["name"] in timeline.RUN_EVENTS]
    runs, by_id = timeline.run_spans(rows)
    loops = {}
    for e in log:
        if e["name"] == "loop.started":
            loops[e["step_run_id"]] = {"started_at": e["timestamp"], "total": len(e["data"]["items"]),
                                       "started": 0, "done": 0, "failed": 0}
    for e in log:
        if e["name"].startswith("loop.iteration.") and e["step_run_id"] in loops:
            loops[e["step_run_id"]][e["name"].rsplit(".", 1)[-1]] += 1
    small = [rid for rid, loop in loops.items() if loop["started"] <= timeline.MAX_ITERATIONS]
    big = [rid for rid in loops if rid not in small]
    iterations = timeline.iteration_spans([(e["step_run_id"], e["iteration"], e["name"], e["timestamp"]) for e in log
                                           if e["name"].startswith("loop.iteration.") and e["step_run_id"] in small])
    start = log[0]["timestamp"]
    end = log[-1]["timestamp"] if finished else None
    hi = end or now
    width = (hi - start) / buckets

    def bucket(t):
        return 0 if t < start else buckets + 1 if t >= hi else int((t - start) / width) + 1

    counts = {}
    for e in log:
        if e["name"] in ("loop.iteration.done", "loop.iteration.failed") and e["step_run_id"] in big:
            counts[(e["step_run_id"], e["name"], bucket(e["timestamp"]))] = \
                counts.get((e["step_run_id"], e["name"], bucket(e["timestamp"])), 0) + 1
    tasks, total = timeline.task_spans(
        [(e["step_run_id"], e["name"], e["task"], e["iteration"], e.get("attempt"), e.get("task_run_id"),
          e["timestamp"], e["status"]) for e in log if e["name"] in timeline.TASK_EVENTS and e["step_run_id"] not in big],
        by_id)
    return timeline.build(execution={"execution_id": xid, "status": "COMPLETED", "start": start, "end": end},
                          runs=runs, loops=loops, iterations=iterations,
                          counts=timeline.histogram([(*k, n) for k, n in counts.items()], buckets),
                          tasks=tasks, tasks_total=total, waits=[], window=(start, hi), buckets=buckets,
                          now=now or hi)


def test_the_timeline_has_each_run_its_tasks_and_a_small_loops_iterations():
    run = asyncio.run(run_local(FORK_JOIN))
    log = run.log_of(run.execution_id)
    tl = timeline_of(log, run.execution_id)
    runs = {r["step"]: r for r in tl["runs"]}
    assert set(runs) == {"start", "eu", "us", "report"} and tl["runs_total"] == 4  # apac never ran
    for r in runs.values():
        assert r["status"] == "done" and r["admitted_at"] <= r["ended_at"]
        assert r["started_at"] is not None and r["admitted_at"] <= r["started_at"] <= r["ended_at"]
    report = runs["report"]["tasks"]
    assert [t["task"] for t in report] == ["report_task"] and report[0]["status"] == "done"
    assert runs["report"]["started_at"] <= report[0]["started_at"] <= report[0]["ended_at"] <= runs["report"]["ended_at"]
    loop = asyncio.run(run_local(validate_file(ROOT / "examples" / "loop.yaml").document))
    tl = timeline_of(loop.log_of(loop.execution_id), loop.execution_id)
    start = next(r for r in tl["runs"] if r["step"] == "start")
    assert start["loop"]["total"] == 3 and [i["iteration"] for i in start["loop"]["iterations"]] == [0, 1, 2]
    assert all(i["status"] == "done" and i["started_at"] <= i["ended_at"] for i in start["loop"]["iterations"])
    assert sorted((t["iteration"], t["task"]) for t in start["tasks"]) == [
        (i, name) for i in range(3) for name in ("label", "mean")]


BIG = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: big, path: t/big}
workflow:
  - step: start
    spec: {policy: {failure: {mode: best_effort}}}
    loop: {in: "{{ range(300) | list }}", iterator: i, spec: {mode: parallel, max_in_flight: 32}}
    tool:
      kind: noop
      result: "{{ iter.i }}"
      spec: {policy: {rules: [{when: "{{ iter.i % 10 == 0 }}", then: {do: fail}}, {else: {then: {do: continue}}}]}}
"""


def test_a_big_loop_is_counts_per_slice_never_its_iterations():
    run = asyncio.run(run_local(validate_text(BIG).document))
    tl = timeline_of(run.log_of(run.execution_id), run.execution_id, buckets=7)
    (loop_run,) = tl["runs"]
    loop = loop_run["loop"]
    assert "iterations" not in loop and "tasks" not in loop_run  # counted, not listed
    assert loop["total"] == 300 and loop["done"] == 270 and loop["failed"] == 30 and loop_run["status"] == "partial"
    slices = loop["slices"]
    assert set(slices) == {"done", "failed"} and len(slices["done"]) == 7 + 2
    assert sum(slices["done"]) == 270 and sum(slices["failed"]) == 30
    assert tl["window"]["buckets"] == 7 and tl["window"]["width"] == pytest.approx((tl["end"] - tl["start"]) / 7, abs=1e-5)


def test_timeline_runs_not_ended_are_running_waiting_or_cancelled():
    from noetl_mesh.core import timeline

    rows = [(1, "step.admitted", "a", "r1", 10.0, None), (2, "step.admitted", "b", "r2", 11.0, None),
            (3, "step.done", "a", "r1", 12.0, None), (4, "step.failed", "c", "rX", 13.0, {"kind": "x"}),
            (5, "step.admitted", "c", "r3", 14.0, None), (6, "step.failed", "c", "r3", 15.0, {"kind": "python_error"}),
            (7, "step.done", "a", "r1", 16.0, None)]
    runs, by_id = timeline.run_spans(rows)
    assert [(r["run_id"], r["status"]) for r in runs] == [("r1", "done"), ("r2", "running"), ("r3", "failed")]
    assert by_id["r1"]["ended_at"] == 12.0 and by_id["r3"]["error_kind"] == "python_error"  # the first terminal
    # a step that is no loop failed: the recorder's row names a loop's counts as null, and it is no loop
    failed, _ = timeline.run_spans([(1, "step.admitted", "s", "r", 1.0, None), (2, "step.failed", "s", "r", 2.0, {
        "kind": "python_error", "total": None, "done": None, "failed": None})])
    assert "counts" not in failed[0] and failed[0]["error_kind"] == "python_error"

    def built(end, waits=()):
        return timeline.build(execution={"execution_id": "x", "status": "RUNNING", "start": 10.0, "end": end},
                              runs=[dict(r) for r in runs], loops={}, iterations={}, counts={}, tasks={},
                              tasks_total=0, waits=waits, window=(10.0, 20.0), buckets=4, now=20.0)

    assert built(None)["runs"][1]["status"] == "running"
    waiting = built(None, [{"step_run_id": "r2", "kind": "signal", "signal": "go", "started_at": 11.5,
                            "ended_at": None}])["runs"][1]
    assert waiting["status"] == "waiting" and waiting["waits"][0]["signal"] == "go"
    cancelled = built(18.0)["runs"][1]
    assert cancelled["status"] == "cancelled" and cancelled["ended_at"] == 18.0
    spans, total = timeline.task_spans([("r2", "task.started", "t", None, 1, "a1", 11.1, "in_progress"),
                                        ("r2", "task.processed", "t", None, 1, "a1", 11.2, "error"),
                                        ("r2", "task.started", "t", None, 2, "a1", 11.3, "in_progress"),
                                        ("r2", "task.suspended", "t", None, 2, "a1", 11.4, "paused"),
                                        ("r9", "task.started", "t", None, 1, "a9", 11.3, "in_progress")], by_id, limit=1)
    assert total == 2 and [(s["attempt"], s["status"]) for s in spans["r2"]] == [(1, "failed")]  # the limit: 1
    spans, _ = timeline.task_spans([("r2", "task.started", "t", None, 2, "a1", 11.3, "in_progress"),
                                    ("r2", "task.suspended", "t", None, 2, "a1", 11.4, "paused")], by_id)
    assert spans["r2"][0]["status"] == "waiting" and spans["r2"][0]["suspended_at"] == 11.4


def test_log_stretches_are_merged_and_bounded():
    from noetl_mesh.core.timeline import ranges

    assert ranges([(10, 20), (15, 30), (40, 50), (31, 35)]) == [(10, 35), (40, 50)]
    assert ranges([(10, 20), (60, None), (70, 80)]) == [(10, 20), (60, None)]
    assert ranges([(10, None), (5, 6)]) == [(5, 6), (10, None)]
    # too many: the smallest gaps are merged first
    assert ranges([(0, 1), (10, 11), (100, 101), (103, 104)], most=2) == [(0, 11), (100, 104)]
    assert len(ranges([(i * 10, i * 10 + 1) for i in range(100)], most=4)) == 4
