"""The playbook language's commands: ``noetl validate``, ``lint``, ``schema``, ``asyncapi`` (the contract of
the NATS subjects), ``migrate`` (legacy playbooks) and ``register`` (into a gateway's catalog)."""
from __future__ import annotations

import argparse
import json
import sys

from .common import EXIT_FAILED, EXIT_INVALID, EXIT_NEEDS_PERSON, EXIT_OK, gateway_call, gateway_option, version

MIGRATE_EXIT_CODES = (f"exit status: {EXIT_OK} every file translated fully (or already canonical), {EXIT_FAILED} "
                      f"--check: a file would change, {EXIT_INVALID} a file is not a playbook, {EXIT_NEEDS_PERSON} "
                      "something needs a person (listed, with its location)")


def add_commands(sub) -> None:
    """validate, lint, schema, asyncapi (``noetl --help`` lists run next, then :func:`add_catalog_commands`)."""
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


def add_catalog_commands(sub) -> None:
    """migrate, register."""
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
    gateway_option(p)
    p.set_defaults(func=cmd_register)


def cmd_validate(args: argparse.Namespace) -> int:
    """D26: exit 0 when every file is valid (warnings printed), 2 when any is invalid. A file that
    cannot be read or decoded is invalid, with its reason; never a traceback."""
    from ..lang.validate import validate_file

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
    from ..lang.documents import read_document
    from ..lang.lint import Finding, Report, from_diagnostics, lint_text, sarif_log

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
    from ..lang.model import json_schema

    print(json.dumps(json_schema(), indent=2))
    return EXIT_OK


def cmd_migrate(args: argparse.Namespace) -> int:
    """``noetl migrate FILE...`` (docs/migrate.md): the canonical form of legacy playbooks. Prints it (or a
    unified diff with --diff, or rewrites the files with --write, or only says whether they would change
    with --check); the changes and what needs a person go to stderr (stdout with --write/--check), each
    with its location. Exit 2 when a file is not a playbook, else 3 when something needs a person, else
    (--check) 1 when a file would change, else 0."""
    import difflib

    from ..lang.documents import read_document
    from ..lang.migrate import migrate_text

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
        m = migrate_text(text, source=None if path == "-" else path)  # script: files next to it
        if m.invalid:
            for reason in m.invalid:
                print(f"{path}: invalid: {reason}", file=report)
            status = EXIT_INVALID
            continue
        for f in m.changes:
            print(f.text(path, "changed"), file=report)
        for f in m.problems:
            print(f.text(path, "needs a person"), file=report)
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


def cmd_asyncapi(args: argparse.Namespace) -> int:
    """``noetl asyncapi``: the contract of every subject (contracts/asyncapi.py)."""
    from ..contracts.asyncapi import document

    doc = document(version())
    if args.yaml:
        import yaml

        print(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True), end="")
    else:
        print(json.dumps(doc, indent=2))
    return EXIT_OK


def cmd_register(args: argparse.Namespace) -> int:
    """``noetl register FILE...``: add playbooks to a running gateway's catalog (a new version each)."""
    from ..lang.validate import validate_file

    for path in args.files:
        result = validate_file(path)
        if not result.ok:
            for d in result.errors:
                print(f"{path}: {d}", file=sys.stderr)
            return EXIT_INVALID

    async def register(client):
        from ..lang.documents import read_document

        return [await client.register(read_document(path)[0]) for path in args.files]

    return gateway_call(args, register)


def migrated(path: str) -> str | None:
    """``noetl run --migrate``: the playbook through ``noetl migrate`` in memory. What needs a person is
    printed (the run goes on when the result validates); None when the file is not a playbook."""
    from ..lang.documents import read_document
    from ..lang.migrate import migrate_text

    text, problems = read_document(path)
    if text is None:
        for d in problems:
            print(f"{path}: {d}", file=sys.stderr)
        return None
    m = migrate_text(text, source=None if path == "-" else path)
    if m.invalid:
        for reason in m.invalid:
            print(f"{path}: {reason}", file=sys.stderr)
        return None
    if m.changed:
        print(f"{path}: migrated in memory: {len(m.changes)} change(s) (noetl migrate {path} shows them)",
              file=sys.stderr)
    for f in m.problems:
        if f.rule != "V":
            print(f.text(path, "migrate: needs a person"), file=sys.stderr)
    return m.text
