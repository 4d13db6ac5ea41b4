"""``/schema``: the OpenAPI schema, and Redoc's page of it, working offline.

Litestar's Redoc page loads Redoc from a CDN and its fonts from Google by default, so with
no network the page the README points to was blank. Here Redoc comes from the gateway
itself (openapi_assets/, vendored: VENDORED.md there), the page renders in the system's
fonts, and its Content-Security-Policy keeps the browser on the gateway's origin: Redoc
2.x shows a Redocly logo from its CDN, which is then not fetched (the logo hides itself).
"""

from __future__ import annotations

from pathlib import Path

from litestar.datastructures import ResponseHeader
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import RedocRenderPlugin
from litestar.router import Router
from litestar.static_files import create_static_files_router

from gateway import __version__

SCHEMA_PATH = "/schema"
ASSETS = Path(__file__).parent / "openapi_assets"
POLICY = (
    "default-src 'none'; script-src 'self' 'unsafe-inline'; "
    "style-src 'self' 'unsafe-inline'; img-src 'self' data:; font-src 'self' data:; "
    "connect-src 'self'; worker-src 'self' blob:"
)
"""Redoc inlines the schema in a script and injects its styles; its search runs in a
worker made from a blob, and its schema validator compiles code at run time."""


def openapi_config() -> OpenAPIConfig:
    redoc = RedocRenderPlugin(
        js_url=f"{SCHEMA_PATH}/assets/redoc.standalone.js",
        google_fonts=False,
        favicon="",
        path="/redoc",
    )
    router = Router(
        SCHEMA_PATH,
        route_handlers=[
            create_static_files_router(path="/assets", directories=[ASSETS], name="schema-assets")
        ],
        include_in_schema=False,
        response_headers=[ResponseHeader(name="Content-Security-Policy", value=POLICY)],
    )
    return OpenAPIConfig(
        title="tokenspout", version=__version__, render_plugins=[redoc], openapi_router=router
    )
