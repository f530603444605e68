"""Streamlit's hashed assets from memory (app/components/static_assets.py): for every file under Streamlit's
static/ folder the middleware answers what Streamlit's own static route answers (status, body, content
type, cache policy), below a base path and a page's path too; anything else — index.html, a page, a HEAD,
a Range request, an unknown or unsafe path — reaches Streamlit untouched."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import streamlit
from streamlit.web.server.starlette.starlette_static_routes import create_streamlit_static_handler

from tests.support.app import app_importable

STATIC = Path(streamlit.__file__).parent / "static"


@pytest.fixture
def middleware(monkeypatch):
    app_importable(monkeypatch)
    from components.static_assets import AssetsFromMemory

    passed: list[str] = []

    async def streamlit_app(scope, receive, send):
        passed.append(scope["path"])
        await send({"type": "http.response.start", "status": 299, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    assets = AssetsFromMemory(streamlit_app, folder=STATIC)
    assets.passed = passed
    return assets


def call(app, path: str, method: str = "GET", headers=(), root_path: str = "") -> tuple[int, dict, bytes]:
    """One request through an ASGI app → (status, headers by lower-case name, body)."""
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "root_path": root_path,
        "query_string": b"",
        "headers": [(b"host", b"localhost"), *headers],
        "scheme": "http",
        "server": ("localhost", 80),
    }
    sent: list[dict] = []

    async def run() -> None:
        done = asyncio.Event()
        requested = False

        async def receive():  # the request once, then a disconnect once the response is sent
            nonlocal requested
            if not requested:
                requested = True
                return {"type": "http.request", "body": b"", "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                done.set()

        await app(scope, receive, send)

    asyncio.run(run())
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode().lower(): v.decode() for k, v in start["headers"]}, body


def test_every_asset_is_what_streamlits_own_route_serves(middleware):
    streamlit_route = create_streamlit_static_handler(str(STATIC), None)
    assets = sorted(middleware.known)
    assert len(assets) > 100 and any(a.startswith("/static/js/index.") for a in assets)
    for asset in assets:
        status, headers, body = call(middleware, asset)
        want_status, want, want_body = call(streamlit_route, asset)
        assert (status, body) == (want_status, want_body), asset
        for name in ("content-type", "cache-control", "content-length"):
            assert headers[name] == want[name], (asset, name)
    assert middleware.passed == []


def test_below_a_base_path_and_a_page(middleware):
    asset = next(a for a in sorted(middleware.known) if a.startswith("/static/js/index."))
    expected = (STATIC / asset[1:]).read_bytes()
    for path in (f"/moeviz{asset}", f"/routing{asset}", f"/base/routing{asset}"):
        status, _, body = call(middleware, path)
        assert (status, body) == (200, expected), path
    assert middleware.passed == []


@pytest.mark.parametrize(
    "path, method, headers",
    [
        ("/", "GET", ()),
        ("/index.html", "GET", ()),
        ("/routing", "GET", ()),
        ("/static/js/no-such-file.js", "GET", ()),
        ("/static/js/../../index.html", "GET", ()),
        ("//static/js/ASSET", "GET", ()),
        ("/static/js/ASSET", "HEAD", ()),
        ("/static/js/ASSET", "POST", ()),
        ("/static/js/ASSET", "GET", ((b"range", b"bytes=0-99"),)),
        ("/_stcore/health", "GET", ()),
    ],
)
def test_anything_else_reaches_streamlit(middleware, path, method, headers):
    asset = next(a for a in sorted(middleware.known) if a.startswith("/static/js/index."))
    path = path.replace("/static/js/ASSET", asset)
    status, _, _ = call(middleware, path, method, headers)
    assert status == 299 and middleware.passed == [path]
