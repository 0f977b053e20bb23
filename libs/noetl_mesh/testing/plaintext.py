"""What a NATS server that requires TLS says to a client that never starts TLS (the tests' probe)."""
from __future__ import annotations

import json
import socket


def plaintext_nats(host: str, port: int, timeout: float = 10) -> tuple[dict, bytes]:
    """Connect without TLS, read the server's INFO, send CONNECT and PING in the clear, and read until
    the server closes: ``(the INFO, every byte answered after it)``."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.settimeout(timeout)
        info = json.loads(s.recv(65536).decode().split(" ", 1)[1])
        s.sendall(b'CONNECT {"verbose":true}\r\nPING\r\n')
        answer = b""
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    return info, answer
