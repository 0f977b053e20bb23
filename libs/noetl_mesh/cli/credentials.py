"""``noetl credential add|list|delete``: the credential store (D24), through a gateway."""
from __future__ import annotations

import argparse
import json

from .common import fail, gateway_call, gateway_option


def add_commands(sub) -> None:
    p = sub.add_parser("credential", help="the credential store (add, list, delete)")
    csub = p.add_subparsers(dest="action", required=True)
    c = csub.add_parser("add", help="create or replace a credential")
    c.add_argument("name", help="the credential's name (what keychain entries refer to)")
    c.add_argument("--kind", default="generic", help="postgres, http, generic, ...")
    c.add_argument("--data", required=True, metavar="JSON", help="the secret fields, a JSON object")
    c.add_argument("--description", help="what the credential is for")
    c = csub.add_parser("list", help="credentials without their data")
    c = csub.add_parser("delete", help="delete a credential")
    c.add_argument("name", help="the credential's name")
    for c in csub.choices.values():
        gateway_option(c).set_defaults(func=cmd_credential)


def cmd_credential(args: argparse.Namespace) -> int:
    """``noetl credential add|list|delete`` against a gateway (D24)."""
    if args.action == "add":
        try:
            data = json.loads(args.data)
        except json.JSONDecodeError as exc:
            return fail(f"--data is not valid JSON: {exc}")
        if not isinstance(data, dict) or not data:
            return fail("--data must be a non-empty JSON object")
        return gateway_call(args, lambda c: c.credential_put(args.name, args.kind, data, args.description))
    if args.action == "list":
        return gateway_call(args, lambda c: c.credential_list())
    return gateway_call(args, lambda c: c.credential_delete(args.name))
