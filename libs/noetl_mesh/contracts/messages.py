"""The messages of :mod:`.subjects`, as pydantic models: the AsyncAPI document's schemas come from them
(``model_json_schema``), and tests check what the engine really sends against them.

The event envelope and commands are exact (no unknown fields); request bodies list the fields their
services read; replies name the fields clients rely on and allow more (a reply may gain a field).
A value over the payload limit travels as a :class:`PayloadRef` in its place (D23), so the payload
fields of events and commands accept one anywhere.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, RootModel

from ..core.events import CORRELATION_KEYS, ENTITY

EventName = Literal[tuple(ENTITY)]  # type: ignore[valid-type]
Writer = Literal["gateway", "admission", "router", "loop-coordinator", "worker", "scheduler", "timer"]


class _Exact(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class PayloadRef(_Exact):
    """A value stored in the payload object store instead of inline (D23)."""
    store: Literal["nats-object:noetl_payloads"]
    key: str = Field(description="SHA-256 of the value's JSON, hex")
    size: int
    checksum: str = Field(pattern=r"^sha256:[0-9a-f]{64}$")


class Event(_Exact):
    """One event (D20): the envelope every writer shapes with ``core/events.make_event``."""
    event_id: str = Field(description="stable id (D21): a redelivery reproduces it")
    execution_id: str
    timestamp: float = Field(description="epoch seconds")
    source: str = Field(description="the writer: gateway, admission, router, loop-coordinator, worker:<pool>, "
                                    "scheduler, timer")
    name: EventName  # type: ignore[valid-type]
    entity: str
    entity_id: str
    status: Literal["in_progress", "success", "error", "paused"]
    step: Optional[str] = None
    task: Optional[str] = None
    data: dict[str, Any] | PayloadRef = Field(default_factory=dict, description="the event's payload (by name)")
    workflow_run_id: Optional[str] = None
    step_run_id: Optional[str] = None
    task_run_id: Optional[str] = None
    parent_id: Optional[str] = None
    action_id: Optional[str] = None
    attempt: Optional[int] = None
    iteration: Optional[int] = None


assert set(CORRELATION_KEYS) <= set(Event.model_fields)


class EventsMessage(RootModel[list[Event]]):
    """An events message: 1 to 1024 events of one execution and one writer, in order."""
    root: list[Event] = Field(min_length=1, max_length=1024)


class ChunkEntry(_Exact):
    iteration: int
    command_id: str
    iter: Any = Field(description="the iteration's scope: {<iterator>: item, index, parent}")


class Resume(_Exact):
    continuation: dict[str, Any] | PayloadRef
    outcome: dict[str, Any] | PayloadRef


class Command(_Exact):
    """A worker's command: one step run, one loop iteration or a chunk of them, or a resume."""
    command_id: str
    pool: str
    execution_id: str
    step: str
    step_run_id: str
    iteration: Optional[int] = None
    chunk: Optional[list[ChunkEntry]] | PayloadRef = None
    iterations: Optional[list[int]] = Field(None, description="a chunk's iterations [first, end): its failure "
                                                              "names them when the chunk itself cannot be read")
    tasks: list[dict[str, Any]] = Field(description="the step's tool tasks, as validated")
    workbook: list[dict[str, Any]] | dict[str, Any] = Field(default_factory=list)
    spec_layers: dict[str, Any]
    workload: Any = None
    ctx: Any = None
    args: Any = None
    iter: Any = None
    steps: Any = None
    keychain: Any = None
    loop_mode: Optional[str] = None
    resume: Optional[Resume] | PayloadRef = None
    flat: bool = Field(False, description="the execution has no loop step: the run's ctl events travel as flat")
    requested_by: Optional[dict[str, Union[str, list[str]]]] = Field(
        None, description="who started the execution (a child: its root): {user_id, username, roles?}; roles: "
                          "those the request carried (an API token's may be fewer than its owner's). The worker "
                          "runs nothing for a disabled user; a pool's roles are checked against these and the "
                          "user's roles now")
    authored_by: Optional[dict[str, Union[str, list[str]]]] = Field(
        None, description="who wrote the playbook it runs (who registered its catalog version, or who sent it "
                          "inline); checked as well")
    called_by: list[dict[str, Union[str, list[str]]]] = Field(
        default_factory=list, description="a child execution's: who wrote each playbook above it, root first; "
                                          "each checked as its author is")


class CancelNotice(_Exact):
    execution_id: str
    status: Optional[str] = Field(None, description="the execution's final status (it finished)")
    runs: list[str] = Field(default_factory=list, description="step runs to stop")
    only_runs: Optional[bool] = Field(None, description="only these runs timed out (D29); the execution goes on")


