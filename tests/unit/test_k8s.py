"""deploy/k8s agrees with the Kubernetes API and with the code (no cluster runs here).

Every manifest is validated, strictly (an unknown field is an error), against the official Kubernetes
1.30 JSON schemas that the `kubernetes-validate` wheel bundles (offline). KEDA's ScaledObject is a
custom resource whose schema is not among them: it is checked against a small schema written here,
after KEDA's v1alpha1 ScaledObject (the fields used and their neighbours, unknown ones refused), and its
nats-jetstream trigger against the scaler's metadata. Then what a schema cannot know: each Deployment
runs a real `noetl service` command line, every service docker-compose.yml runs has one, each mounts its
own NATS user's seed from its own Secret, the probes ask ports the service listens on, no secret value
is written in a manifest, the environment is what the code reads and what compose gives, the pods meet
the "restricted" Pod Security Standard the namespace enforces, NATS's configuration is the one of
deploy/ (but for its monitoring address), and each Deployment has at most one autoscaler with or
without KEDA. And TLS as compose has it: each TLS setting names a file of the Secret that holds what
`noetl certs` made for it, each key goes to the pod that serves with it only, NATS requires TLS on its
client port and verifies and authorizes its routes, and the names dialled are the certificates' names.
"""
from __future__ import annotations

import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from noetl_mesh.cli import DEFAULT_METRICS_PORT, build_parser
from noetl_mesh.contracts.subjects import COMMANDS, LANES
from noetl_mesh.infra import certs
from noetl_mesh.infra.nats_auth import user_for
from noetl_mesh.stack import ALL_SERVICES, SCALABLE

ROOT = Path(__file__).parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES = "1.30"
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
CLUSTER = yaml.safe_load((ROOT / "deploy" / "docker-compose.cluster.yml").read_text())
DOCKERFILE = (ROOT / "deploy" / "Dockerfile").read_text()
NATS_CONF = (ROOT / "deploy" / "nats.conf").read_text()
NATS_CLUSTER_CONF = (ROOT / "deploy" / "nats-cluster.conf").read_text()
KUSTOMIZE = "kustomize.config.k8s.io/v1beta1"


def load(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


FILES = sorted(p for p in K8S.rglob("*.yaml"))
DOCS = [(p, d) for p in FILES for d in load(p) if d.get("apiVersion") != KUSTOMIZE]
MANIFESTS = [(p, d) for p, d in DOCS if not d["apiVersion"].startswith("keda.sh/")]


def of_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for _, d in DOCS if d["kind"] == kind}


DEPLOYMENTS = of_kind("Deployment")
[NATS] = of_kind("StatefulSet").values()
[SETUP] = of_kind("Job").values()
NOETL_COMPOSE = {n: s for n, s in COMPOSE["services"].items() if "build" in s}  # the project image's
PODS = {**{f"Deployment/{n}": d for n, d in DEPLOYMENTS.items()}, "Job/setup": SETUP, "StatefulSet/nats": NATS}


def container(workload: dict) -> dict:
    [c] = workload["spec"]["template"]["spec"]["containers"]
    return c


def env(workload: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container(workload).get("env", [])}


def args_of(workload: dict):
    return build_parser().parse_args(container(workload)["args"])  # argparse exits on what it does not know


def port_named(c: dict, port) -> int:
    if isinstance(port, int):
        return port
    [number] = [p["containerPort"] for p in c["ports"] if p["name"] == port]
    return number


def conf_value(text: str, key: str) -> str:
    return re.search(rf"^\s*{key}:\s*(\S+)", text, re.M).group(1)


def monitoring(text: str) -> tuple[str, int]:
    """NATS's monitoring listener (``http: HOST:PORT``): no other key opens it in these files."""
    assert "http_port" not in text and "https" not in text
    host, port = conf_value(text, "http").rsplit(":", 1)
    return host, int(port)


K8S_CONF = of_kind("ConfigMap")["nats-config"]["data"]


# ------------------------------------------------------------------------------------- the schemas
@pytest.mark.parametrize("path,doc", MANIFESTS, ids=[f"{p.relative_to(K8S)}:{d['kind']}/{d['metadata']['name']}"
                                                     for p, d in MANIFESTS])
def test_every_manifest_validates_strictly_against_the_kubernetes_schemas(path, doc):
    assert kubernetes_validate.validate(doc, KUBERNETES, strict=True) == KUBERNETES


def test_the_strict_validation_refuses_what_kubernetes_would():
    """The check above can fail: an unknown field, a wrong type, a missing required field are refused."""
    deployment = DEPLOYMENTS["router"]
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    container(broken)["livenessProbe"]["httpGet"]["paht"] = "/livez"
    with pytest.raises(kubernetes_validate.ValidationError, match="paht"):
        kubernetes_validate.validate(broken, KUBERNETES, strict=True)
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "30"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES, strict=True)
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    del container(broken)["name"]
    with pytest.raises(kubernetes_validate.ValidationError, match="name"):
        kubernetes_validate.validate(broken, KUBERNETES, strict=True)


