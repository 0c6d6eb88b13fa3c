"""GET /v1/policy: the kernel-policy plan the active engine runs under.

The same document as `mlxserve policy explain --json`, taken from the engine's
hello rather than recomputed, so it is the plan that is actually in force.
"""

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlxserve.server.errors import ServiceUnavailable
from mlxserve.server.routes.common import runtime_of


async def policy(request: Request) -> Response:
    runtime = runtime_of(request)
    plan = runtime.plan()
    if plan is None:
        raise ServiceUnavailable(
            "no engine has reported its plan yet", runtime.settings.server.retry_after_s
        )
    return JSONResponse(plan)


routes = [Route("/v1/policy", policy, methods=["GET"])]
