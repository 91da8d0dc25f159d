"""The status page at ``GET /``: one self-contained HTML file (``static/status.html``: inline CSS, inline script,
charts drawn on a canvas; no CDN, the box may be offline).

The page holds no data of its own: its script polls ``/v1/stats`` (`telemetry.Telemetry.snapshot`, the snapshot
that `/metrics` and `ft top` read) twice a second and draws the model, backend, budget plan, tok/s and the
expert cache's hit/fill/cpu split, the request queue and, when the engine reports one, the prefix cache; its chat
box streams from ``/v1/chat/completions``. The route is open without the API key (the page is static); with a key
set the page asks for it once and sends it as a bearer token.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from starlette.requests import Request
from starlette.responses import HTMLResponse


@cache
def page_html() -> str:
    """The page's HTML (read once from the package)."""
    return resources.files("freetoken.server").joinpath("static/status.html").read_text(encoding="utf-8")


async def status_page(request: Request) -> HTMLResponse:
    """``GET /``: the status page."""
    return HTMLResponse(page_html(), headers={"Cache-Control": "no-cache"})
