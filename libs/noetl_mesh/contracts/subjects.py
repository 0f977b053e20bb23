"""Every NATS name of the engine, in one place: streams, KV buckets, the object store, and every
subject with who sends it, who receives it and what it carries (pure data, no I/O).

The modules that talk to NATS take their names from here (``infra/bus.py``, ``infra/nats_auth.py``,
``infra/membership.py``, ``infra/payloads.py``, ``core/schedules.py``, ``core/access.py``, the sessions
service); :data:`CHANNELS` describes each subject for the AsyncAPI document (``noetl asyncapi``,
``contracts/asyncapi.py``), and a test fails when the code uses a subject this list does not name.
An address is a subject with ``{parameters}`` for its variable tokens.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

# ------------------------------------------------------------------------------ streams and stores
EVENTS = "NOETL_EVENTS"
COMMANDS = "NOETL_COMMANDS"
LOST_COMMANDS = "NOETL_LOST_COMMANDS"
AUDIT = "NOETL_AUDIT"
SCHEDULES = "NOETL_SCHEDULES"
TREES = "NOETL_TREES"  # counters (allow_msg_counter): child executions per root
MEMBERS_BUCKET = "noetl_members"
SESSIONS_BUCKET, USERS_BUCKET, LOGINS_BUCKET = "noetl_sessions", "noetl_users", "noetl_logins"
SESSION_BUCKETS = (SESSIONS_BUCKET, USERS_BUCKET, LOGINS_BUCKET)
SCHEDULES_BUCKET = "noetl_schedules"
PAYLOADS_BUCKET = "noetl_payloads"  # object store (D23)

# ------------------------------------------------------------------------------ subjects
EVENT_SUBJECTS = "noetl.evt.*.*.*"  # writer, class, execution
TIMER_SUBJECTS = "noetl.sched.*.*"  # execution, timer: D29 timers, message schedules of the events stream
LEGACY_EVENT_SUBJECTS = "noetl.evt.*.*"  # class, execution: the layout of earlier versions (setup migrates it)
STORED_EVENTS = "noetl.pevt.>"  # the events stream's transform: noetl.pevt.<partition>.<class>.<execution>.<writer>
# by pool, execution and lane; by pool and execution, and by pool (earlier versions, still read)
COMMAND_SUBJECTS = ("noetl.cmd.*.*.*", "noetl.cmd.*.*", "noetl.cmd.*")
MAX_DELIVERIES = f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{COMMANDS}.*"
CANCEL_PREFIX = "noetl.cancel."
AUDIT_PREFIX = "noetl.audit."
AUDIT_SUBJECTS = (AUDIT_PREFIX + ">",)
SESSIONS_REVOKED = "noetl.sessions.revoked"  # core NATS notice: drop cached validations
# What the recorder has just committed (core NATS, after each batch's transaction): the console's live
# streams (services/gateway/live.py). Per execution, and one subject for changes of the executions list.
LIVE_PREFIX = "noetl.live."
LIVE_EXECUTION = LIVE_PREFIX + "x"  # noetl.live.x.<execution_id>
LIVE_LIST = LIVE_PREFIX + "list"
LIVE_WATCH = "noetl.watch.live"  # gateways -> recorders: which of those notices an open console stream shows
LIVE_ASK = LIVE_PREFIX + "ask"  # a recorder that starts -> gateways: say what you watch now
TREE_PREFIX = "noetl.tree."  # noetl.tree.<root execution id>: its tree's child executions, counted
SCHEDULE_DEF_PREFIX = "noetl.schedule.def."
SCHEDULE_FIRE_PREFIX = "noetl.schedule.fire."
SCHEDULE_SUBJECTS = (SCHEDULE_DEF_PREFIX + "*", SCHEDULE_FIRE_PREFIX + "*")
SCHEDULE_Q_PREFIX = "noetl.q.schedule."
SCHEDULE_VERBS = ("add", "list", "get", "pause", "resume", "delete")

# Every connection's replies come to its inbox, _INBOX.<its public key>.<...> (nats_auth.inbox_prefix).
INBOX = "_INBOX."


def answerable(reply: str | None) -> bool:
    """Whether a request's reply subject is an inbox. A service answers nowhere else: NATS lets a
    responder publish to whatever reply subject the requester names, past the responder's own
    permissions, so a requester could otherwise have it write into a stream, a bucket or another
    service's subject. (A reply subject NATS rewrites on the way, across a service import ``_R_.`` or a
    super-cluster gateway ``_GR_.``, would not pass: neither is used here.)"""
    return isinstance(reply, str) and reply.startswith(INBOX) and len(reply) > len(INBOX)


# request/reply, answered by the event-recorder (queue group ``event-recorder``)
# the kind of an error reply (``{"error": {kind, message, details}}``), and the HTTP status the gateway
# answers with for it (any other kind: 502)
STATUS_OF_KIND = {"bad_request": 400, "unauthenticated": 401, "forbidden": 403, "not_found": 404,
                  "conflict": 409, "payload_missing": 410, "too_large": 413, "invalid_playbook": 422, "locked": 429,
                  "unavailable": 503, "timeout": 503, "too_many": 429}
Q_CATALOG_REGISTER = "noetl.q.catalog.register"
Q_CATALOG_GET = "noetl.q.catalog.get"
Q_CATALOG_LIST = "noetl.q.catalog.list"
Q_EXECUTION_GET = "noetl.q.execution.get"
Q_EXECUTION_EVENTS = "noetl.q.execution.events"
Q_EXECUTION_LIST = "noetl.q.execution.list"
Q_EXECUTION_WAITS = "noetl.q.execution.waits"  # D30: waits in progress (the inbox)
Q_EXECUTION_STATE = "noetl.q.execution.state"  # the console's view of the state after event N (core/view.py)
Q_EXECUTION_RESULT = "noetl.q.execution.result"  # one step run's whole result (the console's download)
Q_EXECUTION_STATUS = "noetl.q.execution.status"  # one execution's status and requester (the credentials service)
Q_EXECUTION_SEED = "noetl.q.execution.seed"  # D32: what a restart from a step starts with (core/restart.py)
Q_EXECUTION_TIMELINE = "noetl.q.execution.timeline"  # the console's Gantt chart of an execution (core/timeline.py)
Q_EXECUTION_STATS = "noetl.q.execution.stats"  # the console's overview: executions per status, slowest, failures
Q_RECORDER_PING = "noetl.q.recorder.ping"
# ... by the credentials service (queue group ``credentials``)
Q_CREDENTIAL_PUT = "noetl.q.credential.put"
Q_CREDENTIAL_LIST = "noetl.q.credential.list"
Q_CREDENTIAL_GET = "noetl.q.credential.get"
Q_CREDENTIAL_DELETE = "noetl.q.credential.delete"
Q_CREDENTIAL_ROLES = "noetl.q.credential.roles"  # who may use a credential from a playbook (D24)
# a worker of the pool resolves the keychain credentials of a command it holds (D24): only the NATS user
# worker-<pool> may publish to noetl.q.credential.resolve.<pool>
CREDENTIAL_RESOLVE_PREFIX = "noetl.q.credential.resolve."
# ... by the sessions service (queue group ``sessions``)
Q_BOOTSTRAP = "noetl.q.sessions.bootstrap"
Q_LOGIN = "noetl.q.sessions.login"
Q_VALIDATE = "noetl.q.sessions.validate"
Q_REFRESH = "noetl.q.sessions.refresh"
Q_REVOKE = "noetl.q.sessions.revoke"
Q_LIST = "noetl.q.sessions.list"
Q_USERS_ADD = "noetl.q.users.add"
Q_USERS_LIST = "noetl.q.users.list"
Q_USERS_GET = "noetl.q.users.get"
Q_USERS_DISABLE = "noetl.q.users.disable"
Q_USERS_ENABLE = "noetl.q.users.enable"
Q_USERS_ROLES = "noetl.q.users.roles"
Q_USERS_PASSWORD = "noetl.q.users.password"
Q_USERS_STANDING = "noetl.q.users.standing"  # services (the scheduler, workers): may this user still act? no token
Q_TOKENS_CREATE = "noetl.q.tokens.create"
Q_TOKENS_LIST = "noetl.q.tokens.list"
Q_TOKENS_REVOKE = "noetl.q.tokens.revoke"
Q_AUDIT_LIST = "noetl.q.audit.list"
# ... by the scheduler (queue group ``scheduler``): noetl.q.schedule.<verb>
Q_SCHEDULE = {verb: SCHEDULE_Q_PREFIX + verb for verb in SCHEDULE_VERBS}

RECORDER_AREAS = ("catalog", "execution", "recorder")  # noetl.q.<area>.<verb>
CREDENTIALS_AREAS = ("credential",)
SESSIONS_AREAS = ("sessions", "users", "tokens", "audit")
SCHEDULER_AREAS = ("schedule",)


def batch_subject_of(writer: str, cls: str, execution_id: str) -> str:
    return f"noetl.evt.{writer}.{cls}.{execution_id}"


def stored_subject(partition: int | str, cls: str, execution_id: str, writer: str) -> str:
    return f"noetl.pevt.{partition}.{cls}.{execution_id}.{writer}"


def control_filter(service: str, partition: int | str, classes: tuple[str, ...]) -> list[str]:
    """What a control-plane service's durable of one partition reads: the stored messages of its classes,
    but its own ``flat`` ones. A flat message is always of the execution its writer decided for (an
    event for another execution, such as a child's request, is ``ctl``), and the writer folded it when it
    made it: it would come back only to fold to nothing (a rebuild reads it from the stream)."""
    return [f"noetl.pevt.{partition}.{c}.*.*" for c in classes if c != "flat"] + \
        [f"noetl.pevt.{partition}.flat.*.{w}" for w in WRITERS if w != service and "flat" in classes]


def credential_resolve_subject(pool: str) -> str:
    return CREDENTIAL_RESOLVE_PREFIX + pool


POOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")  # a worker pool's name: one subject token, part of durable names


def pool_problem(pool: object) -> str | None:
    """What is wrong with ``pool`` as a worker pool's name, or None."""
    if isinstance(pool, str) and POOL_NAME.match(pool):
        return None
    return (f"pool {pool!r}: letters, digits, '-' and '_' only, 1 to 64 of them "
            "(a pool's name is a token of its NATS subjects)")


LANES = 8  # a pool's queue is this many lanes, read in turn (the pool's fairness between users)


def lane_of(command: dict) -> int:
    """The lane of a pool's queue a command waits in: one per user who started the execution (a
    child's: its root's starter), by a hash of the user's id; an execution no user started (``noetl
    run``) by its own id. A pool's workers take commands from the lanes in turn, so one user's backlog
    does not hold up another's commands (users whose ids hash alike share a lane)."""
    who = command.get("requested_by")
    key = who.get("user_id") if isinstance(who, dict) else None
    if not isinstance(key, str) or not key:
        key = str(command.get("execution_id"))
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "big") % LANES


