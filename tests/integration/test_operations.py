"""What an operator sees of a running stack (two replicas of each scalable service): every replica is a
NATS micro service answering ``$SRV.PING/INFO/STATS`` (what ``nats micro ls|info|stats|ping`` read),
its figures move with the work done. The stack runs with one NATS user per service: answering ``$SRV``
must need no permission beyond theirs (the module fails on any violation)."""
from __future__ import annotations

import json
import time

import nats
import pytest

from conftest import start_stack, stop_stack
from noetl_mesh.contracts.subjects import LANES
from noetl_mesh.infra import micro
from noetl_mesh.infra.nats_auth import connect_options
from noetl_mesh.services.gateway.auth import CACHE_SECONDS

pytestmark = pytest.mark.integration

REPLICAS = {"noetl-event-recorder": 1, "noetl-credentials": 1, "noetl-sessions": 1, "noetl-gateway": 1, "noetl-admission": 2,
            "noetl-router": 2, "noetl-loop-coordinator": 2, "noetl-scheduler": 2, "noetl-worker-default": 2}
PLAYBOOK = {
    "apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "ops", "path": "tests/ops"},
    "workflow": [
        {"step": "start", "next": {"arcs": [{"step": "work"}]}},
        {"step": "work", "tool": {"kind": "python", "code": "result = {'n': 1}"}, "next": {"arcs": [{"step": "end"}]}},
        {"step": "end", "tool": {"kind": "noop"}},
    ],
}


@pytest.fixture(scope="module")
def ops(module_pg):
    server, loop, handle = start_stack(module_pg, replicas=2, workers=2)
    status, _ = handle.execute(PLAYBOOK)
    assert status["status"] == "COMPLETED", status
    yield handle
    stop_stack(server, loop, handle)


def ask(handle, verb: str, name: str | None = None, expect: int | None = None) -> list[dict]:
    async def go():
        nc = await nats.connect(handle.nats_url, **connect_options(handle.admin))
        try:
            return await micro.ask_all(nc, verb, name, timeout=5.0,
                                       enough=(lambda r: len(r) >= expect) if expect else None)
        finally:
            await nc.close()

    return handle.run(go())


