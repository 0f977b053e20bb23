"""Hostile requests to the gateway, over a real HTTP server in front of a whole stack (real NATS and
Postgres): each is answered with a 4xx that says what is wrong and where (never a 5xx), and a normal
execution submitted right after still completes."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
import subprocess
import sys
import threading
import time
from typing import Any, Iterator

import httpx
import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import LoopThread, StackHandle, stop_stack
from noetl_mesh import limits
from noetl_mesh.client import GatewayClient, GatewayError, retry_after
from noetl_mesh.infra.bus import Bus
from noetl_mesh.infra.embedded import EmbeddedNats
from noetl_mesh.infra.nats_auth import NatsAuth
from noetl_mesh.services.gateway import app as gateway_app
from noetl_mesh.services.gateway.app import create_app
from noetl_mesh.stack import InProcessStack, Settings, free_port, wait_http
from scenarios import TINY

pytestmark = pytest.mark.integration

USUAL = 30.0  # seconds; a tiny execution normally takes well under one


@pytest.fixture(scope="module", autouse=True)
def _key(throwaway_credential_key) -> None:
    """Credentials written by these tests are encrypted with a throw-away key (no key file)."""


@pytest.fixture(scope="module")
def http(stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, trust_env=False, timeout=60, headers=stack.headers) as client:
        yield client


def detail(resp: httpx.Response) -> dict[str, Any]:
    """The one error shape of the API: ``{"detail": {"message", "location", "errors"}}``."""
    body = resp.json()
    assert set(body) == {"detail"}, body
    assert isinstance(body["detail"]["message"], str) and body["detail"]["message"], body
    assert "location" in body["detail"] and isinstance(body["detail"]["errors"], list), body
    return body["detail"]


def still_normal(stack) -> None:
    """Another execution still completes (the wait's timeout is only a guard against a hang)."""
    status, _ = stack.execute(TINY, timeout=USUAL)
    assert status["status"] == "COMPLETED", status


def post_json_text(http: httpx.Client, url: str, text: str) -> httpx.Response:
    return http.post(url, content=text.encode("utf-8", "surrogatepass"), headers={"content-type": "application/json"})


# ------------------------------------------------------------------------------ size
def test_a_client_that_sends_its_request_slowly_is_cut_off(stack, http):
    """A request line and a header every while, never the end of the headers (slowloris), or whole
    headers and then a body a byte at a time: the gateway closes the connection once
    http_request_seconds have passed, as it closes one that sends nothing; a connection that finished a
    request gets as long again for the next one."""
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(stack.url)
    with limits.override(http_request_seconds=1):
        slow, idle, used, body = (socket.create_connection((url.hostname, url.port), timeout=30) for _ in range(4))
        with slow, idle, used, body:
            slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            body.sendall(b"POST /api/auth/login HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{")
            used.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            answered = used.recv(65536)
            assert answered.startswith(b"HTTP/1.1 200"), answered[:100]
            for _ in range(6):  # a header line (a body byte) every 0.5 s: each within the deadline, the whole never
                for conn, piece in ((slow, b"X-Slow: 1\r\n"), (body, b" ")):
                    try:
                        conn.sendall(piece)
                    except OSError:
                        pass
                time.sleep(0.5)
            def rest(conn: socket.socket) -> bytes:  # until the gateway closes it (not closed: a 30 s timeout)
                data = b""
                while chunk := conn.recv(65536):
                    data += chunk
                return data

            rest(used)  # what is left of its answer (it may come in pieces), then the end
            for conn in (slow, idle, body):
                assert rest(conn) == b"", conn  # closed without an answer
    still_normal(stack)


def test_a_body_over_max_body_bytes_is_413_before_it_is_read(stack, http):
    sent = 0

    def endless() -> Iterator[bytes]:  # 200 MB announced, but the server must stop reading at once
        nonlocal sent
        chunk = b"x" * 50_000
        while sent < 200_000_000:  # exactly the announced length
            sent += len(chunk)
            yield chunk

    resp = http.post("/api/executions", content=endless(),
                     headers={"content-type": "application/json", "content-length": str(200_000_000)})
    assert resp.status_code == 413, resp.text
    msg = detail(resp)["message"]
    assert "max_body_bytes" in msg and "NOETL_LIMIT_MAX_BODY_BYTES" in msg
    # the server answered on the header: what was written is what socket buffers took (a few MB at most)
    assert sent < limits.current().max_body_bytes

    sent = 0
    chunked = http.post("/api/executions", content=endless(), headers={"content-type": "application/json"})
    assert chunked.status_code == 413 and "max_body_bytes" in detail(chunked)["message"]
    assert sent < 2 * limits.current().max_body_bytes  # read up to the limit, then no more
    still_normal(stack)


def test_a_workload_over_max_workload_bytes_is_413(stack, http):
    resp = http.post("/api/executions", json={"playbook": TINY, "workload": {"blob": "x" * 10_000_000}})
    assert resp.status_code == 413, resp.text
    d = detail(resp)
    assert "max_workload_bytes" in d["message"] and "NOETL_LIMIT_MAX_WORKLOAD_BYTES" in d["message"]
    assert d["location"] == "body.workload"
    with limits.override(max_body_bytes=1024):
        small = http.post("/api/executions", json={"playbook": TINY, "workload": {"blob": "x" * 2000}})
        assert small.status_code == 413 and "max_body_bytes = 1 KiB" in detail(small)["message"]
    still_normal(stack)


def test_a_body_of_millions_of_tiny_values_is_413_before_it_is_parsed(stack, http):
    # 15 MiB of empty lists: under max_body_bytes, but about 350 MB of objects once parsed
    text = '{"playbook": "x", "workload": {"a": [' + "[]," * 5_000_000 + '[]]}}'
    resp = http.post("/api/executions", content=text, headers={"content-type": "application/json"}, timeout=USUAL)
    assert resp.status_code == 413, resp.text  # counted on its bytes, never parsed
    assert "max_body_values" in detail(resp)["message"]
    still_normal(stack)


# ------------------------------------------------------------------------------ strict JSON
def test_malformed_json_is_400_with_the_position(stack, http):
    resp = post_json_text(http, "/api/catalog", '{"content": "a",\n  "x": }')
    assert resp.status_code == 400, resp.text
    d = detail(resp)
    assert "line 2, column 8" in d["message"] and d["location"] == "body"
    for url in ("/api/executions", "/api/credentials", "/api/executions/abc/cancel"):
        assert post_json_text(http, url, "{not json").status_code == 400
    still_normal(stack)


@pytest.mark.parametrize("number", [str(2**64), str(2**64 + 1), str(2**63), str(-(2**63) - 1), "1" + "0" * 5000],
                         ids=["2^64", "2^64+1", "2^63", "-2^63-1", "10^5000"])
def test_integers_outside_the_signed_64_bit_range_are_422(stack, http, number):
    text = '{"playbook": %s, "workload": {"n": [1, %s]}}' % (json.dumps(TINY), number)
    resp = post_json_text(http, "/api/executions", text)
    assert resp.status_code == 422, resp.text[:300]
    d = detail(resp)
    assert d["location"] == "body.workload.n[1]" and "64-bit" in d["message"]
    assert len(resp.content) < 2000  # the number is not echoed in full


def test_the_largest_64_bit_integers_are_accepted(stack, http):
    text = '{"playbook": %s, "workload": {"n": [%d, %d]}}' % (json.dumps(TINY), 2**63 - 1, -(2**63))
    assert post_json_text(http, "/api/executions", text).status_code == 202


@pytest.mark.parametrize("depth", [65, 255, 300, 2_000, 100_000])
def test_json_nested_deeper_than_max_json_depth_is_422(stack, http, depth):
    text = '{"playbook": %s, "workload": {"a": %s1%s}}' % (json.dumps(TINY), "[" * depth, "]" * depth)
    resp = post_json_text(http, "/api/executions", text)
    assert resp.status_code == 422, resp.text[:300]
    msg = detail(resp)["message"]
    assert "max_json_depth" in msg and "NOETL_LIMIT_MAX_JSON_DEPTH" in msg


def test_a_lone_surrogate_is_422_with_its_path(stack, http):
    resp = post_json_text(http, "/api/executions",
                          '{"playbook": %s, "workload": {"a": ["ok", "x\\ud800y"]}}' % json.dumps(TINY))
    assert resp.status_code == 422, resp.text
    d = detail(resp)
    assert d["location"] == "body.workload.a[1]" and "surrogate" in d["message"]
    key = post_json_text(http, "/api/executions", '{"playbook": %s, "workload": {"\\udc00": 1}}' % json.dumps(TINY))
    assert key.status_code == 422 and detail(key)["location"] == 'body.workload["\\udc00"]'
    still_normal(stack)


def test_nul_characters_are_422_with_their_path(stack, http):
    resp = post_json_text(http, "/api/executions", '{"path": "tests/tiny", "parent_execution_id": "a\\u0000b"}')
    assert resp.status_code == 422, resp.text
    d = detail(resp)
    assert d["location"] == "body.parent_execution_id" and "NUL" in d["message"]
    key = post_json_text(http, "/api/executions", '{"playbook": %s, "workload": {"k\\u0000": 1}}' % json.dumps(TINY))
    assert key.status_code == 422 and detail(key)["location"] == 'body.workload["k\\u0000"]'
    content = post_json_text(http, "/api/catalog", '{"content": "a\\u0000"}')
    assert content.status_code == 422 and detail(content)["location"] == "body.content"
    still_normal(stack)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity", "1e400", "-1e999"])
def test_non_finite_numbers_are_422(stack, http, constant):
    resp = post_json_text(http, "/api/executions", '{"path": "tests/tiny", "workload": {"x": %s}}' % constant)
    assert resp.status_code == 422, resp.text
    assert detail(resp)["location"] == "body.workload.x"


def test_wrong_content_types_are_415(stack, http):
    for url in ("/api/executions", "/api/credentials", "/api/catalog"):
        resp = http.post(url, content=b"x=1", headers={"content-type": "application/x-www-form-urlencoded"})
        assert resp.status_code == 415, (url, resp.text)
        assert "application/json" in detail(resp)["message"]


def test_undecodable_yaml_is_400(stack, http):
    resp = http.post("/api/catalog", content=b"metadata: {name: caf\xe9}\n", headers={"content-type": "text/yaml"})
    assert resp.status_code == 400, resp.text
    assert "UTF-8" in detail(resp)["message"] and "byte 20" in detail(resp)["message"]


def test_hostile_urls_and_numbers_that_pydantic_would_coerce(stack, http):
    nul_path = http.get("/api/executions/a%00b")
    assert nul_path.status_code == 400 and detail(nul_path)["location"] == "path"
    nul_query = http.get("/api/catalog", params={"path": "a\x00"})
    assert nul_query.status_code == 400 and detail(nul_query)["location"] == "query"
    for url in ("/api/catalog/99999999999999999999999", "/api/executions/x/events?offset=99999999999999999999",
                "/api/catalog/by-path/a?version=99999999999999999999"):
        resp = http.get(url)
        assert resp.status_code == 422, (url, resp.text)
        assert detail(resp)["location"].startswith(("path.", "query."))
    coerced = http.post("/api/executions", json={"catalog_id": "99999999999999999999999"})
    assert coerced.status_code == 422 and detail(coerced)["location"] == "body.catalog_id"
    long_id = http.post("/api/executions", json={"path": "tests/tiny", "parent_execution_id": "x" * 10_000})
    assert long_id.status_code == 422 and detail(long_id)["location"] == "body.parent_execution_id"
    still_normal(stack)


# ------------------------------------------------------------------------------ every error has the shape
def test_every_error_has_one_shape_and_a_request_id(stack, http):
    for resp in (http.get("/api/executions/nope"), http.get("/no/such/route"), http.delete("/api/catalog"),
                 http.get("/api/executions", params={"limit": 0}),
                 http.post("/api/executions", json={"path": "x", "colour": 1})):
        assert 400 <= resp.status_code < 500
        detail(resp)
        assert len(resp.headers["x-request-id"]) >= 16
    fields = detail(http.post("/api/executions", json={"path": "x", "colour": 1}))
    assert fields["location"] == "body.colour" and fields["errors"][0]["type"] == "extra_forbidden"


# ------------------------------------------------------------------------------ the client
def test_the_client_reports_the_gateways_message_and_waits_out_a_503(stack):
    answers: list[int] = []

    async def go() -> None:
        async with GatewayClient(stack.url, token=stack.token) as client:
            client.http.event_hooks["response"].append(lambda resp: _count(resp, answers))
            with pytest.raises(GatewayError) as big:
                await client.start(TINY, workload={"blob": "x" * 5_000_000})
            assert big.value.status == 413 and "max_workload_bytes" in big.value.message
            assert str(big.value).startswith("gateway answered 413: body.workload: the workload (JSON) is 4.8 MiB")
            with pytest.raises(GatewayError) as invalid:
                await client.start(TINY.replace("kind: noop", "kind: nosuchtool"))
            assert invalid.value.status == 422 and invalid.value.message == "invalid playbook"
            assert "nosuchtool" in str(invalid.value) and len(invalid.value.errors) == 3

            recorder = stack.stack.services("event-recorder")[0]
            await recorder.stop()  # reads answer 503 (Retry-After: 1) until it is back
            try:
                execution_id = await client.start(TINY)  # published: recorded once the recorder is back
                waiting = asyncio.create_task(client.wait(execution_id, timeout=USUAL))
                await asyncio.sleep(2.5)
                assert not waiting.done()
            finally:
                await recorder.start()
            assert (await waiting)["status"] == "COMPLETED"

    stack.run(go())
    assert 1 <= answers.count(503) <= 6  # one poll a second, as Retry-After asked (not one every 20 ms)


async def _count(resp: httpx.Response, answers: list[int]) -> None:
    answers.append(resp.status_code)


def test_retry_after_reads_seconds_and_dates():
    assert retry_after("2") == 2.0 and retry_after("0.5") == 0.5 and retry_after(None) is None
    assert retry_after("soon") is None and retry_after("-3") == 0.0
    assert 50 < retry_after(time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 60))) <= 60


