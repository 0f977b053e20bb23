"""The ``nats`` tool without a NATS server: reading a task (operations, servers, credentials from the
keychain only, payloads), the playbook's static check, and the destination guard (D33) -- a refusal
before any connection, the engine's own NATS closed whatever the allow-list says, only checked
addresses dialed and never a server a cluster announces. Against real servers:
tests/integration/test_nats_tool.py."""
from __future__ import annotations

import asyncio
import base64
import json
import pytest

from noetl_mesh import limits
from noetl_mesh.lang.validate import validate
from noetl_mesh.sandbox.policy import Policy, parse_destinations
from noetl_mesh.tools import default_tools
from noetl_mesh.tools.base import ToolContext
from noetl_mesh.tools.nats import NatsTool, _BadTask, decode, encode, parse

pytestmark = pytest.mark.timeout(60)


def ctx(keychain: dict | None = None) -> ToolContext:
    return ToolContext(execution_id="e1", step="s", task_name="t", keychain=keychain or {})


def bad(task: dict, keychain: dict | None = None) -> str:
    with pytest.raises(_BadTask) as e:
        parse(task, keychain)
    return str(e.value)


# ================================================================================= reading a task


def test_a_task_reads_its_operation_servers_and_fields():
    r = parse({"operation": "request", "servers": ["nats://a.example:4333", "tls://b.example"], "subject": "svc.echo",
               "data": {"q": 1}, "headers": {"X-N": 2, "X-S": "s", "gone": None}, "timeout": 5})
    assert r.operation == "request" and r.subject == "svc.echo" and r.timeout == 5
    assert [(s.scheme, s.host, s.port) for s in r.servers] == [("nats", "a.example", 4333), ("tls", "b.example", 4222)]
    assert r.payload == b'{"q":1}' and r.headers == {"X-N": "2", "X-S": "s"}
    assert [str(s) for s in parse({"operation": "publish", "url": "h1:1, [::1]:2,h3", "subject": "x"}).servers] == [
        "nats://h1:1", "nats://[::1]:2", "nats://h3:4222"]
    r = parse({"operation": "kv_put", "url": "n", "bucket": "b", "key": "k", "value": [1, "a"]})
    assert r.payload == b'[1,"a"]'


@pytest.mark.parametrize("task, said", [
    ({"url": "n"}, "nats task needs 'operation', one of publish, request"),
    ({"url": "n", "operation": "subscribe"}, "got 'subscribe'"),
    ({"operation": "publish", "subject": "x"}, "nats task needs 'url' (alias 'servers')"),
    ({"operation": "publish", "url": "n"}, "nats publish needs 'subject'"),
    ({"operation": "kv_put", "url": "n", "bucket": "b"}, "nats kv_put needs 'key' and 'data'"),
    ({"operation": "object_get", "url": "n", "key": "k"}, "nats object_get needs 'bucket'"),
    ({"operation": "publish", "url": "http://n:80", "subject": "x"}, "the scheme must be nats:// or tls://"),
    ({"operation": "publish", "url": "nats://n:80/path", "subject": "x"}, "is not host:port"),
    ({"operation": "publish", "url": "nats://u:pw@n:4222", "subject": "x"},
     "a server URL may not carry a user or password: put the credentials in a keychain entry"),
    ({"operation": "publish", "url": " , ", "subject": "x"}, "'url' names no server"),
    ({"operation": "publish", "url": {"h": 1}, "subject": "x"}, "'url' must be a URL"),
    ({"operation": "publish", "url": "n", "subject": "a b"}, "'subject' 'a b' has white space"),
    ({"operation": "publish", "url": "n", "subject": ["x"]}, "'subject' must be text, got list"),
    ({"operation": "publish", "url": "n", "subject": "x", "headers": "h"}, "'headers' must be a mapping"),
    ({"operation": "publish", "url": "n", "subject": "x", "encoding": "utf-16"}, "'encoding' must be one of json"),
    ({"operation": "publish", "url": "n", "subject": "x", "encoding": "base64", "data": "%%"}, "'data' is not base64"),
    ({"operation": "publish", "url": "n", "subject": "x", "timeout": "soon"}, "'timeout' must be seconds"),
])
def test_a_bad_task_says_which_field_and_why(task, said):
    assert said in bad(task)


