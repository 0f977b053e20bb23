"""NATS permissions on a running stack (one user per service, infra/nats_auth.py): what a service's
credentials may not do is refused by the server (a permission violation, logged by it) and changes
nothing; an event a writer may not write that its own permissions let through is dropped by the control
plane. (That each service's credentials let it do its job is shown by every other integration test:
their stacks run with the same permissions and fail on any violation.)"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import nats
import pytest
from nats.js.api import ConsumerConfig

from conftest import start_stack, stop_stack
from noetl_mesh.client import GatewayClient
from noetl_mesh.core.events import make_event, new_execution_id
from noetl_mesh.contracts.subjects import command_subject, lane_durable, lane_filter
from noetl_mesh.infra.bus import COMMANDS, EVENTS, Bus, dumps, loads, pool_filter
from noetl_mesh.infra.nats_auth import NatsAuth, connect_options, public_key, read_seed

pytestmark = pytest.mark.integration
TIMEOUT = 0.5  # a refused JetStream request is never answered: it times out (the server's -ERR comes at once)


@pytest.fixture(scope="module")
def secured(module_pg, fixture_api):
    nats_server, loop, handle = start_stack(module_pg, pools=("default", "other"),
                                            allow_net=fixture_api.endpoint)  # a task calls the API (D33)
    handle.server = nats_server
    handle.auth = NatsAuth(handle.stack.settings.nats_creds)
    yield handle
    stop_stack(nats_server, loop, handle, check=False)  # this module's own refusals are logged


class Conn:
    """A raw connection as one user, collecting the errors the server sends it."""

    def __init__(self, handle, user: str | None, timeout: float | None = None):
        self.handle, self.user, self.errors = handle, user, []
        self.timeout = timeout or (10.0 if user == "admin" else TIMEOUT)  # the admin's calls are answered

    async def __aenter__(self) -> "Conn":
        async def on_error(exc: Exception) -> None:
            self.errors.append(str(exc))

        creds = self.handle.auth.file(self.user) if self.user else None
        self.nc = await nats.connect(self.handle.nats_url, error_cb=on_error, allow_reconnect=False,
                                     **connect_options(creds))
        self.js = self.nc.jetstream(timeout=self.timeout)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.nc.close()

    async def refused(self, call, what: str) -> None:
        """``call`` fails (no answer) and the server says why: a permission violation naming ``what``."""
        with pytest.raises(Exception):  # noqa: B017 - a timeout, or no responders
            await call
        await self.nc.flush()
        for _ in range(20):
            if any("permissions violation" in e and what.lower() in e.lower() for e in self.errors):  # lower-cased
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"no permission violation for {what!r}: {self.errors}")


def logged(handle, user: str, what: str) -> bool:
    """The server logged the violation, with the user's key."""
    key = public_key(read_seed(handle.auth.file(user)))
    return any(key in line and what in line for line in handle.server.violations())


async def stream_state(handle, stream: str):
    async with Conn(handle, "admin") as admin:
        return (await admin.js.stream_info(stream)).state


def test_an_anonymous_connection_is_refused(secured):
    async def main():
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nats.connect(secured.nats_url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)

    secured.run(main())


def test_a_worker_cannot_publish_a_control_plane_event_as_the_router(secured):
    async def main():
        xid = new_execution_id()
        before = await stream_state(secured, EVENTS)
        finished = make_event("workflow.finished", xid, event_id="forged-1", source="router",
                              data={"status": "COMPLETED", "cancelled_runs": [], "error": None})
        async with Conn(secured, "worker-default") as worker:
            await worker.refused(worker.js.publish(f"noetl.evt.router.ctl.{xid}", dumps([finished]), stream=EVENTS),
                                 f"noetl.evt.router.ctl.{xid}")
            await worker.refused(worker.js.publish(f"noetl.evt.gateway.ctl.{xid}", dumps([finished]), stream=EVENTS),
                                 f"noetl.evt.gateway.ctl.{xid}")
            await worker.refused(worker.js.publish(f"noetl.cmd.default.{xid}", b"{}", stream=COMMANDS),
                                 f"noetl.cmd.default.{xid}")
        after = await stream_state(secured, EVENTS)
        assert (after.messages, after.last_seq) == (before.messages, before.last_seq)  # nothing stored
        assert logged(secured, "worker-default", f"noetl.evt.router.ctl.{xid}")

    secured.run(main())


