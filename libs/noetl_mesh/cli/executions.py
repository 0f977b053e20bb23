"""An execution's commands, through a gateway: ``noetl ls``, ``status``, ``events`` (``--follow``),
``cancel``, ``restart`` (run.py follows it), ``signal`` and ``waits`` (D30), ``verify`` (its event log)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .common import (EXIT_FAILED, EXIT_INVALID, EXIT_OK, EXIT_TIMEOUT, fail, gateway_call, gateway_option,
                     gateway_run)
from .output import aligned
from .run import RESTART_EXIT_CODES, cmd_restart

# the columns of a table of these commands' records (wide ones; the rest show every plain field)
EVENT_COLUMNS = ("timestamp", "name", "step", "task", "iteration", "attempt", "status")
WAIT_COLUMNS = ("execution_id", "step", "task", "signal", "assignee", "timeout_at", "started_at")


def add_commands(sub) -> None:
    """ls, status, events, cancel, restart, signal, waits, verify."""
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
    gateway_option(p)
    p.set_defaults(func=cmd_ls)

    for name, fn, help_ in (("status", cmd_status, "an execution's status and steps"),
                            ("events", cmd_events, "an execution's events (filters as the API's; --follow)"),
                            ("cancel", cmd_cancel, "cancel an execution")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("execution_id", help="the execution's id")
        gateway_option(p)
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
    gateway_option(p)
    p.set_defaults(func=cmd_restart)

    p = sub.add_parser("signal", help="send a signal to an execution (D30): it resumes the wait task waiting for it")
    p.add_argument("execution_id", help="the execution's id")
    p.add_argument("name", help="the signal's name (the wait task's `signal`)")
    p.add_argument("--data", metavar="JSON", help="the payload, JSON (default: null)")
    gateway_option(p)
    p.set_defaults(func=cmd_signal)
    p = sub.add_parser("waits", help="waits in progress (D30): the inbox of human tasks")
    p.add_argument("--execution-id", dest="execution_id", help="only this execution's")
    gateway_option(p)
    p.set_defaults(func=cmd_waits)

    p = sub.add_parser("verify", help="check executions' event logs: finished, every step run ended once, "
                                      "loops complete, nothing run after the end")
    p.add_argument("execution_ids", nargs="*", metavar="ID", help="execution ids (or --all)")
    p.add_argument("--all", action="store_true", help="every execution the gateway lists")
    p.add_argument("--json", action="store_true", help="print the reports as JSON")
    gateway_option(p)
    p.set_defaults(func=cmd_verify)


def cmd_ls(args: argparse.Namespace) -> int:
    """``noetl ls``: executions, newest first, with the console's filters; a table, or ``--json``."""
    from ..client import GatewayClient

    if not 1 <= args.limit <= 1000 or args.offset < 0:
        return fail("--limit is 1 to 1000 and --offset 0 or more", EXIT_INVALID)

    async def main() -> int:
        async with GatewayClient(args.gateway) as client:
            rows = await client.list_executions(status=args.status, limit=args.limit, user=args.user,
                                                path=args.playbook, since=args.since, until=args.until,
                                                offset=args.offset)
        if args.json:
            print(json.dumps(rows, indent=2, default=str))
            return EXIT_OK
        print(_executions_table(rows))
        if len(rows) == args.limit:
            print(f"(the {args.limit} newest; --offset {args.offset + args.limit} for the next page)",
                  file=sys.stderr)
        return EXIT_OK

    return gateway_run(args.gateway, main)


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
    return aligned([header] + [(str(r.get("execution_id")), str(r.get("status")), str(r.get("path") or ""),
                                str(r.get("requested_by_name") or ("(child)" if r.get("parent_execution_id") else "")),
                                when(r.get("created_at")), took(r)) for r in rows])


def cmd_status(args: argparse.Namespace) -> int:
    return gateway_call(args, lambda c: c.status(args.execution_id))


def cmd_events(args: argparse.Namespace) -> int:
    """``noetl events ID [--name N]... [--step S] [--task T] [--iteration I] [--follow]``: the execution's
    events in log order (the API's filters); ``--follow`` prints them as they come, until the end."""
    filters = {"name": args.name or None, "step": args.step, "task": args.task, "iteration": args.iteration}
    if not args.follow:
        return gateway_call(args, lambda c: c.all_events(args.execution_id, **filters), EVENT_COLUMNS)
    import asyncio

    from ..client import GatewayClient
    from .output import chosen, table

    fmt = chosen(args.output)

    async def follow() -> int:
        async with GatewayClient(args.gateway) as client:
            offset, header = 0, True
            while True:
                page = await client.events(args.execution_id, offset=offset, **filters)
                for event in page["events"]:
                    if fmt == "table":
                        lines = table([event], EVENT_COLUMNS).splitlines()
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

    return gateway_run(args.gateway, follow)


def cmd_cancel(args: argparse.Namespace) -> int:
    return gateway_call(args, lambda c: c.cancel(args.execution_id))


def cmd_signal(args: argparse.Namespace) -> int:
    """``noetl signal ID NAME [--data JSON]`` (D30)."""
    try:
        payload = json.loads(args.data) if args.data is not None else None
    except json.JSONDecodeError as exc:
        return fail(f"--data is not JSON: {exc}")
    return gateway_call(args, lambda c: c.signal(args.execution_id, args.name, payload))


def cmd_waits(args: argparse.Namespace) -> int:
    return gateway_call(args, lambda c: c.waits(args.execution_id), WAIT_COLUMNS)


def cmd_verify(args: argparse.Namespace) -> int:
    """``noetl verify ID...|--all``: check executions' event logs (core/verify.py); exit 0 when every
    log is sound, 1 when any has a finding, 2 for bad arguments."""
    from ..client import GatewayClient, GatewayError
    from ..core.verify import verify

    if bool(args.execution_ids) == bool(args.all):
        return fail("give execution ids or --all (not both)")

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

    return gateway_run(args.gateway, main)