def command_subject(pool: str, execution_id: str, lane: int) -> str:
    """A command's subject: by pool (its workers read it), execution (so the queued commands of a
    finished execution can be purged) and lane (:func:`lane_of`)."""
    return f"noetl.cmd.{pool}.{execution_id}.{lane}"


def command_parts(subject: str) -> tuple[str, str, int | None] | None:
    """``(pool, execution, lane)`` of a command's subject (:func:`command_subject`; lane None: sent by
    an earlier version, by pool and execution), or None when ``subject`` is neither layout."""
    parts = subject.split(".")
    if parts[:2] != ["noetl", "cmd"] or len(parts) not in (4, 5):
        return None
    if len(parts) == 4:
        return parts[2], parts[3], None
    lane = _LANE_TOKENS.get(parts[4])
    return None if lane is None else (parts[2], parts[3], lane)


_LANE_TOKENS = {str(n): n for n in range(LANES)}


def lane_filter(pool: str, lane: int) -> str:
    """What the consumer of a pool's lane reads."""
    return f"noetl.cmd.{pool}.*.{lane}"


def lane_durable(pool: str, lane: int) -> str:
    """The consumer of a pool's lane, ``lane-<pool>-p<lane>`` (no other pool's name makes one of them)."""
    return f"lane-{pool}-p{lane}"


