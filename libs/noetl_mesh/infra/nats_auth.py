"""NATS users and permissions: one user per service, each allowed exactly what the service does.

Users authenticate with nkeys (Ed25519): the server configuration holds only public keys and
permissions; each service holds its own seed in a file (0600). Users:

| user | may |
|---|---|
| ``admin`` | everything: creates the streams, buckets and object store (``noetl setup``, the stack runners), operators' tools, ``noetl.q.sessions.bootstrap`` |
| ``gateway`` | publish its events (``noetl.evt.gateway.>``), read an execution's request from the events stream before it is recorded, ask the recorder and the sessions service, record audit entries of its own areas, hear the recorder's notices (``noetl.live.>``, the console's live streams) |
| ``admission``, ``router``, ``loop-coordinator`` | read the events stream through their own durables and rebuild consumers, publish their events (``noetl.evt.<service>.>``) and timers (``noetl.sched.*.*``, D29); admission and the loop-coordinator publish commands, the router purges a finished execution's commands and broadcasts cancels, admission reads lost commands |
| ``event-recorder`` | read every event through its partitions' durables (``event-recorder-p<N>``, shared among its replicas in the members bucket) and, for a gap, by sequence, answer ``noetl.q.{catalog,execution,recorder}.*``, publish notices of what it committed (``noetl.live.>``) |
| ``credentials`` | answer ``noetl.q.credential.*`` and the workers' ``noetl.q.credential.resolve.<pool>``, read a command of ``NOETL_COMMANDS`` by its sequence, ask the recorder an execution's status, record ``credential.resolved``/``credential.refused`` audit records; it answers to inboxes only (no ``allow_responses``) |
| ``worker-<pool>`` | read its pool's commands only (its lanes, ``lane-<pool>-p<N>``, and earlier versions' ``pool-<pool>``), publish worker events (``noetl.evt.worker.>``), resolve the credentials of the commands it holds (``noetl.q.credential.resolve.<pool>``: its pool's subject only), hear cancels |
| ``sessions`` | its KV buckets and the audit stream (no one else may touch them), answer ``noetl.q.{sessions,users,tokens,audit}.*`` |
| ``scheduler`` | the schedules stream and bucket (no one else may touch them), read the firings through its durable, publish its events (``noetl.evt.scheduler.>``: execution requests), answer ``noetl.q.schedule.*`` |

Every user but ``admin`` is also a NATS micro service (infra/micro.py) named ``noetl-<user>``: it may
subscribe to the ``$SRV`` PING/INFO/STATS subjects of that name only and answer them
(``allow_responses``); only ``admin`` (operators' tools, ``noetl ps``) and the gateway (its readiness
pings the control plane: ``$SRV.PING.noetl-<service>``) may publish to ``$SRV``.

Every user but ``admin`` gets its own inbox prefix ``_INBOX.<its public key>`` (nats-py
``inbox_prefix``): replies and JetStream deliveries reach only the connection that asked. The
permissions are computed here (:func:`permissions`, pure) and written into the server configuration
(:func:`server_config`); :class:`NatsAuth` keeps a directory of seeds and that configuration, reused on
restart. docs/nats-security.md explains each rule and how it was found.
"""
from __future__ import annotations

import json
import os
import secrets
import struct
from pathlib import Path
from typing import Any, Iterable

import nkeys

ADMIN = "admin"
CONTROL_PLANE = ("admission", "router", "loop-coordinator")
SERVICES = ("gateway", *CONTROL_PLANE, "event-recorder", "credentials", "sessions", "scheduler")  # and worker-<pool>
WRITERS = ("gateway", *CONTROL_PLANE, "worker", "scheduler")  # the writer token of noetl.evt.<writer>.<class>.<execution>
WORKER_PREFIX = "worker-"
CONFIG_FILE = "nats-auth.conf"  # the server's part: public keys and permissions
META_FILE = "nats-auth.json"  # what the configuration was made for (partitions, pools)
SEED_SUFFIX = ".nk"
DEFAULT_PARTITIONS = 16

