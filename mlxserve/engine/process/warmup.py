"""Run the engine's kinds of step once before serving, untimed.

Why: a device that compiles kernels on their first use (MLX's CUDA backend: NVRTC
and cuDNN plans per kernel and shape) makes the first prefill and the first
speculative round of a fresh process take tens of seconds, later steps milliseconds
(docs/engine.md#warm-up: the measurements). Inside a user's request that is a first
answer that takes a minute, and a step the front's hang detection (seconds) and the
engine's watchdog (tens of seconds) rightly call hung. So the engine runs a lone request
(prefill, a plain step, speculative rounds and the depth calibration) and two
requests together (a decode batch, drafting together) before it says hello, sampled
and greedy rows both.
What it leaves behind is only what serving would have built anyway: compiled
kernels and the depth calibration. Its prefix-cache entries, step times, memory
peaks and acceptance and round times are dropped, so the front's hang limits,
the reported peaks and the automatic depth start from serving.

Under tensor parallelism rank 0's warm-up requests take the normal lockstep path,
so every follower runs the same steps (the depth calibration included) and
forgets them as rank 0 does (`mlxserve.engine.process.lockstep`). While it runs, every
rank's watchdog allows a step `WARM_UP_STEP_S` rather than the plan's progress
timeout (30 s), which a compiling step can exceed.
"""

from __future__ import annotations

import logging
import time
from typing import Literal

from mlxserve.channel.request import GenerationParams, SamplingParams
from mlxserve.engine.core.drive import run_until_finished
from mlxserve.engine.core.request import GenerationRequest
from mlxserve.engine.core.stepper import Engine

log = logging.getLogger(__name__)

#: Tokens each warm-up request generates: past the first token, the depth
#: calibration and a few rounds at the deepest draft depth.
WARM_UP_TOKENS = 24
#: Steps the warm-up may take (it needs about 60): a bound, not a budget.
MAX_STEPS = 10_000
#: The longest a warm-up step may make no progress before the watchdog ends its
#: rank: about 10x what a first step took on the H200 with the demo model
#: (docs/engine.md#tuning; a larger model compiles more kernels), and within the
#: front's 600 s default `startup_timeout_s`, so a rank that wedges while warming up
#: still ends.
WARM_UP_STEP_S = 300.0


def wanted(setting: bool | Literal["auto"], device_type: str) -> bool:
    """Whether to warm up: "auto" does where kernels compile on first use (a GPU)."""
    if setting == "auto":
        return device_type in ("cuda", "metal")
    return setting


def warm_up(engine: Engine, prompt: tuple[int, ...]) -> float:
    """Run ``prompt`` alone, then twice at once, to completion; the seconds taken.

    Raises RuntimeError when a warm-up request fails or does not finish within
    the step bound: the engine would not serve either.
    """
    if not prompt:
        raise ValueError("the warm-up needs a prompt of at least one token")
    started = time.monotonic()
    # A second prompt (the first one's plus one token) so the pair prefills rather
    # than reusing the first request's prefix entry only.
    pair = (prompt, (*prompt, prompt[-1]))
    # Sampled rows (temperature 1: what the APIs default to when a client sends none)
    # and greedy ones, alone and in one batch: a first sampled request compiled its
    # sampler inside a user's first answer (+170 ms of TTFT on an H100, GuideLLM).
    sampled = SamplingParams(temperature=1.0, seed=0)
    lone = [GenerationRequest("warm-up-0", GenerationParams(prompt, WARM_UP_TOKENS, sampled))]
    two = [
        GenerationRequest(
            f"warm-up-{i + 1}",
            GenerationParams(p, WARM_UP_TOKENS, sampled if i else SamplingParams()),
        )
        for i, p in enumerate(pair)
    ]
    engine.warming_up = True
    try:
        _run(engine, lone)
        _run(engine, two)
    except RuntimeError:
        for request in (*lone, *two):  # one left unfinished must not run while serving
            engine.cancel_now(request.request_id)
        raise
    finally:
        engine.warming_up = False
        engine.forget_warm_up()  # kept by none, failed or not (and so by no follower)
    return time.monotonic() - started


def _run(engine: Engine, requests: list[GenerationRequest]) -> None:
    finished = run_until_finished(engine, requests, max_steps=MAX_STEPS)
    for request in requests:
        finish = finished[request.request_id]
        if finish.finish_reason == "error":
            raise RuntimeError(f"warm-up request {request.request_id} failed: {finish.error}")
