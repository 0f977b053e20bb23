"""A small HTTP client of the gateway, for the CLI, the tests and the benchmarks, and the command
line's token store.

Tokens. A :class:`GatewayClient` sends ``Authorization: Bearer <token>`` with every request: the
``token`` it is given, else ``NOETL_TOKEN``, else the one stored for its gateway URL by ``noetl login``
in ``$XDG_CONFIG_HOME/noetl/tokens.json`` (default ``~/.config/noetl/tokens.json``; the directory 0700,
the file 0600, a JSON object of gateway URL → token). Tokens are kept per gateway so that a token is
never sent to a gateway it was not issued by.
"""
from __future__ import annotations

import asyncio
import email.utils
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

FINAL = ("COMPLETED", "FAILED", "CANCELLED")
MAX_RETRY_AFTER = 30.0  # seconds: the longest wait a 503's Retry-After can ask of wait()
TOKEN_ENV = "NOETL_TOKEN"


# --------------------------------------------------------------------------------- the token store
def config_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "noetl"


def token_file() -> Path:
    return config_dir() / "tokens.json"


def gateway_key(url: str) -> str:
    """A gateway URL as the store keys it: scheme and host in lower case, no trailing slash."""
    parts = urlsplit(url.strip())
    return f"{parts.scheme.lower()}://{parts.netloc.lower()}{parts.path.rstrip('/')}"


def _read_store() -> dict[str, str]:
    try:
        data = json.loads(token_file().read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(data, dict) else {}


def stored_token(url: str) -> str | None:
    return _read_store().get(gateway_key(url))


def store_token(url: str, token: str | None) -> Path:
    """Keep ``token`` for the gateway at ``url`` (None: forget it). Written whole to a new 0600 file
    that replaces the old one, so a reader never sees half of it and the mode is never wider."""
    data = _read_store()
    if token is None:
        data.pop(gateway_key(url), None)
    else:
        data[gateway_key(url)] = token
    path = token_file()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tokens-")  # mkstemp creates it 0600
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def resolve_token(url: str, token: str | None = None) -> str | None:
    """The token to send to ``url``: the one given, else ``NOETL_TOKEN``, else the stored one."""
    return token or os.environ.get(TOKEN_ENV) or stored_token(url)


class GatewayError(Exception):
    """An answer of 400 or more: ``status``, ``body`` (the parsed JSON, or the text), ``message`` (the
    gateway's ``detail.message``), ``errors`` (``detail.errors``) and, on a 503, ``retry_after`` seconds."""

    def __init__(self, status: int, body: Any, retry_after: float | None = None, who: str = "gateway"):
        detail = body.get("detail") if isinstance(body, dict) else None
        if isinstance(detail, dict):
            self.message = str(detail.get("message") or detail)
            self.errors = [e for e in detail.get("errors") or [] if isinstance(e, dict)]
        else:
            self.message, self.errors = str(detail if detail is not None else body), []
        lines = [f"{e.get('location')}: {e.get('message')}" if e.get("location") else str(e.get("message"))
                 for e in self.errors]
        lines = [line for line in lines if not self.message.startswith(line)]  # the message says it already
        super().__init__(f"{who} answered {status}: {self.message}" + "".join(f"\n  {line}" for line in lines))
        self.status, self.body, self.retry_after = status, body, retry_after


def retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delay-seconds or an HTTP date); None when absent or unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError, OverflowError):
        return None


