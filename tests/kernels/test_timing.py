"""Timing the variants: medians from the clock, failures recorded with variant and error."""

import itertools

import mlx.core as mx
import pytest
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from mlxserve.kernels.switch import FullComputeSwitchLinear
from mlxserve.kernels.timing import (
    ExpertShape,
    random_routing,
    random_switch_glu,
    time_variants,
)

SHAPE = ExpertShape(experts=8, top_k=2, in_dims=64, out_dims=32, bits=4, group_size=32)
CRASH = "cuGraphAddKernelNode(...) failed: invalid argument"


class CrashingSwitchLinear(QuantizedSwitchLinear):
    """What MLX CUDA did in issue 13: the forward raises at evaluation."""

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        raise RuntimeError(CRASH)


def _inputs(tokens: int = 64) -> tuple[mx.array, mx.array]:
    x = mx.random.normal((1, tokens, SHAPE.in_dims), key=mx.random.key(3))
    return x, random_routing(tokens, SHAPE)


def test_medians_come_from_the_clock_and_outputs_agree() -> None:
    ticks = itertools.count()
    block = random_switch_glu(SHAPE, mx.float32)
    x, indices = _inputs()
    steps: list[int] = []
    scale, results = time_variants(
        block,
        x,
        indices,
        {"skip": QuantizedSwitchLinear, "full": FullComputeSwitchLinear},
        repeats=3,
        clock=lambda: float(next(ticks)),  # every forward takes exactly one tick
        step=lambda: steps.append(1),
    )
    assert [(r.variant, r.seconds, r.max_abs_diff, r.error) for r in results] == [
        ("skip", 1.0, 0.0, None),
        ("full", 1.0, 0.0, None),
    ]
    assert scale is not None and scale > 0
    assert len(steps) == 2 * 4


def test_a_failing_variant_is_recorded_and_the_rest_go_on() -> None:
    block = random_switch_glu(SHAPE, mx.float32)
    x, indices = _inputs()
    _, results = time_variants(
        block,
        x,
        indices,
        {
            "skip": QuantizedSwitchLinear,
            "crash": CrashingSwitchLinear,
            "full": FullComputeSwitchLinear,
        },
        repeats=2,
    )
    by_name = {r.variant: r for r in results}
    assert by_name["crash"].error == f"RuntimeError: {CRASH}"
    assert by_name["crash"].seconds is None
    assert by_name["full"].seconds is not None and by_name["full"].max_abs_diff == 0.0


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        (ExpertShape(8, 2, 64, 32, 4, 32, mode="nvfp4"), "cannot build random nvfp4"),
        (ExpertShape(8, 2, 48, 32, 4, 32), "does not pack"),
    ],
)
def test_unbuildable_shapes_are_refused(shape: ExpertShape, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        random_switch_glu(shape, mx.float32)


def test_mxfp4_experts_run_both_variants() -> None:
    shape = ExpertShape(
        experts=8, top_k=2, in_dims=64, out_dims=64, bits=4, group_size=32, mode="mxfp4"
    )
    block = random_switch_glu(shape, mx.bfloat16)
    x = mx.random.normal((1, 64, 64)).astype(mx.bfloat16)
    _, results = time_variants(
        block,
        x,
        random_routing(64, shape),
        {"skip": QuantizedSwitchLinear, "full": FullComputeSwitchLinear},
        repeats=1,
    )
    assert all(r.error is None and r.max_abs_diff == 0.0 for r in results)