def test_a_control_plane_event_on_a_workers_own_subject_is_stored_and_dropped(secured, fixture_api, caplog):
    """The worker's user may publish on ``noetl.evt.worker.…``, so a forged ``workflow.finished`` (and
    a ``step.done`` claiming to be the router's) is stored; the control plane drops both, logs them, and
    the execution runs on to its real end."""
    doc = {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "f", "path": "t/forged"},
           "workflow": [{"step": "slow", "tool": {"kind": "http", "url": f"{fixture_api.url}/slow/1.5"},
                         "next": {"arcs": [{"step": "end"}]}},
                        {"step": "end", "tool": {"kind": "noop", "result": "done"}}]}

    phase = ["submitting"]

    async def main():
        async with secured.client() as client:
            xid = await client.start(doc)
        phase[0] = "waiting for the step to start"
        async with Conn(secured, "admin") as admin:
            events = await _events(admin, xid, lambda evs: any(e["name"] == "step.started" for e in evs), timeout=60)
            run = next(e for e in events if e["name"] == "step.started")["step_run_id"]
        forged = [make_event("workflow.finished", xid, event_id="forged-2", source="worker:default", status="error",
                             data={"status": "FAILED", "cancelled_runs": [], "error": {"kind": "forged"}}),
                  make_event("step.done", xid, event_id="forged-3", source="router", step="slow", step_run_id=run,
                             data={"result": "forged"})]
        phase[0] = "publishing the forged events"
        async with Conn(secured, "worker-default", timeout=10) as worker:  # allowed: answered
            ack = await worker.js.publish(f"noetl.evt.worker.ctl.{xid}", dumps(forged), stream=EVENTS)
        assert ack.seq and not worker.errors
        phase[0] = "waiting for the router's workflow.finished"
        async with Conn(secured, "admin") as admin:
            events = await _events(admin, xid, lambda evs: any(e["name"] == "workflow.finished" and e["source"] == "router"
                                                               for e in evs), timeout=60)
        real = next(e for e in events if e["name"] == "workflow.finished" and e["source"] == "router")
        assert real["data"]["status"] == "COMPLETED"
        assert any(e["name"] == "step.done" and e["step"] == "end" for e in events)  # it ran on
        from noetl_mesh.infra.control import IDLE
        assert secured.stack.services("router")[0].cache[xid] is IDLE  # finished: let go, nothing more to decide
        phase[0] = "reading the recorded log"
        async with secured.client() as client:  # the recorder dropped them too (D22: same fold)
            final = await client.wait(xid, timeout=30)
            recorded = await client.all_events(xid)
        assert final["status"] == "COMPLETED"
        assert not {"forged-2", "forged-3"} & {e["event_id"] for e in recorded}

    async def bounded():
        try:
            await asyncio.wait_for(main(), 140)
        except asyncio.TimeoutError:
            raise AssertionError(f"stuck {phase[0]}") from None

    with caplog.at_level(logging.ERROR, logger="noetl.bus"):
        secured.run(bounded(), timeout=150)
    dropped = [r.getMessage() for r in caplog.records if "dropped 2 of 2 events" in r.getMessage()]
    assert dropped and "worker may not write 'workflow.finished'" in dropped[0]
    assert "source 'router' is not the writer 'worker'" in dropped[0]


