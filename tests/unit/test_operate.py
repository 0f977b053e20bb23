"""``noetl ps`` and ``noetl inspect`` (cli/operate.py): the rows built from the micro services' STATS and
the JetStream API's JSON, the tables, where NATS is found. Against a running stack:
tests/integration/test_operations.py."""
from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timezone
from types import SimpleNamespace

import pytest

from noetl_mesh.cli import main, operate

NOW = datetime(2025, 1, 1, 12, 0, 0, tzinfo=timezone.utc)


def stats(name, id_, partitions=None, endpoints=(), **meta):
    metadata = {"service": name.removeprefix("noetl-").split("-default")[0], **meta}
    if partitions is not None:
        metadata["partitions"] = ",".join(map(str, partitions))
    return {"type": "io.nats.micro.v1.stats_response", "name": name, "id": id_, "version": "0.1.0",
            "started": "2025-01-01T11:58:00.000Z", "metadata": metadata, "endpoints": list(endpoints)}


def consumer(name, stream, durables, requests=0, errors=0, last_error=""):
    return {"name": name, "subject": "s", "queue_group": "q", "num_requests": requests, "num_errors": errors,
            "last_error": last_error, "processing_time": 0, "average_processing_time": 0,
            "data": {"kind": "consumer", "stream": stream, "durables": list(durables)}}


def request(name, requests, errors=0, last_error=""):
    return {"name": name, "subject": f"noetl.q.{name}", "queue_group": "q", "num_requests": requests,
            "num_errors": errors, "last_error": last_error, "processing_time": 0, "average_processing_time": 0,
            "data": None}


def stand_in() -> subprocess.Popen:
    """A process standing in for a running `noetl up` (its command line says so once it has started)."""
    import time

    up = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "noetl", "up"])
    while b"noetl" not in open(f"/proc/{up.pid}/cmdline", "rb").read():
        time.sleep(0.01)
    return up


def test_ps_rows_add_up_work_and_the_lag_of_the_consumers_each_replica_reads():
    replies = [
        stats("noetl-worker-default", "W1", endpoints=[consumer("commands", "NOETL_COMMANDS", ["pool-default"], 7)],
              pool="default"),
        stats("noetl-router", "R2", [1, 3], endpoints=[consumer("events", "NOETL_EVENTS", ["router-p1", "router-p3"],
                                                                40, 2, "retrying x")]),
        stats("noetl-router", "R1", [0, 2], endpoints=[consumer("events", "NOETL_EVENTS", ["router-p0", "router-p2"], 9)]),
        stats("noetl-event-recorder", "E1", endpoints=[request("execution-get", 5, 1, "not_found: x"),
                                                       consumer("events", "NOETL_EVENTS", ["event-recorder"], 100)]),
        {"not": "a reply"},
    ]
    assert operate.consumers_of(replies) == [("NOETL_COMMANDS", "pool-default"), ("NOETL_EVENTS", "router-p1"),
                                             ("NOETL_EVENTS", "router-p3"), ("NOETL_EVENTS", "router-p0"),
                                             ("NOETL_EVENTS", "router-p2"), ("NOETL_EVENTS", "event-recorder")]
    infos = {("NOETL_EVENTS", "router-p1"): {"num_pending": 4, "num_ack_pending": 1, "num_redelivered": 2},
             ("NOETL_EVENTS", "router-p3"): {"num_pending": 6, "num_ack_pending": 0, "num_redelivered": 0},
             ("NOETL_COMMANDS", "pool-default"): {"num_pending": 0, "num_ack_pending": 8}}
    rows = operate.ps_rows(replies, infos, NOW)
    assert [(r["service"], r["id"]) for r in rows] == [("router", "R1"), ("router", "R2"), ("event-recorder", "E1"),
                                                       ("worker", "W1")]
    r1, r2, rec, worker = rows
    assert r2["partitions"] == [1, 3] and (r2["handled"], r2["failed"], r2["last_error"]) == (40, 2, "retrying x")
    assert (r2["pending"], r2["ack_pending"], r2["lag"], r2["redelivered"]) == (10, 1, 11, 2)
    assert [c["durable"] for c in r2["consumers"]] == ["router-p1", "router-p3"]
    assert r1["lag"] == 0 and r1["consumers"][0]["pending"] is None  # no info: unknown, not zero, per consumer
    assert (rec["handled"], rec["failed"], rec["partitions"]) == (105, 1, None)
    assert (worker["pool"], worker["ack_pending"], worker["lag"]) == ("default", 8, 8)
    assert all(r["uptime"] == 120.0 for r in rows)
    text = operate.table(rows, operate.PS_COLUMNS).splitlines()
    assert text[0].split() == ["SERVICE", "ID", "VERSION", "POOL", "PARTITIONS", "UPTIME", "HANDLED", "FAILED",
                               "PENDING", "ACK", "PENDING"]
    assert text[2].split() == ["router", "R2", "0.1.0", "-", "1,3", "2m0s", "40", "2", "10", "1"]


