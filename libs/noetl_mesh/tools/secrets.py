"""The ``secrets`` tool (D24): fetches a credential the playbook's keychain declares into the task result.

``{kind: secrets, secret: <name>}`` (alias ``key``; ``provider`` None, ``credential`` or ``store``: the
credential store) results in the stored credential's data mapping. ``name`` is a ``credential`` entry of
the keychain (its stored credential is fetched) or the stored name such an entry gives; any other name
is refused before anything is asked (the credentials service refuses it too: a command may resolve only
what its keychain declares). The worker builds one instance per command over its keychain resolver,
bound to the command (:class:`~noetl_mesh.core.keychain.BoundResolver`), with the command's keychain
declarations and a ``sink``: the fetched values go into it and into the resolver's per-execution secrets,
and every event the worker publishes after the fetch is masked with them (the task's own
``task.processed`` included).

Errors: a name the keychain does not declare -> ``secret_not_declared``; one it declares but that is not
stored -> ``secret_not_found``; a resolution the store refuses -> ``secret_refused`` (none retryable);
the store unreachable -> ``secret_unavailable`` (retryable); a bad ``secret`` or ``provider`` ->
``invalid_task``.
"""
from __future__ import annotations

import asyncio
from collections.abc import Mapping, MutableSet
from typing import Any

from ..core.keychain import KeychainRefused, declared_credential, secrets_of
from .base import ToolContext, error, ok

PROVIDERS = (None, "credential", "store")


class SecretsTool:
    kind = "secrets"

    def __init__(self, resolver: Any, sink: MutableSet[str] | None = None, keychain: Any = None):
        self.resolver, self.sink, self.keychain = resolver, sink, keychain

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
        stored = declared_credential(self.keychain, name)
        if stored is None:
            return error("secret_not_declared", f"task {ctx.task_name!r}: secret {name!r} is not declared by the "
                                                "playbook's keychain; declare it: keychain: [{name: " + name
                                                + ", kind: credential}]")
        try:
            data = await self._fetch(ctx.execution_id, stored)
        except asyncio.CancelledError:
            raise
        except KeychainRefused as refused:
            return error("secret_refused", f"secret {name!r}: the credential store refused it: {refused}")
        except Exception as e:  # the store or the bus unreachable, a timeout
            return error("secret_unavailable", f"secret {name!r}: credential store unavailable "
                                               f"({type(e).__name__}: {e})", retryable=True)
        if data is None:
            return error("secret_not_found", f"secret {name!r} is not stored"
                         + (f" (credential {stored!r})" if stored != name else ""))
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