# KEDA's ScaledObject (keda.sh/v1alpha1), written here: its CRD is not among the Kubernetes schemas.
# The spec's fields as KEDA documents them, unknown ones refused; trigger metadata values are strings.
_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
SCALED_OBJECT = {
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"}, "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object", "required": ["name", "namespace"],
                     "properties": {"name": {"type": "string"}, "namespace": {"type": "string"},
                                    "labels": _STRINGS, "annotations": _STRINGS}, "additionalProperties": False},
        "spec": {
            "type": "object", "additionalProperties": False, "required": ["scaleTargetRef", "triggers"],
            "properties": {
                "scaleTargetRef": {"type": "object", "additionalProperties": False, "required": ["name"],
                                   "properties": {"name": {"type": "string"}, "apiVersion": {"type": "string"},
                                                  "kind": {"type": "string"},
                                                  "envSourceContainerName": {"type": "string"}}},
                **{k: {"type": "integer", "minimum": 0} for k in (
                    "pollingInterval", "cooldownPeriod", "initialCooldownPeriod", "idleReplicaCount",
                    "minReplicaCount", "maxReplicaCount")},
                "fallback": {"type": "object"}, "advanced": {"type": "object"},
                "triggers": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False, "required": ["type", "metadata"],
                    "properties": {"type": {"type": "string"}, "name": {"type": "string"},
                                   "metadata": _STRINGS, "useCachedMetrics": {"type": "boolean"},
                                   "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                                   "authenticationRef": {"type": "object"}}}},
            }},
    },
}
# the nats-jetstream scaler's metadata (KEDA's pkg/scalers/nats_jetstream_scaler.go)
NATS_JETSTREAM = {"type": "object", "additionalProperties": False,
                  "required": ["natsServerMonitoringEndpoint", "account", "stream", "consumer"],
                  "properties": {"natsServerMonitoringEndpoint": {"type": "string", "pattern": r"^[a-z0-9.-]+:\d+$"},
                                 "account": {"type": "string"}, "stream": {"type": "string"},
                                 "consumer": {"type": "string"},
                                 "lagThreshold": {"type": "string", "pattern": r"^\d+$"},
                                 "activationLagThreshold": {"type": "string", "pattern": r"^\d+$"},
                                 "useHttps": {"enum": ["true", "false"]}}}
CPU_TRIGGER = {"type": "object", "additionalProperties": False, "required": ["value"],
               "properties": {"value": {"type": "string", "pattern": r"^\d+$"}}}


def test_the_keda_scaled_object_has_keda_s_structure_and_reads_the_worker_pool_s_consumer():
    [scaled] = of_kind("ScaledObject").values()
    jsonschema.validate(scaled, SCALED_OBJECT)
    with pytest.raises(jsonschema.ValidationError):  # the schema refuses what KEDA would not take
        jsonschema.validate({**scaled, "spec": {**scaled["spec"], "minReplicas": 2}}, SCALED_OBJECT)
    spec = scaled["spec"]
    target = DEPLOYMENTS[spec["scaleTargetRef"]["name"]]
    args = args_of(target)
    assert args.name == "worker"
    lanes = [t["metadata"] for t in spec["triggers"] if t["type"] == "nats-jetstream"]
    assert [t["type"] for t in spec["triggers"] if t["type"] != "nats-jetstream"] == ["cpu"]
    for js in lanes:
        jsonschema.validate(js, NATS_JETSTREAM)
        assert {k: v for k, v in js.items() if k != "consumer"} == {k: v for k, v in lanes[0].items() if k != "consumer"}
    # the durable consumers of the pool's lanes (services/worker: lane-<pool>-p<N>) of the commands stream
    assert [(js["stream"], js["consumer"]) for js in lanes] == [(COMMANDS, f"lane-{args.pool}-p{n}") for n in range(LANES)]
    js = lanes[0]
    assert js["account"] == "$G"  # nats-auth.conf's users live in the global account (no accounts block)
    assert "accounts" not in NATS_CONF
    host, port = js["natsServerMonitoringEndpoint"].split(":")
    nats_service = of_kind("Service")[NATS["spec"]["serviceName"]]
    assert host == f"{nats_service['metadata']['name']}.{NATS['metadata']['namespace']}.svc.cluster.local"
    assert int(port) == monitoring(K8S_CONF["nats.conf"])[1]
    assert js["useHttps"] == "false"  # the monitoring port is plain HTTP (test_nats_runs_deploy_s_configuration)
    # in a cluster the scaler may ask the consumer leader at <server_name>.<endpoint host>: the server
    # names are the pods' names, which the headless Service resolves
    assert env(NATS)["NATS_SERVER_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert nats_service["spec"]["clusterIP"] == "None"
    cpu = next(t for t in spec["triggers"] if t["type"] == "cpu")
    jsonschema.validate(cpu["metadata"], CPU_TRIGGER)
    assert cpu["metricType"] == "Utilization"
    assert int(js["lagThreshold"]) >= args.concurrency  # a worker's own commands in flight are lag too
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]