def pool_durable(pool: str) -> str:
    """The consumer of what earlier versions sent to a pool (:func:`pool_filter`), ``pool-<pool>``."""
    return f"pool-{pool}"


def pool_filter(pool: str) -> str:
    """What the consumer ``pool-<pool>`` reads: the commands earlier versions sent (by pool and
    execution), until none is left; the pool's workers read it as one more lane."""
    return f"noetl.cmd.{pool}.*"


def tree_subject(root_execution_id: str) -> str:
    return TREE_PREFIX + root_execution_id


def timer_subject(execution_id: str, timer_id: str) -> str:
    return f"noetl.sched.{execution_id}.{timer_id}"


def timer_target(execution_id: str, cls: str = "ctl") -> str:
    """Where the server writes a timer's ``timer.fired`` (the writer ``timer``, D29): ``ctl``, or
    ``flat`` for a flat execution's (core/events.py)."""
    return f"noetl.evt.timer.{cls}.{execution_id}"


def live_subject(execution_id: str) -> str:
    return f"{LIVE_EXECUTION}.{execution_id}"


def cancel_subject(execution_id: str) -> str:
    return CANCEL_PREFIX + execution_id


def audit_subject(action: str, user: str) -> str:
    """``noetl.audit.<area>.<verb>.<user id or ->`` (``action`` is ``area.verb``)."""
    return f"{AUDIT_PREFIX}{action}.{user}"


