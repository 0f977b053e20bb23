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
deploy/, and each Deployment has at most one autoscaler with or without KEDA.
"""
from __future__ import annotations

import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from noetl_mesh.cli import DEFAULT_METRICS_PORT, build_parser
from noetl_mesh.contracts.subjects import COMMANDS
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
    triggers = {t["type"]: t for t in spec["triggers"]}
    js = triggers["nats-jetstream"]["metadata"]
    jsonschema.validate(js, NATS_JETSTREAM)
    # the pool's durable consumer (services/worker: pool-<pool>) of the commands stream
    assert (js["stream"], js["consumer"]) == (COMMANDS, f"pool-{args.pool}")
    assert js["account"] == "$G"  # nats-auth.conf's users live in the global account (no accounts block)
    assert "accounts" not in NATS_CONF
    host, port = js["natsServerMonitoringEndpoint"].split(":")
    nats_service = of_kind("Service")[NATS["spec"]["serviceName"]]
    assert host == f"{nats_service['metadata']['name']}.{NATS['metadata']['namespace']}.svc.cluster.local"
    assert int(port) == int(conf_value(NATS_CONF, "http_port"))
    # in a cluster the scaler may ask the consumer leader at <server_name>.<endpoint host>: the server
    # names are the pods' names, which the headless Service resolves
    assert env(NATS)["NATS_SERVER_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert nats_service["spec"]["clusterIP"] == "None"
    jsonschema.validate(triggers["cpu"]["metadata"], CPU_TRIGGER)
    assert triggers["cpu"]["metricType"] == "Utilization"
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
    # every node of the StatefulSet, at its client port, through the headless Service
    client = int(conf_value(NATS_CONF, "port"))
    nodes = [f"nats://{NATS['metadata']['name']}-{i}.{NATS['spec']['serviceName']}:{client}"
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
    assert args.host == "0.0.0.0" and port_named(gateway, "http") == args.port
    service = of_kind("Service")["gateway"]
    [port] = service["spec"]["ports"]
    assert port_named(gateway, port["targetPort"]) == args.port
    assert service["spec"]["selector"].items() <= DEPLOYMENTS["gateway"]["spec"]["template"]["metadata"]["labels"].items()
    # NATS: the ports its configuration opens, and compose's health check
    nats = container(NATS)
    assert port_named(nats, "client") == int(conf_value(NATS_CONF, "port"))
    assert port_named(nats, "monitor") == int(conf_value(NATS_CONF, "http_port"))
    assert port_named(nats, "cluster") == int(conf_value(NATS_CLUSTER_CONF, "listen").split(":")[1])
    compose_check = " ".join(COMPOSE["services"]["nats"]["healthcheck"]["test"])
    ready = nats["readinessProbe"]["httpGet"]
    assert f"http://127.0.0.1:{port_named(nats, ready['port'])}{ready['path']}" in compose_check
    headless = of_kind("Service")["nats"]["spec"]
    assert headless["publishNotReadyAddresses"] is True  # the nodes find each other before they are ready
    assert {p["targetPort"] for p in headless["ports"]} == {"client", "cluster", "monitor"}


def test_nats_runs_deploy_s_configuration():
    config = of_kind("ConfigMap")["nats-config"]["data"]
    assert config["nats.conf"] == NATS_CONF

    def without_routes(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith(("#", "routes:"))]

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
    # only the NATS pods reach the (unauthenticated) route port
    policy = of_kind("NetworkPolicy")["nats"]["spec"]
    for rule in policy["ingress"]:
        if any(p["port"] == int(port) for p in rule["ports"]):
            assert rule["from"] == [{"podSelector": {"matchLabels": NATS["spec"]["selector"]["matchLabels"]}}]
            assert [p["port"] for p in rule["ports"]] == [int(port)]


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
