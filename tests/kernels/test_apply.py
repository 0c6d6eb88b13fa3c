"""Applying a plan's ``nax_moe`` decision to whole mlx-lm models, per rank."""

import logging
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.nn.layers.base import Module
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from mlxserve.kernels.apply import (
    MoePolicyReport,
    apply_moe_policy,
    parse_variant,
    swap_switch_layers,
)
from mlxserve.kernels.switch import FullComputeSwitchLinear
from tests.kernels.conftest import GatherCall, PlanFor, mixtral_model, qwen3_moe_model, route

MIXED = "Apple M3 Ultra,Apple M5 Max"


def switch_classes(model: Module) -> set[type]:
    return {type(m) for _, m in model.named_modules() if isinstance(m, QuantizedSwitchLinear)}


def array_ids(model: Module) -> dict[str, int]:
    return {name: id(value) for name, value in tree_flatten(model.parameters())}


@pytest.mark.parametrize(
    ("build", "layers"),
    [(qwen3_moe_model, 2 * 3), (mixtral_model, 2 * 3)],
    ids=["qwen3_moe", "mixtral"],
)
def test_logits_same_for_every_variant(build: Callable[[], Module], layers: int) -> None:
    model = build()
    prompt = mx.random.randint(0, 128, (1, 48), key=mx.random.key(0))  # 48 x top-k >= 64: sorted
    step = prompt[:, :1]  # decode-sized: unsorted
    stock = model(prompt), model(step)
    weights = array_ids(model)
    for variant in ("full", "skip", "off", "full"):
        swap_switch_layers(model, variant)
        logits = model(prompt), model(step)
        for got, want in zip(logits, stock, strict=True):
            assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item(), variant
    assert array_ids(model) == weights  # no expert weight was copied or replaced
    assert switch_classes(model) == {FullComputeSwitchLinear}
    assert swap_switch_layers(model, "off").layers == layers


def test_counts_idempotence_and_reversal() -> None:
    model = qwen3_moe_model()
    first = swap_switch_layers(model, "full")
    assert (first.layers, first.swapped, first.unsupported) == (6, 6, ())
    again = swap_switch_layers(model, "full")
    assert (again.layers, again.swapped) == (6, 0)
    assert switch_classes(model) == {FullComputeSwitchLinear}
    back = swap_switch_layers(model, "skip")
    assert (back.layers, back.swapped) == (6, 6)
    assert switch_classes(model) == {QuantizedSwitchLinear}
    assert swap_switch_layers(model, "off").swapped == 0


class BareExperts(nn.Module):
    """A container that is not SwitchGLU: sorts itself and calls its leaves directly."""

    def __init__(self) -> None:
        super().__init__()
        self.first = QuantizedSwitchLinear(64, 64, 8, bias=False, group_size=32)
        self.second = QuantizedSwitchLinear(64, 64, 8, bias=True, group_size=32)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        order = mx.argsort(indices)
        rows = mx.expand_dims(x, -2)[order]
        h = self.first(rows, indices[order], sorted_indices=True)
        return self.second(nn.silu(h), indices[order], sorted_indices=True)[mx.argsort(order)]


class OwnSwitch(QuantizedSwitchLinear):
    """Someone's own subclass: it keeps its ``__call__`` and is reported, not swapped."""


def test_bare_leaves_and_unsupported_subclasses(
    plan_for: PlanFor, gather_calls: list[GatherCall], caplog: pytest.LogCaptureFixture
) -> None:
    mx.random.seed(1)
    model = nn.Sequential(BareExperts())
    model.layers.append(OwnSwitch(64, 64, 8, bias=False))
    x = mx.random.normal((96, 64))
    indices = route(96, 8, 1).flatten()
    stock = model.layers[0](x, indices)
    with caplog.at_level(logging.WARNING, logger="mlxserve.kernels.apply"):
        report = apply_moe_policy(model, plan_for(MIXED), 1)
    assert (report.layers, report.swapped, report.unsupported) == (2, 2, ("layers.1",))
    assert "left alone" in caplog.text
    assert "layers.1" in caplog.text
    gather_calls.clear()
    full = model.layers[0](x, indices)
    assert mx.allclose(full, stock, rtol=1e-5, atol=1e-5).item()
    assert [c["sorted_indices"] for c in gather_calls] == [False, False]
    assert type(model.layers[1]) is OwnSwitch


def test_plan_for_a_mixed_cluster(
    plan_for: PlanFor, gather_calls: list[GatherCall], caplog: pytest.LogCaptureFixture
) -> None:
    plan = plan_for(MIXED)
    assert [plan.nax_moe(r) for r in range(2)] == ["off", "full"]
    model = qwen3_moe_model()
    prompt = mx.random.randint(0, 128, (1, 48), key=mx.random.key(0))
    stock = model(prompt)

    with caplog.at_level(logging.INFO, logger="mlxserve.kernels.apply"):
        off = apply_moe_policy(model, plan, 0)
        full = apply_moe_policy(model, plan, 1)
    assert off == MoePolicyReport(
        rank=0,
        variant="off",
        rule="nax-moe-no-path",
        reason=plan.ranks[0].decisions["nax_moe"].reason,
        layer_class="QuantizedSwitchLinear",
        layers=6,
        swapped=0,
    )
    assert (full.variant, full.rule, full.layer_class) == (
        "full",
        "nax-moe-mixed-cluster-full",
        "FullComputeSwitchLinear",
    )
    assert (full.layers, full.swapped, full.unchanged) == (6, 6, 0)
    assert full.as_dict()["unsupported"] == []
    assert "rank 1: nax_moe=full (rule nax-moe-mixed-cluster-full)" in caplog.text
    assert any(c["sorted_indices"] for c in gather_calls)  # the stock forward sorted
    gather_calls.clear()
    assert mx.allclose(model(prompt), stock, rtol=1e-5, atol=1e-5).item()
    assert len(gather_calls) == 2 * 3
    assert not any(c["sorted_indices"] for c in gather_calls)

    again = apply_moe_policy(model, plan, 1)
    assert (again.swapped, again.unchanged) == (0, 6)
    skip = apply_moe_policy(model, plan_for(MIXED, nax_moe="skip"), 1)
    assert (skip.variant, skip.rule, skip.swapped) == ("skip", "override", 6)
    assert switch_classes(model) == {QuantizedSwitchLinear}


def test_homogeneous_nax_cluster_keeps_stock(plan_for: PlanFor) -> None:
    plan = plan_for("Apple M5 Max,Apple M5 Max")
    model = qwen3_moe_model()
    reports = [apply_moe_policy(model, plan, r) for r in range(2)]
    assert {(r.variant, r.swapped) for r in reports} == {("skip", 0)}


def test_bad_rank_and_variant(plan_for: PlanFor) -> None:
    plan = plan_for(MIXED)
    model = qwen3_moe_model()
    with pytest.raises(ValueError, match="rank 2"):
        apply_moe_policy(model, plan, 2)
    with pytest.raises(ValueError, match="nax_moe must be one of skip, full, off"):
        parse_variant("fast")
    assert parse_variant("full") == "full"


def test_dense_model_has_nothing_to_swap() -> None:
    model = nn.Sequential(nn.QuantizedLinear(64, 64))
    assert swap_switch_layers(model, "full").layers == 0
