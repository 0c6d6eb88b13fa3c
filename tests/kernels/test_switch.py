"""The full-compute layer inside mlx-lm's own containers (``SwitchGLU``, ``SwitchMLP``)."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.nn.layers.base import Module
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchMLP

from mlxserve.kernels import tiles as tiles_module
from mlxserve.kernels.switch import VARIANT_CLASSES, FullComputeSwitchLinear
from mlxserve.kernels.tiles import ExpertTiles
from tests.kernels.conftest import GatherCall, route

DIMS, HIDDEN, EXPERTS = 64, 96, 8


def quantized(block: Module) -> Module:
    nn.quantize(block, group_size=32, bits=4)
    mx.eval(block.parameters())
    return block


def set_class(block: Module, cls: type[QuantizedSwitchLinear]) -> None:
    for _, module in block.named_modules():
        if isinstance(module, QuantizedSwitchLinear):
            module.__class__ = cls


def test_variant_classes() -> None:
    assert VARIANT_CLASSES["full"] is FullComputeSwitchLinear
    assert VARIANT_CLASSES["skip"] is VARIANT_CLASSES["off"] is QuantizedSwitchLinear
    assert issubclass(FullComputeSwitchLinear, QuantizedSwitchLinear)


@pytest.mark.parametrize("tokens", [1, 7, 16, 100])
@pytest.mark.parametrize("kind", ["glu", "mlp_bias"])
def test_block_outputs_match(kind: str, tokens: int) -> None:
    mx.random.seed(tokens)
    block = quantized(
        SwitchGLU(DIMS, HIDDEN, EXPERTS)
        if kind == "glu"
        else SwitchMLP(DIMS, HIDDEN, EXPERTS, bias=True)
    )
    if kind == "mlp_bias":
        block.update({"fc1": {"bias": mx.random.normal((EXPERTS, HIDDEN))}})
    x = mx.random.normal((1, tokens, DIMS))
    indices = route(tokens, EXPERTS, 4).reshape(1, tokens, 4)
    stock = block(x, indices)
    set_class(block, FullComputeSwitchLinear)
    full = block(x, indices)
    assert full.shape == stock.shape == (1, tokens, 4, DIMS)
    assert mx.allclose(full, stock, rtol=1e-5, atol=1e-5).item()


def test_glu_never_sorted_and_one_layout_per_call(
    monkeypatch: pytest.MonkeyPatch, gather_calls: list[GatherCall]
) -> None:
    built: list[int] = []
    real = tiles_module.expert_tiles

    def counting(indices: mx.array, num_experts: int, tile_rows: int) -> ExpertTiles:
        built.append(indices.size)
        return real(indices, num_experts, tile_rows)

    monkeypatch.setattr(tiles_module, "expert_tiles", counting)
    block = quantized(SwitchGLU(DIMS, HIDDEN, EXPERTS))
    x = mx.random.normal((2, 32, DIMS))
    indices = route(64, EXPERTS, 2).reshape(2, 32, 2)

    mx.eval(block(x, indices))
    assert [c["sorted_indices"] for c in gather_calls] == [True] * 3
    gather_calls.clear()

    set_class(block, FullComputeSwitchLinear)
    mx.eval(block(x, indices))
    mx.eval(block(x[:, :1], indices[:, :1]))  # decode-sized: mlx-lm does not sort it
    assert [c["sorted_indices"] for c in gather_calls] == [False] * 6
    assert built == [128]  # gate, up and down shared one layout
