"""The console's HTTP side: the page and its files at ``/ui`` (open: they hold no data), and the
live state at ``/ui/api/state`` (behind the API key like the API). A server's state is an engine
snapshot taken between steps, shared by all viewers for ``SNAPSHOT_TTL`` seconds, plus its recent
TTFT and ITL; a gateway's is its fleet (health, breaker, load and KV usage of every replica).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from pagellm.server.errors import error_body

STATIC_FILES = {"index.html": "text/html", "console.js": "text/javascript",
                "charts.js": "text/javascript", "console.css": "text/css"}  # fmt: skip
SNAPSHOT_TTL = 0.25
"""Seconds a snapshot serves every viewer: many open consoles cost the engine one snapshot."""
STATE_TIMEOUT = 5.0
"""Seconds a snapshot may take (it waits for the engine thread between two steps); past them,
503: a stopped or stuck engine must not hold the state's lock, and every viewer, for ever."""
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
        "connect-src 'self'; img-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
        "form-action 'self'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
"""On every console response: the page runs only its own files and cannot be framed (a framed
playground would spend the viewer's key)."""
OPEN_PREFIXES = ("/ui/static/",)
OPEN_PATHS = ("/ui", "/ui/")


class RecentLatencies:
    """The last minutes of TTFT and ITL observations, for the console's charts."""

    def __init__(self, horizon_s: float = 300.0, most: int = 4000) -> None:
        self.horizon = horizon_s
        self.ttft: deque[tuple[float, float]] = deque(maxlen=most)
        self.itl: deque[tuple[float, float]] = deque(maxlen=most)

    def series(self, now: float) -> dict[str, list[tuple[float, float]]]:
        since = now - self.horizon
        return {
            "ttft": [(t, v) for t, v in list(self.ttft) if t >= since],
            "itl": [(t, v) for t, v in list(self.itl) if t >= since][-1000:],
        }


def _static_dir():
    return resources.files("pagellm.console") / "static"


def install_console(
    app: FastAPI,
    state: Callable[[], Awaitable[dict[str, Any]]],
    guard: Callable[[Request], Awaitable[Response | None]] | None = None,
) -> None:
    """Serve the page and ``state()`` as the live state (cached for ``SNAPSHOT_TTL``);
    ``guard`` answers a request it refuses (the gateway's key check; the server's middleware
    checks the key before any route)."""
    cache: dict[str, Any] = {"at": -1.0, "body": None}
    lock = asyncio.Lock()

    @app.get("/ui", include_in_schema=False)
    @app.get("/ui/", include_in_schema=False)
    async def page() -> Response:
        return FileResponse(
            str(_static_dir() / "index.html"), media_type="text/html", headers=SECURITY_HEADERS
        )

    @app.get("/ui/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        if name not in STATIC_FILES:
            return JSONResponse({"error": {"message": "not found", "type": "not_found"}}, 404)
        return FileResponse(
            str(_static_dir() / name), media_type=STATIC_FILES[name], headers=SECURITY_HEADERS
        )

    @app.get("/ui/api/state", include_in_schema=False)
    async def live(raw: Request) -> Response:
        refused = await guard(raw) if guard is not None else None
        if refused is not None:
            return refused
        async with lock:
            now = time.monotonic()
            if cache["body"] is None or now - cache["at"] > SNAPSHOT_TTL:
                try:
                    snapshot = await asyncio.wait_for(state(), STATE_TIMEOUT)
                except TimeoutError:
                    message = f"no state within {STATE_TIMEOUT:g} s (the engine is stopped or busy)"
                    return JSONResponse(error_body(503, message, None, None), status_code=503)
                # serialized once for every viewer of this snapshot, not on each request
                cache["body"], cache["at"] = JSONResponse(snapshot).body, now
            headers = {**SECURITY_HEADERS, "Cache-Control": "no-store"}
            return Response(cache["body"], media_type="application/json", headers=headers)


def is_open_path(path: str) -> bool:
    """Console paths that need no key (the page and its files; never the state)."""
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)
