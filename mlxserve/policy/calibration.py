"""Calibration records: MoE variants timed on one device, and the verdict rules read.

`mlxserve policy calibrate` times every variant at a model's expert shapes and
writes a `CalibrationRecord`. The policy never reads raw timings: it reads the
record's `Verdict` (the fastest variant that ran everywhere and matched the stock
path), which is small enough to travel between ranks and is identical on every
rank that sees the same record, so plans keep agreeing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

STOCK = "skip"
"""The stock call (mlx-lm's own sorted ``gather_qmm``): the baseline every variant is
checked against."""

MIN_GAIN = 1.05
"""A variant other than the stock one wins only when it is this much faster (geometric
mean over the measured shapes), so timing noise never swaps the stock path out."""

ERROR_CHARS = 240
"""Longest error text a verdict carries (the record keeps the whole text)."""

MAX_REL_DIFF = 1e-2
"""Largest difference to the stock output, relative to its largest magnitude, for a
variant to count as computing the same thing (different tilings round differently)."""


class VariantTiming(BaseModel):
    """One variant at one shape: its median time, or the error it raised."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    variant: str
    seconds: float | None = None
    max_abs_diff: float | None = None
    error: str | None = None


class ShapeTiming(BaseModel):
    """Every variant at one MoE shape (a prefill chunk or a decode step)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["prefill", "decode"]
    tokens: int
    experts: int
    top_k: int
    in_dims: int
    out_dims: int
    bits: int
    group_size: int
    mode: str
    reference_max_abs: float | None = None
    results: list[VariantTiming]

    def label(self) -> str:
        return (
            f"{self.tokens} tokens x {self.experts} experts x top-{self.top_k} "
            f"(K {self.in_dims}, N {self.out_dims})"
        )

    def result(self, variant: str) -> VariantTiming | None:
        return next((r for r in self.results if r.variant == variant), None)


class Verdict(BaseModel):
    """What a calibration says the policy should run, and the numbers behind it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    chip: str
    device_type: str
    mlx_version: str
    calibrated_on: str
    """The record's date (YYYY-MM-DD), for reasons and staleness warnings."""
    variant: str
    """The fastest variant that ran at every shape and matched the stock output."""
    chunk: int
    """Prefill tokens of the shape the ratio is quoted at (the engine's chunk)."""
    baseline: str | None
    """The variant the ratio compares with (``skip``, or the runner-up when ``skip`` won)."""
    ratio: float | None
    """``baseline``'s time over ``variant``'s at ``chunk`` (>1: ``variant`` is faster)."""
    failed: dict[str, str] = Field(default_factory=dict)
    """Variants never chosen, with the first failure each met (shape and error)."""

    def reason(self, value: str) -> str:
        """Why the speed rule chose ``value`` on a rank this verdict applies to."""
        when = f"on this device (calibrated {self.calibrated_on})"
        if self.baseline is None or self.ratio is None:
            text = f"{value}: the only variant that ran and matched the stock output {when}"
        elif self.variant == STOCK:
            text = (
                f"{value}: the stock kernel measured fastest; {self.baseline} took "
                f"{self.ratio:.2f}x its time at {self.chunk}-token chunks {when}"
            )
        else:
            text = (
                f"{value}: {self.ratio:.1f}x faster than {self.baseline} at "
                f"{self.chunk}-token chunks {when}"
            )
        failures = "; ".join(f"{name} failed: {error}" for name, error in self.failed.items())
        return f"{text}; {failures}" if failures else text


class CalibrationRecord(BaseModel):
    """One run of `mlxserve policy calibrate` on one device."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = 1
    created_at: str
    """UTC time, ISO 8601."""
    device_type: str
    chip: str
    mlx_version: str
    model: str
    dtype: str
    repeats: int
    clock: str = "wall"
    """``wall``, or ``process`` (this process's CPU time, on a CPU device)."""
    shapes: list[ShapeTiming]
    skipped: list[str] = Field(default_factory=list)
    """Shapes left out to stay within the time budget."""

    def verdict(self) -> Verdict | None:
        """The speed rule's input, or None when no variant is safe to choose."""
        return choose(self)


def _first_failure(record: CalibrationRecord, variant: str) -> str | None:
    """Why ``variant`` may not be chosen: an error, or output that differs from stock."""
    for shape in record.shapes:
        result = shape.result(variant)
        if result is None:
            return f"not measured at {shape.label()}"
        if result.error is not None:
            return f"{shape.label()}: {result.error}"
        stock = shape.result(STOCK)
        if variant == STOCK or stock is None or stock.error is not None:
            continue
        scale = max(shape.reference_max_abs or 0.0, 1e-6)
        if result.max_abs_diff is None or not result.max_abs_diff <= MAX_REL_DIFF * scale:
            diff = result.max_abs_diff
            return f"{shape.label()}: output differs from {STOCK} (max abs diff {diff})"
    return None


def _time(variant: str, shape: ShapeTiming) -> float:
    result = shape.result(variant)
    assert result is not None and result.seconds is not None
    return max(result.seconds, 1e-9)


def choose(record: CalibrationRecord) -> Verdict | None:
    """The fastest safe variant of ``record`` (see `MIN_GAIN`), or None when none is safe."""
    if not record.shapes:
        return None
    names = sorted({r.variant for shape in record.shapes for r in shape.results})
    failed = {
        name: why[:ERROR_CHARS]
        for name in names
        if (why := _first_failure(record, name)) is not None
    }
    safe = [name for name in names if name not in failed]
    if not safe:
        return None
    prefill = [s for s in record.shapes if s.kind == "prefill"] or record.shapes
    quoted = min(prefill, key=lambda s: s.tokens)

    def verdict(variant: str, baseline: str | None, ratio: float | None) -> Verdict:
        return Verdict(
            chip=record.chip,
            device_type=record.device_type,
            mlx_version=record.mlx_version,
            calibrated_on=record.created_at[:10],
            variant=variant,
            chunk=quoted.tokens,
            baseline=baseline,
            ratio=None if ratio is None else round(ratio, 3),
            failed=failed,
        )

    if STOCK not in safe:
        # Without a stock time there is nothing to compare with: the fastest by total time.
        best = min(safe, key=lambda n: sum(_time(n, s) for s in record.shapes))
        return verdict(best, None, None)

    def score(name: str) -> float:
        """Geometric mean of the variant's time over stock's, across the shapes."""
        logs = [math.log(_time(name, s) / _time(STOCK, s)) for s in record.shapes]
        return math.exp(sum(logs) / len(logs))

    others = sorted((n for n in safe if n != STOCK), key=lambda n: (score(n), n))
    if others and score(others[0]) <= 1 / MIN_GAIN:
        best = others[0]
        ratio = _time(STOCK, quoted) / _time(best, quoted)
        return verdict(best, STOCK, ratio)
    if not others:
        return verdict(STOCK, None, None)
    runner = others[0]
    ratio = _time(runner, quoted) / _time(STOCK, quoted)
    return verdict(STOCK, runner, ratio)


def verdict_for(
    chip: str, device_type: str, mlx_version: str, verdicts: Sequence[Verdict]
) -> tuple[Verdict | None, Verdict | None]:
    """(the verdict for a rank of this chip and mlx, a stale one to warn about).

    A verdict applies to every rank of the same chip, device and mlx version, so
    calibrating one rank covers its twins. One from another mlx version measured
    different kernels: it is returned only as stale, for a warning.
    """
    same_device = [v for v in verdicts if v.chip == chip and v.device_type == device_type]
    newest_first = sorted(same_device, key=lambda v: (v.calibrated_on, v.mlx_version), reverse=True)
    fresh = next((v for v in newest_first if v.mlx_version == mlx_version), None)
    if fresh is not None:
        return fresh, None
    return None, newest_first[0] if newest_first else None


def merge_verdicts(per_rank: Sequence[Sequence[Verdict]]) -> list[Verdict]:
    """Every rank's verdicts, merged: one rank's record covers its twins.

    For each (chip, device, mlx version) the newest verdict wins, and the result is
    sorted, so every rank plans with the same list.
    """
    merged: dict[tuple[str, str, str], Verdict] = {}
    for verdicts in per_rank:
        for verdict in verdicts:
            key = (verdict.chip, verdict.device_type, verdict.mlx_version)
            known = merged.get(key)
            if known is None or _newer(verdict, known):
                merged[key] = verdict
    return [merged[key] for key in sorted(merged)]


def _newer(a: Verdict, b: Verdict) -> bool:
    return (a.calibrated_on, a.model_dump_json()) > (b.calibrated_on, b.model_dump_json())
