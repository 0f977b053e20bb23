"""The ``noetl`` command (D26), one module per group of commands:

- ``app``: the parser, assembled from the groups below, and :func:`main` (nothing imports from it);
- ``common``: the exit codes, one-line errors, signals and the calls to a gateway;
- ``output``: the output layer (``-o table|yaml|json``) and ``noetl run``'s progress;
- ``playbooks`` (validate, lint, schema, asyncapi, migrate, register), ``run`` (run, and restart),
  ``executions`` (ls, status, events, cancel, restart, signal, waits, verify), ``stack`` (up, service, setup,
  bootstrap, nats-credentials), ``certs``, ``operate`` (ps, inspect), ``credentials``, ``users`` (login,
  logout, whoami, session, user, token), ``schedules``, ``completion``.
"""
from .app import build_parser, main
from .stack import DEFAULT_METRICS_PORT

__all__ = ["main", "build_parser", "DEFAULT_METRICS_PORT"]