async def _events(admin: Conn, xid: str, until, timeout: float = 15) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        sub = await admin.js.pull_subscribe(f"noetl.pevt.*.*.{xid}.*", stream=EVENTS,
                                            config=ConsumerConfig(inactive_threshold=5.0))
        events: list[dict] = []
        try:
            while True:
                msgs = await sub.fetch(100, timeout=0.5)
                for m in msgs:
                    events += [{**e, "_writer": m.subject.rsplit(".", 1)[1]} for e in loads(m.data)]
        except asyncio.TimeoutError:
            pass
        finally:
            await sub.unsubscribe()
        if until(events):
            return events
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; got {[(e['name'], e['source']) for e in events]}")
        await asyncio.sleep(0.3)


def test_a_worker_cannot_touch_the_sessions_bucket(secured):
    async def main():
        async with Conn(secured, "admin") as admin:  # the sessions service's own bucket
            kv = await admin.js.key_value("noetl_sessions")
            revision = await kv.put("noetl.sessions.s1", b'{"user": "u1"}')
        async with Conn(secured, "worker-default") as worker:
            await worker.refused(worker.js.key_value("noetl_sessions"), "$JS.API.STREAM.INFO.KV_noetl_sessions")
            await worker.refused(worker.js.get_msg("KV_noetl_sessions", subject="$KV.noetl_sessions.noetl.sessions.s1"),
                                 "$JS.API.STREAM.MSG.GET.KV_noetl_sessions")
            await worker.refused(worker.js.get_msg("KV_noetl_sessions", subject="$KV.noetl_sessions.noetl.sessions.s1",
                                                   direct=True), "$JS.API.DIRECT.GET.KV_noetl_sessions")
            await worker.refused(worker.js.publish("$KV.noetl_sessions.noetl.sessions.s1", b'{"user": "admin"}'),
                                 "$KV.noetl_sessions.noetl.sessions.s1")
            await worker.nc.subscribe("$KV.noetl_sessions.>")
            await worker.nc.subscribe("_INBOX.>")  # everyone else's replies and deliveries
            await worker.nc.flush()
            await asyncio.sleep(0.2)
            assert any('subscription to "$kv.noetl_sessions.>"' in e.lower() for e in worker.errors), worker.errors
            assert any('subscription to "_inbox.>"' in e.lower() for e in worker.errors), worker.errors
        async with Conn(secured, "admin") as admin:
            kv = await admin.js.key_value("noetl_sessions")
            entry = await kv.get("noetl.sessions.s1")
            assert (entry.value, entry.revision) == (b'{"user": "u1"}', revision)  # unchanged
            await kv.purge("noetl.sessions.s1")
        assert logged(secured, "worker-default", "KV_noetl_sessions")

    secured.run(main())


def test_a_worker_cannot_delete_or_purge_streams_or_read_another_pools_commands(secured):
    async def main():
        xid = new_execution_id()
        async with Conn(secured, "admin") as admin:  # a command for pool "other", which has no worker here
            await admin.js.publish(f"noetl.cmd.other.{xid}", b'{"command_id": "c"}', stream=COMMANDS)
        before = {s: await stream_state(secured, s) for s in (EVENTS, COMMANDS)}
        async with Conn(secured, "worker-default") as worker:
            await worker.refused(worker.js.delete_stream(EVENTS), f"$JS.API.STREAM.DELETE.{EVENTS}")
            await worker.refused(worker.js.purge_stream(COMMANDS), f"$JS.API.STREAM.PURGE.{COMMANDS}")
            await worker.refused(worker.js.purge_stream(EVENTS), f"$JS.API.STREAM.PURGE.{EVENTS}")
            await worker.refused(worker.js.add_consumer(COMMANDS, ConsumerConfig(
                durable_name="pool-other", filter_subject="noetl.cmd.other.*")), "pool-other")
            await worker.refused(worker.js.add_consumer(COMMANDS, ConsumerConfig(  # nor a lane of it
                durable_name="lane-other-p0", filter_subject="noetl.cmd.other.*.0")), "lane-other-p0")
            await worker.refused(worker.js.add_consumer(COMMANDS, ConsumerConfig(filter_subject="noetl.cmd.>")),
                                 f"$JS.API.CONSUMER.CREATE.{COMMANDS}")
            await worker.refused(worker.js.delete_consumer(EVENTS, "event-recorder"), "CONSUMER.DELETE")
        other = await Bus.connect(secured.nats_url, "other-pool", secured.auth.file("worker-other"))
        try:  # that pool's own worker reads it, as the worker service does
            sub = await other.durable(COMMANDS, "pool-other", pool_filter("other"), max_ack_pending=10)
            [msg] = await sub.fetch(1, timeout=5)
            assert loads(msg.data) == {"command_id": "c"}
            await msg.ack()
        finally:
            await other.close()
        after = {s: await stream_state(secured, s) for s in (EVENTS, COMMANDS)}
        assert after[EVENTS].messages >= before[EVENTS].messages  # not purged (the stack may still write)
        assert before[COMMANDS].messages >= 1
        assert logged(secured, "worker-default", f"$JS.API.STREAM.DELETE.{EVENTS}")

    secured.run(main())


