"""The ``noetl`` command (D26)."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from typing import Any, Sequence
from .home import HomeLock, finding

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2
EXIT_TIMEOUT = 3  # noetl run --timeout passed before the execution ended
EXIT_UNREACHABLE = 4  # no gateway answers at the URL
EXIT_STACK = 5  # the embedded stack cannot start (e.g. one already runs from that home)
EXIT_INTERNAL = 70  # an unexpected error: a bug (one line; --debug shows the traceback)
# a signal ends a command with 128 + its number: 130 for SIGINT, 143 for SIGTERM


class Interrupted(BaseException):
    """SIGINT or SIGTERM ended a command (:class:`_Signals`); what it started is stopped first."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Signals:
    """SIGINT and SIGTERM while a command runs what it must stop again (NATS, Postgres, services).
    In plain code they raise :class:`Interrupted` at once (a half-started server is stopped by its own
    ``start``); while :func:`_arun` runs a coroutine they cancel it, so that its ``finally`` blocks stop
    what it started, and :func:`_arun` raises :class:`Interrupted` after. A second signal is ignored
    while that cleanup runs; a third ends the process at once (what it started may be left running)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.task: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "_Signals":
        for sig in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(sig) is not signal.SIG_IGN:  # ignored on purpose (a shell's background job)
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    def _handle(self, signum: int, frame: object) -> None:
        if self.received is not None:  # stopping already: the next one is the default's (death)
            signal.signal(signum, signal.SIG_DFL)
            return
        self.received = signum
        if self.task is not None and self.loop is not None and not self.task.done():
            self.task.cancel()
            self.loop.call_soon_threadsafe(lambda: None)  # wake the loop up
            return
        raise Interrupted(signum)


def run_loop(coro):
    """Run ``coro`` to completion on uvloop when it is installed (a dependency on Linux and macOS: its
    event loop and socket transports cost a service about a fifth less CPU, docs/performance.md), on
    asyncio's own loop otherwise or with ``NOETL_EVENT_LOOP=asyncio``."""
    factory = None
    if os.environ.get("NOETL_EVENT_LOOP", "uvloop") != "asyncio":
        try:
            import uvloop
            factory = uvloop.new_event_loop
        except ImportError:
            pass
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


def _arun(coro, signals: _Signals):
    """``asyncio.run(coro)`` with ``signals`` cancelling it; Interrupted when a signal did."""

    async def main():
        signals.task, signals.loop = asyncio.current_task(), asyncio.get_running_loop()
        try:
            return await coro
        finally:
            signals.task = signals.loop = None

    try:
        result = run_loop(main())
    except asyncio.CancelledError:
        if signals.received is not None:
            raise Interrupted(signals.received) from None
        raise
    if signals.received is not None:  # it ended on its own as the signal arrived
        raise Interrupted(signals.received)
    return result


def cmd_validate(args: argparse.Namespace) -> int:
    """D26: exit 0 when every file is valid (warnings printed), 2 when any is invalid. A file that
    cannot be read or decoded is invalid, with its reason; never a traceback."""
    from .lang.validate import validate_file

    status = EXIT_OK
    for path in args.files:
        try:
            result = validate_file(path)
        except Exception as exc:  # noqa: BLE001 - a defect of the validator is still reported per file
            print(f"{path}: error: the validator failed on this file ({type(exc).__name__}: {exc}); please report it")
            status = EXIT_INVALID
            continue
        for d in result.diagnostics:
            print(f"{path}: {d}")
        if result.ok:
            print(f"{path}: valid" + (f" ({len(result.warnings)} warning(s))" if result.warnings else ""))
        else:
            print(f"{path}: invalid ({len(result.errors)} error(s))")
            status = EXIT_INVALID
    return status


def cmd_lint(args: argparse.Namespace) -> int:
    """``noetl lint``: validation, then the lint rules (docs/lint.md). Exit 2 when a file is invalid or
    has an error finding, else 0 (warnings and infos printed), as D26 says for ``validate``."""
    from .lang.documents import read_document
    from .lang.lint import Finding, Report, from_diagnostics, lint_text, sarif_log

    reports: list[tuple[str, Report]] = []
    for path in args.files:
        text, problems = read_document(path)
        try:
            report = lint_text(text) if text is not None else Report(from_diagnostics(problems), valid=False)
        except Exception as exc:  # noqa: BLE001 - a defect of the linter is still reported per file
            report = Report([Finding("L000", "error", "", f"the linter failed on this file ({type(exc).__name__}: "
                                     f"{exc}); please report it")], valid=False)
        reports.append((path, report))
    if args.format == "json":
        print(json.dumps([f.as_dict(path) for path, r in reports for f in r.findings], indent=2))
    elif args.format == "sarif":
        print(json.dumps(sarif_log(reports), indent=2))
    else:
        for path, report in reports:
            for f in report.findings:
                print(f.text(path))
            counts = {s: sum(f.severity == s for f in report.findings) for s in ("error", "warning", "info")}
            summary = ", ".join(f"{n} {s}(s)" for s, n in counts.items() if n) or "no findings"
            print(f"{path}: {'' if report.valid else 'invalid: '}{summary}")
    return EXIT_INVALID if any(r.failed for _, r in reports) else EXIT_OK


def cmd_schema(args: argparse.Namespace) -> int:
    from .lang.model import json_schema

    print(json.dumps(json_schema(), indent=2))
    return EXIT_OK


EXIT_NEEDS_PERSON = 3  # noetl migrate: something could not be translated (listed)


def cmd_migrate(args: argparse.Namespace) -> int:
    """``noetl migrate FILE...`` (docs/migrate.md): the canonical form of legacy playbooks. Prints it (or a
    unified diff with --diff, or rewrites the files with --write, or only says whether they would change
    with --check); the changes and what needs a person go to stderr (stdout with --write/--check), each
    with its location. Exit 2 when a file is not a playbook, else 3 when something needs a person, else
    (--check) 1 when a file would change, else 0."""
    import difflib

    from .lang.documents import read_document
    from .lang.migrate import migrate_text

    report = sys.stdout if (args.write or args.check) else sys.stderr
    status = EXIT_OK
    several = len(args.files) > 1
    for path in args.files:
        text, problems = read_document(path)
        if text is None:
            for d in problems:
                print(f"{path}: invalid: {d}", file=report)
            status = EXIT_INVALID
            continue
        m = migrate_text(text)
        if m.invalid:
            for reason in m.invalid:
                print(f"{path}: invalid: {reason}", file=report)
            status = EXIT_INVALID
            continue
        for f in m.changes:
            print(f"{path}:{f.line or 0}: changed: {f.rule}: {f.location or '<document>'}: {f.message}", file=report)
        for f in m.problems:
            print(f"{path}:{f.line or 0}: needs a person: {f.rule}: {f.location or '<document>'}: {f.message}",
                  file=report)
        if args.write:
            if m.changed:
                with open(path, "w", encoding="utf-8") as out:
                    out.write(m.text)
        elif args.diff:
            sys.stdout.writelines(difflib.unified_diff(
                text.splitlines(keepends=True), m.text.splitlines(keepends=True), f"{path}", f"{path} (canonical)"))
        elif not args.check:
            if several:
                print(f"# noetl migrate: {path}")
            sys.stdout.write(m.text)
        verdict = ("already canonical" if not m.changed else "rewritten" if args.write else "would change"
                   if args.check else "changed")
        print(f"{path}: {verdict}: {len(m.changes)} change(s), {len(m.problems)} need(s) a person", file=report)
        if m.problems:
            status = max(status, EXIT_NEEDS_PERSON) if status != EXIT_INVALID else status
        elif m.changed and args.check and status == EXIT_OK:
            status = EXIT_FAILED
    return status


FINAL = ("COMPLETED", "FAILED", "CANCELLED")


def cmd_asyncapi(args: argparse.Namespace) -> int:
    """``noetl asyncapi``: the contract of every subject (contracts/asyncapi.py)."""
    from .contracts.asyncapi import document

    doc = document(_version())
    if args.yaml:
        import yaml

        print(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True), end="")
    else:
        print(json.dumps(doc, indent=2))
    return EXIT_OK


def _fail(message: str, code: int = EXIT_INVALID) -> int:
    print(f"noetl: {message}", file=sys.stderr)
    return code


ALLOW_NET_HELP = ("open a destination to the workers' http and postgres tasks (D33): an address, a network or a host "
                  "name, with an optional port (127.0.0.1:8765, 10.0.0.0/8, db.internal:5432); repeatable or "
                  "comma-separated; sets NOETL_SANDBOX_ALLOW_NET for the stack's workers (default: the environment's)")


def _allow_net(args: argparse.Namespace) -> str | None:
    """``--allow-net`` (repeatable, comma-separated) as the text of NOETL_SANDBOX_ALLOW_NET for the
    embedded stack's workers, or None when it is not given (they read the environment's). ValueError
    naming what cannot be read: an entry of the flag, or a sandbox setting of the environment (the
    workers would not start)."""
    from .sandbox.policy import ENV, from_env, parse_destinations

    text = ",".join(args.allow_net) if getattr(args, "allow_net", None) else None
    if text is not None:
        parse_destinations(text, "--allow-net")
    from_env({**os.environ, ENV["allow"]: text} if text is not None else os.environ)
    return text


