"""DSpark against MTP and plain decoding, on the Flash shape and the demo; prints JSON.

* **Flash shape** (`mtp_cost.flash_shaped`: 43 layers, one MTP block, widths scaled
  down, random weights, 4-bit experts, mxfp8 projections) plus a random -0731-style
  DSpark head (``--stages`` V4 blocks, a block of ``--block`` drafts, taps of three
  layers). Drafts are ORACLE drafts at the same acceptance a for both drafters (the
  head's forwards still run; only their token is replaced: `mtp_cost.OracleAdapter`,
  and `OracleDSpark` here, whose confidence head reports a). Per a: decode tok/s of
  depth 0, of MTP at each depth in ``--mtp-depths`` (the best one kept), and of DSpark
  with adaptive verification (its calibration's costs, the ceiling the block), each
  as the median over repeats of a back-to-back pair with depth 0.
* **Demo** (CPU-sized, real heads, real acceptance): the demo with its MTP block at
  the automatic depth and at each fixed depth, and its -0731-style variant
  (``demo-model --dspark``) at the automatic depth, against depth 0 of the same model.

Run: python benchmarks/dspark_cost.py [--layers 43] [--acceptance 0.7] [--repeats 3]
CPU, short: python benchmarks/dspark_cost.py --layers 8 --tokens 48 --repeats 1
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
from mlxserve.hardware.probe import benchmark_device
from mlxserve.models.demo.build import flat_parameters


def with_dspark_head(model: Any, block: int, stages: int, seed: int = 1) -> Any:
    """``model`` given a random DSpark head (its MTP block stays: both drafters run on
    one main model)."""
    from mlxserve.models.deepseek_v4.dspark import DSparkHead, DSparkSpec

    layers = model.args.num_hidden_layers
    taps = (1, layers // 2, layers - 2)
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
    model["dspark"] = head
    mx.eval([value for _, value in flat_parameters(head)])
    return model


class OracleDSpark(DSparkAdapter):
    """DSpark drafts right with probability ``acceptance`` per position (the draws of
    `mtp_cost.OracleAdapter`), and a confidence head that says so."""

    def __init__(self, model: Any, reference: list[int], acceptance: float, seed: int) -> None:
        super().__init__(model)
        self.oracle = OracleAdapter(model, reference, acceptance, seed)
        self.acceptance = acceptance

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
    speedup, rate, outputs, finish = paired_speedup(plain, engine, prompt, tokens, repeats)
    spec = finish.speculative or {}
    return {
        "speedup_over_depth0": speedup,
        "tok_s": rate,
        "acceptance_per_position": spec.get("acceptance_rate_per_depth"),
        "verified_per_round": spec.get("depths_chosen"),
        "outputs_identical": len({tuple(o) for o in outputs}) == 1,
    }


def flash(args: argparse.Namespace) -> dict[str, Any]:
    model = flash_shaped(args.layers, args.hidden, args.experts, args.vocab)
    model = with_dspark_head(model, args.block, args.stages)
    prompt = tuple(random.Random(1).randrange(args.vocab) for _ in range(args.prompt))
    plain = Engine(PlainAdapter(model), EngineConfig(speculative_depth=0, prefix_cache_entries=0))
    one_run(plain, prompt, args.tokens, "warm-up")
    rate0, reference_out, _ = one_run(plain, prompt, args.tokens, "reference")
    reference = [*prompt, *reference_out]
    out: dict[str, Any] = {"depth0_tok_s": rate0, "by_acceptance": {}}
    for acceptance in args.acceptance:
        mtp: dict[str, Any] = {}
        for depth in args.mtp_depths:
            adapter = OracleAdapter(model, reference, acceptance, seed=depth)
            engine = Engine(adapter, EngineConfig(speculative_depth=depth, prefix_cache_entries=0))
            mtp[str(depth)] = compare(plain, engine, prompt, args.tokens, args.repeats)
            print(json.dumps({"a": acceptance, "mtp": depth, **mtp[str(depth)]}), file=sys.stderr)
        best = max(mtp, key=lambda k: mtp[k]["speedup_over_depth0"])
        dspark = OracleDSpark(model, reference, acceptance, seed=1)
        dspark.measure_costs(clock=time.process_time if CLOCK[0] == "cpu" else time.perf_counter)
        config = EngineConfig(speculative_depth=args.block, prefix_cache_entries=0)
        drafted = compare(plain, Engine(dspark, config), prompt, args.tokens, args.repeats)
        print(json.dumps({"a": acceptance, "dspark": drafted}), file=sys.stderr)
        out["by_acceptance"][str(acceptance)] = {
            "mtp": mtp,
            "mtp_best_depth": int(best),
            "dspark": drafted,
            "dspark_over_best_mtp": drafted["speedup_over_depth0"]
            / mtp[best]["speedup_over_depth0"],
        }
    return out


def demo(args: argparse.Namespace) -> dict[str, Any]:
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
            results[str(depth)] = compare(plain, engine, prompt, args.demo_tokens, args.repeats)
            print(
                json.dumps({"demo": name, "depth": depth, **results[str(depth)]}), file=sys.stderr
            )
        out[name] = results
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
    parser.add_argument("--block", type=int, default=4, help="DSpark drafts per block")
    parser.add_argument("--stages", type=int, default=3, help="DSpark stages (-0731: 3)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--acceptance", nargs="*", default=["0.7"])
    parser.add_argument("--mtp-depths", nargs="*", default=["1,2,3"])
    parser.add_argument("--demo-tokens", type=int, default=96)
    parser.add_argument("--demo-depths", nargs="*", default=["1,2,3"])
    parser.add_argument("--skip", choices=["flash", "demo"], default=None)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = parser.parse_args()
    args.acceptance = _numbers(args.acceptance, float)
    args.mtp_depths = _numbers(args.mtp_depths, int)
    args.demo_depths = _numbers(args.demo_depths, int)
    CLOCK[0] = args.clock
    started = time.perf_counter()
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
            "dspark_block": args.block,
            "dspark_stages": args.stages,
            "prompt_tokens": args.prompt,
            "tokens": args.tokens,
        },
    }
    if args.skip != "flash":
        result["flash"] = flash(args)
    if args.skip != "demo":
        result["demo"] = demo(args)
    result["wall_s"] = time.perf_counter() - started
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
