"""Who: ``noetl login``, ``logout``, ``whoami``, and ``session``, ``user``, ``token`` (list, add, revoke, ...),
through a gateway. A login's token is kept per gateway (client.store_token)."""
from __future__ import annotations

import argparse
import os
import sys

from .common import EXIT_FAILED, EXIT_OK, fail, gateway_call, gateway_option, unreachable


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
    import asyncio

    import httpx

    from ..client import TOKEN_ENV, GatewayClient, GatewayError, store_token, stored_token

    if args.token and args.oidc_token:
        return fail("give --token or --oidc-token, not both")
    try:
        username = password = None
        if not args.token and not args.oidc_token:
            username = args.username or input("username: ").strip()
            password = _secret(f"password for {username}: ", args.password_stdin)
    except (EOFError, KeyboardInterrupt, ValueError) as exc:
        return fail(f"no password read ({type(exc).__name__})")

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
        return fail(str(exc), EXIT_FAILED)
    except (OSError, httpx.TransportError) as exc:
        return unreachable(args.gateway, exc)


def cmd_logout(args: argparse.Namespace) -> int:
    """``noetl logout``: end the stored session and forget it. An API token is only forgotten here
    (``noetl token revoke`` revokes it)."""
    import asyncio

    import httpx

    from ..client import TOKEN_ENV, GatewayClient, GatewayError, store_token, stored_token

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
                return fail(f"{exc}; the token is still stored", EXIT_FAILED)
        except (OSError, httpx.TransportError) as exc:
            return unreachable(args.gateway, exc, "; the token is still stored")
        store_token(args.gateway, None)
        print(f"logged out of {args.gateway}")
    else:
        store_token(args.gateway, None)
        print(f"forgot the API token stored for {args.gateway}; it stays valid until revoked "
              "(`noetl token revoke ID`)")
    return EXIT_OK


def cmd_whoami(args: argparse.Namespace) -> int:
    return gateway_call(args, lambda c: c.whoami())


def cmd_session(args: argparse.Namespace) -> int:
    if args.action == "list":
        return gateway_call(args, lambda c: c.sessions(args.user))
    if bool(args.session_id) == bool(args.user):
        return fail("give a session id, or --user USER (me: every session of yours)")
    if args.session_id:
        return gateway_call(args, lambda c: c.revoke_session(args.session_id))
    return gateway_call(args, lambda c: c.revoke_sessions(args.user))


def cmd_user(args: argparse.Namespace) -> int:
    try:
        if args.action == "add":
            password = _secret(f"password for {args.username}: ", args.password_stdin, confirm=True) \
                if (args.password or args.password_stdin) else None
            return gateway_call(args, lambda c: c.add_user(args.username, args.role or None, password,
                                                           args.email, args.display_name))
        if args.action == "password":
            own = args.user in (None, "me")
            current = (_secret("current password (empty if none): ", args.password_stdin) or None) if own else None
            password = _secret("new password: ", args.password_stdin, confirm=not args.password_stdin)
            return gateway_call(args, lambda c: c.set_password(password, args.user or "me", current))
    except (EOFError, KeyboardInterrupt, ValueError) as exc:
        return fail(f"no password read: {exc or type(exc).__name__}")
    if args.action == "list":
        return gateway_call(args, lambda c: c.users())
    if args.action == "roles":
        return gateway_call(args, lambda c: c.set_roles(args.user, args.roles))
    action = {"disable": "disable_user", "enable": "enable_user"}[args.action]
    return gateway_call(args, lambda c: getattr(c, action)(args.user))


def cmd_token(args: argparse.Namespace) -> int:
    if args.action == "create":
        return gateway_call(args, lambda c: c.create_token(args.name, args.role or None, args.expires_in))
    if args.action == "list":
        return gateway_call(args, lambda c: c.tokens(args.user))
    return gateway_call(args, lambda c: c.revoke_token(args.token_id))


def add_commands(sub) -> None:
    roles = "admin, developer, operator or viewer"
    gw = gateway_option  # every one of these talks to a gateway

    p = gw(sub.add_parser("login", help="log in to a gateway and keep the token (password, OIDC or API token)"))
    p.add_argument("--username", help="the user to log in as (asked for when not given)")
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
    c.add_argument("--user", help="a user id or username (default: you)")
    c = gw(ssub.add_parser("revoke", help="end a session, or every session of --user"))
    c.add_argument("session_id", nargs="?", help="the session to end (or --user)")
    c.add_argument("--user", help="a user id or username; me: every session of yours")
    for c in ssub.choices.values():
        c.set_defaults(func=cmd_session)

    p = sub.add_parser("user", help="users: add, list, disable, enable, roles, password (admins; password: anyone)")
    usub = p.add_subparsers(dest="action", required=True)
    c = gw(usub.add_parser("add", help="add a user"))
    c.add_argument("username", help="the new user's login name")
    c.add_argument("--role", action="append", help=f"{roles}; repeatable; default viewer")
    c.add_argument("--email", help="the user's e-mail address (matched by OIDC logins)")
    c.add_argument("--display-name", help="the user's full name, for display")
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
    c.add_argument("name", help="what the token is for (shown by `noetl token list`)")
    c.add_argument("--role", action="append", help=f"{roles}; repeatable; default: your roles")
    c.add_argument("--expires-in", type=int, metavar="SECONDS",
                   help="seconds until the token expires (at most what your session or token has left; default: all of it)")
    c = gw(tsub.add_parser("list", help="your API tokens (or --user's with token.any)"))
    c.add_argument("--user", help="a user id or username (default: you)")
    c = gw(tsub.add_parser("revoke", help="revoke an API token"))
    c.add_argument("token_id", help="the token's id (from `noetl token list`)")
    for c in tsub.choices.values():
        c.set_defaults(func=cmd_token)
