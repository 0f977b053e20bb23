"""The project as users run it: deploy/Dockerfile's image and docker-compose.yml on a real Docker engine,
with real NATS and Postgres containers. The image runs as its own unprivileged user and holds no compiler;
the stack comes up healthy, the first admin logs in through the proxy and runs the examples (and a
keychain credential); replicas are added while executions run and share the partitions; a worker, a
router and the event-recorder are killed mid-run, and afterwards every execution has ended, once, with the
reference engine's outcome (`noetl verify --all` finds nothing). The tests run in order, on one stack.

Everything runs over TLS (`noetl certs`), and the last tests prove it where a user would look: NATS
refuses a client that does not speak TLS and one without the CA (in one line naming the setting), its
monitoring port is not reachable; Postgres refuses a connection without TLS and takes one verified
against the CA; the gateway answers over HTTPS only, through the proxy and at each replica, and still
knows the client's address behind the proxy.

Prometheus runs too (deploy/prometheus.yml): after the faults every replica is a target that is up, and
each query of the Grafana dashboard has data. Jaeger and Grafana are not started (no image here).

Skipped, in one line, when no Docker engine answers (.ci/run starts one where it can)."""
from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
import time

import httpx
import pytest
import yaml

from noetl_mesh.testing.plaintext import plaintext_nats

from container_images import PROJECT_IMAGE, ROOT, docker
from container_report import note, timed

from container_stack import problem

if problem():
    pytest.skip(f"container tests (tests/containers): {problem()}", allow_module_level=True)

from container_load import executions, finish, load, mix  # noqa: E402
from noetl_mesh.core.state import FINAL  # noqa: E402

pytestmark = [pytest.mark.containers, pytest.mark.timeout(900)]

ENGINE = ("nats", "postgres", "setup", "event-recorder", "credentials", "sessions", "admission", "router",
          "loop-coordinator", "scheduler", "worker", "gateway", "proxy")
SCALED = {"worker": 3, "router": 2, "admission": 2, "loop-coordinator": 2}
submitted: dict[str, str] = {}  # every execution the module started: id -> playbook or file


def run_json(cli, up, *args: str) -> dict:
    out = cli("run", *args, "--gateway", up.gateway, "--json", "--timeout", "120")
    assert out.stdout, out.stderr
    result = json.loads(out.stdout)
    submitted[result["execution_id"]] = args[0]
    return result


# ---------------------------------------------------------------------------------------------- tests
def test_the_image_runs_unprivileged_without_a_compiler(images):
    assert docker("image", "inspect", "--format", "{{.Config.User}}", PROJECT_IMAGE).stdout.strip() == "noetl"
    assert docker("run", "--rm", "--entrypoint", "id", PROJECT_IMAGE, "-u").stdout.strip() == "10001"
    found = docker("run", "--rm", "--entrypoint", "sh", PROJECT_IMAGE, "-c",
                   "for c in gcc cc c++ g++ clang tcc x86_64-linux-gnu-gcc; do command -v $c; done; "
                   "ls -d /wheels /root/.cache/pip /home/noetl/.cache/pip 2>/dev/null; true").stdout.split()
    assert found == []  # no compiler, no wheels or pip cache left behind
    version = docker("run", "--rm", PROJECT_IMAGE, "--version").stdout
    assert version.startswith("noetl")
    size = int(docker("image", "inspect", "--format", "{{.Size}}", PROJECT_IMAGE).stdout)
    base = int(docker("image", "inspect", "--format", "{{.Size}}", "python:3.11-slim").stdout)
    note(f"{PROJECT_IMAGE}: {size / 1e6:.0f} MB, {(size - base) / 1e6:.0f} MB over python:3.11-slim "
         f"({images['python:3.11-slim']}); {version.strip()}")


def test_the_stack_comes_up_healthy_and_every_service_answers(up, cli):
    assert all(up.containers(service, all=True) for service in ENGINE), up.health()
    rows = cli.ps()
    assert {r["service"] for r in rows} == set(ENGINE) - {"nats", "postgres", "setup", "proxy"}
    partitions = {r["service"]: r["partitions"] for r in rows if r.get("partitions")}
    assert partitions and all(p == list(range(16)) for p in partitions.values()), partitions