def by_name(replies: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for reply in replies:
        out.setdefault(reply["name"], []).append(reply)
    return out


def test_every_replica_answers_ping_info_and_stats(ops):
    total = sum(REPLICAS.values())
    for verb, kind in (("PING", "ping"), ("INFO", "info"), ("STATS", "stats")):
        replies = ask(ops, verb, expect=total)
        assert {name: len(r) for name, r in by_name(replies).items()} == REPLICAS, verb
        assert all(r["type"] == f"io.nats.micro.v1.{kind}_response" for r in replies)
        assert len({r["id"] for r in replies}) == total  # one id per process
        assert all(r["version"] == micro.version() and r["metadata"]["service"] for r in replies)
    routers = ask(ops, "PING", "noetl-router", expect=2)  # by name: that service's replicas only
    assert {r["name"] for r in routers} == {"noetl-router"} and len(routers) == 2
    one = routers[0]["id"]
    async def by_id():
        nc = await nats.connect(ops.nats_url, **connect_options(ops.admin))
        try:
            return micro.orjson.loads((await nc.request(f"$SRV.INFO.noetl-router.{one}", b"", timeout=5)).data)
        finally:
            await nc.close()
    assert ops.run(by_id())["id"] == one


def test_info_lists_request_endpoints_consumers_and_partitions(ops):
    info = by_name(ask(ops, "INFO", expect=sum(REPLICAS.values())))
    recorder = info["noetl-event-recorder"][0]
    endpoints = {e["subject"]: e for e in recorder["endpoints"]}
    assert endpoints["noetl.q.execution.get"]["queue_group"] == "event-recorder"
    assert endpoints["noetl.q.execution.get"]["metadata"] == {"kind": "request"}
    assert endpoints["noetl.pevt.>"]["metadata"] == {  # one recorder here: it reads every partition
        "kind": "consumer", "stream": "NOETL_EVENTS", "durables": ",".join(f"event-recorder-p{p}" for p in range(16))}
    assert "recorder" in recorder["description"] or "event log" in recorder["description"]
    worker = info["noetl-worker-default"][0]
    assert worker["metadata"]["pool"] == "default" and worker["metadata"]["concurrency"]
    lanes = ",".join(f"lane-default-p{lane}" for lane in range(LANES))  # a durable per lane of the pool's queue
    assert [e["metadata"]["durables"] for e in worker["endpoints"]] == [lanes, "pool-default"]
    assert info["noetl-gateway"][0]["metadata"]["url"] == ops.url
    assert any(e["subject"] == "noetl.q.sessions.validate" for e in info["noetl-sessions"][0]["endpoints"])
    credentials = {e["subject"]: e for e in info["noetl-credentials"][0]["endpoints"]}  # the store left the recorder
    assert {"noetl.q.credential.get", "noetl.q.credential.resolve.*"} <= set(credentials)
    assert credentials["noetl.q.credential.resolve.*"]["queue_group"] == "credentials"
    assert not any(subject.startswith("noetl.q.credential.") for subject in endpoints)
    assert any(e["subject"] == "noetl.q.schedule.add" for e in info["noetl-scheduler"][0]["endpoints"])
    # the replicas of a control-plane service deal the partitions out between them
    deadline = time.monotonic() + 15
    while True:
        for name in ("noetl-admission", "noetl-router", "noetl-loop-coordinator"):
            shares = [set(map(int, filter(None, r["metadata"]["partitions"].split(","))))
                      for r in by_name(ask(ops, "INFO", name, expect=2))[name]]
            if len(shares) != 2 or shares[0] & shares[1] or shares[0] | shares[1] != set(range(16)):
                break
        else:
            break
        assert time.monotonic() < deadline, (name, shares)
        time.sleep(0.5)
    lc = by_name(ask(ops, "INFO", "noetl-loop-coordinator", expect=2))["noetl-loop-coordinator"][0]
    events = next(e for e in lc["endpoints"] if e["name"] == "events")
    assert events["metadata"]["durables"] == ",".join(f"loop-coordinator-all-p{p}" for p in
                                                      map(int, lc["metadata"]["partitions"].split(",")))
    assert lc["metadata"]["partition_count"] == "16"


def test_stats_move_with_the_work_done(ops):
    def totals() -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for reply in ask(ops, "STATS", expect=sum(REPLICAS.values())):
            for e in reply["endpoints"]:
                key = f"{reply['name']} {e['name']}"
                row = out.setdefault(key, {"requests": 0, "errors": 0})
                row["requests"] += e["num_requests"]
                row["errors"] += e["num_errors"]
        return out

    before = totals()
    time.sleep(CACHE_SECONDS + 0.1)  # the gateway asks the sessions service again (not its cached answer)
    status, _ = ops.execute(PLAYBOOK)
    assert status["status"] == "COMPLETED"
    deadline = time.monotonic() + 10
    while True:
        after = totals()
        moved = {k for k in after if after[k]["requests"] > before.get(k, {"requests": 0})["requests"]}
        wanted = {"noetl-router events", "noetl-admission events", "noetl-loop-coordinator events",
                  "noetl-worker-default commands", "noetl-event-recorder events", "noetl-event-recorder execution-get",
                  "noetl-sessions sessions-validate"}
        if wanted <= moved or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert wanted <= moved, (wanted - moved, after)
    assert after["noetl-worker-default commands"]["errors"] == 0
    # an error reply is counted as an error of its endpoint, with the last one's reason
    async def bad_request():
        nc = await nats.connect(ops.nats_url, **connect_options(ops.admin))
        try:
            await nc.request("noetl.q.execution.get", b"[1]", timeout=5)
        finally:
            await nc.close()
    ops.run(bad_request())
    stats = by_name(ask(ops, "STATS", "noetl-event-recorder", expect=1))["noetl-event-recorder"][0]
    get = next(e for e in stats["endpoints"] if e["subject"] == "noetl.q.execution.get")
    assert get["num_errors"] == after["noetl-event-recorder execution-get"]["errors"] + 1
    assert get["last_error"].startswith("bad_request") and get["average_processing_time"] > 0
    assert micro.uptime(stats["started"]) is not None and micro.uptime(stats["started"]) < 600


# ------------------------------------------------------------------------------ noetl ps, noetl inspect
def noetl_json(ops, capsys, *args: str):
    from noetl_mesh.cli import main

    code = main([*args, "--nats-url", ops.nats_url, "--nats-creds", ops.admin, "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def test_ps_lists_every_replica_with_its_partitions_work_and_lag(ops, capsys):
    rows = noetl_json(ops, capsys, "ps", "--wait", "3")
    counts = {name: sum(r["name"] == name for r in rows) for name in {r["name"] for r in rows}}
    assert counts == REPLICAS
    assert {r["service"] for r in rows} == {n.removeprefix("noetl-").removesuffix("-default") for n in REPLICAS}
    routers = [r for r in rows if r["service"] == "router"]
    assert sorted(p for r in routers for p in r["partitions"]) == list(range(16))
    assert sum(r["handled"] for r in routers) > 0 and all(r["failed"] == 0 for r in routers)
    assert all(c["durable"] == f"router-all-p{p}" for r in routers for c, p in zip(r["consumers"], r["partitions"]))
    assert all(r["uptime"] is not None and r["version"] == micro.version() for r in rows)
    workers = [r for r in rows if r["service"] == "worker"]
    assert all(r["pool"] == "default" and [c["durable"] for c in r["consumers"]]
               == [*(f"lane-default-p{lane}" for lane in range(LANES)), "pool-default"] for r in workers)
    assert all(r["partitions"] is None for r in workers)  # its lanes are no partitions of the events

    # a running command is a worker pool's pending acknowledgement: ps shows it while it runs
    slow = {**PLAYBOOK, "metadata": {"name": "slow", "path": "tests/slow"}, "workflow": [
        {"step": "start", "tool": {"kind": "python", "code": "import time\ntime.sleep(4)\nresult = 1"}}]}

    async def start():
        async with ops.client() as client:
            return await client.start(slow)

    eid = ops.run(start())
    deadline = time.monotonic() + 15
    while True:
        workers = [r for r in noetl_json(ops, capsys, "ps", "--wait", "1") if r["service"] == "worker"]
        if all(r["ack_pending"] == 1 and r["lag"] == 1 for r in workers):
            break
        assert time.monotonic() < deadline, workers
        time.sleep(0.2)

    async def finish():
        async with ops.client() as client:
            return await client.wait(eid, timeout=30)

    assert ops.run(finish())["status"] == "COMPLETED"
    deadline = time.monotonic() + 10
    while any(r["lag"] for r in noetl_json(ops, capsys, "ps", "--wait", "1") if r["service"] == "worker"):
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_inspect_shows_streams_consumers_buckets_and_object_stores(ops, capsys):
    streams = {r["name"]: r for r in noetl_json(ops, capsys, "inspect", "streams")}
    events = streams["NOETL_EVENTS"]
    assert events["messages"] > 0 and events["bytes"] > 0 and events["consumers"] >= 16 * 4
    assert events["subjects"] == ["noetl.evt.*.*.*", "noetl.sched.*.*"] and events["retention"] == "limits"
    assert streams["NOETL_COMMANDS"]["retention"] == "workqueue"
    assert [r["name"] for r in noetl_json(ops, capsys, "inspect", "streams", "NOETL_COMMANDS")] == ["NOETL_COMMANDS"]
    consumers = {(r["stream"], r["name"]): r for r in noetl_json(ops, capsys, "inspect", "consumers")}
    assert {f"router-all-p{p}" for p in range(16)} <= {name for _, name in consumers}
    assert ("NOETL_EVENTS", "event-recorder") not in consumers  # the earlier version's single durable
    recorder = [consumers[("NOETL_EVENTS", f"event-recorder-p{p}")] for p in range(16)]
    assert all(r["ack_policy"] == "all" for r in recorder)
    assert [r["filter"] for r in recorder] == [[f"noetl.pevt.{p}.>"] for p in range(16)]
    assert sum(r["delivered"] for r in recorder) and all(r["ack_floor"] <= r["delivered"] for r in recorder)
    assert consumers[("NOETL_COMMANDS", "pool-default")]["durable"] is True
    assert [consumers[("NOETL_COMMANDS", f"lane-default-p{lane}")]["filter"] for lane in range(LANES)] == \
        [[f"noetl.cmd.default.*.{lane}"] for lane in range(LANES)]
    only = noetl_json(ops, capsys, "inspect", "consumers", "NOETL_COMMANDS")
    assert {r["stream"] for r in only} == {"NOETL_COMMANDS"}
    kv = {r["bucket"]: r for r in noetl_json(ops, capsys, "inspect", "kv")}
    assert kv["noetl_members"]["ttl"] == 6 and kv["noetl_members"]["history"] == 1
    assert kv["noetl_members"]["keys"] >= 6  # a key per control-plane replica
    assert {"noetl_sessions", "noetl_users"} <= set(kv)
    objects = {r["bucket"]: r for r in noetl_json(ops, capsys, "inspect", "objects")}
    assert objects["noetl_payloads"]["ttl"] == 7 * 24 * 3600

    from noetl_mesh.cli import main  # the tables people read

    assert main(["inspect", "streams", "--nats-url", ops.nats_url, "--nats-creds", ops.admin]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[0].split() == ["STREAM", "MESSAGES", "SIZE", "CONSUMERS", "RETENTION", "MAX", "AGE", "REPLICAS",
                               "SUBJECTS"]
    assert any(line.startswith("NOETL_EVENTS ") and "7d0h" in line for line in text)
    assert main(["ps", "--nats-url", ops.nats_url, "--nats-creds", ops.admin]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[0].split()[:4] == ["SERVICE", "ID", "VERSION", "POOL"] and len(text) == 1 + sum(REPLICAS.values())


def test_bootstrap_makes_no_second_admin_and_never_overwrites_a_file(ops, tmp_path, capsys):
    from noetl_mesh.cli import main

    out = tmp_path / "admin.token"
    args = ["bootstrap", "--out", str(out), "--nats-url", ops.nats_url, "--nats-creds", ops.admin, "--timeout", "10"]
    assert main(args) == 1  # the stack made its admin when it started
    assert "has users already" in capsys.readouterr().err and not out.exists()
    out.write_text("kept\n")
    assert main(args) == 2 and out.read_text() == "kept\n"
    assert "exists" in capsys.readouterr().err
