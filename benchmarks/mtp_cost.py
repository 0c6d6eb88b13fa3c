"""MTP speculation cost model, checked against real rounds; prints one JSON document.

A DeepSeek-V4-Flash-shaped model (43 layers and one MTP block by default, widths
scaled down, random weights, 4-bit experts as the demo is served) is timed for a
plain decode step, the verify forward of k + 1 tokens and one draft forward
(`round_costs.measure_round_costs`, the engine's own calibration). Then real speculative
rounds run through the engine with ORACLE drafts: each draft is the main model's own
greedy token with probability a, else a wrong one (the MTP forwards still run; only
their token is replaced). Per (a, k) it reports

- measured: decode tok/s at depth k over depth 0 (plain, pipelined decoding), the
  median of back-to-back pairs, after one untimed run per (a, k); every run of an
  (a, k) replays the same oracle draws, so the timed runs take exactly the shapes
  the untimed one did (on CUDA the first use of a shape compiles kernels);
- bound: expected tokens per round / (verify(k) + k * draft), in plain steps, with
  E(k) = 1 + a + ... + a^k;
- measured / bound (target >= 0.9);
- with the costs, a whole round as the engine runs it over its parts
  (`round_over_parts`): what a round spends beyond its forwards;
- `host_and_device`: a plain step pipelined (as served: the next step's graph is
  built and queued while the device runs this one), synced (built, run, read back
  before the next), and the host's share of it (building the graph, queuing it).
  Pipelined ~ synced means the device is idle while the host works: a round, which
  must read its drafts' fate before building the next, then costs host + device
  where a plain step costs only the larger of the two.

Run: python benchmarks/mtp_cost.py [--layers 43] [--tokens 96] [--repeats 3]
                                   [--acceptance 0.5,0.7,0.85] [--depths 1,2,3,4,5]
                                   [--queue-every 4] [--hc-ops]
CPU, short: python benchmarks/mtp_cost.py --layers 8 --tokens 48 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import time
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from mlxserve.channel.request import GenerationParams, SamplingParams
from mlxserve.engine.core.drive import run_to_completion
from mlxserve.engine.core.request import GenerationRequest
from mlxserve.engine.core.stepper import Engine, EngineConfig
from mlxserve.engine.runner.adapter import PlainAdapter
from mlxserve.engine.spec.costs import measure_round_costs, throwaway_state
from mlxserve.engine.spec.mtp import MTPAdapter, trim_steps
from mlxserve.hardware.cuda_graphs import configure_cuda_graphs
from mlxserve.hardware.probe import benchmark_device
from mlxserve.hardware.tuning import default_tuning

ACCEPTANCES = (0.5, 0.7, 0.85)
DEPTHS = (1, 2, 3, 4, 5)


#: The projections DeepSeek-V4-Flash ships in FP8, which mlxserve loads as ``mxfp8``:
#: attention's, the indexer's query, the shared expert's and the MTP inputs' (the
#: compressors, ``weights_proj``, the router and the hyper-connections ship in float).
FP8_PROJECTIONS = re.compile(
    r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)$|\.indexer\.wq_b$|\.shared_experts\.(gate_proj|up_proj|down_proj)$"
    r"|\.(e_proj|h_proj)$"
)
DENSE_FORMATS = ("mxfp8", "float")


def flash_config(layers: int, hidden: int, experts: int, vocab: int) -> dict[str, Any]:
    """DeepSeek-V4-Flash's config (layer pattern, hash layers, hc_mult 4, top-6 MoE, one
    MTP block) at ``hidden`` width: `flash_shaped` and `vs_mlx_vlm.py` build it."""
    return {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "moe_intermediate_size": hidden // 2,
        "num_hidden_layers": layers,
        "num_attention_heads": 8,
        "head_dim": max(hidden // 4, 32),
        "q_lora_rank": hidden // 2,
        "num_experts_per_tok": 6,
        "n_routed_experts": experts,
        "sliding_window": 128,
        "o_groups": 4,
        "o_lora_rank": hidden // 2,
        "index_n_heads": 8,
        "index_head_dim": 32,
        "index_topk": 64,
        "hc_mult": 4,
        "partial_rotary_factor": 0.125,
        "num_nextn_predict_layers": 1,
        "max_position_embeddings": 8192,
    }


def randomize(model: Any, experts: int, norms_near_one: bool = False) -> None:
    """Random weights in place from MLX's current seed: matrices scaled by their fan-in,
    vectors small (``norms_near_one``: norm weights about 1), hash routing tables of
    expert ids."""
    randomized = []
    parameters = tree_flatten(model.parameters())
    assert isinstance(parameters, list)
    for name, value in parameters:
        if mx.issubdtype(value.dtype, mx.floating):
            value = mx.random.normal(value.shape) * (1.0 if value.ndim > 1 else 0.1)
            if value.ndim > 1:
                value = value / (value.shape[-1] ** 0.5)
            if norms_near_one and name.endswith("norm.weight"):
                value = 1 + value
        else:  # hash routing tables
            value = mx.random.randint(0, experts, value.shape).astype(value.dtype)
        randomized.append((name, value))
    model.update(tree_unflatten(randomized))


def flash_shaped(
    layers: int, hidden: int, experts: int, vocab: int, seed: int = 0, dense: str = "mxfp8"
) -> Any:
    """DeepSeek-V4-Flash's structure (layer pattern, hash layers, hc_mult 4, top-6 MoE,
    one MTP block) at `hidden` width; random weights, experts quantised to 4 bits and,
    with `dense` "mxfp8", the projections the published checkpoint has in FP8 as
    mlxserve loads them (`FP8_PROJECTIONS`); "float" keeps them float32. The format
    matters on CUDA: a float matmul of 2-6 rows costs 2-3x one of a single row there
    (cuBLAS against a matrix-vector kernel, `matmul_rows.py`), a quantised one about
    the same."""
    from mlx.nn.layers.quantized import quantize

    from mlxserve.engine.core.build import materialize
    from mlxserve.models.deepseek_v4 import Model, ModelArgs
    from mlxserve.models.deepseek_v4.model import MTPBlock
    from mlxserve.models.demo.build import quantize_experts

    args = ModelArgs.from_dict(flash_config(layers, hidden, experts, vocab))
    mx.random.seed(seed)
    model = Model(args)
    model.mtp = [MTPBlock(args, "sliding_attention")]
    randomize(model, experts)
    quantize_experts(model)
    if dense == "mxfp8":
        quantize(
            model,
            32,
            8,
            mode="mxfp8",
            class_predicate=lambda path, _: FP8_PROJECTIONS.search(path) is not None,
        )
    elif dense != "float":
        raise ValueError(f"dense projections are {' or '.join(DENSE_FORMATS)}, not {dense!r}")
    materialize(model)
    return model


#: One irrational step per draft position (square roots of primes): the positions'
#: sequences are jointly equidistributed (a Kronecker sequence), so they do not
#: correlate the way shifted copies of one sequence would.
STEPS = tuple(p**0.5 % 1.0 for p in (2, 3, 5, 7, 11, 13, 17, 19))


class OracleAdapter(MTPAdapter):
    """Drafts that are right with probability `acceptance`, per position, by construction.

    The draft forwards run as always; the proposed token is replaced by the reference
    greedy token (or a wrong one) while still depending on the draft logits, so the
    device computes the whole draft chain.

    The draws are stratified, not independent: draft position l's n-th draw is right
    when frac(phase_l + n x sqrt(p_l)) < a (a Kronecker sequence, one prime p_l per
    position). Each draw is still right with probability a over the random phases,
    but over the ten-odd rounds of a run the share of right drafts at each position
    stays within a draw or so of a, where independent draws wander by +-0.1: the
    nominal bound is then the bound of the acceptance the run had."""

    def __init__(self, model: Any, reference: list[int], acceptance: float, seed: int) -> None:
        super().__init__(model)
        self.reference = reference
        self.acceptance = acceptance
        self.seed = seed
        self.vocab = int(model.args.vocab_size)
        self.position = 0
        self.draws: dict[int, int] = {}
        draw = random.Random(seed)
        self.phases = [draw.random() for _ in STEPS]

    def replay(self) -> None:
        """The next run draws what the last one drew: the same rounds, so the same
        shapes (on CUDA the warm-up run compiled the kernels of exactly those)."""
        self.draws = {}

    def right(self, level: int) -> bool:
        """Whether draft position `level`'s next draw is the reference token."""
        n = self.draws.get(level, 0)
        self.draws[level] = n + 1
        slot = level % len(STEPS)
        return (self.phases[slot] + n * STEPS[slot]) % 1.0 < self.acceptance

    def speculate(self, state: Any, last_token: int, *args: Any) -> tuple[list[int], int, int]:
        self.position = int(state.offset) + 1  # d_1 stands for token `offset + 1`
        return super().speculate(state, last_token, *args)

    def propose(
        self, level: int, logits: mx.array, params: SamplingParams, key: mx.array
    ) -> mx.array:
        index = self.position + level
        right = self.reference[index] if index < len(self.reference) else 0
        token = right if self.right(level) else (right + 1) % self.vocab
        return mx.array(token, dtype=mx.uint32) + mx.argmax(logits).astype(mx.uint32) * 0


