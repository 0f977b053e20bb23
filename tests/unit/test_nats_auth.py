"""NATS users and permissions (infra/nats_auth.py) as data, the writer in the subject (infra/bus.py), and
the commands that make and use credentials. The server's enforcement is tested against a real NATS in
tests/integration/test_nats_permissions.py."""
from __future__ import annotations

import json
import os
import stat
import struct

import pytest

from noetl_mesh.contracts.subjects import LANES
from noetl_mesh.cli import main
from noetl_mesh.core.events import make_event
from noetl_mesh.infra.bus import admitted, batch_subject, batches, writer_from_subject
from noetl_mesh.infra.nats_auth import SERVICES, WRITERS as WRITER_USERS
from noetl_mesh.infra.nats_auth import (ADMIN, NatsAuth, check_pool, connect_options, micro_name, permissions,
                                        public_key, read_seed, server_config, user_for)

INBOX = "_INBOX.UKEY"


def perms(user: str, partitions: int = 4) -> dict:
    return permissions(user, partitions=partitions, inbox=INBOX)


def allows(patterns: list[str], subject: str) -> bool:
    """NATS subject matching: ``*`` one token, ``>`` the rest."""
    def match(pattern: str) -> bool:
        p, s = pattern.split("."), subject.split(".")
        for i, token in enumerate(p):
            if token == ">":
                return len(s) > i
            if i >= len(s) or (token != "*" and token != s[i]):
                return False
        return len(p) == len(s)
    return any(match(p) for p in patterns)


def may_publish(user: str, subject: str, partitions: int = 4) -> bool:
    p = perms(user, partitions)["publish"]
    return allows(p["allow"], subject) and not allows(p["deny"], subject)


def may_subscribe(user: str, subject: str) -> bool:
    p = perms(user)["subscribe"]
    return allows(p["allow"], subject) and not allows(p["deny"], subject)


WRITERS = {"gateway": "gateway", "admission": "admission", "router": "router",
           "loop-coordinator": "loop-coordinator", "worker-default": "worker"}


@pytest.mark.parametrize("user, writer", WRITERS.items())
def test_each_writer_publishes_events_as_itself_only(user, writer):
    for other in ("gateway", "admission", "router", "loop-coordinator", "worker"):
        assert may_publish(user, f"noetl.evt.{other}.ctl.x1") == (other == writer), (user, other)
    assert not may_publish(user, "noetl.pevt.0.ctl.x1.router")  # never the stored subjects


def test_who_publishes_commands_purges_and_broadcasts():
    for user in ("admission", "loop-coordinator"):
        assert may_publish(user, "noetl.cmd.default.x1.3")
        assert not may_publish(user, "noetl.cmd.default.x1")  # the unlaned subject of earlier versions
    for user in ("gateway", "router", "event-recorder", "worker-default", "sessions"):
        assert not may_publish(user, "noetl.cmd.default.x1.3"), user
    assert may_publish("router", "$JS.API.STREAM.PURGE.NOETL_COMMANDS")
    assert may_publish("router", "noetl.cancel.x1") and not may_publish("admission", "noetl.cancel.x1")
    for user in ("gateway", "admission", "worker-default", "event-recorder"):
        assert not may_publish(user, "$JS.API.STREAM.PURGE.NOETL_COMMANDS"), user
    assert may_publish("admission", "$JS.API.STREAM.MSG.DELETE.NOETL_COMMANDS")
    assert not may_publish("router", "$JS.API.STREAM.MSG.DELETE.NOETL_COMMANDS")
    for user in ("gateway", "admission", "router", "loop-coordinator", "event-recorder", "worker-default", "sessions"):
        assert not may_publish(user, "$JS.API.STREAM.DELETE.NOETL_EVENTS"), user
        assert not may_publish(user, "$JS.API.STREAM.PURGE.NOETL_EVENTS"), user
        assert not may_publish(user, "$JS.API.STREAM.CREATE.NOETL_EVENTS"), user


