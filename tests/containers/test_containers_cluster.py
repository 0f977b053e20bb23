"""docker-compose.yml over deploy/docker-compose.cluster.yml: three NATS containers, every stream, bucket
and object store kept on all three. The node leading the events stream is cut off the network (`docker
network disconnect`) for 30 s while executions run; afterwards every execution has ended with the reference
engine's outcome and `noetl verify --all` finds nothing, and the node is back in the cluster. The routes
are TLS and authorized: a NATS server started on the stack's network with a client certificate of the
stack's own CA, and one without TLS, try to join as routes and are refused.

Skipped, in one line, when no Docker engine answers (.ci/run starts one where it can)."""
from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime

import pytest
import yaml

from container_images import docker
from container_report import note, timed

from container_stack import problem

if problem():
    pytest.skip(f"container tests (tests/containers): {problem()}", allow_module_level=True)

from container_load import executions, finish, load, mix  # noqa: E402

pytestmark = [pytest.mark.containers, pytest.mark.timeout(900)]

COMPOSE_FILES = ("docker-compose.yml", "deploy/docker-compose.cluster.yml")
NODES = {"nats-1": "nats", "nats-2": "nats-2", "nats-3": "nats-3"}  # server name -> compose service
SERVER = {service: name for name, service in NODES.items()}
CUT_OFF_S = 30


def monitor(up, service: str, path: str) -> dict:
    """A node's monitoring endpoint, asked from inside its container."""
    [name] = up.containers(service)[:1]
    return json.loads(docker("exec", name, "wget", "-q", "-O", "-", f"http://127.0.0.1:8222{path}").stdout)


def jsz(up, service: str = "nats") -> dict:
    """A node's JetStream report."""
    return monitor(up, service, "/jsz?accounts=true&streams=true")


def back_in_the_cluster(up, service: str) -> tuple[bool, dict]:
    """Whether a node has routes to both others again and the meta leader (the only node that tracks
    its peers' progress; a follower reports every peer not current) has it current."""
    routes = {r.get("remote_name") for r in monitor(up, service, "/routez").get("routes") or []}
    leader = jsz(up, service)["meta_cluster"].get("leader")
    peers = {r["name"]: r["current"] for r in (jsz(up, NODES[leader])["meta_cluster"].get("replicas") or [])} \
        if leader in NODES else {}
    seen = {"routes to": sorted(routes - {None}), "meta leader": leader, "its peers current": peers}
    ok = routes >= set(NODES) - {SERVER[service]} and len(peers) == 2 and all(peers.values())
    return ok, seen


def stream_leader(up, stream: str) -> str:
    for account in jsz(up).get("account_details") or []:
        for detail in account.get("stream_detail") or []:
            if detail["name"] == stream:
                return detail["cluster"]["leader"]
    raise AssertionError(f"no stream {stream} in the JetStream report")


def test_every_stream_bucket_and_object_store_is_kept_on_three_nodes(up, cli, token):
    out = cli("inspect", "streams", "--nats-url", up.nats, "--nats-creds", str(up.creds), "--json")
    assert out.returncode == 0, out.stderr
    streams = json.loads(out.stdout)
    assert len(streams) >= 8 and all(s["replicas"] == 3 for s in streams), [(s["name"], s["replicas"]) for s in streams]
    meta = jsz(up)["meta_cluster"]
    assert meta["cluster_size"] == 3 and meta["leader"] in NODES, meta