#: "wall" or "cpu" (this process's CPU time: steadier on a CPU shared with other work)
CLOCK = ["wall"]


def one_run(engine: Engine, prompt: tuple[int, ...], tokens: int, name: str) -> Any:
    if isinstance(engine.adapter, OracleAdapter):
        engine.adapter.replay()
    done = run_to_completion(engine, GenerationRequest(name, GenerationParams(prompt, tokens)))
    if CLOCK[0] == "cpu":
        seconds = done.cpu_total_s - done.cpu_ttft_s
    else:
        seconds = done.total_s - done.ttft_s
    return (len(done.tokens) - 1) / seconds, done.tokens, done.finish


def paired_speedup(
    plain: Engine, speculative: Engine, prompt: tuple[int, ...], tokens: int, repeats: int
) -> Any:
    """Median over repeats of (depth-k rate / depth-0 rate), each pair run back to back,
    so a machine whose speed drifts (shared CPU, clocks) compares like with like."""
    ratios, rates, outputs, finish = [], [], [], None
    for i in range(repeats):
        rate0, _, _ = one_run(plain, prompt, tokens, f"p{i}")
        rate, out, finish = one_run(speculative, prompt, tokens, f"s{i}")
        ratios.append(rate / rate0)
        rates.append(rate)
        outputs.append(out)
    return statistics.median(ratios), statistics.median(rates), outputs, finish