# stream and bucket names: contracts/subjects.py
from ..contracts.subjects import (AUDIT, COMMANDS, EVENTS, MEMBERS_BUCKET, PAYLOADS_BUCKET,  # noqa: E402
                                  CREDENTIAL_RESOLVE_PREFIX, CREDENTIALS_AREAS, RECORDER_AREAS, SCHEDULER_AREAS, SCHEDULES, SCHEDULES_BUCKET, SESSION_BUCKETS,
                                  SESSIONS_AREAS, COMMAND_SUBJECTS, LANES, MAX_DELIVERIES, SCHEDULE_FIRE_PREFIX, TREE_PREFIX, TREES,
                                  lane_durable, lane_filter, pool_durable, pool_filter, pool_problem, INBOX)
from ..contracts.subjects import LOST_COMMANDS as LOST  # noqa: E402

MEMBERS, PAYLOADS = f"KV_{MEMBERS_BUCKET}", f"OBJ_{PAYLOADS_BUCKET}"
SESSION_STREAMS = (*(f"KV_{b}" for b in SESSION_BUCKETS), AUDIT)
SCHEDULE_STREAMS = (SCHEDULES, f"KV_{SCHEDULES_BUCKET}")
ALL_STREAMS = (EVENTS, COMMANDS, LOST, TREES, MEMBERS, PAYLOADS, *SESSION_STREAMS, *SCHEDULE_STREAMS)
SESSIONS_AUDIT_AREAS = ("session", "user", "token")  # audit records only the sessions service writes
CREDENTIALS_AUDIT = ("credential.resolved", "credential.refused")  # audit records only the credentials service writes
from ..contracts.subjects import LIVE_PREFIX, LIVE_WATCH  # noqa: E402 - the console's live streams
LIVE = LIVE_PREFIX.rstrip(".")
SRV_VERBS = ("PING", "INFO", "STATS")  # the NATS micro services' control subjects: $SRV.<verb>[.<name>[.<id>]]
COMMAND_PUBLISH = [COMMAND_SUBJECTS[0]]  # noetl.cmd.<pool>.<execution>.<lane> only: admission's, the loop-coordinator's
READY_SERVICES = ("admission", "router", "loop-coordinator", "event-recorder", "credentials", "sessions")  # the gateway pings them

# ------------------------------------------------------------------------------------- names
def check_pool(pool: str) -> str:
    """A pool name is one subject token (``noetl.cmd.<pool>.<execution>``) and part of a durable name."""
    problem = pool_problem(pool)
    if problem is not None:
        raise ValueError(problem)
    return pool


def user_for(service: str, pool: str = "default") -> str:
    """The NATS user of a service (a worker's is its pool's)."""
    if service == "worker":
        return WORKER_PREFIX + check_pool(pool)
    if service not in SERVICES and service != ADMIN:
        raise ValueError(f"no NATS user for service {service!r}; known: {', '.join((ADMIN, *SERVICES, 'worker'))}")
    return service


def micro_name(user: str) -> str:
    """The NATS micro service name of a NATS user's processes (``noetl-router``, ``noetl-worker-gpu``)."""
    return f"noetl-{user}"


def srv_subjects(name: str) -> list[str]:
    """The ``$SRV`` subjects a micro service called ``name`` listens on: every verb to all services, to
    the name, and to one instance of it (``$SRV.PING``, ``$SRV.PING.<name>``, ``$SRV.PING.<name>.<id>``)."""
    return [s for verb in SRV_VERBS for s in (f"$SRV.{verb}", f"$SRV.{verb}.{name}", f"$SRV.{verb}.{name}.*")]


def durable_prefix(service: str) -> str:
    """What the names of the partitions' durables of a control-plane service (or the recorder) start with:
    ``<prefix>-p<N>``. The control plane's acknowledge cumulatively (``<service>-all``); those of earlier
    versions (``<service>-p<N>``, one ack per message) hand over to them (infra/control.py)."""
    return f"{service}-all" if service in CONTROL_PLANE else service