def test_only_the_recorder_says_what_is_recorded_and_only_gateways_hear_it():
    """The console's live notices (noetl.live.*): a service that could publish them could make a page
    show what is not in the log."""
    for subject in ("noetl.live.x.x1", "noetl.live.list"):
        assert may_publish("event-recorder", subject)
        assert may_subscribe("gateway", subject)
        for user in ("gateway", "admission", "router", "loop-coordinator", "worker-default", "sessions", "scheduler"):
            assert not may_publish(user, subject), (user, subject)
        for user in ("admission", "router", "loop-coordinator", "worker-default", "sessions", "event-recorder"):
            assert not may_subscribe(user, subject), (user, subject)


def test_control_plane_durables_are_each_services_own():
    assert may_publish("router", "$JS.API.CONSUMER.DURABLE.CREATE.NOETL_EVENTS.router-all-p3")
    assert may_publish("router", "$JS.API.CONSUMER.MSG.NEXT.NOETL_EVENTS.router-all-p3")
    assert may_publish("router", "$JS.ACK.NOETL_EVENTS.router-all-p3.1.2.3.4.5.6")
    assert not may_publish("router", "$JS.API.CONSUMER.DURABLE.CREATE.NOETL_EVENTS.router-all-p4")  # 4 partitions
    assert may_publish("router", "$JS.API.CONSUMER.DURABLE.CREATE.NOETL_EVENTS.router-all-p4", partitions=5)
    # a rebuild consumer (random name) is fine; another service's durable is not, by any verb
    assert may_publish("router", "$JS.API.CONSUMER.CREATE.NOETL_EVENTS.Xy12.noetl.pevt.0.ctl.x1.*")
    assert may_publish("router", "$JS.API.CONSUMER.MSG.NEXT.NOETL_EVENTS.Xy12")
    assert may_publish("router", "$JS.API.CONSUMER.DELETE.NOETL_EVENTS.Xy12")
    for durable in ("event-recorder", "admission-all-p0", "loop-coordinator-all-p3", "admission-p0", "event-recorder-p1"):
        for subject in (f"$JS.API.CONSUMER.CREATE.NOETL_EVENTS.{durable}",
                        f"$JS.API.CONSUMER.CREATE.NOETL_EVENTS.{durable}.noetl.pevt.>",
                        f"$JS.API.CONSUMER.MSG.NEXT.NOETL_EVENTS.{durable}",
                        f"$JS.API.CONSUMER.DELETE.NOETL_EVENTS.{durable}",
                        f"$JS.ACK.NOETL_EVENTS.{durable}.1.2.3.4.5.6"):
            assert not may_publish("router", subject), subject
    assert not may_publish("router", "$JS.API.CONSUMER.DELETE.NOETL_EVENTS.router-all-p0")  # not even its own


def test_a_control_plane_service_reads_where_its_earlier_durables_stopped_and_deletes_them():
    """Its durables of an earlier version (one ack per event) hand over to the current ones: it may read
    their ack floor and delete them, and nothing else."""
    assert may_publish("router", "$JS.API.CONSUMER.INFO.NOETL_EVENTS.router-p3")
    assert may_publish("router", "$JS.API.CONSUMER.DELETE.NOETL_EVENTS.router-p3")
    for subject in ("$JS.API.CONSUMER.MSG.NEXT.NOETL_EVENTS.router-p3", "$JS.ACK.NOETL_EVENTS.router-p3.1.2.3.4.5.6",
                    "$JS.API.CONSUMER.DURABLE.CREATE.NOETL_EVENTS.router-p3"):
        assert not may_publish("router", subject), subject