class MaxDeliveriesAdvisory(_Open):
    """``io.nats.jetstream.advisory.v1.max_deliver`` (the server's)."""
    type: str
    stream: str
    consumer: str
    stream_seq: int
    deliveries: int


class Error(_Exact):
    kind: str = Field(description="bad_request, not_found, invalid_playbook, conflict, too_large, unavailable, "
                                  "unauthenticated, forbidden, locked, invalid_schedule, internal, ...")
    message: str
    details: Any = None
    retry_after: Optional[float] = None


class ErrorReply(_Exact):
    """Any request's answer when it fails."""
    error: Error


class Empty(_Exact):
    pass


class TreeCount(_Open):
    """An increment of a counter stream: the body is empty when published (header Nats-Incr: +1); the
    server stores the running total, and answers it in the PubAck (``val``)."""
    val: Optional[str] = Field(None, description="the total, as the server stores it (a decimal string)")


# ---- the event-recorder's requests and replies
class CatalogRegisterRequest(_Exact):
    content: str = Field(description="the playbook's YAML text")
    registered_by: Optional[dict[str, Any]] = Field(None, description="who registers it (the gateway's caller)")
    any_path: bool = Field(False, description="the caller may register versions of any path (catalog.any); "
                                              "otherwise only of a new path or one whose first version it registered")


class CatalogGetRequest(_Exact):
    id: Optional[int] = None
    path: Optional[str] = None
    version: Optional[int] = None


class CatalogListRequest(_Exact):
    path: Optional[str] = None
    limit: Optional[int] = Field(None, le=10_000)


class CatalogEntry(_Open):
    id: int
    path: str
    version: int
    name: Optional[str] = None
    created_at: Any = None
    content: str | PayloadRef | None = None
    registered_by: Optional[dict[str, Any]] = None


class CatalogList(RootModel[list[CatalogEntry]]):
    pass


class ExecutionGetRequest(_Exact):
    execution_id: str
    brief: Optional[bool] = None
    reader: Optional[str] = Field(None, description="the user it is read for: one large fold at a time each")


class ExecutionSummary(_Open):
    """The D26 summary (status, steps, ctx, workload, error, children...) and projection fields."""
    execution_id: str
    status: str
    event_count: Optional[int] = None


class ExecutionEventsRequest(_Exact):
    execution_id: str
    offset: Optional[int] = None
    limit: Optional[int] = Field(None, le=1000)
    names: Optional[list[str]] = Field(None, max_length=50, description="only events of these names")
    step: Optional[str] = None
    task: Optional[str] = None
    iteration: Optional[int] = None
    step_run_id: Optional[str] = None


class EventsPage(_Open):
    events: list[Event]
    total: int
    offset: int
    limit: int
    next_offset: Optional[int]


class ExecutionListRequest(_Exact):
    status: Optional[str] = None
    user: Optional[str] = None
    path: Optional[str] = None
    id_prefix: Optional[str] = Field(None, description="executions whose id starts with this")
    since: Optional[float] = Field(None, description="created at or after (epoch seconds)")
    until: Optional[float] = Field(None, description="created before (epoch seconds)")
    offset: Optional[int] = None
    limit: Optional[int] = Field(None, le=1000)


class ExecutionStateRequest(_Exact):
    execution_id: str
    upto: Optional[int] = Field(None, ge=0, description="the state after the first `upto` events of the log")
    seq: Optional[int] = Field(None, description="the state after the event of this log sequence")
    net: Optional[bool] = Field(None, description="also the playbook's net (nodes and edges)")
    reader: Optional[str] = Field(None, description="the user it is read for: one large fold at a time each")


class ExecutionView(_Open):
    """core/view.py: steps (status, runs, skipped, active, tokens), runs (the last ones per step: args,
    result, error, loop progress; values over 2 KiB as previews), tokens on places, ctx, waits,
    children; where it stands in the log."""
    execution_id: str
    status: str
    steps: dict[str, Any]
    runs: dict[str, Any]
    tokens: list[dict[str, Any]]
    position: int = Field(description="events of the log folded into it")
    total: int = Field(description="events in the log")
    at: Optional[dict[str, Any]] = Field(None, description="the event it stands after (compact), when not the last")


class ExecutionTimelineRequest(_Exact):
    execution_id: str
    from_: Optional[float] = Field(None, alias="from", description="the window's start (epoch seconds)")
    to: Optional[float] = Field(None, description="the window's end (epoch seconds)")
    buckets: Optional[int] = Field(None, ge=1, le=400, description="slices of the window a big loop is counted in")
    reader: Optional[str] = Field(None, description="the user it is read for: one large fold at a time each")