def test_a_worker_cannot_point_its_own_durables_at_another_pools_commands(secured):
    """A worker creates its pool's durables, and only with their own filters: the API subject it may
    use names the filter, and the server refuses a body that asks for another one. Pool "other" has no
    worker here, so no consumer of its lanes exists that the work queue would make conflict."""
    async def main():
        xid = new_execution_id()
        async with Conn(secured, "admin") as admin:
            await admin.js.publish(command_subject("other", xid, 0), b'{"command_id": "c0"}', stream=COMMANDS)
        own, theirs = lane_filter("default", 0), lane_filter("other", 0)

        def body(name: str, filter_subject: str) -> bytes:
            return dumps({"stream_name": COMMANDS, "config": {"durable_name": name, "name": name, "ack_policy": "explicit",
                                                               "filter_subject": filter_subject}})

        async with Conn(secured, "worker-default") as worker:
            async def ask(subject: str, data: bytes) -> dict:
                return loads((await worker.nc.request(f"$JS.API.CONSUMER.{subject}", data, timeout=5)).data)

            create = f"$JS.API.CONSUMER.CREATE.{COMMANDS}"
            # the subject that does not name the filter (the server never compares the body with it)
            await worker.refused(worker.nc.request(f"$JS.API.CONSUMER.DURABLE.CREATE.{COMMANDS}.lane-default-p0",
                                                   body("lane-default-p0", theirs), timeout=TIMEOUT), "DURABLE.CREATE")
            await worker.refused(worker.nc.request(f"{create}.lane-default-p0", body("lane-default-p0", theirs),
                                                   timeout=TIMEOUT), f"{create}.lane-default-p0\"")
            # its own subject, another filter or another name in the body: the server refuses them
            assert "error" in await ask(f"CREATE.{COMMANDS}.lane-default-p0.{own}", body("lane-default-p0", theirs))
            assert "error" in await ask(f"CREATE.{COMMANDS}.lane-default-p0.{own}", body("lane-other-p0", own))
            # a wider filter, or another pool's, in the subject
            for wider in ("noetl.cmd.*.*.0", "noetl.cmd.>", theirs):
                await worker.refused(worker.nc.request(f"{create}.lane-default-p0.{wider}", body("lane-default-p0", wider),
                                                       timeout=TIMEOUT), f"{create}.lane-default-p0.{wider}")
        async with Conn(secured, "admin") as admin:
            assert (await admin.js.consumer_info(COMMANDS, "lane-default-p0")).config.filter_subject == own
            assert {c.name for c in await admin.js.consumers_info(COMMANDS)}.isdisjoint({"lane-other-p0"})
        other = await Bus.connect(secured.nats_url, "other-pool", secured.auth.file("worker-other"))
        try:  # the command is still there for that pool's own worker
            sub = await other.durable(COMMANDS, lane_durable("other", 0), theirs, max_ack_pending=10)
            [msg] = await sub.fetch(1, timeout=5)
            assert loads(msg.data) == {"command_id": "c0"}
            await msg.ack()
        finally:
            await other.close()

    secured.run(main())


