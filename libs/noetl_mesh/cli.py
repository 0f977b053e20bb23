"""The ``noetl`` command (D26)."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from typing import Sequence

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2


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


def cmd_schema(args: argparse.Namespace) -> int:
    from .lang.model import json_schema

    print(json.dumps(json_schema(), indent=2))
    return EXIT_OK


FINAL = ("COMPLETED", "FAILED", "CANCELLED")


def _fail(message: str, code: int = EXIT_INVALID) -> int:
    print(f"noetl: {message}", file=sys.stderr)
    return code


def cmd_run(args: argparse.Namespace) -> int:
    """D26: run a playbook to its end; exit 0 COMPLETED, 1 FAILED/CANCELLED, 2 invalid input."""
    from .lang.documents import read_document
    from .lang.validate import validate_file

    invalid = False
    for path in [args.file, *(args.register or [])]:  # every playbook checked before anything starts
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
    text = read_document(args.file)[0]  # decoded as it was validated (UTF-8/16/32)
    try:
        return asyncio.run(_run(args, text, workload))
    except KeyboardInterrupt:
        return EXIT_FAILED


async def _run(args: argparse.Namespace, text: str, workload: dict) -> int:
    from .client import GatewayClient
    from .lang.documents import read_document

    stack = None
    gateway = args.gateway or os.environ.get("NOETL_GATEWAY_URL")
    try:
        if not gateway:
            stack = await _embedded_stack(quiet=args.json)
            gateway = stack.gateway_url
        async with GatewayClient(gateway) as client:
            for path in args.register or ():  # the playbooks that `playbook` tasks call, by catalog path
                await client.register(read_document(path)[0])
            execution_id = await client.start(text, workload)
            progress = None if args.json else (lambda e: _print_progress(e))
            final = await client.wait(execution_id, timeout=args.timeout, on_event=progress)
            events = await client.all_events(execution_id)
    finally:
        if stack is not None:
            await stack.stop()
    if args.json:
        out = {k: final.get(k) for k in ("execution_id", "status", "workload", "ctx", "steps")}
        out["events"] = [{k: e.get(k) for k in ("name", "step", "task", "iteration", "attempt")} for e in events]
        print(json.dumps(out, default=str))
    else:
        print(f"execution {execution_id}: {final['status']}")
        if final.get("error"):
            print(f"  error: {final['error']}")
    return EXIT_OK if final["status"] == "COMPLETED" else EXIT_FAILED


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
    elif name in ("task.suspended", "playbook.child.finished"):  # child executions (kind: playbook)
        data = event.get("data") or {}
        child = data.get("child") or {}
        if name == "task.suspended":
            extra = f"{event.get('task')} -> {child.get('path')} ({child.get('execution_id')})"
        else:
            extra = f"{data.get('child_execution_id')} {data.get('status')}"
        where = event.get("step") or ""
        if event.get("iteration") is not None:
            where += f"[{event['iteration']}]"
        print(f"  {'child.started' if name == 'task.suspended' else 'child.finished':<18} {where} {extra}", flush=True)


async def _embedded_stack(quiet: bool, persistent: str | None = None, processes: bool = False):
    """NATS and Postgres as local processes (or the ones NOETL_NATS_URL / NOETL_PG_DSN name) and every
    service; stopped with the stack. The embedded NATS runs with one user per service: credentials in
    ``<home>/nats-creds`` (kept and reused), or a temporary directory; an external NATS with those of
    NOETL_NATS_CREDS (a directory or one file), if set."""
    import shutil
    import tempfile

    from .infra.embedded import ENV_NATS_URL, provision_nats, provision_postgres
    from .infra.nats_auth import NatsAuth
    from .stack import InProcessStack, ProcessStack, Settings

    nats_dir = os.path.join(persistent, "nats") if persistent else None
    pg_dir = os.path.join(persistent, "pg") if persistent else None
    creds_dir = os.path.join(persistent, "nats-creds") if persistent else tempfile.mkdtemp(prefix="noetl-creds-")
    auth = None if os.environ.get(ENV_NATS_URL) else NatsAuth(creds_dir).ensure()
    try:
        nats_server = provision_nats(store_dir=nats_dir, auth=auth)
    except BaseException:
        if not persistent:
            shutil.rmtree(creds_dir, ignore_errors=True)
        raise
    pg = provision_postgres(data_dir=pg_dir, fast=not persistent)
    creds = str(auth.directory) if auth else os.environ.get("NOETL_NATS_CREDS")
    settings = Settings(nats_url=nats_server.url, pg_dsn=pg.dsn("postgres"), nats_creds=creds)
    token_file = os.path.join(persistent, "admin.token") if persistent else None
    if processes:
        stack = ProcessStack(settings, log_dir=persistent, supervise=True, token_file=token_file)
    else:
        stack = InProcessStack(settings, token_file=token_file)
    inner_stop = stack.stop

    async def stop() -> None:
        try:
            await inner_stop()
        finally:
            nats_server.stop()
            pg.stop()
            if not persistent:
                shutil.rmtree(creds_dir, ignore_errors=True)

    stack.stop = stop  # type: ignore[method-assign]
    try:
        await stack.start()
    except BaseException:
        await stop()
        raise
    return stack


def cmd_up(args: argparse.Namespace) -> int:
    async def main() -> None:
        home = os.path.abspath(args.home)
        os.makedirs(home, exist_ok=True)
        stack = await _embedded_stack(quiet=False, persistent=home, processes=not args.in_process)
        print(f"noetl stack up; gateway: {stack.gateway_url} (OpenAPI docs at {stack.gateway_url}/docs)", flush=True)
        print(f"NATS: {stack.settings.nats_url}  Postgres: {stack.settings.pg_dsn}", flush=True)
        if stack.settings.nats_creds:
            print(f"NATS credentials (one per service; admin.nk for tools): {stack.settings.nats_creds}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        print("stopping...", flush=True)
        await stack.stop()

    asyncio.run(main())
    return EXIT_OK


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
    except ValueError as exc:
        return _fail(str(exc))
    settings = replace(settings, pg_dsn=args.pg_dsn or os.environ.get("NOETL_PG_DSN"), concurrency=args.concurrency,
                       host=args.host, port=args.port, ack_wait=args.ack_wait)
    logging.basicConfig(level=os.environ.get("NOETL_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s {args.name} %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve_forever(args.name, settings))
    return EXIT_OK


def cmd_setup(args: argparse.Namespace) -> int:
    """``noetl setup``: create the streams, the membership bucket and the payload store (as the admin)."""
    from .stack import setup

    args.name = "admin"
    try:
        settings = _nats_settings(args)
    except ValueError as exc:
        return _fail(str(exc))
    asyncio.run(setup(settings))
    print(f"streams, bucket and object store ready at {settings.nats_url}")
    return EXIT_OK


def cmd_nats_credentials(args: argparse.Namespace) -> int:
    """``noetl nats-credentials --out DIR``: one nkey seed per service (kept if present) and the server's
    ``authorization`` block (public keys and permissions), for deploy/nats.conf to include."""
    from .infra.nats_auth import NatsAuth

    try:
        auth = NatsAuth(args.out, pools=args.pool or ["default"], partitions=args.partitions).ensure()
    except ValueError as exc:
        return _fail(str(exc))
    print(f"{auth.config_file}: the server's users ({auth.partitions} partitions, pools {', '.join(auth.pools)})")
    for user in auth.users:
        print(f"{auth.file(user)}: the seed of {user} (keep it secret; NOETL_NATS_CREDS or --nats-creds)")
    return EXIT_OK


def _gateway_call(args: argparse.Namespace, fn) -> int:
    import httpx

    from .client import GatewayClient, GatewayError

    async def main() -> int:
        async with GatewayClient(args.gateway) as client:
            print(json.dumps(await fn(client), indent=2, default=str))
            return EXIT_OK

    try:
        return asyncio.run(main())
    except GatewayError as exc:
        return _fail(str(exc), EXIT_FAILED)
    except (OSError, httpx.TransportError) as exc:  # e.g. no gateway listening
        return _fail(f"cannot reach the gateway at {args.gateway}: {exc}", EXIT_FAILED)


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


def cmd_status(args: argparse.Namespace) -> int:
    return _gateway_call(args, lambda c: c.status(args.execution_id))


def cmd_events(args: argparse.Namespace) -> int:
    return _gateway_call(args, lambda c: c.all_events(args.execution_id))


def cmd_cancel(args: argparse.Namespace) -> int:
    return _gateway_call(args, lambda c: c.cancel(args.execution_id))


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
        return _fail(str(exc), EXIT_FAILED)
    except (OSError, httpx.TransportError) as exc:
        return _fail(f"cannot reach the gateway at {args.gateway}: {exc}", EXIT_FAILED)


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="noetl", description="Run NoETL playbooks as Petri nets over NATS.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("validate", help="check playbooks; every error with its location")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("schema", help="print the JSON Schema of the playbook language")
    p.set_defaults(func=cmd_schema)

    gateway_default = os.environ.get("NOETL_GATEWAY_URL", "http://127.0.0.1:8082")
    p = sub.add_parser("run", help="run a playbook to its end (embedded stack unless --gateway)")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--workload", help="JSON object deep-merged over the playbook's workload")
    p.add_argument("--json", action="store_true", help="print one JSON object with the outcome")
    p.add_argument("--gateway", help="a running gateway's URL instead of an embedded stack")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the end")
    p.add_argument("--register", action="append", metavar="FILE",
                   help="register this playbook in the catalog first (for `kind: playbook` tasks); repeatable")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("register", help="add playbooks to the catalog of a running gateway")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--gateway", default=gateway_default)
    p.set_defaults(func=cmd_register)

    p = sub.add_parser("up", help="start NATS, Postgres and every service in the foreground")
    p.add_argument("--home", default=os.environ.get("NOETL_HOME", ".noetl"), help="data and logs directory")
    p.add_argument("--in-process", action="store_true", help="all services in this process")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("service", help="run one service")
    p.add_argument("name", choices=["gateway", "admission", "router", "loop-coordinator", "event-recorder",
                                    "sessions", "worker"])
    p.add_argument("--nats-url")
    p.add_argument("--nats-creds", metavar="FILE",
                   help="the service's NATS credentials (nkey seed file, or a directory of them; NOETL_NATS_CREDS)")
    p.add_argument("--pg-dsn")
    p.add_argument("--pool", default="default")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--ack-wait", type=float, default=30.0)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8082)
    p.set_defaults(func=cmd_service)

    p = sub.add_parser("setup", help="create the streams, bucket and object store (as the NATS admin user)")
    p.add_argument("--nats-url")
    p.add_argument("--nats-creds", metavar="FILE", help="the admin's credentials (NOETL_NATS_CREDS)")
    p.set_defaults(func=cmd_setup)

    p = sub.add_parser("nats-credentials", help="generate one NATS user per service and the server's users")
    p.add_argument("--out", required=True, metavar="DIR", help="directory for the seeds and nats-auth.conf (0700)")
    p.add_argument("--pool", action="append", help="a worker pool to make a user for (repeatable; default: default)")
    p.add_argument("--partitions", type=int, help="of the events stream (NOETL_PARTITIONS, default 16)")
    p.set_defaults(func=cmd_nats_credentials)

    for name, fn, help_ in (("status", cmd_status, "an execution's status and steps"),
                            ("events", cmd_events, "an execution's events"),
                            ("cancel", cmd_cancel, "cancel an execution")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("execution_id")
        p.add_argument("--gateway", default=gateway_default)
        p.set_defaults(func=fn)

    p = sub.add_parser("verify", help="check executions' event logs: finished, every step run ended once, "
                                      "loops complete, nothing run after the end")
    p.add_argument("execution_ids", nargs="*", metavar="ID")
    p.add_argument("--all", action="store_true", help="every execution the gateway lists")
    p.add_argument("--json", action="store_true", help="print the reports as JSON")
    p.add_argument("--gateway", default=gateway_default)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("credential", help="the credential store (add, list, delete)")
    csub = p.add_subparsers(dest="action", required=True)
    c = csub.add_parser("add", help="create or replace a credential")
    c.add_argument("name")
    c.add_argument("--kind", default="generic", help="postgres, http, generic, ...")
    c.add_argument("--data", required=True, help="the secret fields, a JSON object")
    c.add_argument("--description")
    c = csub.add_parser("list", help="credentials without their data")
    c2 = csub.add_parser("delete", help="delete a credential")
    c2.add_argument("name")
    for c in (csub.choices["add"], csub.choices["list"], c2):
        c.add_argument("--gateway", default=gateway_default)
        c.set_defaults(func=cmd_credential)
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
