"""GET /v1/models and /v1/models/{id}: the one model this server serves, by its served name
and its aliases (`server.model_name`, `server.model_aliases`); the model setting itself
(a directory's path) is accepted in requests but not listed."""

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlxserve.server.protocol import ModelCard, ModelList
from mlxserve.server.routes.common import dump, runtime_of


def _card(request: Request, name: str) -> ModelCard:
    runtime = runtime_of(request)
    return ModelCard(id=name, created=runtime.created, context_length=runtime.context_length())


def _listed(request: Request) -> list[str]:
    runtime = runtime_of(request)
    aliases = runtime.settings.server.model_aliases
    return list(dict.fromkeys([runtime.model_name, *aliases]))


async def list_models(request: Request) -> Response:
    return JSONResponse(dump(ModelList(data=[_card(request, name) for name in _listed(request)])))


async def get_model(request: Request) -> Response:
    name = request.path_params["model"]
    runtime_of(request).generations.check_model(name)
    return JSONResponse(dump(_card(request, name)))


routes = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model:path}", get_model, methods=["GET"]),
]