def durables(service: str, partitions: int) -> list[str]:
    """The durable consumers of the events stream a control-plane service (or the recorder) reads through."""
    return [f"{durable_prefix(service)}-p{p}" for p in range(partitions)]


def earlier_durables(service: str, partitions: int) -> list[str]:
    """A control-plane service's durables of earlier versions: read where they stopped, then deleted."""
    return [f"{service}-p{p}" for p in range(partitions)] if service in CONTROL_PLANE else []


# ------------------------------------------------------------------------------------- keys
def new_seed() -> str:
    return nkeys.encode_seed(secrets.token_bytes(32), nkeys.PREFIX_BYTE_USER).decode()


def public_key(seed: str) -> str:
    kp = nkeys.from_seed(bytearray(seed.strip().encode()))
    try:
        return kp.public_key.decode()
    finally:
        kp.wipe()


def inbox_prefix(public: str) -> str:
    return f"{INBOX}{public}"


def read_seed(path: str | os.PathLike) -> str:
    try:
        seed = Path(path).read_text().strip()
        public_key(seed)
    except OSError as exc:
        raise ValueError(f"NATS credentials {path}: cannot read ({exc.strerror})") from None
    except Exception:  # noqa: BLE001 - nkeys raises several kinds for a bad seed
        raise ValueError(f"NATS credentials {path}: not an nkey user seed (a line starting 'SU')") from None
    return seed


def connect_options(creds: str | os.PathLike | None, url: str | None = None) -> dict[str, Any]:
    """nats-py connect options for a credentials file (an nkey seed): the seed and this user's own
    inbox prefix (its permissions allow replies under it only); and TLS when the environment or a
    ``tls://`` ``url`` asks for it (infra/tls.py: ``NOETL_NATS_TLS_CA``, ``_CERT``, ``_KEY``). ``{}``
    without either."""
    from .tls import nats_options

    options = nats_options(url)
    if not creds:
        return options
    seed = read_seed(creds)
    return {**options, "nkeys_seed_str": seed, "inbox_prefix": inbox_prefix(public_key(seed))}


# ------------------------------------------------------------------------------------- permissions
def _js(*parts: str) -> str:
    return ".".join(("$JS.API", *parts))


def _stream_api(stream: str) -> list[str]:
    """Every JetStream API subject that names ``stream`` (for deny lists)."""
    return [_js("STREAM", "*", stream), _js("STREAM", "MSG", "*", stream), _js("DIRECT", "GET", stream),
            _js("DIRECT", "GET", stream, ">"), _js("CONSUMER", "*", stream), _js("CONSUMER", "*", stream, ">"),
            _js("CONSUMER", "*", "*", stream, ">"), f"$JS.ACK.{stream}.>", f"$JS.FC.{stream}.>"]


def _durable(stream: str, name: str, filter_subject: str | None = None, *, info: bool = False,
             pinned: bool = False) -> list[str]:
    """Create (or update) a durable pull consumer, fetch from it, acknowledge its messages; ``pinned``:
    also count its unacknowledged messages and give up its pin (infra/pinned.py). Not pinned: created
    with ``filter_subject`` only, named in the API subject (Bus.consumer; the server refuses a body that
    filters otherwise)."""
    create = _js("CONSUMER", "DURABLE", "CREATE", stream, name) if pinned else \
        _js("CONSUMER", "CREATE", stream, name, filter_subject or "")
    out = [create, _js("CONSUMER", "MSG", "NEXT", stream, name), f"$JS.ACK.{stream}.{name}.>"]
    return out + ([_js("CONSUMER", "INFO", stream, name)] if info or pinned else []) + (
        [_js("CONSUMER", "UNPIN", stream, name)] if pinned else [])


