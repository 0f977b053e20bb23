"""A small HTTP API on loopback for tests and examples (``examples/pagination.yaml`` pages through it).

Routes: ``/assessments?page=N&pageSize=M`` (25 items in the envelope ``{"data": {"data": [...],
"paging": {"page", "hasMore"}}}``; with ``&flaky=KEY`` page 2 answers 503 the first time for that
KEY), ``/events?limit=N&cursor=C`` (the same 25 items by an opaque cursor: ``{"events": [...],
"next_cursor": C or null, "limit": N}``), ``/status/<code>``, ``/flaky/<key>/<n>`` (503 for the first
n calls of a key, then 200), ``/slow/<seconds>``, ``/redirect?to=URL`` (302 to URL), ``/echo`` (POST:
the JSON body back). Anything else is 404.

``python -m noetl_mesh.testing.fixture_api [--port 8765]`` serves it in the foreground (the port
``examples/pagination.yaml`` expects) until Ctrl-C.
"""
from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

ITEMS = [{"id": i, "score": (i * 37) % 100} for i in range(1, 26)]


class _Handler(BaseHTTPRequestHandler):
    calls: dict[str, int] = {}
    lock = threading.Lock()

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, code: int, body, content_type: str = "application/json") -> None:
        data = json.dumps(body).encode() if content_type == "application/json" else str(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        url = urlparse(self.path)
        parts = [p for p in url.path.split("/") if p]
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        if parts == ["assessments"]:
            page, size = int(query.get("page", 1)), int(query.get("pageSize", 10))
            if "flaky" in query and page == 2:  # page 2 of a key answers 503 the first time
                with self.lock:
                    n = self.calls[f"assessments/{query['flaky']}"] = self.calls.get(f"assessments/{query['flaky']}", 0) + 1
                if n == 1:
                    return self._send(503, {"page": page, "attempt": n})
            chunk = ITEMS[(page - 1) * size: page * size]
            has_more = page * size < len(ITEMS)
            return self._send(200, {"data": {"data": chunk, "paging": {"page": page, "hasMore": has_more}}})
        if parts == ["events"]:
            start, size = int(query.get("cursor", "c0")[1:] or 0), int(query.get("limit", 10))
            end = start + size
            return self._send(200, {"events": ITEMS[start:end], "next_cursor": f"c{end}" if end < len(ITEMS) else None,
                                    "limit": size})
        if len(parts) == 2 and parts[0] == "status":
            return self._send(int(parts[1]), {"status": int(parts[1])})
        if len(parts) == 3 and parts[0] == "flaky":
            with self.lock:
                n = self.calls[parts[1]] = self.calls.get(parts[1], 0) + 1
            if n <= int(parts[2]):
                return self._send(503, {"attempt": n})
            return self._send(200, {"attempt": n, "ok": True})
        if len(parts) == 2 and parts[0] == "slow":
            time.sleep(float(parts[1]))
            return self._send(200, {"slept": float(parts[1])})
        if parts == ["redirect"] and "to" in query:
            self.send_response(302)
            self.send_header("Location", query["to"])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        if parts == ["text"]:
            return self._send(200, "plain text", "text/plain")
        return self._send(404, {"error": "not found", "path": url.path})

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"null")
        if self.path.startswith("/echo"):
            return self._send(200, {"echo": body})
        return self._send(404, {"error": "not found"})


class QuietHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:  # a client that hung up: not our concern
        pass


class FixtureApi:
    def __init__(self, port: int = 0):
        self.server = QuietHTTPServer(("127.0.0.1", port), _Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:PORT``: what a stack's workers must be allowed to reach (NOETL_SANDBOX_ALLOW_NET)."""
        return f"127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> "FixtureApi":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m noetl_mesh.testing.fixture_api",
                                     description="The tests' HTTP API on loopback, for examples/pagination.yaml.")
    parser.add_argument("--port", type=int, default=8765, help="the port to listen on (default: 8765)")
    args = parser.parse_args(argv)
    try:
        api = FixtureApi(args.port)
    except OSError as exc:
        print(f"fixture_api: cannot listen on 127.0.0.1:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"fixture API at {api.url} (Ctrl-C stops it)", flush=True)
    try:
        api.server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        api.server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
