"""The metrics port of a service process: ``/metrics`` (Prometheus), ``/livez``, ``/readyz``.

A small HTTP server in a thread of its own, so that ``/metrics`` answers even while the event loop
is busy. ``/livez`` asks the event loop to run a no-op and answers 200 when it does within
``LIVE_TIMEOUT`` seconds (the process is alive and its loop turns), 503 otherwise: restart it.
``/readyz`` runs every registered check on the loop (each within ``READY_TIMEOUT``) and answers 200
when all are ok, else 503 with each check's state: send it no work. A process that runs several
services (the in-process stacks) has one server and one check per service.

``/metrics`` needs ``Authorization: Bearer <NOETL_METRICS_TOKEN>`` when that variable is set; the
probes never do (orchestrators probe without credentials; they say only "ok" or what is not). The
server listens on ``NOETL_METRICS_HOST`` (default 127.0.0.1: only this machine; a container sets
0.0.0.0 to be scraped).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Awaitable, Callable

from prometheus_client.exposition import choose_encoder

from .. import limits
from . import metrics

log = logging.getLogger("noetl.probes")
LIVE_TIMEOUT = 5.0
READY_TIMEOUT = 2.0

DEFAULT_PORT = 9464  # the port Prometheus exporters of OpenTelemetry use; containers listen here

Check = Callable[[], Awaitable[dict[str, Any]]]


class PortTaken(ValueError):
    """The metrics port cannot be listened on: a mistake in the settings, not something to wait out."""


class ProbeServer:
    def __init__(self, loop: asyncio.AbstractEventLoop, host: str | None = None, port: int = 0,
                 token: str | None = None):
        self.loop = loop
        self.host = host or os.environ.get("NOETL_METRICS_HOST") or "127.0.0.1"
        self.port = port
        self.token = token if token is not None else (os.environ.get("NOETL_METRICS_TOKEN") or None)
        self.checks: dict[str, Check] = {}
        self.starting: set[str] = set()  # services not started yet: not ready
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def expect(self, name: str) -> None:
        """``name`` is starting: /readyz says not ready until it registers its check."""
        self.starting.add(name)

    def add(self, name: str, check: Check) -> None:
        self.starting.discard(name)
        self.checks[name] = check

    def remove(self, name: str) -> None:
        self.checks.pop(name, None)
        self.starting.discard(name)

    def start(self) -> "ProbeServer":
        """Listen (:class:`PortTaken` when it cannot) and serve in a daemon thread."""
        try:
            server = _Server((self.host, self.port), _handler(self))
        except OSError as exc:
            raise PortTaken(f"cannot listen on {self.host}:{self.port} for metrics ({exc.strerror or exc})") from None
        server.daemon_threads = True
        self._server, self.port = server, server.server_address[1]
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="noetl-probes", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # ---------------------------------------------------------------- the answers (server threads)
    def live(self) -> tuple[int, dict[str, Any]]:
        turned = threading.Event()
        try:
            self.loop.call_soon_threadsafe(turned.set)
        except RuntimeError:  # the loop is closed
            return 503, {"status": "dead", "error": "the event loop is closed"}
        if not turned.wait(LIVE_TIMEOUT):
            return 503, {"status": "stalled", "error": f"the event loop did not turn within {LIVE_TIMEOUT}s"}
        return 200, {"status": "ok"}

    def ready(self) -> tuple[int, dict[str, Any]]:
        try:
            checks = asyncio.run_coroutine_threadsafe(self._ready(), self.loop).result(READY_TIMEOUT + 1)
        except Exception as exc:  # noqa: BLE001 - a closed or stalled loop: not ready
            return 503, {"status": "not_ready", "error": f"{type(exc).__name__}: {exc}".rstrip(": ")}
        for name in self.starting:
            checks[name] = {"ok": False, "error": "starting"}
        ok = bool(checks) and all(c.get("ok") for c in checks.values())
        return (200 if ok else 503), {"status": "ready" if ok else "not_ready", "services": checks}

    async def _ready(self) -> dict[str, Any]:
        names = list(self.checks)

        async def one(name: str) -> dict[str, Any]:
            try:
                return await asyncio.wait_for(self.checks[name](), READY_TIMEOUT)
            except Exception as exc:  # noqa: BLE001 - a check that fails is a no
                return {"ok": False, "error": f"{type(exc).__name__}: {exc}".rstrip(": ")}

        return dict(zip(names, await asyncio.gather(*(one(n) for n in names))))

    def authorised(self, header: str | None) -> bool:
        if not self.token:
            return True
        scheme, _, value = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), self.token.encode())


class _Server(ThreadingHTTPServer):
    """A thread per connection, at most ``metrics_connections`` at once (a flood of connections costs at
    most that many threads; the rest are closed unanswered)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.slots = threading.BoundedSemaphore(int(limits.current().metrics_connections))

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def _handler(probes: ProbeServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "noetl-probes"
        # the request line and headers (their size bounded by the standard library) must come in time
        timeout = float(limits.current().metrics_request_seconds)

        def do_GET(self) -> None:  # noqa: N802 - the standard library's name
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                if not probes.authorised(self.headers.get("Authorization")):
                    return self._send(401, b'{"error": "a bearer token is required (NOETL_METRICS_TOKEN)"}',
                                      "application/json", [("WWW-Authenticate", "Bearer")])
                encoder, content_type = choose_encoder(self.headers.get("Accept") or "")
                return self._send(200, encoder(metrics.registry), content_type)
            if path == "/livez":
                return self._json(*probes.live())
            if path == "/readyz":
                return self._json(*probes.ready())
            self._json(404, {"error": "not found: /metrics, /livez, /readyz"})

        def _json(self, status: int, body: dict[str, Any]) -> None:
            self._send(status, json.dumps(body, default=str).encode(), "application/json")

        def _send(self, status: int, body: bytes, content_type: str, headers: list | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for name, value in headers or ():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - no access log
            pass

    return Handler


def port_free(host: str, port: int) -> bool:
    """Whether ``host:port`` can be listened on now."""
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


async def nats_check(bus: Any) -> dict[str, Any]:
    """The part every service's readiness shares: its NATS connection."""
    nc = bus.nc
    state = ("connected" if nc.is_connected else "reconnecting" if nc.is_reconnecting
             else "connecting" if nc.is_connecting else "closed" if nc.is_closed else "disconnected")
    return {"ok": state == "connected", "nats": state}


def readiness(service: Any, bus: Any) -> Check:
    """A service's check: NATS connected and, when the service says more (``ready()``: its consumers
    bound, Postgres reachable...), that too."""

    async def check() -> dict[str, Any]:
        out = await nats_check(bus)
        own = getattr(service, "ready", None)
        if own is not None:
            more = await own()
            out.update({k: v for k, v in more.items() if k != "ok"})
            out["ok"] = out["ok"] and bool(more.get("ok"))
        return out

    return check
