"""The container tests' fixtures: the images (once per session), and for each test module one compose
stack of its own (the module's COMPOSE_FILES, docker-compose.yml by default), up and healthy, with the
first admin logged in; torn down at the module's end (images kept). What each phase took is printed at
the end of the run (measured, never asserted): docs/operations.md keeps the figures."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from container_images import PROJECT_IMAGE, base_images, build_project, ensure
from container_report import NOTES, TIMES, note, timed
from container_stack import Compose, problem

# Without a Docker engine (or compose) test_containers.py skips as a whole, in one line that says why;
# the other module is not collected, so that the line is the only one
if problem():
    collect_ignore = ["test_containers_cluster.py"]


def summary() -> list[str]:
    return [f"{phase:<52} {seconds:7.1f}" for phase, seconds in TIMES.items()] + NOTES if TIMES else []


def pytest_terminal_summary(terminalreporter) -> None:  # in one process (pytest -n 0)
    if lines := summary():
        terminalreporter.section("containers: what each phase took (seconds)")
        for line in lines:
            terminalreporter.write_line(line)


def pytest_sessionfinish(session) -> None:  # in an xdist worker: tests/conftest.py prints them
    if hasattr(session.config, "workeroutput") and (lines := summary()):
        session.config.workeroutput["containers"] = lines


@pytest.fixture(scope="session")
def images() -> dict[str, str]:
    """Every base image (pulled, present or a stand-in), then the project's image: ref -> how."""
    how = {}
    with timed("base images (pull or stand-ins)"):
        for ref, kind in base_images().items():
            how[ref] = ensure(ref, kind, note)
    with timed("project image (deploy/Dockerfile)"):
        build_project(note)
    how[PROJECT_IMAGE] = "built"
    return how


@pytest.fixture(scope="module")
def stack(images, request, tmp_path_factory) -> Iterator[Compose]:
    noetl = shutil.which("noetl") or str(Path(sys.executable).parent / "noetl")
    name = request.module.__name__.rsplit(".", 1)[-1].replace("_", "-")
    compose = Compose(tmp_path_factory.mktemp("compose"), f"noetl-{name}", noetl, note,
                      files=getattr(request.module, "COMPOSE_FILES", ("docker-compose.yml",)))
    compose.prepare()
    compose.down()  # what a run that was killed left behind
    try:
        yield compose
    finally:
        if os.environ.get("NOETL_CONTAINERS_KEEP"):  # to look at a failure: docker ps, docker logs
            note(f"kept: {' '.join(compose.cmd)} -p {compose.project} -f {compose.file} down --volumes")
        else:
            with timed(f"compose down ({name})"):
                compose.down()


class Cli:
    """The `noetl` command line of this environment, with a configuration directory of its own."""

    def __init__(self, stack: Compose) -> None:
        self.stack = stack
        self.env = {k: v for k, v in os.environ.items() if k not in ("NOETL_TOKEN", "NOETL_GATEWAY_URL")}
        self.env["XDG_CONFIG_HOME"] = str(stack.workdir / "config")
        # the stack's CA, for its NATS (tls://) and its proxy (https://)
        self.env["NOETL_NATS_TLS_CA"] = self.env["NOETL_GATEWAY_CA"] = str(stack.ca)

    def __call__(self, *args: str, input: str | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
        return subprocess.run([self.stack.noetl, *args], capture_output=True, text=True, input=input,
                              env=self.env, cwd=self.stack.workdir, timeout=timeout)

    def ps(self) -> list[dict]:
        """`noetl ps --json` against the stack's NATS, as its admin."""
        out = self("ps", "--nats-url", self.stack.nats, "--nats-creds", str(self.stack.creds), "--json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)


@pytest.fixture(scope="module")
def cli(stack) -> Cli:
    return Cli(stack)


@pytest.fixture(scope="module")
def up(stack) -> Compose:
    """The stack up, every health check passed; its proxy's and NATS's published addresses known (both
    TLS only: https://, tls://)."""
    with timed(f"compose up, every health check passed ({stack.project})"):
        stack.up()
        states = stack.wait_healthy()
    assert states and all(s in ("healthy", "exited:0") for s in states.values()), states
    stack.gateway = "https://" + stack.port("proxy", 8082)
    stack.nats = "tls://" + stack.port("nats", 4222)
    return stack


@pytest.fixture(scope="module")
def token(up, cli) -> str:
    """The first admin: `noetl bootstrap` as the NATS admin (the published NATS port), `noetl login`."""
    out = cli("bootstrap", "--nats-url", up.nats, "--nats-creds", str(up.creds / "admin.nk"), "--out", "admin.token")
    assert out.returncode == 0, out.stderr
    assert oct(os.stat(up.workdir / "admin.token").st_mode & 0o777) == "0o600"
    out = cli("login", "--gateway", up.gateway, "--token", "-", input=(up.workdir / "admin.token").read_text())
    assert out.returncode == 0 and "logged in" in out.stdout, out.stderr
    return (up.workdir / "admin.token").read_text().strip()
