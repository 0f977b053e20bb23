"""A loopback HTTP server for result-limit tests: bodies of any size, generated while they are sent
(never built in memory), so a test can offer a worker 300 MB without holding them.

Routes: ``/stream/N`` N bytes of ``x`` with chunked transfer encoding; ``/announce/N`` the same with
``Content-Length: N``; ``/json/N`` a JSON string of about N bytes; ``/echo`` ``{"url": <the request's
path and query string>}``; anything else 404 with the same body. ``sent[path]`` counts what was sent.
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import urlsplit

from noetl_mesh.testing.fixture_api import QuietHTTPServer

MIB = 1024 * 1024


class _Streams(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    sent: dict[str, int] = {}

    def log_message(self, *args: Any) -> None:
        pass

    def _json(self, status: int, value: Any) -> None:
        body = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        parts = urlsplit(self.path).path.strip("/").split("/")
        if parts == ["echo"] or len(parts) != 2 or parts[0] not in ("json", "stream", "announce"):
            return self._json(200 if parts == ["echo"] else 404, {"url": self.path})
        kind, size = parts[0], int(parts[1])
        if kind == "json":
            return self._json(200, "j" * size)
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        chunked = kind == "stream"
        self.send_header(*(("Transfer-Encoding", "chunked") if chunked else ("Content-Length", str(size))))
        self.end_headers()
        block, sent = b"x" * 65536, 0
        try:
            while sent < size:
                part = block[: min(len(block), size - sent)]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
                sent += len(part)
                _Streams.sent[self.path] = sent
            if chunked:
                self.wfile.write(b"0\r\n\r\n")
        except OSError:  # the client hung up
            pass


class StreamServer:
    sent = _Streams.sent

    def __init__(self) -> None:
        self.server = QuietHTTPServer(("127.0.0.1", 0), _Streams)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