def test_a_worker_cannot_make_the_server_or_a_service_deliver_its_bytes_where_it_may_not_publish(secured):
    """No consumer of the payload store (a push consumer delivers whatever it reads to any subject its
    creator names), and no service answers a request at a reply subject that is not an inbox (NATS lets
    a responder publish there past its own permissions)."""
    async def main():
        async with Conn(secured, "worker-default") as worker:
            heard: list = []

            async def hear(msg) -> None:
                heard.append(msg)

            await worker.nc.subscribe("noetl.cancel.forged1", cb=hear)
            config = {"stream_name": "OBJ_noetl_payloads", "config": {
                "deliver_subject": "noetl.q.catalog.register", "deliver_group": "event-recorder",
                "ack_policy": "none", "filter_subject": "$O.noetl_payloads.C.x"}}
            for api in ("$JS.API.CONSUMER.CREATE.OBJ_noetl_payloads",
                        "$JS.API.CONSUMER.CREATE.OBJ_noetl_payloads.x.$O.noetl_payloads.C.x",
                        "$JS.API.CONSUMER.DURABLE.CREATE.OBJ_noetl_payloads.x"):
                await worker.refused(worker.nc.request(api, dumps(config), timeout=TIMEOUT), api)
            # a request it may send, answered (before) at the reply subject it named
            await worker.nc.publish("noetl.q.users.standing", dumps({"user_id": "u1"}), reply="noetl.cancel.forged1")
            await worker.nc.flush()
            answered = await worker.nc.request("noetl.q.users.standing", dumps({"user_id": "u1"}), timeout=5)
            assert "exists" in loads(answered.data) or "error" in loads(answered.data)  # an inbox: answered
            await asyncio.sleep(0.5)
            assert heard == []

    secured.run(main())


def test_the_gateway_cannot_publish_a_command_purge_or_bootstrap_sessions(secured):
    async def main():
        xid = new_execution_id()
        before = {s: await stream_state(secured, s) for s in (EVENTS, COMMANDS)}
        async with Conn(secured, "gateway") as gateway:
            await gateway.refused(gateway.js.publish(f"noetl.cmd.default.{xid}", b"{}", stream=COMMANDS),
                                  f"noetl.cmd.default.{xid}")
            await gateway.refused(gateway.js.purge_stream(EVENTS), f"$JS.API.STREAM.PURGE.{EVENTS}")
            await gateway.refused(gateway.js.purge_stream(COMMANDS), f"$JS.API.STREAM.PURGE.{COMMANDS}")
            await gateway.refused(gateway.js.delete_consumer(EVENTS, "router-all-p0"), "CONSUMER.DELETE")
            await gateway.refused(gateway.nc.request("noetl.q.sessions.bootstrap", b"{}", timeout=TIMEOUT),
                                  "noetl.q.sessions.bootstrap")
            finished = make_event("workflow.finished", xid, event_id="forged-4", source="router")
            await gateway.refused(gateway.js.publish(f"noetl.evt.router.ctl.{xid}", dumps([finished]), stream=EVENTS),
                                  f"noetl.evt.router.ctl.{xid}")
        after = {s: await stream_state(secured, s) for s in (EVENTS, COMMANDS)}
        assert after[COMMANDS].last_seq == before[COMMANDS].last_seq
        assert after[EVENTS].first_seq == before[EVENTS].first_seq  # nothing purged
        assert logged(secured, "gateway", f"$JS.API.STREAM.PURGE.{EVENTS}")

    secured.run(main())


