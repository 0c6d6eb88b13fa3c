"""GET /health (the front is alive) and GET /ready (a backend really generates).

/health never touches a backend: it answers whether this process serves HTTP.
/ready is 200 only when the active backend answered a real one-token
generation (or delivered tokens to a client) recently; a wedged engine makes
it fail even though its process is still there.
"""

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlxserve.server.routes.common import runtime_of


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    runtime = runtime_of(request)
    is_ready, detail = runtime.readiness()
    headers = {} if is_ready else {"Retry-After": str(runtime.settings.server.retry_after_s)}
    return JSONResponse(detail, status_code=200 if is_ready else 503, headers=headers)


routes = [
    Route("/health", health, methods=["GET"]),
    Route("/ready", ready, methods=["GET"]),
]
