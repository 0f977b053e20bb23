"""The ``noetl`` command (D26): the parser, assembled from the command groups' modules, and :func:`main`,
which runs a command and turns what escapes it into one line and an exit code (common.py). The groups
import from common.py and output.py, never from here."""
from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Sequence

from . import certs, completion, credentials, executions, operate, playbooks, run, schedules, stack, users
from .common import (DEBUG_HELP, EXIT_CODES, EXIT_INTERNAL, EXIT_INVALID, FALLBACK, GATEWAY_HELP, HOME_HELP,
                     Interrupted, bad_url, fail, version)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="noetl", description="Run NoETL playbooks as Petri nets over NATS.", epilog=EXIT_CODES)
    parser.add_argument("--version", action=_Version, help="print the version and exit")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # in the order `noetl --help` lists them
    playbooks.add_commands(sub)  # validate, lint, schema, asyncapi
    run.add_commands(sub)
    playbooks.add_catalog_commands(sub)  # migrate, register
    stack.add_commands(sub)  # up, service, setup, bootstrap, nats-credentials
    certs.add_commands(sub)
    completion.add_commands(sub, parser)
    executions.add_commands(sub)  # ls, status, events, cancel, restart, signal, waits, verify
    credentials.add_commands(sub)
    users.add_commands(sub)  # login, logout, whoami, session, user, token
    schedules.add_commands(sub)
    operate.add_commands(sub)  # ps, inspect
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


class _Version(argparse._VersionAction):
    """``--version``: the package's version, looked up when asked (importlib.metadata costs every command
    about 10 ms otherwise)."""

    def __call__(self, parser, namespace, values, option_string=None):
        self.version = f"%(prog)s {version()}"
        super().__call__(parser, namespace, values, option_string)


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad arguments, as D26 wants
        return int(exc.code or 0)
    if getattr(args, "gateway", "") is None and args.command != "run":  # `noetl run` may start its own stack
        from ..home import DEFAULT_GATEWAY, gateway_url, home_dir

        args.gateway = gateway_url(args.home)
        if args.gateway == DEFAULT_GATEWAY and not os.environ.get("NOETL_GATEWAY_URL"):
            FALLBACK.update(gateway=args.gateway, home=home_dir(args.home))
    problem = bad_url(getattr(args, "gateway", None))
    if problem:
        return fail(problem, EXIT_INVALID)
    try:
        return int(args.func(args) or 0)
    except (KeyboardInterrupt, Interrupted) as exc:
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        return fail(f"interrupted ({signal.Signals(signum).name})", 128 + signum)
    except BrokenPipeError:  # the reader went away (`noetl schema | head`): nothing to say, nowhere to say it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 128 + signal.SIGPIPE
    except Exception as exc:  # noqa: BLE001 - the last resort: one line, never a traceback unasked
        from ..infra.tls import TlsSettingError

        if isinstance(exc, TlsSettingError):  # NOETL_GATEWAY_CA and kin: a file that cannot be used
            return fail(str(exc), EXIT_INVALID)
        if getattr(args, "debug", False):
            import traceback

            traceback.print_exc()
        lines = str(exc).strip().splitlines()
        what = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
        hint = "" if getattr(args, "debug", False) else "; run with --debug for the traceback"
        return fail(f"unexpected error: {what}{hint}", EXIT_INTERNAL)
