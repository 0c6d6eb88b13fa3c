"""GET /status: the dashboard (HTML; `?format=json` for its data); GET /v1/status: the data.

Guarded like `/v1/*` when API keys are set: it shows the policy plan, which
`/v1/policy` guards too. `?since=T` (a sample's `t`) returns only the newer samples
of the history, which is how the page polls without fetching it all each time.
"""

import math

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from mlxserve.server.errors import InvalidRequest
from mlxserve.server.routes.common import runtime_of
from mlxserve.server.status import snapshot
from mlxserve.server.status_html import render

FORMATS = ("html", "json")
KNOWN = ("format", "since")
#: The page's own script and style only; it may call this server and nothing else.
PAGE_POLICY = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
    "style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:; "
    "form-action 'none'; base-uri 'none'; frame-ancestors 'none'"
}


def _since(request: Request) -> float | None:
    unknown = sorted(set(request.query_params) - set(KNOWN))
    if unknown:
        raise InvalidRequest(f"unknown query parameter '{unknown[0]}'", param=unknown[0])
    text = request.query_params.get("since")
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise InvalidRequest("since must be a number (a sample's t)", param="since")
    return value


async def status(request: Request) -> Response:
    wanted = request.query_params.get("format", "html")
    if wanted not in FORMATS:
        raise InvalidRequest(f"format must be one of {', '.join(FORMATS)}", param="format")
    since = _since(request)
    data = snapshot(runtime_of(request), since)
    if wanted == "json":
        return JSONResponse(data, headers={"Cache-Control": "no-store"})
    return HTMLResponse(render(data), headers={"Cache-Control": "no-store", **PAGE_POLICY})


async def status_json(request: Request) -> Response:
    if "format" in request.query_params:
        raise InvalidRequest("/v1/status answers JSON only; drop 'format'", param="format")
    data = snapshot(runtime_of(request), _since(request))
    return JSONResponse(data, headers={"Cache-Control": "no-store"})


routes = [
    Route("/status", status, methods=["GET"]),
    Route("/v1/status", status_json, methods=["GET"]),
]