class Following:
    """Following an execution to its end, over a client's ``status`` and ``events``."""

    async def status(self, execution_id: str, brief: bool = False) -> dict:
        raise NotImplementedError

    async def events(self, execution_id: str, offset: int = 0, limit: int = 1000, **filters: Any) -> dict:
        raise NotImplementedError

    async def all_events(self, execution_id: str, **filters: Any) -> list[dict]:
        """Every event (the filters of :meth:`events`: name, step, task, iteration), page by page."""
        out: list[dict] = []
        while True:
            page = await self.events(execution_id, offset=len(out), **filters)
            out += page["events"]
            if not page["events"] or len(out) >= page["total"]:
                return out

    async def wait(self, execution_id: str, timeout: float = 600.0, poll: float = 0.02,
                   on_event: Callable[[dict], None] | None = None, stop: Callable[[], bool] | None = None) -> dict:
        """Poll until the execution is final. The recorder stores a message's events and the projection
        in one transaction, so a final status means ``workflow.finished`` and the ``playbook.processed``
        published with it are recorded (events may still follow: a child's notice, a late report).
        Not recorded yet (404) polls on; unavailable (503) waits as its Retry-After asks (at most
        30 s) and tries again, until ``timeout``. ``stop()`` true before a poll: ``CancelledError``, as
        if the task had been cancelled. A caller cancelled by a signal passes it, because a cancellation
        can be lost on the way: on Python 3.11, ``asyncio.wait_for`` (nats-py's requests) returns the
        reply instead of raising when the reply and the cancellation arrive together."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            if stop is not None and stop():
                raise asyncio.CancelledError()
            delay = poll
            try:
                status = await self.status(execution_id, brief=True)
                if on_event is not None:
                    page = await self.events(execution_id, offset=seen)
                    for event in page["events"]:
                        on_event(event)
                    seen += len(page["events"])
                if status["status"] in FINAL:
                    return await self.status(execution_id)
            except GatewayError as exc:
                if exc.status == 503:
                    delay = min(MAX_RETRY_AFTER, exc.retry_after if exc.retry_after is not None else 1.0)
                elif exc.status != 404:
                    raise
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"execution {execution_id} did not finish within {timeout}s")
            await asyncio.sleep(min(max(delay, poll), left))


class GatewayClient(Following):
    """``token``: the bearer token to send; without one, ``NOETL_TOKEN`` or the token stored for
    ``base_url`` (:func:`resolve_token`). ``ca``: the CA file an ``https://`` gateway's certificate must
    verify against; without one ``NOETL_GATEWAY_CA``, else the system's authorities (infra/tls.py)."""

    def __init__(self, base_url: str, timeout: float = 30.0, token: str | None = None, ca: str | None = None):
        import httpx

        from .infra.tls import gateway_verify

        self.http = httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout, trust_env=False,
                                      verify=gateway_verify(ca))
        self.use(resolve_token(base_url, token))

    def use(self, token: str | None) -> None:
        """Send ``token`` from now on (None: none)."""
        self.token = token
        self.http.headers.pop("authorization", None)
        if token:
            self.http.headers["authorization"] = f"Bearer {token}"

    async def __aenter__(self) -> "GatewayClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.http.aclose()

    async def _call(self, method: str, url: str, **kw: Any) -> Any:
        resp = await self.http.request(method, url, **kw)
        body: Any = resp.text
        if resp.headers.get("content-type", "").startswith("application/json"):
            try:
                body = resp.json()
            except ValueError:  # not what it says: keep the text
                pass
        if resp.status_code >= 400:
            raise GatewayError(resp.status_code, body, retry_after(resp.headers.get("retry-after")))
        return body

    async def register(self, content: str) -> dict:
        return await self._call("POST", "/api/catalog", json={"content": content})

    async def start(self, playbook: str | dict | None = None, workload: dict | None = None, **ref: Any) -> str:
        body: dict[str, Any] = {"workload": workload or {}, **ref}
        if playbook is not None:
            body["playbook"] = playbook
        return (await self._call("POST", "/api/executions", json=body))["execution_id"]

    async def status(self, execution_id: str, brief: bool = False) -> dict:
        return await self._call("GET", f"/api/executions/{execution_id}", params={"brief": "true"} if brief else None)

    async def events(self, execution_id: str, offset: int = 0, limit: int = 1000, *, name: list[str] | None = None,
                     step: str | None = None, task: str | None = None, iteration: int | None = None) -> dict:
        """A page of the execution's events in log order, filtered as the API filters them."""
        params: dict[str, Any] = {"offset": offset, "limit": limit}
        for key, value in (("name", name), ("step", step), ("task", task), ("iteration", iteration)):
            if value is not None:
                params[key] = value
        return await self._call("GET", f"/api/executions/{execution_id}/events", params=params)

    async def list_executions(self, status: str | None = None, limit: int = 1000, all_pages: bool = False,
                              user: str | None = None, path: str | None = None, since: str | None = None,
                              until: str | None = None, offset: int = 0) -> list[dict]:
        """Executions, newest first; ``all_pages`` follows the pages to the oldest; ``user``: a user
        id or ``me`` (the executions that user started); ``path``: a playbook's; ``since``/``until``:
        created at or after / before (ISO 8601 or epoch seconds)."""
        out: list[dict] = []
        params: dict[str, Any] = {"limit": limit}
        for key, value in (("status", status), ("user", user), ("path", path), ("since", since), ("until", until)):
            if value:
                params[key] = value
        seen: set[str] = set()
        while True:
            page = await self._call("GET", "/api/executions", params={**params, "offset": offset + len(out)})
            new = [x for x in page if x["execution_id"] not in seen]
            seen.update(x["execution_id"] for x in new)
            out += new
            if not all_pages or len(page) < limit or not new:
                return out

    async def stats(self, since: float | str | None = None, until: float | str | None = None,
                    buckets: int = 48) -> dict:
        """The executions created in ``[since, until)`` (epoch seconds or ISO 8601; the console's
        overview): ``totals`` per status, ``by_status`` per slice, ``slowest``, ``failures``."""
        params: dict[str, Any] = {"buckets": buckets}
        for key, value in (("since", since), ("until", until)):
            if value is not None:
                params[key] = value
        return await self._call("GET", "/api/stats/executions", params=params)

    async def restart(self, execution_id: str, from_step: str, workload: dict | None = None) -> dict:
        """D32: a new execution that goes on from ``from_step`` of the finished ``execution_id``:
        ``{execution_id, status, restarted_from}``."""
        body: dict[str, Any] = {"from_step": from_step}
        if workload is not None:
            body["workload"] = workload
        return await self._call("POST", f"/api/executions/{execution_id}/restart", json=body)

    async def cancel(self, execution_id: str, reason: str | None = None) -> dict:
        return await self._call("POST", f"/api/executions/{execution_id}/cancel", json={"reason": reason})

    async def signal(self, execution_id: str, name: str, payload: Any = None) -> dict:
        """D30: send a signal (its payload as the JSON body)."""
        return await self._call("POST", f"/api/executions/{execution_id}/signals/{name}", json=payload)

    async def waits(self, execution_id: str | None = None) -> list:
        """D30: waits in progress (the inbox)."""
        return await self._call("GET", "/api/waits", params={"execution_id": execution_id} if execution_id else None)

    # credentials (D24)
    async def credential_put(self, name: str, kind: str, data: dict, description: str | None = None,
                             roles: list[str] | None = None, users: list[str] | None = None) -> dict:
        body: dict[str, Any] = {"name": name, "kind": kind, "data": data}
        if description is not None:
            body["description"] = description
        if roles is not None:
            body["roles"] = roles
        if users is not None:
            body["users"] = users
        return await self._call("POST", "/api/credentials", json=body)

    async def credential_roles(self, name: str, roles: list[str], users: list[str] | None = None) -> dict:
        """Who may use the credential from a playbook (D24): its roles, and its users (None: kept)."""
        body: dict[str, Any] = {"roles": roles}
        if users is not None:
            body["users"] = users
        return await self._call("POST", f"/api/credentials/{name}/roles", json=body)

    async def credential_list(self) -> list[dict]:
        return await self._call("GET", "/api/credentials")

    async def credential_get(self, name: str, include_data: bool = False) -> dict:
        return await self._call("GET", f"/api/credentials/{name}",
                                params={"include_data": "true" if include_data else "false"})

    async def credential_delete(self, name: str) -> dict:
        await self._call("DELETE", f"/api/credentials/{name}")
        return {"name": name, "deleted": True}

    # who: logins, sessions, users, API tokens, audit
    async def login(self, username: str | None = None, password: str | None = None,
                    id_token: str | None = None, nonce: str | None = None) -> dict:
        """A session (``{token, principal}``); the client sends its token from now on."""
        body = {k: v for k, v in (("username", username), ("password", password), ("id_token", id_token),
                                  ("nonce", nonce)) if v is not None}
        reply = await self._call("POST", "/api/auth/login", json=body)
        self.use(reply["token"])
        return reply

    async def logout(self) -> dict:
        return await self._call("POST", "/api/auth/logout")

    async def whoami(self) -> dict:
        return await self._call("GET", "/api/auth/whoami")

    async def sessions(self, user_id: str | None = None) -> list[dict]:
        return await self._call("GET", "/api/sessions", params={"user_id": user_id} if user_id else None)

    async def revoke_session(self, session_id: str) -> dict:
        return await self._call("DELETE", f"/api/sessions/{session_id}")

    async def revoke_sessions(self, user_id: str | None = None) -> dict:
        return await self._call("DELETE", "/api/sessions", params={"user_id": user_id} if user_id else None)

    async def users(self) -> list[dict]:
        return await self._call("GET", "/api/users")

    async def add_user(self, username: str, roles: list[str] | None = None, password: str | None = None,
                       email: str | None = None, display_name: str | None = None) -> dict:
        body = {k: v for k, v in (("username", username), ("roles", roles), ("password", password),
                                  ("email", email), ("display_name", display_name)) if v is not None}
        return await self._call("POST", "/api/users", json=body)

    async def disable_user(self, user: str) -> dict:
        return await self._call("POST", f"/api/users/{user}/disable")

    async def enable_user(self, user: str) -> dict:
        return await self._call("POST", f"/api/users/{user}/enable")

    async def set_roles(self, user: str, roles: list[str]) -> dict:
        return await self._call("POST", f"/api/users/{user}/roles", json={"roles": roles})

    async def set_password(self, password: str, user: str = "me", current_password: str | None = None) -> dict:
        body = {"password": password}
        if current_password is not None:
            body["current_password"] = current_password
        return await self._call("POST", f"/api/users/{user}/password", json=body)

    async def tokens(self, user_id: str | None = None) -> list[dict]:
        return await self._call("GET", "/api/tokens", params={"user_id": user_id} if user_id else None)

    async def create_token(self, name: str, roles: list[str] | None = None, expires_in: int | None = None) -> dict:
        body: dict[str, Any] = {"name": name}
        if roles:
            body["roles"] = roles
        if expires_in is not None:
            body["expires_in"] = expires_in
        return await self._call("POST", "/api/tokens", json=body)

    async def revoke_token(self, token_id: str) -> dict:
        return await self._call("DELETE", f"/api/tokens/{token_id}")

    async def audit(self, **filters: Any) -> list[dict]:
        return await self._call("GET", "/api/audit", params={k: v for k, v in filters.items() if v is not None})

    # schedules (D31)
    async def schedule_add(self, path: str, *, cron: str | None = None, timezone: str | None = None,
                           every: int | float | str | None = None, at: str | None = None, version: int | None = None,
                           workload: dict | None = None, name: str | None = None) -> dict:
        body = {k: v for k, v in (("path", path), ("cron", cron), ("timezone", timezone), ("every", every),
                                  ("at", at), ("version", version), ("workload", workload), ("name", name))
                if v is not None}
        return await self._call("POST", "/api/schedules", json=body)

    async def schedules(self) -> list[dict]:
        """Every schedule, newest first (the pages followed)."""
        out: list[dict] = []
        while True:
            page = await self._call("GET", "/api/schedules", params={"offset": len(out), "limit": 1000})
            out += page["schedules"]
            if page.get("next_offset") is None or not page["schedules"]:
                return out

    async def schedule(self, schedule_id: str, next: int = 5) -> dict:
        return await self._call("GET", f"/api/schedules/{schedule_id}", params={"next": next})

    async def schedule_pause(self, schedule_id: str) -> dict:
        return await self._call("POST", f"/api/schedules/{schedule_id}/pause")

    async def schedule_resume(self, schedule_id: str) -> dict:
        return await self._call("POST", f"/api/schedules/{schedule_id}/resume")

    async def schedule_delete(self, schedule_id: str) -> dict:
        await self._call("DELETE", f"/api/schedules/{schedule_id}")
        return {"id": schedule_id, "deleted": True}


