"""GET /metrics: Prometheus text."""

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mlxserve.server.routes.common import runtime_of


async def metrics(request: Request) -> Response:
    return Response(runtime_of(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


routes = [Route("/metrics", metrics, methods=["GET"])]
