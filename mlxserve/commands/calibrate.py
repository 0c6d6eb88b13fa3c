"""`mlxserve policy calibrate`: time the MoE variants on this device, write a record.

For every expert shape of the model (read from its weights, loaded lazily: nothing
is materialised) it times each variant at the engine's prefill chunk sizes and at
one decode step, checks each output against the stock call, and writes one
`CalibrationRecord` to the state directory. The speed rule
(`policies/moe_speed.toml`) reads it at the next plan.

The record is written only when every shape is done (or left out to stay within the
budget): Ctrl-C leaves the previous record as it was.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from mlxserve.config import Settings, state_dir
from mlxserve.errors import UsageError
from mlxserve.kernels.timing import ExpertShape
from mlxserve.policy.calibration import CalibrationRecord, ShapeTiming, VariantTiming

EXIT_INTERRUPTED = 130
TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_top_k", "top_k")


def model_expert_shapes(model_name: str) -> tuple[list[ExpertShape], str]:
    """`expert_shapes` of a model directory (or ``demo``), loaded lazily: no weight is read."""
    from mlxserve.models.loader import load_model

    if model_name == "demo":
        from mlxserve.models.demo import build_demo_model

        path: Any = build_demo_model(progress=False)
    else:
        path = model_name
    model, config = load_model(path, lazy=True)
    return expert_shapes(model, config.get("text_config", config), model_name)


def expert_shapes(model: Any, config: dict[str, Any], name: str) -> tuple[list[ExpertShape], str]:
    """The distinct routed-expert shapes of ``model`` and the float dtype its activations
    run in (that of its affine scales, else bfloat16). `UsageError` when it has none."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU

    top_k = next((int(config[k]) for k in TOP_K_KEYS if k in config), None)
    shapes = set()
    dtypes = set()
    for _, module in model.named_modules():
        gate = getattr(module, "gate_proj", None)
        if not isinstance(module, SwitchGLU) or not isinstance(gate, QuantizedSwitchLinear):
            continue
        if top_k is None:
            raise UsageError(f"model {name!r}: config.json names no experts per token")
        experts, out_dims, words = (int(d) for d in gate["weight"].shape)
        bits = int(gate.bits)
        if str(gate.mode) == "affine":
            dtypes.add(str(gate["scales"].dtype).removeprefix("mlx.core."))
        shapes.add(
            ExpertShape(
                experts=experts,
                top_k=top_k,
                in_dims=words * 32 // bits,
                out_dims=out_dims,
                bits=bits,
                group_size=int(gate.group_size),
                mode=str(gate.mode),
            )
        )
    if not shapes:
        raise UsageError(
            f"model {name!r} has no quantized MoE layers (SwitchGLU with quantized "
            "experts): nothing to calibrate"
        )
    ordered = sorted(shapes, key=lambda s: (s.experts, s.in_dims, s.out_dims, s.bits))
    return ordered, dtypes.pop() if len(dtypes) == 1 else "bfloat16"


