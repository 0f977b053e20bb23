"""NATS micro services (infra/micro.py) without a server: what INFO and STATS answer, the counters,
the names. Against a running stack: tests/integration/test_operations.py."""
from __future__ import annotations

import importlib.metadata
import json
import time
from datetime import datetime, timezone
from types import SimpleNamespace

import pytest
from nats.aio.client import Client
from nats.micro.service import ServiceConfig

from noetl_mesh.infra import micro
from noetl_mesh.infra.micro import Consumer, Endpoint, MicroService
from noetl_mesh.stack import ALL_SERVICES


def test_counts_requests_errors_and_time():
    e = Endpoint(subject="noetl.q.catalog.get", queue="event-recorder")
    start = time.perf_counter_ns() - 2_000_000
    e.record(start)
    e.record(start, error="not_found: no such entry")
    assert (e.handled, e.failed, e.last_error) == (2, 1, "not_found: no such entry")
    assert e.processing_ns >= 4_000_000
    stats = e.stats()
    assert (stats.name, stats.num_requests, stats.num_errors) == ("catalog-get", 2, 1)
    assert stats.average_processing_time == e.processing_ns // 2
    c = Consumer(name="events", stream="NOETL_EVENTS", subject="noetl.pevt.>", durable="event-recorder")
    c.record(start, n=10, failed=3, error="3 events recorded as rejected")
    c.record(start, n=5, failed=0)
    assert (c.handled, c.failed, c.last_error) == (15, 3, "3 events recorded as rejected")
    assert Endpoint(subject="x" * 10).stats().average_processing_time == 0  # nothing handled: no division


def test_a_partitioned_consumer_names_the_durables_it_reads_now():
    changes = []
    c = Consumer(name="events", stream="NOETL_EVENTS", subject="noetl.pevt.*.ctl.*.*", durable="router", partitions=[],
                 on_change=lambda: changes.append(1))
    assert c.durables() == []
    c.own({3, 1})
    c.own([1, 3])  # the same: no change
    assert c.durables() == ["router-p1", "router-p3"] and changes == [1]
    info, stats = c.info(), c.stats()
    assert info.queue_group == "router-p*"
    assert info.metadata == {"kind": "consumer", "stream": "NOETL_EVENTS", "durables": "router-p1,router-p3"}
    assert stats.data == {"kind": "consumer", "stream": "NOETL_EVENTS", "durables": ["router-p1", "router-p3"],
                          "partitions": [1, 3]}
    shared = Consumer(name="commands", stream="NOETL_COMMANDS", subject="noetl.cmd.gpu.*", durable="pool-gpu")
    assert shared.durables() == ["pool-gpu"] and shared.info().queue_group == "pool-gpu"
    assert "partitions" not in shared.stats().data
    lanes = Consumer(name="commands", stream="NOETL_COMMANDS", subject="noetl.cmd.gpu.*.*", durable="lane-gpu", lanes=3)
    assert lanes.durables() == ["lane-gpu-p0", "lane-gpu-p1", "lane-gpu-p2"] and lanes.info().queue_group == "lane-gpu-p*"
    assert "partitions" not in lanes.stats().data  # a pool's lanes: every worker reads them all
    assert "partitions" not in micro.metadata("worker", SimpleNamespace(pool="gpu", concurrency=4), [lanes])


def test_info_and_stats_show_the_live_endpoints_consumers_and_metadata():
    worker = SimpleNamespace(pool="gpu", concurrency=4, bus=SimpleNamespace(partitions=16),
                             consumers=[Consumer(name="commands", stream="NOETL_COMMANDS", subject="noetl.cmd.gpu.*",
                                                 durable="pool-gpu")])
    endpoints = {"noetl.q.x.y": Endpoint(subject="noetl.q.x.y", queue="q")}
    service = MicroService(Client(), ServiceConfig(name="noetl-worker-gpu", version="1.2.3"),
                           endpoints=lambda: list(endpoints.values()), consumers=lambda: worker.consumers,
                           meta=lambda: micro.metadata("worker", worker, worker.consumers))
    worker.consumers[0].record(time.perf_counter_ns(), n=3)
    endpoints["noetl.q.x.z"] = Endpoint(subject="noetl.q.x.z", queue="q")  # added later (the recorder's credentials)
    info = json.loads(json.dumps(service.info().to_dict()))
    assert [e["name"] for e in info["endpoints"]] == ["x-y", "x-z", "commands"]
    assert info["metadata"]["pool"] == "gpu" and info["metadata"]["concurrency"] == "4"
    assert all(isinstance(v, str) for v in info["metadata"].values())  # the protocol's metadata are strings
    stats = json.loads(json.dumps(service.stats().to_dict()))
    assert stats["endpoints"][2]["num_requests"] == 3 and stats["name"] == "noetl-worker-gpu"
    assert 0 <= micro.uptime(stats["started"]) < 60


def test_control_plane_metadata_follows_its_partitions():
    events = Consumer(name="events", stream="NOETL_EVENTS", subject="s", durable="router", partitions=[])
    router = SimpleNamespace(bus=SimpleNamespace(partitions=4), consumers=[events])
    service = MicroService(Client(), ServiceConfig(name="noetl-router", version="1.0.0"), endpoints=list,
                           consumers=lambda: router.consumers,
                           meta=lambda: micro.metadata("router", router, router.consumers))
    events.own([0, 2])
    assert service._metadata["partitions"] == "0,2"  # what PING answers: refreshed on the change
    assert service._metadata["partition_count"] == "4"


def test_names_subjects_version_and_uptime():
    assert micro.control_subject("PING") == "$SRV.PING"
    assert micro.control_subject("INFO", "noetl-router") == "$SRV.INFO.noetl-router"
    assert micro.control_subject("STATS", "noetl-router", "ID") == "$SRV.STATS.noetl-router.ID"
    with pytest.raises(ValueError):
        micro.control_subject("KILL")
    assert micro.version() == importlib.metadata.version("noetl-mesh")
    now = datetime(2025, 1, 1, 0, 1, 0, tzinfo=timezone.utc)
    assert micro.uptime("2025-01-01T00:00:00.000Z", now) == 60.0
    assert micro.uptime("yesterday", now) is None and micro.uptime(None, now) is None
    assert set(micro.DESCRIPTIONS) == set(ALL_SERVICES)  # every service a `noetl service` runs