def test_a_worker_reads_its_pools_commands_only():
    # earlier versions', its lanes: created by the subject that names the filter, which the server
    # compares with the body's (never by DURABLE.CREATE, whose body may filter anything)
    for durable, filter_subject in (("pool-gpu", "noetl.cmd.gpu.*"),
                                    *((f"lane-gpu-p{lane}", f"noetl.cmd.gpu.*.{lane}") for lane in range(LANES))):
        assert may_publish("worker-gpu", f"$JS.API.CONSUMER.CREATE.NOETL_COMMANDS.{durable}.{filter_subject}")
        assert may_publish("worker-gpu", f"$JS.API.CONSUMER.MSG.NEXT.NOETL_COMMANDS.{durable}")
        assert may_publish("worker-gpu", f"$JS.ACK.NOETL_COMMANDS.{durable}.1.2.3.4.5.6")
        for subject in (f"$JS.API.CONSUMER.DURABLE.CREATE.NOETL_COMMANDS.{durable}",
                        f"$JS.API.CONSUMER.CREATE.NOETL_COMMANDS.{durable}",
                        f"$JS.API.CONSUMER.CREATE.NOETL_COMMANDS.{durable}.noetl.cmd.>",
                        f"$JS.API.CONSUMER.CREATE.NOETL_COMMANDS.{durable}.noetl.cmd.default.*.0"):
            assert not may_publish("worker-gpu", subject), subject
    for subject in ("$JS.API.CONSUMER.DURABLE.CREATE.NOETL_COMMANDS.pool-default",
                    "$JS.API.CONSUMER.CREATE.NOETL_COMMANDS.pool-default.noetl.cmd.default.*",
                    "$JS.API.CONSUMER.MSG.NEXT.NOETL_COMMANDS.pool-default",
                    "$JS.API.CONSUMER.MSG.NEXT.NOETL_COMMANDS.lane-default-p0",
                    f"$JS.API.CONSUMER.MSG.NEXT.NOETL_COMMANDS.lane-gpu-p{LANES}",
                    "$JS.API.CONSUMER.CREATE.NOETL_COMMANDS", "$JS.API.CONSUMER.CREATE.NOETL_COMMANDS.x.noetl.cmd.>",
                    "$JS.API.STREAM.MSG.GET.NOETL_COMMANDS", "$JS.API.CONSUMER.MSG.NEXT.NOETL_EVENTS.event-recorder",
                    "$KV.noetl_members.admission.x", "$JS.API.STREAM.INFO.KV_noetl_sessions",
                    "$JS.API.DIRECT.GET.KV_noetl_sessions", "$KV.noetl_sessions.noetl.sessions.s1",
                    "noetl.q.catalog.get", "noetl.q.sessions.validate", "noetl.q.credential.get"):
        assert not may_publish("worker-gpu", subject), subject
    # credentials: its own pool's resolutions only (the pool in the subject is the credentials service's
    # proof of who asks); nothing else of the credential store
    assert may_publish("worker-gpu", "noetl.q.credential.resolve.gpu")
    for subject in ("noetl.q.credential.resolve", "noetl.q.credential.resolve.default", "noetl.q.credential.put",
                    "noetl.q.credential.list", "noetl.q.credential.delete", "noetl.audit.credential.resolved.-"):
        assert not may_publish("worker-gpu", subject), subject
    assert may_subscribe("worker-gpu", "noetl.cancel.*")
    for subject in ("_INBOX.>", "_INBOX.UOTHER.x", "noetl.cmd.gpu.*", "noetl.q.credential.resolve.gpu", "$KV.>"):
        assert not may_subscribe("worker-gpu", subject), subject
    assert may_subscribe("worker-gpu", f"{INBOX}.abc")


def test_no_user_but_the_admin_asks_a_direct_get():
    for user in ("gateway", "admission", "router", "loop-coordinator", "event-recorder", "worker-default",
                 "scheduler", "sessions", "credentials"):
        for stream in ("KV_noetl_sessions", "KV_noetl_schedules", "NOETL_TREES", "OBJ_noetl_payloads", "NOETL_EVENTS"):
            assert not may_publish(user, f"$JS.API.DIRECT.GET.{stream}"), (user, stream)
            assert not may_publish(user, f"$JS.API.DIRECT.GET.{stream}.x.y"), (user, stream)


