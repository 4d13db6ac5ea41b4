"""gateway/server/openapi.py: ``/schema`` is Redoc's page from the gateway's own copy of
Redoc (gateway/server/openapi_assets/), and nothing on it comes from another host."""

from __future__ import annotations

import hashlib
import re

from litestar import Litestar, get
from litestar.testing import TestClient

from gateway.server.openapi import ASSETS, openapi_config

LOCAL = re.compile(r"""(?:src|href)=["']([^"']*)["']""")


@get("/ping", summary="A route to document", sync_to_thread=False)
def ping() -> str:
    return "pong"


def test_the_vendored_bundle_is_the_one_its_notes_name_with_its_licences() -> None:
    notes = (ASSETS / "VENDORED.md").read_text()
    bundle = (ASSETS / "redoc.standalone.js").read_bytes()
    assert f"sha256 `{hashlib.sha256(bundle).hexdigest()}`" in notes
    assert 'Version: "2.5.4"' in (ASSETS / "redoc.standalone.js.LICENSE.txt").read_text()
    assert "MIT" in (ASSETS / "LICENSE").read_text()
    assert "npm pack redoc@2.5.4" in notes


def test_the_schema_page_loads_redoc_from_the_gateway_and_nothing_from_elsewhere() -> None:
    app = Litestar([ping], openapi_config=openapi_config())
    with TestClient(app) as client:
        page = client.get("/schema")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "A route to document" in page.text  # the schema, inline
        urls = LOCAL.findall(page.text)
        assert urls == ["/schema/assets/redoc.standalone.js"], urls
        assert "googleapis" not in page.text and "cdn." not in page.text
        assert "default-src 'none'" in page.headers["content-security-policy"]
        script = client.get(urls[0])
        assert script.status_code == 200
        assert "javascript" in script.headers["content-type"]
        assert script.content == (ASSETS / "redoc.standalone.js").read_bytes()
        assert client.get("/schema/openapi.json").json()["info"]["title"] == "tokenspout"
