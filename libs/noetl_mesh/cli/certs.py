"""``noetl certs --out DIR``: a development CA, the TLS certificates of a container stack and the
Postgres password (infra/certs.py)."""
from __future__ import annotations

import argparse

from .common import EXIT_OK, fail


def add_commands(sub) -> None:
    p = sub.add_parser("certs", help="make a development CA and the TLS certificates of a container stack (NATS, its "
                                     "routes, Postgres, the gateway and its proxy) and the Postgres password; "
                                     "keeps what exists and still fits")
    p.add_argument("--out", required=True, metavar="DIR", help="directory for the CA, certificates and keys (0700)")
    p.add_argument("--host", action="append", default=[], metavar="NAME",
                   help="another name (or address) clients reach NATS and the proxy by (repeatable)")
    p.add_argument("--nats-host", action="append", default=[], metavar="NAME",
                   help="another name of the NATS nodes, for their clients and their routes alike (repeatable): "
                        "nats-0.nats, nats-1.nats, nats-2.nats for deploy/k8s's StatefulSet")
    p.add_argument("--client", action="append", default=[], metavar="NAME",
                   help="also a client certificate client-NAME.crt (for a NATS server that verifies clients; repeatable)")
    p.add_argument("--days", type=int, default=397, help="validity of a new certificate (default 397; the CA: 10 years)")
    p.add_argument("--reader", type=int, metavar="UID", help="let this user read the keys the services read too (an "
                   "ACL entry): the containers' user, 10001, for docker-compose.yml's secrets")
    p.set_defaults(func=cmd_certs)


def cmd_certs(args: argparse.Namespace) -> int:
    """``noetl certs --out DIR``: a development CA, the stack's certificates and the Postgres password
    (infra/certs.py); what exists and still fits is kept, so it can run again (another --host, a renewal)."""
    from ..infra.certs import ensure

    if args.days < 1:
        return fail("--days: at least 1")
    try:
        report = ensure(args.out, hosts=args.host, clients=args.client, reader=args.reader, days=args.days,
                        nats_hosts=args.nats_host)
    except ValueError as exc:
        return fail(str(exc))
    except OSError as exc:
        return fail(f"--out {args.out}: {exc.strerror or exc}")
    for line in report.lines:
        print(line)
    if args.reader is not None:
        print(f"gateway.key, postgres.password and the client keys are readable by uid {args.reader} too (an ACL "
              "entry: ls -l shows a +)")
    return EXIT_OK