class ExecutionTimeline(_Open):
    """core/timeline.py: the step runs (the last 500) with their admission, start and end, status, task
    attempts, waits, and loops (iterations one by one up to 100, else counts per slice of the window)."""
    execution_id: str
    status: Optional[str] = None
    start: Optional[float] = Field(None, description="the first event's time (epoch seconds)")
    end: Optional[float] = Field(None, description="when it finished; null while it runs")
    runs: list[dict[str, Any]]
    runs_total: int
    window: dict[str, Any] = Field(description="{from, to, buckets, width}: what loops are counted over")


class ExecutionStatsRequest(_Exact):
    since: Optional[float] = Field(None, description="created at or after (epoch seconds)")
    until: Optional[float] = Field(None, description="created before (epoch seconds)")
    buckets: Optional[int] = Field(None, ge=1, le=400)


class ExecutionStats(_Open):
    """Executions created in ``[since, until)``: per status and slice of time, the slowest playbooks
    (duration percentiles of the finished ones), the failures by error kind."""
    since: float
    until: float
    by_status: list[dict[str, Any]]
    totals: dict[str, int]
    slowest: list[dict[str, Any]]
    failures: list[dict[str, Any]]


class ExecutionSeedRequest(_Exact):
    execution_id: str
    from_step: str = Field(description="the step to restart from")
    reader: Optional[str] = Field(None, description="the user it is read for: one large fold at a time each")


class RestartSeed(_Open):
    """core/restart.py ``seed``: what a restart of the execution from ``step`` starts with (D32)."""
    execution_id: str
    step: str
    upto_event: str = Field(description="the step's first step.started: the state is folded up to it")
    playbook: dict[str, Any] = Field(description="the document that ran (or its D23 reference)")
    catalog: Optional[dict[str, Any]] = Field(None, description="its catalog path and version")
    workload: Any = Field(description="the execution's workload")
    iter_parent: Any = None
    state: dict[str, Any] = Field(description="ctx, runs (each step's last finished run), skipped, tokens, delayed")
    status: Optional[str] = Field(None, description="the execution's final status")


class ExecutionResultRequest(_Exact):
    execution_id: str
    run_id: str


class RunResult(_Open):
    execution_id: str
    run_id: str
    step: Optional[str] = None
    event: str = Field(description="the run's terminal event: step.done, step.failed or loop.done")
    result: Any = None
    error: Any = None


class LiveNotice(_Open):
    """What one committed batch recorded of one execution (services/event_recorder/live.py)."""
    execution_id: str
    count: int
    names: dict[str, int]
    events: list[dict[str, Any]] = Field(description="the newest (at most 20): envelopes without data, with seq")
    status: Optional[str] = None


class LiveWatch(_Open):
    keys: list[str] = Field(description="execution ids, and \"*\" for the executions list (at most 10,000 are read)")
    ttl: float = Field(15.0, description="seconds they stay watched unless said again (at most 60)")


class LiveAsk(_Open):
    """Empty: say what you watch."""


class LiveListNotice(_Open):
    executions: list[dict[str, str]] = Field(description="{execution_id, event}: requested, evaluated, started, finished")
    more: int = 0


class ExecutionRow(_Open):
    execution_id: str
    status: str
    path: Optional[str] = None
    version: Optional[int] = None
    parent_execution_id: Optional[str] = None
    requested_by: Any = None


class ExecutionList(RootModel[list[ExecutionRow]]):
    pass


class ExecutionWaitsRequest(_Exact):
    execution_id: Optional[str] = None
    kind: Optional[str] = None
    limit: Optional[int] = None
    principal: Optional[dict[str, Any]] = None
    mine: Optional[bool] = None


class Wait(_Open):
    wait_id: str
    execution_id: str
    step: str
    kind: str


class WaitList(RootModel[list[Wait]]):
    pass


class RecorderPing(_Exact):
    ok: bool
    database: bool
    consumer: bool
    lag: Optional[int]
    recorded: int
    rejected: int


class CredentialUser(_Exact):
    """A user a credential names (D24): whoever it is, they may use it."""
    user_id: str
    username: str


class CredentialPutRequest(_Exact):
    name: str
    kind: str = "generic"
    data: dict[str, Any]
    description: Optional[str] = None
    roles: Optional[list[str]] = None  # who may use it from a playbook (D24); a new one's: admin
    users: Optional[list[CredentialUser]] = None  # ... or by name, whatever their roles; a new one's: none


class CredentialRolesRequest(_Exact):
    name: str
    roles: list[str]
    users: Optional[list[CredentialUser]] = None  # None: kept


class CredentialNameRequest(_Exact):
    name: str


class CredentialGetRequest(CredentialNameRequest):
    include_data: Optional[bool] = None


class CredentialInfo(_Open):
    name: str
    kind: str
    description: Optional[str] = None
    roles: Optional[list[str]] = None
    users: Optional[list[CredentialUser]] = None