def host_and_device(adapter: MTPAdapter, context: int, steps: int = 8) -> dict[str, float]:
    """Milliseconds of a plain step pipelined, synced, and of its host work alone
    (wall clock: the split is what a wall clock shows)."""
    state, token = throwaway_state(adapter, context, max_rollback=steps + 1)

    def run(mode: str) -> float:
        host = 0.0
        start = time.perf_counter()
        current = token
        for _ in range(steps):
            began = time.perf_counter()
            current = mx.argmax(adapter.step(state, current)).reshape(1)
            if mode == "pipelined":
                mx.async_eval(current)  # type: ignore[no-untyped-call]
            elif mode == "host":
                mx.async_eval(current)  # type: ignore[no-untyped-call]
                host += time.perf_counter() - began
                mx.eval(current)
            else:
                mx.eval(current)
        mx.eval(current, [c.state for c in state.cache])
        elapsed = time.perf_counter() - start
        trim_steps(state, steps)
        return (host if mode == "host" else elapsed) / steps * 1e3

    modes = ("pipelined", "synced", "host")
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for trial in range(4):
        for mode in modes:
            ms = run(mode)
            if trial:
                times[mode].append(ms)
    return {f"plain_{mode}_ms": statistics.median(times[mode]) for mode in modes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=43)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=96, help="tokens generated per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--acceptance",
        nargs="*",
        default=[str(a) for a in ACCEPTANCES],
        help="acceptances, space- or comma-separated: 0.5 0.7 or 0.5,0.7",
    )
    parser.add_argument("--depths", nargs="*", default=[str(k) for k in DEPTHS])
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="time decoding by the wall clock, or by this process's CPU time (a CPU "
        "device shared with other work; the costs are then CPU time too)",
    )
    parser.add_argument(
        "--queue-every",
        type=int,
        default=default_tuning().verify_queue_every_layers,
        help="queue a verify for the device every this many layers (0: not at all)",
    )
    parser.add_argument(
        "--dense",
        choices=DENSE_FORMATS,
        default="mxfp8",
        help="the dense projections' format (mxfp8: as the published checkpoint loads)",
    )
    parser.add_argument(
        "--hc-ops",
        action="store_true",
        help="run the hyper-connections as ops, not compiled (to compare)",
    )
    args = parser.parse_args()
    tuning = default_tuning().replace(verify_queue_every_layers=args.queue_every)
    if args.hc_ops:
        tuning = tuning.replace(compiled_hc_max_rows=0)
    configure_cuda_graphs()  # as the CLI does, before any device work
    CLOCK[0] = args.clock
    try:
        args.acceptance = [float(a) for a in ",".join(args.acceptance).split(",") if a]
        args.depths = [int(k) for k in ",".join(args.depths).split(",") if k]
    except ValueError as exc:
        parser.error(f"--acceptance takes numbers, --depths integers: {exc}")

    started = time.perf_counter()
    model = flash_shaped(args.layers, args.hidden, args.experts, args.vocab, dense=args.dense)
    prompt = tuple(random.Random(1).randrange(args.vocab) for _ in range(args.prompt))
    plain_config = EngineConfig(speculative_depth=0, prefix_cache_entries=0, tuning=tuning)
    plain = Engine(PlainAdapter(model), plain_config)
    one_run(plain, prompt, args.tokens, "warm-up")  # kernels for every shape compiled
    rate0, reference_out, _ = one_run(plain, prompt, args.tokens, "reference")
    reference = [*prompt, *reference_out]
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    tuned = MTPAdapter(model)
    tuned.tune(tuning)
    costs = measure_round_costs(tuned, context=args.prompt + args.tokens // 2, clock=clock)
    step = costs.plain
    result: dict[str, Any] = {
        "benchmark": "mtp_cost",
        "model": {
            "shape": "DeepSeek-V4-Flash",
            "layers": args.layers,
            "mtp_blocks": 1,
            "hidden": args.hidden,
            "routed_experts": args.experts,
            "experts_per_token": 6,
            "vocab": args.vocab,
            "experts_bits": 4,
            "dense_projections": args.dense,
        },
        "prompt_tokens": args.prompt,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "clock": args.clock,
        "queue_every_layers": args.queue_every,
        "hyper_connections_compiled": not args.hc_ops,
        "attention_split_per_query": tuning.split_attention_queries,
        "device": benchmark_device(),
        "costs_in_plain_steps": {
            "plain_step_ms": step * 1e3,
            "verify": {str(k): v / step for k, v in costs.verify.items()},
            "draft": costs.draft / step,
            # A whole round as the engine runs it, and over its parts (verify + k drafts):
            # what a round spends beyond its forwards.
            "round": {str(k): v / step for k, v in costs.rounds.items()},
            "round_over_parts": {str(k): v / costs.parts(k) for k, v in costs.rounds.items()},
        },
        "host_and_device": host_and_device(tuned, args.prompt + args.tokens // 2),
        "depth0_tok_s": rate0,
        "runs": [],
    }
    header = {
        k: result[k] for k in ("device", "costs_in_plain_steps", "host_and_device", "depth0_tok_s")
    }
    print(json.dumps(header), file=sys.stderr, flush=True)
    for acceptance in args.acceptance:
        best = 0.0
        for depth in args.depths:
            adapter = OracleAdapter(model, reference, acceptance, seed=depth)
            config = EngineConfig(speculative_depth=depth, prefix_cache_entries=0, tuning=tuning)
            engine = Engine(adapter, config)
            one_run(engine, prompt, args.tokens, "warm-up")  # the shapes the runs will take
            measured, rate, runs, finish = paired_speedup(
                plain, engine, prompt, args.tokens, args.repeats
            )
            expected = sum(acceptance**j for j in range(depth + 1))
            bound = expected * step / costs.parts(depth)
            best = max(best, measured)
            spec = finish.speculative or {}
            realised = spec.get("acceptance_rate_per_depth") or []
            # The oracle's draws vary run to run: the bound at the acceptance it realised.
            realised_bound = (1 + sum(realised)) * step / costs.parts(depth)
            entry = {
                "a": acceptance,
                "k": depth,
                "tok_s": rate,
                "measured_speedup": measured,
                "bound": bound,
                "measured_over_bound": measured / bound,
                "bound_at_realised_acceptance": realised_bound,
                "measured_over_realised_bound": measured / realised_bound,
                "expected_tokens_per_round": expected,
                "realised_acceptance": realised,
                "identical_to_depth0": all(r == reference_out for r in runs),
            }
            result["runs"].append(entry)
            print(json.dumps(entry), file=sys.stderr, flush=True)
        result.setdefault("best_measured", {})[str(acceptance)] = best
    runs = result["runs"]
    result["worst_measured_over_bound"] = min(r["measured_over_bound"] for r in runs)
    result["worst_measured_over_realised_bound"] = min(
        r["measured_over_realised_bound"] for r in runs
    )
    result["wall_s"] = time.perf_counter() - started
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
