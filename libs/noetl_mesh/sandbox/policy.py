"""A worker pool's sandbox policy (D33): what user code and tool destinations may reach. Pure.

Read once per worker process from its environment (:func:`from_env`); every variable is optional and the
defaults are the safe ones:

| variable | default | meaning |
|---|---|---|
| ``NOETL_SANDBOX`` | ``on`` | ``on``: user code (python, duckdb) runs sandboxed and the worker refuses it when it cannot sandbox; ``off``: a *trusted* pool, user code runs with the worker's own rights (said loudly at start) |
| ``NOETL_SANDBOX_ALLOW_NET`` | empty | destinations opened beyond the default, comma-separated: an address or network (``10.0.0.0/8``, ``::1``) or a host name, each with an optional ``:port`` (``127.0.0.1:8765``, ``[::1]:8080``, ``db.internal:5432``) |
| ``NOETL_SANDBOX_PYTHON_NET`` | ``0`` | ``1``: python, duckdb and shell tasks may open network sockets (to any address: the kernel filter cannot look at addresses) |
| ``NOETL_SANDBOX_DATA_DIRS`` | empty | directories user code may read and write besides its scratch directory, separated by ``:`` (``/data:/warehouse``) |
| ``NOETL_POOL_ROLES`` | ``*`` (anyone); ``admin`` on a trusted pool | the roles, comma-separated, of whoever started an execution (a child: its root) whose commands the pool runs; ``*`` anyone. Another's commands fail with ``error.kind: forbidden`` before any task runs |

Destinations of ``http``, ``postgres`` and ``nats`` tasks are checked with :meth:`Policy.refusal` on the address a
connection is really made to (after name resolution): loopback, link-local (cloud metadata services live
there), unspecified, multicast, the known metadata addresses and the worker host's own addresses
(:meth:`Policy.with_host_addresses`) are closed unless an entry of ``NOETL_SANDBOX_ALLOW_NET`` opens
them. The endpoints the worker adds itself (its NATS servers'
address and port) are closed whatever the allow-list says.
"""
from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

__all__ = ["Destination", "Policy", "PolicyError", "from_env", "parse_destinations", "ENV"]

ENV = {
    "enabled": "NOETL_SANDBOX",
    "allow": "NOETL_SANDBOX_ALLOW_NET",
    "python_network": "NOETL_SANDBOX_PYTHON_NET",
    "data_dirs": "NOETL_SANDBOX_DATA_DIRS",
    "roles": "NOETL_POOL_ROLES",
}
ANYONE = "*"

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# Closed by default, with the words an error uses for them.
_CLOSED: tuple[tuple[IPNetwork, str], ...] = tuple(
    (ipaddress.ip_network(net), why) for net, why in (
        ("169.254.169.254/32", "a cloud metadata address"),
        ("169.254.170.2/32", "a cloud metadata address"),
        ("100.100.100.200/32", "a cloud metadata address"),
        ("fd00:ec2::254/128", "a cloud metadata address"),
        ("127.0.0.0/8", "a loopback address"),
        ("::1/128", "a loopback address"),
        ("169.254.0.0/16", "a link-local address"),
        ("fe80::/10", "a link-local address"),
        ("0.0.0.0/8", "an unspecified address"),
        ("::/128", "an unspecified address"),
        ("224.0.0.0/4", "a multicast address"),
        ("ff00::/8", "a multicast address"),
        ("255.255.255.255/32", "a broadcast address"),
    ))


_EMBEDDING = tuple(ipaddress.ip_network(n) for n in (
    "::/96",  # IPv4-compatible (deprecated): ::127.0.0.1
    "::ffff:0:0:0/96",  # IPv4-translated (SIIT): ::ffff:0:7f00:1
    "64:ff9b::/96",  # NAT64's well-known prefix: a NAT64 gateway reaches the IPv4 address it ends with
    "64:ff9b:1::/48",  # NAT64's local-use prefixes (RFC 8215): the same, where a network runs one
))