def test_only_the_sessions_service_touches_its_buckets_and_only_the_admin_bootstraps():
    for bucket in ("noetl_sessions", "noetl_users", "noetl_logins"):
        stream = f"KV_{bucket}"
        assert may_publish("sessions", f"$KV.{bucket}.k") and may_publish("sessions", f"$JS.API.STREAM.MSG.GET.{stream}")
        # no direct get: its answer is a message's own bytes, which the server publishes at any reply subject
        assert not may_publish("sessions", f"$JS.API.DIRECT.GET.{stream}.$KV.{bucket}.k")
        for user in ("gateway", "admission", "router", "loop-coordinator", "event-recorder", "worker-default"):
            for subject in (f"$KV.{bucket}.k", f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.STREAM.MSG.GET.{stream}",
                            f"$JS.API.DIRECT.GET.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}",
                            f"$JS.API.STREAM.PURGE.{stream}"):
                assert not may_publish(user, subject), (user, subject)
    assert may_subscribe("sessions", "noetl.q.sessions.bootstrap")
    assert not may_publish("gateway", "noetl.q.sessions.bootstrap")
    assert may_publish("gateway", "noetl.q.sessions.validate") and may_publish("gateway", "noetl.q.users.add")
    # answered without a token (a schedule's creator at each firing): the scheduler's only
    assert may_publish("scheduler", "noetl.q.users.standing")
    assert may_publish("worker-default", "noetl.q.users.standing")  # a pool's roles (NOETL_POOL_ROLES)
    assert may_publish("credentials", "noetl.q.users.standing")  # a credential's roles (D24)
    assert not any(may_publish(u, "noetl.q.users.standing") for u in ("gateway", "router", "admission"))
    assert may_publish("gateway", "noetl.audit.credential.read.u1")
    assert not may_publish("gateway", "noetl.audit.session.login.u1")  # the sessions service's record
    assert not may_subscribe("gateway", "noetl.q.sessions.validate")  # nobody impersonates the service
    assert not may_subscribe("worker-default", "noetl.q.execution.get")
    assert perms("sessions").get("allow_responses") and perms("event-recorder").get("allow_responses")


USERS = ("gateway", "admission", "router", "loop-coordinator", "event-recorder", "credentials", "sessions",
         "scheduler", "worker-default", "worker-gpu")


@pytest.mark.parametrize("user", USERS)
def test_each_service_answers_the_srv_requests_of_its_own_micro_name_only(user):
    name = micro_name(user)
    assert name == f"noetl-{user}"
    for verb in ("PING", "INFO", "STATS"):
        for subject in (f"$SRV.{verb}", f"$SRV.{verb}.{name}", f"$SRV.{verb}.{name}.ID1"):
            assert may_subscribe(user, subject), subject
        for other in USERS:
            if other != user:
                assert not may_subscribe(user, f"$SRV.{verb}.noetl-{other}"), other
                assert not may_subscribe(user, f"$SRV.{verb}.noetl-{other}.ID1"), other
    for subject in ("$SRV.>", "$SRV.*", "$SRV.PING.>", "$SRV.FOO"):
        assert not may_subscribe(user, subject), subject
    if user == "credentials":  # it answers with secrets: to inboxes only, whatever reply subject it is given
        assert perms(user)["allow_responses"] is False and may_publish(user, "_INBOX.UOTHER.x")
    else:
        assert perms(user)["allow_responses"] is True  # one reply per request received, to its inbox


def test_the_credential_store_is_the_credentials_service_alone():
    """Only the credentials service answers noetl.q.credential.*; the gateway asks the store's API (not
    resolve), a worker resolves on its own pool's subject only, the recorder nothing at all; only the
    credentials service records resolutions in the audit log, and it answers to inboxes only."""
    for verb in ("put", "list", "get", "delete", "resolve.default", "resolve.gpu"):
        subject = f"noetl.q.credential.{verb}"
        assert may_subscribe("credentials", subject if "." not in verb else "noetl.q.credential.resolve.*")
        for user in USERS:
            if user != "credentials":
                assert not may_subscribe(user, subject), (user, subject)
        assert may_publish("gateway", subject) == ("resolve" not in verb), verb
        assert not may_publish("event-recorder", subject) and not may_publish("router", subject)
    assert may_publish("worker-default", "noetl.q.credential.resolve.default")
    assert not may_publish("worker-default", "noetl.q.credential.resolve.gpu")
    assert not may_publish("worker-default", "noetl.q.credential.get")
    assert not may_subscribe("event-recorder", "noetl.q.credential.get")
    # it reads commands by sequence, asks the recorder one thing, reads payloads, writes two audit records
    assert may_publish("credentials", "$JS.API.STREAM.MSG.GET.NOETL_COMMANDS")
    assert may_publish("credentials", "noetl.q.execution.status")
    assert may_publish("credentials", "$JS.API.STREAM.MSG.GET.OBJ_noetl_payloads")
    for action in ("resolved", "refused"):
        assert may_publish("credentials", f"noetl.audit.credential.{action}.-")
        for user in USERS:
            if user != "credentials":
                assert not may_publish(user, f"noetl.audit.credential.{action}.-"), (user, action)
    for subject in ("noetl.q.execution.get", "noetl.cmd.default.x", "noetl.evt.worker.ctl.x", "noetl.cancel.x",
                    "$O.noetl_payloads.C.x", "$JS.API.STREAM.PURGE.NOETL_COMMANDS",
                    "$JS.API.STREAM.MSG.DELETE.NOETL_COMMANDS", "$JS.API.CONSUMER.MSG.NEXT.NOETL_COMMANDS.pool-default",
                    "noetl.audit.credential.read.-", "noetl.audit.session.login.-"):
        assert not may_publish("credentials", subject), subject


