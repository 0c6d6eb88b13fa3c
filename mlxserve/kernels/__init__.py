"""MoE kernel variants for the ``nax_moe`` policy decision, and applying them to a model."""

from .apply import MoePolicyReport, SwapResult, apply_moe_policy, swap_switch_layers
from .moe import MOE_VARIANTS, MoeVariant, QuantizedExperts, full_matmul, skip_matmul
from .switch import FullComputeSwitchLinear

__all__ = [
    "MOE_VARIANTS",
    "FullComputeSwitchLinear",
    "MoePolicyReport",
    "MoeVariant",
    "QuantizedExperts",
    "SwapResult",
    "apply_moe_policy",
    "full_matmul",
    "skip_matmul",
    "swap_switch_layers",
]
