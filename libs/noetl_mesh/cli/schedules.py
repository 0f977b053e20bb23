"""``noetl schedule add|list|get|pause|resume|delete``: schedules (D31) through a gateway."""
from __future__ import annotations

import argparse

from .common import fail, gateway_call, gateway_option, json_object


def add_commands(sub) -> None:
    p = sub.add_parser("schedule", help="start catalog playbooks on a schedule: add, list, get, pause, resume, delete")
    ssub = p.add_subparsers(dest="action", required=True)
    c = ssub.add_parser("add", help="a new schedule of a catalog playbook (exactly one of --cron, --every, --at)")
    c.add_argument("path", help="the playbook's catalog path")
    c.add_argument("--cron", help="six fields, seconds first: 'SEC MIN HOUR DOM MON DOW', e.g. '0 */5 * * * *'")
    c.add_argument("--timezone", help="the cron's IANA time zone, e.g. Europe/Paris (default UTC)")
    c.add_argument("--every", help="a duration: 90, 5m, 2h, PT5M (at least 1 s)")
    c.add_argument("--at", help="one instant, ISO-8601 with its time zone: 2026-12-01T09:00:00Z")
    c.add_argument("--version", type=int, help="a catalog version (default: the latest at each firing)")
    c.add_argument("--workload", help="a JSON object merged over the playbook's workload")
    c.add_argument("--name", help="the schedule's id (default: generated)")
    ssub.add_parser("list", help="every schedule with its next fire time")
    c = ssub.add_parser("get", help="one schedule with its next fire times")
    c.add_argument("schedule_id", help="the schedule's id")
    c.add_argument("--next", type=int, default=5, help="how many next fire times (default 5)")
    for verb, help_ in (("pause", "stop a schedule's firings"), ("resume", "fire again from now on"),
                        ("delete", "delete a schedule (its executions stay)")):
        ssub.add_parser(verb, help=help_).add_argument("schedule_id", help="the schedule's id")
    for c in ssub.choices.values():
        gateway_option(c).set_defaults(func=cmd_schedule)


def cmd_schedule(args: argparse.Namespace) -> int:
    if args.action == "add":
        try:
            workload = json_object(args.workload, "--workload")
        except ValueError as exc:
            return fail(str(exc))
        given = [flag for flag in ("cron", "every", "at") if getattr(args, flag) is not None]
        if len(given) != 1:
            return fail(f"give exactly one of --cron, --every or --at (got {', '.join(given) or 'none'})")
        return gateway_call(args, lambda c: c.schedule_add(
            args.path, cron=args.cron, timezone=args.timezone, every=args.every, at=args.at, version=args.version,
            workload=workload, name=args.name))
    if args.action == "list":
        return gateway_call(args, lambda c: c.schedules())
    if args.action == "get":
        return gateway_call(args, lambda c: c.schedule(args.schedule_id, args.next))
    method = {"pause": "schedule_pause", "resume": "schedule_resume", "delete": "schedule_delete"}[args.action]
    return gateway_call(args, lambda c: getattr(c, method)(args.schedule_id))