def _payloads(write: bool) -> list[str]:
    """The object store of large values (D23): read (message by message, payloads.py: no consumer, whose
    configuration a user could point anywhere), and write (replacing an object purges its old chunks)."""
    out = [_js("STREAM", "INFO", PAYLOADS), _js("STREAM", "MSG", "GET", PAYLOADS)]
    return out + ([f"$O.{PAYLOADS_BUCKET}.>", _js("STREAM", "PURGE", PAYLOADS)] if write else [])


def _membership(service: str) -> list[str]:
    """Its replicas' heartbeats in the members bucket (infra/membership.py)."""
    return [_js("STREAM", "INFO", MEMBERS), _js("STREAM", "PURGE", MEMBERS), _js("STREAM", "MSG", "GET", MEMBERS),
            f"$KV.{MEMBERS_BUCKET}.{service}.>"]


def permissions(user: str, *, partitions: int, inbox: str) -> dict[str, Any] | None:
    """The server permissions of ``user`` (None: ``admin``, unrestricted). ``inbox``: the user's
    inbox prefix. Allow lists name exactly what the service does; deny lists repeat the dangerous
    refusals explicitly (deny wins over any allow)."""
    if user == ADMIN:
        return None
    pub: list[str] = []
    sub: list[str] = [f"{inbox}.>", *srv_subjects(micro_name(user))]  # answers its own $SRV requests
    writer = "worker" if user.startswith(WORKER_PREFIX) else user
    purges: set[str] = set()  # streams it may purge
    if writer in WRITERS:
        pub.append(f"noetl.evt.{writer}.>")
    if user == "gateway":
        pub += [_js("STREAM", "INFO", EVENTS), *_payloads(write=True)]
        pub.append(_js("STREAM", "MSG", "GET", EVENTS))  # a request not recorded yet (Bus.pending_request)
        pub += [f"noetl.q.{area}.*" for area in RECORDER_AREAS]
        pub += [f"noetl.q.credential.{verb}" for verb in ("put", "list", "get", "delete", "roles")]  # not resolve
        pub += [f"noetl.q.{area}.*" for area in SESSIONS_AREAS]  # bootstrap denied below
        pub += [f"noetl.q.{area}.*" for area in SCHEDULER_AREAS]
        pub.append("noetl.audit.>")  # its own areas: the sessions service's are denied below
        sub.append("noetl.sessions.revoked")
        sub.append(f"{LIVE}.>")  # what the recorder has committed: the console's live streams
        pub.append(LIVE_WATCH)  # which of those its streams show (the recorders send only those)
        pub += [f"$SRV.PING.{micro_name(s)}" for s in READY_SERVICES]  # its readiness (/ready)
        purges.add(PAYLOADS)
    elif user in CONTROL_PLANE:
        own = durables(user, partitions)
        pub += [_js("STREAM", "INFO", EVENTS), _js("STREAM", "MSG", "GET", EVENTS)]
        for name in own:
            pub += _durable(EVENTS, name, pinned=True)
        for name in earlier_durables(user, partitions):  # where they stopped, then deleted (control.py)
            pub += [_js("CONSUMER", "INFO", EVENTS, name), _js("CONSUMER", "DELETE", EVENTS, name)]
        # rebuilds: a short-lived consumer (nats-py names it at random; its filter travels in the subject
        # when there is one), fetched and deleted; never another's durable (denied below)
        pub += [_js("CONSUMER", "CREATE", EVENTS, "*"), _js("CONSUMER", "CREATE", EVENTS, "*", ">"),
                _js("CONSUMER", "MSG", "NEXT", EVENTS, "*"), _js("CONSUMER", "DELETE", EVENTS, "*")]
        pub += _payloads(write=True) + _membership(user)
        pub.append("noetl.sched.*.*")  # D29: timers (schedules of the events stream); see admitted() in bus.py
        pub.append("noetl.q.execution.status")  # whether an execution it cannot rebuild has finished (control.py)
        purges |= {PAYLOADS, MEMBERS}
        if user == "admission":
            pub += [*COMMAND_PUBLISH, "noetl.q.catalog.get", _js("STREAM", "INFO", COMMANDS),
                    _js("STREAM", "MSG", "GET", COMMANDS), _js("STREAM", "MSG", "DELETE", COMMANDS),
                    _js("STREAM", "INFO", LOST), *_durable(LOST, "admission", MAX_DELIVERIES),
                    TREE_PREFIX + "*", _js("STREAM", "INFO", TREES),  # a child counted in its tree (D19;
                    _js("STREAM", "MSG", "GET", TREES)]  # the PubAck says the total; a duplicate's: read)
        elif user == "router":
            pub += ["noetl.cancel.*", _js("STREAM", "PURGE", COMMANDS)]
            purges.add(COMMANDS)
        else:
            pub += COMMAND_PUBLISH
    elif user == "event-recorder":
        pub += [_js("STREAM", "INFO", EVENTS), _js("STREAM", "MSG", "GET", EVENTS)]  # a gap's messages (feeds.py)
        for name in durables(user, partitions):  # its partitions, shared out among its replicas
            pub += _durable(EVENTS, name, pinned=True)
        # the single durable of an earlier version: where it stopped, then deleted (event_recorder/service.py)
        pub += [_js("CONSUMER", "INFO", EVENTS, "event-recorder"), _js("CONSUMER", "DELETE", EVENTS, "event-recorder")]
        pub += _payloads(write=True) + _membership(user)  # replies over max_reply_bytes carry big values by reference
        purges |= {PAYLOADS, MEMBERS}
        sub += [f"noetl.q.{area}.*" for area in RECORDER_AREAS]
        pub.append(f"{LIVE}.>")  # notices of committed batches, for the console
        sub.append(LIVE_WATCH)  # of what the gateways' console streams show
    elif user == "credentials":
        pub += [_js("STREAM", "INFO", EVENTS), *_payloads(write=False)]  # attach; a command's keychain by reference
        pub.append(_js("STREAM", "MSG", "GET", COMMANDS))  # the command a worker says it holds, by its sequence
        pub.append("noetl.q.execution.status")  # whether its execution still runs (the recorder)
        pub.append("noetl.q.users.standing")  # the roles of the users a command acts for (D24)
        pub += [f"noetl.audit.{action}.*" for action in CREDENTIALS_AUDIT]
        pub.append("_INBOX.>")  # its answers: to inboxes only (no allow_responses, below)
        sub += [f"noetl.q.{area}.*" for area in CREDENTIALS_AREAS] + [CREDENTIAL_RESOLVE_PREFIX + "*"]
    elif user == "sessions":
        pub.append(_js("STREAM", "INFO", EVENTS))  # the stack's replica count, for its own buckets
        for stream in SESSION_STREAMS:
            pub += [_js("STREAM", verb, stream) for verb in ("INFO", "CREATE", "UPDATE")]
            pub.append(_js("STREAM", "MSG", "GET", stream))  # no DIRECT.GET: its answer is a message's own bytes,
            # which the server would publish at any reply subject named (a stream's, a bucket's key)
        pub += [f"$KV.{b}.>" for b in SESSION_BUCKETS] + ["noetl.audit.>", "noetl.sessions.revoked"]
        sub += [f"noetl.q.{area}.*" for area in SESSIONS_AREAS]
    elif user == "scheduler":
        pub += [_js("STREAM", "INFO", EVENTS), *_payloads(write=True)]  # attach; a request's big workload
        pub += ["noetl.schedule.def.*", *_durable(SCHEDULES, "scheduler", SCHEDULE_FIRE_PREFIX + "*")]  # schedule messages; firings
        for stream in SCHEDULE_STREAMS:
            pub += [_js("STREAM", verb, stream) for verb in ("INFO", "PURGE", "MSG.GET")]  # no DIRECT.GET (sessions')
        pub.append(f"$KV.{SCHEDULES_BUCKET}.*")
        pub.append("noetl.q.users.standing")  # a schedule's creator, at each firing
        purges |= {PAYLOADS, *SCHEDULE_STREAMS}
        sub += [f"noetl.q.{area}.*" for area in SCHEDULER_AREAS]
    elif user.startswith(WORKER_PREFIX):
        pool = check_pool(user[len(WORKER_PREFIX):])
        consumers = [(lane_durable(pool, n), lane_filter(pool, n)) for n in range(LANES)] \
            + [(pool_durable(pool), pool_filter(pool))]  # and earlier versions' pool-<pool>
        pub += [_js("STREAM", "INFO", EVENTS), *(x for d, f in consumers for x in _durable(COMMANDS, d, f)),
                CREDENTIAL_RESOLVE_PREFIX + pool,
                *_payloads(write=True)]
        pub.append("noetl.q.users.standing")  # the roles of who started a command's execution (NOETL_POOL_ROLES)
        sub.append("noetl.cancel.*")
        purges.add(PAYLOADS)
    else:
        raise ValueError(f"unknown NATS user {user!r}")
    pub = list(dict.fromkeys(p for p in pub if p))

    deny = [_js("STREAM", "DELETE", ">"), "$JS.API.ACCOUNT.>", "$JS.API.SERVER.>", "$SYS.>", _js("DIRECT", "GET", ">")]
    # no consumer of the payload store: a push consumer delivers to whatever subject its creator names
    deny += [_js("CONSUMER", "CREATE", PAYLOADS), _js("CONSUMER", "CREATE", PAYLOADS, ">"),
             _js("CONSUMER", "DURABLE", "CREATE", PAYLOADS, ">")]
    deny += [f"noetl.evt.{w}.>" for w in WRITERS if w != writer]  # nobody publishes as another writer
    deny.append("noetl.pevt.>")  # stored subjects are the stream's transform's, never published
    deny.append("noetl.evt.timer.>")  # the NATS scheduler's own writer (D29): no client publishes as it
    if user != "event-recorder":
        deny.append(f"{LIVE}.>")  # only the recorder says what is recorded
    if user != "gateway":
        deny.append("noetl.watch.>")  # only gateways say what their console streams show
    if user not in CONTROL_PLANE:
        deny.append("noetl.sched.>")
    if user not in ("admission", "loop-coordinator"):
        deny.append("noetl.cmd.>")
    if user != "admission":
        deny.append(TREE_PREFIX + ">")  # the trees' counts: admission's alone
    if user != "router":
        deny.append("noetl.cancel.>")
    if user != "gateway":  # only operators' tools ask services (and the gateway pings for its readiness)
        deny.append("$SRV.>")
    if user != "sessions":  # the sessions service's buckets and audit stream are its own
        deny += [x for stream in SESSION_STREAMS for x in _stream_api(stream)]
        deny += [f"$KV.{b}.>" for b in SESSION_BUCKETS]
        deny += [f"noetl.audit.{area}.>" for area in SESSIONS_AUDIT_AREAS]
        deny.append("noetl.q.sessions.bootstrap")  # the admin's only
        deny.append("noetl.sessions.revoked")
    if user not in ("scheduler", "credentials") and not user.startswith(WORKER_PREFIX):
        deny.append("noetl.q.users.standing")  # answered without a token: the scheduler's, the workers', the credentials service's
    if user != "credentials":  # its records of workers' resolutions: nobody else writes them
        deny += [f"noetl.audit.{action}.>" for action in CREDENTIALS_AUDIT]
    if not user.startswith(WORKER_PREFIX):  # a worker asks on its own pool's subject only (allowed above)
        deny.append(CREDENTIAL_RESOLVE_PREFIX + ">")
    if user != "scheduler":  # the schedules stream and bucket are the scheduler's: a schedule message fires
        deny += [x for stream in SCHEDULE_STREAMS for x in _stream_api(stream)]
        deny += [f"$KV.{SCHEDULES_BUCKET}.>", "noetl.schedule.>"]
    deny += [_js("STREAM", "PURGE", s) for s in ALL_STREAMS if s not in purges and s not in SESSION_STREAMS]
    deny += [_js("STREAM", verb, s) for verb in ("CREATE", "UPDATE") for s in ALL_STREAMS if s not in SESSION_STREAMS]
    others = ["event-recorder", *(d for s in (*CONTROL_PLANE, "event-recorder")
                                  for d in (*durables(s, partitions), *earlier_durables(s, partitions)))]
    if user in CONTROL_PLANE:  # its wildcards cover ephemerals only: never another service's durable
        own, earlier = set(durables(user, partitions)), set(earlier_durables(user, partitions))
        deny += [_js("CONSUMER", verb, EVENTS, d) for verb in ("MSG.NEXT", "DELETE", "CREATE") for d in others
                 if d not in own and not (verb == "DELETE" and d in earlier)]
        deny += [_js("CONSUMER", "CREATE", EVENTS, d, ">") for d in others if d not in own]
        deny += [_js("CONSUMER", "DELETE", EVENTS, d) for d in own]
    elif user == "event-recorder":  # no consumer but the earlier version's single durable (allowed above)
        deny += [_js("CONSUMER", "DELETE", s, ">") for s in ALL_STREAMS if s != EVENTS]
        deny += [_js("CONSUMER", "DELETE", EVENTS, d) for d in others if d != "event-recorder"]
    else:
        deny += [_js("CONSUMER", "DELETE", ">")]
    if user not in (*CONTROL_PLANE, "event-recorder"):
        deny.append(f"$KV.{MEMBERS_BUCKET}.>")
    sub_deny = [f"noetl.q.{a}.>" for a in (*RECORDER_AREAS, *CREDENTIALS_AREAS, *SESSIONS_AREAS, *SCHEDULER_AREAS)
                if not (user == "event-recorder" and a in RECORDER_AREAS or user == "sessions" and a in SESSIONS_AREAS
                        or user == "scheduler" and a in SCHEDULER_AREAS
                        or user == "credentials" and a in CREDENTIALS_AREAS)]
    sub_deny += ["noetl.evt.>", "noetl.cmd.>", "$JS.>", "$KV.>", "$O.>"]  # stored traffic arrives via inboxes only
    # allow_responses: one reply to each request received (the $SRV requests every service answers, and
    # the request/reply services' queries), to whatever inbox the requester chose, and nothing else
    # The credentials service answers with secrets: not to whatever subject a requester names, only to
    # inboxes (its publish allow list), which only their owner may read
    return {"publish": {"allow": pub, "deny": sorted(set(deny) - set(pub))},
            "subscribe": {"allow": sub, "deny": sub_deny}, "allow_responses": user != "credentials"}


