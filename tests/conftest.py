# The harness that starts real NATS and Postgres on loopback, lazily, only for tests that ask for them.
import signal

pytest_plugins = ["noetl_mesh.testing.pytest_plugin"]

# A test run a shell started in the background (`bash .ci/run &`, nohup) ignores SIGINT, and so would
# every process it starts: `noetl run` and the fixture API then rightly keep ignoring it, and the tests
# that interrupt them with SIGINT wait in vain. A handled signal is reset to its default in a child.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
