"""docker-compose.yml, run as a user runs it: from a directory of its own holding a copy of the file and
of deploy/, with the seeds made there by `noetl nats-credentials` and the CA, certificates and Postgres
password by `noetl certs` (and a client certificate, `intruder`, that the tests try as a NATS route),
under a project name of its own.

The only change to the file: its published ports get a host port chosen by Docker (`127.0.0.1::4222`)
instead of the fixed ones, so a run never collides with whatever else listens on this machine. The
observability services (Jaeger, Prometheus, Grafana) are not started: their images have no stand-in
here (tests/containers/standins/README.md), and the services' traces are turned off
(`OTEL_SDK_DISABLED=true`) since no collector listens.
"""
from __future__ import annotations

import base64
import functools
import ipaddress
import os
import shutil
import subprocess
import time
from pathlib import Path

import yaml

from container_images import ROOT, docker, engine_problem

OBSERVABILITY = ("jaeger", "prometheus", "grafana")


def compose_command() -> list[str] | None:
    """The compose v2 plugin when the docker command has it, else docker-compose (v1); None: neither."""
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) and subprocess.run([*cmd, "version"], capture_output=True).returncode == 0:
            return cmd
    return None


def free_net_prefix() -> str:
    """The first 172.30.N.0/24 that no Docker network of this host overlaps (docker-compose.yml's
    NOETL_NET_PREFIX): a network left by a killed run, or anyone else's, never stops a run."""
    ids = docker("network", "ls", "-q").stdout.split()
    subnets = docker("network", "inspect", "--format",
                     "{{range .IPAM.Config}}{{.Subnet}} {{end}}", *ids).stdout.split() if ids else []
    taken = [ipaddress.ip_network(s, strict=False) for s in subnets if ":" not in s]
    for n in range(80, 256):
        candidate = ipaddress.ip_network(f"172.30.{n}.0/24")
        if not any(candidate.overlaps(t) for t in taken):
            return f"172.30.{n}"
    raise RuntimeError(f"no free 172.30.N.0/24 among this host's Docker networks: {subnets}")


@functools.cache
def problem() -> str | None:
    """Why the container tests cannot run here (no Docker engine answers, no compose), or None."""
    return engine_problem() or (None if compose_command() else "neither `docker compose` nor `docker-compose` works")


class Compose:
    def __init__(self, workdir: Path, project: str, noetl: str, log,
                 files: tuple[str, ...] = ("docker-compose.yml",)) -> None:
        self.workdir, self.project, self.noetl, self.log = workdir, project, noetl, log
        self.cmd = compose_command()
        assert self.cmd, "neither `docker compose` nor `docker-compose` works"
        self.file = workdir / "docker-compose.yml"
        self.files = [workdir / f for f in files]  # the first is docker-compose.yml, the others override it
        self.creds = workdir / "deploy" / "nats-creds"
        self.tls = workdir / "deploy" / "tls"
        self.ca = self.tls / "ca.crt"  # what every client of the stack trusts
        self.env = {**os.environ, "NOETL_CREDENTIAL_KEY": base64.b64encode(os.urandom(32)).decode(),
                    "GRAFANA_ADMIN_PASSWORD": base64.b64encode(os.urandom(12)).decode(),  # interpolated only
                    "OTEL_SDK_DISABLED": "true"}

    # ------------------------------------------------------------------ the project directory
    def prepare(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        shutil.copytree(ROOT / "deploy", self.workdir / "deploy",
                        ignore=shutil.ignore_patterns("nats-creds", "tls", "Dockerfile"), dirs_exist_ok=True)
        doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
        for service in doc["services"].values():
            if "ports" in service:
                service["ports"] = ["127.0.0.1::" + p.rsplit(":", 1)[1] for p in service["ports"]]
        self.file.write_text(yaml.safe_dump(doc, sort_keys=False))
        for extra in self.files[1:]:
            doc["services"].update(yaml.safe_load(extra.read_text())["services"])
        self.services = [name for name in doc["services"] if name not in OBSERVABILITY]
        self.env["NOETL_NET_PREFIX"] = free_net_prefix()
        # as the Containers section says: the seeds, readable by the image's user too
        out = subprocess.run([self.noetl, "nats-credentials", "--out", str(self.creds), "--reader", "10001"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        out = subprocess.run([self.noetl, "certs", "--out", str(self.tls), "--reader", "10001", "--client", "intruder"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr

    # ------------------------------------------------------------------ compose
    def run(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        files = [a for f in self.files for a in ("-f", str(f))]
        out = subprocess.run([*self.cmd, "-p", self.project, *files, *args], cwd=self.workdir,
                             env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and out.returncode:
            raise RuntimeError(f"{' '.join(self.cmd)} {' '.join(args)}: exit {out.returncode}:\n"
                               f"{(out.stderr + out.stdout)[-4000:]}")
        return out

    def up(self, scale: dict[str, int] | None = None, services: list[str] | None = None) -> float:
        """`up -d` of the engine's services (existing containers kept); answers the seconds it took."""
        started = time.monotonic()
        args = ["up", "-d", "--no-build", "--no-recreate"]
        for name, n in (scale or {}).items():
            args += ["--scale", f"{name}={n}"]
        self.run(*args, *(services or self.services))
        return time.monotonic() - started

    def down(self) -> float:
        started = time.monotonic()
        self.run("down", "--volumes", "--remove-orphans", timeout=300, check=False)
        return time.monotonic() - started

    def containers(self, service: str | None = None, all: bool = False) -> list[str]:
        """Container names of the project (of one service), running ones unless ``all``."""
        filters = ["--filter", f"label=com.docker.compose.project={self.project}"]
        if service:
            filters += ["--filter", f"label=com.docker.compose.service={service}"]
        out = docker("ps", *(["-a"] if all else []), *filters, "--format", "{{.Names}}")
        return sorted(out.stdout.split())

    def health(self) -> dict[str, str]:
        """Each container's state: its health check's status, or its state when it has none."""
        names = self.containers(all=True)
        if not names:
            return {}
        out = docker("inspect", "--format",
                     "{{.Name}} {{if .State.Health}}{{.State.Health.Status}}{{else}}{{.State.Status}}:{{.State.ExitCode}}{{end}}",
                     *names)
        return dict(line.lstrip("/").split(" ", 1) for line in out.stdout.splitlines())

    def wait_healthy(self, timeout: float = 240) -> dict[str, str]:
        """Until every container is healthy (setup: exited 0); answers the states (last seen)."""
        deadline = time.monotonic() + timeout
        while True:
            states = self.health()
            if states and all(s == "healthy" or s == "exited:0" and "setup" in n for n, s in states.items()):
                return states
            if time.monotonic() > deadline:
                return states
            time.sleep(1)

    def port(self, service: str, port: int) -> str:
        """host:port that Docker published ``port`` of ``service`` on."""
        [name] = self.containers(service)[:1]
        out = docker("port", name, str(port))
        return out.stdout.split()[0].replace("0.0.0.0", "127.0.0.1")

    def logs(self, service: str | None = None) -> str:
        return self.run("logs", "--no-color", *([service] if service else []), check=False, timeout=120).stdout
