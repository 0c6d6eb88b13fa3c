"""Time the ``nax_moe`` MoE variants on prefill-shaped batches; print JSON.

Each configuration builds one quantized mlx-lm ``SwitchGLU`` (gate and up
``K -> N``, down ``N -> K``; random packed weights, so no float copy is ever
made), routes ``tokens x top_k`` rows uniformly, and times a forward per
variant: ``skip`` (stock sorted ``gather_qmm``) and ``full`` (mlxserve's
expert-aligned tiles through the unsorted kernel). With candidates on, it also
times the designs ``full`` was chosen over:

* ``unsorted``: the stock call with ``sorted_indices=False``;
* ``per_expert``: one ``quantized_matmul`` per expert run (after a host sync);
* ``static_tiles``: ``full``'s tiles with an upper bound on their number, no sync.

Rounds are interleaved (every variant once per round, after a warm-up that also
checks every variant against ``skip``) and medians are reported, wall time and
this process's CPU time, with ratios to ``skip`` from the same run: load from
other processes then hits every variant alike, and CPU time ignores it.

A CPU timing cannot show the GPU question, because the CPU's ``gather_qmm``
ignores ``sorted_indices`` and costs the same per row either way. So each result
also counts the rows each GPU kernel would put through its matrix units
(``gpu_mma_rows``: ``skip`` per 32-row simdgroup, ``full`` per 64-row tile,
``static_tiles`` its bound), and ``cpu_full_overhead_per_row`` gives ``full``'s
CPU time per row it computes over ``skip``'s: 1.0 means the tiling (layout, host
sync, gathers) costs nothing beyond its padding rows.

``--quick`` (default) sweeps three small configurations, 1-3 minutes on two CPU
cores; ``--full`` sweeps tokens 512..8192, 64..256 experts, top-k 6..8, a 1024x512
shape and the DeepSeek-V4-Flash expert shape (K=4096, N=2048), plus two cheap
configurations with 65528 and 65536 rows; ``--configs`` runs exactly the ones given.
Configurations whose predicted time exceeds what is left of ``--budget`` are listed
as skipped.

A variant that raises (issue 13: ``RuntimeError: cuGraphAddKernelNode(...) failed:
invalid argument`` at ``mx.eval`` on MLX CUDA) is recorded in the configuration's
``failures`` and in the document's, with the variant, the phase (warm-up or timed)
and the shape, and the sweep goes on; each failure is also printed to stderr as it
happens. ``--isolate`` runs every configuration in a fresh process, so one that
kills the process or leaves the device unusable is charged to itself alone. A
suspect, from MLX's CUDA source: the sorted call on ``[rows, 1, K]`` launches one
grid block per row along a grid dimension that CUDA caps at 65535, so it would fail
from ``tokens x top_k > 65535`` on (8192 tokens, top-8), while ``full``'s tiles
batch ``rows / 64 + experts`` matrices; the 65528/65536-row pair tests exactly that.

    python benchmarks/moe_variants.py --quick
    python benchmarks/moe_variants.py --configs 8191x256x8:256x128,8192x256x8:256x128 --isolate
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python benchmarks/moe_variants.py --quick
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU

from mlxserve.hardware.probe import benchmark_device
from mlxserve.kernels.moe import ROW_TILE, QuantizedExperts, takes_row_tiles
from mlxserve.kernels.switch import FullComputeSwitchLinear
from mlxserve.kernels.tiles import ExpertTiles, forget_tiles

# Candidate designs, kept here: they lost (see mlxserve/kernels/moe.py).


class UnsortedSwitchLinear(QuantizedSwitchLinear):
    """Candidate (b): the stock call, always with ``sorted_indices=False``."""

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        return QuantizedExperts.of(self).gather(x, indices, sorted_indices=False)


class _RunCache:
    """Run lengths per expert for the last ``indices`` array (one sync per MoE layer)."""

    def __init__(self) -> None:
        self.indices: mx.array | None = None
        self.counts: list[int] = []


_runs = _RunCache()


class PerExpertSwitchLinear(QuantizedSwitchLinear):
    """Candidate (a): one dense ``quantized_matmul`` per expert run of the sorted rows."""

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        experts = QuantizedExperts.of(self)
        if not sorted_indices or not takes_row_tiles(
            tuple(x.shape), tuple(indices.shape), experts.num_experts
        ):
            return experts.gather(x, indices, sorted_indices=False)
        if _runs.indices is not indices:
            flat = indices.reshape(-1).astype(mx.int32)
            counts = mx.zeros((experts.num_experts,), dtype=mx.int32).at[flat].add(1)
            _runs.indices, _runs.counts = indices, cast(list[int], counts.tolist())
        rows = x.reshape(-1, x.shape[-1])
        outs = []
        start = 0
        for expert, count in enumerate(_runs.counts):
            if count:
                outs.append(
                    mx.quantized_matmul(
                        rows[start : start + count],
                        experts.weight[expert],
                        experts.scales[expert],
                        None if experts.biases is None else experts.biases[expert],
                        transpose=True,
                        group_size=experts.group_size,
                        bits=experts.bits,
                        mode=experts.mode,
                    )
                )
            start += count
        return mx.concatenate(outs).reshape(*indices.shape, 1, -1)


def static_tiles(indices: mx.array, num_experts: int, tile_rows: int) -> ExpertTiles:
    """Candidate (c) layout: as many tiles as any routing could need, so no sync."""
    flat = indices.reshape(-1)
    experts = flat.astype(mx.int32)
    rows = mx.arange(flat.size, dtype=mx.int32)
    counts = mx.zeros((num_experts,), dtype=mx.int32).at[experts].add(1)
    tiles = (counts + (tile_rows - 1)) // tile_rows
    first_tile = mx.cumsum(tiles) - tiles
    first_row = mx.cumsum(counts) - counts
    row_slot = first_tile[experts] * tile_rows + (rows - first_row[experts])
    num_tiles = math.ceil(flat.size / tile_rows) + min(num_experts, flat.size)
    slot_row = mx.zeros((num_tiles * tile_rows,), dtype=mx.int32).at[row_slot].add(rows)
    return ExpertTiles(tile_rows, num_tiles, row_slot, slot_row, flat[slot_row[::tile_rows]])


class _StaticCache:
    def __init__(self) -> None:
        self.indices: mx.array | None = None
        self.tiles: ExpertTiles | None = None


_static = _StaticCache()


class StaticTilesSwitchLinear(QuantizedSwitchLinear):
    """Candidate (c'): ``full``'s tiles sized by the static bound instead of a sync."""

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        experts = QuantizedExperts.of(self)
        if not sorted_indices or not takes_row_tiles(
            tuple(x.shape), tuple(indices.shape), experts.num_experts
        ):
            return experts.gather(x, indices, sorted_indices=False)
        if _static.indices is not indices or _static.tiles is None:
            _static.indices = indices
            _static.tiles = static_tiles(indices, experts.num_experts, ROW_TILE)
        tiles = _static.tiles
        k = x.shape[-1]
        tiled_x = x.reshape(-1, k)[tiles.slot_row].reshape(tiles.num_tiles, ROW_TILE, k)
        y = experts.gather(tiled_x, tiles.tile_expert, sorted_indices=False)
        return y.reshape(tiles.slots, -1)[tiles.row_slot].reshape(*indices.shape, 1, -1)


VARIANTS: dict[str, type[QuantizedSwitchLinear]] = {
    "skip": QuantizedSwitchLinear,
    "full": FullComputeSwitchLinear,
}
CANDIDATES: dict[str, type[QuantizedSwitchLinear]] = {
    "unsorted": UnsortedSwitchLinear,
    "per_expert": PerExpertSwitchLinear,
    "static_tiles": StaticTilesSwitchLinear,
}


@dataclass(frozen=True)
class Config:
    tokens: int
    experts: int
    top_k: int
    in_dims: int
    out_dims: int
    bits: int = 4
    group_size: int = 64

    @property
    def rows(self) -> int:
        return self.tokens * self.top_k

    @property
    def gflop(self) -> float:
        """Multiply-adds of the three projections, as flops."""
        return 3 * 2 * self.rows * self.in_dims * self.out_dims / 1e9


TINY = (256, 128)
SMALL = (1024, 512)
V4_FLASH = (4096, 2048)


def sweep(full: bool) -> list[Config]:
    """The configurations, cheapest first, so a budget cuts the most expensive ones."""
    if not full:
        return [
            Config(tokens, experts, top_k, *TINY)
            for tokens, experts, top_k in ((512, 64, 8), (512, 256, 6), (1024, 128, 8))
        ]
    configs = [
        Config(tokens, experts, top_k, *shape, group_size=64 if shape == SMALL else 32)
        for shape in (SMALL, V4_FLASH)
        for tokens in (512, 2048, 8192)
        for experts, top_k in ((64, 8), (128, 8), (256, 6), (256, 8))
    ]
    # rows = tokens x top_k just under and at 2^16: a kernel that puts one row per
    # grid block in y or z (CUDA's limit: 65535) fails at the second and not the first.
    configs += [Config(tokens, 256, 8, *TINY) for tokens in (8191, 8192)]
    return sorted(configs, key=lambda cfg: cfg.gflop)


def parse_configs(text: str) -> list[Config]:
    """``TOKENSxEXPERTSxTOPK:KxN[:GROUP]``, comma-separated (e.g. ``8192x256x8:1024x512``)."""
    configs = []
    for item in text.split(","):
        try:
            route, dims, *group = item.strip().split(":")
            tokens, experts, top_k = (int(v) for v in route.split("x"))
            in_dims, out_dims = (int(v) for v in dims.split("x"))
            group_size = int(group[0]) if group else (64 if in_dims <= 1024 else 32)
        except ValueError:
            raise SystemExit(f"moe_variants.py: error: bad --configs entry {item!r}") from None
        configs.append(Config(tokens, experts, top_k, in_dims, out_dims, group_size=group_size))
    return configs


def quantized_layer(
    experts: int, n: int, k: int, cfg: Config, dtype: mx.Dtype, seed: int
) -> QuantizedSwitchLinear:
    """A stock ``QuantizedSwitchLinear`` holding random packed weights ``[experts, n, k]``.

    Built tiny and then given its arrays, because its constructor draws float
    weights of the full shape first (8 GB for 256 V4-Flash experts).
    """
    layer = QuantizedSwitchLinear(
        cfg.group_size, 1, 1, bias=False, group_size=cfg.group_size, bits=cfg.bits
    )
    wkey, skey = mx.random.split(mx.random.key(seed))
    words = k * cfg.bits // 32
    groups = k // cfg.group_size
    levels = 2**cfg.bits - 1
    span = 2.0 / math.sqrt(k) / levels
    layer.weight = mx.random.randint(0, 2**31 - 1, (experts, n, words), key=wkey).astype(mx.uint32)
    scales = mx.random.uniform(0.5, 1.5, (experts, n, groups), key=skey) * span
    layer.scales = scales.astype(dtype)
    layer.biases = (-scales * levels / 2).astype(dtype)
    return layer


def quantized_block(cfg: Config, dtype: mx.Dtype, seed: int) -> SwitchGLU:
    """mlx-lm's SwitchGLU with ``gate``/``up`` ``[E, N, K]`` and ``down`` ``[E, K, N]``."""
    block = SwitchGLU(cfg.group_size, 1, 1)
    n, k = cfg.out_dims, cfg.in_dims
    block.gate_proj = quantized_layer(cfg.experts, n, k, cfg, dtype, seed)
    block.up_proj = quantized_layer(cfg.experts, n, k, cfg, dtype, seed + 1)
    block.down_proj = quantized_layer(cfg.experts, k, n, cfg, dtype, seed + 2)
    mx.eval(block.parameters())
    return block


def routing(cfg: Config, seed: int) -> mx.array:
    logits = mx.random.normal((cfg.tokens, cfg.experts), key=mx.random.key(seed + 1))
    return mx.argpartition(-logits, cfg.top_k - 1, axis=-1)[:, : cfg.top_k].astype(mx.uint32)


def mma_rows(indices: mx.array, cfg: Config) -> dict[str, int]:
    """Rows each GPU kernel runs through its matrix units, padding included.

    ``gather_qmm_rhs_nax`` and ``full``'s ``gather_qmm_t_nax`` both work in 64-row
    tiles per expert run, each tile split between two 32-row simdgroup rows; #4352
    lets a simdgroup row with no real rows skip its MMA, so ``skip`` pays per 32
    rows where ``full`` pays per 64. A CPU timing cannot show this; these counts do.
    """
    flat = indices.reshape(-1).astype(mx.int32)
    counts = mx.zeros((cfg.experts,), dtype=mx.int32).at[flat].add(1)

    def rounded(unit: int) -> int:
        return cast(int, mx.sum((counts + unit - 1) // unit).item()) * unit

    bound = (math.ceil(cfg.rows / ROW_TILE) + min(cfg.experts, cfg.rows)) * ROW_TILE
    return {
        "rows": cfg.rows,
        "skip": rounded(ROW_TILE // 2),
        "full": rounded(ROW_TILE),
        "static_tiles": bound,
    }


def set_class(block: SwitchGLU, cls: type[QuantizedSwitchLinear]) -> None:
    for layer in (block.gate_proj, block.up_proj, block.down_proj):
        layer.__class__ = cls


def forget_caches() -> None:
    forget_tiles()
    _runs.indices = None
    _static.indices, _static.tiles = None, None


def time_config(
    cfg: Config, variants: dict[str, type[QuantizedSwitchLinear]], repeats: int, dtype: mx.Dtype
) -> dict[str, Any]:
    """Time every variant on one configuration; a variant that raises is recorded, not fatal.

    MLX reports a kernel the device refuses (issue 13: ``cuGraphAddKernelNode(...)
    failed: invalid argument`` on CUDA) as a RuntimeError at ``mx.eval``: it goes into
    ``failures`` with the variant, the phase and the configuration, and that variant is
    left out of the timed rounds while the others go on.
    """
    block = quantized_block(cfg, dtype, seed=cfg.tokens + cfg.experts)
    x = mx.random.normal((1, cfg.tokens, cfg.in_dims), key=mx.random.key(7)).astype(dtype)
    indices = routing(cfg, seed=cfg.experts).reshape(1, cfg.tokens, cfg.top_k)
    mx.eval(x, indices)

    def run(cls: type[QuantizedSwitchLinear]) -> tuple[float, float, mx.array]:
        set_class(block, cls)
        forget_caches()
        wall, cpu = time.perf_counter(), time.process_time()
        y = block(x, indices)
        mx.eval(y)
        return time.perf_counter() - wall, time.process_time() - cpu, y

    failures: list[dict[str, Any]] = []

    def failed(name: str, phase: str, exc: Exception) -> None:
        failure = {"variant": name, "phase": phase, "error": f"{type(exc).__name__}: {exc}"}
        failures.append({**failure, **asdict(cfg), "rows": cfg.rows})
        print(json.dumps({"failure": failures[-1]}), file=sys.stderr, flush=True)

    reference = None
    max_abs_diff: dict[str, float] = {}
    for name, cls in variants.items():  # warm-up, and check every variant agrees
        try:
            *_, y = run(cls)
        except Exception as exc:  # any failure of a variant is a result
            failed(name, "warm-up", exc)
            continue
        if reference is None and name == "skip":
            reference = y
        if reference is not None:
            max_abs_diff[name] = cast(float, mx.max(mx.abs(y - reference)).item())
    ran = [name for name in variants if not any(f["variant"] == name for f in failures)]
    walls: dict[str, list[float]] = {name: [] for name in ran}
    cpus: dict[str, list[float]] = {name: [] for name in ran}
    for _ in range(repeats):
        for name in list(walls):
            try:
                wall, cpu, _ = run(variants[name])
            except Exception as exc:
                failed(name, "timed", exc)
                del walls[name], cpus[name]
                continue
            walls[name].append(wall)
            cpus[name].append(cpu)
    seconds = {name: statistics.median(t) for name, t in walls.items()}
    # Process CPU time: on a CPU device, what the variant cost this process,
    # whatever else the machine runs (wall time is kept for GPUs).
    cpu_seconds = {name: statistics.median(t) for name, t in cpus.items()}
    work = mma_rows(indices, cfg)
    result: dict[str, Any] = {
        **asdict(cfg),
        "rows": cfg.rows,
        "dtype": args_dtype(dtype),
        "seconds": rounded(seconds, 4),
        "cpu_seconds": rounded(cpu_seconds, 4),
        "gpu_mma_rows": work,
        "gpu_mma_ratio_full_to_skip": round(work["full"] / work["skip"], 3),
        "max_abs_diff_to_skip": max_abs_diff,
        "failures": failures,
    }
    if "skip" in seconds:
        result["ratio_to_skip"] = rounded(ratios(seconds), 3)
        result["cpu_ratio_to_skip"] = rounded(ratios(cpu_seconds), 3)
    if "skip" in cpu_seconds and "full" in cpu_seconds:
        # The CPU's gather_qmm costs the same per row with or without sorting, so
        # full's time over skip's, per row computed, isolates what the tiling adds
        # (layout, host sync, two gathers): 1.0 means nothing.
        per_row = (cpu_seconds["full"] / work["full"]) / (cpu_seconds["skip"] / work["rows"])
        result["cpu_full_overhead_per_row"] = round(per_row, 3)
    return result


def ratios(seconds: dict[str, float]) -> dict[str, float]:
    return {name: value / seconds["skip"] for name, value in seconds.items()}


def rounded(values: dict[str, float], digits: int) -> dict[str, float]:
    return {name: round(value, digits) for name, value in values.items()}


def args_dtype(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def predict_seconds(
    cfg: Config, variants: dict[str, type[QuantizedSwitchLinear]], repeats: int, gflops: float
) -> float:
    """Warm-up plus timed rounds of every variant, each scaled by the rows it computes."""
    work = mma_rows(routing(cfg, seed=cfg.experts), cfg)
    rows_per_variant = {"full": work["full"], "static_tiles": work["static_tiles"]}
    scale = sum(rows_per_variant.get(name, cfg.rows) / cfg.rows for name in variants)
    return cfg.gflop / gflops * scale * (repeats + 1)


def run_isolated(cfg: Config, args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    """One configuration in a fresh process: a crash that takes the process (or leaves
    the device unusable) is recorded against this configuration only."""
    command = [
        sys.executable,
        __file__,
        "--one",
        json.dumps(asdict(cfg)),
        "--repeats",
        str(args.repeats),
        "--dtype",
        args.dtype,
    ]
    if args.no_candidates:
        command.append("--no-candidates")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=max(timeout, 10))
    except subprocess.TimeoutExpired:
        error = f"no result within {max(timeout, 10):.0f} s (the rest of the budget)"
        return {**asdict(cfg), "rows": cfg.rows, "failures": [{"variant": None, "error": error}]}
    sys.stderr.write(done.stderr)
    if done.returncode == 0:
        result: dict[str, Any] = json.loads(done.stdout)
        return result
    tail = " | ".join(done.stderr.strip().splitlines()[-3:])
    error = f"process exited with {done.returncode}: {tail}"
    return {**asdict(cfg), "rows": cfg.rows, "failures": [{"variant": None, "error": error}]}


def run_config(
    cfg: Config, variants: dict[str, type[QuantizedSwitchLinear]], args: argparse.Namespace
) -> dict[str, Any]:
    """`time_config`, with a failure outside the variants (say, building the weights)
    recorded against the configuration."""
    try:
        return time_config(cfg, variants, args.repeats, getattr(mx, args.dtype))
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        return {**asdict(cfg), "rows": cfg.rows, "failures": [{"variant": None, "error": error}]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sweep (default)")
    size.add_argument("--full", action="store_true", help="tokens 512..8192, V4-Flash shape")
    size.add_argument(
        "--configs", help="only these: TOKENSxEXPERTSxTOPK:KxN[:GROUP], comma-separated"
    )
    size.add_argument("--one", help=argparse.SUPPRESS)  # a child of --isolate: one Config
    parser.add_argument("--budget", type=float, help="seconds to spend (default 300 / 3600)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per config")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--no-candidates", action="store_true", help="only skip and full")
    parser.add_argument(
        "--isolate", action="store_true", help="run each configuration in its own process"
    )
    args = parser.parse_args(argv)

    variants = dict(VARIANTS) if args.no_candidates else {**VARIANTS, **CANDIDATES}
    if args.one:
        print(json.dumps(run_config(Config(**json.loads(args.one)), variants, args)))
        return 0
    budget = args.budget if args.budget is not None else (3600.0 if args.full else 300.0)
    configs = parse_configs(args.configs) if args.configs else sweep(args.full)
    began = time.perf_counter()
    gflops: float | None = None  # measured skip throughput, to predict the next config
    results: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for cfg in configs:
        left = budget - (time.perf_counter() - began)
        predicted = None if gflops is None else predict_seconds(cfg, variants, args.repeats, gflops)
        if predicted is not None and predicted > left:
            skipped.append({**asdict(cfg), "predicted_s": round(predicted, 1)})
            continue
        result = run_isolated(cfg, args, left) if args.isolate else run_config(cfg, variants, args)
        skip_seconds = result.get("seconds", {}).get("skip")
        if skip_seconds:
            gflops = cfg.gflop / max(skip_seconds, 1e-9)
            result["skip_gflops"] = round(gflops, 2)
        results.append(result)
        print(json.dumps(result), file=sys.stderr, flush=True)
    failures = [f for result in results for f in result.get("failures", [])]
    document = {
        "device": benchmark_device(),
        "sweep": "configs" if args.configs else ("full" if args.full else "quick"),
        "isolated": args.isolate,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "row_tile": ROW_TILE,
        "budget_s": budget,
        "elapsed_s": round(time.perf_counter() - began, 1),
        "failures": failures,
        "results": results,
        "skipped": skipped,
    }
    print(json.dumps(document, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
