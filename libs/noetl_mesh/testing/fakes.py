"""Fake tools for engine tests without network: outcomes scripted by the task's URL."""
from __future__ import annotations

import json


class FakeHttp:
    """``url`` 'ok:<json>' -> ok with that result; 'error:<status>' -> an http error;
    'flaky:<n>' -> 503 for the first n calls of that url, then ok 'recovered'. Records every call."""

    def __init__(self):
        self.calls: dict[str, int] = {}
        self.seen: list[tuple] = []

    async def run(self, task, spec, ctx):
        self.seen.append((dict(task), dict(spec), ctx.task_name))
        url = task["url"]
        self.calls[url] = self.calls.get(url, 0) + 1
        if url.startswith("ok:"):
            return {"status": "ok", "result": json.loads(url[3:]), "http": {"status": 200, "headers": {}}}
        if url.startswith("flaky:") and self.calls[url] > int(url.split(":")[1]):
            return {"status": "ok", "result": "recovered", "http": {"status": 200, "headers": {}}}
        code = 503 if url.startswith("flaky:") else int(url.split(":")[1])
        return {"status": "error", "result": None, "http": {"status": code, "headers": {}},
                "error": {"kind": "http_error", "message": f"HTTP {code}", "retryable": code >= 500}}
