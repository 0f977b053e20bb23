"""The gateway's /docs and /redoc work with no internet: every script, style sheet and icon they load
is served by the gateway itself, without a token, like the other public pages."""
from __future__ import annotations

import asyncio
import re
from urllib.parse import urlsplit

import httpx
import pytest

from noetl_mesh.services.gateway.app import create_app


class NoBus:
    """create_app touches no bus while it builds the routes; the docs pages ask nothing of it."""


class Client:
    """GET through the app itself (its middleware included), no server."""

    def __init__(self, app):
        self.app = app

    def get(self, url: str) -> httpx.Response:
        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://gw") as c:
                return await c.get(url)

        return asyncio.run(go())


@pytest.fixture(scope="module")
def client():
    return Client(create_app(NoBus()))  # type: ignore[arg-type]


def _loaded(html: str) -> list[str]:
    """Every URL a page loads: script sources, link hrefs (style sheets, icons), and what its inline
    script fetches (the OpenAPI description)."""
    found = re.findall(r"""<(?:script|link|img)\b[^>]*?\b(?:src|href)\s*=\s*["']([^"']+)["']""", html, re.I)
    found += re.findall(r"""\burl:\s*['"]([^'"]+)['"]""", html)
    found += re.findall(r"""\bspec-url\s*=\s*["']([^"']+)["']""", html)
    return found


@pytest.mark.parametrize("page,kinds", [
    ("/docs", {"swagger-ui-bundle.js": "javascript", "swagger-ui.css": "text/css", "favicon.png": "image/png"}),
    ("/redoc", {"redoc.standalone.js": "javascript", "favicon.png": "image/png"}),
])
def test_docs_pages_load_only_what_the_gateway_serves(client, page, kinds):
    resp = client.get(page)  # no Authorization header: public
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/html")
    urls = _loaded(resp.text)
    assert urls, resp.text
    for url in urls:
        parts = urlsplit(url)
        assert not parts.scheme and not parts.netloc and url.startswith("/"), f"{page} loads {url} from elsewhere"
        assert "cdn" not in url and "fonts.googleapis" not in resp.text
        got = client.get(url)
        assert got.status_code == 200, url
        assert "x-request-id" in got.headers  # through the gateway's guard like every answer
    assets = {u.rsplit("/", 1)[1]: u for u in urls if u.startswith("/docs/assets/")}
    assert set(assets) == set(kinds)
    for name, kind in kinds.items():
        got = client.get(assets[name])
        assert kind in got.headers["content-type"] and len(got.content) > 1000, name
    assert client.get("/openapi.json").json()["info"]["title"] == "NoETL mesh gateway"


def test_swagger_ui_asks_no_outside_validator(client):
    assert '"validatorUrl": null' in client.get("/docs").text


def test_the_oauth2_redirect_page_stays(client):
    resp = client.get("/docs/oauth2-redirect")
    assert resp.status_code == 200 and "oauth2" in resp.text.lower()


def test_an_asset_that_does_not_exist_is_404(client):
    assert client.get("/docs/assets/nope.js").status_code == 404


def _policy(resp: httpx.Response) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for part in resp.headers["content-security-policy"].split(";"):
        name, *sources = part.split()
        assert name not in out, f"{name} twice"
        out[name] = set(sources)
    return out


def _sha256(text: str) -> str:
    import base64
    import hashlib

    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


@pytest.mark.parametrize("page", ["/docs", "/redoc", "/docs/oauth2-redirect"])
def test_docs_pages_run_only_the_gateways_scripts(client, page):
    """A Content-Security-Policy as strict as each page allows: nothing by default, scripts from the
    gateway and, inline, exactly the page's own (by hash), nothing from another origin, no framing."""
    resp = client.get(page)
    csp = _policy(resp)
    assert csp["default-src"] == csp["frame-ancestors"] == csp["base-uri"] == csp["form-action"] == {"'none'"}
    inline = {_sha256(body) for body in re.findall(r"<script>(.*?)</script>", resp.text, re.S)}
    assert csp["script-src"] == {"'self'", *inline}  # no 'unsafe-inline', no 'unsafe-eval'
    assert inline or page == "/redoc"
    allowed = {"'self'", "'none'", "data:", "blob:", "'unsafe-inline'"}
    for name, sources in csp.items():
        assert sources <= allowed | inline | {_sha256(b) for b in re.findall(r"<style>(.*?)</style>", resp.text, re.S)}, \
            (name, sources)  # no other origin, no scheme that reaches one
    if page == "/redoc":  # styled-components writes <style> elements; the page takes no token
        assert csp["style-src"] == {"'self'", "'unsafe-inline'"} and csp["worker-src"] == {"blob:"}
    else:
        assert "'unsafe-inline'" not in csp["style-src"]
    assert (resp.headers["x-frame-options"], resp.headers["x-content-type-options"],
            resp.headers["referrer-policy"]) == ("DENY", "nosniff", "no-referrer")


def test_the_console_and_the_docs_share_their_page_headers(client):
    ui, docs = client.get("/ui/"), client.get("/docs")
    for name in ("x-frame-options", "x-content-type-options", "referrer-policy", "cache-control"):
        assert ui.headers[name] == docs.headers[name], name
    assert _policy(ui)["frame-ancestors"] == _policy(docs)["frame-ancestors"] == {"'none'"}


@pytest.mark.parametrize("url", ["/openapi.json", "/asyncapi.json", "/docs/assets/swagger-ui.css", "/no/such/route"])
def test_every_answer_says_nosniff(client, url):
    resp = client.get(url)
    assert resp.headers.get_list("x-content-type-options") == ["nosniff"], url
