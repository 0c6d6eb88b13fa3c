"""GET /v1/models and /v1/models/{id}: the one model this server serves."""

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlxserve.server.protocol import ModelCard, ModelList
from mlxserve.server.routes.common import dump, runtime_of


def _card(request: Request) -> ModelCard:
    runtime = runtime_of(request)
    return ModelCard(
        id=runtime.model_name, created=runtime.created, context_length=runtime.context_length()
    )


async def list_models(request: Request) -> Response:
    return JSONResponse(dump(ModelList(data=[_card(request)])))


async def get_model(request: Request) -> Response:
    runtime_of(request).generations.check_model(request.path_params["model"])
    return JSONResponse(dump(_card(request)))


routes = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model:path}", get_model, methods=["GET"]),
]