def test_credentials_come_from_the_keychain_entry_auth_names_and_only_from_there():
    keychain = {
        "up": {"username": "alice", "password": "pw-1234", "url": "nats://kc.example:4111"},
        "tok": {"data": {"token": "tok-5678"}},
        "seed": {"nkey_seed": "SUAM..."},
        "creds": {"creds": "-----BEGIN NATS USER JWT-----"},
        "two": {"user": "a", "password": "p", "token": "t"},
        "half": {"user": "a"},
        "odd": {"password": 12345},
        "legacy": {"nats_url": "nats://old.example", "nats_user": "bob", "nats_password": "pw-legacy"},
    }
    r = parse({"operation": "publish", "auth": "up", "subject": "x"}, keychain)
    assert r.credentials == {"user": "alice", "password": "pw-1234"} and str(r.servers[0]) == "nats://kc.example:4111"
    assert r.secrets() == ["pw-1234"]
    r = parse({"operation": "publish", "auth": "tok", "url": "nats://task.example", "subject": "x"}, keychain)
    assert r.credentials == {"token": "tok-5678"} and r.servers[0].host == "task.example"  # the task's url wins
    assert parse({"operation": "publish", "auth": "seed", "url": "n", "subject": "x"}, keychain).credentials == {
        "nkeys_seed_str": "SUAM..."}
    assert parse({"operation": "publish", "auth": "creds", "url": "n", "subject": "x"}, keychain).credentials == {
        "user_credentials": "-----BEGIN NATS USER JWT-----"}
    r = parse({"operation": "publish", "auth": "legacy", "subject": "x"}, keychain)  # NoETL's field names
    assert r.credentials == {"user": "bob", "password": "pw-legacy"} and r.servers[0].host == "old.example"
    task = {"operation": "publish", "url": "n", "subject": "x"}
    assert "auth 'nope' names no keychain entry" in bad({**task, "auth": "nope"}, keychain)
    assert "'auth' must name a keychain entry (D24)" in bad({**task, "auth": {"token": "inline"}}, keychain)
    assert "gives user/password and token: give one way" in bad({**task, "auth": "two"}, keychain)
    assert "a user needs a password" in bad({**task, "auth": "half"}, keychain)
    assert "'password' must be text, got int" in bad({**task, "auth": "odd"}, keychain)


def test_what_is_sent_and_what_is_read():
    assert encode("héllo", "json") == "héllo".encode() and encode(None, "json") == b""
    assert encode({"a": [1, None]}, "text") == b'{"a":[1,null]}' and encode(7, "json") == b"7"
    assert encode(base64.b64encode(b"\x00\xff").decode(), "base64") == b"\x00\xff"
    assert decode(b'{"a": 1}', "json") == {"a": 1} and decode(b'{"a": 1}', "text") == '{"a": 1}'
    assert decode(b"plain", "json") == "plain" and decode(b"", "json") is None
    assert decode(b"\xff\x00", "json") == base64.b64encode(b"\xff\x00").decode()  # not UTF-8: base64
    assert decode(b"abc", "base64") == "YWJj"


def test_data_over_the_result_limit_is_refused_before_connecting():
    async def main():
        with limits.override(max_result_bytes=1024):
            return await NatsTool(resolver=never_resolves).run(
                {"operation": "object_put", "url": "nats://n.example", "bucket": "b", "key": "k", "data": "x" * 2000},
                {}, ctx())

    out = asyncio.run(main())
    assert out["status"] == "error" and out["error"]["kind"] == "limit_exceeded", out
    said = out["error"]["message"]
    assert "the data of a nats object_put is 2.0 KiB, over the limit max_result_bytes = 1 KiB" in said


def test_a_bad_task_is_invalid_task_naming_step_and_task():
    out = asyncio.run(NatsTool().run({"operation": "kv_get", "url": "n", "bucket": "b"}, {}, ctx()))
    assert out["error"] == {"kind": "invalid_task", "retryable": False,
                            "message": "step 's', task 't': nats kv_get needs 'key'"}


def test_the_playbook_check_knows_the_kind_and_its_operations():
    def check(tool: dict) -> list[str]:
        doc = {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "p", "path": "p"},
               "workflow": [{"step": "start", "tool": tool}]}
        return [d.message for d in validate(doc).errors]

    assert check({"kind": "nats", "operation": "kv_get", "url": "nats://h", "bucket": "b", "key": "k"}) == []
    assert check({"kind": "nats", "operation": "{{ workload.op }}", "servers": ["nats://h"], "subject": "s"}) == []
    assert "operation 'kv_gett' is not one of publish" in check({"kind": "nats", "operation": "kv_gett", "url": "h"})[0]
    assert "encoding 'hex' is not one of json, text, base64" in check(
        {"kind": "nats", "operation": "publish", "url": "h", "subject": "s", "encoding": "hex"})[0]
    assert check({"kind": "nats", "operation": "publish", "url": "h", "subject": "s", "password": "inline"}) == [
        "unknown key 'password'"]  # credentials: a keychain entry named by auth