# ------------------------------------------------------------------------------ heavy playbooks
def big_invalid_playbook(steps: int) -> dict[str, Any]:
    """A long chain whose last step names an unknown tool kind: validated in full, then refused."""
    workflow = [{"step": f"s{i}", "tool": {"kind": "noop", "result": i}, "next": {"arcs": [{"step": f"s{i + 1}"}]}}
                for i in range(steps)]
    workflow.append({"step": f"s{steps}", "tool": {"kind": "nosuchtool"}})
    workflow[0]["step"] = "start"
    return {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "big", "path": "tests/big"},
            "workflow": workflow}


def test_validating_a_big_playbook_does_not_stop_the_gateway(stack, http, monkeypatch):
    """Both forms of a big body (a mapping, YAML text) are validated off the event loop: while both
    validations are held inside the validator, ``/health`` still answers. Holding them, instead of timing
    ``/health`` beside a real validation, makes the check independent of the machine's load: had the
    validation run on the event loop, nothing would answer until it was let go."""
    big = big_invalid_playbook(2_000)
    answers: dict[str, httpx.Response] = {}
    entered = threading.Semaphore(0)
    release = threading.Event()
    real = gateway_app.parse_and_validate

    def held(playbook: Any) -> Any:
        entered.release()
        release.wait(120)  # a guard against a hang only: the test lets it go
        return real(playbook)

    def submit(name: str, body: dict[str, Any]) -> None:
        with httpx.Client(base_url=stack.url, trust_env=False, timeout=300, headers=stack.headers) as client:
            answers[name] = client.post("/api/executions", json=body)

    monkeypatch.setattr(gateway_app, "parse_and_validate", held)
    workers = [threading.Thread(target=submit, args=("mapping", {"playbook": big})),
               threading.Thread(target=submit, args=("text", {"playbook": yaml.safe_dump(big)}))]
    try:
        with limits.override(max_steps=5_000):  # validated in full, not refused for its length
            for w in workers:
                w.start()
            assert entered.acquire(timeout=120) and entered.acquire(timeout=120), "the validations never began"
            assert http.get("/health").status_code == 200  # both are still held
            assert all(w.is_alive() for w in workers) and not answers
            release.set()
            for w in workers:
                w.join(300)
    finally:
        release.set()
    for name, resp in answers.items():
        assert resp.status_code == 422, (name, resp.text[:300])
        assert any("nosuchtool" in e["message"] for e in detail(resp)["errors"])
    assert set(answers) == {"mapping", "text"}
    still_normal(stack)


