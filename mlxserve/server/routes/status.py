"""GET /status: the status page (HTML; `?format=json` for the same data as JSON).

Guarded like `/v1/*` when API keys are set: it shows the policy plan, which
`/v1/policy` guards too.
"""

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from mlxserve.server.errors import InvalidRequest
from mlxserve.server.routes.common import runtime_of
from mlxserve.server.status import snapshot
from mlxserve.server.status_html import render

FORMATS = ("html", "json")


async def status(request: Request) -> Response:
    wanted = request.query_params.get("format", "html")
    if wanted not in FORMATS:
        raise InvalidRequest(f"format must be one of {', '.join(FORMATS)}", param="format")
    data = snapshot(runtime_of(request))
    if wanted == "json":
        return JSONResponse(data)
    return HTMLResponse(render(data), headers={"Cache-Control": "no-store"})


routes = [Route("/status", status, methods=["GET"])]
