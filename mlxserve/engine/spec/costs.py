"""What a speculative round costs on this machine: measured, not assumed.

The automatic depth (`mlxserve.engine.spec.depth`) weighs expected tokens against
seconds. On a GPU a small-batch step is bound by launches and memory, so verifying
k + 1 tokens costs about one step; on a CPU it grows with k. Measuring tells which.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlxserve.channel.request import SamplingParams
from mlxserve.engine.sample.sampling import KeyStream
from mlxserve.engine.spec.mtp import (
    MTPAdapter,
    MTPState,
    trim_exactly,
    trim_steps,
    verify_streams,
)

GREEDY = SamplingParams()

#: How `measure_round_costs` probes (its defaults and the probes the engine asks for).
#: Stored costs (`mlxserve.engine.spec.cost_store`) carry it: bump it whenever a change
#: here makes older figures mean something else, and they are measured again.
#: 2: DSpark's ``rounds`` became planned rounds (drafts, confidences and verdict read
#: back once), where 1 stored rounds that read the confidences first.
MEASUREMENT = 2


@dataclass
class RoundCosts:
    """Seconds of one decode step, of the pieces of a speculative round and, where
    measured, of whole rounds."""

    plain: float
    verify: dict[int, float] = field(default_factory=dict)  # k -> forward of k + 1 tokens
    draft: float = 0.0
    # k -> one real round at depth k, as the engine runs it
    rounds: dict[int, float] = field(default_factory=dict)

    def round(self, depth: int) -> float:
        """Expected seconds of a round at ``depth`` (0: one plain step): the measured
        round where there is one, else its parts."""
        if depth <= 0:
            return self.plain
        return self.rounds.get(depth, self.parts(depth))

    def parts(self, depth: int) -> float:
        """verify(depth) + depth x draft: what a round would cost with no other work."""
        return self.verify.get(depth, self.plain) + depth * self.draft

    def as_dict(self) -> dict[str, Any]:
        """JSON-able (depths as strings), for rank 0 to send its costs to followers."""
        return {
            "plain": self.plain,
            "verify": {str(k): v for k, v in self.verify.items()},
            "draft": self.draft,
            "rounds": {str(k): v for k, v in self.rounds.items()},
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "RoundCosts":
        return cls(
            plain=float(raw["plain"]),
            verify={int(k): float(v) for k, v in raw["verify"].items()},
            draft=float(raw["draft"]),
            rounds={int(k): float(v) for k, v in raw["rounds"].items()},
        )


def interleaved_medians(
    probes: dict[str, Callable[[], float]], trials: int, tick: Callable[[], None]
) -> dict[str, float]:
    """Each probe's median seconds over ``trials`` interleaved runs, after one
    untimed warm-up round: interleaving spreads the device's drift over every probe
    alike, so their ratios hold when the absolute times wander."""
    times: dict[str, list[float]] = {name: [] for name in probes}
    for trial in range(trials + 1):
        for name, probe in probes.items():
            seconds = probe()
            tick()
            if trial:
                times[name].append(seconds)
    return {name: sorted(values)[len(values) // 2] for name, values in times.items()}


def throwaway_state(
    adapter: MTPAdapter, context: int, max_rollback: int
) -> tuple[MTPState, mx.array]:
    """A state of `context` made-up tokens plus one plain step, evaluated, and the
    token it fed (what a probe feeds next): the ground probes stand on."""
    vocab = int(adapter.model.args.vocab_size)
    state = adapter.new_state(max_rollback=max_rollback)
    adapter.prefill(state, [(7 * i + 3) % vocab for i in range(context)])
    token = mx.array([1], mx.int32)
    adapter.step(state, token)
    mx.eval(state.carry, [c.state for c in state.cache])
    return state, token


def measure_round_costs(
    adapter: MTPAdapter,
    trials: int = 5,
    steps: int = 8,
    context: int = 32,
    clock: Callable[[], float] = time.perf_counter,
    tick: Callable[[], None] = lambda: None,
    parts: bool = True,
) -> RoundCosts:
    """A plain step, verify(k) for every k, one draft forward and a whole round at
    every k, on a throw-away state of `context` tokens, each timed as the engine runs
    it: plain steps pipelined (the next queued before the last is read), a verify
    forward with the round's sync, a draft as one link of a synced chain, a round
    as `speculate` runs it (on a copy of the state). The automatic depth weighs the
    whole rounds: on a 2-core CPU their parts put a depth-1 round at 0.65x and a
    depth-5 one at 1.3x what the round cost. The measurements are interleaved and the
    median of `trials` kept (after one untimed pass: kernels compile on first use),
    so a machine whose speed drifts affects them alike. `clock`: benchmarks on a
    shared CPU pass `time.process_time`. `tick` is called after every probe: the
    engine counts each as progress, so its watchdogs (its own and the front's hang
    detection) do not take a calibration of a few seconds for a stalled step.
    `parts=False` skips the verify and draft probes (the engine weighs whole rounds
    only: half the calibration time)."""
    model = adapter.model
    depth = adapter.max_draft_depth
    vocab = int(model.args.vocab_size)
    state, token = throwaway_state(adapter, context, max_rollback=max(steps, depth) + 1)
    # Distinct tokens: identical ones would all route to the same experts.
    varied = mx.array([(31 * i + 11) % vocab for i in range(depth + 1)], mx.int32)
    queue_every = adapter.tuning.verify_queue_every_layers

    def plain() -> float:
        start = clock()
        current = token
        for _ in range(steps):
            current = mx.argmax(adapter.step(state, current)).reshape(1)
            mx.async_eval(current)  # type: ignore[no-untyped-call]
        mx.eval(current, [c.state for c in state.cache])
        elapsed = clock() - start
        trim_steps(state, steps)
        return elapsed / steps

    def verify(k: int) -> float:
        start = clock()
        streams = verify_streams(model, varied[None, : k + 1], state.cache, [], queue_every)
        logits = model.head_from_streams(streams)
        mx.eval(mx.argmax(logits, axis=-1), streams, [c.state for c in state.cache])
        elapsed = clock() - start
        for cache in state.cache:
            trim_exactly(cache, k + 1)
        return elapsed

    def draft() -> float:
        carry = state.carry
        assert carry is not None
        start = clock()
        streams, current = carry[:, -1:], token[None]
        for _ in range(depth):
            logits, streams = model.mtp_forward(streams, current, state.mtp_cache[0], 0)
            current = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(current, state.mtp_cache[0].state)
        elapsed = clock() - start
        trim_exactly(state.mtp_cache[0], depth)
        return elapsed / depth

    def whole_round(k: int) -> float:
        copy = adapter.snapshot(state)
        mx.eval(copy.carry, [c.state for c in (*copy.cache, *copy.mtp_cache)])
        start = clock()
        adapter.speculate(copy, 1, k, GREEDY, keys)
        return clock() - start

    keys = KeyStream(0).at(0)
    probes: dict[str, Callable[[], float]] = {"plain": plain}
    for k in range(1, depth + 1 if parts else 1):
        probes[f"verify{k}"] = lambda k=k: verify(k)  # type: ignore[misc]
    if model.num_mtp_blocks and depth:
        if parts:
            probes["draft"] = draft
        for k in range(1, depth + 1):
            probes[f"round{k}"] = lambda k=k: whole_round(k)  # type: ignore[misc]
    median = interleaved_medians(probes, trials, tick)
    return RoundCosts(
        plain=median["plain"],
        verify={k: median[f"verify{k}"] for k in range(1, depth + 1) if f"verify{k}" in median},
        draft=median.get("draft", 0.0),
        rounds={k: median[f"round{k}"] for k in range(1, depth + 1) if f"round{k}" in median},
    )
