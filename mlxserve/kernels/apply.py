"""Apply a plan's ``nax_moe`` decision to a loaded model, per rank.

Works on any mlx-lm MoE model (and mlxserve's own): it looks for
``QuantizedSwitchLinear`` leaves wherever they sit (``SwitchGLU``, ``SwitchMLP``
or a custom container) and sets their class to the variant's (`switch`), so
weights are never copied, applying twice changes nothing, and applying ``skip``
or ``off`` after ``full`` restores the stock layer.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

from mlx.nn.layers.base import Module
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from mlxserve.policy.plan import Plan

from .moe import MOE_VARIANTS, MoeVariant
from .switch import SWAPPABLE, VARIANT_CLASSES
from .tiles import forget_tiles

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SwapResult:
    """What `swap_switch_layers` found and changed."""

    layers: int
    """Quantized switch layers that now run the variant."""
    swapped: int
    """Of those, how many changed class in this call (0 when applied again)."""
    unsupported: tuple[str, ...]
    """Paths of ``QuantizedSwitchLinear`` subclasses left alone (own ``__call__``)."""


@dataclass(frozen=True)
class MoePolicyReport:
    """What `apply_moe_policy` did on one rank, for logs and ``GET /v1/policy``."""

    rank: int
    variant: MoeVariant
    rule: str
    reason: str
    layer_class: str
    layers: int
    swapped: int
    unsupported: tuple[str, ...] = ()

    @property
    def unchanged(self) -> int:
        """Layers that already ran the variant."""
        return self.layers - self.swapped

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "unsupported": list(self.unsupported)}


def parse_variant(value: object) -> MoeVariant:
    """``value`` as a variant name, or ValueError naming the allowed ones."""
    if isinstance(value, str) and value in MOE_VARIANTS:
        return value
    raise ValueError(f"nax_moe must be one of {', '.join(MOE_VARIANTS)}, not {value!r}")


def swap_switch_layers(model: Module, variant: MoeVariant) -> SwapResult:
    """Give every stock or variant ``QuantizedSwitchLinear`` in ``model`` the variant's class."""
    target = VARIANT_CLASSES[variant]
    layers = swapped = 0
    unsupported: list[str] = []
    for name, module in model.named_modules():  # type: ignore[no-untyped-call]
        if not isinstance(module, QuantizedSwitchLinear):
            continue
        if type(module) not in SWAPPABLE:
            unsupported.append(name)
            continue
        layers += 1
        if type(module) is not target:
            module.__class__ = target
            swapped += 1
            logger.debug("%s: %s", name, target.__name__)
    if target is not VARIANT_CLASSES["full"]:
        forget_tiles()
    return SwapResult(layers, swapped, tuple(unsupported))


def apply_moe_policy(model: Module, plan: Plan, rank: int) -> MoePolicyReport:
    """Run the variant ``plan`` chose for ``rank`` in every quantized switch layer."""
    if not 0 <= rank < len(plan.ranks):
        raise ValueError(f"rank {rank} is not in a plan for {len(plan.ranks)} ranks")
    decision = plan.ranks[rank].decisions["nax_moe"]
    variant = parse_variant(plan.nax_moe(rank))
    result = swap_switch_layers(model, variant)
    report = MoePolicyReport(
        rank=rank,
        variant=variant,
        rule=decision.rule,
        reason=decision.reason,
        layer_class=VARIANT_CLASSES[variant].__name__,
        layers=result.layers,
        swapped=result.swapped,
        unsupported=result.unsupported,
    )
    logger.info(
        "rank %d: nax_moe=%s (rule %s): %d quantized switch layers run %s, %d swapped",
        rank,
        variant,
        decision.rule,
        report.layers,
        report.layer_class,
        report.swapped,
    )
    if report.unsupported:
        logger.warning(
            "rank %d: %d quantized switch layers have their own class and were left alone "
            "(they may still dispatch the sorted kernel): %s",
            rank,
            len(report.unsupported),
            ", ".join(report.unsupported),
        )
    return report
