"""A stack's commands: ``noetl up`` (NATS, Postgres and every service, in the foreground), ``service``
(one service), ``setup`` and ``bootstrap`` (a deployment's streams and first admin), ``nats-credentials``;
and the embedded stack that ``noetl run`` starts too (:func:`provision`, :func:`embedded_stack`)."""
from __future__ import annotations

import argparse
import os
import sys

from ..home import HomeLock, finding
from .common import (EXIT_FAILED, EXIT_OK, EXIT_PORT_TAKEN, EXIT_STACK, EXIT_UNREACHABLE, Interrupted, Signals, arun, env_int, fail,
                     run_loop)

DEFAULT_METRICS_PORT = 9464
ALLOW_NET_HELP = ("open a destination to the workers' http, postgres and nats tasks (D33): an address, a network or "
                  "a host name, with an optional port (127.0.0.1:8765, 10.0.0.0/8, db.internal:5432); repeatable or "
                  "comma-separated; sets NOETL_SANDBOX_ALLOW_NET for the stack's workers (default: the environment's)")


def allow_net(args: argparse.Namespace) -> str | None:
    """``--allow-net`` (repeatable, comma-separated) as the text of NOETL_SANDBOX_ALLOW_NET for the
    embedded stack's workers, or None when it is not given (they read the environment's). ValueError
    naming what cannot be read: an entry of the flag, or a sandbox setting of the environment (the
    workers would not start)."""
    from ..sandbox.policy import ENV, from_env, parse_destinations

    text = ",".join(args.allow_net) if getattr(args, "allow_net", None) else None
    if text is not None:
        parse_destinations(text, "--allow-net")
    from_env({**os.environ, ENV["allow"]: text} if text is not None else os.environ)
    return text