@pytest.mark.parametrize("user", USERS)
def test_only_the_gateway_asks_services_and_only_pings_the_control_plane(user):
    for subject in ("$SRV.PING", "$SRV.INFO", "$SRV.STATS", "$SRV.INFO.noetl-router", "$SRV.STATS.noetl-router.X",
                    "$SRV.PING.noetl-worker-default", "$SRV.PING.noetl-gateway"):
        assert not may_publish(user, subject), (user, subject)
    for service in ("admission", "router", "loop-coordinator", "event-recorder", "sessions"):
        assert may_publish(user, f"$SRV.PING.noetl-{service}") == (user == "gateway"), (user, service)


def test_the_admin_is_unrestricted_and_unknown_users_are_refused():
    assert permissions(ADMIN, partitions=4, inbox=INBOX) is None
    with pytest.raises(ValueError, match="unknown NATS user"):
        permissions("mallory", partitions=4, inbox=INBOX)
    assert user_for("worker", "gpu") == "worker-gpu" and user_for("router") == "router"
    with pytest.raises(ValueError, match="no NATS user for service 'sessionz'"):
        user_for("sessionz")
    for bad in ("a.b", "*", ">", "", "x" * 65, "a b"):
        with pytest.raises(ValueError, match="a token of its NATS subjects"):
            check_pool(bad)


def test_server_config_holds_public_keys_and_permissions_only(tmp_path):
    auth = NatsAuth(tmp_path / "creds", pools=["default", "gpu"], partitions=2).ensure()
    text = auth.config
    seeds = {u: read_seed(auth.file(u)) for u in auth.users}
    for user, seed in seeds.items():
        assert seed.startswith("SU") and seed not in text
        assert f'"nkey": "{public_key(seed)}"' in text and f"# {user}\n" in text
        assert stat.S_IMODE((tmp_path / "creds" / f"{user}.nk").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "creds").stat().st_mode) == 0o700
    assert f'"_INBOX.{public_key(seeds["worker-gpu"])}.>"' in text
    assert "router-p1" in text and "router-p2" not in text
    assert "authorization {" in text and text.count('"nkey"') == len(auth.users) == 11  # 9 users, 2 pools


def test_credentials_are_kept_across_restarts_and_pools_added(tmp_path):
    first = NatsAuth(tmp_path, partitions=8).ensure()
    seed = read_seed(first.file("router"))
    again = NatsAuth(tmp_path, pools=["gpu"], partitions=16).ensure()  # a later run asks for another count
    assert read_seed(again.file("router")) == seed
    assert again.partitions == 8 and again.pools == ["default", "gpu"]
    assert json.loads((tmp_path / "nats-auth.json").read_text()) == {"partitions": 8, "pools": ["default", "gpu"]}
    assert "worker-gpu" in again.config and "router-p7" in again.config and "router-p8" not in again.config