# ------------------------------------------------------------------------------------- kustomize
def kustomization(directory: Path) -> list[dict]:
    """The resources a kustomization renders, as far as these files use kustomize: resources (files or
    directories of another kustomization) and `$patch: delete` patches."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert k["apiVersion"] == KUSTOMIZE and k["kind"] == "Kustomization"
    out: list[dict] = []
    for resource in k["resources"]:
        path = (directory / resource).resolve()
        out += kustomization(path) if path.is_dir() else load(path)
    for patch in k.get("patches", ()):
        p = yaml.safe_load(patch["patch"])
        assert p.pop("$patch") == "delete"
        before = len(out)
        out = [d for d in out if (d["kind"], d["metadata"]["name"]) != (p["kind"], p["metadata"]["name"])]
        assert len(out) == before - 1, p  # it deletes something that is there
    return out


def test_the_kustomizations_list_every_file_and_give_each_deployment_one_autoscaler_at_most():
    base = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]) == base
    for directory in (K8S, K8S / "keda"):
        rendered = kustomization(directory)
        names = [(d["kind"], d["metadata"]["name"]) for d in rendered]
        assert len(names) == len(set(names)), directory
        deployments = {d["metadata"]["name"] for d in rendered if d["kind"] == "Deployment"}
        assert deployments == set(DEPLOYMENTS)
        scaled = [d["spec"]["scaleTargetRef"]["name"] for d in rendered
                  if d["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")]
        assert len(scaled) == len(set(scaled)) and set(scaled) <= deployments, (directory, scaled)
        assert {"admission", "router", "worker"} <= set(scaled)
        keda = [d for d in rendered if d["kind"] == "ScaledObject"]
        assert [d["metadata"]["name"] for d in keda] == (["worker"] if directory.name == "keda" else [])


# ------------------------------------------------------------------------------------- the services
def test_each_deployment_runs_a_real_noetl_service_and_every_compose_service_has_one():
    parser = build_parser()
    for name, deployment in DEPLOYMENTS.items():
        command = container(deployment)["args"]
        assert command[0] == "service" and "command" not in container(deployment)  # the image's entrypoint
        args = parser.parse_args(command)
        assert args.name == name, (name, command)
        assert command == NOETL_COMPOSE[name]["command"], name  # what compose runs, options included
    compose_services = {n for n, s in NOETL_COMPOSE.items() if s["command"][0] == "service"}
    assert set(DEPLOYMENTS) == compose_services == set(ALL_SERVICES) | {"event-recorder", "scheduler"}
    assert container(SETUP)["args"] == NOETL_COMPOSE["setup"]["command"] == ["setup"]
    parser.parse_args(container(SETUP)["args"])
    image = re.sub(r":.*", "", NOETL_COMPOSE["setup"]["image"])
    for workload in PODS.values():
        if workload is not NATS:
            assert container(workload)["image"].split(":")[0] == image
    assert container(NATS)["image"] == COMPOSE["services"]["nats"]["image"]


def test_each_pod_mounts_its_own_nats_users_seed_from_its_own_secret():
    secrets = []
    for key, workload in PODS.items():
        if workload is NATS:
            continue
        spec = workload["spec"]["template"]["spec"]
        user = "admin" if workload is SETUP else user_for(args_of(workload).name, getattr(args_of(workload), "pool", "default"))
        [seed] = [v for v in spec["volumes"] if "secret" in v]
        assert seed["secret"]["secretName"] == f"nats-seed-{user}", key
        [item] = seed["secret"]["items"]
        assert item["key"] == "seed"
        assert seed["secret"]["defaultMode"] == 0o440  # root's file, the pod's group (fsGroup) reads it
        assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsUser"]
        [mount] = [m for m in container(workload)["volumeMounts"] if m["name"] == seed["name"]]
        assert mount["readOnly"] is True
        assert env(workload)["NOETL_NATS_CREDS"]["value"] == f"{mount['mountPath']}/{item['path']}", key
        secrets.append(seed["secret"]["secretName"])
        assert "--nats-creds" not in container(workload)["args"]  # never on a command line
    assert len(secrets) == len(set(secrets))  # nobody shares a seed


def test_no_secret_value_is_written_in_a_manifest():
    assert not of_kind("Secret")
    for path in FILES:
        text = path.read_text()
        assert not re.search(r"\bS[UAO][A-Z2-7]{50,}", text), path  # an nkey seed
        assert not re.search(r"password\s*=", text, re.I), path  # a DSN with its password
    for key, workload in PODS.items():
        for name, e in env(workload).items():
            if name in ("NOETL_PG_DSN", "NOETL_CREDENTIAL_KEY", "NOETL_CREDENTIAL_KEY_OLD", "NOETL_METRICS_TOKEN"):
                assert "value" not in e and "secretKeyRef" in e["valueFrom"], (key, name)


def known_variables() -> set[str]:
    found: set[str] = set()
    for path in [*(ROOT / "libs").rglob("*.py"), *(ROOT / "services").rglob("*.py")]:
        found |= set(re.findall(r"(?:NOETL|OTEL)_[A-Z0-9_]+", path.read_text()))
    return found


def test_the_environment_is_what_the_code_reads_and_what_compose_gives():
    known = known_variables()
    for key, workload in PODS.items():
        names = set(env(workload))
        if workload is NATS:
            assert names == {"NATS_SERVER_NAME"}  # deploy/nats-cluster.conf's $NATS_SERVER_NAME
            assert "$NATS_SERVER_NAME" in NATS_CLUSTER_CONF
            continue
        assert names <= known, (key, names - known)
        name = "setup" if workload is SETUP else key.split("/")[1]
        cluster = CLUSTER["services"][name].get("environment", {})
        want = {n for n in {**NOETL_COMPOSE[name].get("environment", {}), **cluster} if n.startswith("NOETL_")}
        extra = {"NOETL_CREDENTIAL_KEY_OLD"} if name == "credentials" else set()  # rotation, optional
        assert {n for n in names if n.startswith("NOETL_")} == want | extra, name
        assert env(workload)["NOETL_REPLICAS"]["value"] == str(NATS["spec"]["replicas"]) == cluster["NOETL_REPLICAS"]
        for variable in ("NOETL_METRICS_PORT", "NOETL_METRICS_HOST"):
            assert variable not in names  # the image's (Dockerfile), which the probes ask
    # every node of the StatefulSet, at its client port, through the headless Service, over TLS as compose
    client = int(conf_value(NATS_CONF, "port"))
    assert {u.split("://")[0] for u in CLUSTER["x-cluster-env"]["NOETL_NATS_URL"].split(",")} == {"tls"}
    nodes = [f"tls://{NATS['metadata']['name']}-{i}.{NATS['spec']['serviceName']}:{client}"
             for i in range(NATS["spec"]["replicas"])]
    for workload in PODS.values():
        if workload is not NATS:
            assert env(workload)["NOETL_NATS_URL"]["value"].split(",") == nodes
    assert len(CLUSTER["x-cluster-env"]["NOETL_NATS_URL"].split(",")) == len(nodes)
    assert env(DEPLOYMENTS["event-recorder"])["NOETL_PG_DSN"]["valueFrom"]["secretKeyRef"] == \
        env(DEPLOYMENTS["credentials"])["NOETL_PG_DSN"]["valueFrom"]["secretKeyRef"]


def test_probes_and_ports_are_the_ones_the_services_listen_on():
    probe_paths = set(re.findall(r'path == "(/[a-z]+)"', (ROOT / "libs" / "noetl_mesh" / "infra" / "probes.py").read_text()))
    assert f"NOETL_METRICS_PORT={DEFAULT_METRICS_PORT}" in DOCKERFILE and "NOETL_METRICS_HOST=0.0.0.0" in DOCKERFILE
    for name, deployment in DEPLOYMENTS.items():
        c = container(deployment)
        assert port_named(c, "metrics") == DEFAULT_METRICS_PORT, name
        live, ready = c["livenessProbe"]["httpGet"], c["readinessProbe"]["httpGet"]
        assert (live["path"], ready["path"]) == ("/livez", "/readyz") and {"/livez", "/readyz"} <= probe_paths
        assert port_named(c, live["port"]) == port_named(c, ready["port"]) == DEFAULT_METRICS_PORT, name
        assert c["livenessProbe"]["timeoutSeconds"] > 5  # /livez waits up to 5 s for the event loop
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(DEFAULT_METRICS_PORT)
        grace = int(NOETL_COMPOSE[name].get("stop_grace_period", "30s").rstrip("s"))
        assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= grace
    gateway = container(DEPLOYMENTS["gateway"])
    args = args_of(DEPLOYMENTS["gateway"])
    assert args.host == "0.0.0.0" and port_named(gateway, "https") == args.port
    service = of_kind("Service")["gateway"]
    [port] = service["spec"]["ports"]
    assert port_named(gateway, port["targetPort"]) == args.port and port["appProtocol"] == "https"
    assert service["spec"]["selector"].items() <= DEPLOYMENTS["gateway"]["spec"]["template"]["metadata"]["labels"].items()
    # NATS: the ports its configuration opens, and compose's health check
    nats = container(NATS)
    assert port_named(nats, "client") == int(conf_value(NATS_CONF, "port"))
    assert port_named(nats, "monitor") == monitoring(K8S_CONF["nats.conf"])[1] == monitoring(NATS_CONF)[1]
    assert port_named(nats, "cluster") == int(conf_value(NATS_CLUSTER_CONF, "listen").split(":")[1])
    compose_check = " ".join(COMPOSE["services"]["nats"]["healthcheck"]["test"])
    ready = nats["readinessProbe"]["httpGet"]
    assert f"http://127.0.0.1:{port_named(nats, ready['port'])}{ready['path']}" in compose_check
    headless = of_kind("Service")["nats"]["spec"]
    assert headless["publishNotReadyAddresses"] is True  # the nodes find each other before they are ready
    assert {p["targetPort"] for p in headless["ports"]} == {"client", "cluster", "monitor"}


def settings(text: str, *skip: str) -> list[str]:
    """A NATS configuration's lines but comments, blank lines and the keys ``skip``."""
    lines = [re.sub(r"\s+#.*", "", line).strip() for line in text.splitlines()]
    return [line for line in lines if line and not line.startswith(("#", *skip))]


