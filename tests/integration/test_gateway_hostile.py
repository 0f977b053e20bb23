"""Hostile requests to the gateway, over a real HTTP server in front of a whole stack (real NATS and
Postgres): each is answered with a 4xx that says what is wrong and where (never a 5xx), and a normal
execution submitted right after still completes within its usual time."""
from __future__ import annotations

import json
import time
from typing import Any, Iterator

import httpx
import pytest

from noetl_mesh import limits
from scenarios import TINY

pytestmark = pytest.mark.integration

USUAL = 30.0  # seconds; a tiny execution normally takes well under one


@pytest.fixture(scope="module")
def http(stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, trust_env=False, timeout=60) as client:
        yield client


def detail(resp: httpx.Response) -> dict[str, Any]:
    """The one error shape of the API: ``{"detail": {"message", "location", "errors"}}``."""
    body = resp.json()
    assert set(body) == {"detail"}, body
    assert isinstance(body["detail"]["message"], str) and body["detail"]["message"], body
    assert "location" in body["detail"] and isinstance(body["detail"]["errors"], list), body
    return body["detail"]


def still_normal(stack) -> None:
    started = time.monotonic()
    status, _ = stack.execute(TINY, timeout=USUAL)
    assert status["status"] == "COMPLETED", status
    assert time.monotonic() - started < USUAL


def post_json_text(http: httpx.Client, url: str, text: str) -> httpx.Response:
    return http.post(url, content=text.encode("utf-8", "surrogatepass"), headers={"content-type": "application/json"})


# ------------------------------------------------------------------------------ size
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