class StackClient(Following):
    """``noetl run``'s client of the embedded stack it started, over NATS instead of HTTP: that stack
    runs no gateway (nobody else can reach it), and the command line takes the gateway's place, as its
    NATS user and as the writer of the requests (architecture.md, "noetl run"). The same answers as
    :class:`GatewayClient`'s for what ``noetl run`` asks (register, start, status, events, cancel),
    and the same checks on the way in: the playbook validated, the workload's size bounded."""

    WHO = "the embedded stack"

    def __init__(self, bus: Any):
        self.bus = bus

    async def __aenter__(self) -> "StackClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.bus.close()

    @classmethod
    async def connect(cls, nats_url: str, creds: str | None) -> "StackClient":
        from .infra.bus import Bus

        return cls(await Bus.connect(nats_url, "noetl-run", creds))

    def _failed(self, status: int, message: str, errors: list | None = None) -> GatewayError:
        detail: dict[str, Any] = {"message": message}
        if errors:
            detail["errors"] = errors
        return GatewayError(status, {"detail": detail}, who=self.WHO)

    async def _ask(self, subject: str, payload: dict[str, Any], expand: bool = False) -> Any:
        from .contracts.subjects import STATUS_OF_KIND
        from .infra.bus import BusError

        try:
            return await self.bus.request(subject, payload, timeout=10.0, expand=expand)
        except BusError as exc:
            raise self._failed(STATUS_OF_KIND.get(exc.kind, 502), exc.message) from exc

    async def register(self, content: str) -> dict:
        from .contracts.subjects import Q_CATALOG_REGISTER

        reply = await self._ask(Q_CATALOG_REGISTER, {"content": content})
        reply.setdefault("warnings", [])
        return reply

    async def start(self, playbook: str | dict, workload: dict | None = None) -> str:
        from . import limits
        from .contracts import refs
        from .core.events import execution_requested, new_execution_id
        from .infra.wire import dumps
        from .lang.validate import parse_and_validate

        workload = workload or {}
        if over := limits.exceeded("max_workload_bytes", len(dumps(workload)), "workload"):
            raise self._failed(413, str(over))
        doc, diags = parse_and_validate(playbook)
        errors = [{"location": d.location, "message": d.message} for d in diags if d.severity == "error"]
        if errors:
            raise self._failed(422, "invalid playbook", errors)
        if (at := refs.forged(workload)) is not None:  # only the engine writes one (D23; the validator's for the playbook)
            raise self._failed(422, refs.refusal(refs.shown(("workload", *at))))
        execution_id = new_execution_id()
        await self.bus.publish_event(execution_requested(execution_id, {
            "playbook": doc, "catalog": None, "workload": workload, "parent_execution_id": None,
            "requested_by": None}))
        return execution_id

    async def status(self, execution_id: str, brief: bool = False) -> dict:
        from .contracts.subjects import Q_EXECUTION_GET

        # D23: values whole (an object gone past its retention: 410, payload_missing)
        return await self._ask(Q_EXECUTION_GET, {"execution_id": execution_id, "brief": brief}, expand=True)

    async def events(self, execution_id: str, offset: int = 0, limit: int = 1000, **filters: Any) -> dict:
        from .contracts.subjects import Q_EXECUTION_EVENTS

        if filters:
            raise TypeError(f"StackClient.events filters nothing ({sorted(filters)})")
        return await self._ask(Q_EXECUTION_EVENTS, {"execution_id": execution_id, "offset": offset, "limit": limit})

    async def cancel(self, execution_id: str, reason: str | None = None) -> dict:
        from .core.events import cancel_requested

        try:
            current = await self.status(execution_id, brief=True)
        except GatewayError as exc:  # accepted a moment ago, not recorded yet: the log knows it
            current = await self.bus.pending_request(execution_id) if exc.status == 404 else None
            if current is None:
                raise
        if current["status"] in FINAL:
            raise self._failed(409, f"execution {execution_id} is already {current['status']}")
        await self.bus.publish_event(cancel_requested(execution_id, reason, None))
        return {"execution_id": execution_id, "status": "CANCELLING"}
