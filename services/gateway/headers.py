"""The security headers of the gateway's pages (the console under ``/ui``, ``/docs``, ``/redoc``), in one
place: each page gets a Content-Security-Policy as strict as what it runs allows, and the same
framing, sniffing and referrer rules. Every other answer gets ``X-Content-Type-Options: nosniff``
(app.py, ``_Guard``).

A policy is built from directives (:func:`policy`); a page whose HTML holds an inline ``<script>`` or
``<style>`` (Swagger UI's start-up script) allows exactly that text by its SHA-256 (:func:`inline_hashes`),
never ``'unsafe-inline'`` for scripts.
"""
from __future__ import annotations

import base64
import hashlib
import re

# Nothing may frame a page (clickjacking), guess a type, or learn where the reader came from.
PAGE = {"x-content-type-options": "nosniff", "referrer-policy": "no-referrer", "x-frame-options": "DENY",
        "cache-control": "no-cache"}
# What every policy says: nothing by default, no <base>, no form posts, no framing.
BASE = {"default-src": "'none'", "base-uri": "'none'", "form-action": "'none'", "frame-ancestors": "'none'"}
_INLINE = {tag: re.compile(rf"<{tag}>(.*?)</{tag}>", re.S) for tag in ("script", "style")}


def inline_hashes(html: str, tag: str) -> list[str]:
    """``'sha256-…'`` sources for each inline ``<tag>`` element (without attributes) of ``html``."""
    return [f"'sha256-{base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()}'"
            for body in _INLINE[tag].findall(html)]


def policy(**directives: str | list[str]) -> str:
    """A Content-Security-Policy: :data:`BASE` with ``directives`` (``script_src="'self'"``) over it."""
    merged = {**BASE, **{k.replace("_", "-"): " ".join(v) if isinstance(v, list) else v for k, v in directives.items()}}
    return "; ".join(f"{k} {v}" for k, v in merged.items())


def page(csp: str) -> dict[str, str]:
    """The headers of a page with policy ``csp``."""
    return {"content-security-policy": csp, **PAGE}
