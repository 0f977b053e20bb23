# The harness that starts real NATS and Postgres on loopback, lazily, only for tests that ask for them.
pytest_plugins = ["noetl_mesh.testing.pytest_plugin"]
