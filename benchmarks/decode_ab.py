"""A decode step of the Flash-shaped DeepSeek-V4, this tree's model against a baseline
copy of its package, in one process; one JSON.

Which code is faster is a question of two versions of ``mlxserve/models/deepseek_v4``,
and a CPU shared with other work drifts by more than the difference between them, so
they are timed in one process, interleaved: the baseline package (a copy of the
folder, e.g. the last commit's: ``git archive HEAD mlxserve/models/deepseek_v4 | tar
-x -C /tmp/base``) is imported under another name beside this tree's, both build the
same model (`mtp_cost.flash_shaped`, one seed: the same weights), prefill the same
prompt, and then decode in turns, ``--steps`` steps each per round, each step's
token evaluated with its caches (``mx.eval``) before the next is built; then, as the
engine decodes, ``--steps`` steps pipelined (each built from the last step's lazy
tokens and queued before those are read back, so the host builds while the device
runs; mean per step, the pipeline filled at the start). The arms'
first steps' logits are compared (they are to agree within 1e-3) and their greedy
tokens over the run. The ``plain`` arm is this tree with the fused paths off
(``compiled_decode_max_rows = compiled_hc_max_rows = 0``).

Run: python benchmarks/decode_ab.py --baseline /tmp/base/mlxserve/models/deepseek_v4
         [--layers 43] [--rows 1] [--steps 8] [--rounds 7] [--dense float]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import mlx.core as mx

from mlxserve.hardware.cuda_graphs import configure_cuda_graphs
from mlxserve.hardware.probe import benchmark_device
from mlxserve.hardware.tuning import default_tuning

BASELINE = "mlxserve_baseline_deepseek_v4"


def load_baseline(folder: Path) -> ModuleType:
    """The package in ``folder`` imported as `BASELINE` (its relative imports resolve
    inside it; ``mlxserve.kernels`` and the rest are this tree's)."""
    spec = importlib.util.spec_from_file_location(
        BASELINE, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    if spec is None or spec.loader is None:
        raise SystemExit(f"no package in {folder}")
    package = importlib.util.module_from_spec(spec)
    sys.modules[BASELINE] = package
    spec.loader.exec_module(package)
    return package


@contextlib.contextmanager
def models_from(package: str) -> Iterator[None]:
    """``mlxserve.models.deepseek_v4`` (and its ``.model``) resolved to ``package`` for a
    while, so `mtp_cost.flash_shaped` builds that package's model."""
    names = ("mlxserve.models.deepseek_v4", "mlxserve.models.deepseek_v4.model")
    saved = {name: sys.modules.get(name) for name in names}
    sys.modules[names[0]] = importlib.import_module(package)
    sys.modules[names[1]] = importlib.import_module(package + ".model")
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


class Arm:
    """One model decoding greedily from its own caches."""

    def __init__(self, name: str, model: Any, rows: int, prompt: int, vocab: int) -> None:
        self.name, self.model = name, model
        self.caches = [model.make_cache() for _ in range(rows)]
        self.tokens: list[list[int]] = []
        last = []
        for row, cache in enumerate(self.caches):
            ids = mx.random.randint(0, vocab, (1, prompt + row), key=mx.random.key(row))
            logits = model(ids, cache=cache)[:, -1]
            mx.eval(logits, [c.state for c in cache])
            last.append(int(mx.argmax(logits[0])))
        self.tokens = [[t] for t in last]
        self.stacked: list[Any] = self.caches[0]
        if rows > 1:
            cls = type(self.caches[0][0])
            self.stacked = [
                cls.stack([c[i] for c in self.caches]) for i in range(len(model.layers))
            ]
        self.first_logits: mx.array | None = None
        self.times: list[float] = []
        self.pipelined_times: list[float] = []

    def _take(self, picked: list[int]) -> None:
        for row, token in enumerate(picked):
            self.tokens[row].append(token)

    def step(self) -> float:
        """One decode step, evaluated; its seconds."""
        began = time.perf_counter()
        feed = mx.array([[t[-1]] for t in self.tokens])
        logits = self.model(feed, cache=self.stacked)[:, -1]
        choice = mx.argmax(logits, axis=-1)
        mx.eval(choice, logits, [c.state for c in self.stacked])
        elapsed = time.perf_counter() - began
        if self.first_logits is None:
            self.first_logits = logits
        self._take(choice.tolist())  # type: ignore[arg-type]
        return elapsed

    def pipelined(self, steps: int) -> float:
        """``steps`` decode steps as the engine runs them (module docstring); seconds
        per step."""
        from pipelined import pipelined_steps  # beside this file

        def greedy(feed: mx.array) -> mx.array:
            choice = mx.argmax(self.model(feed, cache=self.stacked)[:, -1], axis=-1)[:, None]
            mx.async_eval(choice, [c.state for c in self.stacked])  # type: ignore[no-untyped-call]
            return choice

        first = mx.array([[t[-1]] for t in self.tokens])
        seconds, read = pipelined_steps(greedy, first, steps)
        for column in read[1:]:  # ``first`` is the last token already taken
            self._take([row[0] for row in column])
        return seconds


def main() -> None:
    from mtp_cost import DENSE_FORMATS, flash_shaped  # beside this file

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="a deepseek_v4 folder")
    parser.add_argument("--layers", type=int, default=43)
    parser.add_argument("--rows", type=int, default=1, help="decoding rows (stacked)")
    parser.add_argument("--prompt", type=int, default=300, help="prompt tokens per row")
    parser.add_argument("--steps", type=int, default=8, help="steps per arm per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dense", choices=DENSE_FORMATS, default="float")
    parser.add_argument("--no-plain", action="store_true", help="leave out the plain arm")
    args = parser.parse_args()
    # As the CLI does, before any device work: without it a 43-layer step ran with
    # MLX's own graph cache, which thrashes (stop 32's first two runs, and stop 28's).
    configure_cuda_graphs()
    if not (args.baseline / "__init__.py").is_file():
        print(f"decode_ab: {args.baseline} holds no package (__init__.py)", file=sys.stderr)
        raise SystemExit(2)
    load_baseline(args.baseline)
    vocab = 8192
    shape = (args.layers, 512, 64, vocab)
    models = {"new": flash_shaped(*shape, dense=args.dense)}
    with models_from(BASELINE):
        models["baseline"] = flash_shaped(*shape, dense=args.dense)
    if not args.no_plain:
        plain = flash_shaped(*shape, dense=args.dense)
        plain.tune(default_tuning().replace(compiled_decode_max_rows=0, compiled_hc_max_rows=0))
        models["plain"] = plain
    arms = [Arm(name, model, args.rows, args.prompt, vocab) for name, model in models.items()]
    for arm in arms:  # warm-up: compilations and first-use checks
        arm.step()
        arm.pipelined(2)
        arm.times.clear()
    for _ in range(args.rounds):
        for arm in arms:
            arm.times.extend(arm.step() for _ in range(args.steps))
            arm.pipelined_times.append(arm.pipelined(args.steps))
    base = next(a for a in arms if a.name == "baseline")
    medians = {arm.name: statistics.median(arm.times) * 1e3 for arm in arms}
    pipelined = {arm.name: statistics.median(arm.pipelined_times) * 1e3 for arm in arms}
    result = {
        "benchmark": "decode_ab",
        "layers": args.layers,
        "rows": args.rows,
        "prompt": args.prompt,
        "dense_projections": args.dense,
        "steps_per_arm": args.steps * args.rounds,
        "step_ms_median": medians,
        "over_baseline": {name: ms / medians["baseline"] for name, ms in medians.items()},
        "pipelined_step_ms_median": pipelined,
        "pipelined_over_baseline": {
            name: ms / pipelined["baseline"] for name, ms in pipelined.items()
        },
        "first_step_logits_max_diff_from_baseline": {
            arm.name: float(mx.abs(arm.first_logits - base.first_logits).max())  # type: ignore[operator]
            for arm in arms
        },
        "greedy_tokens_equal_baseline": {arm.name: arm.tokens == base.tokens for arm in arms},
        "load_average": os.getloadavg(),
        "device": benchmark_device(),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
