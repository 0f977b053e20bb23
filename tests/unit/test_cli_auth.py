"""The command line's token store and which token a client sends (no servers)."""
from __future__ import annotations

import asyncio
import json
import os

import pytest

from noetl_mesh import client as C
from noetl_mesh.cli import build_parser, main as cli

SESSION = "noetl_s_" + "s" * 43
API = "noetl_t_" + "t" * 43


@pytest.fixture(autouse=True)
def config(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.delenv("NOETL_TOKEN", raising=False)
    return tmp_path / "cfg"


def test_tokens_are_kept_per_gateway_in_a_0600_file(config):
    assert C.token_file() == config / "noetl" / "tokens.json"
    assert C.stored_token("http://127.0.0.1:8082") is None
    path = C.store_token("http://127.0.0.1:8082/", SESSION)
    assert oct(path.stat().st_mode & 0o777) == "0o600" and oct(path.parent.stat().st_mode & 0o777) == "0o700"
    C.store_token("https://noetl.example.com", API)
    assert C.stored_token("HTTP://127.0.0.1:8082") == SESSION  # the same gateway, spelled otherwise
    assert C.stored_token("http://127.0.0.1:8083") is None  # never sent to another gateway
    assert C.stored_token("https://noetl.example.com/") == API
    assert json.loads(path.read_text()) == {"http://127.0.0.1:8082": SESSION, "https://noetl.example.com": API}
    C.store_token("http://127.0.0.1:8082", None)
    assert C.stored_token("http://127.0.0.1:8082") is None and C.stored_token("https://noetl.example.com") == API
    assert [p.name for p in path.parent.iterdir()] == ["tokens.json"]  # no temporary file left


def test_a_damaged_store_is_read_as_empty(config):
    (config / "noetl").mkdir(parents=True)
    for text in ("not json", "[1, 2]", '{"http://x": 5}'):
        (config / "noetl" / "tokens.json").write_text(text)
        assert C.stored_token("http://x") is None


def test_which_token_a_client_sends(monkeypatch):
    C.store_token("http://gw", SESSION)

    async def header(**kw) -> str | None:
        async with C.GatewayClient("http://gw", **kw) as c:
            return c.http.headers.get("authorization")

    assert asyncio.run(header()) == f"Bearer {SESSION}"  # the stored one
    monkeypatch.setenv("NOETL_TOKEN", API)
    assert asyncio.run(header()) == f"Bearer {API}"  # the environment's overrides it
    assert asyncio.run(header(token="noetl_t_given")) == "Bearer noetl_t_given"  # the given one, first of all
    monkeypatch.delenv("NOETL_TOKEN")
    C.store_token("http://gw", None)
    assert asyncio.run(header()) is None


def test_logout_of_an_api_token_forgets_it_without_asking_the_gateway(capsys):
    C.store_token("http://127.0.0.1:1", API)  # nothing listens there: no request may be made
    assert cli(["logout", "--gateway", "http://127.0.0.1:1"]) == 0
    assert "stays valid until revoked" in capsys.readouterr().out and C.stored_token("http://127.0.0.1:1") is None
    assert cli(["logout", "--gateway", "http://127.0.0.1:1"]) == 0
    assert "no token stored" in capsys.readouterr().out


def test_a_session_that_cannot_be_ended_stays_stored(capsys):
    C.store_token("http://127.0.0.1:1", SESSION)
    assert cli(["logout", "--gateway", "http://127.0.0.1:1"]) == 4  # no gateway answers there
    assert "cannot reach the gateway" in capsys.readouterr().err and C.stored_token("http://127.0.0.1:1") == SESSION


def test_the_auth_commands_parse():
    parser = build_parser()
    args = parser.parse_args(["login", "--username", "ann", "--gateway", "http://gw"])
    assert (args.username, args.gateway, args.token, args.password_stdin) == ("ann", "http://gw", None, False)
    args = parser.parse_args(["user", "roles", "ann", "developer", "operator"])
    assert (args.user, args.roles) == ("ann", ["developer", "operator"])
    args = parser.parse_args(["token", "create", "ci", "--role", "viewer", "--expires-in", "3600"])
    assert (args.name, args.role, args.expires_in) == ("ci", ["viewer"], 3600)
    assert parser.parse_args(["session", "revoke", "--user", "me"]).user == "me"
    assert cli(["session", "revoke", "--gateway", "http://127.0.0.1:1"]) == 2  # neither an id nor --user
    assert cli(["login", "--token", API, "--oidc-token", "x"]) == 2
    assert os.environ.get("NOETL_TOKEN") is None