def test_setup_moves_an_events_stream_of_the_earlier_layout(fresh_nats, caplog):
    """A stream made by an earlier version (``noetl.evt.<class>.<execution>``, no writer) takes the
    writer layout in place: same partitions, earlier messages kept; a stream noetl did not make is refused."""
    from nats.js.api import StreamConfig, SubjectTransform

    async def main():
        bus = await Bus.connect(fresh_nats.url, "upgrade")
        try:
            old = "noetl.pevt.{{partition(4,2)}}.{{wildcard(1)}}.{{wildcard(2)}}"
            await bus.js.add_stream(StreamConfig(name=EVENTS, subjects=["noetl.evt.*.*"],
                                                 subject_transform=SubjectTransform(src="noetl.evt.*.*", dest=old)))
            await bus.js.publish("noetl.evt.ctl.x1", b"[]", stream=EVENTS)
            with caplog.at_level(logging.WARNING, logger="noetl.bus"):
                await bus.setup(partitions=16)
            assert bus.partitions == 4  # the stream's, not the argument
            assert any("subject layout of an earlier version" in r.getMessage() for r in caplog.records)
            await bus.publish_event(make_event("execution.cancelled", "x1", event_id="c1", source="gateway"))
            first, second = [await bus.js.get_msg(EVENTS, seq) for seq in (1, 2)]
            assert first.subject.rsplit(".", 1)[0] == second.subject.rsplit(".", 2)[0]  # same partition
            assert second.subject.endswith(".ctl.x1.gateway")
            assert await bus.first_seq("x1", int(second.subject.split(".")[2])) == 2  # the control plane's view
            await bus.setup()  # again: nothing to do
            await bus.js.delete_stream(EVENTS)
            await bus.js.add_stream(StreamConfig(name=EVENTS, subjects=["elsewhere.>"]))
            with pytest.raises(ValueError, match="it was not made by noetl"):
                await bus.setup()
        finally:
            await bus.close()

    asyncio.run(main())


def test_wrong_credentials_fail_at_once_with_a_clear_error(secured, tmp_path):
    """A server that is away is waited for; one that refuses the credentials is a settings mistake:
    connecting fails at once, naming the credentials, instead of retrying forever."""
    from noetl_mesh.infra.bus import NatsRefused
    from noetl_mesh.infra.nats_auth import NatsAuth

    stranger = NatsAuth(tmp_path / "other").ensure()  # well-formed keys this server does not know

    async def main():
        started = time.monotonic()
        with pytest.raises(NatsRefused, match="refused the connection") as exc:
            await Bus.connect(secured.stack.settings.nats_url, "stranger", stranger.for_service("worker"))
        assert time.monotonic() - started < 10
        return str(exc.value)

    message = secured.run(main())
    assert "nats-security.md" in message and "other" in message


def test_only_the_admin_asks_services_and_none_answers_for_another(secured):
    """NATS micro services (infra/micro.py): a service may not ask `$SRV` (the gateway: pings of the
    control plane only), nor listen on another service's `$SRV` subjects to answer for it."""
    async def main():
        async with Conn(secured, "worker-default") as worker:
            await worker.refused(worker.nc.request("$SRV.PING", b"", timeout=TIMEOUT), "$SRV.PING")
            for subject in ("$SRV.PING.noetl-router", "$SRV.INFO.noetl-router.>", "$SRV.>", "$SRV.STATS.noetl-worker-other"):
                await worker.nc.subscribe(subject)
            await worker.nc.flush()
            await asyncio.sleep(0.2)
            for subject in ("$srv.ping.noetl-router", "$srv.info.noetl-router.>", "$srv.>", "$srv.stats.noetl-worker-other"):
                assert any(f'subscription to "{subject}"' in e.lower() for e in worker.errors), (subject, worker.errors)
        async with Conn(secured, "gateway") as gateway:
            answer = await gateway.nc.request("$SRV.PING.noetl-router", b"", timeout=5)  # its readiness
            assert loads(answer.data)["name"] == "noetl-router"
            await gateway.refused(gateway.nc.request("$SRV.INFO.noetl-router", b"", timeout=TIMEOUT),
                                  "$SRV.INFO.noetl-router")
            await gateway.refused(gateway.nc.request("$SRV.PING", b"", timeout=TIMEOUT), "$SRV.PING")
        async with Conn(secured, "admin") as admin:  # the operator's tools: every service answers
            answer = await admin.nc.request("$SRV.STATS.noetl-worker-default", b"", timeout=5)
            assert loads(answer.data)["metadata"]["pool"] == "default"
        assert logged(secured, "worker-default", "$SRV.PING")

    secured.run(main())