def _acl(path) -> list[tuple[int, int, int]]:
    """The file's POSIX ACL entries (tag, permissions, id), as Linux stores them."""
    raw = os.getxattr(path, "system.posix_acl_access")
    assert struct.unpack_from("<I", raw)[0] == 2
    return [struct.unpack_from("<HHI", raw, 4 + 8 * i) for i in range((len(raw) - 4) // 8)]


@pytest.mark.skipif(not hasattr(os, "setxattr"), reason="POSIX ACLs through xattrs: Linux only")
def test_the_seeds_can_be_made_readable_by_the_containers_user_and_no_one_else(tmp_path):
    auth = NatsAuth(tmp_path / "creds").ensure()
    files = auth.grant_read(10001)
    assert sorted(files) == sorted(auth.file(u) for u in auth.users)  # every seed, admin's too (compose's setup)
    for path in files:
        # owner rw, user 10001 r, the group and others nothing (the mask lets the named user read only)
        assert _acl(path) == [(0x01, 6, 0xFFFFFFFF), (0x02, 4, 10001), (0x04, 0, 0xFFFFFFFF),
                              (0x10, 4, 0xFFFFFFFF), (0x20, 0, 0xFFFFFFFF)]
    with pytest.raises(OSError):  # the server's configuration is not a seed: left alone
        os.getxattr(auth.config_file, "system.posix_acl_access")
    if os.geteuid() == 0:  # the kernel agrees: 10001 reads a seed, 10002 does not
        # (reached as a bind mount reaches it, without the 0700 directory: through an O_PATH descriptor)
        fd = os.open(auth.admin, os.O_PATH)
        for uid, code in ((10001, 0), (10002, 13)):
            pid = os.fork()
            if pid == 0:
                try:
                    os.setgid(65534), os.setuid(uid)
                    open(f"/proc/self/fd/{fd}").read()
                    os._exit(0)
                except PermissionError:
                    os._exit(13)
                except BaseException:
                    os._exit(99)
            assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == code, uid
        os.close(fd)


@pytest.mark.skipif(not hasattr(os, "setxattr"), reason="POSIX ACLs through xattrs: Linux only")
def test_nats_credentials_reader_option(tmp_path, capsys):
    assert main(["nats-credentials", "--out", str(tmp_path / "c"), "--reader", "10001"]) == 0
    assert "readable by uid 10001" in capsys.readouterr().out
    assert _acl(tmp_path / "c" / "router.nk")[1] == (0x02, 4, 10001)


def test_connect_options_use_the_users_own_inbox(tmp_path):
    auth = NatsAuth(tmp_path).ensure()
    opts = connect_options(auth.for_service("worker"))
    assert opts["inbox_prefix"] == f"_INBOX.{public_key(read_seed(auth.file('worker-default')))}"
    assert opts["nkeys_seed_str"] == read_seed(auth.file("worker-default"))
    assert connect_options(None) == {}
    (tmp_path / "bad.nk").write_text("not a seed")
    with pytest.raises(ValueError, match="bad.nk: not an nkey user seed"):
        connect_options(tmp_path / "bad.nk")
    with pytest.raises(ValueError, match="missing.nk: cannot read"):
        connect_options(tmp_path / "missing.nk")


def test_server_config_renders_users_in_order():
    text = server_config({"admin": "UA", "router": "UB"}, partitions=1)
    assert text.index("# admin") < text.index("# router") and '{"nkey": "UA"}' in text


# ------------------------------------------------------------------------------ the writer in the subject
def ev(name, source, eid="x1", event_id="e"):
    return make_event(name, eid, event_id=event_id, source=source)


def test_the_subject_names_the_writer_from_the_source():
    assert batch_subject([ev("step.done", "worker:gpu")]) == "noetl.evt.worker.ctl.x1"
    assert batch_subject([ev("task.started", "worker:gpu")]) == "noetl.evt.worker.info.x1"
    assert batch_subject([ev("next.evaluated", "router")]) == "noetl.evt.router.ctl.x1"
    with pytest.raises(ValueError, match="source 'test' names no writer"):
        batch_subject([ev("step.done", "test")])
    mixed = [ev("step.done", "router", "x1", "a"), ev("step.done", "router", "x1", "b"),
             ev("step.done", "admission", "x1", "c"), ev("step.done", "admission", "x2", "d")]
    assert [[e["event_id"] for e in b] for b in batches(mixed)] == [["a", "b"], ["c"], ["d"]]  # one writer each


def test_a_control_plane_durable_reads_its_classes_but_its_own_flat_messages():
    from noetl_mesh.contracts.subjects import control_filter
    from noetl_mesh.core.decide import CONSUMES

    reads = {s: control_filter(s, 3, CONSUMES[s]) for s in CONSUMES}
    assert reads["loop-coordinator"] == ["noetl.pevt.3.ctl.*.*", "noetl.pevt.3.loop.*.*"]
    for service in ("admission", "router"):
        assert reads[service][0] == "noetl.pevt.3.ctl.*.*"  # its own too: a child's request, a parent's notice
        flat = {f.split(".")[5] for f in reads[service][1:]}
        assert flat == {"gateway", "admission", "router", "loop-coordinator", "worker", "scheduler", "timer"} - {service}
        assert all(f.startswith("noetl.pevt.3.flat.*.") for f in reads[service][1:])


def test_admitted_keeps_what_the_subjects_writer_may_write(caplog):
    good, forged, lying = ev("step.done", "worker:a", event_id="g"), ev("workflow.finished", "worker:a", event_id="f"), \
        ev("step.done", "router", event_id="l")
    assert writer_from_subject("noetl.pevt.3.ctl.x1.worker") == "worker"
    assert writer_from_subject("noetl.pevt.3.ctl.x1") is None
    with caplog.at_level("ERROR"):
        assert admitted("noetl.pevt.3.ctl.x1.worker", [good, forged, lying], "router", None) == [good]
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("router: dropped 2 of 3 events of noetl.pevt.3.ctl.x1.worker: 'workflow.finished' (f,")
    assert admitted("noetl.pevt.3.ctl.x1.nobody", [good], "router", {}) == []
    assert admitted("noetl.pevt.3.ctl.x1", [forged], "event-recorder", None) == [forged]  # the earlier layout


def test_only_the_nats_scheduler_writes_as_timer(caplog):
    """D29: a timer's message is written by the server at its time (it carries Nats-Scheduler); no
    client publishes as ``timer``, and a scheduled message may not write as any other writer."""
    fired = ev("timer.fired", "timer", event_id="t")
    by_scheduler = {"Nats-Scheduler": "noetl.sched.x1.abc"}
    assert admitted("noetl.pevt.3.ctl.x1.timer", [fired], "router", by_scheduler) == [fired]
    with caplog.at_level("ERROR"):
        assert admitted("noetl.pevt.3.ctl.x1.timer", [fired], "router", {}) == []  # published as timer
        forged = ev("execution.cancelled", "gateway", event_id="c")
        assert admitted("noetl.pevt.3.ctl.x1.gateway", [forged], "router", by_scheduler) == []  # scheduled forgery
        assert admitted("noetl.pevt.3.ctl.x1.timer", [ev("step.done", "timer", event_id="d")], "router",
                        by_scheduler) == []  # the timer writes timer.fired only
    assert len(caplog.records) == 3
    for user in ("gateway", "router", "worker-default", "event-recorder"):
        perms = permissions(user, partitions=2, inbox="_INBOX.x")
        assert "noetl.evt.timer.>" in perms["publish"]["deny"]
    assert "noetl.sched.*.*" in permissions("router", partitions=2, inbox="_INBOX.x")["publish"]["allow"]
    assert "noetl.sched.>" in permissions("gateway", partitions=2, inbox="_INBOX.x")["publish"]["deny"]


def test_nats_credentials_command(tmp_path, capsys):
    out = tmp_path / "creds"
    assert main(["nats-credentials", "--out", str(out), "--pool", "gpu", "--partitions", "4"]) == 0
    printed = capsys.readouterr().out
    assert f"{out}/nats-auth.conf: the server's users (4 partitions, pools gpu)" in printed
    assert f"{out}/worker-gpu.nk" in printed and (out / "admin.nk").exists()
    assert main(["nats-credentials", "--out", str(out), "--pool", "a.b"]) == 2
    assert "pool 'a.b'" in capsys.readouterr().err


def test_service_refuses_unreadable_credentials_before_starting(tmp_path, capsys):
    assert main(["service", "router", "--nats-url", "nats://127.0.0.1:1", "--nats-creds", str(tmp_path / "no.nk")]) == 2
    assert "no.nk: cannot read" in capsys.readouterr().err


# ------------------------------------------------------------------ the scheduler
# It alone touches the schedules stream and bucket (a schedule message fires executions), it writes
# execution requests as itself, and only the gateway may ask it.
SCHEDULES_API = ("noetl.schedule.def.s1", "noetl.schedule.fire.s1", "$KV.noetl_schedules.s1",
                 "$JS.API.STREAM.PURGE.NOETL_SCHEDULES", "$JS.API.STREAM.INFO.KV_noetl_schedules",
                 "$JS.API.STREAM.MSG.GET.NOETL_SCHEDULES", "$JS.API.CONSUMER.CREATE.NOETL_SCHEDULES.scheduler.noetl.schedule.fire.*",
                 "$JS.API.CONSUMER.MSG.NEXT.NOETL_SCHEDULES.scheduler", "$JS.ACK.NOETL_SCHEDULES.scheduler.1.2.3.4.5")


SCHEDULER_OTHERS = ("gateway", "admission", "router", "loop-coordinator", "event-recorder", "sessions", "worker-default")


@pytest.mark.parametrize("user", SCHEDULER_OTHERS)
def test_only_the_scheduler_touches_the_schedules(user):
    for subject in SCHEDULES_API:
        assert not may_publish(user, subject), (user, subject)
    assert not may_subscribe(user, "noetl.q.schedule.add")
    assert not may_publish(user, "noetl.evt.scheduler.ctl.x1")


def test_only_admission_counts_a_trees_children():
    """D19: the trees' counters (NOETL_TREES) take increments from admission alone; no user but the
    admin may create, change or purge the stream."""
    assert may_publish("admission", "noetl.tree.x1")
    for user in ("gateway", "router", "loop-coordinator", "event-recorder", "worker-default", "scheduler",
                 "sessions", "credentials"):
        assert not may_publish(user, "noetl.tree.x1"), user
        for verb in ("CREATE", "UPDATE", "PURGE", "DELETE"):
            assert not may_publish(user, f"$JS.API.STREAM.{verb}.NOETL_TREES"), (user, verb)
    assert not may_publish("admission", "noetl.tree.x1.more")


def test_what_the_scheduler_may_do():
    assert "scheduler" in SERVICES and "scheduler" in WRITER_USERS
    for subject in (*SCHEDULES_API[:1], *SCHEDULES_API[2:], "noetl.evt.scheduler.ctl.x1", "$JS.API.STREAM.INFO.NOETL_EVENTS",
                    "$JS.API.STREAM.PURGE.KV_noetl_schedules"):
        assert may_publish("scheduler", subject), subject
    assert may_subscribe("scheduler", "noetl.q.schedule.add") and may_subscribe("scheduler", f"{INBOX}.x")
    for subject in ("noetl.schedule.fire.s1",  # only the server fires
                    "noetl.evt.gateway.ctl.x1", "noetl.evt.router.ctl.x1", "noetl.cmd.default.x1", "noetl.cancel.x1",
                    "$JS.API.STREAM.PURGE.NOETL_EVENTS", "$JS.API.STREAM.CREATE.NOETL_SCHEDULES",
                    "$JS.API.STREAM.DELETE.NOETL_SCHEDULES", "$JS.API.CONSUMER.DELETE.NOETL_SCHEDULES.scheduler",
                    "$KV.noetl_sessions.x", "$KV.noetl_members.scheduler.x", "noetl.q.sessions.bootstrap"):
        assert not may_publish("scheduler", subject), subject
    for subject in ("noetl.q.catalog.get", "noetl.q.sessions.validate", "_INBOX.other.x", "noetl.schedule.fire.s1"):
        assert not may_subscribe("scheduler", subject), subject
    assert permissions("scheduler", partitions=4, inbox=INBOX).get("allow_responses") is True


def test_the_gateway_asks_the_scheduler():
    for verb in ("add", "list", "get", "pause", "resume", "delete"):
        assert may_publish("gateway", f"noetl.q.schedule.{verb}")
    for user in SCHEDULER_OTHERS[1:]:
        assert not may_publish(user, "noetl.q.schedule.add"), user