def schedule_def_subject(schedule_id: str) -> str:
    return SCHEDULE_DEF_PREFIX + schedule_id


def schedule_fire_subject(schedule_id: str) -> str:
    return SCHEDULE_FIRE_PREFIX + schedule_id


def kv_subject(bucket: str, key: str) -> str:
    return f"$KV.{bucket}.{key}"


# ------------------------------------------------------------------------------ the catalogue
@dataclass(frozen=True)
class Channel:
    """One subject (or family of subjects) and what travels on it.

    ``kind``: ``jetstream`` (published to a stream, acknowledged), ``broadcast`` (core NATS, at most
    once), ``request`` (core NATS request/reply: ``message`` asked, ``reply`` answered), ``kv`` (a KV
    bucket's keys), ``object`` (an object store's chunks and metadata), ``advisory`` (written by the
    server). ``message``/``reply`` name models of :mod:`.messages`."""

    id: str
    address: str
    kind: str
    description: str
    message: str
    senders: tuple[str, ...] = ()
    receivers: tuple[str, ...] = ()
    reply: str | None = None
    stream: str | None = None
    parameters: dict[str, str] = field(default_factory=dict)
    queue: str | None = None  # the queue group of the receivers


_EXECUTION = {"execution_id": "the execution's id"}
# the writer token of noetl.evt.<writer>.<class>.<execution_id> (core/events.py MAY_WRITE)
WRITERS = ("gateway", "admission", "router", "loop-coordinator", "worker", "scheduler", "timer")
CONTROL_PLANE = ("admission", "router", "loop-coordinator")


def _q(subject: str, message: str, reply: str, description: str, receiver: str, senders: tuple[str, ...]) -> Channel:
    cid = subject.removeprefix("noetl.q.").replace(".", "-")
    return Channel(id=f"q-{cid}", address=subject, kind="request", description=description, message=message,
                   reply=reply, senders=senders, receivers=(receiver,), queue=receiver)


