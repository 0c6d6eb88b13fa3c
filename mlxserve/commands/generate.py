"""`mlxserve generate`: one generation through the engine, like `mlx_lm.generate`."""

import argparse
import json
import queue
import time
import uuid
from typing import Any

from mlxserve.config import Settings
from mlxserve.engine.request import FinishEvent, GenerationRequest, SamplingParams, TokensEvent
from mlxserve.errors import UsageError


def encode_prompt(tokenizer: Any, text: str, chat: bool) -> list[int]:
    """Token ids of `text`, wrapped in the chat template when the model has one."""
    if chat and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids)
    return list(tokenizer.encode(text))


def stream_is_empty(stream: Any) -> bool:
    return bool(stream._events.empty())


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
    detokenizer = loaded.tokenizer.detokenizer
    detokenizer.reset()
    while finish is None:
        if not engine.run_once() and stream_is_empty(stream):
            raise UsageError("the engine stopped without finishing the request")
        while True:
            try:
                event = stream.get(timeout=0)
            except queue.Empty:
                break
            if isinstance(event, TokensEvent):
                first_token_at = first_token_at or time.perf_counter()
                tokens.extend(event.token_ids)
                for token in event.token_ids:
                    detokenizer.add_token(token)
                if not args.json:
                    print(detokenizer.last_segment, end="", flush=True)
            elif isinstance(event, FinishEvent):
                finish = event
                break
    detokenizer.finalize()
    elapsed = time.perf_counter() - started
    if args.json:
        document = {
            "text": detokenizer.text,
            "token_ids": tokens,
            "finish_reason": finish.finish_reason,
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
        print(detokenizer.last_segment)
    if finish.finish_reason == "error":
        raise UsageError(f"generation failed: {finish.error}")
    return 0
