"""API errors: one exception type per answer the client can act on.

Every error leaves the server as `{"error": {"message", "type", "param", "code"}}`
with the status that says what to do next (fix the request, wait and retry,
report a bug); on the Anthropic Messages routes (`ANTHROPIC_PREFIX`) in that API's
shape, `{"type": "error", "error": {"type", "message"}}`, whatever raised it (a
route, a middleware, Starlette's routing, a bug). Errors are mapped by type, never
by matching messages, and an unexpected exception becomes a 500 whose body names
no internals.
"""

import json
import logging
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

log = logging.getLogger(__name__)


class APIError(Exception):
    status = 500
    type = "internal_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


class InvalidRequest(APIError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_value"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class Unauthorized(APIError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class NotFound(APIError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class MethodNotAllowed(APIError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class Forbidden(APIError):
    """A browser request from a page the server does not serve (its Origin)."""

    status = 403
    type = "permission_error"
    code = "origin_not_allowed"


class RequestTimeout(APIError):
    """The request did not arrive in time (`mlxserve.server.connections`)."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class BodyTooLarge(APIError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class UnsupportedMediaType(APIError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class MisdirectedRequest(APIError):
    """A Host this server does not answer to (DNS rebinding: `mlxserve.server.browser_guard`)."""

    status = 421
    type = "invalid_request_error"
    code = "host_not_allowed"


class _RetryLater(APIError):
    """An error that clears by itself: the answer says when to come back."""

    def __init__(self, message: str, retry_after_s: int, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.headers.setdefault("Retry-After", str(retry_after_s))


class QueueFull(_RetryLater):
    status = 429
    type = "rate_limit_error"
    code = "queue_full"


class ServiceUnavailable(_RetryLater):
    status = 503
    type = "service_unavailable"
    code = "no_healthy_backend"


class TooManyConnections(_RetryLater):
    status = 503
    type = "service_unavailable"
    code = "too_many_connections"


class BadGateway(APIError):
    status = 502
    type = "backend_error"
    code = "backend_rejected"


class InternalError(APIError):
    status = 500
    type = "internal_error"
    code = "internal_error"


class RequestFailed(APIError):
    """This request failed on a backend that serves the others (its grammar, a step
    that raised for it): a 500 naming the cause, not a 503, since sending the same
    request again, here or anywhere, fails the same way."""

    status = 500
    type = "internal_error"
    code = "request_failed"


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


#: Routes of the Anthropic Messages API, whose clients read its error shape.
ANTHROPIC_PREFIX = "/v1/messages"

#: Anthropic's error type by status.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    421: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error(error: APIError) -> dict[str, Any]:
    """`error` in the Anthropic Messages API's shape."""
    kind = _ANTHROPIC_TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_response(error: APIError, path: str = "") -> JSONResponse:
    """`error` as the client of the route at `path` reads it."""
    body = anthropic_error(error) if path.startswith(ANTHROPIC_PREFIX) else error.body()
    return JSONResponse(body, status_code=error.status, headers=error.headers)


def _field_path(error: Any, data: Any) -> list[str]:
    """The error's location as the client wrote it, found by walking its `data`: a part
    that is not a key (or index) there is a union member pydantic names (``str``,
    ``list[ContentPart]``, ``literal['none','auto']``, ``NamedToolChoice``, or the
    ``type`` a discriminated union picked) and is left out, unless it is a missing
    field's name."""
    loc = error["loc"]
    parts: list[str] = []
    node: Any = data
    tagged: Any = None  # the object whose ``type`` was met as a union's member
    for i, part in enumerate(loc):
        if isinstance(node, dict) and part == node.get("type") and tagged is not node:
            following = loc[i + 1] if i + 1 < len(loc) else None
            if _is_tag(node, part, following, error["type"]):
                tagged = node
                continue  # the member a union picked by ``type`` (a block's "text", say)
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[int(part)]
        elif not (i == len(loc) - 1 and error["type"] == "missing"):
            continue  # a union member: not in what the client sent
        parts.append(str(part))
    return parts


def _is_tag(node: dict[str, Any], part: str, following: int | str | None, kind: str) -> bool:
    """Whether `part`, the value of `node`'s ``type``, is the union member pydantic names
    rather than a key of `node` of that same name (a tool's "function", a text block's
    "text"): what comes next in the location tells, or at its end the error's kind (an
    object's own check ends at the object, a field's error at the field)."""
    if part not in node:
        return True
    if following is not None:
        return isinstance(following, str) and following in node
    return kind == "unsupported_field" and not isinstance(node[part], dict | list)


def _named_field(error: Any) -> list[str]:
    """The key an object's own check refused (``unsupported_field``: an unknown key
    with a value, `mlxserve.server.protocol.Echoing`), which pydantic's location,
    the object's, does not hold."""
    if error["type"] == "unsupported_field":
        return [str(error.get("ctx", {}).get("field", ""))]
    return []


def from_validation_error(exc: ValidationError, data: Any = None) -> InvalidRequest:
    """The deepest problem of a pydantic error (inside a union, the member that got
    furthest), with its field path in the client's `data` as `param`."""
    errors = exc.errors(include_url=False)
    paths = [(_field_path(e, data) + _named_field(e), e) for e in errors]
    path, first = max(paths, key=lambda pe: len(pe[0]))
    param = ".".join(path) or None
    message = first["msg"]
    code = "invalid_value"
    if first["type"] in ("extra_forbidden", "unsupported_field"):
        message, code = "this field is not supported by mlxserve", "unsupported_field"
    if param:
        message = f"{param}: {message}"
    more = len(exc.errors()) - 1
    if more:
        message += f" (and {more} more problem{'s' if more > 1 else ''})"
    return InvalidRequest(message, param=param, code=code)


def invalid_json(exc: json.JSONDecodeError | UnicodeDecodeError) -> InvalidRequest:
    return InvalidRequest(f"the body is not valid JSON: {exc}", code="invalid_json")


# -- starlette exception handlers -------------------------------------------------


async def handle_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(exc, request.url.path)


async def handle_http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 / 405 (unknown path or method) in the API's shape."""
    assert isinstance(exc, HTTPException)
    error: APIError
    if exc.status_code == 404:
        error = NotFound(f"no route for {request.method} {request.url.path}")
    elif exc.status_code == 405:
        error = MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}")
    else:
        error = APIError(str(exc.detail))
        error.status = exc.status_code
        error.type = "invalid_request_error" if exc.status_code < 500 else "internal_error"
    error.headers.update(exc.headers or {})
    return error_response(error, request.url.path)


async def handle_client_disconnect(request: Request, exc: Exception) -> Response:
    """The client went (or its connection was closed, a body too slow) while its body was
    read: nobody to answer, nothing to log as a bug."""
    return Response(status_code=499)  # nginx's "client closed request"; never sent


async def handle_unexpected(request: Request, exc: Exception) -> Response:
    """A bug: log the traceback, answer 500 without it."""
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(InternalError("internal server error"), request.url.path)
