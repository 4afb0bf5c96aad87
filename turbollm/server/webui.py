"""The chat page and the dashboard: static files shipped in `turbollm/server/static/`, served from memory.

`/` and `/dashboard` serve `index.html` (the page shows the view its path names); its scripts and
styles are under `/static/`. Nothing is fetched from elsewhere: no CDN, no fonts, no build step. The
page talks to the server through `/props` (settings' defaults, the context length, whether an API
key is needed), `/v1/chat/completions` (streamed) and `/stats` (the dashboard).

The files are read once at start; `WebUI.total_bytes` is what a first visit downloads.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import Response

STATIC = Path(__file__).with_name("static")
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
# the page may load its own files only; inline scripts and styles are not used
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


@dataclass(frozen=True)
class StaticFile:
    body: bytes
    media_type: str
    etag: str


class WebUI:
    def __init__(self, folder: Path = STATIC):
        self.files: dict[str, StaticFile] = {}
        for path in sorted(folder.iterdir()):
            if path.suffix in _TYPES and path.is_file():
                body = path.read_bytes()
                self.files[path.name] = StaticFile(body, _TYPES[path.suffix],
                                                   '"' + hashlib.sha256(body).hexdigest()[:16] + '"')
        if "index.html" not in self.files:
            raise FileNotFoundError(f"the chat page is missing: no index.html in {folder}")

    @property
    def total_bytes(self) -> int:
        """Bytes of the page and every file it loads (one visit, uncompressed)."""
        return sum(len(f.body) for f in self.files.values())

    def response(self, name: str, request: Request) -> Response:
        f = self.files.get(name)
        if f is None:
            return Response(status_code=404)
        headers = {"ETag": f.etag, "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
        if name.endswith(".html"):
            headers["Content-Security-Policy"] = CSP
        if request.headers.get("if-none-match") == f.etag:
            return Response(status_code=304, headers=headers)
        return Response(f.body, media_type=f.media_type, headers=headers)

    def mount(self, app: FastAPI) -> None:
        @app.get("/", include_in_schema=False)
        async def index(request: Request):
            return self.response("index.html", request)

        @app.get("/dashboard", include_in_schema=False)
        async def dashboard(request: Request):
            return self.response("index.html", request)

        @app.get("/static/{name}", include_in_schema=False)
        async def static(name: str, request: Request):
            return self.response(name, request)