def calibrate(
    shapes: Sequence[ExpertShape],
    chunks: Sequence[int],
    decode_tokens: int,
    *,
    device: dict[str, str],
    model: str,
    dtype_name: str,
    repeats: int,
    budget_s: float,
    clock: Callable[[], float] | None = None,
    step: Callable[[], None] = lambda: None,
) -> CalibrationRecord:
    """Time every variant at every (shape, chunk) and at one decode step per shape.

    Shapes are measured smallest first; once ``budget_s`` is spent the rest are
    listed as skipped (the smallest prefill chunk of every shape always runs).
    The default clock is wall time on a GPU and this process's CPU time on a CPU
    device, where MLX computes in the process's own threads and the wall clock
    also counts whatever else the machine runs.
    """
    import mlx.core as mx

    from mlxserve.hardware.clock import cost_clock

    if clock is None:
        clock = cost_clock()
        clock_name = "process" if clock is time.process_time else "wall"
    else:
        clock_name = "given"

    from mlxserve.kernels.timing import (
        random_routing,
        random_switch_glu,
        time_variants,
        variant_classes,
    )

    dtype = getattr(mx, dtype_name)
    variants = variant_classes()
    budget_clock = time.perf_counter
    began = budget_clock()
    timings: list[ShapeTiming] = []
    skipped: list[str] = []
    smallest = min(chunks)
    for index, shape in enumerate(shapes):
        block = random_switch_glu(shape, dtype, seed=index)
        plan = [("prefill", smallest), ("decode", decode_tokens)]
        plan += [("prefill", c) for c in sorted(set(chunks)) if c != smallest]
        for kind, tokens in plan:
            label = f"{kind} {tokens} tokens x {shape.experts} experts (K {shape.in_dims})"
            if tokens != smallest and budget_clock() - began > budget_s:
                skipped.append(label)
                for _ in range(len(variants) * (repeats + 1)):
                    step()
                continue
            x = mx.random.normal((1, tokens, shape.in_dims), key=mx.random.key(tokens))
            indices = random_routing(tokens, shape, seed=tokens + 1)
            mx.eval(x, indices)
            scale, results = time_variants(
                block, x.astype(dtype), indices, variants, repeats, clock=clock, step=step
            )
            timings.append(
                ShapeTiming(
                    kind="prefill" if kind == "prefill" else "decode",
                    tokens=tokens,
                    experts=shape.experts,
                    top_k=shape.top_k,
                    in_dims=shape.in_dims,
                    out_dims=shape.out_dims,
                    bits=shape.bits,
                    group_size=shape.group_size,
                    mode=shape.mode,
                    reference_max_abs=scale,
                    results=[
                        VariantTiming(
                            variant=r.variant,
                            seconds=r.seconds,
                            max_abs_diff=r.max_abs_diff,
                            error=r.error,
                        )
                        for r in results
                    ],
                )
            )
        del block
    return CalibrationRecord(
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        device_type=device["device_type"],
        chip=device["chip"],
        mlx_version=device["mlx_version"],
        model=model,
        dtype=dtype_name,
        repeats=repeats,
        clock=clock_name,
        shapes=timings,
        skipped=skipped,
    )


def engine_chunks(settings: Settings, shapes: Sequence[ExpertShape]) -> list[int]:
    """The prefill chunks the engine would run: the configured step, and the plan's raise."""
    from mlxserve.startup.plan import build_plan

    plan, _ = build_plan(settings)
    chunks = {settings.engine.prefill_step}
    for shape in shapes:
        chunks.add(plan.prefill_step_size(settings.engine.prefill_step, shape.experts, shape.top_k))
    return sorted(chunks)


def run_calibrate(
    settings: Settings,
    *,
    chunks: Sequence[int] = (),
    repeats: int = 3,
    budget_s: float = 120.0,
    dtype: str = "auto",
    progress: bool = True,
) -> int:
    """The command: measure, write the record, print the verdict; exit 130 on Ctrl-C."""
    try:
        record = _measure(settings, chunks, repeats, budget_s, dtype, progress)
    except KeyboardInterrupt:
        print("mlxserve: calibration interrupted; no record written", file=sys.stderr)
        return EXIT_INTERRUPTED
    from mlxserve.policy.calibration_store import save_record

    path = save_record(state_dir(settings.server), record)
    verdict = record.verdict()
    print(f"calibration record: {path}")
    if verdict is None:
        print("no variant ran at every shape: the rules decide as before")
    else:
        print(f"fastest safe variant: {verdict.reason(verdict.variant)}")
    return 0


def _measure(
    settings: Settings,
    chunks: Sequence[int],
    repeats: int,
    budget_s: float,
    dtype: str,
    progress: bool,
) -> CalibrationRecord:
    from tqdm import tqdm  # type: ignore[import-untyped]

    from mlxserve.hardware.probe import probe_local

    shapes, model_dtype = model_expert_shapes(settings.model)
    sizes = sorted(set(chunks)) if chunks else engine_chunks(settings, shapes)
    profile = probe_local()
    device = {
        "device_type": profile.device_type,
        "chip": profile.chip,
        "mlx_version": profile.mlx_version,
    }
    runs = len(shapes) * (len(sizes) + 1) * 2 * (repeats + 1)
    with tqdm(total=runs, desc="Calibrating MoE variants", unit="run", disable=not progress) as bar:
        return calibrate(
            shapes,
            sizes,
            settings.engine.max_running,
            device=device,
            model=settings.model,
            dtype_name=model_dtype if dtype == "auto" else dtype,
            repeats=repeats,
            budget_s=budget_s,
            step=lambda: bar.update(1),
        )
