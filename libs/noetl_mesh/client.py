"""A small HTTP client of the gateway, for the CLI, the tests and the benchmarks."""
from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import httpx

FINAL = ("COMPLETED", "FAILED", "CANCELLED")


class GatewayError(Exception):
    def __init__(self, status: int, body: Any):
        super().__init__(f"gateway answered {status}: {body}")
        self.status, self.body = status, body


class GatewayClient:
    def __init__(self, base_url: str, timeout: float = 30.0):
        self.http = httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout, trust_env=False)

    async def __aenter__(self) -> "GatewayClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.http.aclose()

    async def _call(self, method: str, url: str, **kw: Any) -> Any:
        resp = await self.http.request(method, url, **kw)
        body = resp.json() if resp.headers.get("content-type", "").startswith("application/json") else resp.text
        if resp.status_code >= 400:
            raise GatewayError(resp.status_code, body)
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

    async def events(self, execution_id: str, offset: int = 0, limit: int = 1000) -> dict:
        return await self._call("GET", f"/api/executions/{execution_id}/events",
                                params={"offset": offset, "limit": limit})

    async def all_events(self, execution_id: str) -> list[dict]:
        out: list[dict] = []
        while True:
            page = await self.events(execution_id, offset=len(out))
            out += page["events"]
            if not page["events"] or len(out) >= page["total"]:
                return out

    async def list_executions(self, status: str | None = None, limit: int = 1000, all_pages: bool = False) -> list[dict]:
        """Executions, newest first; ``all_pages`` follows the pages to the oldest."""
        out: list[dict] = []
        params: dict[str, Any] = {"limit": limit}
        if status:
            params["status"] = status
        seen: set[str] = set()
        while True:
            page = await self._call("GET", "/api/executions", params={**params, "offset": len(out)})
            new = [x for x in page if x["execution_id"] not in seen]
            seen.update(x["execution_id"] for x in new)
            out += new
            if not all_pages or len(page) < limit or not new:
                return out

    async def cancel(self, execution_id: str, reason: str | None = None) -> dict:
        return await self._call("POST", f"/api/executions/{execution_id}/cancel", json={"reason": reason})

    # credentials (D24)
    async def credential_put(self, name: str, kind: str, data: dict, description: str | None = None) -> dict:
        body: dict[str, Any] = {"name": name, "kind": kind, "data": data}
        if description is not None:
            body["description"] = description
        return await self._call("POST", "/api/credentials", json=body)

    async def credential_list(self) -> list[dict]:
        return await self._call("GET", "/api/credentials")

    async def credential_get(self, name: str, include_data: bool = False) -> dict:
        return await self._call("GET", f"/api/credentials/{name}",
                                params={"include_data": "true" if include_data else "false"})

    async def credential_delete(self, name: str) -> dict:
        await self._call("DELETE", f"/api/credentials/{name}")
        return {"name": name, "deleted": True}

    async def wait(self, execution_id: str, timeout: float = 600.0, poll: float = 0.02,
                   on_event: Callable[[dict], None] | None = None) -> dict:
        """Poll until the execution is final. The recorder stores a message's events and the projection
        in one transaction, so a final status means ``workflow.finished`` and the ``playbook.processed``
        published with it are recorded (events may still follow: a child's notice, a late report)."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            status = None
            try:
                status = await self.status(execution_id, brief=True)
            except GatewayError as exc:
                if exc.status != 404:
                    raise
            if on_event is not None and status is not None:
                page = await self.events(execution_id, offset=seen)
                for event in page["events"]:
                    on_event(event)
                seen += len(page["events"])
            if status is not None and status["status"] in FINAL:
                return await self.status(execution_id)
            if time.monotonic() > deadline:
                raise TimeoutError(f"execution {execution_id} did not finish within {timeout}s")
            await asyncio.sleep(poll)