BOMB = "apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {name: laughs, path: tests/laughs}\nworkload:\n" + "".join(
    f"  {name}: &{name} [{', '.join([f'*{prev}'] * 9) if prev else ', '.join(['lol' * 16] * 9)}]\n"
    for prev, name in zip(["", *[f"lol{i}" for i in range(1, 10)]], [f"lol{i}" for i in range(1, 11)])
) + "workflow:\n  - step: start\n    tool: {kind: noop, result: '{{ workload }}'}\n"


@contextlib.contextmanager
def gateway_process(nats_url: str, creds: str | None = None, max_memory: int = 3 * 2**30) -> Iterator[str]:
    """A gateway of its own (``noetl service gateway``) whose address space is capped: should a
    document ever be expanded again, that process fails, not the shared machine."""
    port = free_port()

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (max_memory, max_memory))

    proc = subprocess.Popen([sys.executable, "-m", "noetl_mesh.cli", "service", "gateway", "--nats-url", nats_url,
                             "--host", "127.0.0.1", "--port", str(port), *(["--nats-creds", creds] if creds else [])],
                            preexec_fn=cap,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        asyncio.run(wait_http(f"{url}/health", timeout=60, procs={"gateway": proc}))
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_a_yaml_alias_bomb_is_refused_quickly_and_the_gateway_keeps_answering(stack):
    assert 1200 < len(BOMB) < 1400  # about 1.3 KB; expanded, 9^10 (3.5 billion) strings
    settings = stack.stack.settings
    with gateway_process(settings.nats_url, settings.creds_for("gateway")) as url:
        answer: dict[str, Any] = {}

        def submit() -> None:
            with httpx.Client(base_url=url, trust_env=False, timeout=USUAL, headers=stack.headers) as client:
                try:
                    answer["bomb"] = client.post("/api/executions", json={"playbook": BOMB})
                except httpx.HTTPError as exc:  # the gateway died
                    answer["bomb"] = exc

        bomb = threading.Thread(target=submit)
        bomb.start()

        async def normal() -> dict:  # submitted through the same gateway while the bomb is looked at
            async with GatewayClient(url, token=stack.token) as client:
                return await client.wait(await client.start(TINY), timeout=USUAL)

        assert asyncio.run(normal())["status"] == "COMPLETED"
        bomb.join(USUAL)
        resp = answer["bomb"]
        assert isinstance(resp, httpx.Response), resp
        assert resp.status_code == 422, resp.text[:300]
        assert "alias" in json.dumps(detail(resp)) and "NOETL_LIMIT_MAX_DOCUMENT_" in json.dumps(detail(resp))


# ------------------------------------------------------------------------------ NATS and bugs
def test_a_submission_while_nats_is_down_is_503_with_retry_after(pg_dsn, tmp_path):
    auth = NatsAuth(tmp_path / "creds").ensure()
    nats = EmbeddedNats(store_dir=tmp_path / "js", auth=auth).start()
    port, loop = nats.port, LoopThread()
    settings = Settings(nats_url=nats.url, pg_dsn=pg_dsn, nats_creds=str(auth.directory))
    handle = StackHandle(loop, loop.run(InProcessStack(settings).start()))
    try:
        with httpx.Client(base_url=handle.url, trust_env=False, timeout=60, headers=handle.headers) as http:
            assert http.get("/ready").status_code == 200
            nats.stop()
            resp = http.post("/api/executions", json={"playbook": TINY}, timeout=USUAL)  # as NATS goes away
            assert resp.status_code == 503, resp.text  # an answer, not a hang
            assert resp.headers["retry-after"] == "1" and "NATS" in detail(resp)["message"]
            ready = http.get("/ready")
            assert ready.status_code == 503 and ready.headers["retry-after"] == "1"
            assert ready.json()["nats"]["ok"] is False and ready.json()["recorder"]["ok"] is False
            down = http.post("/api/executions", json={"playbook": TINY})  # while NATS is known to be down
            assert down.status_code == 503 and "NATS is reconnecting" in detail(down)["message"]
            assert http.get("/api/executions").status_code == 503

            nats = EmbeddedNats(store_dir=tmp_path / "js", port=port, auth=auth).start()
            deadline = time.monotonic() + USUAL
            while http.get("/ready").status_code != 200:
                assert time.monotonic() < deadline, http.get("/ready").text
                time.sleep(0.1)
            still_normal(handle)
    finally:
        stop_stack(nats, loop, handle)


def test_an_unexpected_exception_is_500_with_a_logged_request_id(nats_url, caplog):
    async def main() -> httpx.Response:
        bus = await Bus.connect(nats_url, "test-gateway-bug")

        async def broken(*args: Any, **kwargs: Any) -> Any:
            raise ZeroDivisionError("a bug in the shell")

        bus.request = broken  # a defect in the code, not in the request
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(bus)), base_url="http://gw",
                                         headers={"Authorization": "Bearer noetl_t_" + "a" * 43}) as gw:
                return await gw.get("/api/executions")
        finally:
            await bus.close()

    with caplog.at_level(logging.ERROR, logger="noetl.gateway"):
        resp = asyncio.run(main())
    assert resp.status_code == 500
    d = detail(resp)
    assert d["request_id"] == resp.headers["x-request-id"] and d["request_id"] in d["message"]
    assert "ZeroDivisionError" not in resp.text  # the details are in the log, not in the answer
    [record] = [r for r in caplog.records if d["request_id"] in r.getMessage()]
    assert record.exc_info[0] is ZeroDivisionError and "GET /api/executions" in record.getMessage()