def test_the_first_admin_logs_in_through_the_proxy_and_runs_the_examples(up, cli, token):
    again = cli("bootstrap", "--nats-url", up.nats, "--nats-creds", str(up.creds / "admin.nk"), "--out", "-")
    assert again.returncode == 1 and "has users already" in again.stderr  # a second admin is never made
    whoami = cli("whoami", "--gateway", up.gateway)
    assert whoami.returncode == 0 and json.loads(whoami.stdout)["roles"] == ["admin"]
    assert httpx.get(f"{up.gateway}/api/executions", timeout=10, verify=ssl.create_default_context(cafile=up.ca)) \
        .status_code == 401  # no token, no entry
    with timed("examples through the proxy"):
        hello = run_json(cli, up, str(ROOT / "examples" / "hello.yaml"))
        assert hello["status"] == "COMPLETED", hello["error"]
        assert hello["steps"]["aggregate"]["result"] == "hello: 8 squares add up to 173"  # python, duckdb, noop
        assert hello["ctx"] == {"total": 173}
        for example in ("fork_join.yaml", "loop.yaml"):
            result = run_json(cli, up, str(ROOT / "examples" / example))
            assert result["status"] == "COMPLETED", (example, result["error"])
        nested = run_json(cli, up, str(ROOT / "examples" / "nested.yaml"),
                          "--register", str(ROOT / "examples" / "nested_child.yaml"))
        assert nested["status"] == "COMPLETED", nested["error"]
        shell = run_json(cli, up, str(ROOT / "tests" / "containers" / "playbooks" / "shell.yaml"))
        assert shell["status"] == "COMPLETED", shell["error"]
        assert shell["steps"]["start"]["result"]["stdout"] == "10001\nHELLO\n"  # confined, as the image's user


def test_a_keychain_credential_reaches_the_task_that_declares_it(up, cli, token):
    # the stack's Postgres takes TLS only. A task may not name a file of the worker (sslrootcert: only
    # 'system', whose authorities do not know the stack's CA), so the credential asks for TLS without
    # verifying the server: sslmode=require
    password = (up.tls / "postgres.password").read_text().strip()
    data = json.dumps({"host": "postgres", "port": 5432, "user": "noetl", "password": password, "dbname": "noetl",
                       "sslmode": "require"})
    out = cli("credential", "add", "compose_pg", "--kind", "postgres", "--data", data, "--gateway", up.gateway)
    assert out.returncode == 0, out.stderr
    result = run_json(cli, up, str(ROOT / "tests" / "containers" / "playbooks" / "keychain_pg.yaml"))
    assert result["status"] == "COMPLETED", result["error"]
    [row] = result["steps"]["start"]["result"]["rows"]
    assert row == {"who": "noetl", "answer": 42, "tls": True}  # the credential's user, over TLS (pg_stat_ssl)


def test_replicas_added_while_executions_run_share_the_partitions(up, cli, token):
    async def scenario() -> tuple[dict, float]:
        loading = asyncio.create_task(load(token, up.gateway, mix(24), gap=0.5, ca=str(up.ca)))
        await asyncio.sleep(2)  # executions in flight
        took = await asyncio.to_thread(up.up, SCALED)
        return await loading, took

    with timed("scale up while executions run, until they ended"):
        ids, took = asyncio.run(scenario())
        submitted.update(ids)
        note(f"compose up --scale {' '.join(f'{k}={v}' for k, v in SCALED.items())}: {took:.0f} s")
        result = asyncio.run(finish(token, up.gateway, ids, ca=str(up.ca)))
    assert not result.unfinished and not result.mismatches, result.describe()
    with timed("partitions dealt out after scaling"):
        deadline = time.monotonic() + 60
        while True:
            rows = cli.ps()
            shares = {s: [r["partitions"] for r in rows if r["service"] == s]
                      for s in ("admission", "router", "loop-coordinator")}
            settled = all(len(v) == SCALED[s] and all(v) and sorted(p for part in v for p in part) == list(range(16))
                          for s, v in shares.items())
            if settled or time.monotonic() > deadline:
                break
            time.sleep(1)
    assert settled, shares  # each replica reads some partitions, each partition is read by one replica
    workers = [r for r in rows if r["service"] == "worker"]
    assert len(workers) == 3 and {w["pool"] for w in workers} == {"default"}
    note("after scaling: " + "; ".join(f"{s} {[len(p) for p in v]} partitions" for s, v in shares.items())
         + f"; workers handled {[w['handled'] for w in workers]}")