def cmd_run(args: argparse.Namespace) -> int:
    """D26: run a playbook to its end; exit 0 COMPLETED, 1 FAILED/CANCELLED, 2 invalid input, 3 --timeout
    passed, 4 no gateway at --gateway, 5 the embedded stack cannot start, 128 + the signal's number when
    SIGINT/SIGTERM stopped it (after stopping what it started)."""
    from .lang.documents import read_document
    from .lang.validate import validate_file, validate_text

    invalid = False
    texts: dict[str, str] = {}
    for path in [args.file, *(args.register or [])]:  # every playbook checked before anything starts
        if getattr(args, "migrate", False):
            text = _migrated(path)
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
    if invalid:
        return EXIT_INVALID
    try:
        workload = json.loads(args.workload) if args.workload else {}
    except json.JSONDecodeError as exc:
        return _fail(f"--workload is not valid JSON: {exc}")
    if not isinstance(workload, dict):
        return _fail("--workload must be a JSON object")
    text = texts.get(args.file) or read_document(args.file)[0]  # decoded as it was validated (UTF-8/16/32)
    import httpx

    from .client import GatewayError
    from .infra.embedded import InfraError

    gateway = args.gateway or os.environ.get("NOETL_GATEWAY_URL")
    if not gateway:
        from .home import running_stack

        local = running_stack(args.home)
        if local:
            gateway = local["gateway"]
            print(f"noetl: running on the noetl up of {local.get('home') or args.home or '.noetl'} ({gateway}; "
                  "--gateway URL for another)", file=sys.stderr)
    if _bad_url(gateway):
        return _fail(_bad_url(gateway))
    if gateway and getattr(args, "allow_net", None):
        return _fail(f"--allow-net sets what the workers of the stack `noetl run` starts may reach; the workers "
                     f"behind {gateway} have their own setting (NOETL_SANDBOX_ALLOW_NET where they run)")
    try:
        args.allow_net_text = None if gateway else _allow_net(args)
    except ValueError as exc:
        return _fail(str(exc))
    with _Signals() as signals:
        run, servers = _Run(args, gateway, signals), None
        try:
            if not gateway:
                _preload_services()
                servers = _provision()
            return _arun(run.main(text, workload, servers, texts), signals)
        except Interrupted as exc:
            run.stopping(exc.signum)
            return 128 + exc.signum
        except _TimedOut:
            return EXIT_TIMEOUT
        except GatewayError as exc:
            return _gateway_failed(exc, gateway or "URL")
        except (OSError, httpx.TransportError) as exc:
            if not gateway or isinstance(exc, TimeoutError):
                raise
            return _unreachable(gateway, exc)
        except InfraError as exc:
            return _fail(f"cannot start the embedded stack: {exc}", EXIT_STACK)
        finally:
            run.close()
            if servers is not None:
                servers.stop()


def _preload_services() -> None:
    """Import the services in a thread while NATS and Postgres start (mostly waiting for them): the
    stack then starts without the imports' ~0.3 s."""
    import threading

    def load() -> None:
        try:
            from . import stack
            from .services.gateway import app  # noqa: F401 - FastAPI, the heaviest
            for name in stack.ALL_SERVICES:
                stack.service_class(name)
            import duckdb  # noqa: F401 - the worker's duckdb tool
        except Exception:  # noqa: BLE001 - the stack imports them again, and says what failed
            pass

    threading.Thread(target=load, name="noetl-preload", daemon=True).start()


def _migrated(path: str) -> str | None:
    """``noetl run --migrate``: the playbook through ``noetl migrate`` in memory. What needs a person is
    printed (the run goes on when the result validates); None when the file is not a playbook."""
    from .lang.documents import read_document
    from .lang.migrate import migrate_text

    text, problems = read_document(path)
    if text is None:
        for d in problems:
            print(f"{path}: {d}", file=sys.stderr)
        return None
    m = migrate_text(text)
    if m.invalid:
        for reason in m.invalid:
            print(f"{path}: {reason}", file=sys.stderr)
        return None
    if m.changed:
        print(f"{path}: migrated in memory: {len(m.changes)} change(s) (noetl migrate {path} shows them)",
              file=sys.stderr)
    for f in m.problems:
        if f.rule != "V":
            print(f"{path}:{f.line or 0}: migrate: needs a person: {f.rule}: {f.location}: {f.message}",
                  file=sys.stderr)
    return m.text


class _TimedOut(Exception):
    """``noetl run --timeout`` passed (said already)."""


class _Run:
    """One ``noetl run``: start the services (unless ``--gateway``), submit, follow, print the end.
    On a signal or ``--timeout`` an execution on the embedded stack is cancelled (so the stack stops at
    once); on a gateway it keeps running, and the message says how to follow or cancel it. The message
    comes as the stopping starts, not after it."""

    def __init__(self, args: argparse.Namespace, gateway: str | None, signals: _Signals):
        self.args, self.gateway, self.signals = args, gateway, signals
        self.execution_id: str | None = None
        self.progress = None if args.json else _Progress()
        self.started = time.monotonic()
        self.said = False

    async def main(self, text: str, workload: dict, servers: "_Servers | None", texts: dict | None = None) -> int:
        from .client import GatewayClient
        from .infra.embedded import EmbeddedNats
        from .lang.documents import read_document

        args, stack = self.args, None
        try:
            if servers is not None:
                stack = await _embedded_stack(servers, metrics_port=args.metrics_port,
                                              allow_net=getattr(args, "allow_net_text", None))
                if stack.metrics_url and not args.json:
                    print(f"metrics: {stack.metrics_url}/metrics (and /livez, /readyz)", file=sys.stderr, flush=True)
            gateway = stack.gateway_url if stack is not None else self.gateway
            # the throw-away stack's own admin token; a running gateway gets the command line's (noetl login)
            async with GatewayClient(gateway, token=stack.token if stack is not None else None) as client:
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
        from .client import GatewayClient

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
        self.started = time.monotonic()
        try:
            final = await client.wait(self.execution_id, timeout=self.args.timeout, on_event=self.progress)
            elapsed = time.monotonic() - self.started  # the execution's, not the stack's stop
        except (TimeoutError, asyncio.CancelledError) as exc:
            timed_out = isinstance(exc, TimeoutError)
            self.stopping(None if timed_out else self.signals.received)
            if cancel:
                await self._cancel(client)
            if timed_out:
                raise _TimedOut() from None
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
            print(_outcome_text(final, elapsed))
        return EXIT_OK if final["status"] == "COMPLETED" else EXIT_FAILED

    async def _cancel(self, client) -> None:
        """Cancel the execution on the embedded stack and give the cancellation a moment to reach its
        running tasks (a worker that still runs one when it stops waits for it)."""
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
        _fail(f"{why}: {what}" if what else why)


def _outcome_text(final: dict, elapsed: float) -> str:
    """The end of a run for people: the status, each step's status and result, the error; values as
    YAML (flow style on one line when short), long ones cut (``--json`` has everything)."""
    lines = [f"execution {final.get('execution_id')}: {final.get('status')} in {elapsed:.1f}s"]
    steps = final.get("steps") or {}
    width = max((len(name) for name in steps), default=0)
    for name, step in steps.items():
        head = f"  {name:<{width}}  {step.get('status')}" + (f" ({step['runs']} runs)" if step.get("runs", 1) > 1 else "")
        result = step.get("result")
        if result is None:
            lines.append(head)
            continue
        flow = _yamlish(result, flow=True)
        if "\n" not in flow and len(head) + len(flow) < 120:
            lines.append(f"{head}  {flow}")
        elif "\n" not in flow and len(flow) <= 400:  # a few lines once the terminal wraps it
            lines += [head, f"      {flow}"]
        else:
            lines.append(head)
            lines += _indented(_yamlish(result), "      ")
    if final.get("error"):
        lines.append("error:")
        lines += _indented(_yamlish(final["error"]), "  ")
    return "\n".join(lines)


def _indented(text: str, prefix: str, max_lines: int = 30) -> list[str]:
    rows = text.rstrip("\n").split("\n")
    if len(rows) > max_lines:
        rows = rows[:max_lines] + [f"... ({len(rows) - max_lines} more lines: --json shows everything)"]
    return [prefix + row for row in rows]