def test_the_events_streams_leader_cut_off_for_30_s_loses_nothing(up, cli, token):
    leader = stream_leader(up, "NOETL_EVENTS")
    service = NODES[leader]
    [container] = up.containers(service)[:1]
    [network] = docker("network", "ls", "--filter", f"label=com.docker.compose.project={up.project}",
                       "--format", "{{.Name}}").stdout.split()
    cut: dict[str, float] = {}

    async def back_later() -> None:
        await asyncio.sleep(CUT_OFF_S)
        docker("network", "connect", "--alias", service, network, container)
        cut["back"] = time.monotonic()

    async def faults(i: int) -> None:
        if i == 3:
            docker("network", "disconnect", network, container)
            cut["off"] = time.monotonic()
            cut["task"] = asyncio.create_task(back_later())

    async def scenario() -> dict[str, str]:
        ids = await load(token, up.gateway, mix(30), gap=1.2, faults=faults, ca=str(up.ca))
        await cut["task"]
        return ids

    with timed(f"a node cut off for {CUT_OFF_S} s mid-run, until every execution ended"):
        ids = asyncio.run(scenario())
        result = asyncio.run(finish(token, up.gateway, ids, ca=str(up.ca)))
    rows = sorted(asyncio.run(executions(token, up.gateway, ca=str(up.ca))), key=lambda r: r["created_at"])
    created = [datetime.fromisoformat(r["created_at"]) for r in rows if r["execution_id"] in ids]
    stall = max((b - a).total_seconds() for a, b in zip(created, created[1:]))
    note(f"cut off {service} ({leader}, the events stream's leader) for {cut['back'] - cut['off']:.0f} s; "
         f"the events stream's leader after: {stream_leader(up, 'NOETL_EVENTS')}; longest time without "
         f"an execution started (one is asked for every 1.2 s): {stall:.0f} s")
    assert not result.unfinished and not result.mismatches, result.describe()
    out = cli("verify", "--all", "--gateway", up.gateway, "--json", timeout=300)
    reports = json.loads(out.stdout or "[]")
    assert out.returncode == 0, [r for r in reports if not r["ok"]] or out.stderr
    assert {r["execution_id"] for r in reports} == set(ids)
    with timed("the cut-off node back in the cluster"):
        deadline = time.monotonic() + 120
        while True:
            ok, seen = back_in_the_cluster(up, service)
            if ok or time.monotonic() > deadline:
                break
            time.sleep(1)
    assert ok, seen


def test_no_node_logged_a_permission_violation(up):
    for service in NODES.values():
        log = up.logs(service)
        assert "Permissions Violation" not in log and "Authorization Error" not in log, \
            (service, [line for line in log.splitlines() if "Violation" in line or "Authorization" in line][:10])


def test_a_route_without_the_route_certificate_cannot_join(up, tmp_path):
    """Two NATS servers on the stack's network dial `nats:6222` as routes: one over TLS with a certificate
    the stack's CA signed but for another subject (a client's: CN=intruder), one without TLS. Neither
    becomes a route of any node, and the cluster still has its three JetStream peers."""
    [network] = docker("network", "ls", "--filter", f"label=com.docker.compose.project={up.project}",
                       "--format", "{{.Name}}").stdout.split()
    image = yaml.safe_load((up.workdir / "docker-compose.yml").read_text())["services"]["nats"]["image"]
    tls = (f'tls {{ cert_file: /tls/intruder.crt, key_file: /tls/intruder.key, ca_file: /tls/ca.crt, '
           f'timeout: 2 }}')
    before = len(up.logs("nats"))
    names = []
    try:
        for kind, block in (("tls", tls), ("plain", "")):
            conf = tmp_path / f"{kind}.conf"
            conf.write_text(f"server_name: intruder-{kind}\nhttp: 127.0.0.1:8222\n"
                            f"cluster {{ name: noetl, listen: 0.0.0.0:6222, routes: [nats-route://nats:6222]\n{block}\n}}\n")
            name = f"{up.project}-intruder-{kind}"
            docker("rm", "-f", name, check=False)
            docker("run", "-d", "--name", name, "--network", network,
                   "-v", f"{conf}:/etc/nats/intruder.conf:ro", "-v", f"{up.tls / 'ca.crt'}:/tls/ca.crt:ro",
                   "-v", f"{up.tls / 'client-intruder.crt'}:/tls/intruder.crt:ro",
                   "-v", f"{up.tls / 'client-intruder.key'}:/tls/intruder.key:ro", image, "-c", "/etc/nats/intruder.conf")
            names.append(name)
        deadline = time.monotonic() + 60  # a guard against a hang, not a measure
        while True:
            log = up.logs("nats")[before:]
            refused, plain = "authentication error" in log, "TLS route handshake error" in log or "TLS handshake error" in log
            if refused and plain or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert refused and plain, log[-3000:]
        routes = {service: {r.get("remote_name") for r in monitor(up, service, "/routez").get("routes") or []}
                  for service in NODES.values()}
        for service, seen in routes.items():
            assert seen == set(NODES) - {SERVER[service]}, routes  # the other two nodes, no one else
        for name in names:
            theirs = json.loads(docker("exec", name, "wget", "-q", "-O", "-", "http://127.0.0.1:8222/routez").stdout)
            assert not theirs.get("routes"), (name, theirs)
        assert jsz(up)["meta_cluster"]["cluster_size"] == 3
        said = {kind: next(line.split("] ", 1)[-1] for line in log.splitlines() if kind in line)
                for kind in ("authentication error", "handshake error")}
        note(f"routes: a client certificate of the stack's CA and a route without TLS refused "
             f"({said['authentication error'][:90]}; {said['handshake error'][:90]})")
    finally:
        for name in names:
            docker("rm", "-f", name, check=False)
