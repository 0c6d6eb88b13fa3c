"""DSpark against MTP and plain decoding, on the Flash shape and the demo; prints JSON.

* **Flash shape** (`mtp_cost.flash_shaped`: 43 layers, one MTP block, widths scaled
  down, random weights, 4-bit experts, mxfp8 projections) plus a random -0731-style
  DSpark head per ``--block`` (3 V4 stages quantised like the main layers, taps of the
  last three layers as -0731's ``dspark_target_layer_ids`` [40, 41, 42]). -0731 ships
  ``dspark_block_size`` 5 (its config.json, as vLLM #41834 and DeepSpec's loaders read
  it); other blocks are what a longer-drafting head would give. Drafts are ORACLE
  drafts at the same acceptance a per position for both drafters (the head's forwards
  still run; only their token is replaced: `mtp_cost.OracleAdapter`, and
  `OracleDSpark` here, whose confidence head reports a). Per a: decode tok/s of depth
  0, of MTP at each depth in ``--mtp-depths`` (the best one kept), and of DSpark at
  each block with adaptive verification (one calibration per block, its costs in
  plain steps reported), each as the median over repeats of a back-to-back pair with
  depth 0.
* **Demo** (CPU-sized, real heads, real acceptance): the demo with its MTP block at
  the automatic depth and at each fixed depth, and its -0731-style variant
  (``demo-model --dspark``) at the automatic depth, against depth 0 of the same model.

Every result is also one JSON line on stderr as soon as it is measured, and appended
to ``--partial`` (flushed), so a run cut off at a time limit keeps what it measured;
``--budget-s`` starts no new measurement past that many seconds (those left are
listed under ``skipped``), so the run ends with its JSON inside a limit.

Run: python benchmarks/dspark_cost.py [--layers 43] [--acceptance 0.7 0.85] [--block 4,5,8]
CPU, short: python benchmarks/dspark_cost.py --layers 8 --tokens 48 --repeats 2 --skip demo \
    --clock cpu
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_unflatten

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mtp_cost import (
    CLOCK,
    FP8_PROJECTIONS,
    STEPS,
    OracleAdapter,
    flash_shaped,
    one_run,
    paired_speedup,
)

from mlxserve.channel.request import SamplingParams
from mlxserve.engine.core.stepper import Engine, EngineConfig
from mlxserve.engine.runner.adapter import PlainAdapter
from mlxserve.engine.spec.dspark import DSparkAdapter
from mlxserve.engine.spec.mtp import MTPAdapter
from mlxserve.hardware.cuda_graphs import configure_cuda_graphs
from mlxserve.hardware.probe import benchmark_device
from mlxserve.models.demo.build import flat_parameters

#: One oracle seed for every drafter: draft position j's n-th draw is right or wrong
#: alike for MTP at any depth and DSpark at any block, so at one a they are compared
#: on the same draws, not on draws that happened to come out higher for one of them.
ORACLE_SEED = 1


def with_dspark_head(model: Any, block: int, stages: int, seed: int = 1) -> Any:
    """``model`` given a random -0731-style DSpark head (its MTP block stays: both
    drafters run on one main model): taps of the last three layers, experts 4-bit and
    the projections -0731 ships in FP8 as mxfp8, as `mtp_cost.flash_shaped` has them."""
    from mlx.nn.layers.quantized import quantize

    from mlxserve.models.deepseek_v4.dspark import DSparkHead, DSparkSpec
    from mlxserve.models.demo.build import quantize_experts

    layers = model.args.num_hidden_layers
    taps = tuple(range(max(layers - 3, 0), layers))
    spec = DSparkSpec(block, taps, 0, stages, 256, confidence_with_markov=True)
    head = DSparkHead(model.args, spec)
    mx.random.seed(seed)
    randomized = []
    for name, value in flat_parameters(head):
        value = mx.random.normal(value.shape) * (1.0 if value.ndim > 1 else 0.1)
        if value.ndim > 1:
            value = value / (value.shape[-1] ** 0.5)
        randomized.append((name, value))
    head.update(tree_unflatten(randomized))
    quantize_experts(head)
    quantize(
        head,
        32,
        8,
        mode="mxfp8",
        class_predicate=lambda path, _: (
            FP8_PROJECTIONS.search(path) is not None or path.endswith("main_proj")
        ),
    )
    model["dspark"] = head
    mx.eval([value for _, value in flat_parameters(head)])
    return model


class OracleDSpark(DSparkAdapter):
    """DSpark drafts right with probability ``acceptance`` per position (the draws of
    `mtp_cost.OracleAdapter`), and a confidence head that says so. ``read_first``: every
    round reads its confidences before it verifies (no plan: the round as it was before
    plans, two host syncs), to compare in one process."""

    def __init__(
        self,
        model: Any,
        reference: list[int],
        acceptance: float,
        seed: int,
        read_first: bool = False,
    ) -> None:
        super().__init__(model)
        self.oracle = OracleAdapter(model, reference, acceptance, seed)
        self.acceptance = acceptance
        self.read_first = read_first
        #: rounds whose verify count was planned / decided on their read confidences
        self.plans = {"planned": 0, "read_first": 0}

    def replay(self) -> None:
        self.oracle.replay()

    def speculate(self, state: Any, last_token: int, *args: Any) -> tuple[list[int], int, int]:
        self.oracle.position = int(state.offset) + 1
        return super().speculate(state, last_token, *args)

    def propose(
        self, level: int, logits: mx.array, params: SamplingParams, key: mx.array
    ) -> mx.array:
        return self.oracle.propose(level, logits, params, key)

    def confidences(self, hidden: mx.array, previous: mx.array) -> mx.array:
        real = super().confidences(hidden, previous)
        return mx.full(real.shape, self.acceptance) + real * 0

    def _plan(self, state: Any, depth: int) -> int | None:
        plan = None if self.read_first else super()._plan(state, depth)
        self.plans["planned" if plan is not None else "read_first"] += 1
        return plan


def _run(engine: Engine, prompt: tuple[int, ...], tokens: int, name: str) -> Any:
    adapter = engine.adapter
    if isinstance(adapter, OracleDSpark):
        adapter.replay()
    return one_run(engine, prompt, tokens, name)


def compare(
    plain: Engine, engine: Engine, prompt: tuple[int, ...], tokens: int, repeats: int
) -> dict[str, Any]:
    _run(engine, prompt, tokens, "warm-up")
    if isinstance(engine.adapter, OracleDSpark):
        engine.adapter.replay()
        engine.adapter.plans = {"planned": 0, "read_first": 0}
    speedup, rate, outputs, finish = paired_speedup(plain, engine, prompt, tokens, repeats)
    spec = finish.speculative or {}
    plans = dict(engine.adapter.plans) if isinstance(engine.adapter, OracleDSpark) else None
    return {
        **({"rounds_planned_vs_read_first": plans} if plans is not None else {}),
        "speedup_over_depth0": speedup,
        "tok_s": rate,
        "acceptance_per_position": spec.get("acceptance_rate_per_depth"),
        "verified_per_round": spec.get("depths_chosen"),
        "outputs_identical": len({tuple(o) for o in outputs}) == 1,
    }


class Progress:
    """Each result as one JSON line as soon as it is measured (stderr, and ``--partial``
    flushed), and the time budget: past ``budget_s`` no new measurement starts."""

    def __init__(self, path: str | None, budget_s: float | None) -> None:
        self.path = Path(path) if path else None
        self.budget_s = budget_s
        self.started = time.perf_counter()
        self.skipped: list[str] = []
        if self.path is not None:
            self.path.write_text("")

    def emit(self, row: dict[str, Any]) -> None:
        line = json.dumps({"elapsed_s": round(time.perf_counter() - self.started, 1), **row})
        print(line, file=sys.stderr, flush=True)
        if self.path is not None:
            with self.path.open("a") as out:
                out.write(line + "\n")

    def go(self, what: str) -> bool:
        """Whether ``what`` may start (else it is listed as skipped)."""
        if self.budget_s is None or time.perf_counter() - self.started < self.budget_s:
            return True
        self.skipped.append(what)
        self.emit({"skipped": what})
        return False


def in_steps(costs: Any) -> dict[str, Any]:
    """A DSpark calibration in plain steps: the head's block, rounds that read their
    confidences first (verifying m) and planned rounds (verifying k, one sync)."""
    step = costs.plain
    return {
        "plain_step_ms": step * 1e3,
        "draft": costs.draft / step,
        "round_read_first": {str(m): v / step for m, v in costs.verify.items()},
        "round_planned": {str(k): v / step for k, v in costs.rounds.items()},
    }


def flash(args: argparse.Namespace, progress: Progress) -> dict[str, Any]:
    model = flash_shaped(args.layers, args.hidden, args.experts, args.vocab)
    heads = {}
    for block in args.block:
        heads[block] = with_dspark_head(model, block, args.stages)["dspark"]
    prompt = tuple(random.Random(1).randrange(args.vocab) for _ in range(args.prompt))
    plain = Engine(PlainAdapter(model), EngineConfig(speculative_depth=0, prefix_cache_entries=0))
    one_run(plain, prompt, args.tokens, "warm-up")
    rate0, reference_out, _ = one_run(plain, prompt, args.tokens, "reference")
    reference = [*prompt, *reference_out]
    out: dict[str, Any] = {"depth0_tok_s": rate0, "dspark_costs": {}, "by_acceptance": {}}
    progress.emit({"depth0_tok_s": rate0})
    clock = time.process_time if CLOCK[0] == "cpu" else time.perf_counter
    costs: dict[int, Any] = {}
    for block in args.block:
        if not progress.go(f"calibration, block {block}"):
            continue
        model["dspark"] = heads[block]
        calibrated = OracleDSpark(model, reference, args.acceptance[0], ORACLE_SEED)
        calibrated.measure_costs(clock=clock)
        assert calibrated.costs is not None
        costs[block] = calibrated.costs  # all of them (the engine's picker gets the rounds)
        out["dspark_costs"][str(block)] = in_steps(costs[block])
        progress.emit({"block": block, "costs_in_plain_steps": out["dspark_costs"][str(block)]})
    for acceptance in args.acceptance:
        mtp: dict[str, Any] = {}
        for depth in args.mtp_depths:
            if not progress.go(f"a {acceptance}, MTP depth {depth}"):
                continue
            adapter = OracleAdapter(model, reference, acceptance, seed=ORACLE_SEED)
            engine = Engine(adapter, EngineConfig(speculative_depth=depth, prefix_cache_entries=0))
            mtp[str(depth)] = compare(plain, engine, prompt, args.tokens, args.repeats)
            progress.emit({"a": acceptance, "mtp": depth, **mtp[str(depth)]})
        best = max(mtp, key=lambda k: mtp[k]["speedup_over_depth0"]) if mtp else None
        entry: dict[str, Any] = {"mtp": mtp, "mtp_best_depth": int(best) if best else None}
        entry["dspark"] = {}
        for block in args.block:
            if block not in costs or not progress.go(f"a {acceptance}, DSpark block {block}"):
                continue
            model["dspark"] = heads[block]
            for read_first in (False, True) if args.also_read_first else (False,):
                if read_first and not progress.go(f"a {acceptance}, block {block}, read first"):
                    continue
                dspark = OracleDSpark(model, reference, acceptance, ORACLE_SEED, read_first)
                dspark.costs = costs[block]
                config = EngineConfig(speculative_depth=block, prefix_cache_entries=0)
                engine = Engine(dspark, config)
                drafted = compare(plain, engine, prompt, args.tokens, args.repeats)
                if best is not None:
                    ratio = drafted["speedup_over_depth0"] / mtp[best]["speedup_over_depth0"]
                    drafted["dspark_over_best_mtp"] = ratio
                name = "dspark_read_first" if read_first else "dspark"
                entry.setdefault(name, {})[str(block)] = drafted
                progress.emit({"a": acceptance, name: block, **drafted})
        out["by_acceptance"][str(acceptance)] = entry
    return out


def demo(args: argparse.Namespace, progress: Progress) -> dict[str, Any]:
    from mlxserve.engine.core.build import materialize
    from mlxserve.models import load
    from mlxserve.models.demo.build import build_demo_model
    from mlxserve.models.demo.dspark import build_dspark_demo

    out: dict[str, Any] = {}
    for name, path in (
        ("mtp", build_demo_model(progress=False)),
        ("dspark", build_dspark_demo(progress=False)),
    ):
        model, tokenizer = load(str(path))
        materialize(model)
        text = "<|user|>Python reference: the for statement<|end|><|assistant|>"
        prompt = tuple(tokenizer.encode(text))
        plain = Engine(
            PlainAdapter(model), EngineConfig(speculative_depth=0, prefix_cache_entries=0)
        )
        one_run(plain, prompt, args.demo_tokens, "warm-up")
        adapter_type = DSparkAdapter if name == "dspark" else MTPAdapter
        results: dict[str, Any] = {}
        depths: list[int | str] = ["auto", *args.demo_depths] if name == "mtp" else ["auto", 4]
        for depth in depths:
            config = EngineConfig(speculative_depth=depth, prefix_cache_entries=0)  # type: ignore[arg-type]
            engine = Engine(adapter_type(model), config)
            if not progress.go(f"demo {name}, depth {depth}"):
                continue
            results[str(depth)] = compare(plain, engine, prompt, args.demo_tokens, args.repeats)
            progress.emit({"demo": name, "depth": depth, **results[str(depth)]})
        out[name] = results
    if out["mtp"] and "auto" in out["dspark"]:  # not cut by the time budget
        best_mtp = max(v["speedup_over_depth0"] for v in out["mtp"].values())
        out["dspark_auto_over_depth0"] = out["dspark"]["auto"]["speedup_over_depth0"]
        out["dspark_auto_over_best_mtp"] = out["dspark_auto_over_depth0"] / best_mtp
    return out


def _numbers(values: list[str], kind: type) -> list[Any]:
    return [kind(v) for v in ",".join(values).split(",") if v]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=43)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument(
        "--block",
        nargs="*",
        default=["5"],
        help="DSpark drafts per block, one head each (-0731's dspark_block_size: 5)",
    )
    parser.add_argument("--stages", type=int, default=3, help="DSpark stages (-0731: 3)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--acceptance", nargs="*", default=["0.7"])
    parser.add_argument("--mtp-depths", nargs="*", default=["1,2,3,4,5"])
    parser.add_argument("--demo-tokens", type=int, default=96)
    parser.add_argument("--demo-depths", nargs="*", default=["1,2,3"])
    parser.add_argument("--skip", choices=["flash", "demo"], default=None)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    parser.add_argument(
        "--also-read-first",
        action="store_true",
        help="also run DSpark with every round reading its confidences first (no plan)",
    )
    parser.add_argument("--partial", default=None, help="append each result here (JSON lines)")
    parser.add_argument(
        "--budget-s", type=float, default=None, help="start no measurement past these seconds"
    )
    args = parser.parse_args()
    args.acceptance = _numbers(args.acceptance, float)
    args.mtp_depths = _numbers(args.mtp_depths, int)
    args.demo_depths = _numbers(args.demo_depths, int)
    args.block = _numbers(args.block, int)
    CLOCK[0] = args.clock
    configure_cuda_graphs()  # as the CLI does, before any device work (as mtp_cost.py)
    started = time.perf_counter()
    progress = Progress(args.partial, args.budget_s)
    result: dict[str, Any] = {
        "benchmark": "dspark_cost",
        "device": benchmark_device(),
        "clock": args.clock,
        "repeats": args.repeats,
        "oracle_steps": list(STEPS[:2]),
        "flash_shape": {
            "layers": args.layers,
            "hidden": args.hidden,
            "routed_experts": args.experts,
            "vocab": args.vocab,
            "dspark_blocks": args.block,
            "dspark_stages": args.stages,
            "prompt_tokens": args.prompt,
            "tokens": args.tokens,
        },
    }
    progress.emit({"header": result})
    if args.skip != "flash":
        result["flash"] = flash(args, progress)
    if args.skip != "demo":
        result["demo"] = demo(args, progress)
    result["skipped"] = progress.skipped
    result["wall_s"] = time.perf_counter() - started
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
