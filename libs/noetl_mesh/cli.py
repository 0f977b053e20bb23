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
    from .client import GatewayError

    try:
        return asyncio.run(_run(args, text, workload))
    except KeyboardInterrupt:
        return EXIT_FAILED
    except GatewayError as exc:
        return _gateway_failed(exc, args.gateway or os.environ.get("NOETL_GATEWAY_URL") or "URL")


async def _run(args: argparse.Namespace, text: str, workload: dict) -> int:
    from .client import GatewayClient
    from .lang.documents import read_document

    stack = None
    gateway = args.gateway or os.environ.get("NOETL_GATEWAY_URL")
    try:
        if not gateway:
            stack = await _embedded_stack(quiet=args.json)
            gateway = stack.gateway_url
        # the throw-away stack's own admin token; a running gateway gets the command line's (noetl login)
        async with GatewayClient(gateway, token=stack.token if stack is not None else None) as client:
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
        first = not os.path.exists(os.path.join(home, "admin.token"))
        stack = await _embedded_stack(quiet=False, persistent=home, processes=not args.in_process)
        print(f"noetl stack up; gateway: {stack.gateway_url} (OpenAPI docs at {stack.gateway_url}/docs)", flush=True)
        print(f"NATS: {stack.settings.nats_url}  Postgres: {stack.settings.pg_dsn}", flush=True)
        if stack.settings.nats_creds:
            print(f"NATS credentials (one per service; admin.nk for tools): {stack.settings.nats_creds}", flush=True)
        url = stack.gateway_url
        stored = _local_admin(url, stack.token, os.path.join(home, "admin.token"), first)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        print("stopping...", flush=True)
        await stack.stop()
        if stored:
            _forget_local_admin(url, stack.token)

    asyncio.run(main())
    return EXIT_OK


def _local_admin(url: str, token: str | None, token_file: str, first: bool) -> bool:
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
        print(f"noetl commands use it for this gateway (kept in {where} while the stack runs): "
              f"export NOETL_GATEWAY_URL={url}", flush=True)
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
        return _gateway_failed(exc, args.gateway)
    except (OSError, httpx.TransportError) as exc:  # e.g. no gateway listening
        return _fail(f"cannot reach the gateway at {args.gateway}: {exc}", EXIT_FAILED)


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


def cmd_status(args: argparse.Namespace) -> int:
    return _gateway_call(args, lambda c: c.status(args.execution_id))


def cmd_events(args: argparse.Namespace) -> int:
    return _gateway_call(args, lambda c: c.all_events(args.execution_id))


def cmd_cancel(args: argparse.Namespace) -> int:
    return _gateway_call(args, lambda c: c.cancel(args.execution_id))


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
        return _fail(f"cannot reach the gateway at {args.gateway}: {exc}", EXIT_FAILED)


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
            return _fail(f"cannot reach the gateway at {args.gateway}: {exc}; the token is still stored", EXIT_FAILED)
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
        p.add_argument("--gateway", default=gateway_default, help="the gateway's URL (NOETL_GATEWAY_URL)")
        return p

    p = gw(sub.add_parser("login", help="log in to a gateway and keep the token (password, OIDC or API token)"))
    p.add_argument("--username", help="asked for when not given")
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
    c.add_argument("--user", help="a user id or username")
    c = gw(ssub.add_parser("revoke", help="end a session, or every session of --user"))
    c.add_argument("session_id", nargs="?")
    c.add_argument("--user", help="a user id or username; me: every session of yours")
    for c in ssub.choices.values():
        c.set_defaults(func=cmd_session)

    p = sub.add_parser("user", help="users: add, list, disable, enable, roles, password (admins; password: anyone)")
    usub = p.add_subparsers(dest="action", required=True)
    c = gw(usub.add_parser("add", help="add a user"))
    c.add_argument("username")
    c.add_argument("--role", action="append", help=f"{roles}; repeatable; default viewer")
    c.add_argument("--email")
    c.add_argument("--display-name")
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
    c.add_argument("name")
    c.add_argument("--role", action="append", help=f"{roles}; repeatable; default: your roles")
    c.add_argument("--expires-in", type=int, metavar="SECONDS")
    c = gw(tsub.add_parser("list", help="your API tokens (or --user's with token.any)"))
    c.add_argument("--user", help="a user id or username")
    c = gw(tsub.add_parser("revoke", help="revoke an API token"))
    c.add_argument("token_id")
    for c in tsub.choices.values():
        c.set_defaults(func=cmd_token)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="noetl", description="Run NoETL playbooks as Petri nets over NATS.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("validate", help="check playbooks; every error with its location")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("lint", help="check that playbooks will behave: joins, cycles, ctx races, template names "
                       "(docs/lint.md)")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--format", choices=("text", "json", "sarif"), default="text")
    p.set_defaults(func=cmd_lint)

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
                                    "sessions", "worker", "scheduler"])
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

    p = sub.add_parser("signal", help="send a signal to an execution (D30): it resumes the wait task waiting for it")
    p.add_argument("execution_id")
    p.add_argument("name", help="the signal's name (the wait task's `signal`)")
    p.add_argument("--data", help="the payload, JSON (default: null)")
    p.add_argument("--gateway", default=gateway_default)
    p.set_defaults(func=cmd_signal)
    p = sub.add_parser("waits", help="waits in progress (D30): the inbox of human tasks")
    p.add_argument("--execution-id", dest="execution_id", help="only this execution's")
    p.add_argument("--gateway", default=gateway_default)
    p.set_defaults(func=cmd_waits)

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
    _auth_commands(sub, gateway_default)
    from .schedule_cli import add_commands

    add_commands(sub, gateway_default)
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
