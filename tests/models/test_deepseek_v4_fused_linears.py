"""Projections of one input concatenated into one matmul (``fused_linears.py``): the
same outputs as the layers' own calls, nothing held twice, and a layer whose arrays
were replaced since is noticed."""

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.nn.layers.linear import Linear

from mlxserve.hardware.tuning import default_tuning
from mlxserve.models.deepseek_v4.fused_linears import FusedLinears, fused
from tests.engine.v4_models import tiny_v4


def _layers() -> list[Module]:
    """Two float layers, two quantised ones (mxfp8 and 4-bit affine: other kinds), one
    with a bias: two groups and two layers called on their own."""
    keys = iter(mx.random.split(mx.random.key(3), 8))
    made: list[Module] = []
    for rows, kind in ((32, "float"), (16, "float"), (8, "mxfp8"), (40, "mxfp8"), (24, "affine")):
        layer = Linear(64, rows, bias=False)
        layer.weight = mx.random.normal((rows, 64), key=next(keys))
        if kind == "mxfp8":
            made.append(layer.to_quantized(32, 8, mode="mxfp8"))
        elif kind == "affine":
            made.append(layer.to_quantized(32, 4))
        else:
            made.append(layer)
    biased = Linear(64, 12, bias=True)
    made.append(biased)
    return made


def test_one_matmul_per_kind_gives_each_layers_output() -> None:
    layers = _layers()
    x = mx.random.normal((3, 64), key=mx.random.key(9))
    theirs = [layer(x) for layer in layers]
    owner = Module()
    projections = fused(owner, "_in", layers)
    assert [len(indices) for indices, _ in projections.groups] == [2, 2]
    for ours, reference in zip(projections(x), theirs, strict=True):
        assert ours.shape == reference.shape
        assert mx.allclose(ours, reference, rtol=1e-5, atol=1e-5)
    # The layers now hold views of the concatenation: their own calls are unchanged.
    for layer, reference in zip(layers, theirs, strict=True):
        assert mx.allclose(layer(x), reference, rtol=1e-5, atol=1e-5)


def test_the_layers_hold_rows_of_the_concatenation_not_copies() -> None:
    first, second = _layers()[:2]
    group = FusedLinears([first, second])
    assert group.arrays["weight"].shape == (48, 64)
    assert mx.array_equal(group.arrays["weight"][:32], first.weight)
    assert mx.array_equal(group.arrays["weight"][32:], second.weight)
    assert group.fresh([first, second])


def test_a_replaced_weight_is_noticed_and_concatenated_again() -> None:
    layers = _layers()[:2]
    owner = Module()
    before = fused(owner, "_in", layers)
    assert fused(owner, "_in", layers) is before  # kept while nothing changed
    layers[0].weight = layers[0].weight * 2  # a load, say
    after = fused(owner, "_in", layers)
    assert after is not before
    x = mx.random.normal((2, 64), key=mx.random.key(4))
    assert mx.allclose(after(x)[0], x @ layers[0].weight.T, rtol=1e-5, atol=1e-5)


def test_layers_that_do_not_concatenate_are_called_on_their_own() -> None:
    layers = _layers()
    lone = [layers[0], layers[2], layers[4], layers[5]]  # one layer of each kind
    projections = fused(Module(), "_in", lone)
    assert projections.groups == []
    x = mx.random.normal((1, 64), key=mx.random.key(5))
    for ours, layer in zip(projections(x), lone, strict=True):
        assert mx.array_equal(ours, layer(x))


def test_the_plain_tuning_concatenates_nothing() -> None:
    """``compiled_decode_max_rows = 0`` runs the layers' own projections: no decode
    step makes a concatenation; the default tuning does."""

    def decode_step(knob: int) -> list[object]:
        model = tiny_v4(seed=4, hc_mult=4)
        model.tune(default_tuning().replace(compiled_decode_max_rows=knob))
        cache = model.make_cache()
        model(mx.array([list(range(1, 20))]), cache=cache)
        mx.eval(model(mx.array([[7]]), cache=cache))
        return [
            getattr(module, name, None)
            for layer in model.layers
            for module, name in ((layer.attn, "_decode_inputs"), (layer.ffn, "_shared_in"))
        ]

    assert all(made is None for made in decode_step(0))
    assert any(made is not None for made in decode_step(64))