def _yamlish(value, flow: bool = False) -> str:
    """A JSON value as YAML: block style (multi-line strings as ``|`` blocks), or flow style on one line."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper, data: str):
        style = "|" if "\n" in data and not flow else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)

    Dumper.add_representer(str, text)
    if isinstance(value, str) and flow:
        return value if "\n" not in value else yaml.dump(value, Dumper=Dumper, width=10**9).strip()
    out = yaml.dump(value, Dumper=Dumper, default_flow_style=flow, sort_keys=False, allow_unicode=True,
                    width=10**9)  # long lines are the terminal's to wrap
    return out[:-5] if out.endswith("\n...\n") else out.rstrip("\n")


class _Progress:
    """``noetl run``'s progress: :func:`_print_progress`'s lines, and for each running loop how many
    iterations are done of how many, the rate and the time since it started: a bar redrawn in place
    when stdout is a terminal, else a plain line every ``every`` seconds and one when the loop ends."""

    SHOW_FAILED = 3  # failed iterations shown with their error, per loop

    def __init__(self, out=None, tty: bool | None = None, every: float = 2.0):
        self.out = out if out is not None else sys.stdout
        self.tty = bool(self.out.isatty()) if tty is None else tty
        self.every = every
        self.loops: dict[str, dict] = {}
        self.shown = False  # a bar is on screen
        self.drawn = ""  # what it shows

    def __call__(self, event: dict) -> None:
        name, data = event["name"], event.get("data") or {}
        key = str(event.get("step_run_id") or event.get("step"))
        now = time.monotonic()
        at = event.get("timestamp") if isinstance(event.get("timestamp"), (int, float)) else None
        if name == "loop.started":
            items = data.get("items")
            self.loops[key] = {"step": event.get("step") or "", "total": len(items) if isinstance(items, list) else None,
                               "done": set(), "failed": set(), "seen": now, "said": now, "t0": at, "t1": at}
        elif name in ("loop.iteration.done", "loop.iteration.failed") and key in self.loops:
            loop = self.loops[key]
            loop["failed" if name.endswith("failed") else "done"].add(event.get("iteration"))
            loop["t1"] = at if at is not None else loop["t1"]
            if name.endswith("failed") and len(loop["failed"]) <= self.SHOW_FAILED:
                error = data.get("error") if isinstance(data.get("error"), dict) else {}
                more = "; further failures only counted" if len(loop["failed"]) == self.SHOW_FAILED else ""
                self._line(f"  {'iteration.failed':<18} {loop['step']}[{event.get('iteration')}] "
                           f"({error.get('message', '')}){more}")
        ended = self.loops.pop(key, None) if name in ("loop.done", "step.failed") else None
        if ended is not None:
            if isinstance(data.get("total"), int):
                ended["total"] = data["total"]
            ended["t1"] = at if at is not None else ended["t1"]
            self._line(self._loop_text(ended, now, bar=False, ended=True))
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()) as said:
            _print_progress(event)
        if said.getvalue():
            self._clear()
            self.out.write(said.getvalue())
            self.out.flush()
        self._tick(now)

    @staticmethod
    def _loop_text(loop: dict, now: float, bar: bool, ended: bool = False) -> str:
        done, failed = len(loop["done"]), len(loop["failed"])
        total = loop["total"]
        # the events' own times when they are known (a poll may bring many at once), else this clock's
        timed = loop["t0"] is not None and loop["t1"] is not None
        elapsed = loop["t1"] - loop["t0"] if timed and ended else now - loop["seen"]
        span = loop["t1"] - loop["t0"] if timed and loop["t1"] > loop["t0"] else elapsed
        per_second = (done + failed) / span if span > 0 and done + failed else 0.0
        rate = f"{per_second:.1f}/s" if per_second else "-/s"
        count = f"{done + failed}/{total if total is not None else '?'}"
        extra = f", {failed} failed" if failed else ""
        left = total - done - failed if total else 0
        eta = f" ETA {left / per_second:.0f}s" if per_second and left > 0 and not ended else ""
        if bar and total:
            filled = int(20 * (done + failed) / total)
            return f"{loop['step']} [{'#' * filled}{'.' * (20 - filled)}] {count}{extra} {rate} {elapsed:.1f}s{eta}"
        return f"  {'loop':<18} {loop['step']} {count} iterations{extra}, {rate}, {elapsed:.1f}s{eta and ','}{eta}"

    def _tick(self, now: float) -> None:
        if not self.loops:
            return
        if self.tty:
            import shutil

            text = "  " + "  ".join(self._loop_text(loop, now, bar=True) for loop in self.loops.values())
            text = text[:shutil.get_terminal_size().columns - 1]
            if text != self.drawn or not self.shown:
                self.out.write("\r\x1b[K" + text)
                self.out.flush()
                self.shown, self.drawn = True, text
            return
        for loop in self.loops.values():
            if now - loop["said"] >= self.every:
                loop["said"] = now
                self._line(self._loop_text(loop, now, bar=False))

    def _line(self, text: str) -> None:
        self._clear()
        print(text, file=self.out, flush=True)

    def _clear(self) -> None:
        if self.shown:
            self.out.write("\r\x1b[K")
            self.out.flush()
            self.shown = False

    def close(self) -> None:
        self._clear()


def _print_progress(event: dict) -> None:
    name = event["name"]
    if name in ("step.started", "step.done", "step.failed", "step.skipped", "loop.done", "workflow.finished"):
        where = event.get("step") or ""
        extra = ""
        if name == "step.failed":
            extra = f" ({(event.get('data') or {}).get('error', {}).get('message', '')})"
        if name == "workflow.finished":
            extra = f" {(event.get('data') or {}).get('status')}"
        print(f"  {name:<18} {where}{extra}", flush=True)
    elif name in ("task.suspended", "playbook.child.finished", "wait.ended"):  # children and waits (D29, D30)
        data = event.get("data") or {}
        where = event.get("step") or ""
        if event.get("iteration") is not None:
            where += f"[{event['iteration']}]"
        if name == "task.suspended" and "wait" in data:
            label, extra = "waiting", f"{event.get('task')}: {_wait_text(data['wait'])}"
        elif name == "task.suspended":
            child = data.get("child") or {}
            label, extra = "child.started", f"{event.get('task')} -> {child.get('path')} ({child.get('execution_id')})"
        elif name == "wait.ended":
            outcome = data.get("outcome") or {}
            how = "ok" if outcome.get("status") == "ok" else (outcome.get("error") or {}).get("kind") or "error"
            label, extra = "wait.ended", f"{event.get('task')}: {how}"
        else:
            label, extra = "child.finished", f"{data.get('child_execution_id')} {data.get('status')}"
        print(f"  {label:<18} {where} {extra}", flush=True)


def _wait_text(wait: dict) -> str:
    """What a wait task waits for, in a few words: a signal (and its timeout) or a time."""
    if wait.get("signal"):
        timeout = f" (timeout {wait['timeout']})" if wait.get("timeout") is not None else ""
        return f"signal {wait['signal']!r}{timeout}"
    due, since = wait.get("due"), wait.get("suspended_at")
    if isinstance(due, (int, float)) and isinstance(since, (int, float)):
        return f"{max(0.0, due - since):g} s"
    return "a time"


class _Servers:
    """The NATS and Postgres of an embedded stack (or the ones NOETL_NATS_URL / NOETL_PG_DSN name) and
    its NATS credentials. The embedded NATS runs with one user per service: credentials in
    ``<home>/nats-creds`` (kept and reused), or a temporary directory; an external NATS with those of
    NOETL_NATS_CREDS (a directory or one file), if set."""

    def __init__(self, persistent: str | None):
        import tempfile

        self.persistent = persistent
        self.nats = self.pg = self.auth = None
        self.creds_dir = os.path.join(persistent, "nats-creds") if persistent else tempfile.mkdtemp(prefix="noetl-creds-")

    def stop(self) -> None:
        import shutil

        immediate = not self.persistent  # a throw-away stack's data: nothing to flush
        try:
            if self.nats is not None:
                self.nats.stop(immediate=immediate)
        finally:
            try:
                if self.pg is not None:
                    self.pg.stop(immediate=immediate)
            finally:
                if not self.persistent:
                    shutil.rmtree(self.creds_dir, ignore_errors=True)


def _provision(persistent: str | None = None) -> _Servers:
    """Start NATS and Postgres (plain code, so that a signal stops a half-started one at once); data
    under ``persistent`` (kept), else in temporary directories removed by ``stop()``."""
    from .infra.embedded import ENV_NATS_URL, provision_nats, provision_postgres
    from .infra.nats_auth import NatsAuth

    servers = _Servers(persistent)
    try:
        servers.auth = None if os.environ.get(ENV_NATS_URL) else NatsAuth(servers.creds_dir).ensure()
        servers.nats = provision_nats(store_dir=os.path.join(persistent, "nats") if persistent else None,
                                      auth=servers.auth)
        servers.pg = provision_postgres(data_dir=os.path.join(persistent, "pg") if persistent else None,
                                        fast=not persistent)
    except BaseException:
        servers.stop()
        raise
    return servers


async def _embedded_stack(servers: _Servers, processes: bool = False, metrics_port: int | None = None,
                          log_format: str | None = None, port: int = 0, counts: dict[str, int] | None = None,
                          allow_net: str | None = None):
    """Every service, on ``servers``: in this process, or (``processes``) one process each, supervised;
    the gateway on ``port`` (0: any free one), ``counts`` replicas per service (stack.parse_replicas).
    ``stop()`` stops the services; the servers are the caller's to stop. ``metrics_port``: in this
    process, the port of its one metrics server (0: a free one; None: none); with ``processes``, the
    first of the services' ports (0 or None: free ones). ``allow_net``: NOETL_SANDBOX_ALLOW_NET for the
    workers (None: the environment's)."""
    from .stack import InProcessStack, ProcessStack, Settings

    persistent = servers.persistent
    creds = str(servers.auth.directory) if servers.auth else os.environ.get("NOETL_NATS_CREDS")
    settings = Settings(nats_url=servers.nats.url, pg_dsn=servers.pg.dsn("postgres"), nats_creds=creds,
                        metrics_port=metrics_port, log_format=log_format, port=port, allow_net=allow_net,
                        home=persistent)
    token_file = os.path.join(persistent, "admin.token") if persistent else None
    if processes:
        stack = ProcessStack(settings, log_dir=persistent, supervise=True, token_file=token_file, counts=counts)
    else:
        stack = InProcessStack(settings, token_file=token_file, counts=counts)
    try:
        await stack.start()
    except BaseException:
        await stack.stop()
        raise
    return stack


def cmd_up(args: argparse.Namespace) -> int:
    """``noetl up``: the stack in the foreground until SIGINT/SIGTERM (exit 0 then); one per home."""
    from .infra.embedded import InfraError

    from .stack import parse_replicas

    home = os.path.abspath(args.home)
    try:
        args.counts = parse_replicas(args.replicas)
        args.allow_net_text = _allow_net(args)
    except ValueError as exc:
        return _fail(str(exc))
    from .infra.probes import port_free
    if args.port and not port_free("127.0.0.1", args.port):
        return _fail(f"--port {args.port}: the port is in use (another gateway or program listens there)")
    try:
        os.makedirs(home, exist_ok=True)
    except OSError as exc:
        return _fail(f"--home {home}: cannot make the directory ({exc.strerror or exc})")
    lock = HomeLock(home)
    busy = lock.acquire()
    if busy:
        return _fail(busy, EXIT_STACK)
    try:
        stale = lock.leftovers()
        if stale:
            return _fail(stale, EXIT_STACK)
        with _Signals() as signals:
            servers = None
            try:
                first = not os.path.exists(os.path.join(home, "admin.token"))
                servers = _provision(home)
                _arun(_up(args, home, servers, first, lock), signals)
            except Interrupted:
                pass  # how a stack is stopped
            except InfraError as exc:
                return _fail(f"cannot start the stack from {home}: {exc}", EXIT_STACK)
            finally:
                if servers is not None:
                    servers.stop()
    finally:
        lock.release()
    return EXIT_OK


async def _up(args: argparse.Namespace, home: str, servers: _Servers, first: bool, lock: "HomeLock") -> None:
    from .stack import shown_dsn, topology

    if args.in_process:
        from .infra import logs

        logs.configure(None, args.log_format)
    stack = await _embedded_stack(servers, processes=not args.in_process,
                                  metrics_port=args.metrics_port if not args.in_process else (args.metrics_port or 0),
                                  log_format=args.log_format, port=args.port, counts=args.counts,
                                  allow_net=getattr(args, "allow_net_text", None))
    url, stored = stack.gateway_url, False
    monitoring = getattr(servers.nats, "monitor_url", None)
    replicas: dict[str, int] = {}
    for name, _ in topology(counts=args.counts):
        replicas[name] = replicas.get(name, 0) + 1
    try:
        print(f"noetl stack up from {home}", flush=True)
        print(f"  gateway: {url} (web console at {url}/ui, OpenAPI docs at {url}/docs)", flush=True)
        print(f"  NATS: {stack.settings.nats_url} (monitoring: {monitoring or 'not known: an external server'})",
              flush=True)
        print(f"  Postgres: {shown_dsn(stack.settings.pg_dsn)}", flush=True)
        print(f"  services: {', '.join(f'{n} x{c}' if c > 1 else n for n, c in replicas.items())} "
              f"({'in this process' if args.in_process else f'one process each, logs in {home}'}); "
              "see them with `noetl ps`", flush=True)
        if stack.settings.nats_creds:
            print(f"  NATS credentials (one per service; admin.nk for tools): {stack.settings.nats_creds}", flush=True)
        metrics_urls = getattr(stack, "metrics_urls", None) or {"all services": stack.metrics_url}
        print("  metrics (/metrics, /livez, /readyz): " + ", ".join(f"{k} {v}" for k, v in metrics_urls.items()),
              flush=True)
        pids = {"nats-server": servers.nats.pid, "postgres": servers.pg.pid}
        pids.update({key: proc.pid for key, proc in getattr(stack, "procs", {}).items()})
        lock.record({"pid": os.getpid(), "home": home, "gateway": url, "nats": stack.settings.nats_url,
                     "nats_monitoring": monitoring, "metrics": metrics_urls, "postgres": shown_dsn(stack.settings.pg_dsn),
                     "replicas": replicas, "pids": {k: v for k, v in pids.items() if v}})
        stored = _local_admin(url, stack.token, os.path.join(home, "admin.token"), first, home)
        await asyncio.Event().wait()  # until a signal cancels this
    finally:
        print("stopping...", flush=True)
        await stack.stop()
        if stored:
            _forget_local_admin(url, stack.token)


def _local_admin(url: str, token: str | None, token_file: str, first: bool, home: str = "") -> bool:
    """``noetl up``'s word on logging in. The home's admin API token (``admin.token``, 0600) is stored
    in the command line's token store for this gateway's URL, unless a token is stored for it already,
    so that local commands (``--gateway URL``) work at once; ``noetl up`` removes it again when it stops
    (the next start may listen on another port). True when it stored it."""
    from .client import store_token, stored_token

    if first and token:
        print(f"first start: created the admin user 'admin'; its API token (no expiry) is in {token_file} "
              "(mode 0600): keep it safe", flush=True)
    if not token:
        print(f"log in: noetl login --gateway {url} [--username NAME] (the admin's token was in {token_file})",
              flush=True)
        return False
    stored = stored_token(url) is None
    if stored:
        where = store_token(url, token)
        print(f"noetl commands use it for this gateway (kept in {where} while the stack runs); "
              f"{finding(home)}", flush=True)
    print(f"elsewhere: noetl login --gateway {url} --token - < {token_file}; give the admin a password "
          f"with `noetl user password`, add users with `noetl user add`", flush=True)
    return stored


def _forget_local_admin(url: str, token: str | None) -> None:
    from .client import store_token, stored_token

    if token and stored_token(url) == token:
        store_token(url, None)


def _nats_settings(args: argparse.Namespace):
    """``--nats-url``/``NOETL_NATS_URL`` and ``--nats-creds``/``NOETL_NATS_CREDS`` (an nkey seed file, or
    a directory of them: the service's own is taken), checked before anything starts."""
    from .infra.nats_auth import read_seed
    from .stack import Settings

    nats_url = args.nats_url or os.environ.get("NOETL_NATS_URL")
    if not nats_url:
        raise ValueError("--nats-url (or NOETL_NATS_URL) is required")
    creds = args.nats_creds or os.environ.get("NOETL_NATS_CREDS") or None
    settings = Settings(nats_url=nats_url, pool=getattr(args, "pool", "default"), nats_creds=creds)
    if creds:
        read_seed(settings.creds_for(args.name))
    return settings


def cmd_service(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from .stack import serve_forever

    try:
        settings = _nats_settings(args)
        if args.name == "worker":  # D33: a bad sandbox setting stops the worker here, in one line
            from .sandbox.policy import from_env

            from_env()
    except ValueError as exc:
        return _fail(str(exc))
    from .infra import logs
    from .infra.probes import PortTaken

    logs.configure(args.name, args.log_format)
    # the default port, when taken (another service on this host), leaves the service without one:
    # found by binding it, not by looking first (two services starting at once both saw it free)
    port = DEFAULT_METRICS_PORT if args.metrics_port is None else args.metrics_port
    from .infra.tls import pg_dsn

    try:  # NOETL_PG_PASSWORD_FILE: the password from a file (a compose secret), not from the DSN
        dsn = pg_dsn(args.pg_dsn or os.environ.get("NOETL_PG_DSN"))
    except ValueError as exc:
        return _fail(f"{args.name}: {exc}")
    settings = replace(settings, pg_dsn=dsn, concurrency=args.concurrency,
                       host=args.host, port=args.port, ack_wait=args.ack_wait,
                       metrics_port=None if port < 0 else port, metrics_optional=args.metrics_port is None,
                       metrics_host=args.metrics_host, home=os.path.abspath(args.home))
    try:
        run_loop(serve_forever(args.name, settings))
    except PortTaken as exc:
        return _fail(f"{args.name}: {exc}; choose another --metrics-port (0: any free one, -1: none)")
    except ValueError as exc:  # a mistake in the settings (credentials, TLS): one line, exit 2
        return _fail(str(exc))
    return EXIT_OK


def cmd_setup(args: argparse.Namespace) -> int:
    """``noetl setup``: create the streams, the membership bucket and the payload store (as the admin)."""
    from .stack import setup

    args.name = "admin"
    try:
        settings = _nats_settings(args)
    except ValueError as exc:
        return _fail(str(exc))
    try:
        asyncio.run(setup(settings))
    except ValueError as exc:  # NATS refused the credentials, its certificate does not verify, a bad TLS setting
        return _fail(str(exc))
    print(f"streams, bucket and object store ready at {settings.nats_url}")
    return EXIT_OK


def cmd_bootstrap(args: argparse.Namespace) -> int:
    """``noetl bootstrap``: the first admin of a deployment (docker-compose.yml), as the NATS admin: the
    sessions service creates it only while no user exists and answers an API token for it, written to
    ``--out`` (0600) or, with ``--out -``, to stdout alone (messages go to stderr)."""
    from .infra.bus import BusError, NatsRefused
    from .stack import bootstrap

    args.name = "admin"
    try:
        settings = _nats_settings(args)
    except ValueError as exc:
        return _fail(str(exc))
    if args.out != "-" and os.path.exists(args.out):
        return _fail(f"--out {args.out}: exists; the token is written once (remove the file, or --out -)")
    try:  # connecting retries for ever (a service waits for NATS): the whole is bounded here
        token = asyncio.run(asyncio.wait_for(bootstrap(settings, None, username=args.username, timeout=args.timeout),
                                             args.timeout))
    except NatsRefused as exc:
        return _fail(str(exc))
    except (BusError, TimeoutError) as exc:
        return _fail(f"no NATS or no sessions service answered at {settings.nats_url} within {args.timeout:g}s"
                     + (f" ({exc})" if str(exc) else ""), EXIT_UNREACHABLE)
    if token is None:
        return _fail("the stack has users already: log in as one of them (noetl login)", EXIT_FAILED)
    if args.out == "-":
        print(token, flush=True)
    else:
        fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
    where = "stdout" if args.out == "-" else args.out
    print(f"created the admin {args.username}; its API token is in {where}: noetl login --gateway URL --token - "
          f"< {'FILE' if args.out == '-' else args.out}", file=sys.stderr)
    return EXIT_OK


def cmd_nats_credentials(args: argparse.Namespace) -> int:
    """``noetl nats-credentials --out DIR``: one nkey seed per service (kept if present) and the server's
    ``authorization`` block (public keys and permissions), for deploy/nats.conf to include."""
    from .infra.nats_auth import NatsAuth

    try:
        auth = NatsAuth(args.out, pools=args.pool or ["default"], partitions=args.partitions).ensure()
    except ValueError as exc:
        return _fail(str(exc))
    except OSError as exc:
        return _fail(f"--out {args.out}: {exc.strerror or exc}")
    print(f"{auth.config_file}: the server's users ({auth.partitions} partitions, pools {', '.join(auth.pools)})")
    for user in auth.users:
        print(f"{auth.file(user)}: the seed of {user} (keep it secret; NOETL_NATS_CREDS or --nats-creds)")
    if args.reader is not None:
        try:
            auth.grant_read(args.reader)
        except ValueError as exc:
            return _fail(str(exc))
        print(f"the seeds are readable by uid {args.reader} too (an ACL entry: ls -l shows a +)")
    return EXIT_OK


def cmd_certs(args: argparse.Namespace) -> int:
    """``noetl certs --out DIR``: a development CA, the stack's certificates and the Postgres password
    (infra/certs.py); what exists and still fits is kept, so it can run again (another --host, a renewal)."""
    from .infra.certs import ensure

    if args.days < 1:
        return _fail("--days: at least 1")
    try:
        report = ensure(args.out, hosts=args.host, clients=args.client, reader=args.reader, days=args.days,
                        nats_hosts=args.nats_host)
    except ValueError as exc:
        return _fail(str(exc))
    except OSError as exc:
        return _fail(f"--out {args.out}: {exc.strerror or exc}")
    for line in report.lines:
        print(line)
    if args.reader is not None:
        print(f"gateway.key, postgres.password and the client keys are readable by uid {args.reader} too (an ACL "
              "entry: ls -l shows a +)")
    return EXIT_OK


def add_certs_parser(sub) -> None:
    """``noetl certs``'s options (build_parser calls it where the command is listed)."""
    p = sub.add_parser("certs", help="make a development CA and the TLS certificates of a container stack (NATS, its "
                                     "routes, Postgres, the gateway and its proxy) and the Postgres password; "
                                     "keeps what exists and still fits")
    p.add_argument("--out", required=True, metavar="DIR", help="directory for the CA, certificates and keys (0700)")
    p.add_argument("--host", action="append", default=[], metavar="NAME",
                   help="another name (or address) clients reach NATS and the proxy by (repeatable)")
    p.add_argument("--nats-host", action="append", default=[], metavar="NAME",
                   help="another name of the NATS nodes, for their clients and their routes alike (repeatable): "
                        "nats-0.nats, nats-1.nats, nats-2.nats for deploy/k8s's StatefulSet")
    p.add_argument("--client", action="append", default=[], metavar="NAME",
                   help="also a client certificate client-NAME.crt (for a NATS server that verifies clients; repeatable)")
    p.add_argument("--days", type=int, default=397, help="validity of a new certificate (default 397; the CA: 10 years)")
    p.add_argument("--reader", type=int, metavar="UID", help="let this user read the keys the services read too (an "
                   "ACL entry): the containers' user, 10001, for docker-compose.yml's secrets")
    p.set_defaults(func=cmd_certs)


def _columns() -> dict:
    """The columns a table shows for the commands whose records are wide (the rest: every plain field)."""
    return {
        cmd_events: ("timestamp", "name", "step", "task", "iteration", "attempt", "status"),
        cmd_waits: ("execution_id", "step", "task", "signal", "assignee", "timeout_at", "started_at"),
    }


def _gateway_call(args: argparse.Namespace, fn) -> int:
    import httpx

    from .client import GatewayClient, GatewayError

    from .output import emit

    async def main() -> int:
        async with GatewayClient(args.gateway) as client:
            emit(await fn(client), getattr(args, "output", None), _columns().get(getattr(args, "func", None)))
            return EXIT_OK

    try:
        return asyncio.run(main())
    except GatewayError as exc:
        return _gateway_failed(exc, args.gateway)
    except (OSError, httpx.TransportError) as exc:  # e.g. no gateway listening
        return _unreachable(args.gateway, exc)


# the gateway a command fell back to when neither --gateway, NOETL_GATEWAY_URL nor a running noetl up
# named one, and the home it looked in (main sets it; _unreachable says where to look instead)
_FALLBACK: dict[str, str | None] = {"gateway": None, "home": None}


def _unreachable(gateway: str, exc: BaseException, more: str = "") -> int:
    """One line for a gateway that does not answer (nothing listens, a wrong URL, a timeout). A closed
    standard output (``noetl events ID | head -1``) is not the gateway's doing: it ends quietly (main)."""
    if isinstance(exc, BrokenPipeError):
        raise exc
    reason = str(exc) or type(exc).__name__
    from .infra import tls

    if tls.is_verify_failure(exc):  # one line: where, why, and which setting
        return _fail(f"the gateway at {gateway}: {tls.verify_failure(exc, os.environ.get(tls.GATEWAY_CA), tls.GATEWAY_CA)}"
                     f"{more}", EXIT_UNREACHABLE)
    if gateway == _FALLBACK["gateway"] and _FALLBACK["home"] and not more:  # nothing told it where to look
        more = (f"; no noetl up runs from {_FALLBACK['home']}: start one there (noetl up), or point at one with "
                "--home DIR, NOETL_HOME=DIR or --gateway URL")
    return _fail(f"cannot reach the gateway at {gateway} ({reason}){more}", EXIT_UNREACHABLE)


def _gateway_failed(exc, gateway: str) -> int:
    if exc.status == 401:
        return _fail(f"{exc}\n  log in with `noetl login --gateway {gateway}` (or set NOETL_TOKEN)", EXIT_FAILED)
    return _fail(str(exc), EXIT_FAILED)


def cmd_register(args: argparse.Namespace) -> int:
    """``noetl register FILE...``: add playbooks to a running gateway's catalog (a new version each)."""
    from .lang.validate import validate_file

    for path in args.files:
        result = validate_file(path)
        if not result.ok:
            for d in result.errors:
                print(f"{path}: {d}", file=sys.stderr)
            return EXIT_INVALID

    async def register(client):
        from .lang.documents import read_document

        return [await client.register(read_document(path)[0]) for path in args.files]

    return _gateway_call(args, register)


def cmd_completion(args: argparse.Namespace) -> int:
    """``noetl completion bash|zsh|fish``: the shell's completion script, from this parser."""
    from .completion import script

    print(script(args.shell, build_parser()), end="")
    return EXIT_OK


def cmd_ls(args: argparse.Namespace) -> int:
    """``noetl ls``: executions, newest first, with the console's filters; a table, or ``--json``."""
    import httpx

    from .client import GatewayClient, GatewayError

    if not 1 <= args.limit <= 1000 or args.offset < 0:
        return _fail("--limit is 1 to 1000 and --offset 0 or more", EXIT_INVALID)

    async def main() -> list[dict]:
        async with GatewayClient(args.gateway) as client:
            return await client.list_executions(status=args.status, limit=args.limit, user=args.user,
                                                path=args.playbook, since=args.since, until=args.until,
                                                offset=args.offset)

    try:
        rows = asyncio.run(main())
    except GatewayError as exc:
        return _gateway_failed(exc, args.gateway)
    except (OSError, httpx.TransportError) as exc:
        return _unreachable(args.gateway, exc)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return EXIT_OK
    print(_executions_table(rows))
    if len(rows) == args.limit:
        print(f"(the {args.limit} newest; --offset {args.offset + args.limit} for the next page)", file=sys.stderr)
    return EXIT_OK


def _executions_table(rows: list[dict]) -> str:
    """Executions as a table for people: id, status, playbook, who started it, when, how long."""
    from datetime import datetime

    def when(value: Any) -> str:
        return str(value or "")[:19].replace("T", " ")

    def took(row: dict) -> str:
        try:
            start = datetime.fromisoformat(str(row["started_at"] or row["created_at"]))
            end = datetime.fromisoformat(str(row["finished_at"])) if row.get("finished_at") else None
        except (TypeError, ValueError, KeyError):
            return ""
        if end is None:
            return "running" if row.get("status") in ("RUNNING", "PENDING") else ""
        seconds = (end - start).total_seconds()
        return f"{seconds:.1f}s" if seconds < 60 else f"{seconds / 60:.1f}m" if seconds < 3600 else f"{seconds / 3600:.1f}h"

    header = ("EXECUTION", "STATUS", "PLAYBOOK", "STARTED BY", "CREATED", "TOOK")
    table = [header] + [(str(r.get("execution_id")), str(r.get("status")), str(r.get("path") or ""),
                         str(r.get("requested_by_name") or ("(child)" if r.get("parent_execution_id") else "")),
                         when(r.get("created_at")), took(r)) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table)


def cmd_status(args: argparse.Namespace) -> int:
    return _gateway_call(args, lambda c: c.status(args.execution_id))


def cmd_events(args: argparse.Namespace) -> int:
    """``noetl events ID [--name N]... [--step S] [--task T] [--iteration I] [--follow]``: the execution's
    events in log order (the API's filters); ``--follow`` prints them as they come, until the end."""
    filters = {"name": args.name or None, "step": args.step, "task": args.task, "iteration": args.iteration}
    if not args.follow:
        return _gateway_call(args, lambda c: c.all_events(args.execution_id, **filters))
    import httpx

    from .client import GatewayClient, GatewayError
    from .output import chosen, table

    fmt = chosen(args.output)

    async def follow() -> int:
        async with GatewayClient(args.gateway) as client:
            offset, header = 0, True
            while True:
                page = await client.events(args.execution_id, offset=offset, **filters)
                for event in page["events"]:
                    if fmt == "table":
                        lines = table([event], _columns()[cmd_events]).splitlines()
                        print("\n".join(lines if header else lines[1:]), flush=True)
                        header = False
                    else:
                        print(json.dumps(event, default=str), flush=True)  # one event per line
                offset += len(page["events"])
                if not page["events"]:
                    status = await client.status(args.execution_id, brief=True)
                    if status.get("status") in ("COMPLETED", "FAILED", "CANCELLED"):
                        rest = await client.events(args.execution_id, offset=offset, **filters)
                        if not rest["events"]:
                            return EXIT_OK
                        continue
                    await asyncio.sleep(0.5)

    try:
        return asyncio.run(follow())
    except GatewayError as exc:
        return _gateway_failed(exc, args.gateway)
    except (OSError, httpx.TransportError) as exc:
        return _unreachable(args.gateway, exc)


def cmd_cancel(args: argparse.Namespace) -> int:
    return _gateway_call(args, lambda c: c.cancel(args.execution_id))


def cmd_restart(args: argparse.Namespace) -> int:
    """``noetl restart ID --from STEP [--workload JSON] [--json]`` (D32): a new execution that goes on
    from STEP of the finished execution ID, followed to its end as ``noetl run`` follows one; exit 0
    COMPLETED, 1 FAILED/CANCELLED or refused by the gateway, 2 bad arguments, 3 --timeout passed (it
    keeps running), 4 no gateway."""
    import httpx

    from .client import GatewayError

    try:
        workload = json.loads(args.workload) if args.workload else None
    except json.JSONDecodeError as exc:
        return _fail(f"--workload is not valid JSON: {exc}")
    if workload is not None and not isinstance(workload, dict):
        return _fail("--workload must be a JSON object")
    with _Signals() as signals:
        run = _Run(args, args.gateway, signals)
        try:
            return _arun(run.restart(args.execution_id, args.from_step, workload), signals)
        except Interrupted as exc:
            run.stopping(exc.signum)
            return 128 + exc.signum
        except _TimedOut:
            return EXIT_TIMEOUT
        except GatewayError as exc:
            return _gateway_failed(exc, args.gateway)
        except (OSError, httpx.TransportError) as exc:
            if isinstance(exc, TimeoutError):
                raise
            return _unreachable(args.gateway, exc)
        finally:
            run.close()


def cmd_signal(args: argparse.Namespace) -> int:
    """``noetl signal ID NAME [--data JSON]`` (D30)."""
    try:
        payload = json.loads(args.data) if args.data is not None else None
    except json.JSONDecodeError as exc:
        return _fail(f"--data is not JSON: {exc}")
    return _gateway_call(args, lambda c: c.signal(args.execution_id, args.name, payload))


def cmd_waits(args: argparse.Namespace) -> int:
    return _gateway_call(args, lambda c: c.waits(args.execution_id))


def cmd_verify(args: argparse.Namespace) -> int:
    """``noetl verify ID...|--all``: check executions' event logs (core/verify.py); exit 0 when every
    log is sound, 1 when any has a finding, 2 for bad arguments."""
    import httpx

    from .client import GatewayClient, GatewayError
    from .core.verify import verify

    if bool(args.execution_ids) == bool(args.all):
        return _fail("give execution ids or --all (not both)")

    async def main() -> int:
        async with GatewayClient(args.gateway) as client:
            ids = args.execution_ids or [x["execution_id"] for x in await client.list_executions(all_pages=True)]
            reports = []
            for xid in ids:
                try:
                    reports.append(verify(await client.all_events(xid), xid))
                except GatewayError as exc:
                    if exc.status != 404:
                        raise
                    reports.append(None)
                    print(f"{xid}: not found", file=sys.stderr)
        bad = [r for r in reports if r is None or not r.ok]
        if args.json:
            print(json.dumps([r.as_dict() for r in reports if r is not None], indent=2))
        else:
            for r in reports:
                if r is None:
                    continue
                print(f"{r.execution_id}: {'ok' if r.ok else 'FINDINGS'} ({r.status}, {r.events} events)")
                for f in r.findings:
                    where = " ".join(f"{k}={v}" for k, v in f.as_dict().items() if k not in ("check", "message"))
                    print(f"  {f.check}: {f.message}" + (f" [{where}]" if where else ""))
            print(f"{len(reports) - len(bad)} of {len(reports)} execution(s) verified without findings")
        return EXIT_FAILED if bad else EXIT_OK

    try:
        return asyncio.run(main())
    except GatewayError as exc:
        return _gateway_failed(exc, args.gateway)
    except (OSError, httpx.TransportError) as exc:
        return _unreachable(args.gateway, exc)


def cmd_credential(args: argparse.Namespace) -> int:
    """``noetl credential add|list|delete`` against a gateway (D24)."""
    if args.action == "add":
        try:
            data = json.loads(args.data)
        except json.JSONDecodeError as exc:
            return _fail(f"--data is not valid JSON: {exc}")
        if not isinstance(data, dict) or not data:
            return _fail("--data must be a non-empty JSON object")
        return _gateway_call(args, lambda c: c.credential_put(args.name, args.kind, data, args.description))
    if args.action == "list":
        return _gateway_call(args, lambda c: c.credential_list())
    return _gateway_call(args, lambda c: c.credential_delete(args.name))


# --------------------------------------------------------------------------------- who: logins, users, tokens
def _secret(prompt: str, from_stdin: bool, confirm: bool = False) -> str:
    """A password from the terminal (not echoed) or, with ``--password-stdin``, the first line of stdin."""
    import getpass

    if from_stdin:
        return sys.stdin.readline().rstrip("\r\n")
    value = getpass.getpass(prompt)
    if confirm and getpass.getpass("again: ") != value:
        raise ValueError("the two passwords differ")
    return value


def cmd_login(args: argparse.Namespace) -> int:
    """``noetl login``: a password (prompted), an OIDC ID token, or an API token to keep; the token is
    stored for the gateway (``client.store_token``)."""
    import httpx

    from .client import TOKEN_ENV, GatewayClient, GatewayError, store_token, stored_token

    if args.token and args.oidc_token:
        return _fail("give --token or --oidc-token, not both")
    try:
        username = password = None
        if not args.token and not args.oidc_token:
            username = args.username or input("username: ").strip()
            password = _secret(f"password for {username}: ", args.password_stdin)
    except (EOFError, KeyboardInterrupt, ValueError) as exc:
        return _fail(f"no password read ({type(exc).__name__})")

    async def main() -> int:
        previous = stored_token(args.gateway)
        async with GatewayClient(args.gateway) as client:
            client.use(None)
            if args.token:
                client.use((sys.stdin.readline() if args.token == "-" else args.token).strip())
                who = await client.whoami()
            else:
                who = (await client.login(username, password, id_token=args.oidc_token))["principal"]
            path = store_token(args.gateway, client.token)
            if previous and previous != client.token and previous.startswith("noetl_s_"):
                client.use(previous)  # the session this login replaces ends
                try:
                    await client.logout()
                except GatewayError:
                    pass
        kind = f"API token {who.get('token_name')!r}" if who.get("kind") == "token" else "a session"
        print(f"logged in to {args.gateway} as {who['username']} (roles {', '.join(who['roles']) or 'none'}) "
              f"with {kind}; the token is kept in {path}")
        if os.environ.get(TOKEN_ENV):
            print(f"note: {TOKEN_ENV} is set and is sent instead of the stored token", file=sys.stderr)
        return EXIT_OK

    try:
        return asyncio.run(main())
    except GatewayError as exc:
        return _fail(str(exc), EXIT_FAILED)
    except (OSError, httpx.TransportError) as exc:
        return _unreachable(args.gateway, exc)


def cmd_logout(args: argparse.Namespace) -> int:
    """``noetl logout``: end the stored session and forget it. An API token is only forgotten here
    (``noetl token revoke`` revokes it)."""
    import httpx

    from .client import TOKEN_ENV, GatewayClient, GatewayError, store_token, stored_token

    token = stored_token(args.gateway)
    if token is None:
        extra = f" ({TOKEN_ENV} is set: unset it)" if os.environ.get(TOKEN_ENV) else ""
        print(f"no token stored for {args.gateway}{extra}")
        return EXIT_OK
    if token.startswith("noetl_s_"):
        async def main() -> None:
            async with GatewayClient(args.gateway, token=token) as client:
                await client.logout()

        try:
            asyncio.run(main())
        except GatewayError as exc:
            if exc.status != 401:  # 401: ended already
                return _fail(f"{exc}; the token is still stored", EXIT_FAILED)
        except (OSError, httpx.TransportError) as exc:
            return _unreachable(args.gateway, exc, "; the token is still stored")
        store_token(args.gateway, None)
        print(f"logged out of {args.gateway}")
    else:
        store_token(args.gateway, None)
        print(f"forgot the API token stored for {args.gateway}; it stays valid until revoked "
              "(`noetl token revoke ID`)")
    return EXIT_OK


def cmd_whoami(args: argparse.Namespace) -> int:
    return _gateway_call(args, lambda c: c.whoami())


def cmd_session(args: argparse.Namespace) -> int:
    if args.action == "list":
        return _gateway_call(args, lambda c: c.sessions(args.user))
    if bool(args.session_id) == bool(args.user):
        return _fail("give a session id, or --user USER (me: every session of yours)")
    if args.session_id:
        return _gateway_call(args, lambda c: c.revoke_session(args.session_id))
    return _gateway_call(args, lambda c: c.revoke_sessions(args.user))


def cmd_user(args: argparse.Namespace) -> int:
    try:
        if args.action == "add":
            password = _secret(f"password for {args.username}: ", args.password_stdin, confirm=True) \
                if (args.password or args.password_stdin) else None
            return _gateway_call(args, lambda c: c.add_user(args.username, args.role or None, password,
                                                            args.email, args.display_name))
        if args.action == "password":
            own = args.user in (None, "me")
            current = (_secret("current password (empty if none): ", args.password_stdin) or None) if own else None
            password = _secret("new password: ", args.password_stdin, confirm=not args.password_stdin)
            return _gateway_call(args, lambda c: c.set_password(password, args.user or "me", current))
    except (EOFError, KeyboardInterrupt, ValueError) as exc:
        return _fail(f"no password read: {exc or type(exc).__name__}")
    if args.action == "list":
        return _gateway_call(args, lambda c: c.users())
    if args.action == "roles":
        return _gateway_call(args, lambda c: c.set_roles(args.user, args.roles))
    action = {"disable": "disable_user", "enable": "enable_user"}[args.action]
    return _gateway_call(args, lambda c: getattr(c, action)(args.user))


def cmd_token(args: argparse.Namespace) -> int:
    if args.action == "create":
        return _gateway_call(args, lambda c: c.create_token(args.name, args.role or None, args.expires_in))
    if args.action == "list":
        return _gateway_call(args, lambda c: c.tokens(args.user))
    return _gateway_call(args, lambda c: c.revoke_token(args.token_id))


def _auth_commands(sub, gateway_default: str) -> None:
    roles = "admin, developer, operator or viewer"

    def gw(p):
        p.add_argument("--gateway", default=gateway_default, metavar="URL", help=GATEWAY_HELP)
        return p

    p = gw(sub.add_parser("login", help="log in to a gateway and keep the token (password, OIDC or API token)"))
    p.add_argument("--username", help="the user to log in as (asked for when not given)")
    p.add_argument("--password-stdin", action="store_true", help="read the password from stdin instead of asking")
    p.add_argument("--token", metavar="TOKEN", help="keep this API token instead of logging in ('-': read it "
                                                    "from stdin, out of the shell's history)")
    p.add_argument("--oidc-token", metavar="TOKEN", help="log in with an OIDC ID token")
    p.set_defaults(func=cmd_login)
    gw(sub.add_parser("logout", help="end the stored session and forget its token")).set_defaults(func=cmd_logout)
    gw(sub.add_parser("whoami", help="who the stored token is, and what it may do")).set_defaults(func=cmd_whoami)

    p = sub.add_parser("session", help="login sessions: list, revoke")
    ssub = p.add_subparsers(dest="action", required=True)
    c = gw(ssub.add_parser("list", help="live sessions (yours, or --user's with session.any)"))
    c.add_argument("--user", help="a user id or username (default: you)")
    c = gw(ssub.add_parser("revoke", help="end a session, or every session of --user"))
    c.add_argument("session_id", nargs="?", help="the session to end (or --user)")
    c.add_argument("--user", help="a user id or username; me: every session of yours")
    for c in ssub.choices.values():
        c.set_defaults(func=cmd_session)

    p = sub.add_parser("user", help="users: add, list, disable, enable, roles, password (admins; password: anyone)")
    usub = p.add_subparsers(dest="action", required=True)
    c = gw(usub.add_parser("add", help="add a user"))
    c.add_argument("username", help="the new user's login name")
    c.add_argument("--role", action="append", help=f"{roles}; repeatable; default viewer")
    c.add_argument("--email", help="the user's e-mail address (matched by OIDC logins)")
    c.add_argument("--display-name", help="the user's full name, for display")
    c.add_argument("--password", action="store_true", help="ask for a password (else: OIDC logins only)")
    c.add_argument("--password-stdin", action="store_true", help="read the password from stdin")
    gw(usub.add_parser("list", help="every user"))
    for verb in ("disable", "enable"):
        gw(usub.add_parser(verb, help=f"{verb} a user" + (" (its sessions and tokens are revoked)"
                                                          if verb == "disable" else ""))).add_argument(
            "user", help="a user id or username")
    c = gw(usub.add_parser("roles", help="set a user's roles"))
    c.add_argument("user", help="a user id or username")
    c.add_argument("roles", nargs="+", help=roles)
    c = gw(usub.add_parser("password", help="change your password, or (admins) a user's"))
    c.add_argument("user", nargs="?", help="a user id or username (default: yourself)")
    c.add_argument("--password-stdin", action="store_true",
                   help="read from stdin: the current password (yours; empty line if none), then the new one")
    for c in usub.choices.values():
        c.set_defaults(func=cmd_user)

    p = sub.add_parser("token", help="API tokens: create, list, revoke")
    tsub = p.add_subparsers(dest="action", required=True)
    c = gw(tsub.add_parser("create", help="a new API token for you (printed once)"))
    c.add_argument("name", help="what the token is for (shown by `noetl token list`)")
    c.add_argument("--role", action="append", help=f"{roles}; repeatable; default: your roles")
    c.add_argument("--expires-in", type=int, metavar="SECONDS",
                   help="seconds until the token expires (at most what your session or token has left; default: all of it)")
    c = gw(tsub.add_parser("list", help="your API tokens (or --user's with token.any)"))
    c.add_argument("--user", help="a user id or username (default: you)")
    c = gw(tsub.add_parser("revoke", help="revoke an API token"))
    c.add_argument("token_id", help="the token's id (from `noetl token list`)")
    for c in tsub.choices.values():
        c.set_defaults(func=cmd_token)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="noetl", description="Run NoETL playbooks as Petri nets over NATS.", epilog=EXIT_CODES)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}",
                        help="print the version and exit")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("validate", help="check playbooks; every error with its location")
    p.add_argument("files", nargs="+", metavar="FILE", help="playbook files (YAML)")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("lint", help="check that playbooks will behave: joins, cycles, ctx races, template names "
                       "(docs/lint.md)")
    p.add_argument("files", nargs="+", metavar="FILE", help="playbook files (YAML)")
    p.add_argument("--format", choices=("text", "json", "sarif"), default="text",
                   help="text for people, json or sarif (code-scanning tools) for machines")
    p.set_defaults(func=cmd_lint)

    p = sub.add_parser("schema", help="print the JSON Schema of the playbook language")
    p.set_defaults(func=cmd_schema)

    p = sub.add_parser("asyncapi", help="print the AsyncAPI 3.0 document of the NATS subjects, streams, buckets "
                                        "and messages")
    p.add_argument("--yaml", action="store_true", help="YAML instead of JSON")
    p.set_defaults(func=cmd_asyncapi)

    gateway_default = None  # resolved after parsing: NOETL_GATEWAY_URL, the running `noetl up`'s, 127.0.0.1:8082
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
    p.add_argument("--metrics-port", type=int, metavar="PORT", default=_env_int("NOETL_METRICS_PORT"),
                   help="embedded stack: serve /metrics, /livez, /readyz of its services on this port (0: a free "
                        "one, printed; NOETL_METRICS_PORT; default: none)")
    p.add_argument("--migrate", action="store_true",
                   help="run the playbook (and the --register ones) through `noetl migrate` in memory first, for "
                        "a quick try of a legacy playbook; what needs a person is printed")
    p.add_argument("--allow-net", action="append", metavar="HOST[:PORT]|CIDR", help=ALLOW_NET_HELP)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("migrate", help="rewrite legacy NoETL playbooks into the canonical language (docs/migrate.md)",
                       epilog=MIGRATE_EXIT_CODES)
    p.add_argument("files", nargs="+", metavar="FILE", help="playbook files (YAML)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the files in place (comments and key order kept)")
    mode.add_argument("--diff", action="store_true", help="print a unified diff instead of the rewritten playbook")
    mode.add_argument("--check", action="store_true",
                      help=f"print nothing but the report; exit {EXIT_FAILED} when a file would change")
    p.set_defaults(func=cmd_migrate)

    p = sub.add_parser("register", help="add playbooks to the catalog of a running gateway")
    p.add_argument("files", nargs="+", metavar="FILE", help="playbook files (YAML)")
    p.add_argument("--gateway", default=gateway_default, metavar="URL", help=GATEWAY_HELP)
    p.set_defaults(func=cmd_register)

    p = sub.add_parser("up", help="start NATS, Postgres and every service in the foreground")
    p.add_argument("--home", default=os.environ.get("NOETL_HOME", ".noetl"), metavar="DIR",
                   help="data and logs directory (NOETL_HOME); one stack per home")
    p.add_argument("--in-process", action="store_true", help="all services in this process (default: one process each)")
    p.add_argument("--port", type=int, default=0, metavar="PORT",
                   help="the gateway's port on 127.0.0.1 (default: any free port; `noetl up` prints it)")
    p.add_argument("--replicas", metavar="SERVICE=N,...",
                   help="replicas per service, e.g. admission=2,router=2,worker=3 (admission, router, loop-coordinator, "
                        "scheduler, sessions, worker; default one each)")
    p.add_argument("--metrics-port", type=int, metavar="PORT", default=_env_int("NOETL_METRICS_PORT"),
                   help="metrics ports (/metrics, /livez, /readyz): the services take PORT, PORT+1, ... (one port "
                        "for --in-process); 0 or unset: free ports, printed (NOETL_METRICS_PORT)")
    p.add_argument("--log-format", choices=("text", "json"), default=os.environ.get("NOETL_LOG_FORMAT", "text"),
                   help="the services' log lines: text, or one JSON object per line (NOETL_LOG_FORMAT)")
    p.add_argument("--allow-net", action="append", metavar="HOST[:PORT]|CIDR", help=ALLOW_NET_HELP)
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("service", help="run one service")
    p.add_argument("name", choices=["gateway", "admission", "router", "loop-coordinator", "event-recorder",
                                    "credentials", "sessions", "worker", "scheduler"], help="which service")
    p.add_argument("--nats-url", metavar="URL", help="the NATS server (default: NOETL_NATS_URL)")
    p.add_argument("--nats-creds", metavar="FILE",
                   help="the service's NATS credentials (nkey seed file, or a directory of them; NOETL_NATS_CREDS)")
    p.add_argument("--pg-dsn", metavar="DSN", help="Postgres, for the event-recorder and the credentials service "
                   "(default: NOETL_PG_DSN, which keeps a password off the command line other users can read)")
    p.add_argument("--home", default=os.environ.get("NOETL_HOME", ".noetl"), metavar="DIR",
                   help="the stack's home (NOETL_HOME, default .noetl): the credentials service keeps its key file "
                        "credential.key there unless NOETL_CREDENTIAL_KEY is set")
    p.add_argument("--pool", default="default", help="worker: the pool whose commands it takes")
    p.add_argument("--concurrency", type=int, default=8, help="worker: commands run at once")
    p.add_argument("--ack-wait", type=float, default=30.0, metavar="SECONDS",
                   help="worker: seconds before an unacknowledged command is redelivered")
    p.add_argument("--host", default="127.0.0.1", help="gateway: the address to listen on")
    p.add_argument("--port", type=int, default=8082, help="gateway: the port to listen on")
    p.add_argument("--metrics-port", type=int, metavar="PORT", default=_env_int("NOETL_METRICS_PORT"),
                   help=f"serve /metrics, /livez, /readyz on this port (0: a free one, logged; -1: none; "
                        f"NOETL_METRICS_PORT; default {DEFAULT_METRICS_PORT}, skipped with a warning when taken)")
    p.add_argument("--metrics-host", default=os.environ.get("NOETL_METRICS_HOST", "127.0.0.1"), metavar="HOST",
                   help="the address of the metrics port (NOETL_METRICS_HOST; 0.0.0.0 in a container)")
    p.add_argument("--log-format", choices=("text", "json"), default=os.environ.get("NOETL_LOG_FORMAT", "text"),
                   help="text lines, or one JSON object per line (NOETL_LOG_FORMAT); with the execution and trace "
                        "ids where there are some")
    p.set_defaults(func=cmd_service)

    p = sub.add_parser("setup", help="create the streams, bucket and object store (as the NATS admin user)")
    p.add_argument("--nats-url", metavar="URL", help="the NATS server (default: NOETL_NATS_URL)")
    p.add_argument("--nats-creds", metavar="FILE", help="the admin's credentials (NOETL_NATS_CREDS)")
    p.set_defaults(func=cmd_setup)

    p = sub.add_parser("bootstrap", help="create the first admin of a new stack and write its API token (as the NATS "
                                         "admin user; docker-compose.yml's stacks: noetl up and run do it themselves)")
    p.add_argument("--out", required=True, metavar="FILE", help="where the token goes (created 0600; - for stdout)")
    p.add_argument("--username", default="admin", help="the admin's name (default: admin)")
    p.add_argument("--timeout", type=float, default=60, metavar="SECONDS",
                   help="how long to wait for the sessions service (default 60)")
    p.add_argument("--nats-url", metavar="URL", help="the NATS server (default: NOETL_NATS_URL)")
    p.add_argument("--nats-creds", metavar="FILE", help="the admin's credentials (NOETL_NATS_CREDS)")
    p.set_defaults(func=cmd_bootstrap)

    p = sub.add_parser("nats-credentials", help="generate one NATS user per service and the server's users")
    p.add_argument("--out", required=True, metavar="DIR", help="directory for the seeds and nats-auth.conf (0700)")
    p.add_argument("--pool", action="append", help="a worker pool to make a user for (repeatable; default: default)")
    p.add_argument("--partitions", type=int, help="partitions of the events stream (default: NOETL_PARTITIONS, else 16)")
    p.add_argument("--reader", type=int, metavar="UID", help="let this user read the seeds too (an ACL entry): "
                   "the containers' user, 10001, for docker-compose.yml's secrets")
    p.set_defaults(func=cmd_nats_credentials)

    add_certs_parser(sub)

    p = sub.add_parser("completion", help="print shell completion: eval \"$(noetl completion bash)\" (zsh, fish too)")
    p.add_argument("shell", choices=["bash", "zsh", "fish"], help="which shell's script")
    p.set_defaults(func=cmd_completion)

    p = sub.add_parser("ls", help="executions, newest first (filters as the console's)")
    p.add_argument("--status", type=str.upper, choices=["PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED"],
                   help="only those in this status (any case)")
    p.add_argument("--playbook", metavar="PATH", help="only this playbook's (its catalog path)")
    p.add_argument("--user", metavar="ID", help="only those this user started: a user id, or me")
    p.add_argument("--since", metavar="TIME", help="created at or after: ISO 8601 (2026-11-27T08:00) or epoch seconds")
    p.add_argument("--until", metavar="TIME", help="created before: ISO 8601 or epoch seconds")
    p.add_argument("--limit", type=int, default=20, help="how many (default 20, at most 1000)")
    p.add_argument("--offset", type=int, default=0, help="skip the newest N: the next page (default 0)")
    p.add_argument("--json", action="store_true", help="the rows as JSON")
    p.add_argument("--gateway", default=gateway_default, metavar="URL", help=GATEWAY_HELP)
    p.set_defaults(func=cmd_ls)

    for name, fn, help_ in (("status", cmd_status, "an execution's status and steps"),
                            ("events", cmd_events, "an execution's events (filters as the API's; --follow)"),
                            ("cancel", cmd_cancel, "cancel an execution")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("execution_id", help="the execution's id")
        p.add_argument("--gateway", default=gateway_default, metavar="URL", help=GATEWAY_HELP)
        p.set_defaults(func=fn)
        if name == "events":
            p.add_argument("--name", action="append", metavar="EVENT", help="only events of this name (repeatable)")
            p.add_argument("--step", help="only this step's events")
            p.add_argument("--task", help="only this task's events")
            p.add_argument("--iteration", type=int, help="only this loop iteration's events")
            p.add_argument("--follow", "-f", action="store_true",
                           help="print events as they are recorded, until the execution ends")

    p = sub.add_parser("restart", help="restart a finished execution from one of its steps (D32), and follow the "
                                       "new execution to its end", epilog=RESTART_EXIT_CODES)
    p.add_argument("execution_id", help="the finished execution's id")
    p.add_argument("--from", dest="from_step", required=True, metavar="STEP",
                   help="the step to go on from: the steps before it are not run again")
    p.add_argument("--workload", metavar="JSON", help="JSON object deep-merged over the old execution's workload")
    p.add_argument("--json", action="store_true", help="print one JSON object with the outcome (as noetl run --json)")
    p.add_argument("--timeout", type=float, default=3600.0, metavar="SECONDS",
                   help=f"seconds to wait for the end; then exit {EXIT_TIMEOUT} (the execution keeps running)")
    p.add_argument("--gateway", default=gateway_default, metavar="URL", help=GATEWAY_HELP)
    p.set_defaults(func=cmd_restart)

    p = sub.add_parser("signal", help="send a signal to an execution (D30): it resumes the wait task waiting for it")
    p.add_argument("execution_id", help="the execution's id")
    p.add_argument("name", help="the signal's name (the wait task's `signal`)")
    p.add_argument("--data", metavar="JSON", help="the payload, JSON (default: null)")
    p.add_argument("--gateway", default=gateway_default, metavar="URL", help=GATEWAY_HELP)
    p.set_defaults(func=cmd_signal)
    p = sub.add_parser("waits", help="waits in progress (D30): the inbox of human tasks")
    p.add_argument("--execution-id", dest="execution_id", help="only this execution's")
    p.add_argument("--gateway", default=gateway_default, metavar="URL", help=GATEWAY_HELP)
    p.set_defaults(func=cmd_waits)

    p = sub.add_parser("verify", help="check executions' event logs: finished, every step run ended once, "
                                      "loops complete, nothing run after the end")
    p.add_argument("execution_ids", nargs="*", metavar="ID", help="execution ids (or --all)")
    p.add_argument("--all", action="store_true", help="every execution the gateway lists")
    p.add_argument("--json", action="store_true", help="print the reports as JSON")
    p.add_argument("--gateway", default=gateway_default, metavar="URL", help=GATEWAY_HELP)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("credential", help="the credential store (add, list, delete)")
    csub = p.add_subparsers(dest="action", required=True)
    c = csub.add_parser("add", help="create or replace a credential")
    c.add_argument("name", help="the credential's name (what keychain entries refer to)")
    c.add_argument("--kind", default="generic", help="postgres, http, generic, ...")
    c.add_argument("--data", required=True, metavar="JSON", help="the secret fields, a JSON object")
    c.add_argument("--description", help="what the credential is for")
    c = csub.add_parser("list", help="credentials without their data")
    c2 = csub.add_parser("delete", help="delete a credential")
    c2.add_argument("name", help="the credential's name")
    for c in (csub.choices["add"], csub.choices["list"], c2):
        c.add_argument("--gateway", default=gateway_default, metavar="URL", help=GATEWAY_HELP)
        c.set_defaults(func=cmd_credential)
    _auth_commands(sub, gateway_default)
    from .schedule_cli import add_commands

    add_commands(sub, gateway_default)
    from .operate import add_commands as operate_commands

    operate_commands(sub)
    _everywhere(parser, "--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    _common_help(parser)
    _home_where_gateway(parser)
    return parser


def _home_where_gateway(parser: argparse.ArgumentParser) -> None:
    """``--home`` for every command that has ``--gateway`` (the home whose running stack it finds)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in set(action.choices.values()):
                _home_where_gateway(child)
    dests = {a.dest for a in parser._actions}
    if "gateway" in dests and "home" not in dests:
        parser.add_argument("--home", metavar="DIR", help=HOME_HELP)
    # the output layer (output.py) for every command that answers what the gateway says; not for those
    # with an output of their own (run, restart, ls, verify: --json)
    if "gateway" in dests and "json" not in dests and "output" not in dests:
        parser.add_argument("-o", "--output", choices=("table", "yaml", "json"),
                            help="table or yaml for people, json for programs (default: a table or yaml on a "
                                 "terminal, json when piped)")


DEFAULT_METRICS_PORT = 9464


def _env_int(name: str, default: int | None = None) -> int | None:
    value = os.environ.get(name, "").strip()
    try:
        return int(value) if value else default
    except ValueError:
        return default  # reported where it is used: argparse checks --metrics-port, not the variable


def _common_help(parser: argparse.ArgumentParser) -> None:
    """The help of an option every gateway command has (``--gateway``), for a command that gives none."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in set(action.choices.values()):
                _common_help(child)
        elif action.dest == "gateway" and not action.help:
            action.help, action.metavar = GATEWAY_HELP, action.metavar or "URL"


def _everywhere(parser: argparse.ArgumentParser, *names: str, **kw) -> None:
    """Add an option to every subcommand too (``noetl run X --debug`` as well as ``noetl --debug run X``);
    ``default=SUPPRESS`` keeps a subcommand from overwriting the top level's value."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in set(action.choices.values()):
                child.add_argument(*names, **kw)
                _everywhere(child, *names, **kw)


GATEWAY_HELP = ("the gateway's URL (default: NOETL_GATEWAY_URL, else the gateway of the `noetl up` running from "
                "--home, else http://127.0.0.1:8082)")
HOME_HELP = "the home of a local `noetl up` whose gateway to use (default: NOETL_HOME, else .noetl)"
DEBUG_HELP = "on an unexpected error, print its traceback"
MIGRATE_EXIT_CODES = (f"exit status: {EXIT_OK} every file translated fully (or already canonical), {EXIT_FAILED} "
                      f"--check: a file would change, {EXIT_INVALID} a file is not a playbook, {EXIT_NEEDS_PERSON} "
                      "something needs a person (listed, with its location)")
RUN_EXIT_CODES = (f"exit status: {EXIT_OK} COMPLETED, {EXIT_FAILED} FAILED or CANCELLED, {EXIT_INVALID} an invalid "
                  f"playbook or arguments, {EXIT_TIMEOUT} --timeout passed, {EXIT_UNREACHABLE} no gateway at --gateway, "
                  f"{EXIT_STACK} the embedded stack cannot start, 130/143 interrupted (SIGINT/SIGTERM)")
RESTART_EXIT_CODES = (f"exit status: {EXIT_OK} COMPLETED, {EXIT_FAILED} FAILED or CANCELLED, or the gateway refused "
                      f"the restart, {EXIT_INVALID} bad arguments, {EXIT_TIMEOUT} --timeout passed (the execution "
                      f"keeps running), {EXIT_UNREACHABLE} no gateway, 130/143 interrupted (SIGINT/SIGTERM)")
EXIT_CODES = (f"exit status: {EXIT_OK} success; {EXIT_FAILED} failed (an execution, a check, a refusal of the gateway); "
              f"{EXIT_INVALID} invalid input; {EXIT_TIMEOUT} noetl run --timeout passed; {EXIT_UNREACHABLE} no gateway "
              f"answers at the URL; {EXIT_STACK} the embedded stack cannot start (e.g. one runs from that home "
              f"already); {EXIT_INTERNAL} an unexpected error (--debug shows the traceback); 130/143 interrupted "
              "(SIGINT/SIGTERM). See docs/operations.md.")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown after each option's help, except the empty ones (None, False, [])."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, argparse.SUPPRESS) or action.default == [] or \
                "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """Every (sub)command's parser: defaults shown in the help."""

    def __init__(self, *args, **kw):
        kw.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kw)


def _bad_url(url: str | None) -> str | None:
    """Why ``--gateway URL`` cannot be a gateway's URL (None when it can be)."""
    if not url:
        return None
    import httpx

    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        return f"--gateway {url}: not a valid URL ({exc})"
    if parsed.scheme not in ("http", "https") or not parsed.host:
        return f"--gateway {url}: not an http:// or https:// URL with a host"
    if parsed.port is not None and not 0 < parsed.port < 65536:
        return f"--gateway {url}: the port is not between 1 and 65535"
    return None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("noetl-mesh")
    except PackageNotFoundError:
        return "unknown (not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad arguments, as D26 wants
        return int(exc.code or 0)
    if getattr(args, "gateway", "") is None and args.func is not cmd_run:  # `noetl run` may start its own stack
        from .home import DEFAULT_GATEWAY, gateway_url, home_dir

        args.gateway = gateway_url(args.home)
        if args.gateway == DEFAULT_GATEWAY and not os.environ.get("NOETL_GATEWAY_URL"):
            _FALLBACK.update(gateway=args.gateway, home=home_dir(args.home))
    problem = _bad_url(getattr(args, "gateway", None))
    if problem:
        return _fail(problem, EXIT_INVALID)
    try:
        return int(args.func(args) or 0)
    except (KeyboardInterrupt, Interrupted) as exc:
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        return _fail(f"interrupted ({signal.Signals(signum).name})", 128 + signum)
    except BrokenPipeError:  # the reader went away (`noetl schema | head`): nothing to say, nowhere to say it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 128 + signal.SIGPIPE
    except Exception as exc:  # noqa: BLE001 - the last resort: one line, never a traceback unasked
        from .infra.tls import TlsSettingError

        if isinstance(exc, TlsSettingError):  # NOETL_GATEWAY_CA and kin: a file that cannot be used
            return _fail(str(exc), EXIT_INVALID)
        if getattr(args, "debug", False):
            import traceback

            traceback.print_exc()
        lines = str(exc).strip().splitlines()
        what = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
        hint = "" if getattr(args, "debug", False) else "; run with --debug for the traceback"
        return _fail(f"unexpected error: {what}{hint}", EXIT_INTERNAL)


if __name__ == "__main__":
    sys.exit(main())