_RECORDER_Q = (
    (Q_CATALOG_REGISTER, "CatalogRegisterRequest", "CatalogEntry", "register a playbook: the next version of its path",
     ("gateway",)),
    (Q_CATALOG_GET, "CatalogGetRequest", "CatalogEntry", "a catalog entry by id, or by path (and version, else latest)",
     ("gateway", "admission")),
    (Q_CATALOG_LIST, "CatalogListRequest", "CatalogList", "catalog entries, newest first", ("gateway",)),
    (Q_EXECUTION_GET, "ExecutionGetRequest", "ExecutionSummary", "an execution's state folded from its events (D26)",
     ("gateway",)),
    (Q_EXECUTION_EVENTS, "ExecutionEventsRequest", "EventsPage", "a page of an execution's events", ("gateway",)),
    (Q_EXECUTION_LIST, "ExecutionListRequest", "ExecutionList", "executions, newest first", ("gateway",)),
    (Q_EXECUTION_WAITS, "ExecutionWaitsRequest", "WaitList", "waits in progress (D30)", ("gateway",)),
    (Q_EXECUTION_STATE, "ExecutionStateRequest", "ExecutionView",
     "the console's view of an execution after one event of its log (time travel, core/view.py)", ("gateway",)),
    (Q_EXECUTION_RESULT, "ExecutionResultRequest", "RunResult", "one step run's whole outcome (a download)",
     ("gateway",)),
    (Q_EXECUTION_STATUS, "ExecutionStatusRequest", "ExecutionStatus",
     "one execution's status and who started it, from the projection (no fold)", ("credentials",)),
    (Q_EXECUTION_SEED, "ExecutionSeedRequest", "RestartSeed",
     "what a restart from a step starts with: the state folded up to the step's first start (D32)", ("gateway",)),
    (Q_EXECUTION_TIMELINE, "ExecutionTimelineRequest", "ExecutionTimeline",
     "an execution's step runs, task attempts, waits and loop iterations with their times, bounded (a big loop as "
     "counts per time slice): the console's Gantt chart (core/timeline.py)", ("gateway",)),
    (Q_EXECUTION_STATS, "ExecutionStatsRequest", "ExecutionStats",
     "executions created per status over time, the slowest playbooks and the failures by error kind, in a "
     "time range (the console's overview)", ("gateway",)),
    (Q_RECORDER_PING, "Empty", "RecorderPing", "the recorder's state (the gateway's /ready)", ("gateway",)),
)
_CREDENTIALS_Q = (
    (Q_CREDENTIAL_PUT, "CredentialPutRequest", "CredentialInfo", "create or replace a credential (D24)", ("gateway",)),
    (Q_CREDENTIAL_LIST, "Empty", "CredentialList", "credentials without their data", ("gateway",)),
    (Q_CREDENTIAL_GET, "CredentialGetRequest", "CredentialInfo", "one credential (its data only when asked)",
     ("gateway",)),
    (Q_CREDENTIAL_DELETE, "CredentialNameRequest", "Deleted", "delete a credential", ("gateway",)),
    (Q_CREDENTIAL_ROLES, "CredentialRolesRequest", "CredentialInfo",
     "set who may use a credential from a playbook: the roles its users must hold, or the users it names (D24)", ("gateway",)),
)
_SESSIONS_Q = (
    (Q_BOOTSTRAP, "BootstrapRequest", "BootstrapReply", "create the first admin while no user exists", ("admin",)),
    (Q_LOGIN, "LoginRequest", "LoginReply", "log in with a password or an OIDC ID token", ("gateway",)),
    (Q_VALIDATE, "TokenRequest", "Principal", "the principal of a session or API token", ("gateway",)),
    (Q_REFRESH, "TokenRequest", "Principal", "a session's idle expiry moved now", ("gateway",)),
    (Q_REVOKE, "SessionsRequest", "Revoked", "log out, or revoke sessions", ("gateway",)),
    (Q_LIST, "SessionsRequest", "SessionList", "login sessions", ("gateway",)),
    (Q_USERS_ADD, "SessionsRequest", "UserReply", "add a user", ("gateway",)),
    (Q_USERS_LIST, "SessionsRequest", "UserList", "users by username", ("gateway",)),
    (Q_USERS_GET, "SessionsRequest", "UserReply", "one user", ("gateway",)),
    (Q_USERS_DISABLE, "SessionsRequest", "UserReply", "disable a user (its sessions and tokens revoked)", ("gateway",)),
    (Q_USERS_ENABLE, "SessionsRequest", "UserReply", "enable a user", ("gateway",)),
    (Q_USERS_ROLES, "SessionsRequest", "UserReply", "set a user's roles", ("gateway",)),
    (Q_USERS_PASSWORD, "SessionsRequest", "UserReply", "change a password", ("gateway",)),
    (Q_USERS_STANDING, "UserStandingRequest", "UserStanding",
     "whether a user exists, is active and which roles it has (a schedule's creator, at each firing; "
     "who started a command's execution, on a pool that names its roles; the users a command acts for, "
     "when it resolves a stored credential)",
     ("scheduler", "worker", "credentials")),
    (Q_TOKENS_CREATE, "SessionsRequest", "TokenCreated", "a new API token", ("gateway",)),
    (Q_TOKENS_LIST, "SessionsRequest", "TokenList", "live API tokens", ("gateway",)),
    (Q_TOKENS_REVOKE, "SessionsRequest", "Revoked", "revoke an API token", ("gateway",)),
    (Q_AUDIT_LIST, "SessionsRequest", "AuditList", "audit records, newest first", ("gateway",)),
)
_SCHEDULER_Q = (
    ("add", "ScheduleAddRequest", "ScheduleRecord", "add a schedule of a catalog playbook (D31)"),
    ("list", "ScheduleListRequest", "ScheduleList", "schedules"),
    ("get", "ScheduleGetRequest", "ScheduleRecord", "one schedule (and its next fire times)"),
    ("pause", "ScheduleIdRequest", "ScheduleRecord", "pause a schedule"),
    ("resume", "ScheduleIdRequest", "ScheduleRecord", "resume a schedule"),
    ("delete", "ScheduleIdRequest", "Deleted", "delete a schedule"),
)

