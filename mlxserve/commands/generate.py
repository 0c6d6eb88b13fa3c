"""`mlxserve generate`: one generation through the engine, like `mlx_lm.generate`."""

import argparse
import json
import queue
import time
import uuid
from typing import Any

from mlxserve.config import Settings
from mlxserve.engine.engine import RequestStream
from mlxserve.engine.request import (
    Event,
    FinishEvent,
    GenerationRequest,
    SamplingParams,
    TokensEvent,
)
from mlxserve.errors import UsageError
from mlxserve.server.stops import TextStream

# A request cannot need more steps than this; a bound, not a budget.
MAX_STEPS = 10_000_000


def encode_prompt(tokenizer: Any, text: str, chat: bool) -> list[int]:
    """Token ids of `text`, wrapped in the chat template when the model has one."""
    if chat and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids)
    return list(tokenizer.encode(text))


def drain(stream: RequestStream) -> list[Event]:
    """The events that are ready now, without waiting."""
    events: list[Event] = []
    while True:
        try:
            events.append(stream.get(timeout=0))
        except queue.Empty:
            return events


def run_generate(settings: Settings, args: argparse.Namespace) -> int:
    from mlxserve.engine.build import build_engine
    from mlxserve.policy.build import build_plan

    if args.max_tokens < 1:
        raise UsageError("--max-tokens must be >= 1")
    try:
        sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    plan, membership = build_plan(settings)
    plan.ensure_startable()
    engine, loaded = build_engine(settings, plan, membership.rank)
    prompt = encode_prompt(loaded.tokenizer, args.prompt, chat=not args.raw)
    request = GenerationRequest(
        request_id=uuid.uuid4().hex,
        prompt_ids=tuple(prompt),
        max_tokens=args.max_tokens,
        sampling=sampling,
        stop_token_ids=frozenset(loaded.tokenizer.eos_token_ids),
    )
    started = time.perf_counter()
    stream = engine.submit(request)
    tokens: list[int] = []
    finish: FinishEvent | None = None
    first_token_at = None
    text = TextStream(loaded.tokenizer.detokenizer, list(args.stop or []))
    output: list[str] = []

    def show(piece: str) -> None:
        output.append(piece)
        if not args.json:
            print(piece, end="", flush=True)

    for _ in range(MAX_STEPS):
        progressed = engine.run_once()
        for event in drain(stream):
            if isinstance(event, TokensEvent):
                first_token_at = first_token_at or time.perf_counter()
                tokens.extend(event.token_ids)
                show(text.push(list(event.token_ids)))
                if text.stopped:
                    engine.cancel(request.request_id)
            else:
                finish = event
        if finish is not None:
            break
        if not progressed:
            raise UsageError("the engine stopped without finishing the request")
    assert finish is not None
    show(text.finish())
    reason = "stop" if text.stopped else finish.finish_reason
    elapsed = time.perf_counter() - started
    if args.json:
        document = {
            "text": "".join(output),
            "token_ids": tokens,
            "finish_reason": reason,
            "usage": {
                "prompt_tokens": finish.usage.prompt_tokens,
                "completion_tokens": finish.usage.completion_tokens,
                "total_tokens": finish.usage.prompt_tokens + finish.usage.completion_tokens,
            },
            "speculative": finish.speculative
            or {"depth": 0, "drafted": 0, "accepted": 0, "acceptance_rate": 0.0},
            "timing": {
                "seconds": elapsed,
                "ttft_seconds": (first_token_at or time.perf_counter()) - started,
            },
        }
        print(json.dumps(document, indent=2))
    else:
        print()
    if finish.finish_reason == "error":
        raise UsageError(f"generation failed: {finish.error}")
    return 0