def server_config(users: dict[str, str], *, partitions: int) -> str:
    """The ``authorization`` block of the server configuration: ``users`` maps each user name to its
    public key. Holds no secret."""
    lines = ["# noetl-mesh NATS users (infra/nats_auth.py; docs/nats-security.md). Public keys and permissions",
             "# only: each service keeps its own seed. Anonymous connections are refused.",
             "authorization {", "  users: ["]
    for user, public in users.items():
        entry: dict[str, Any] = {"nkey": public}
        perms = permissions(user, partitions=partitions, inbox=inbox_prefix(public))
        if perms is not None:
            entry["permissions"] = perms
        lines.append(f"    # {user}")
        lines.append("    " + json.dumps(entry) + ",")
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------- a directory
class NatsAuth:
    """A credentials directory: one nkey seed file per user (``<user>.nk``, 0600), the server
    configuration made from their public keys (``nats-auth.conf``), and what it was made for
    (``nats-auth.json``: partitions, pools). :meth:`ensure` keeps existing seeds and what the
    directory was made for (a restart reuses both; new pools are added)."""

    def __init__(self, directory: str | os.PathLike, *, pools: Iterable[str] = ("default",),
                 partitions: int | None = None) -> None:
        self.directory = Path(directory)
        self.pools = [check_pool(p) for p in dict.fromkeys(pools)]
        self.partitions = partitions or int(os.environ.get("NOETL_PARTITIONS") or DEFAULT_PARTITIONS)

    @property
    def users(self) -> list[str]:
        return [ADMIN, *SERVICES, *(WORKER_PREFIX + p for p in self.pools)]

    def file(self, user: str) -> str:
        return str(self.directory / f"{user}{SEED_SUFFIX}")

    def for_service(self, service: str, pool: str = "default") -> str:
        return self.file(user_for(service, pool))

    @property
    def admin(self) -> str:
        return self.file(ADMIN)

    @property
    def config_file(self) -> str:
        return str(self.directory / CONFIG_FILE)

    @property
    def config(self) -> str:
        return Path(self.config_file).read_text()

    def ensure(self) -> "NatsAuth":
        self.directory.mkdir(parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)
        meta_path = self.directory / META_FILE
        if meta_path.exists():  # made before: its partitions hold (the events stream's are fixed too)
            meta = json.loads(meta_path.read_text())
            self.partitions = int(meta.get("partitions") or self.partitions)
            self.pools = list(dict.fromkeys([*meta.get("pools", []), *self.pools]))
        keys = {}
        for user in self.users:
            path = Path(self.file(user))
            if not path.exists():
                _write_private(path, new_seed() + "\n")
            keys[user] = public_key(read_seed(path))
        _write_private(Path(self.config_file), server_config(keys, partitions=self.partitions))
        _write_private(meta_path, json.dumps({"partitions": self.partitions, "pools": self.pools}) + "\n")
        return self

    def grant_read(self, uid: int) -> list[str]:
        """Let ``uid`` read every seed (:func:`grant_read`): the user a container runs the services as.
        Answers the files."""
        files = [self.file(user) for user in self.users]
        for path in files:
            grant_read(path, uid)
        return files