CHANNELS: tuple[Channel, ...] = (
    Channel("events", "noetl.evt.{writer}.{class}.{execution_id}", "jetstream",
            "An events message: the events of one decision (or one worker flush) of one execution, one writer "
            "(who may write what: core/events.py MAY_WRITE). Headers: Nats-Msg-Id (the events' ids, D21), "
            "traceparent. Stored as noetl.pevt.<partition>.<class>.<execution_id>.<writer>.",
            "EventsMessage", senders=("gateway", *CONTROL_PLANE, "worker", "scheduler", "nats-server (timer)"),
            stream=EVENTS,
            parameters={"writer": "who wrote the events: " + ", ".join(WRITERS),
                        "class": "the most demanding class of its events: ctl, loop, dispatch, info; flat for the ctl "
                                 "messages of an execution without loop steps (core/events.py)", **_EXECUTION}),
    Channel("events-stored", "noetl.pevt.{partition}.{class}.{execution_id}.{writer}", "jetstream",
            "The events stream's stored form of noetl.evt (its subject transform: partition = hash of the "
            "execution id mod the partition count). Read through durables: <service>-all-p<P> (control plane, "
            "admission and router: ctl/flat; loop-coordinator: ctl/loop), event-recorder (everything); never "
            "published to.",
            "EventsMessage", receivers=(*CONTROL_PLANE, "event-recorder"), stream=EVENTS,
            parameters={"partition": "the execution's partition", "class": "ctl, flat, loop, dispatch, info",
                        **_EXECUTION, "writer": "who wrote the events"}),
    Channel("events-legacy", "noetl.evt.{class}.{execution_id}", "jetstream",
            "Events of the layout of earlier versions (no writer token). No longer published: setup moves an "
            "events stream of this layout to the current one; messages stored under it are still recorded.",
            "EventsMessage", receivers=("event-recorder",), stream=EVENTS,
            parameters={"class": "ctl, loop, dispatch, info", **_EXECUTION}),
    Channel("timers", "noetl.sched.{execution_id}.{timer_id}", "jetstream",
            "A timer (D29): a message schedule of the events stream (headers Nats-Schedule: @at <instant>, "
            "Nats-Schedule-Target: noetl.evt.timer.<ctl or flat>.<execution_id>) whose body, the timer.fired event, the "
            "server writes into the execution's log at that time; an empty message with Nats-Rollup: sub "
            "cancels it.", "EventsMessage", senders=CONTROL_PLANE, stream=EVENTS,
            parameters={**_EXECUTION, "timer_id": "the timer's id"}),
    Channel("commands", "noetl.cmd.{pool}.{execution_id}.{lane}", "jetstream",
            "One command for a worker pool: a step run, a loop iteration, a chunk of iterations, or a resume. "
            "Work-queue retention: deleted when a worker acks it. One durable per lane, lane-<pool>-p<lane>, "
            "shared by the pool's workers, which take from the lanes in turn. Header Nats-Msg-Id: the command id.",
            "Command", senders=("admission", "loop-coordinator"), receivers=("worker",), stream=COMMANDS,
            parameters={"pool": "the worker pool", **_EXECUTION,
                        "lane": "0 to 7: a hash of the id of the user who started the execution (its root)"}),
    Channel("commands-unlaned", "noetl.cmd.{pool}.{execution_id}", "jetstream",
            "Commands by pool and execution, as earlier versions sent them; still read by the pool's workers "
            "(durable pool-<pool>).",
            "Command", receivers=("worker",), stream=COMMANDS, parameters={"pool": "the worker pool", **_EXECUTION}),
    Channel("commands-legacy", "noetl.cmd.{pool}", "jetstream",
            "Commands by pool only, as the first versions sent them; no longer read (nothing has sent here since "
            "commands went per execution).", "Command", stream=COMMANDS, parameters={"pool": "the worker pool"}),
    Channel("lost-commands", f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{COMMANDS}.{{consumer}}", "advisory",
            "The server's advisory of a command that ran out of deliveries; kept in NOETL_LOST_COMMANDS until "
            "admission (durable admission) fails its runs with worker_lost.",
            "MaxDeliveriesAdvisory", senders=("nats-server",), receivers=("admission",), stream=LOST_COMMANDS,
            parameters={"consumer": "the commands consumer (lane-<pool>-p<lane>, or pool-<pool>)"}),
    Channel("tree-count", TREE_PREFIX + "{root_execution_id}", "jetstream",
            "The count of the child executions a root execution's tree has requested, at every depth: admission "
            "adds 1 (header Nats-Incr: +1, Nats-Msg-Id: the child's id, so a request evaluated again is not "
            "counted twice) as it evaluates a child's request, reads the total in the PubAck, and fails the child "
            "past max_tree_executions. A counter stream keeping the last value per root.",
            "TreeCount", senders=("admission",), stream=TREES,
            parameters={"root_execution_id": "the id of the tree's root execution"}),
    Channel("cancel", "noetl.cancel.{execution_id}", "broadcast",
            "Workers abort an execution's running commands (it finished), or some step runs (timed out, D29).",
            "CancelNotice", senders=("router",), receivers=("worker",), parameters=_EXECUTION),
    *(_q(s, m, r, d, "event-recorder", who) for s, m, r, d, who in _RECORDER_Q),
    *(_q(s, m, r, d, "credentials", who) for s, m, r, d, who in _CREDENTIALS_Q),
    Channel("q-credential-resolve", CREDENTIAL_RESOLVE_PREFIX + "{pool}", "request",
            "A worker of the pool resolves the keychain credentials (D24) of a command it holds, named by its "
            "stream sequence and subject in NOETL_COMMANDS; only worker-<pool> may publish here, the answer goes "
            "to its inbox only. Refused unless the command exists, is of that execution and pool, declares the "
            "names, and the execution runs; every answer is audited (credential.resolved, credential.refused).",
            "CredentialResolveRequest", reply="CredentialValues", senders=("worker",), receivers=("credentials",),
            queue="credentials", parameters={"pool": "the worker pool"}),
    *(_q(s, m, r, d, "sessions", who) for s, m, r, d, who in _SESSIONS_Q),
    *(_q(SCHEDULE_Q_PREFIX + verb, m, r, d, "scheduler", ("gateway",)) for verb, m, r, d in _SCHEDULER_Q),
    Channel("sessions-revoked", SESSIONS_REVOKED, "broadcast",
            "Gateways drop cached token validations: a session, a token, or every one of a user.",
            "RevokedNotice", senders=("sessions",), receivers=("gateway",)),
    Channel("live-execution", LIVE_EXECUTION + ".{execution_id}", "broadcast",
            "What the event-recorder has just committed of an execution (after each batch's transaction): counts "
            "by event name and the newest events, without data. Gateways subscribe while a console page shows the "
            "execution (services/gateway/live.py).", "LiveNotice", senders=("event-recorder",),
            receivers=("gateway",), parameters=_EXECUTION),
    Channel("live-list", LIVE_LIST, "broadcast",
            "Executions a committed batch requested, started or finished (the console's executions list).",
            "LiveListNotice", senders=("event-recorder",), receivers=("gateway",)),
    Channel("live-watch", LIVE_WATCH, "broadcast",
            "Which execution ids (and \"*\": the executions list) a gateway's open console streams show, for "
            "ttl seconds: said when a stream opens and every 5 s. Recorders send notices of those only.",
            "LiveWatch", senders=("gateway",), receivers=("event-recorder",)),
    Channel("live-ask", LIVE_ASK, "broadcast",
            "A recorder that has just started asks the gateways to say at once what they watch (noetl.watch.live).",
            "LiveAsk", senders=("event-recorder",), receivers=("gateway",)),
    Channel("audit", "noetl.audit.{area}.{verb}.{user_id}", "jetstream",
            "An audit record (stream NOETL_AUDIT, max age audit_retention). The sessions service writes the "
            "session, user and token areas; the gateway its own (credential, execution, access); the credentials "
            "service credential.resolved and credential.refused (workers' resolutions).",
            "AuditRecord", senders=("sessions", "gateway", "credentials"), receivers=("sessions",), stream=AUDIT,
            parameters={"area": "what was acted on", "verb": "what was done",
                        "user_id": "the actor's user id, or -"}),
    Channel("schedule-def", "noetl.schedule.def.{schedule_id}", "jetstream",
            "A schedule's message (header Nats-Schedule: a cron, @every or @at); the server fires it into "
            "noetl.schedule.fire.<schedule_id> (D31).", "ScheduleFiring", senders=("scheduler",),
            stream=SCHEDULES, parameters={"schedule_id": "the schedule's id"}),
    Channel("schedule-fire", "noetl.schedule.fire.{schedule_id}", "jetstream",
            "A schedule fired (written by the server); the scheduler (durable scheduler) turns it into an "
            "execution request.", "ScheduleFiring", senders=("nats-server",), receivers=("scheduler",),
            stream=SCHEDULES, parameters={"schedule_id": "the schedule's id"}),
    *(Channel(f"micro-{verb.lower()}{suffix}", f"$SRV.{verb}{address}", "request",
              f"NATS micro service discovery (the nats CLI's `nats micro`): every service process that registers "
              f"as a micro service (noetl-<service>) answers {verb}{what}.", "Empty",
              senders=("operators' tools", "gateway"), receivers=("every service",), reply=f"Micro{verb.title()}",
              parameters=params)
      for verb in ("PING", "INFO", "STATS")
      for suffix, address, what, params in (
          ("", "", " for all", {}),
          ("-name", ".{name}", " for its name", {"name": "noetl-<service>"}),
          ("-id", ".{name}.{id}", " for one replica", {"name": "noetl-<service>", "id": "the replica's id"}))),
    Channel("kv-members", f"$KV.{MEMBERS_BUCKET}.{{service}}.{{replica}}", "kv",
            "Membership of the control-plane replicas: each puts its key every third of the bucket's TTL "
            "(NOETL_MEMBERSHIP_TTL) and deletes it when it stops; the live keys deal the partitions out.",
            "Member", senders=CONTROL_PLANE, receivers=CONTROL_PLANE,
            parameters={"service": "admission, router or loop-coordinator", "replica": "the replica's id"}),
    Channel("kv-sessions", f"$KV.{SESSIONS_BUCKET}.{{key}}", "kv",
            "Login sessions and each user's index of them (per-key TTL).", "KvRecord",
            senders=("sessions",), receivers=("sessions",), parameters={"key": "services/sessions/store.py"}),
    Channel("kv-users", f"$KV.{USERS_BUCKET}.{{key}}", "kv",
            "Users, unique names, OIDC links, API tokens.", "KvRecord", senders=("sessions",),
            receivers=("sessions",), parameters={"key": "services/sessions/store.py"}),
    Channel("kv-logins", f"$KV.{LOGINS_BUCKET}.{{key}}", "kv",
            "Failed-login counters (per-key TTL).", "KvRecord", senders=("sessions",), receivers=("sessions",),
            parameters={"key": "services/sessions/store.py"}),
    Channel("kv-schedules", f"$KV.{SCHEDULES_BUCKET}.{{schedule_id}}", "kv",
            "Schedule definitions (D31).", "ScheduleRecord", senders=("scheduler",), receivers=("scheduler",),
            parameters={"schedule_id": "the schedule's id"}),
    Channel("payloads", f"$O.{PAYLOADS_BUCKET}.{{part}}.{{id}}", "object",
            "The payload store (D23): values too big to travel inline, keyed by the SHA-256 of their JSON, "
            "referred to by PayloadRef; chunks (C) and metadata (M) of each object.", "PayloadObject",
            senders=("gateway", *CONTROL_PLANE, "worker", "event-recorder"),
            receivers=("gateway", *CONTROL_PLANE, "worker"),
            parameters={"part": "C (chunks) or M (metadata)", "id": "the chunk's nuid or the object's encoded name"}),
)