STREAMS = [
    {"config": {"name": "NOETL_EVENTS", "subjects": ["noetl.evt.*.*.*"], "retention": "limits", "storage": "file",
                "num_replicas": 1, "max_age": 7 * 86400 * operate.NS},
     "created": "2025-01-01T00:00:00Z",
     "state": {"messages": 1500, "bytes": 3 * 1024 * 1024, "first_seq": 1, "last_seq": 1500, "consumer_count": 49,
               "num_subjects": 70}},
    {"config": {"name": "KV_noetl_members", "subjects": ["$KV.noetl_members.>"], "retention": "limits",
                "max_msgs_per_subject": 1, "max_age": 6 * operate.NS, "num_replicas": 1, "storage": "file",
                "description": "noetl control-plane replicas"},
     "state": {"messages": 4, "bytes": 400, "num_subjects": 4, "consumer_count": 0}},
    {"config": {"name": "OBJ_noetl_payloads", "subjects": ["$O.noetl_payloads.C.>", "$O.noetl_payloads.M.>"],
                "retention": "limits", "max_age": 0, "num_replicas": 3, "storage": "file"},
     "state": {"messages": 12, "bytes": 5_000_000}},
]


def test_stream_kv_and_object_rows_from_the_jetstream_api():
    streams = {r["name"]: r for r in operate.stream_rows(STREAMS)}
    events = streams["NOETL_EVENTS"]
    assert (events["messages"], events["consumers"], events["max_age"], events["subjects"]) == \
        (1500, 49, 7 * 86400, ["noetl.evt.*.*.*"])
    assert streams["OBJ_noetl_payloads"]["max_age"] is None  # 0: no limit
    [kv] = operate.kv_rows(STREAMS)
    assert (kv["bucket"], kv["keys"], kv["values"], kv["history"], kv["ttl"]) == ("noetl_members", 4, 4, 1, 6)
    [obj] = operate.object_rows(STREAMS)
    assert (obj["bucket"], obj["bytes"], obj["replicas"], obj["ttl"], obj["sealed"]) == \
        ("noetl_payloads", 5_000_000, 3, None, False)
    text = operate.table(operate.stream_rows(STREAMS), operate.STREAM_COLUMNS)
    assert "NOETL_EVENTS        1500      3.0 MiB  49         limits     7d0h" in text


