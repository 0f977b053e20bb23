"""The wheel a user installs holds what the engine needs at run time: every package (the services, the
sandbox), the web console's files, and builds without a warning from setuptools (a warning there has
meant files silently left out)."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[list[str], str]:
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out),
                            str(ROOT)], capture_output=True, text=True, timeout=240)
    assert build.returncode == 0, build.stdout + build.stderr
    (path,) = out.glob("noetl_mesh-*.whl")
    return zipfile.ZipFile(path).namelist(), build.stdout + build.stderr


def test_the_wheel_holds_the_console_and_every_package(wheel):
    names, _ = wheel
    ui = ROOT / "services" / "gateway" / "ui"
    for f in ui.rglob("*"):
        if f.is_file():
            assert f"noetl_mesh/services/gateway/ui/{f.relative_to(ui).as_posix()}" in names, f
    for module in ("noetl_mesh/sandbox/forkserver.py", "noetl_mesh/sandbox/seccomp.py",
                   "noetl_mesh/services/credentials/service.py", "noetl_mesh/services/worker/service.py",
                   "noetl_mesh/tools/python_runner.py", "noetl_mesh/infra/pg_migrations.py"):
        assert module in names, module
    packages = {str(p.parent.relative_to(ROOT)) for p in ROOT.glob("libs/noetl_mesh/**/__init__.py")}
    packages |= {str(p.parent.relative_to(ROOT)) for p in ROOT.glob("services/**/__init__.py")}
    for package in packages:
        inside = package.replace("libs/", "", 1) if package.startswith("libs/") else "noetl_mesh/" + package
        assert f"{inside}/__init__.py" in names, package


def test_the_wheel_builds_without_setuptools_warnings(wheel):
    _, log = wheel
    assert "absent from the `packages` configuration" not in log
    assert "deprecated" not in log.lower()