@dataclass(frozen=True)
class Stream:
    name: str
    subjects: tuple[str, ...]
    retention: str
    description: str
    bucket: str | None = None  # KV bucket or object store it backs


STREAMS: tuple[Stream, ...] = (
    Stream(EVENTS, (EVENT_SUBJECTS, TIMER_SUBJECTS), "limits",
           "every event; timers as message schedules; subject transform to noetl.pevt.<partition>...; 7 days"),
    Stream(COMMANDS, COMMAND_SUBJECTS, "workqueue", "commands for worker pools"),
    Stream(LOST_COMMANDS, (MAX_DELIVERIES,), "workqueue", "advisories of commands that ran out of deliveries"),
    Stream(AUDIT, AUDIT_SUBJECTS, "limits", "the audit log"),
    Stream(SCHEDULES, SCHEDULE_SUBJECTS, "workqueue", "schedule messages and their firings (D31)"),
    Stream(TREES, (TREE_PREFIX + "*",), "limits",
           "counters: the child executions of each root's tree (max_tree_executions); the last value per root, "
           "7 days after its last child, at most 1,000,000 roots (the oldest go first)"),
    Stream(f"KV_{MEMBERS_BUCKET}", (f"$KV.{MEMBERS_BUCKET}.>",), "limits", "KV: replica membership",
           MEMBERS_BUCKET),
    *(Stream(f"KV_{b}", (f"$KV.{b}.>",), "limits", f"KV: the sessions service's {b.split('_')[1]}", b)
      for b in SESSION_BUCKETS),
    Stream(f"KV_{SCHEDULES_BUCKET}", (f"$KV.{SCHEDULES_BUCKET}.>",), "limits", "KV: schedule definitions",
           SCHEDULES_BUCKET),
    Stream(f"OBJ_{PAYLOADS_BUCKET}", (f"$O.{PAYLOADS_BUCKET}.C.>", f"$O.{PAYLOADS_BUCKET}.M.>"), "limits",
           "object store: payload references (D23)", PAYLOADS_BUCKET),
)


def pattern(address: str) -> str:
    """A channel's address as a NATS subject filter (each parameter one token: ``*``)."""
    import re

    return re.sub(r"\{[^}]+\}", "*", address)


def overlaps(a: str, b: str) -> bool:
    """Whether two subject filters (``*``, ``>``) can match a common subject."""
    ta, tb = a.split("."), b.split(".")
    for i, (x, y) in enumerate(zip(ta, tb)):
        if x == ">" or y == ">":
            return True
        if x != y and "*" not in (x, y):
            return False
    return len(ta) == len(tb)


def listed(subject: str) -> bool:
    """Whether ``subject`` (a subject or filter) can match a channel of :data:`CHANNELS` or a stream's."""
    return any(overlaps(subject, pattern(c.address)) for c in CHANNELS) or \
        any(overlaps(subject, s) for stream in STREAMS for s in stream.subjects)
