"""The gateway's API documentation pages (``/docs``: Swagger UI, ``/redoc``: ReDoc) with every script,
style sheet and icon served by the gateway itself, under ``/docs/assets``, so that they work on a
machine with no internet (FastAPI's own pages load them from a CDN). The files come from the
``fastapi-offline`` package, which ships them. ``/asyncapi.json``: the AsyncAPI 3.0 document of the
NATS side (``contracts/asyncapi.py``). Like FastAPI's own documentation routes these are plain routes,
public (``auth.DOCS``): they describe the interfaces, never data.

Each page answers with a Content-Security-Policy as strict as it allows (headers.py): scripts from the
gateway only, plus, on ``/docs``, Swagger UI's inline start-up script by its hash; nothing from another
origin (ReDoc's footer logo, on a CDN, stays blocked); connections to this gateway only. ReDoc alone
needs ``style-src 'unsafe-inline'`` (its styled-components write ``<style>`` elements as the bundle
loads, before a nonce could reach them) and ``worker-src blob:`` (its search index runs in a worker
made from its own code); its page has no field that takes a token."""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.staticfiles import StaticFiles
from starlette.responses import HTMLResponse, JSONResponse

from noetl_mesh.services.gateway import headers

ASSETS = "/docs/assets"
CONNECT = {"connect_src": "'self'", "img_src": "'self' data:"}  # the OpenAPI document, "try it out"; icons


def assets_dir() -> Path:
    import fastapi_offline

    return Path(fastapi_offline.__file__).parent / "static"


def _with_policy(page: HTMLResponse, **directives: str) -> HTMLResponse:
    """``page`` with :func:`headers.page`'s headers; its inline scripts and styles allowed by their hashes
    (where ``directives`` do not say otherwise)."""
    html = page.body.decode()
    scripts, styles = headers.inline_hashes(html, "script"), headers.inline_hashes(html, "style")
    directives.setdefault("script_src", " ".join(["'self'", *scripts]))
    directives.setdefault("style_src", " ".join(["'self'", *styles]))
    page.headers.update(headers.page(headers.policy(**directives)))
    return page


def mount(app: FastAPI) -> None:
    """``/docs``, ``/docs/oauth2-redirect``, ``/redoc`` and the files they load, on an app created with
    ``docs_url=None, redoc_url=None``."""
    app.mount(ASSETS, StaticFiles(directory=assets_dir()), name="docs-assets")
    oauth2_redirect = app.swagger_ui_oauth2_redirect_url or "/docs/oauth2-redirect"

    async def swagger(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return _with_policy(get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - Swagger UI",
            oauth2_redirect_url=f"{root}{oauth2_redirect}",
            swagger_js_url=f"{root}{ASSETS}/swagger-ui-bundle.js", swagger_css_url=f"{root}{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS}/favicon.png",
            # no badge from the public validator (it would send the description's URL out)
            swagger_ui_parameters={**(app.swagger_ui_parameters or {}), "validatorUrl": None}), **CONNECT)

    async def swagger_redirect(request: Request) -> HTMLResponse:
        return _with_policy(get_swagger_ui_oauth2_redirect_html())

    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return _with_policy(get_redoc_html(openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - ReDoc",
                                           redoc_js_url=f"{root}{ASSETS}/redoc.standalone.js",
                                           redoc_favicon_url=f"{root}{ASSETS}/favicon.png", with_google_fonts=False),
                            style_src="'self' 'unsafe-inline'", worker_src="blob:", **CONNECT)

    async def asyncapi(request: Request) -> JSONResponse:
        from noetl_mesh.contracts.asyncapi import document

        return JSONResponse(document(app.version))

    app.add_route("/docs", swagger, include_in_schema=False)
    app.add_route("/asyncapi.json", asyncapi, include_in_schema=False)
    app.add_route(oauth2_redirect, swagger_redirect, include_in_schema=False)
    app.add_route("/redoc", redoc, include_in_schema=False)
