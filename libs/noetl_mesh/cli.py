"""The ``noetl`` command (D26)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2


def cmd_validate(args: argparse.Namespace) -> int:
    """D26: exit 0 when every file is valid (warnings printed), 2 when any is invalid."""
    from .lang.validate import validate_file

    status = EXIT_OK
    for path in args.files:
        result = validate_file(path)
        for d in result.diagnostics:
            print(f"{path}: {d}")
        if result.ok:
            print(f"{path}: valid" + (f" ({len(result.warnings)} warning(s))" if result.warnings else ""))
        else:
            print(f"{path}: invalid ({len(result.errors)} error(s))")
            status = EXIT_INVALID
    return status


def cmd_schema(args: argparse.Namespace) -> int:
    from .lang.model import json_schema

    print(json.dumps(json_schema(), indent=2))
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="noetl", description="Run NoETL playbooks as Petri nets over NATS.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("validate", help="check playbooks; every error with its location")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("schema", help="print the JSON Schema of the playbook language")
    p.set_defaults(func=cmd_schema)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad arguments, as D26 wants
        return int(exc.code or 0)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