def test_nats_runs_deploy_s_configuration():
    config = K8S_CONF
    # deploy/nats.conf but for the monitoring port, which listens on the pod's address here (the kubelet's
    # probes and KEDA's scaler ask it from outside the container; 127.0.0.1 in compose): the same port
    assert settings(config["nats.conf"], "http:") == settings(NATS_CONF, "http:")
    assert monitoring(NATS_CONF) == ("127.0.0.1", monitoring(config["nats.conf"])[1])
    assert monitoring(config["nats.conf"])[0] == "0.0.0.0"

    def without_routes(text: str) -> list[str]:
        return settings(text, "routes:")

    assert without_routes(config["nats-cluster.conf"]) == without_routes(NATS_CLUSTER_CONF)
    routes = re.search(r"routes:\s*\[(.*)\]", config["nats-cluster.conf"]).group(1)
    port = conf_value(NATS_CLUSTER_CONF, "listen").split(":")[1]
    assert [r.strip() for r in routes.split(",")] == [
        f"nats-route://{NATS['metadata']['name']}-{i}.{NATS['spec']['serviceName']}:{port}"
        for i in range(NATS["spec"]["replicas"])]
    assert container(NATS)["args"] == ["-c", "/etc/nats/nats-cluster.conf"]
    # the projected volume lays out what the includes name: ./nats.conf, ./nats-creds/nats-auth.conf
    [mount] = [m for m in container(NATS)["volumeMounts"] if m["mountPath"] == "/etc/nats"]
    [volume] = [v for v in NATS["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    paths = {i["path"] for s in volume["projected"]["sources"] for i in s["configMap"]["items"]}
    includes = {re.sub(r"^\./", "", m) for m in re.findall(r"^include (\S+)", NATS_CONF + NATS_CLUSTER_CONF, re.M)}
    assert includes <= paths and "nats-cluster.conf" in paths
    [data] = [m for m in container(NATS)["volumeMounts"] if m["name"] == "data"]
    assert data["mountPath"] == conf_value(NATS_CONF, "store_dir")
    assert [t["metadata"]["name"] for t in NATS["spec"]["volumeClaimTemplates"]] == ["data"]
    assert NATS["spec"]["replicas"] == 3 and NATS["spec"]["podManagementPolicy"] == "Parallel"
    # only the NATS pods reach the route port; the (plain, unauthenticated) monitoring port only this
    # namespace's pods and KEDA's
    policy = of_kind("NetworkPolicy")["nats"]["spec"]
    assert policy["policyTypes"] == ["Ingress"]
    monitor = monitoring(config["nats.conf"])[1]
    admitted = []
    for rule in policy["ingress"]:
        assert rule.get("from") and rule.get("ports"), rule  # no rule admits every source or every port
        if any(p["port"] == int(port) for p in rule["ports"]):
            assert rule["from"] == [{"podSelector": {"matchLabels": NATS["spec"]["selector"]["matchLabels"]}}]
            assert [p["port"] for p in rule["ports"]] == [int(port)]
        if any(p["port"] == monitor for p in rule["ports"]):
            admitted += rule["from"]
    assert sorted(admitted, key=str) == sorted([{"podSelector": {}}, {"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "keda"}}}], key=str)


# ------------------------------------------------------------------------------------- security
QUANTITY = {"m": 1e-3, "": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


def quantity(value) -> float:
    number, unit = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(value)).groups()
    return float(number) * QUANTITY[unit]


RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}  # the "restricted" Pod Security Standard's volume types


@pytest.mark.parametrize("key", sorted(PODS))
def test_every_pod_meets_the_restricted_standard_with_requests_and_limits(key):
    workload = PODS[key]
    spec = workload["spec"]["template"]["spec"]
    pod = spec["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] > 0
    assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["automountServiceAccountToken"] is False
    for volume in spec.get("volumes", ()):
        assert set(volume) - {"name"} <= RESTRICTED_VOLUMES, volume
    c = container(workload)
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["readOnlyRootFilesystem"] is True
    assert not {"privileged", "runAsUser", "runAsNonRoot"} & set(sc)  # the pod's, not overridden
    for resource in ("cpu", "memory"):
        assert quantity(c["resources"]["requests"][resource]) <= quantity(c["resources"]["limits"][resource])
    if workload is not NATS:  # the project's image: its user, and a writable /tmp (tempfile, the sandbox)
        uid = int(re.search(r"useradd .*--uid (\d+)", DOCKERFILE).group(1))
        assert pod["runAsUser"] == uid and "USER noetl" in DOCKERFILE
        [tmp] = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
        [volume] = [v for v in spec["volumes"] if v["name"] == tmp["name"]]
        assert "emptyDir" in volume and not tmp.get("readOnly")


def test_the_namespace_enforces_the_restricted_standard_and_everything_lives_in_it():
    [namespace] = of_kind("Namespace").values()
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for path, doc in DOCS:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == namespace["metadata"]["name"], (path, doc["metadata"]["name"])


# ------------------------------------------------------------------------------------- availability
def test_every_scalable_service_has_a_disruption_budget_and_the_autoscalers_can_measure_cpu():
    budgets = of_kind("PodDisruptionBudget")
    for name in (*SCALABLE, "gateway", "nats"):
        budget = budgets[name]["spec"]
        workload = DEPLOYMENTS.get(name) or NATS
        assert budget["selector"]["matchLabels"].items() <= workload["spec"]["template"]["metadata"]["labels"].items()
        assert budget.get("maxUnavailable") == 1 and "minAvailable" not in budget  # a drain can proceed
    hpas = of_kind("HorizontalPodAutoscaler")
    assert set(hpas) == {"admission", "router", "worker"}
    for name, hpa in hpas.items():
        target = hpa["spec"]["scaleTargetRef"]
        assert (target["kind"], target["name"]) == ("Deployment", name)
        assert "replicas" not in DEPLOYMENTS[name]["spec"]  # the autoscaler's to set, not each apply's
        [metric] = hpa["spec"]["metrics"]
        assert metric["resource"]["name"] == "cpu" and metric["resource"]["target"]["type"] == "Utilization"
        assert "cpu" in container(DEPLOYMENTS[name])["resources"]["requests"]  # utilization is of the request
        assert 2 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    for name, deployment in DEPLOYMENTS.items():
        if name not in hpas:
            assert deployment["spec"]["replicas"] >= 1


# ------------------------------------------------------------------------------------- TLS
OPERATIONS = (ROOT / "docs" / "operations.md").read_text()
KUBERNETES_DOC = OPERATIONS.split("\n## Kubernetes\n", 1)[1]
TLS_SETTINGS = ("NOETL_NATS_TLS_CA", "NOETL_NATS_TLS_CERT", "NOETL_NATS_TLS_KEY", "NOETL_GATEWAY_TLS_CERT",
                "NOETL_GATEWAY_TLS_KEY", "NOETL_PG_PASSWORD_FILE")


def secret_files(workload: dict) -> dict[str, tuple[str, str]]:
    """The files a pod's container sees from Secrets: path -> (Secret, key), through secret and
    projected volumes alike."""
    spec = workload["spec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in container(workload).get("volumeMounts", ())}
    out: dict[str, tuple[str, str]] = {}
    for volume in spec.get("volumes", ()):
        if volume["name"] not in mounts:
            continue
        if "secret" in volume:
            sources = [{"name": volume["secret"]["secretName"], "items": volume["secret"]["items"]}]
        elif "projected" in volume:
            sources = [s["secret"] for s in volume["projected"]["sources"] if "secret" in s]
        else:
            continue
        for source in sources:
            for item in source["items"]:  # each file named: a Secret's other keys are not laid out
                path = f"{mounts[volume['name']]}/{item['path']}"
                assert path not in out, path
                out[path] = (source["name"], item["key"])
    return out


def made_file(secret: str, key: str) -> str:
    """The `noetl certs` file a Secret's key holds, as docs/operations.md's commands create them:
    noetl-tls-ca from ca.crt, `kubectl create secret tls noetl-tls-NAME` from NAME.crt and NAME.key,
    noetl-postgres's password from postgres.password."""
    if secret == "noetl-tls-ca" and key == "ca.crt":
        return "ca.crt"
    if secret.startswith("noetl-tls-") and key in ("tls.crt", "tls.key"):
        return f"{secret.removeprefix('noetl-tls-')}.{key.split('.')[1]}"
    if (secret, key) == ("noetl-postgres", "password"):
        return certs.PASSWORD_FILE
    raise AssertionError(f"{secret}/{key}: not a file of noetl certs")


def compose_files(name: str) -> dict[str, str]:
    """A compose service's secrets: the path it sees -> the file's name under deploy/tls (or nats-creds)."""
    service = {**COMPOSE["services"].get(name, {}), **CLUSTER["services"].get(name, {})}  # nats-2: the override's
    out = {}
    for s in service.get("secrets", ()):
        source, target = (s, s) if isinstance(s, str) else (s["source"], s.get("target", s["source"]))
        out[f"/run/secrets/{target}"] = Path(COMPOSE["secrets"][source]["file"]).name
    return out


def test_each_tls_setting_names_the_file_compose_gives_it_from_its_own_secret():
    """As in compose: every TLS setting a service has there it has here, naming a file mounted from the
    Secret made of the same `noetl certs` file; the CA for everyone, the gateway's certificate for the
    gateway, the Postgres password for the recorder and the credentials service."""
    made = {"ca.crt", certs.PASSWORD_FILE} | {f"{leaf.name}.{ext}" for leaf in certs.leaves() for ext in ("crt", "key")}
    for key, workload in PODS.items():
        if workload is NATS:
            continue
        name = "setup" if workload is SETUP else key.split("/")[1]
        ours, theirs = env(workload), NOETL_COMPOSE[name]["environment"]
        files, compose = secret_files(workload), compose_files(name)
        assert {v for v in ours if v in TLS_SETTINGS} == {v for v in theirs if v in TLS_SETTINGS}, name
        for variable in TLS_SETTINGS:
            if variable in ours:
                path = ours[variable]["value"]
                assert made_file(*files[path]) == compose[theirs[variable]] and compose[theirs[variable]] in made, \
                    (name, variable)
        assert made_file(*files[ours["NOETL_NATS_TLS_CA"]["value"]]) == "ca.crt"
        assert files[ours["NOETL_NATS_CREDS"]["value"]][0].startswith("nats-seed-")  # the seed stays its own
        assert {n: e for n, e in ours.items() if n in TLS_SETTINGS and "value" not in e} == {}  # paths, not contents
        for variable, e in ours.items():
            assert "secretKeyRef" not in e.get("valueFrom", {}) or e["valueFrom"]["secretKeyRef"]["key"] not in (
                "tls.key", "tls.crt", "ca.crt", "password"), (name, variable)  # certificates and keys as files only
    gateway = env(DEPLOYMENTS["gateway"])
    assert secret_files(DEPLOYMENTS["gateway"])[gateway["NOETL_GATEWAY_TLS_KEY"]["value"]] == ("noetl-tls-gateway", "tls.key")
    recorder = env(DEPLOYMENTS["event-recorder"])
    assert secret_files(DEPLOYMENTS["event-recorder"])[recorder["NOETL_PG_PASSWORD_FILE"]["value"]] == \
        ("noetl-postgres", "password")


def test_nats_mounts_every_file_its_configuration_names_and_requires_tls():
    files = secret_files(NATS)
    text = K8S_CONF["nats.conf"] + K8S_CONF["nats-cluster.conf"]
    named = set(re.findall(r"/run/secrets/[\w.-]+", text))
    assert named == {f"/run/secrets/{f}" for f in ("ca.crt", "nats.crt", "nats.key", "nats-route.crt", "nats-route.key")}
    for path in named:
        assert made_file(*files[path]) == Path(path).name, path  # the file compose mounts at that path
        assert compose_files("nats-2")[path] == Path(path).name
    # the client port: TLS required, the handshake first (what the services' NOETL_NATS_TLS_FIRST default expects)
    client_tls = re.search(r"^tls \{([^}]*)\}", K8S_CONF["nats.conf"], re.M).group(1)
    assert "handshake_first" in client_tls and "cert_file: /run/secrets/nats.crt" in client_tls
    assert "allow_non_tls" not in text
    # the routes: TLS, the peer's certificate verified and mapped to the one route identity
    cluster = re.search(r"^cluster \{(.*)^\}", K8S_CONF["nats-cluster.conf"], re.M | re.S).group(1)
    route_tls = re.search(r"tls \{([^}]*)\}", cluster).group(1)
    assert "verify_and_map: true" in route_tls and "ca_file: /run/secrets/ca.crt" in route_tls
    assert "cert_file: /run/secrets/nats-route.crt" in route_tls
    assert re.search(r"authorization \{\s*user: \"([^\"]+)\"", cluster).group(1) == certs.ROUTE_SUBJECT
    assert re.findall(r"nats-route://", cluster) and "nats://" not in cluster


def test_each_key_goes_to_the_pod_that_serves_with_it_only():
    holders: dict[tuple[str, str], set[str]] = {}
    for key, workload in PODS.items():
        for path, (secret, item) in secret_files(workload).items():
            if secret.startswith("noetl-tls-") or secret == "noetl-postgres":
                holders.setdefault((secret, item), set()).add(key)
    services = {k for k in PODS if k != "StatefulSet/nats"}
    assert holders == {
        ("noetl-tls-ca", "ca.crt"): set(PODS),
        ("noetl-tls-nats", "tls.crt"): {"StatefulSet/nats"}, ("noetl-tls-nats", "tls.key"): {"StatefulSet/nats"},
        ("noetl-tls-nats-route", "tls.crt"): {"StatefulSet/nats"}, ("noetl-tls-nats-route", "tls.key"): {"StatefulSet/nats"},
        ("noetl-tls-gateway", "tls.crt"): {"Deployment/gateway"}, ("noetl-tls-gateway", "tls.key"): {"Deployment/gateway"},
        ("noetl-postgres", "password"): {"Deployment/event-recorder", "Deployment/credentials"}}
    assert services <= holders[("noetl-tls-ca", "ca.crt")]
    for key, workload in PODS.items():  # read-only files, the pod's group reads them (0440, fsGroup)
        spec = workload["spec"]["template"]["spec"]
        for volume in spec["volumes"]:
            if any("secret" in source for source in volume.get("projected", {}).get("sources", ())):
                assert volume["projected"]["defaultMode"] == 0o440, key
                [mount] = [m for m in container(workload)["volumeMounts"] if m["name"] == volume["name"]]
                assert mount["readOnly"] is True, key
        assert "fsGroup" in spec["securityContext"], key


def test_no_key_material_is_in_a_manifest_and_the_ca_key_is_never_mounted():
    for path in FILES:
        text = path.read_text()
        assert "-----BEGIN" not in text and "PRIVATE KEY" not in text, path
        assert "ca.key" not in text, path
    for key, workload in PODS.items():
        for name, e in env(workload).items():
            assert "BEGIN" not in e.get("value", ""), (key, name)


def nats_hosts_of_the_doc() -> list[str]:
    [command] = re.findall(r"^noetl certs --out deploy/tls (.*)$", KUBERNETES_DOC, re.M)
    return re.findall(r"--nats-host (\S+)", command)


def test_the_names_dialled_are_names_of_the_certificates_the_doc_makes():
    """The services dial nats-N.nats (NOETL_NATS_URL), the routes nats-N.nats:6222, the ingress the
    Service `gateway`: each name is on the certificate `noetl certs` makes with the doc's options, and
    the NATS names are not without --nats-host."""
    leaves = {leaf.name: leaf for leaf in certs.leaves(nats_hosts=nats_hosts_of_the_doc())}
    plain = {leaf.name: leaf for leaf in certs.leaves()}
    clients = {h.split(":")[0] for h in re.findall(r"tls://([^,]+)", env(DEPLOYMENTS["router"])["NOETL_NATS_URL"]["value"])}
    routes = set(re.findall(r"nats-route://([^:,\]]+):", K8S_CONF["nats-cluster.conf"]))
    assert len(clients) == len(routes) == NATS["spec"]["replicas"]
    assert clients <= set(leaves["nats"].sans) and routes <= set(leaves["nats-route"].sans)
    assert not (clients | routes) & set(plain["nats"].sans + plain["nats-route"].sans)
    assert of_kind("Service")["gateway"]["metadata"]["name"] in leaves["gateway"].sans
    assert "localhost" in leaves["nats"].sans and "localhost" in leaves["gateway"].sans  # the doc's port-forwards


def test_the_doc_creates_every_secret_the_manifests_name_and_asks_postgres_for_verify_full():
    shell = "\n".join(re.findall(r"```sh\n(.*?)```", KUBERNETES_DOC, re.S)).replace("\\\n", " ")
    for loop in re.finditer(r"^for (\w+) in ([^;]+); do\n(.*?)\ndone$", shell, re.M | re.S):
        var, words, body = loop.groups()
        shell += "\n" + "\n".join(body.replace(f"${var}", w) for w in words.split())
    created = {}
    for m in re.finditer(r"kubectl -n noetl create secret (generic|tls) ([\w-]+) (.*)", shell):
        kind, name, rest = m.groups()
        keys = {"tls.crt", "tls.key"} if kind == "tls" else set(re.findall(r"--from-(?:file|literal)=([\w.-]+)=", rest))
        files = re.findall(r"deploy/tls/([\w.-]+)", rest)
        created[name] = (keys, files)
    named: dict[str, set[str]] = {}
    for workload in PODS.values():
        for secret, key in secret_files(workload).values():
            named.setdefault(secret, set()).add(key)
        for e in env(workload).values():
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref and not ref.get("optional"):
                named.setdefault(ref["name"], set()).add(ref["key"])
    for secret, keys in named.items():
        assert secret in created and keys <= created[secret][0], (secret, keys)
        if secret.startswith("noetl-tls-") and secret != "noetl-tls-ca":  # NAME.crt and NAME.key of noetl certs
            assert sorted(created[secret][1]) == sorted(made_file(secret, k) for k in ("tls.crt", "tls.key"))
    dsn = dict(p.split("=", 1) for p in re.search(r"--from-literal=dsn='([^']*)'", shell).group(1).split())
    assert dsn["sslmode"] == "verify-full" and "password" not in dsn
    recorder = secret_files(DEPLOYMENTS["event-recorder"])
    assert made_file(*recorder[dsn["sslrootcert"]]) == "ca.crt"
    assert dsn["host"] in certs.leaves()[2].sans  # postgres.crt's name, for a Postgres in the namespace
