"""``noetl run`` (a playbook to its end, on an embedded stack or a running gateway) and ``noetl restart``
(a finished execution from one of its steps): both follow the execution to its end, with progress."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from .common import (EXIT_FAILED, EXIT_INVALID, EXIT_OK, EXIT_STACK, EXIT_TIMEOUT, EXIT_UNREACHABLE, Interrupted,
                     Signals, arun, bad_url, env_int, fail, gateway_failed, json_object, unreachable)
from .output import Progress, outcome_text
from .playbooks import migrated
from .stack import ALLOW_NET_HELP, Servers, allow_net, embedded_stack, preload_services, provision

RUN_EXIT_CODES = (f"exit status: {EXIT_OK} COMPLETED, {EXIT_FAILED} FAILED or CANCELLED, {EXIT_INVALID} an invalid "
                  f"playbook or arguments, {EXIT_TIMEOUT} --timeout passed, {EXIT_UNREACHABLE} no gateway at --gateway, "
                  f"{EXIT_STACK} the embedded stack cannot start, 130/143 interrupted (SIGINT/SIGTERM)")
RESTART_EXIT_CODES = (f"exit status: {EXIT_OK} COMPLETED, {EXIT_FAILED} FAILED or CANCELLED, or the gateway refused "
                      f"the restart, {EXIT_INVALID} bad arguments, {EXIT_TIMEOUT} --timeout passed (the execution "
                      f"keeps running), {EXIT_UNREACHABLE} no gateway, 130/143 interrupted (SIGINT/SIGTERM)")


def add_commands(sub) -> None:
    """run (``noetl restart`` is among the executions' commands)."""
    p = sub.add_parser("run", help="run a playbook to its end (embedded stack unless --gateway)", epilog=RUN_EXIT_CODES)
    p.add_argument("file", metavar="FILE", help="the playbook (YAML)")
    p.add_argument("--workload", metavar="JSON", help="JSON object deep-merged over the playbook's workload")
    p.add_argument("--json", action="store_true", help="print one JSON object with the outcome")
    p.add_argument("--gateway", metavar="URL", help="a running gateway's URL instead of an embedded stack "
                                                    "(default: NOETL_GATEWAY_URL, else the gateway of the `noetl up` "
                                                    "running from --home, else an embedded stack)")
    p.add_argument("--timeout", type=float, default=3600.0, metavar="SECONDS",
                   help=f"seconds to wait for the end; then exit {EXIT_TIMEOUT}")
    p.add_argument("--register", action="append", metavar="FILE",
                   help="register this playbook in the catalog first (for `kind: playbook` tasks); repeatable")
    p.add_argument("--metrics-port", type=int, metavar="PORT", default=env_int("NOETL_METRICS_PORT"),
                   help="embedded stack: serve /metrics, /livez, /readyz of its services on this port (0: a free "
                        "one, printed; NOETL_METRICS_PORT; default: none)")
    p.add_argument("--migrate", action="store_true",
                   help="run the playbook (and the --register ones) through `noetl migrate` in memory first, for "
                        "a quick try of a legacy playbook; what needs a person is printed")
    p.add_argument("--allow-net", action="append", metavar="HOST[:PORT]|CIDR", help=ALLOW_NET_HELP)
    p.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    """D26: run a playbook to its end; exit 0 COMPLETED, 1 FAILED/CANCELLED, 2 invalid input, 3 --timeout
    passed, 4 no gateway at --gateway, 5 the embedded stack cannot start, 128 + the signal's number when
    SIGINT/SIGTERM stopped it (after stopping what it started)."""
    from ..lang.documents import read_document
    from ..lang.validate import validate_file, validate_text

    invalid = False
    texts: dict[str, str] = {}
    kinds: set[str] = set()  # of the tasks in them: their sandboxes' fork servers start with the worker
    for path in [args.file, *(args.register or [])]:  # every playbook checked before anything starts
        if getattr(args, "migrate", False):
            text = migrated(path)
            if text is None:
                invalid = True
                continue
            texts[path] = text
            result = validate_text(text)
        else:
            result = validate_file(path)
        for d in result.errors:
            print(f"{path}: {d}", file=sys.stderr)
        invalid = invalid or not result.ok
        kinds |= _kinds(result.document)
    if invalid:
        return EXIT_INVALID
    try:
        workload = json_object(args.workload or None, "--workload", empty={})
    except ValueError as exc:
        return fail(str(exc))
    text = texts.get(args.file) or read_document(args.file)[0]  # decoded as it was validated (UTF-8/16/32)
    gateway = args.gateway or os.environ.get("NOETL_GATEWAY_URL")
    if not gateway:
        from ..home import running_stack

        local = running_stack(args.home)
        if local:
            gateway = local["gateway"]
            print(f"noetl: running on the noetl up of {local.get('home') or args.home or '.noetl'} ({gateway}; "
                  "--gateway URL for another)", file=sys.stderr)
    if bad_url(gateway):
        return fail(bad_url(gateway))
    if gateway and getattr(args, "allow_net", None):
        return fail(f"--allow-net sets what the workers of the stack `noetl run` starts may reach; the workers "
                    f"behind {gateway} have their own setting (NOETL_SANDBOX_ALLOW_NET where they run)")
    try:
        args.allow_net_text = None if gateway else allow_net(args)
    except ValueError as exc:
        return fail(str(exc))
    args.sandbox_warm = ",".join(sorted(kinds))
    with Signals() as signals:
        run = Run(args, gateway, signals)

        def start():
            if not gateway:
                preload_services()
                run.servers = provision()
            return run.main(text, workload, run.servers, texts)

        return run.go(start)


class TimedOut(Exception):
    """``noetl run --timeout`` passed (said already)."""


class Run:
    """One ``noetl run``: start the services (unless ``--gateway``), submit, follow, print the end.
    On a signal or ``--timeout`` an execution on the embedded stack is cancelled (so the stack stops at
    once); on a gateway it keeps running, and the message says how to follow or cancel it. The message
    comes as the stopping starts, not after it."""

    def __init__(self, args: argparse.Namespace, gateway: str | None, signals: Signals):
        self.args, self.gateway, self.signals = args, gateway, signals
        self.execution_id: str | None = None
        self.progress = None if args.json else Progress()
        self.started = time.monotonic()
        self.said = False
        self.servers: Servers | None = None  # the embedded stack's NATS and Postgres, when it runs on one

    def go(self, start) -> int:
        """Run ``start()`` (the coroutine of :meth:`main` or :meth:`restart`; the embedded stack's servers
        started first when it needs them) to the exit code; a signal, ``--timeout``, the gateway's refusal
        or absence, or a stack that cannot start said in one line."""
        from ..client import GatewayError
        from ..infra.embedded import InfraError

        transport: tuple[type[BaseException], ...] = (OSError,)
        if self.gateway:  # httpx's errors too (imported only then: the embedded stack's client is NATS)
            import httpx

            transport = (OSError, httpx.TransportError)
        try:
            return arun(start(), self.signals)
        except Interrupted as exc:
            self.stopping(exc.signum)
            return 128 + exc.signum
        except TimedOut:
            return EXIT_TIMEOUT
        except GatewayError as exc:
            return gateway_failed(exc, self.gateway or "URL")
        except transport as exc:
            if not self.gateway or isinstance(exc, TimeoutError):
                raise
            return unreachable(self.gateway, exc)
        except InfraError as exc:
            return fail(f"cannot start the embedded stack: {exc}", EXIT_STACK)
        finally:
            self.close()
            if self.servers is not None:
                self.servers.stop()

    async def main(self, text: str, workload: dict, servers: "Servers | None", texts: dict | None = None) -> int:
        import asyncio

        from ..client import GatewayClient, StackClient
        from ..infra.embedded import EmbeddedNats
        from ..lang.documents import read_document

        args, stack = self.args, None
        try:
            if servers is not None:
                # on its own NATS, one partition: a stack of one replica each, for one execution, thrown
                # away after (a partition is a durable per control-plane service; 16 of each took ~0.2 s
                # to create). Someone else's NATS keeps its count (fixed when its stream was created).
                own = isinstance(servers.nats, EmbeddedNats)
                # without a gateway: this command is the stack's only client, over NATS as the gateway's user
                stack = await embedded_stack(servers, metrics_port=args.metrics_port, partitions=1 if own else None,
                                             allow_net=getattr(args, "allow_net_text", None), gateway=False,
                                             sandbox_warm=getattr(args, "sandbox_warm", None))
                if stack.metrics_url and not args.json:
                    print(f"metrics: {stack.metrics_url}/metrics (and /livez, /readyz)", file=sys.stderr, flush=True)
                client = await StackClient.connect(stack.settings.nats_url, stack.settings.creds_for("gateway"))
            else:  # a running gateway, with the command line's token (noetl login)
                client = GatewayClient(self.gateway)
            async with client:
                for path in args.register or ():  # the playbooks that `playbook` tasks call, by catalog path
                    await client.register((texts or {}).get(path) or read_document(path)[0])
                self.execution_id = await client.start(text, workload)
                if stack is None:  # on a running stack it outlives this command: its id now, to follow it elsewhere
                    print(f"noetl: execution {self.execution_id} started (noetl status {self.execution_id})",
                          file=sys.stderr, flush=True)
                final, events, elapsed = await self._follow(client, cancel=stack is not None)
        except asyncio.CancelledError:
            self.stopping(self.signals.received)
            raise
        finally:
            if stack is not None:
                # all at once: nothing of this stack is kept; nothing handed back unless NATS is someone else's
                await stack.stop(ordered=False, throwaway=isinstance(servers.nats, EmbeddedNats))
        return self._report(final, events, elapsed)

    async def restart(self, execution_id: str, from_step: str, workload: dict | None) -> int:
        """``noetl restart`` (D32): ask the gateway for the restart, then follow the new execution as a
        run on a gateway is followed."""
        import asyncio

        from ..client import GatewayClient

        try:
            async with GatewayClient(self.gateway) as client:
                answer = await client.restart(execution_id, from_step, workload)
                self.execution_id = answer["execution_id"]
                if not self.args.json:
                    print(f"noetl: execution {self.execution_id} restarts {execution_id} from step {from_step!r}",
                          file=sys.stderr, flush=True)
                final, events, elapsed = await self._follow(client, cancel=False)
        except asyncio.CancelledError:
            self.stopping(self.signals.received)
            raise
        return self._report(final, events, elapsed)

    async def _follow(self, client, cancel: bool) -> tuple[dict, list[dict], float]:
        """Wait for the execution's end (progress on the way); on ``--timeout`` or a signal, say so and
        (``cancel``: it runs on the embedded stack) cancel it."""
        import asyncio

        self.started = time.monotonic()
        try:
            final = await client.wait(self.execution_id, timeout=self.args.timeout, on_event=self.progress,
                                      stop=lambda: self.signals.received is not None)
            elapsed = time.monotonic() - self.started  # the execution's, not the stack's stop
        except (TimeoutError, asyncio.CancelledError) as exc:
            timed_out = isinstance(exc, TimeoutError)
            self.stopping(None if timed_out else self.signals.received)
            if cancel:
                await self._cancel(client)
            if timed_out:
                raise TimedOut() from None
            raise
        return final, await client.all_events(self.execution_id), elapsed

    def _report(self, final: dict, events: list[dict], elapsed: float) -> int:
        self.close()
        if self.args.json:
            out = {k: final.get(k) for k in ("execution_id", "status", "workload", "ctx", "steps", "error")}
            if final.get("restarted_from"):  # D32
                out["restarted_from"] = final["restarted_from"]
            out["events"] = [{k: e.get(k) for k in ("name", "step", "task", "iteration", "attempt")} for e in events]
            print(json.dumps(out, default=str))
        else:
            print(outcome_text(final, elapsed))
        return EXIT_OK if final["status"] == "COMPLETED" else EXIT_FAILED

    async def _cancel(self, client) -> None:
        """Cancel the execution on the embedded stack and give the cancellation a moment to reach its
        running tasks (a worker that still runs one when it stops waits for it)."""
        import asyncio

        try:
            await asyncio.wait_for(client.cancel(self.execution_id, reason="noetl run stopped"), 2)
            await client.wait(self.execution_id, timeout=2)
        except Exception:  # noqa: BLE001 - best effort: the stack stops anyway
            pass

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()

    def stopping(self, signum: int | None) -> None:
        """Say once why the run stops and what becomes of the execution: a signal (``signum``), or
        ``--timeout`` (None)."""
        if self.said:
            return
        self.said = True
        self.close()
        xid, gw = self.execution_id, self.gateway
        why = (f"interrupted ({signal.Signals(signum).name})" if signum is not None else
               f"execution {xid} did not finish within {self.args.timeout:g}s (--timeout)")
        if gw:
            what = (f"execution {xid} keeps running on {gw}: `noetl status {xid} --gateway {gw}`, "
                    f"`noetl cancel {xid} --gateway {gw}`" if xid else "")
        elif xid:
            what = f"cancelling {'it' if signum is None else f'execution {xid}'} and stopping the embedded stack"
        else:
            what = "stopping the embedded stack"
        fail(f"{why}: {what}" if what else why)


def cmd_restart(args: argparse.Namespace) -> int:
    """``noetl restart ID --from STEP [--workload JSON] [--json]`` (D32): a new execution that goes on
    from STEP of the finished execution ID, followed to its end as ``noetl run`` follows one; exit 0
    COMPLETED, 1 FAILED/CANCELLED or refused by the gateway, 2 bad arguments, 3 --timeout passed (it
    keeps running), 4 no gateway."""
    try:
        workload = json_object(args.workload or None, "--workload")
    except ValueError as exc:
        return fail(str(exc))
    with Signals() as signals:
        run = Run(args, args.gateway, signals)
        return run.go(lambda: run.restart(args.execution_id, args.from_step, workload))


def _kinds(value) -> set[str]:
    """Every ``kind`` named in a playbook document (its tasks' among them)."""
    if isinstance(value, dict):
        found = {value["kind"]} if isinstance(value.get("kind"), str) else set()
        return found.union(*(_kinds(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(_kinds(v) for v in value))
    return set()
