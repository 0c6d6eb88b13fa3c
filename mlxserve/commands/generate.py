"""`mlxserve generate`: one generation through the engine, like `mlx_lm.generate`."""

import argparse
import json
import uuid
from typing import Any

from mlxserve.channel.request import GenerationParams, SamplingParams
from mlxserve.config import Settings
from mlxserve.engine.core.request import GenerationRequest
from mlxserve.errors import UsageError
from mlxserve.server.stops import TextStream


def encode_prompt(tokenizer: Any, text: str, chat: bool) -> list[int]:
    """Token ids of `text`, wrapped in the chat template when the model has one."""
    if chat and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids)
    return list(tokenizer.encode(text))


def run_generate(settings: Settings, args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise UsageError("--max-tokens must be >= 1")
    try:
        sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    # After the checks: the engine brings mlx-lm and transformers (seconds to import),
    # and a bad flag is answered before anything starts.
    from mlxserve.engine.core.build import build_engine
    from mlxserve.engine.core.drive import run_to_completion
    from mlxserve.startup.plan import build_plan

    plan, membership = build_plan(settings)
    plan.ensure_startable()
    engine, loaded = build_engine(settings, plan, membership.rank)
    prompt = encode_prompt(loaded.tokenizer, args.prompt, chat=not args.raw)
    request = GenerationRequest(
        request_id=uuid.uuid4().hex,
        params=GenerationParams(
            prompt_ids=tuple(prompt),
            max_tokens=args.max_tokens,
            sampling=sampling,
            stop_token_ids=tuple(sorted(loaded.tokenizer.eos_token_ids)),
        ),
    )
    text = TextStream(loaded.tokenizer.detokenizer, list(args.stop or []))
    output: list[str] = []

    def show(piece: str) -> None:
        output.append(piece)
        if not args.json:
            print(piece, end="", flush=True)

    def on_tokens(token_ids: tuple[int, ...]) -> bool:
        show(text.push(list(token_ids)))
        return text.stopped  # a stop string: cancel the rest

    try:
        done = run_to_completion(engine, request, on_tokens)
    except RuntimeError as exc:
        raise UsageError(str(exc)) from None
    finish = done.finish
    show(text.finish())
    reason = "stop" if text.stopped else finish.finish_reason
    if args.json:
        document = {
            "text": "".join(output),
            "token_ids": done.tokens,
            "finish_reason": reason,
            "usage": {
                "prompt_tokens": finish.usage.prompt_tokens,
                "completion_tokens": finish.usage.completion_tokens,
                "total_tokens": finish.usage.prompt_tokens + finish.usage.completion_tokens,
            },
            "speculative": finish.speculative
            or {"depth": 0, "drafted": 0, "accepted": 0, "acceptance_rate": 0.0},
            "timing": {
                "seconds": done.total_s,
                "ttft_seconds": done.ttft_s,
            },
        }
        print(json.dumps(document, indent=2))
    else:
        print()
    if finish.finish_reason == "error":
        raise UsageError(f"generation failed: {finish.error}")
    return 0