# ------------------------------------------------------------------------------ arbitrary bodies
def write_routes(stack) -> list[tuple[str, str]]:
    """Every (method, path) of the gateway that takes a body, read from the app itself (but logout:
    it would end the session the fuzzing uses)."""
    app = stack.stack.services("gateway")[0].app
    out = [(method, route.path) for route in app.routes for method in sorted(getattr(route, "methods", ()) or ())
           if method in ("POST", "PUT", "PATCH", "DELETE") and route.path != "/api/auth/logout"]
    assert len(out) >= 5, out
    return out


text = st.lists(st.characters() | st.sampled_from(["\x00", "\ud800", "\udfff", "\u00e9", "😀", '"', "\\"]),
                max_size=12).map("".join)
numbers = (st.integers(-(2**70), 2**70) | st.floats() | st.sampled_from([2**63, -(2**63) - 1, 2**64, 10**30]))
values = st.recursive(st.none() | st.booleans() | numbers | text,
                      lambda inner: st.lists(inner, max_size=5) | st.dictionaries(text, inner, max_size=5),
                      max_leaves=25)
VALID = [{"playbook": TINY, "workload": {"n": 3}}, {"path": "tests/tiny", "version": 1}, {"catalog_id": 1},
         {"content": TINY}, {"name": "fuzz", "kind": "generic", "data": {"user": "u"}}, {"reason": "enough"},
         {"username": "fuzzed", "password": "fuzzed password", "roles": ["viewer"]}, {"roles": ["viewer"]},
         {"name": "fuzz token", "expires_in": 60}, {"password": "new password 1", "current_password": "x"}]