def test_the_worker_registry_has_the_kind_under_the_pools_policy():
    policy = Policy(allow=parse_destinations("10.0.0.0/8"))

    async def main():
        tools = default_tools(policy=policy)
        try:
            return tools["nats"]
        finally:
            from noetl_mesh.tools import close_tools

            await close_tools(tools)

    assert asyncio.run(main())._policy is policy


# ===================================================================================== destinations


async def never_resolves(host: str, port: int) -> list[str]:
    raise AssertionError(f"resolved {host}")


class Names:
    def __init__(self, names: dict[str, list[str]]):
        self.names, self.asked = names, []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append(host)
        return self.names[host]


def refused(out: dict) -> str:
    assert out["status"] == "error" and out["error"]["kind"] == "sandbox" and out["error"]["retryable"] is False, out
    return out["error"]["message"]


@pytest.mark.parametrize("url, said", [
    ("nats://127.0.0.1:4222", "nats task refused: 127.0.0.1 is a loopback address, closed to tasks on this worker "
                              "pool (D33); open it with NOETL_SANDBOX_ALLOW_NET=127.0.0.1:4222"),
    ("nats://[::1]:4222", "nats task refused: ::1 is a loopback address"),
    ("nats://169.254.169.254", "nats task refused: 169.254.169.254 is a cloud metadata address"),
    ("nats://sneaky.example:4222", "nats task refused: sneaky.example:4222 resolves to 127.0.0.1: 127.0.0.1 is a "
                                   "loopback address"),
])
def test_closed_destinations_are_refused_before_any_connection(url, said):
    out = asyncio.run(NatsTool(resolver=Names({"sneaky.example": ["127.0.0.1"]})).run(
        {"operation": "publish", "url": url, "subject": "x"}, {}, ctx()))
    assert refused(out).startswith(said)


def test_the_engines_own_nats_stays_closed_whatever_the_allow_list_says():
    policy = Policy(allow=parse_destinations("127.0.0.0/8")).with_engine_endpoints([("127.0.0.1", 4222)])
    out = asyncio.run(NatsTool(policy=policy, resolver=Names({"localhost": ["127.0.0.1"]})).run(
        {"operation": "kv_get", "servers": "nats://localhost:4222", "bucket": "b", "key": "k"}, {}, ctx()))
    assert refused(out).endswith("127.0.0.1:4222 is the engine's own NATS server, closed to tasks on this worker pool "
                                 "(D33); it stays closed whatever NOETL_SANDBOX_ALLOW_NET says")


class FakeNats:
    """Just enough of a NATS server on loopback: INFO (announcing ``announce`` as cluster peers), PONG
    for every PING, OK for publishes; with ``hang_up``, the connection is closed at the first PING after
    CONNECT's (the server going away, where a reconnecting client would dial the announced peers); with
    ``reply``, every request is answered with that many bytes (announced, then sent in chunks while the
    client reads them)."""

    def __init__(self, announce: list[str] | None = None, hang_up: bool = False, reply: int = 0):
        self.announce, self.hang_up, self.reply = announce or [], hang_up, reply
        self.sent = 0
        self.connections = 0
        self.received = b""

    async def start(self) -> "FakeNats":
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        info = {"server_id": "FAKE", "version": "2.10.0", "go": "go", "host": "127.0.0.1", "port": self.port,
                "max_payload": 1048576, "proto": 1, "headers": True, "connect_urls": self.announce}
        writer.write(b"INFO " + json.dumps(info).encode() + b"\r\n")
        await writer.drain()
        pings, sids = 0, {}
        try:
            while line := await reader.readline():
                self.received += line
                words = line.split()
                if words[:1] == [b"SUB"]:
                    sids[words[1]] = words[-1]
                if words[:1] == [b"PUB"] and len(words) == 4 and self.reply:  # PUB subject reply size
                    await reader.readline()
                    inbox = words[2]
                    sid = next(s for p, s in sids.items() if inbox.startswith(p.rstrip(b"*")))
                    writer.write(b"MSG %s %s %d\r\n" % (inbox, sid, self.reply))
                    chunk = b"x" * 65536
                    while self.sent < self.reply:
                        writer.write(chunk[:self.reply - self.sent])
                        self.sent += min(len(chunk), self.reply - self.sent)
                        await writer.drain()
                    writer.write(b"\r\n")
                    continue
                if line.startswith(b"PING"):
                    pings += 1
                    if self.hang_up and pings > 1:
                        break
                    writer.write(b"PONG\r\n")
                    await writer.drain()
        finally:
            writer.close()

    async def stop(self) -> None:
        self.server.close()
        await self.server.wait_closed()