def test_killing_a_worker_a_router_and_the_recorder_mid_run_loses_nothing(up, cli, token):
    killed: list[str] = []
    held: dict[str, int] = {}
    hunting: list[asyncio.Task] = []

    async def kill_a_busy_worker() -> None:
        """The first worker seen holding commands, killed; looked for while the load goes on (the
        executions keep starting, so one is always running: a loaded machine's slow reads miss none)."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for name in up.containers("worker"):
                count = await asyncio.to_thread(in_flight, name)
                if count:
                    held[name] = count
                    await asyncio.to_thread(docker, "kill", name)
                    killed.append(name)
                    return
            await asyncio.sleep(0.1)

    async def faults(i: int) -> None:
        if i == 4:
            hunting.append(asyncio.create_task(kill_a_busy_worker()))
        elif i in (8, 12):
            victim = up.containers({8: "router", 12: "event-recorder"}[i])[0]
            docker("kill", victim)
            killed.append(victim)
        elif i == 20:  # the recorder comes back (it is the only one); the worker and router stay dead
            docker("start", [k for k in killed if "event-recorder" in k][0])

    async def run() -> dict[str, str]:
        started = await load(token, up.gateway, mix(28), gap=0.7, faults=faults, ca=str(up.ca))
        await asyncio.gather(*hunting)
        return started

    with timed("kills mid-run, until every execution ended"):
        ids = asyncio.run(run())
        submitted.update(ids)
        result = asyncio.run(finish(token, up.gateway, ids, ca=str(up.ca)))
    worker = [k for k in killed if k in held]
    note(f"killed {', '.join(killed)} (the worker held {held[worker[0]] if worker else 0} commands; the recorder "
         f"started again 8 executions later)")
    assert worker, "no worker was seen holding a command"  # killed with commands in hand: redelivered elsewhere
    assert not result.unfinished and not result.mismatches, result.describe()
    with timed("noetl verify --all"):
        out = cli("verify", "--all", "--gateway", up.gateway, "--json", timeout=300)
    reports = json.loads(out.stdout or "[]")
    assert out.returncode == 0, [r for r in reports if not r["ok"]] or out.stderr
    assert all(r["status"] in FINAL for r in reports)
    # nothing lost, nothing duplicated: the gateway lists exactly the executions started (and the child
    # of the nested example), each once, and verify read each of them
    rows = asyncio.run(executions(token, up.gateway, ca=str(up.ca)))
    ids = [r["execution_id"] for r in rows]
    assert len(ids) == len(set(ids)) and sorted(ids) == sorted(r["execution_id"] for r in reports)
    top = {r["execution_id"] for r in rows if not r["parent_execution_id"]}
    assert top == set(submitted), top ^ set(submitted)
    assert {r["parent_execution_id"] for r in rows if r["parent_execution_id"]} <= top
    with timed("compose up: the killed replicas back"):
        up.up(SCALED)
        states = up.wait_healthy()
    assert all(s in ("healthy", "exited:0") for s in states.values()), states


def test_nats_logged_no_permission_violation(up):
    log = up.logs("nats")
    assert "Permissions Violation" not in log and "Authorization Error" not in log, \
        [line for line in log.splitlines() if "Violation" in line or "Authorization" in line][:10]


# ----------------------------------------------------------------------------------- Prometheus
def prometheus(up, path: str, **params) -> dict:
    """GET ``path`` of the stack's Prometheus (its published port, plain HTTP); answers the ``data``."""
    answer = httpx.get(f"http://{up.port('prometheus', 9090)}{path}", params=params, timeout=30)
    assert answer.status_code == 200 and answer.json()["status"] == "success", answer.text[:500]
    return answer.json()["data"]


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of the Grafana dashboard, its variables given values."""
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "noetl.json").read_text())
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            if target.get("expr"):
                expr = target["expr"]
                for variable in ("$__rate_interval", "${__rate_interval}", "$__interval", "${__interval}"):
                    expr = expr.replace(variable, "1m")
                assert "$" not in expr, expr  # a variable this test does not know
                found.append((panel["title"], expr))
    return found


def test_prometheus_scrapes_every_replica_and_the_dashboards_queries_have_data(up, cli, token):
    # every replica of every service prometheus.yml names, by its address on the compose network, is a
    # target that is up (DNS service discovery: killed replicas, started again, may have new addresses)
    config = yaml.safe_load((up.workdir / "deploy" / "prometheus.yml").read_text())
    [job] = [j for j in config["scrape_configs"] if j["job_name"] == "noetl"]
    [sd] = job["dns_sd_configs"]
    expected = set()
    for service in sd["names"]:
        names = up.containers(service)
        assert names, service
        addresses = docker("inspect", "--format", "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}",
                           *names).stdout.split()
        assert len(addresses) == len(names), (service, addresses)
        expected |= {(service, f"{address}:{sd['port']}") for address in addresses}
    assert len(expected) >= len(sd["names"]) + sum(n - 1 for n in SCALED.values())
    with timed("prometheus: every replica a target, up"):
        deadline = time.monotonic() + 120  # DNS refreshed every 15 s, scraped every 15 s
        while True:
            targets = prometheus(up, "/api/v1/targets", state="active")["activeTargets"]
            seen = {(t["labels"].get("compose_service"), t["labels"]["instance"]): t for t in targets
                    if t["labels"]["job"] == "noetl"}
            if set(seen) == expected and all(t["health"] == "up" for t in seen.values()) \
                    or time.monotonic() > deadline:
                break
            time.sleep(2)
    assert set(seen) == expected, (sorted(set(seen) - expected), sorted(expected - set(seen)))
    down = {k: (t["health"], t.get("lastError")) for k, t in seen.items() if t["health"] != "up"}
    assert not down, down
    assert all(t["scrapeUrl"].startswith("http://") and t["scrapeUrl"].endswith(":9464/metrics")
               for t in seen.values())  # plain HTTP, no token (compose sets no NOETL_METRICS_TOKEN)
    # each query of the dashboard, over the run (as Grafana asks: a range), has data: a series with a
    # number (histogram_quantile of no observation is NaN, which Grafana draws as nothing)
    end = time.time()
    results = {}
    for title, expr in dashboard_queries():
        series = prometheus(up, "/api/v1/query_range", query=expr, start=end - 3600, end=end, step=15)["result"]
        values = [float(v) for s in series for _, v in s["values"]]
        results[expr] = (title, [v for v in values if v == v])  # NaN != NaN
    empty = {expr: title for expr, (title, values) in results.items() if not values}
    assert not empty, empty
    assert max(results["sum(rate(noetl_executions_started_total[1m]))"][1]) > 0
    replicas = prometheus(up, "/api/v1/query", query='sum by (compose_service) (up{job="noetl"})')["result"]
    assert {r["metric"]["compose_service"]: float(r["value"][1]) for r in replicas} == \
        {service: float(sum(1 for s, _ in expected if s == service)) for service in sd["names"]}  # "Services up"
    note(f"prometheus: {len(seen)} targets up ({', '.join(sorted({s for s, _ in seen}))}); "
         f"{len(results)} dashboard queries, each with data")


# ------------------------------------------------------------------------------------ TLS, proved
def in_container(up, service: str, code: str) -> dict:
    """Run ``code`` (Python, printing one JSON object) in a container of ``service``: another host's view."""
    [name] = up.containers(service)[:1]
    out = docker("exec", name, "python", "-c", code, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_nats_refuses_a_client_without_tls_and_one_without_the_ca(up, cli):
    host, port = up.nats.removeprefix("tls://").rsplit(":", 1)
    info, answer = plaintext_nats(host, int(port))  # a client that never starts TLS
    assert info["tls_required"] is True
    assert b"PONG" not in answer and b"+OK" not in answer, answer  # closed: nothing is served in the clear
    env = {k: v for k, v in cli.env.items() if k != "NOETL_NATS_TLS_CA"}  # the admin's seed, not the CA
    out = subprocess.run([up.noetl, "ps", "--nats-url", up.nats, "--nats-creds", str(up.creds / "admin.nk")],
                         capture_output=True, text=True, env=env, timeout=60)
    [line] = out.stderr.strip().splitlines()
    assert out.returncode == 2 and "its certificate does not verify" in line and "NOETL_NATS_TLS_CA" in line, line
    # the monitoring port (no authentication) answers inside its container only
    assert docker("port", up.containers("nats")[0], "8222", check=False).returncode != 0
    seen = in_container(up, "worker", "import json, urllib.request as u\n"
                        "try:\n u.urlopen('http://nats:8222/varz', timeout=5); print(json.dumps({'reached': True}))\n"
                        "except OSError as e:\n print(json.dumps({'reached': False, 'why': str(e)}))")
    assert seen["reached"] is False, seen
    note(f"NATS: a plaintext client closed ({len(answer)} bytes after CONNECT), without the CA: {line[7:90]}...; "
         f"monitoring from another container: {seen['why']}")


def test_postgres_refuses_a_connection_without_tls(up):
    seen = in_container(up, "event-recorder", """
import json, os, psycopg
base = os.environ["NOETL_PG_DSN"]
password = open(os.environ["NOETL_PG_PASSWORD_FILE"]).read().strip()
out = {}
for name, extra in (("verified", ""), ("plaintext", " sslmode=disable"), ("no CA", " sslrootcert=/nonexistent")):
    try:
        with psycopg.connect(base + extra, password=password, connect_timeout=10) as conn:
            out[name] = "ok: " + conn.execute("SELECT version FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetchone()[0]
    except psycopg.OperationalError as exc:
        out[name] = "refused: " + " ".join(str(exc).split())
print(json.dumps(out))""")
    assert seen["verified"].startswith("ok: TLSv1."), seen  # sslmode=verify-full, the services' DSN
    assert seen["plaintext"].startswith("refused:") and "no encryption" in seen["plaintext"], seen
    assert seen["no CA"].startswith("refused:") and "/nonexistent" in seen["no CA"], seen
    note(f"Postgres: {seen['verified']}; without TLS: {seen['plaintext'][:120]}")


def test_the_gateway_answers_only_over_https(up, cli, token):
    host_port = up.gateway.removeprefix("https://")
    plain = httpx.get(f"http://{host_port}/health", timeout=10)
    assert plain.status_code == 400 and "plain HTTP request was sent to HTTPS port" in plain.text, plain.text
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):  # the system's authorities
        httpx.get(f"{up.gateway}/health", timeout=10)
    verified = ssl.create_default_context(cafile=up.ca)
    assert httpx.get(f"{up.gateway}/health", timeout=10, verify=verified).status_code == 200
    env = {k: v for k, v in cli.env.items() if k != "NOETL_GATEWAY_CA"}
    out = subprocess.run([up.noetl, "whoami", "--gateway", up.gateway], capture_output=True, text=True, env=env,
                         timeout=60)
    [line] = out.stderr.strip().splitlines()
    assert out.returncode == 4 and line.startswith(f"noetl: the gateway at {up.gateway}: its certificate does not "
                                                   "verify") and "NOETL_GATEWAY_CA" in line, line
    # each replica speaks HTTPS only, to the proxy too (another container of the network asks)
    seen = in_container(up, "worker", """
import json, ssl, urllib.request as u
out = {}
for name, url, ctx in (("http", "http://gateway:8082/health", None),
                       ("https", "https://gateway:8082/health", ssl.create_default_context(cafile="/run/secrets/ca.crt"))):
    try:
        out[name] = u.urlopen(url, timeout=5, context=ctx).status
    except Exception as exc:
        out[name] = type(exc).__name__ + ": " + str(exc)[:80]
print(json.dumps(out))""")
    assert seen["https"] == 200 and seen["http"] != 200, seen
    # the client's address behind the proxy is still the client's (NOETL_TRUSTED_PROXIES): a failed login's
    # audit record names the address the proxy saw this request come from (its access log), not the proxy's
    wrong = httpx.post(f"{up.gateway}/api/auth/login", json={"username": "nobody", "password": "x" * 12}, timeout=10,
                       verify=verified)
    assert wrong.status_code == 401
    records = httpx.get(f"{up.gateway}/api/audit", params={"action": "session.login_failed"}, timeout=10,
                        verify=verified, headers={"authorization": f"Bearer {token}"}).json()  # newest first
    [proxy] = up.containers("proxy")
    access = docker("logs", proxy).stdout.splitlines()
    client_ip = [line.split(" ", 1)[0] for line in access if '"POST /api/auth/login HTTP/1.1" 401' in line][-1]
    proxy_ip = up.env["NOETL_NET_PREFIX"] + ".2"  # docker-compose.yml's fixed address of the proxy
    assert records and records[0].get("client_ip") == client_ip != proxy_ip, (client_ip, records[:1])
    note(f"gateway: plain HTTP answered {plain.status_code} by the proxy; a replica over HTTP: {seen['http']}; "
         f"the client's address behind the proxy: {client_ip}")


def in_flight(container: str) -> int:
    """The commands a worker container holds now (its noetl_commands_in_flight gauge); 0 when it cannot
    be read."""
    out = docker("exec", container, "python", "-c", "import urllib.request as u; "
                 "print(u.urlopen('http://127.0.0.1:9464/metrics', timeout=5).read().decode())", check=False)
    return int(sum(float(line.split()[-1]) for line in out.stdout.splitlines()
                   if line.startswith("noetl_commands_in_flight{")))
