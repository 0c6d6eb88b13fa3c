"""The starlette application: routes, middleware, error handlers. No globals.

`create_app(runtime)` only reads the runtime; starting, draining and stopping
it is the serve command's job, so tests can wrap any runtime (real engines or
fakes) in the same app.
"""

from __future__ import annotations

import os

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect
from starlette.routing import BaseRoute, Route

from mlxserve.server.accounting import RequestCounter
from mlxserve.server.auth import BearerAuth
from mlxserve.server.browser_guard import BrowserGuard
from mlxserve.server.errors import (
    APIError,
    handle_api_error,
    handle_client_disconnect,
    handle_http_exception,
    handle_unexpected,
)
from mlxserve.server.limits import BodySizeLimit
from mlxserve.server.routes import (
    chat,
    completions,
    health,
    messages,
    metrics,
    models,
    policy,
    responses,
    status,
    tokenize,
)
from mlxserve.server.runtime import Runtime

API_KEY_ENV = "MLXSERVE_API_KEY"


def api_keys(configured: list[str]) -> list[str]:
    """The configured keys plus MLXSERVE_API_KEY (one key, for containers and CI)."""
    extra = os.environ.get(API_KEY_ENV, "").strip()
    return [*configured, extra] if extra else list(configured)


def create_app(runtime: Runtime) -> Starlette:
    routes: list[BaseRoute] = [
        *chat.routes,
        *completions.routes,
        *messages.routes,
        *responses.routes,
        *models.routes,
        *health.routes,
        *metrics.routes,
        *policy.routes,
        *status.routes,
        *tokenize.routes,
    ]
    endpoints = [route.path for route in routes if isinstance(route, Route)]
    server = runtime.settings.server
    keys = api_keys(server.api_keys)
    # Without a key, what a web page could send is refused (mlxserve.server.browser_guard).
    guard = [
        Middleware(
            BrowserGuard,
            bind_host=server.host,
            allowed_hosts=server.allowed_hosts,
            allowed_origins=server.allowed_origins,
        )
    ]
    app = Starlette(
        routes=routes,
        middleware=[
            Middleware(RequestCounter, metrics=runtime.metrics, endpoints=endpoints),
            *(guard if not keys else []),
            Middleware(BodySizeLimit, max_bytes=server.max_body_bytes),
            Middleware(BearerAuth, keys=keys),
        ],
        exception_handlers={
            APIError: handle_api_error,
            HTTPException: handle_http_exception,
            ClientDisconnect: handle_client_disconnect,
            Exception: handle_unexpected,
        },
    )
    app.state.runtime = runtime
    return app
