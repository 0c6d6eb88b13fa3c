"""Server-sent events for streaming completions.

Starlette's StreamingResponse races the body against a listener for the
client's disconnect and cancels the body when the client goes: the
cancellation unwinds through the router into the backend, which tells the
engine to cancel the request (within one engine step). An error after the
stream has started can no longer change the status code, so it is sent as an
OpenAI-style `error` event before `[DONE]`.
"""

import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from starlette.responses import StreamingResponse

from mlxserve.server.errors import APIError, InternalError

log = logging.getLogger(__name__)

HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


#: One encoder for every event: `json.dumps` with options builds a new one per call,
#: and a streamed answer encodes an event per token.
_encode = json.JSONEncoder(separators=(",", ":")).encode


def event(data: dict[str, Any]) -> str:
    return f"data: {_encode(data)}\n\n"


async def _body(chunks: AsyncGenerator[dict[str, Any], None]) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield event(chunk)
    except APIError as exc:
        yield event(exc.body())
    except Exception:
        log.exception("a stream failed")
        yield event(InternalError("internal server error").body())
    finally:
        await chunks.aclose()
    yield "data: [DONE]\n\n"


async def _typed_body(
    chunks: AsyncGenerator[dict[str, Any], None], error: Callable[[APIError], dict[str, Any]]
) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield f"event: {chunk['type']}\n{event(chunk)}"
    except APIError as exc:
        yield f"event: error\n{event(error(exc))}"
    except Exception:
        log.exception("a stream failed")
        yield f"event: error\n{event(error(InternalError('internal server error')))}"
    finally:
        await chunks.aclose()


def typed_sse_response(
    chunks: AsyncGenerator[dict[str, Any], None],
    error: Callable[[APIError], dict[str, Any]],
    headers: dict[str, str] | None = None,
) -> StreamingResponse:
    """Events named by their ``type`` (Anthropic Messages, OpenAI Responses), no [DONE];
    an error after the start is an ``error`` event in the API's own shape."""
    return StreamingResponse(
        _typed_body(chunks, error),
        media_type="text/event-stream",
        headers={**HEADERS, **(headers or {})},
    )


def sse_response(
    chunks: AsyncGenerator[dict[str, Any], None], headers: dict[str, str] | None = None
) -> StreamingResponse:
    return StreamingResponse(
        _body(chunks), media_type="text/event-stream", headers={**HEADERS, **(headers or {})}
    )