def add_commands(sub) -> None:
    """up, service, setup, bootstrap, nats-credentials."""
    p = sub.add_parser("up", help="start NATS, Postgres and every service in the foreground")
    p.add_argument("--home", default=os.environ.get("NOETL_HOME", ".noetl"), metavar="DIR",
                   help="data and logs directory (NOETL_HOME); one stack per home")
    p.add_argument("--in-process", action="store_true", help="all services in this process (default: one process each)")
    p.add_argument("--port", type=int, default=0, metavar="PORT",
                   help="the gateway's port on 127.0.0.1 (default: any free port; `noetl up` prints it)")
    p.add_argument("--replicas", metavar="SERVICE=N,...",
                   help="replicas per service, e.g. admission=2,router=2,worker=3 (admission, router, loop-coordinator, "
                        "scheduler, sessions, worker; default one each)")
    p.add_argument("--metrics-port", type=int, metavar="PORT", default=env_int("NOETL_METRICS_PORT"),
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
    p.add_argument("--metrics-port", type=int, metavar="PORT", default=env_int("NOETL_METRICS_PORT"),
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


def preload_services() -> None:
    """Import the services of ``noetl run``'s stack in a thread while NATS and Postgres start (mostly
    waiting for them): the stack then starts without the imports' ~0.3 s."""
    import threading

    def load() -> None:
        try:
            from .. import stack
            for name in stack.ALL_SERVICES:
                if name not in stack.GATEWAY_ONLY:  # noetl run's stack has no gateway
                    stack.service_class(name)
        except Exception:  # noqa: BLE001 - the stack imports them again, and says what failed
            pass

    threading.Thread(target=load, name="noetl-preload", daemon=True).start()


class Servers:
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


def provision(persistent: str | None = None) -> Servers:
    """Start NATS and Postgres (plain code, so that a signal stops a half-started one at once); data
    under ``persistent`` (kept), else in temporary directories removed by ``stop()``."""
    from ..infra.embedded import ENV_NATS_URL, provision_nats, provision_postgres
    from ..infra.nats_auth import NatsAuth

    servers = Servers(persistent)
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


async def embedded_stack(servers: Servers, processes: bool = False, metrics_port: int | None = None,
                         log_format: str | None = None, port: int = 0, counts: dict[str, int] | None = None,
                         allow_net: str | None = None, partitions: int | None = None, gateway: bool = True,
                         sandbox_warm: str | None = None):
    """Every service, on ``servers``: in this process, or (``processes``) one process each, supervised;
    the gateway on ``port`` (0: any free one), ``counts`` replicas per service (stack.parse_replicas).
    ``stop()`` stops the services; the servers are the caller's to stop. ``metrics_port``: in this
    process, the port of its one metrics server (0: a free one; None: none); with ``processes``, the
    first of the services' ports (0 or None: free ones). ``allow_net``: NOETL_SANDBOX_ALLOW_NET for the
    workers (None: the environment's). ``partitions``: of the events stream, when this stack creates it
    (None: NOETL_PARTITIONS, else the default). ``gateway``: False for a stack in this process whose only
    client is the caller, over NATS (``noetl run``: client.StackClient). ``sandbox_warm``: the task kinds
    whose fork servers the workers start ahead (None: NOETL_SANDBOX_WARM, else every kind)."""
    from ..stack import InProcessStack, ProcessStack, Settings

    persistent = servers.persistent
    creds = str(servers.auth.directory) if servers.auth else os.environ.get("NOETL_NATS_CREDS")
    settings = Settings(nats_url=servers.nats.url, pg_dsn=servers.pg.dsn("postgres"), nats_creds=creds,
                        metrics_port=metrics_port, log_format=log_format, port=port, allow_net=allow_net,
                        home=persistent, partitions=partitions, sandbox_warm=sandbox_warm)
    token_file = os.path.join(persistent, "admin.token") if persistent else None
    if processes:
        stack = ProcessStack(settings, log_dir=persistent, supervise=True, token_file=token_file, counts=counts)
    else:
        stack = InProcessStack(settings, token_file=token_file, counts=counts, gateway=gateway)
    try:
        await stack.start()
    except BaseException:
        await stack.stop()
        raise
    return stack


def cmd_up(args: argparse.Namespace) -> int:
    """``noetl up``: the stack in the foreground until SIGINT/SIGTERM (exit 0 then); one per home."""
    from ..infra.embedded import InfraError

    from ..stack import parse_replicas

    home = os.path.abspath(args.home)
    try:
        args.counts = parse_replicas(args.replicas)
        args.allow_net_text = allow_net(args)
    except ValueError as exc:
        return fail(str(exc))
    from ..infra.probes import port_free
    if args.port and not port_free("127.0.0.1", args.port):
        return fail(f"--port {args.port}: the port is in use (another gateway or program listens there)")
    try:
        os.makedirs(home, exist_ok=True)
    except OSError as exc:
        return fail(f"--home {home}: cannot make the directory ({exc.strerror or exc})")
    lock = HomeLock(home)
    busy = lock.acquire()
    if busy:
        return fail(busy, EXIT_STACK)
    try:
        stale = lock.leftovers()
        if stale:
            return fail(stale, EXIT_STACK)
        with Signals() as signals:
            servers = None
            try:
                first = not os.path.exists(os.path.join(home, "admin.token"))
                servers = provision(home)
                arun(_up(args, home, servers, first, lock, signals), signals)
            except Interrupted:
                pass  # how a stack is stopped
            except InfraError as exc:
                return fail(f"cannot start the stack from {home}: {exc}", EXIT_STACK)
            finally:
                if servers is not None:
                    servers.stop()
    finally:
        lock.release()
    return EXIT_OK


async def _up(args: argparse.Namespace, home: str, servers: Servers, first: bool, lock: "HomeLock",
              signals: Signals) -> None:
    from ..stack import shown_dsn, topology, tune_gc

    if args.in_process:
        from ..infra import logs

        logs.configure(None, args.log_format)
    stack = await embedded_stack(servers, processes=not args.in_process,
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
        tune_gc()
        await signals.wait()
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
    from ..client import store_token, stored_token

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
    from ..client import store_token, stored_token

    if token and stored_token(url) == token:
        store_token(url, None)


def _nats_settings(args: argparse.Namespace):
    """``--nats-url``/``NOETL_NATS_URL`` and ``--nats-creds``/``NOETL_NATS_CREDS`` (an nkey seed file, or
    a directory of them: the service's own is taken), checked before anything starts."""
    from ..infra.nats_auth import read_seed
    from ..stack import Settings

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

    from ..stack import serve_forever

    try:
        settings = _nats_settings(args)
        if args.name == "worker":  # D33: a bad sandbox setting stops the worker here, in one line
            from ..sandbox.policy import from_env

            from_env()
    except ValueError as exc:
        return fail(str(exc))
    from ..infra import logs
    from ..infra.probes import PortTaken

    logs.configure(args.name, args.log_format)
    # the default port, when taken (another service on this host), leaves the service without one:
    # found by binding it, not by looking first (two services starting at once both saw it free)
    port = DEFAULT_METRICS_PORT if args.metrics_port is None else args.metrics_port
    from ..infra.tls import pg_dsn

    try:  # NOETL_PG_PASSWORD_FILE: the password from a file (a compose secret), not from the DSN
        dsn = pg_dsn(args.pg_dsn or os.environ.get("NOETL_PG_DSN"))
    except ValueError as exc:
        return fail(f"{args.name}: {exc}")
    settings = replace(settings, pg_dsn=dsn, concurrency=args.concurrency,
                       host=args.host, port=args.port, ack_wait=args.ack_wait,
                       metrics_port=None if port < 0 else port, metrics_optional=args.metrics_port is None,
                       metrics_host=args.metrics_host, home=os.path.abspath(args.home))
    try:
        run_loop(serve_forever(args.name, settings))
    except PortTaken as exc:
        return fail(f"{args.name}: {exc}; choose another --metrics-port (0: any free one, -1: none)", EXIT_PORT_TAKEN)
    except ValueError as exc:  # a mistake in the settings (credentials, TLS): one line, exit 2
        return fail(str(exc))
    return EXIT_OK


def cmd_setup(args: argparse.Namespace) -> int:
    """``noetl setup``: create the streams, the membership bucket and the payload store (as the admin)."""
    import asyncio

    from ..stack import setup

    args.name = "admin"
    try:
        settings = _nats_settings(args)
    except ValueError as exc:
        return fail(str(exc))
    try:
        asyncio.run(setup(settings))
    except ValueError as exc:  # NATS refused the credentials, its certificate does not verify, a bad TLS setting
        return fail(str(exc))
    print(f"streams, bucket and object store ready at {settings.nats_url}")
    return EXIT_OK


def cmd_bootstrap(args: argparse.Namespace) -> int:
    """``noetl bootstrap``: the first admin of a deployment (docker-compose.yml), as the NATS admin: the
    sessions service creates it only while no user exists and answers an API token for it, written to
    ``--out`` (0600) or, with ``--out -``, to stdout alone (messages go to stderr)."""
    import asyncio

    from ..infra.bus import BusError, NatsRefused
    from ..stack import bootstrap

    args.name = "admin"
    try:
        settings = _nats_settings(args)
    except ValueError as exc:
        return fail(str(exc))
    if args.out != "-" and os.path.exists(args.out):
        return fail(f"--out {args.out}: exists; the token is written once (remove the file, or --out -)")
    try:  # connecting retries for ever (a service waits for NATS): the whole is bounded here
        token = asyncio.run(asyncio.wait_for(bootstrap(settings, None, username=args.username, timeout=args.timeout),
                                             args.timeout))
    except NatsRefused as exc:
        return fail(str(exc))
    except (BusError, TimeoutError) as exc:
        return fail(f"no NATS or no sessions service answered at {settings.nats_url} within {args.timeout:g}s"
                    + (f" ({exc})" if str(exc) else ""), EXIT_UNREACHABLE)
    if token is None:
        return fail("the stack has users already: log in as one of them (noetl login)", EXIT_FAILED)
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
    from ..infra.nats_auth import NatsAuth

    try:
        auth = NatsAuth(args.out, pools=args.pool or ["default"], partitions=args.partitions).ensure()
    except ValueError as exc:
        return fail(str(exc))
    except OSError as exc:
        return fail(f"--out {args.out}: {exc.strerror or exc}")
    print(f"{auth.config_file}: the server's users ({auth.partitions} partitions, pools {', '.join(auth.pools)})")
    for user in auth.users:
        print(f"{auth.file(user)}: the seed of {user} (keep it secret; NOETL_NATS_CREDS or --nats-creds)")
    if args.reader is not None:
        try:
            auth.grant_read(args.reader)
        except ValueError as exc:
            return fail(str(exc))
        print(f"the seeds are readable by uid {args.reader} too (an ACL entry: ls -l shows a +)")
    return EXIT_OK