@st.composite
def mutated(draw) -> Any:
    body = dict(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(1, 3))):
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        if action == "replace" and body:
            body[draw(st.sampled_from(sorted(body)))] = draw(values)
        elif action == "delete" and body:
            body.pop(draw(st.sampled_from(sorted(body))))
        else:
            body[draw(text)] = draw(values)
    return body


def encode(value: Any, ascii_only: bool) -> bytes:
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


bodies = st.one_of(
    st.binary(max_size=300),
    st.builds(encode, values, st.booleans()),
    st.builds(encode, mutated(), st.booleans()),
    st.integers(1, 5_000).map(lambda n: b'{"path": "p", "workload": {"a": ' + b"[" * n + b"]" * n + b"}}"),
    st.integers(1, 3_000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
    st.integers(15, 6_000).map(lambda n: b'{"path": "p", "workload": {"x": -' + b"9" * n + b"}}"),
    st.sampled_from([b"NaN", b'{"path": "p", "workload": {"x": Infinity}}', b'{"content": "a\\u0000"}',
                     b'{"playbook": "a: \\"\\ud800\\""}', b'{"reason": "\\udc00"}', b"\xef\xbb\xbf{}", b""]),
)
content_types = st.sampled_from([None, "application/json", "application/json; charset=utf-8",
                                 "application/json; charset=latin-1", "application/merge-patch+json", "text/yaml",
                                 "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                 "application/octet-stream", "image/png", ";;;=", "application/json; charset"])
ids = st.sampled_from(["x", "0" * 32, "a b", "%00", "%ff", "..", "9" * 30, "é"])


def test_arbitrary_bodies_to_every_write_endpoint_never_get_a_5xx(stack):
    routes = write_routes(stack)
    seen: dict[int, int] = {}

    async def fuzzer_session() -> str:  # an admin of its own: what the fuzzing does to its user stays there
        async with GatewayClient(stack.url, token=stack.token) as admin:
            await admin.add_user("fuzzer", ["admin"], password="fuzzer password")
            return (await admin.login("fuzzer", "fuzzer password"))["token"]

    http = httpx.Client(base_url=stack.url, trust_env=False, timeout=60,
                        headers={"Authorization": f"Bearer {stack.run(fuzzer_session())}"})

    @settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(routes), bodies, content_types, ids)
    def one(route: tuple[str, str], body: bytes, ctype: str | None, some_id: str) -> None:
        method, path = route
        url = path
        for name in ("execution_id", "name", "catalog_id", "user_id", "session_id", "token_id"):
            url = url.replace("{" + name + "}", some_id)
        headers = {"content-type": ctype} if ctype is not None else {}
        resp = http.request(method, url, content=body, headers=headers)
        seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
        assert resp.status_code < 500, (method, url, ctype, body[:200], resp.status_code, resp.text[:500])
        if resp.status_code >= 400:
            detail(resp)

    with http:
        one()
    assert {400, 415, 422} <= set(seen), seen  # the strict paths were reached
    still_normal(stack)


BY_REFERENCE = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: by-reference, path: tests/by-reference}
executor: {spec: {policy: {limits: {max_payload_bytes: 1024}}}}
workflow:
  - step: start
    tool: {kind: noop, result: "{{ 'x' * 5000 }}"}
"""


def test_a_view_of_values_over_max_view_bytes_is_413_before_they_are_read(stack, http):
    """The values a view would read back from the payload store (D23) are bounded before any is read:
    413 saying what to ask instead; within the bound, the view has the values themselves."""
    status, _ = stack.execute(BY_REFERENCE, timeout=USUAL)
    assert status["status"] == "COMPLETED" and status["steps"]["start"]["result"] == "x" * 5000
    with limits.override(max_view_bytes=4000):
        over = http.get(f"/api/executions/{status['execution_id']}")
        assert over.status_code == 413, over.text
        assert "max_view_bytes" in detail(over)["message"] and "?brief=true" in detail(over)["message"]
        assert http.get(f"/api/executions/{status['execution_id']}?brief=true").status_code == 200