def test_consumer_rows():
    raw = [{"stream_name": "NOETL_EVENTS", "name": "router-p0",
            "config": {"durable_name": "router-p0", "filter_subjects": ["noetl.pevt.0.ctl.*.*"], "ack_policy": "explicit",
                       "max_ack_pending": 1, "ack_wait": 30 * operate.NS},
            "delivered": {"consumer_seq": 10, "stream_seq": 120, "last_active": "2025-01-01T11:59:00Z"},
            "ack_floor": {"consumer_seq": 9, "stream_seq": 119},
            "num_ack_pending": 1, "num_redelivered": 0, "num_waiting": 1, "num_pending": 3},
           {"stream_name": "NOETL_COMMANDS", "name": "Xy12", "config": {"filter_subject": "noetl.cmd.>"}}]
    rows = operate.consumer_rows(raw)
    assert [r["name"] for r in rows] == ["Xy12", "router-p0"]  # by stream, then name
    ephemeral, router = rows
    assert (router["durable"], router["filter"], router["pending"], router["ack_pending"], router["ack_wait"],
            router["delivered"], router["ack_floor"]) == (True, ["noetl.pevt.0.ctl.*.*"], 3, 1, 30, 120, 119)
    assert (ephemeral["durable"], ephemeral["filter"], ephemeral["pending"]) == (False, ["noetl.cmd.>"], 0)


def test_formatting():
    assert operate.ranges([]) == "-" and operate.ranges(None) == "-"
    assert operate.ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8" and operate.ranges(list(range(16))) == "0-15"
    assert [operate.duration(s) for s in (None, 5, 125, 3725, 90000)] == ["-", "5s", "2m5s", "1h2m", "1d1h"]
    assert [operate.size(n) for n in (None, 10, 2048, 5 * 1024 ** 3)] == ["-", "10 B", "2.0 KiB", "5.0 GiB"]


def args(**kw):
    return SimpleNamespace(**{"home": None, "nats_url": None, "nats_creds": None, **kw})


def test_nats_is_found_from_the_options_the_environment_or_the_running_stack(tmp_path, monkeypatch):
    monkeypatch.delenv("NOETL_NATS_URL", raising=False)
    monkeypatch.delenv("NOETL_NATS_CREDS", raising=False)
    monkeypatch.delenv("NOETL_HOME", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="no NATS to ask: give --nats-url"):
        operate.where(args())
    assert operate.where(args(nats_url="nats://h:1", nats_creds="/x/a.nk")) == ("nats://h:1", "/x/a.nk")
    creds = tmp_path / "creds"
    creds.mkdir()
    assert operate.where(args(nats_url="nats://h:1", nats_creds=str(creds))) == ("nats://h:1", str(creds / "admin.nk"))
    monkeypatch.setenv("NOETL_NATS_URL", "nats://env:2")
    assert operate.where(args()) == ("nats://env:2", None)
    monkeypatch.delenv("NOETL_NATS_URL")
    # a `noetl up` running from the default home (.noetl): a process whose command line says noetl
    home = tmp_path / ".noetl"
    (home / "nats-creds").mkdir(parents=True)
    (home / "nats-creds" / "admin.nk").write_text("SU...")
    up = stand_in()
    try:
        (home / "stack.json").write_text(json.dumps({"pid": up.pid, "gateway": "http://127.0.0.1:9",
                                                      "nats": "nats://127.0.0.1:4"}))
        assert operate.where(args()) == ("nats://127.0.0.1:4", str(home / "nats-creds" / "admin.nk"))
        other = tmp_path / "elsewhere"
        assert operate.where(args(home=str(other), nats_url="nats://h:1")) == ("nats://h:1", None)
    finally:
        up.kill()
        up.wait()
    with pytest.raises(ValueError):  # a stack.json whose process is gone (killed) is no running stack
        operate.where(args())


def test_ps_and_inspect_without_nats_say_so_without_a_traceback(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("NOETL_NATS_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["ps"]) == 2
    assert capsys.readouterr().err.startswith("noetl: no NATS to ask: give --nats-url")
    assert main(["inspect", "streams", "--nats-url", "nats://127.0.0.1:1", "--timeout", "1"]) == 4
    err = capsys.readouterr().err
    assert err.startswith("noetl: cannot reach NATS at nats://127.0.0.1:1 (") and err.count("\n") == 1
    assert main(["inspect", "nothing"]) == 2
