"""Helpers every route uses: the runtime, body parsing, collecting a generation."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from mlxserve.channel.request import SamplingParams
from mlxserve.server import json_limits
from mlxserve.server.errors import InvalidRequest, from_validation_error, invalid_json
from mlxserve.server.generation import Delta
from mlxserve.server.protocol import SEED_RANGE, GenerationBody, Usage
from mlxserve.server.runtime import Runtime

Model = TypeVar("Model", bound=BaseModel)
P = ParamSpec("P")
Result = TypeVar("Result")
BACKEND_HEADER = "X-Mlxserve-Backend"
CLIENT_CLOSED = 499  # nginx's "client closed request": logged, never seen by the client


def runtime_of(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


async def parse_body(request: Request, model: type[Model]) -> Model:
    """The JSON body as `model`; every way it can be wrong is a 400 naming the field."""
    raw = await request.body()
    server = runtime_of(request).settings.server
    try:
        data = json_limits.loads(
            raw, max_depth=server.max_json_depth, max_number_chars=server.max_number_chars
        )
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid_json(exc) from None
    if not isinstance(data, dict):
        raise InvalidRequest("the body must be a JSON object", code="invalid_json")
    if _SURROGATE_ESCAPE.search(raw):  # only an escape can spell one: a quick look first
        _refuse_lone_surrogates(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc, data) from None


#: A JSON escape of a UTF-16 surrogate (or of text that looks like one: checked then).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _refuse_lone_surrogates(data: dict[str, Any]) -> None:
    """JSON may spell a lone UTF-16 surrogate (``"\\ud83d"``), which no text is made of:
    the tokenizer cannot encode it. A 400 naming the first field that holds one."""
    path = _surrogate_path(data)
    if path is not None:
        raise InvalidRequest(
            f"{path}: the text holds a lone UTF-16 surrogate, which is not valid Unicode",
            param=path,
            code="invalid_value",
        )


def _surrogate_path(value: Any, path: str = "") -> str | None:
    """The dotted path of the first string (or key) in `value` that UTF-8 cannot encode."""
    items: list[tuple[str, Any]] = []
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        items = [(str(key), item) for key, item in value.items()]
        for key, _ in items:
            if _surrogate_path(key) is not None:
                return f"{path}.{key!a}".lstrip(".")
    elif isinstance(value, list):
        items = [(str(i), item) for i, item in enumerate(value)]
    for key, item in items:
        found = _surrogate_path(item, f"{path}.{key}".lstrip("."))
        if found is not None:
            return found
    return None


Item = TypeVar("Item")


class ClientGone(Exception):
    """The client of a non-streamed request disconnected before its answer was ready."""


async def collect_each(
    items: AsyncGenerator[Item, None], request: Request, each: Callable[[Item], object]
) -> None:
    """`each` item of a generation as it comes; `ClientGone` if the client goes first."""

    async def gather() -> tuple[str, Delta]:
        try:
            async for item in items:
                each(item)
        finally:
            await items.aclose()
        return "", Delta("")

    await _race(gather(), request)


async def collect(
    deltas: AsyncGenerator[Delta, None],
    request: Request,
    each: Callable[[Delta], object] | None = None,
) -> tuple[str, Delta]:
    """The whole text and the last delta; cancels the generation when the client goes.

    Why race a listener: a non-streamed answer is written only at the end, so
    nothing else would notice the disconnect, and the engine would keep
    generating for nobody. Raises `ClientGone` then. `each` sees every delta as it
    comes, for answers that are more than text (reasoning, tool calls).
    """

    async def gather() -> tuple[str, Delta]:
        parts: list[str] = []
        last = Delta("")
        try:
            async for delta in deltas:
                parts.append(delta.text)
                last = delta
                if each is not None:
                    each(delta)
        finally:
            await deltas.aclose()
        return "".join(parts), last

    return await _race(gather(), request)


async def _race(
    gathering: Coroutine[None, None, tuple[str, Delta]], request: Request
) -> tuple[str, Delta]:
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.create_task(gathering)
    listener = asyncio.create_task(disconnected())
    try:
        await asyncio.wait({work, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
            raise ClientGone
    return work.result()


def backend_header(delta: Delta) -> dict[str, str]:
    """Which backend answered: for operators and for the failover tests."""
    return {BACKEND_HEADER: delta.backend} if delta.backend else {}


async def with_first(first: Item, rest: AsyncGenerator[Item, None]) -> AsyncGenerator[Item, None]:
    """`first` (already taken from `rest`, to answer errors with a real status), then `rest`."""
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


async def collect_choices(
    first: tuple[int, Delta],
    rest: AsyncGenerator[tuple[int, Delta], None],
    request: Request,
    each: Callable[[int, Delta], object],
) -> dict[int, Delta]:
    """The last delta of every choice of an ``n``-choice generation, by index.

    `first` was taken from `rest` already (see `with_first`); `each` sees every
    delta as it comes. Raises `ClientGone` when the client goes first.
    """
    lasts: dict[int, Delta] = {}

    def add(item: tuple[int, Delta]) -> None:
        index, delta = item
        each(index, delta)
        if delta.finish_reason is not None:
            lasts[index] = delta

    add(first)
    await collect_each(rest, request, add)
    return lasts


def usage_of(delta: Delta) -> Usage:
    details = {"cached_tokens": delta.cached_tokens} if delta.cached_tokens else None
    return Usage(
        prompt_tokens=delta.prompt_tokens,
        completion_tokens=delta.completion_tokens,
        total_tokens=delta.prompt_tokens + delta.completion_tokens,
        prompt_tokens_details=details,
    )


def total_usage(usages: list[Usage]) -> Usage:
    """n choices: the prompt once, the completions summed (as OpenAI counts them)."""
    total = usages[0].model_copy()
    for usage in usages[1:]:
        total.completion_tokens += usage.completion_tokens
        total.total_tokens += usage.completion_tokens
        if usage.completion_tokens_details and total.completion_tokens_details:
            for key, value in usage.completion_tokens_details.items():
                total.completion_tokens_details[key] = (
                    total.completion_tokens_details.get(key, 0) + value
                )
    return total


def dump(model: BaseModel) -> dict[str, object]:
    return model.model_dump(exclude_none=True)


async def off_loop(
    request: Request, fn: Callable[P, Result], /, *args: P.args, **kwargs: P.kwargs
) -> Result:
    """``fn(*args, **kwargs)`` in the runtime's worker threads, not on the event loop
    (`mlxserve.server.workers`): preparing a request, weighed by its body's size."""
    size = len(await request.body())  # read already: parse_body's, kept by the request
    return await runtime_of(request).workers.run(size, fn, *args, **kwargs)


def sampling_of(body: GenerationBody, logprobs: int | None = None) -> SamplingParams:
    """The request's sampling, as the engine's sampler will read it: OpenAI's defaults
    for what the body leaves out (temperature and top_p 1, the vendor extensions off),
    the seed within [0, 2^63). ``logprobs``: the API's own field, read by its route."""
    return SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=None if body.seed is None else body.seed % SEED_RANGE,
        top_k=body.top_k or 0,
        min_p=body.min_p or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        logit_bias=body.logit_bias_pairs(),
        logprobs=logprobs,
    )
