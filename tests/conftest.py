# The harness that starts real NATS and Postgres on loopback, lazily, only for tests that ask for them.
import os
import signal

import pytest

pytest_plugins = ["noetl_mesh.testing.pytest_plugin"]

# A test run a shell started in the background (`bash .ci/run &`, nohup) ignores SIGINT, and so would
# every process it starts: `noetl run` and the fixture API then rightly keep ignoring it, and the tests
# that interrupt them with SIGINT wait in vain. A handled signal is reset to its default in a child.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# pytest-xdist (pyproject.toml: -n auto): two workers per CPU, since most of a test's time is waiting
# (servers starting, timers, redeliveries): on 2 CPUs the suite took 5:58 with 4 workers, 9:05 with 2.
# PYTEST_XDIST_AUTO_NUM_WORKERS (or -n N) says otherwise
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    return 2 * len(os.sched_getaffinity(0))


# They take units of tests whole, the next one as they are nearly done: each module is one (its
# module-scoped servers and stacks start once); all the container tests are one, the first (one image
# build, one Docker engine's worth of stacks at a time)
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "tests/containers" if module.startswith("tests/containers/") else module

    return ByModule(config, log)


# what the container tests' worker measured (tests/containers/conftest.py), printed by the process that
# writes the terminal
WORKER_LINES: list[str] = []


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    WORKER_LINES.extend(getattr(node, "workeroutput", {}).get("containers", ()))


def pytest_terminal_summary(terminalreporter) -> None:
    if WORKER_LINES:
        terminalreporter.section("containers: what each phase took (seconds)")
        for line in WORKER_LINES:
            terminalreporter.write_line(line)
