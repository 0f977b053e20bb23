"""``noetl credential add|list|roles|delete``: the credential store (D24), through a gateway."""
from __future__ import annotations

import argparse
import json

from .common import fail, gateway_call, gateway_option


def add_commands(sub) -> None:
    p = sub.add_parser("credential", help="the credential store (add, list, roles, delete)")
    csub = p.add_subparsers(dest="action", required=True)
    c = csub.add_parser("add", help="create or replace a credential")
    c.add_argument("name", help="the credential's name (what keychain entries refer to)")
    c.add_argument("--kind", default="generic", help="postgres, http, generic, ...")
    c.add_argument("--data", required=True, metavar="JSON", help="the secret fields, a JSON object")
    c.add_argument("--description", help="what the credential is for")
    c.add_argument("--roles", type=_roles, metavar="ROLE[,ROLE]", help=(
        "who may use it from a playbook (D24): whoever starts the execution and whoever wrote its playbooks "
        "must each hold one of these roles, or be one of --users (a new credential: admin; a replaced one keeps "
        "its own; none: its users only)"))
    c.add_argument("--users", type=_users, metavar="USER[,USER]", help=(
        "users (usernames or ids) who may use it whatever their roles (a replaced one keeps its own)"))
    c = csub.add_parser("list", help="credentials without their data")
    c = csub.add_parser("roles", help="set who may use a credential from a playbook (D24)")
    c.add_argument("name", help="the credential's name")
    c.add_argument("roles", type=_roles, metavar="ROLE[,ROLE]",
                   help="admin, developer, operator, viewer; none: only the users of --users")
    c.add_argument("--users", type=_users, metavar="USER[,USER]", help=(
        "users (usernames or ids) who may use it whatever their roles; not given: kept; none: nobody by name"))
    c = csub.add_parser("delete", help="delete a credential")
    c.add_argument("name", help="the credential's name")
    for c in csub.choices.values():
        gateway_option(c).set_defaults(func=cmd_credential)


def _roles(text: str) -> list[str]:
    if text.strip() == "none":
        return []
    roles = [r.strip() for r in text.split(",") if r.strip()]
    if not roles:
        raise argparse.ArgumentTypeError("name at least one role (admin, developer, operator, viewer), or none")
    return roles


def _users(text: str) -> list[str]:
    return [] if text.strip() == "none" else [u.strip() for u in text.split(",") if u.strip()]


def cmd_credential(args: argparse.Namespace) -> int:
    """``noetl credential add|list|roles|delete`` against a gateway (D24)."""
    if args.action == "add":
        try:
            data = json.loads(args.data)
        except json.JSONDecodeError as exc:
            return fail(f"--data is not valid JSON: {exc}")
        if not isinstance(data, dict) or not data:
            return fail("--data must be a non-empty JSON object")
        return gateway_call(args, lambda c: c.credential_put(args.name, args.kind, data, args.description,
                                                             args.roles, args.users))
    if args.action == "list":
        return gateway_call(args, lambda c: c.credential_list())
    if args.action == "roles":
        return gateway_call(args, lambda c: c.credential_roles(args.name, args.roles, args.users))
    return gateway_call(args, lambda c: c.credential_delete(args.name))
