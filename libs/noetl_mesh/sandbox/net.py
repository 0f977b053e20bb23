"""Where a task's connection may go (D33, the network part): the addresses a host name really resolves
to, each checked with the pool's :meth:`Policy.refusal <noetl_mesh.sandbox.policy.Policy.refusal>`, and
the words of a refusal.

The ``http``, ``postgres`` and ``nats`` tools resolve a destination here, connect only to an address it returned,
and turn :class:`Refused` into the task's outcome ``error.kind: sandbox`` (not retryable). The decision
itself is the policy's; this module only applies it to every address and explains it.
"""
from __future__ import annotations

import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace

from .policy import ENV, Destination, Policy, _plain

__all__ = ["Refused", "Resolver", "resolve", "allowed_addresses", "check_address", "refusal_text",
           "resolve_endpoints", "host_addresses", "is_address"]

# ``(host, port) -> addresses``: the real one asks the system's resolver; tests give a stub
Resolver = Callable[[str, int], Awaitable[list[str]]]


class Refused(Exception):
    """A connection the pool's policy closes. ``reason`` says what was refused, why, and how to open it
    (or that nothing opens it); ``str()`` is the task's whole message (``<tool> task refused: ...``)."""

    kind = "sandbox"

    def __init__(self, tool: str, reason: str):
        self.tool, self.reason = tool, reason
        self.url: str | None = None  # http: the URL whose connection was refused (a redirect's, maybe)
        super().__init__(f"{tool} task refused: {reason}")


def is_address(host: str) -> bool:
    """Whether ``host`` is an IP address as written (``::1``, ``10.0.0.1``), not a name to resolve."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def resolve(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (the system's resolver, as a connection would), in its order,
    each once. Address forms that are not canonical (``2130706433``, ``0x7f.1``, ``127.1``) resolve to
    the address they mean. OSError when the name does not resolve."""
    import anyio

    out: list[str] = []
    for *_, sockaddr in await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP):
        address = str(sockaddr[0])
        if address not in out:
            out.append(address)
    return out


def _hint(policy: Policy, address: str, port: int) -> str:
    """How to open ``address:port``, or that nothing does (the engine's own endpoints)."""
    ip = _plain(ipaddress.ip_address(address))
    opened = replace(policy, allow=policy.allow + (Destination(network=ipaddress.ip_network(ip), port=port),))
    if opened.refusal(ip, port) is not None:
        return f"it stays closed whatever {ENV['allow']} says"
    entry = f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"
    return f"open it with {ENV['allow']}={entry} (noetl run/up: --allow-net {entry})"


def refusal_text(policy: Policy, host: str, port: int, refused: list[tuple[str, str]]) -> str:
    """The reason of a refusal: the first refused address's, naming ``host`` when it is a name."""
    address, why = refused[0]
    named = "" if is_address(host) else f"{host}:{port} resolves to {', '.join(a for a, _ in refused)}: "
    return f"{named}{why}, closed to tasks on this worker pool (D33); {_hint(policy, address, port)}"


def check_address(policy: Policy, tool: str, address: str, port: int, host: str | None = None) -> None:
    """:class:`Refused` when the policy closes ``address:port`` (reached as ``host``)."""
    why = policy.refusal(address, port, host)
    if why is not None:
        raise Refused(tool, refusal_text(policy, host or address, port, [(address, why)]))


async def allowed_addresses(policy: Policy, tool: str, host: str, port: int,
                            resolver: Resolver | None = None) -> list[str]:
    """The addresses of ``host`` that ``tool`` may connect to on ``port``: an address as written is
    itself, a name is resolved (``resolver``, default :func:`resolve`) and its refused addresses are
    dropped. :class:`Refused` when none is left; OSError when the name does not resolve."""
    if is_address(host):
        addresses = [host]
    else:
        addresses = await (resolver or resolve)(host, port)
    allowed, refused = [], []
    for address in addresses:
        why = policy.refusal(address, port, host)
        if why is None:
            allowed.append(address)
        else:
            refused.append((address, why))
    if allowed:
        return allowed
    if not refused:
        raise OSError(f"{host} resolves to no address")
    raise Refused(tool, refusal_text(policy, host, port, refused))


def host_addresses(fib_trie: str = "/proc/net/fib_trie", if_inet6: str = "/proc/net/if_inet6") -> list[str]:
    """The addresses of this host's own interfaces (for :meth:`Policy.with_host_addresses`): IPv4 from
    the kernel's local routes (``/32 host LOCAL`` in ``fib_trie``), IPv6 from ``if_inet6``; none of a
    file that cannot be read."""
    out: list[str] = []
    try:
        with open(fib_trie) as f:
            last = None
            for line in f:
                text = line.strip()
                if text.startswith("|--"):
                    last = text[3:].strip()
                elif text.startswith("/32 host LOCAL") and last and last not in out:
                    out.append(last)
    except OSError:
        pass
    try:
        with open(if_inet6) as f:
            for line in f:
                fields = line.split()
                if fields and len(fields[0]) == 32:
                    address = str(ipaddress.IPv6Address(int(fields[0], 16)))
                    if address not in out:
                        out.append(address)
    except (OSError, ValueError):
        pass
    return out


def resolve_endpoints(endpoints: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
    """``(host, port)`` pairs with every host name replaced by each address it resolves to now (for
    :meth:`Policy.with_engine_endpoints`, which takes addresses); names that do not resolve are left
    out."""
    out: list[tuple[str, int]] = []
    for host, port in endpoints:
        if is_address(host):
            found = [host]
        else:
            try:
                found = [str(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]
            except OSError:
                continue
        for address in found:
            if (address, port) not in out:
                out.append((address, port))
    return out
