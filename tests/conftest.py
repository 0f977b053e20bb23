# The harness that starts real NATS and Postgres on loopback, lazily, only for tests that ask for them.
import signal

import pytest

pytest_plugins = ["noetl_mesh.testing.pytest_plugin"]

# A test run a shell started in the background (`bash .ci/run &`, nohup) ignores SIGINT, and so would
# every process it starts: `noetl run` and the fixture API then rightly keep ignoring it, and the tests
# that interrupt them with SIGINT wait in vain. A handled signal is reset to its default in a child.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# pytest-xdist (pyproject.toml: -n auto --dist loadgroup) hands out groups of tests whole: each module is one
# (its module-scoped servers and stacks start once), the container tests together are one (one image build,
# one Docker engine's worth of stacks at a time). First, before xdist reads the groups
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if not item.get_closest_marker("xdist_group"):
            group = "containers" if item.get_closest_marker("containers") else item.nodeid.split("::", 1)[0]
            item.add_marker(pytest.mark.xdist_group(group))


# what the container tests' worker measured (tests/containers/conftest.py), printed by the process that
# writes the terminal
WORKER_LINES: list[str] = []


def pytest_configure(config) -> None:
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_WorkerReports())


class _WorkerReports:
    def pytest_testnodedown(self, node, error) -> None:
        WORKER_LINES.extend(getattr(node, "workeroutput", {}).get("containers", ()))

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if WORKER_LINES:
            terminalreporter.section("containers: what each phase took (seconds)")
            for line in WORKER_LINES:
                terminalreporter.write_line(line)
