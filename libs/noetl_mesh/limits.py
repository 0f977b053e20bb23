"""Every limit and budget of the engine, in one place; docs/limits.md lists them for users.

A limit bounds what one request, one playbook, one template or one task may cost, so that one careless
or hostile input fails alone, with an error that names the limit, while every other execution keeps
its latency. Each has a default a user would expect and an environment variable that changes it,
``NOETL_LIMIT_<NAME>`` (read when the process starts; set it on every service that checks the limit).

Code reads the current values as attributes: ``limits.current().max_body_bytes``. A breach raises (or
reports) :class:`LimitExceeded`, whose message says what was too big, where, the limit, and how to
raise it. Tests change values with :func:`override`.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Iterator

ENV_PREFIX = "NOETL_LIMIT_"
KIB, MIB = 1024, 1024 * 1024


@dataclass(frozen=True)
class Limit:
    name: str
    default: int | float
    unit: str  # bytes, characters, ms, levels, values, steps, items, seconds, ...
    what: str  # what it bounds, in a few words, as the start of an error message ("the request body")
    checked: str  # where it is checked (for docs/limits.md)

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


# The table. Grouped by boundary; keep docs/limits.md in step (a test checks every entry is there).
LIMITS: tuple[Limit, ...] = (
    # ---- HTTP (gateway)
    Limit("http_request_seconds", 30, "seconds", "the time a client has to send a request (line, headers and body)",
          "gateway, every connection: closed when no request has arrived whole within it of the connection or "
          "of the last response (slow clients holding connections open)"),
    Limit("max_http_connections", 4096, "connections", "the gateway's open connections and requests in progress",
          "gateway: past it, a new request is answered 503 at once and its connection closed"),
    Limit("max_view_bytes", 64 * MIB, "bytes", "the values one answer reads back from the payload store",
          "gateway, GET /api/executions/{id} and a run's result (413, before anything is read)"),
    Limit("max_body_bytes", 16 * MIB, "bytes", "the request body",
          "gateway, every request with a body (413)"),
    Limit("max_json_depth", 64, "levels", "the nesting of a JSON request body",
          "gateway, every JSON body (422)"),
    Limit("max_body_values", 1_000_000, "values", "the values of a JSON request body",
          "gateway, every JSON body, counted before parsing (413)"),
    Limit("max_login_bytes", 128 * KIB, "bytes", "a login request's body",
          "gateway, POST /api/auth/login (413): the one body read before the caller is known"),

    # ---- documents (playbooks: files, catalog, inline)
    Limit("max_document_bytes", 4 * MIB, "bytes", "the playbook text",
          "validator (CLI, gateway, catalog, admission)"),
    Limit("max_document_depth", 64, "levels", "the nesting of the playbook",
          "validator"),
    Limit("max_document_nodes", 500_000, "values", "the number of values in the playbook (YAML aliases expanded)",
          "validator, before aliases are expanded"),
    Limit("max_steps", 1_000, "steps", "the number of steps of the playbook",
          "validator"),
    Limit("max_template_chars", 512 * KIB, "characters", "the text of all the templates of the playbook",
          "validator, before any template is parsed (parsing costs about 10 us per character)"),

    # ---- executions
    Limit("max_workload_bytes", 4 * MIB, "bytes", "the workload (JSON)",
          "gateway (413), `noetl run` on its own stack (exit 1) and admission (the request is refused)"),
    Limit("max_loop_items", 1_000_000, "items", "the collection of a loop (loop.in)",
          "loop-coordinator (the loop step fails)"),
    Limit("max_task_attempts", 100, "attempts", "a retry rule's attempts (its first included)",
          "validator: the playbook is invalid"),
    Limit("max_task_visits", 100_000, "visits", "max_steps: the task visits of one pipeline run",
          "validator: the playbook is invalid"),
    Limit("max_step_runs", 50_000, "step runs", "the step runs one execution started (a loop's iterations "
          "not counted)", "router: the execution fails"),
    Limit("max_tree_executions", 100_000, "executions",
          "the child executions one root execution's tree has requested (every depth together)",
          "admission, as it evaluates a child's request (the child fails, and so the task that called it)"),
    Limit("max_timer_seconds", 7 * 24 * 3600, "seconds", "a delay, wait, timeout or instant ahead",
          "validator (literal values) and the worker (templated ones); timers live in the events stream"),
    Limit("max_signal_bytes", 256 * KIB, "bytes", "a signal's payload",
          "gateway, POST /api/executions/{id}/signals/{name} (413)"),
    Limit("max_state_events", 500_000, "events", "the events folded for one view of an execution's state",
          "event-recorder, the console's view (GET /api/executions/{id}/state) and a restart's seed "
          "(POST /api/executions/{id}/restart): 413"),
    Limit("max_live_streams", 1_000, "streams", "the live streams (server-sent events) one gateway serves at once",
          "gateway, GET /api/live/...: 503 with Retry-After"),
    Limit("max_live_streams_per_session", 8, "streams", "the live streams of one session or API token at once",
          "gateway, GET /api/live/...: 429 with Retry-After"),
    Limit("live_stream_seconds", 900, "seconds", "how long one live stream lasts",
          "gateway: the stream ends with an event `bye`; the console opens a new one"),
    Limit("signal_check_seconds", 2, "seconds", "checking a signal's payload against its wait's schema",
          "gateway, POST /api/executions/{id}/signals/{name}: in a child process capped at 1 GiB (422)"),
    Limit("signal_check_steps", 50_000, "steps",
          "checking a signal that came before its wait against the wait's schema, in the control plane",
          "admission and the loop-coordinator, when the signal meets its wait: the signal is refused "
          "(signal.checked), the wait goes on waiting"),

    # ---- templates (every render, in every service)
    Limit("template_max_ms", 250, "ms", "the time one template render takes",
          "every render: the task, arc or rule holding the template fails"),
    Limit("template_max_output", 1_000_000, "characters or items",
          "what one template builds (a string's characters, a list's items, added up)",
          "every render: the task, arc or rule holding the template fails"),
    Limit("template_max_int_digits", 4_300, "digits", "an integer a template builds",
          "every render: the task, arc or rule holding the template fails"),

    # ---- task results
    Limit("max_result_bytes", 32 * MIB, "bytes", "a task's result",
          "worker: the task ends with error kind result_too_large"),
    Limit("max_value_depth", 64, "levels", "the nesting of a value a task returns or a template makes",
          "worker (the task's tool_error), templates (template_error); at most 200: the event log's "
          "encoder stops at 254 levels, its envelope included"),

    # ---- sandboxed tasks (D33): python and duckdb task processes, set by the worker
    Limit("task_max_memory_bytes", 2048 * MIB, "bytes", "the memory a task process allocates",
          "worker, each python, duckdb or shell task process (RLIMIT_DATA): the task fails with limit_exceeded"),
    Limit("task_max_cpu_seconds", 600, "seconds", "the CPU time of a task process",
          "worker, each python, duckdb or shell task process (RLIMIT_CPU): the process is stopped, limit_exceeded"),
    Limit("task_max_open_files", 256, "files", "the files and sockets a task process holds open at once",
          "worker, each python, duckdb or shell task process (RLIMIT_NOFILE): opening one more fails"),
    Limit("task_max_file_bytes", 1024 * MIB, "bytes", "the size of a file a task process writes",
          "worker, each python, duckdb or shell task process (RLIMIT_FSIZE): the write fails"),
    Limit("task_max_seconds", 3600, "seconds", "the time one task runs (python, duckdb, shell, nats, postgres, http), "
          "whatever its spec.timeout says",
          "worker: a task's spec.timeout above it (or none, or 0) is this; the process is killed (timeout)"),
    Limit("task_max_threads", 512, "threads", "the threads one task process may add to what its user runs when the task starts",
          "worker, each task process (RLIMIT_NPROC, per user: a worker that does not run as root): starting one more fails"),
    Limit("max_task_processes", 8, "processes", "the python, duckdb and shell task processes one worker runs at once",
          "worker: a task waits for a free one, in its lane's turn"),
    Limit("lane_reserve", 1, "slots", "the run slots, and the task processes, of a worker that one lane (one "
          "user's executions) never takes: they are kept for the other users",
          "worker: a lane at its share waits until one of its own frees; 0: none kept"),
    Limit("shell_max_processes", 128, "processes", "the processes and threads one shell task may add "
          "to what its user runs when the task starts",
          "worker, each shell task process (RLIMIT_NPROC of its unprivileged user): starting one more fails, "
          "the task fails with limit_exceeded"),
    Limit("shell_max_output_bytes", 1 * MIB, "bytes", "what a shell task keeps of its standard output, and of "
          "its standard error",
          "worker, each shell task: stdout keeps its first bytes, stderr its last, with a marker; the rest is read "
          "and dropped"),

    # ---- replies over NATS (queries)
    Limit("max_reply_bytes", 768 * KIB, "bytes", "a query's reply over NATS",
          "event-recorder: pages are cut by bytes, bigger values go by reference (D23)"),

    # ---- sessions and logins (access control): read by the sessions service
    Limit("session_lifetime", 24 * 3600, "seconds", "the absolute lifetime of a login session",
          "sessions: a session ends this long after its login, however active"),
    Limit("session_idle", 30 * 60, "seconds", "the idle time of a login session",
          "sessions: a session without activity for this long ends"),
    Limit("session_refresh_interval", 60, "seconds", "the time between two activity writes of a session",
          "sessions: a validation writes the session's activity at most once per interval"),
    Limit("max_sessions_per_user", 100, "sessions", "the live sessions of one user",
          "sessions: a login past it ends the user's oldest session"),
    Limit("max_tokens_per_user", 100, "tokens", "the API tokens of one user",
          "sessions: creating one more is refused"),
    Limit("max_password_bytes", 1 * KIB, "bytes", "a password",
          "sessions: login and password changes (bad_request)"),
    Limit("login_slow_after", 3, "failures", "failed logins of a user before each next attempt waits",
          "sessions: the next attempt waits 1 s, 2 s, 4 s, ... (locked, with retry_after)"),
    Limit("login_lock_after", 10, "failures", "failed logins of a user before it is locked",
          "sessions: logins of the user are refused for login_lock_seconds (locked)"),
    Limit("login_address_slow_after", 20, "failures", "failed logins from one address before each next attempt waits",
          "sessions: as login_slow_after, per client address"),
    Limit("login_address_lock_after", 100, "failures", "failed logins from one address before it is locked",
          "sessions: as login_lock_after, per client address"),
    Limit("login_lock_seconds", 15 * 60, "seconds", "how long a lock lasts and failures are remembered",
          "sessions: a user or address is locked this long; failures are forgotten this long after the last"),
    Limit("oidc_max_bytes", 1 * MIB, "bytes", "an OIDC discovery document, key set or ID token",
          "sessions: OIDC login (unauthenticated; unavailable for the provider's documents)"),
    Limit("oidc_jwks_max_age", 3600, "seconds", "how long an identity provider's key set is cached",
          "sessions: the key set is fetched again after this"),
    Limit("oidc_jwks_min_interval", 30, "seconds", "the time between two key set fetches for unknown key ids",
          "sessions: an ID token with an unknown kid fetches the key set at most once per interval"),
    Limit("audit_retention", 90 * 24 * 3600, "seconds", "the age of an audit record",
          "sessions: the NOETL_AUDIT stream's max age, set when the stream is created"),

    # ---- schedules (D31): read by the scheduler (and the gateway, which checks first)
    Limit("max_schedules", 1_000, "schedules", "the schedules of the stack",
          "scheduler: adding one more is refused (409)"),
    Limit("max_schedules_per_user", 100, "schedules", "the schedules one user creates",
          "scheduler: adding one more is refused (409), so that one user cannot take the stack's max_schedules"),
    Limit("max_schedule_bytes", 256 * KIB, "bytes", "a schedule's definition (JSON, workload included)",
          "gateway (413) and scheduler (refused)"),
    Limit("schedule_fire_ttl", 3600, "seconds", "how long a firing waits for the scheduler",
          "NATS drops a firing no scheduler took within it (set on the schedule message when added or resumed)"),

    # ---- the metrics port of every service process (infra/probes.py)
    Limit("metrics_connections", 32, "connections", "the connections the metrics port answers at once",
          "every service's metrics port: more are closed unanswered"),
    Limit("metrics_request_seconds", 10, "seconds", "the time a metrics-port client has to send its request",
          "every service's metrics port: a slower or idle connection is dropped"),
)

_BY_NAME = {limit.name: limit for limit in LIMITS}


def by_name(name: str) -> Limit:
    return _BY_NAME[name]


class LimitExceeded(ValueError):
    """A value over a limit. ``str()`` is the message for the user."""

    def __init__(self, name: str, actual: int | float | None, where: str = "", what: str | None = None):
        self.limit = _BY_NAME[name]
        self.name, self.actual, self.where = name, actual, where
        self.value = getattr(current(), name)
        what = what or self.limit.what
        size = f" is {amount(actual, self.limit.unit)}" if actual is not None else ""
        prefix = f"{where}: " if where else ""
        super().__init__(
            f"{prefix}{what}{size}, over the limit {name} = {amount(self.value, self.limit.unit)} "
            f"(set {self.limit.env} to change it)")

    @property
    def kind(self) -> str:
        return "limit_exceeded"


def exceeded(name: str, actual: int | float, where: str = "") -> LimitExceeded | None:
    """The :class:`LimitExceeded` to raise or report when ``actual`` is over limit ``name`` now, else None."""
    return LimitExceeded(name, actual, where) if actual > getattr(current(), name) else None


def amount(value: int | float, unit: str) -> str:
    if unit == "bytes" and isinstance(value, int) and value >= KIB:
        for size, suffix in ((MIB, "MiB"), (KIB, "KiB")):
            if value >= size:
                n = value / size
                return f"{n:.0f} {suffix}" if n == int(n) else f"{n:.1f} {suffix}"
    if isinstance(value, int):
        return f"{value:,} {unit}"
    return f"{value:g} {unit}"


class Limits:
    """The current values, as attributes named like the limits."""

    def __init__(self, values: dict[str, int | float]):
        self.__dict__.update(values)

    def __getattr__(self, name: str) -> Any:  # only reached for unknown names
        raise AttributeError(f"no limit named {name!r}; known: {', '.join(_BY_NAME)}")

    def as_dict(self) -> dict[str, int | float]:
        return {name: getattr(self, name) for name in _BY_NAME}


def _parse(limit: Limit, raw: str) -> int | float:
    try:
        value: int | float = int(raw) if isinstance(limit.default, int) else float(raw)
    except ValueError:
        raise ValueError(f"{limit.env}={raw!r}: expected a {type(limit.default).__name__}") from None
    if value < 0 or (value == 0 and limit.name not in MAY_BE_ZERO):
        raise ValueError(f"{limit.env}={raw!r}: must be positive{' or 0' if limit.name in MAY_BE_ZERO else ''}")
    return value


MAY_BE_ZERO = frozenset({"lane_reserve"})  # 0 turns it off


def from_environment(environ: dict[str, str] | None = None) -> Limits:
    env = os.environ if environ is None else environ
    values = {}
    for limit in LIMITS:
        raw = env.get(limit.env)
        values[limit.name] = _parse(limit, raw) if raw not in (None, "") else limit.default
    return Limits(values)


_current = from_environment()


def current() -> Limits:
    return _current


@contextlib.contextmanager
def override(**values: int | float) -> Iterator[Limits]:
    """Change limits inside a ``with`` block (tests)."""
    global _current
    unknown = set(values) - set(_BY_NAME)
    if unknown:
        raise AttributeError(f"no limit named {', '.join(sorted(unknown))}")
    before = _current
    _current = Limits({**before.as_dict(), **values})
    try:
        yield _current
    finally:
        _current = before


def describe() -> list[dict[str, Any]]:
    """Every limit with its default, current value and variable (``noetl limits``, docs)."""
    now = current()
    return [{"name": limit.name, "default": limit.default, "value": getattr(now, limit.name), "unit": limit.unit,
             "env": limit.env, "what": limit.what, "checked": limit.checked} for limit in LIMITS]