def test_only_checked_addresses_are_dialed_and_a_clusters_announced_servers_never_are():
    async def main():
        elsewhere = await FakeNats().start()  # opened too: only announced, so dialing it would be unchecked
        announce = [f"127.0.0.1:{elsewhere.port}"]
        fine, hangs = await FakeNats(announce).start(), await FakeNats(announce, hang_up=True).start()
        opened = ",".join(f"127.0.0.1:{s.port}" for s in (fine, hangs, elsewhere))
        names = Names({"nats.example": ["169.254.169.254", "127.0.0.1"]})
        tool = NatsTool(policy=Policy(allow=parse_destinations(opened)), resolver=names)
        try:
            sent = await tool.run({"operation": "publish", "url": f"nats://nats.example:{fine.port}", "subject": "a.b",
                                   "data": "hi"}, {"timeout": 5}, ctx())
            gone = await tool.run({"operation": "publish", "url": f"nats://127.0.0.1:{hangs.port}", "subject": "a.b"},
                                  {"timeout": 3}, ctx())
            await asyncio.sleep(0.3)
            return sent, gone, fine, hangs, elsewhere, names
        finally:
            for s in (fine, hangs, elsewhere):
                await s.stop()

    sent, gone, fine, hangs, elsewhere, names = asyncio.run(main())
    # the metadata address of the name is left out, its loopback one (opened) dialed by address
    assert names.asked == ["nats.example"] and fine.connections == 1
    assert sent == {"status": "ok", "result": {"subject": "a.b", "bytes": 2}, "error": None}
    assert b"PUB a.b  2\r\nhi\r\n" in fine.received
    assert b'"echo": false' in fine.received  # no_echo: its own messages never come back
    # the server went away in the middle: an error, and the peers it announced are never dialed
    assert gone["error"]["kind"] == "nats_error" and gone["error"]["retryable"] is True, gone
    assert gone["error"]["message"].startswith(f"nats publish on nats://127.0.0.1:{hangs.port}: the server closed "
                                               "the connection")
    assert hangs.connections == 1 and elsewhere.connections == 0


@pytest.mark.parametrize("size, read", [(300 * 1024, "the reply"),
                                        (16 * 1024 * 1024, "a message the server sent; reading stopped there")])
def test_a_reply_bigger_than_the_result_limit_is_refused_and_a_huge_one_never_held_whole(size, read):
    """Limit 256 KiB: a reply of 300 KiB is read, then refused; one of 16 MiB -- more than any server's
    max_payload should allow -- is not even read: the client's reader stops at 1 MiB and hangs up."""
    async def main():
        server = await FakeNats(reply=size).start()
        try:
            with limits.override(max_result_bytes=256 * 1024):
                out = await NatsTool(policy=Policy(allow=parse_destinations(f"127.0.0.1:{server.port}"))).run(
                    {"operation": "request", "url": f"nats://127.0.0.1:{server.port}", "subject": "svc"},
                    {"timeout": 10}, ctx())
            return out, server.sent
        finally:
            await server.stop()

    out, sent = asyncio.run(main())
    assert out["status"] == "error" and out["error"]["kind"] == "result_too_large", out
    assert f"({read})" in out["error"]["message"]
    if size > 1024 * 1024:
        assert sent < size  # the connection was closed while the server was still sending


def test_a_server_that_does_not_answer_is_a_retryable_connect_error():
    import socket

    with socket.socket() as s:  # a port with nothing behind it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = asyncio.run(NatsTool(policy=Policy(allow=parse_destinations(f"127.0.0.1:{port}"))).run(
        {"operation": "publish", "url": f"nats://127.0.0.1:{port}", "subject": "x"}, {"timeout": 5}, ctx()))
    assert out["error"]["kind"] == "nats_connect_error" and out["error"]["retryable"] is True, out
    assert out["error"]["message"].startswith(f"nats publish: cannot connect: nats://127.0.0.1:{port} (127.0.0.1): ")
    assert "Connect call failed" in out["error"]["message"]  # the reason, not only "no servers"