def _plain(ip: IPAddress) -> IPAddress:
    """The IPv4 address an IPv6 address stands for, or ``ip``: ``::ffff:127.0.0.1``, ``::127.0.0.1``,
    ``::ffff:0:7f00:1`` and ``64:ff9b::7f00:1`` are ``127.0.0.1``; a 6to4 or Teredo address is the one
    it embeds."""
    if ip.version != 6:
        return ip
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:  # (server, client): the client is where the packets go
        return ip.teredo[1]
    if int(ip) > 1 and any(ip in net for net in _EMBEDDING):  # :: and ::1 are themselves
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip


class PolicyError(ValueError):
    """A sandbox setting that cannot be read: names the variable and the entry."""


@dataclass(frozen=True)
class Destination:
    """One entry of an allow-list: a network or a host name, and an optional port."""

    network: IPNetwork | None = None
    host: str | None = None
    port: int | None = None

    def matches(self, address: IPAddress, port: int, host: str | None) -> bool:
        if self.port is not None and self.port != port:
            return False
        if self.network is not None:
            return address.version == self.network.version and address in self.network
        return host is not None and host.rstrip(".").lower() == self.host

    def __str__(self) -> str:
        if self.network is not None:  # one address as written (127.0.0.1, not 127.0.0.1/32)
            where = str(self.network.network_address) if self.network.num_addresses == 1 else str(self.network)
        else:
            where = str(self.host)
        if self.port is None:
            return where
        return f"[{where}]:{self.port}" if self.network is not None and self.network.version == 6 else f"{where}:{self.port}"


