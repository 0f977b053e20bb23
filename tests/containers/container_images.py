"""The images the container tests need. A base image (the Dockerfile's `FROM`, the compose file's
`image:`) is used as it is when the machine has it and is not a stand-in, pulled when a registry has it,
and otherwise built here as a stand-in (tests/containers/standins/README.md) under the same tag, so the
project's files are the same for a user with a registry. Stand-ins start from Debian bookworm made by
mmdebstrap once: its tree is kept in the cache directory and imported as `noetl-standin/minbase`;
images are kept between runs (Docker's layer cache makes a rebuild of an unchanged stand-in a second).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parents[2]
STANDINS = Path(__file__).parent / "standins"
CACHE = Path(os.environ.get("NOETL_CONTAINERS_CACHE") or Path.home() / ".cache" / "noetl-mesh" / "containers")
MINBASE = "noetl-standin/minbase:bookworm"
DEBIAN = "noetl-standin/debian:bookworm"
STANDIN_LABEL = "org.noetl-mesh.stand-in"
PROJECT_IMAGE = "noetl-mesh:local"  # docker-compose.yml's `image:` of the project's services


def docker(*args: str, timeout: float = 600, check: bool = True, input: str | None = None,
           cwd: Path | None = None) -> subprocess.CompletedProcess:
    out = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, input=input, cwd=cwd)
    if check and out.returncode:
        raise RuntimeError(f"docker {' '.join(args)}: exit {out.returncode}: {(out.stderr or out.stdout).strip()[-3000:]}")
    return out


def engine_problem() -> str | None:
    """None when a Docker engine answers, else why not (one line)."""
    if not shutil.which("docker"):
        return "no docker command"
    try:
        out = docker("info", "--format", "{{.ServerVersion}}", timeout=20, check=False)
    except subprocess.TimeoutExpired:
        return "the Docker engine does not answer (20 s)"
    if out.returncode or not out.stdout.strip():
        return "no Docker engine answers: " + (out.stderr.strip().splitlines() or ["?"])[-1]
    return None


def exists(ref: str) -> bool:
    return docker("image", "inspect", ref, check=False, timeout=30).returncode == 0


def is_standin(ref: str) -> bool:
    out = docker("image", "inspect", "--format", f'{{{{index .Config.Labels "{STANDIN_LABEL}"}}}}', ref,
                 check=False, timeout=30)
    return out.returncode == 0 and out.stdout.strip() not in ("", "<no value>")


def base_images() -> dict[str, str]:
    """Every registry image the project's Dockerfile and the compose stack under test use: tag -> the
    stand-in that replaces it (a folder of standins/)."""
    refs = re.findall(r"^FROM\s+(\S+)", (ROOT / "deploy" / "Dockerfile").read_text(), re.M)
    import yaml

    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    refs += [services[name]["image"] for name in ("nats", "postgres", "proxy", "prometheus")]
    wanted = {}
    for ref in refs:
        kind = ref.split(":")[0].rsplit("/", 1)[-1]
        assert (STANDINS / kind / "Dockerfile").exists(), f"no stand-in for {ref}"
        wanted[ref] = kind
    return wanted


def ensure(ref: str, kind: str, log) -> str:
    """Make `ref` available; answers how: "present", "pulled" or "stand-in"."""
    if exists(ref) and not is_standin(ref):
        return "present"
    if not exists(ref):
        pulled = docker("pull", "--quiet", ref, check=False, timeout=600)
        if pulled.returncode == 0:
            return "pulled"
        log(f"{ref}: cannot be pulled ({(pulled.stderr.strip().splitlines() or ['?'])[-1][:120]}): a stand-in")
    build_standin(ref, kind, log)
    return "stand-in"


def minbase(log) -> None:
    """Debian bookworm, minbase, imported from a tree kept in the cache (made by mmdebstrap once)."""
    if exists(MINBASE):
        return
    CACHE.mkdir(parents=True, exist_ok=True)
    tar = CACHE / "bookworm-minbase.tar"
    if not tar.exists():
        if not shutil.which("mmdebstrap"):
            raise RuntimeError("no mmdebstrap to make the stand-ins' Debian base (apt-get install mmdebstrap)")
        log("mmdebstrap: Debian bookworm minbase (once; kept in %s)" % CACHE)
        started = time.monotonic()
        part = tar.with_suffix(".part")
        out = subprocess.run(
            ["mmdebstrap", "--variant=minbase", "--format=tar", "--include=ca-certificates",
             # what Debian's slim images leave out
             "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-exclude=/usr/share/man/*",
             "--dpkgopt=path-exclude=/usr/share/locale/*", "--dpkgopt=path-include=/usr/share/locale/locale.alias",
             "--aptopt=APT::Install-Recommends \"false\"", "bookworm", str(part)],
            capture_output=True, text=True, timeout=1200)
        if out.returncode:
            raise RuntimeError(f"mmdebstrap failed: {out.stderr.strip()[-2000:]}")
        part.rename(tar)
        log(f"mmdebstrap: {time.monotonic() - started:.0f} s")
    docker("import", "--change", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "--change", 'CMD ["bash"]', str(tar), MINBASE)


def build_context(kind: str, extra: dict[str, Path]) -> tempfile.TemporaryDirectory:
    tmp = tempfile.TemporaryDirectory(prefix=f"noetl-standin-{kind}-")
    shutil.copytree(STANDINS / kind, tmp.name, dirs_exist_ok=True)
    for name, source in extra.items():
        target = Path(tmp.name) / name
        if source.is_dir():
            shutil.copytree(source, target, dirs_exist_ok=True)
        else:
            shutil.copy2(source, target)
    return tmp


def debian(log) -> None:
    """The stand-ins' common base: the minbase trusting the machine's local certificate authorities."""
    minbase(log)
    local_ca = Path(tempfile.mkdtemp(prefix="noetl-local-ca-"))
    try:
        for crt in Path("/usr/local/share/ca-certificates").glob("**/*.crt"):
            shutil.copy2(crt, local_ca / crt.name)
        with build_context("debian", {"local-ca": local_ca}) as ctx:
            docker("build", "--quiet", "-t", DEBIAN, ctx, timeout=900)
    finally:
        shutil.rmtree(local_ca, ignore_errors=True)


def build_standin(ref: str, kind: str, log) -> None:
    debian(log)
    extra = {}
    if kind == "nats":
        from noetl_mesh.infra.embedded import find_nats_server

        extra["nats-server"] = find_nats_server()  # the server version the project tests with
    started = time.monotonic()
    with build_context(kind, extra) as ctx:
        docker("build", "--quiet", "-t", ref, ctx, timeout=1200)
    log(f"{ref}: stand-in built ({time.monotonic() - started:.0f} s)")


def build_project(log) -> float:
    """deploy/Dockerfile, tagged as docker-compose.yml names it; answers the seconds it took."""
    started = time.monotonic()
    docker("build", "--quiet", "-f", "deploy/Dockerfile", "-t", PROJECT_IMAGE, ".", cwd=ROOT, timeout=1800)
    took = time.monotonic() - started
    log(f"{PROJECT_IMAGE}: built in {took:.0f} s")
    return took
