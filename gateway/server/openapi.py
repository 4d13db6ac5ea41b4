"""``/schema``: the OpenAPI schema, and Redoc's page of it, working offline.

Both serve the document as it is true of the gateway (gateway/server/documented.py): each
route's real error statuses in its API's own shape, its event streams as event streams.

Litestar's Redoc page loads Redoc from a CDN and its fonts from Google by default, so with
no network the page the README points to was blank. Here Redoc comes from the gateway
itself (openapi_assets/, vendored: VENDORED.md there), the page renders in the system's
fonts, and its Content-Security-Policy keeps the browser on the gateway's origin: Redoc
2.x shows a Redocly logo from its CDN, which is then not fetched (the logo hides itself).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from litestar.connection import Request
from litestar.datastructures import ResponseHeader
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin, RedocRenderPlugin
from litestar.router import Router
from litestar.static_files import create_static_files_router

from gateway import __version__
from gateway.server.documented import corrected

SCHEMA_PATH = "/schema"
ASSETS = Path(__file__).parent / "openapi_assets"
POLICY = (
    "default-src 'none'; script-src 'self' 'unsafe-inline'; "
    "style-src 'self' 'unsafe-inline'; img-src 'self' data:; font-src 'self' data:; "
    "connect-src 'self'; worker-src 'self' blob:"
)
"""Redoc inlines the schema in a script and injects its styles; its search runs in a
worker made from a blob, and its schema validator compiles code at run time."""


class _Corrected:
    """A render plugin whose document is ``corrected`` (made once: the routes are fixed)."""

    _rendered: bytes | None = None

    def render_json(self, request: Request[Any, Any, Any], openapi_schema: dict[str, Any]) -> bytes:
        if self._rendered is None:
            self._rendered = JsonRenderPlugin.render_json(request, corrected(openapi_schema))
        return self._rendered


class CorrectedJson(_Corrected, JsonRenderPlugin):
    """``/schema/openapi.json``."""


class CorrectedRedoc(_Corrected, RedocRenderPlugin):
    """``/schema``: Redoc's page, the document inline."""


def openapi_config() -> OpenAPIConfig:
    redoc = CorrectedRedoc(
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
        title="tokenspout",
        version=__version__,
        render_plugins=[redoc, CorrectedJson()],
        openapi_router=router,
    )