# POSIX ACLs as Linux stores them (linux/posix_acl_xattr.h): a version, then (tag, permissions, id) entries
_ACL_XATTR, _ACL_VERSION, _ACL_NO_ID = "system.posix_acl_access", 2, 0xFFFFFFFF
_ACL_USER_OBJ, _ACL_USER, _ACL_GROUP_OBJ, _ACL_MASK, _ACL_OTHER = 0x01, 0x02, 0x04, 0x10, 0x20


def grant_read(path: str | os.PathLike, uid: int) -> None:
    """Let the user ``uid`` read ``path`` besides its owner (a POSIX ACL entry ``user:<uid>:r``; the mode
    stays what it was for everyone else). A container's user needs it to read a seed that compose
    bind-mounts as a secret: outside Swarm compose keeps the host file's owner and mode (0600), and the
    project image's services run as uid 10001. Replaces any ACL the file had; Linux only."""
    st = os.stat(path)
    if st.st_uid == uid:
        return
    owner, group, other = (st.st_mode >> 6) & 7, (st.st_mode >> 3) & 7, st.st_mode & 7
    entries = [(_ACL_USER_OBJ, owner, _ACL_NO_ID), (_ACL_USER, 4, uid), (_ACL_GROUP_OBJ, group, _ACL_NO_ID),
               (_ACL_MASK, group | 4, _ACL_NO_ID), (_ACL_OTHER, other, _ACL_NO_ID)]
    value = struct.pack("<I", _ACL_VERSION) + b"".join(struct.pack("<HHI", *e) for e in entries)
    try:
        os.setxattr(path, _ACL_XATTR, value)
    except (AttributeError, OSError) as exc:  # no setxattr (not Linux), or a file system without ACLs
        why = getattr(exc, "strerror", None) or "no POSIX ACLs on this system"
        raise ValueError(f"{path}: cannot let uid {uid} read it ({why}); instead give the file to that user "
                         f"(chown {uid}) or make it readable another way") from None


def _write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (created 0600, never briefly readable by others)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