class CredentialList(RootModel[list[CredentialInfo]]):
    pass


class CommandRef(_Exact):
    """Where a command is stored in NOETL_COMMANDS while a worker holds it."""
    seq: int
    subject: str


class CredentialResolveRequest(_Exact):
    """Stored credential names (declared by the command's keychain) for the command a worker holds."""
    names: list[str]
    execution_id: str
    command: CommandRef


class ExecutionStatusRequest(_Exact):
    execution_id: str


class ExecutionStatus(_Open):
    execution_id: str
    status: Optional[str] = None
    requested_by: Optional[str] = None


class CredentialValues(RootModel[dict[str, dict[str, Any]]]):
    """Credential name -> its fields (never written to the object store)."""


class Deleted(_Open):
    deleted: bool


# ---- the sessions service's (its fields: services/sessions/service.py)
class BootstrapRequest(_Exact):
    username: Optional[str] = None
    password: Optional[str] = None
    client_ip: Optional[str] = None


class BootstrapReply(_Open):
    created: bool
    token: Optional[str] = None


class LoginRequest(_Exact):
    username: Optional[str] = None
    password: Optional[str] = None
    id_token: Optional[str] = None
    nonce: Optional[str] = None
    client_ip: Optional[str] = None


class Principal(_Open):
    user_id: str
    username: str
    roles: list[str]
    kind: str


class LoginReply(_Open):
    token: str
    principal: Principal


class TokenRequest(_Exact):
    token: str
    client_ip: Optional[str] = None


class SessionsRequest(_Open):
    """A request made for a caller: ``principal`` (the validated caller), ``client_ip``, and the verb's fields."""
    principal: Optional[Principal] = None
    client_ip: Optional[str] = None


class Revoked(_Open):
    revoked: list[dict[str, Any]]


class SessionList(_Open):
    sessions: list[dict[str, Any]]


class UserReply(_Open):
    user: dict[str, Any]


class UserList(_Open):
    users: list[dict[str, Any]]


class UserStandingRequest(_Exact):
    user_id: str


class UserStanding(_Exact):
    exists: bool
    active: bool
    roles: list[str]


class TokenCreated(_Open):
    token: str
    token_id: str
    name: str
    roles: list[str]


class TokenList(_Open):
    tokens: list[dict[str, Any]]


class AuditRecord(_Open):
    audit_id: str
    at: str
    action: str
    outcome: str
    actor: Optional[dict[str, Any]] = None
    client_ip: Optional[str] = None
    target: Optional[dict[str, Any]] = None
    details: Optional[dict[str, Any]] = None


class AuditList(_Open):
    records: list[AuditRecord]


class RevokedNotice(_Open):
    user_id: Optional[str] = None
    session_id: Optional[str] = None
    token_id: Optional[str] = None
    reason: Optional[str] = None


# ---- the scheduler's (D31)
class ScheduleAddRequest(_Exact):
    schedule: dict[str, Any] = Field(description="path, version, workload, and one of cron (+ timezone), every, at; "
                                                 "name")
    created_by: Optional[dict[str, Any]] = None


class ScheduleIdRequest(_Exact):
    id: str


class ScheduleGetRequest(ScheduleIdRequest):
    next: Optional[int] = Field(None, le=100)


class ScheduleListRequest(_Exact):
    offset: Optional[int] = None
    limit: Optional[int] = None


class ScheduleRecord(_Open):
    id: str
    path: str


class ScheduleList(_Open):
    schedules: list[ScheduleRecord]


class ScheduleFiring(_Open):
    """The body of a schedule's message and of each firing: the schedule's id and generation."""
    id: str


# ---- NATS micro discovery (the nats-py micro library's answers)
class MicroPing(_Open):
    type: str = Field(description="io.nats.micro.v1.ping_response")
    name: str
    id: str
    version: str
    metadata: Optional[dict[str, str]] = None


class MicroInfo(MicroPing):
    """io.nats.micro.v1.info_response: also ``description`` and ``endpoints``."""


class MicroStats(MicroPing):
    """io.nats.micro.v1.stats_response: also ``started`` and each endpoint's counts."""


# ---- KV values and objects
class Member(_Open):
    """A replica's heartbeat value."""


class KvRecord(_Open):
    """A JSON record of the sessions service's buckets (services/sessions/store.py)."""


class PayloadObject(RootModel[Any]):
    """The JSON of one stored value; its object's name is the SHA-256 of that JSON."""


MODELS: dict[str, type[BaseModel]] = {name: obj for name, obj in dict(globals()).items()
                                      if isinstance(obj, type) and issubclass(obj, BaseModel)
                                      and obj.__module__ == __name__ and not name.startswith("_")}
