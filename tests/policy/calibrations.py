"""Recorded calibrations for policy tests: built from numbers, no timing involved."""

from pathlib import Path

from mlxserve.hardware.probe import package_version
from mlxserve.policy.calibration import CalibrationRecord, ShapeTiming, VariantTiming
from mlxserve.policy.calibration_store import save_record

# variant -> seconds, or an error text
Outcome = float | str


def shape(tokens: int, outcomes: dict[str, Outcome], kind: str = "prefill") -> ShapeTiming:
    results = [
        VariantTiming(variant=name, seconds=value, max_abs_diff=0.0)
        if isinstance(value, float)
        else VariantTiming(variant=name, error=value)
        for name, value in outcomes.items()
    ]
    return ShapeTiming(
        kind="prefill" if kind == "prefill" else "decode",
        tokens=tokens,
        experts=256,
        top_k=6,
        in_dims=4096,
        out_dims=2048,
        bits=4,
        group_size=32,
        mode="affine",
        reference_max_abs=1.0,
        results=results,
    )


def record(
    *shapes: ShapeTiming,
    chip: str = "Linux CPU",
    device_type: str = "cpu",
    mlx: str | None = None,
    created_at: str = "2026-12-01T10:00:00+00:00",
) -> CalibrationRecord:
    return CalibrationRecord(
        created_at=created_at,
        device_type=device_type,
        chip=chip,
        mlx_version=mlx or package_version("mlx"),
        model="test",
        dtype="bfloat16",
        repeats=3,
        shapes=list(shapes),
    )


def full_faster(**where: str) -> CalibrationRecord:
    """`full` 4.1x faster than `skip` at 512-token chunks, 2x at 2048, equal at decode."""
    return record(
        shape(512, {"skip": 0.041, "full": 0.01}),
        shape(8, {"skip": 0.001, "full": 0.001}, kind="decode"),
        shape(2048, {"skip": 0.08, "full": 0.04}),
        **where,
    )


def save(state_dir: Path, *records: CalibrationRecord) -> Path:
    for item in records:
        save_record(state_dir, item)
    return state_dir