def _port(text: str, entry: str, variable: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise PolicyError(f"{variable}: {entry!r}: the port must be a number from 1 to 65535")
    return int(text)


def parse_destinations(text: str, variable: str = ENV["allow"]) -> tuple[Destination, ...]:
    """``"127.0.0.1:8765, 10.0.0.0/8, [::1]:80, api.internal"`` -> destinations; :class:`PolicyError`
    naming the variable and the entry that cannot be read."""
    out: list[Destination] = []
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            continue
        where, port = entry, None
        if entry.startswith("["):  # [v6]:port
            close = entry.find("]")
            if close < 0:
                raise PolicyError(f"{variable}: {entry!r}: a '[' without its ']'")
            where, rest = entry[1:close], entry[close + 1:]
            if rest:
                if not rest.startswith(":"):
                    raise PolicyError(f"{variable}: {entry!r}: write [address]:port")
                port = _port(rest[1:], entry, variable)
        elif entry.count(":") == 1:  # v4 or a host name, with a port
            where, _, p = entry.partition(":")
            port = _port(p, entry, variable)
        try:
            out.append(Destination(network=ipaddress.ip_network(where, strict=False), port=port))
            continue
        except ValueError:
            pass
        host = where.rstrip(".").lower()
        if not host or "/" in host or not all(part and len(part) < 64 and all(c.isalnum() or c == "-" for c in part)
                                               for part in host.split(".")):
            raise PolicyError(f"{variable}: {entry!r} is neither an address, a network nor a host name")
        out.append(Destination(host=host, port=port))
    return tuple(out)


def _flag(value: str | None, variable: str, default: bool) -> bool:
    if value is None or value.strip() == "":
        return default
    v = value.strip().lower()
    if v in ("1", "on", "true", "yes"):
        return True
    if v in ("0", "off", "false", "no"):
        return False
    raise PolicyError(f"{variable}={value!r}: write on or off")


@dataclass(frozen=True)
class Policy:
    """What user code and tool destinations may reach on one worker pool."""

    enabled: bool = True
    allow: tuple[Destination, ...] = ()
    python_network: bool = False
    data_dirs: tuple[str, ...] = ()
    roles: frozenset[str] | None = None  # whose executions the pool runs (their starter's roles); None: anyone
    # closed whatever the allow-list says: the engine's own endpoints (its NATS servers), as
    # (address, port) with the words an error uses
    engine: tuple[tuple[IPAddress, int, str], ...] = field(default=())
    # closed unless the allow-list opens them: the addresses of the worker's own host (what listens on
    # 0.0.0.0 there: its metrics port, a sidecar, a Docker bridge's services)
    own: frozenset[IPAddress] = frozenset()

    def with_host_addresses(self, addresses: Iterable[str]) -> "Policy":
        """The policy with the worker host's own ``addresses`` closed unless ``allow`` opens them."""
        out = set(self.own)
        for address in addresses:
            try:
                out.add(_plain(ipaddress.ip_address(address)))
            except ValueError:
                continue
        return replace(self, own=frozenset(out))

    def with_engine_endpoints(self, endpoints: Iterable[tuple[str, int]],
                              why: str = "the engine's own NATS server") -> "Policy":
        """The policy with ``(address, port)`` pairs closed to tasks whatever ``allow`` says."""
        out = []
        for address, port in endpoints:
            try:
                out.append((_plain(ipaddress.ip_address(address)), int(port), why))
            except ValueError:
                continue
        return replace(self, engine=self.engine + tuple(out))

    def refusal(self, address: str | IPAddress, port: int, host: str | None = None) -> str | None:
        """``None`` when a connection to ``address:port`` (reached as ``host``) is allowed; otherwise
        why not, in words an error message can use."""
        ip = _plain(ipaddress.ip_address(address) if isinstance(address, str) else address)
        for engine_ip, engine_port, why in self.engine:
            if ip == engine_ip and port == engine_port:
                return f"{ip}:{port} is {why}"
        if any(d.matches(ip, port, host) for d in self.allow):
            return None
        for net, why in _CLOSED:
            if ip.version == net.version and ip in net:
                return f"{ip} is {why}"
        if ip in self.own:
            return f"{ip} is an address of the worker's own host"
        return None

    def describe(self) -> str:
        """One line for a worker's start-up log."""
        served = "anyone's executions" if self.roles is None else "executions started by " + ", ".join(sorted(self.roles))
        if not self.enabled:
            return f"sandbox OFF (trusted pool): user code runs with the worker's own rights; runs {served}"
        parts = ["sandbox on", f"python network {'open' if self.python_network else 'closed'}"]
        parts.append("allow-net " + (", ".join(map(str, self.allow)) if self.allow else "none"))
        parts.append("data dirs " + (":".join(self.data_dirs) if self.data_dirs else "none"))
        parts.append("runs " + served)
        return "; ".join(parts)


def from_env(environ: Mapping[str, str] | None = None) -> Policy:
    """The policy the environment sets (see the module's table); :class:`PolicyError` on a bad value."""
    env = os.environ if environ is None else environ
    mode = (env.get(ENV["enabled"]) or "on").strip().lower()
    if mode not in ("on", "off", "1", "0", "true", "false"):
        raise PolicyError(f"{ENV['enabled']}={env.get(ENV['enabled'])!r}: write on (sandboxed) or off (a trusted pool)")
    dirs = []
    for d in (env.get(ENV["data_dirs"]) or "").split(":"):
        d = d.strip()
        if not d:
            continue
        if not os.path.isabs(d):
            raise PolicyError(f"{ENV['data_dirs']}: {d!r} is not an absolute path")
        dirs.append(os.path.normpath(d))
    enabled = mode in ("on", "1", "true")
    roles_text = (env.get(ENV["roles"]) or "").strip() or (ANYONE if enabled else "admin")
    roles = frozenset(r.strip() for r in roles_text.split(",") if r.strip())
    from ..core.access import ROLES  # here: it imports the password hasher, which most readers never need

    unknown = sorted(roles - set(ROLES) - {ANYONE})
    if not roles or unknown or (ANYONE in roles and len(roles) > 1):
        raise PolicyError(f"{ENV['roles']}={env.get(ENV['roles'])!r}: write roles among {', '.join(ROLES)} separated by "
                          f"commas, or * for anyone" + (f" ({', '.join(unknown)} is none of them)" if unknown else ""))
    return Policy(
        enabled=enabled,
        roles=None if ANYONE in roles else roles,
        allow=parse_destinations(env.get(ENV["allow"]) or ""),
        python_network=_flag(env.get(ENV["python_network"]), ENV["python_network"], False),
        data_dirs=tuple(dirs),
    )
