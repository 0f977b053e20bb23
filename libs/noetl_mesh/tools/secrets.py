"""The ``secrets`` tool (D24): fetches a named secret from the configured provider into the task result.

``{kind: secrets, secret: <stored name>}`` (alias ``key``; ``provider`` None, ``credential`` or
``store``: the credential store) results in the stored credential's data mapping. The worker builds one
instance per command over its keychain resolver (:class:`~noetl_mesh.core.keychain.KeychainCache`) with
a ``sink``: the fetched values go into it and into the resolver's per-execution secrets, and every event
the worker publishes after the fetch is masked with them (the task's own ``task.processed`` included).

Errors: an unknown secret -> ``secret_not_found`` (not retryable); the store unreachable ->
``secret_unavailable`` (retryable); a bad ``secret`` or ``provider`` -> ``invalid_task``.
"""
from __future__ import annotations

import asyncio
from collections.abc import Mapping, MutableSet
from typing import Any

from ..core.keychain import secrets_of
from .base import ToolContext, error, ok

PROVIDERS = (None, "credential", "store")


class SecretsTool:
    kind = "secrets"

    def __init__(self, resolver: Any, sink: MutableSet[str] | None = None):
        self.resolver, self.sink = resolver, sink

    async def run(self, task: dict, spec: dict, ctx: ToolContext) -> dict:
        name = task.get("secret", task.get("key"))
        if not isinstance(name, str) or not name.strip():
            return error("invalid_task", f"task {ctx.task_name!r}: secret must be a non-empty name, got {name!r}")
        name = name.strip()
        provider = task.get("provider")
        if provider not in PROVIDERS:
            return error("invalid_task", f"task {ctx.task_name!r}: unsupported secrets provider {provider!r} "
                                         "(supported: 'credential', 'store' - the credential store, the default)")
        if self.resolver is None:
            return error("secret_unavailable", "no credential resolver configured on this worker")
        try:
            data = await self._fetch(ctx.execution_id, name)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the store or the bus unreachable, a timeout
            return error("secret_unavailable", f"secret {name!r}: credential store unavailable "
                                               f"({type(e).__name__}: {e})", retryable=True)
        if data is None:
            return error("secret_not_found", f"secret {name!r} is not stored")
        values = secrets_of(data)
        if self.sink is not None:
            self.sink.update(values)
        remember = getattr(self.resolver, "remember", None)
        if remember is not None:
            remember(ctx.execution_id, values)
        return ok(dict(data) if isinstance(data, Mapping) else data)

    async def _fetch(self, execution_id: str, name: str) -> Any:
        credential = getattr(self.resolver, "credential", None)
        if credential is not None:
            return await credential(execution_id, name)
        # a plain keychain resolver: one credential declaration named after the stored credential
        got = await self.resolver(execution_id, [{"name": name, "kind": "credential", "credential": name}])
        return (got or {}).get(name)

    async def close(self) -> None:
        return None
