"""Streamlit's hashed scripts, styles and fonts served from memory (`AssetsFromMemory`, an ASGI middleware
app/serve.py puts in front of Streamlit): what a browser without them in its cache fetches for every page it
opens (~80 files, 4 MB). Streamlit's static route takes each through its middleware stack, its security
checks and a worker thread: ~0.6 s of the server's CPU per first visit on these 2 cores, against ~0.35 s
from memory, while the browser competes for the same cores (measured side by side, the first page's views
drawn ~0.3 s sooner). No Streamlit here: the folder is given.

Only GETs of files under the folder's `static/` (their names carry a content hash: cached for a year, as
Streamlit serves them) without a Range header; everything else, index.html included, goes to Streamlit."""

from __future__ import annotations

import mimetypes
from pathlib import Path

ASSETS = "static"  # the folder of hashed assets inside Streamlit's static folder, and its URL segment
CACHE_CONTROL = b"public, immutable, max-age=31536000"  # Streamlit's own for these files


class AssetsFromMemory:
    """An ASGI middleware answering GET …/static/<file> from memory for the files under `folder`/static
    (each read on its first request, then kept); any other request is passed to `app`."""

    def __init__(self, app, folder: Path) -> None:
        self.app = app
        self.folder = Path(folder)
        files = (path for path in (self.folder / ASSETS).rglob("*") if path.is_file())
        self.known = {f"/{path.relative_to(self.folder).as_posix()}" for path in files}
        self.responses: dict[str, tuple[list[tuple[bytes, bytes]], bytes]] = {}

    def asset(self, scope) -> str | None:
        """The asset a request asks for ("/static/js/x.js"), or None: not a plain GET of a known asset."""
        if scope["type"] != "http" or scope["method"] != "GET":
            return None
        path = scope["path"]
        if path.startswith("//") or any(name == b"range" for name, _ in scope.get("headers", ())):
            return None
        at = path.find(f"/{ASSETS}/")  # below the server's base path and a page's path ("./static/…")
        return path[at:] if at >= 0 and path[at:] in self.known else None

    def response(self, asset: str) -> tuple[list[tuple[bytes, bytes]], bytes]:
        """The headers and body of `asset`, read once."""
        if asset not in self.responses:
            body = (self.folder / asset[1:]).read_bytes()
            kind = mimetypes.guess_type(asset)[0] or "application/octet-stream"
            if kind.startswith("text/") or kind.endswith("javascript"):
                kind += "; charset=utf-8"
            headers = [
                (b"content-type", kind.encode()),
                (b"content-length", str(len(body)).encode()),
                (b"cache-control", CACHE_CONTROL),
            ]
            self.responses[asset] = (headers, body)
        return self.responses[asset]

    async def __call__(self, scope, receive, send) -> None:
        asset = self.asset(scope)
        if asset is None:
            await self.app(scope, receive, send)
            return
        headers, body = self.response(asset)
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