def test_noetl_ps_and_inspect_with_a_services_credentials_are_refused_clearly(secured, capsys):
    from noetl_mesh.cli import main

    worker = secured.auth.file("worker-default")
    assert main(["inspect", "streams", "--nats-url", secured.nats_url, "--nats-creds", worker, "--timeout", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("noetl: NATS refused STREAM.LIST: ") and "use the admin's credentials" in err, err
    assert main(["ps", "--nats-url", secured.nats_url, "--nats-creds", worker, "--wait", "0.5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("noetl: NATS refused $SRV.STATS: ") and err.count("\n") == 1, err


def test_only_the_credentials_service_answers_credential_subjects(secured):
    """The credential store left the event-recorder: its user can no longer listen on the credential
    subjects (nor anyone but the credentials service); a worker may ask resolutions on its own pool's
    subject only, nothing else of the store; the gateway asks the store's API, never a resolution; and the
    credentials service answers to an inbox only (a request naming another reply subject gets nothing)."""
    async def main():
        async with Conn(secured, "event-recorder") as recorder:
            for subject in ("noetl.q.credential.get", "noetl.q.credential.resolve.default", "noetl.q.credential.>"):
                await recorder.nc.subscribe(subject, queue="event-recorder")
            await recorder.nc.flush()
            await asyncio.sleep(0.2)
            for subject in ("noetl.q.credential.get", "noetl.q.credential.resolve.default", "noetl.q.credential.>"):
                assert any(f'subscription to "{subject}"' in e.lower() for e in recorder.errors), (subject, recorder.errors)
        async with Conn(secured, "worker-default") as worker:
            for subject in ("noetl.q.credential.get", "noetl.q.credential.list", "noetl.q.credential.resolve",
                            "noetl.q.credential.resolve.other"):
                await worker.refused(worker.nc.request(subject, b'{"name": "x", "include_data": true}',
                                                       timeout=TIMEOUT), subject)
            answer = await worker.nc.request("noetl.q.credential.resolve.default", b'{"names": ["x"]}', timeout=5)
            assert loads(answer.data)["error"]["kind"] == "bad_request"  # answered: refused for naming no command
            # an answer to a subject the worker listens on (every worker hears noetl.cancel.*): none comes
            heard = []

            async def hear(msg):
                heard.append(msg)

            sub = await worker.nc.subscribe("noetl.cancel.stolen", cb=hear)
            await worker.nc.publish("noetl.q.credential.resolve.default", b'{"names": ["x"]}', reply="noetl.cancel.stolen")
            await worker.nc.flush()
            await asyncio.sleep(0.5)
            await sub.unsubscribe()
            assert heard == []
        async with Conn(secured, "gateway") as gateway:
            await gateway.refused(gateway.nc.request("noetl.q.credential.resolve.default", b"{}", timeout=TIMEOUT),
                                  "noetl.q.credential.resolve.default")
            listed = await gateway.nc.request("noetl.q.credential.list", b"{}", timeout=5)
            assert isinstance(loads(listed.data), list)
        assert logged(secured, "event-recorder", "noetl.q.credential.get")
        assert logged(secured, "worker-default", "noetl.q.credential.resolve.other")

    secured.run(main())
