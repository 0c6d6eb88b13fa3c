"""The fused decode layers (``compiled_decode_max_rows``, ``compiled_hc_max_rows``)
against the plain ops: the same logits within 1e-3 and the same greedy tokens, one
row and three stacked rows, step after step past the compressors' windows and the
indexer's picks, with quantised experts and output groups as served, and through
speculative rounds; a fast path that disagrees steps aside."""

import logging
from typing import Any

import mlx.core as mx
import pytest
from mlx.nn.layers.quantized import quantize
from mlx_lm.models.switch_layers import SwitchLinear

from mlxserve.channel.request import GenerationParams
from mlxserve.engine.core.request import GenerationRequest
from mlxserve.engine.core.stepper import Engine, EngineConfig
from mlxserve.engine.spec.mtp import MTPAdapter
from mlxserve.hardware.tuning import default_tuning
from mlxserve.models.deepseek_v4 import Model, moe, rope
from mlxserve.models.deepseek_v4.cache import LayerCache
from tests.engine.drive import run
from tests.engine.v4_models import tiny_v4

FUSED = default_tuning().replace(compiled_decode_max_rows=64, compiled_hc_max_rows=64)
PLAIN = default_tuning().replace(compiled_decode_max_rows=0, compiled_hc_max_rows=0)
PROMPT = tuple((7 * i + 3) % 61 for i in range(30))


def served() -> Model:
    """The tiny model with hc 4, its experts quantised to 4 bits and ``wo_a`` to MXFP8,
    as a published checkpoint is served."""
    model = tiny_v4(seed=3, hidden_size=64, moe_intermediate_size=32, hc_mult=4)
    quantize(
        model,
        32,
        4,
        class_predicate=lambda path, m: isinstance(m, SwitchLinear) and ".switch_mlp." in path,
    )
    quantize(model, 32, 8, mode="mxfp8", class_predicate=lambda path, _: path.endswith("wo_a"))
    mx.eval(model.parameters())  # type: ignore[no-untyped-call]
    return model


@pytest.fixture(scope="module")
def model() -> Model:
    return served()


def decode(model: Model, rows: int, steps: int) -> tuple[list[mx.array], list[list[int]]]:
    """Greedy decoding of `rows` rows (stacked when several) from prompts of different
    lengths: each step's logits and each row's tokens."""
    caches = []
    tokens = []
    for row in range(rows):
        cache = model.make_cache()
        prompt = mx.array([[(5 * i + 3 * row + 1) % 61 for i in range(13 + 6 * row)]])
        logits = model(prompt, cache=cache)
        tokens.append([int(mx.argmax(logits[0, -1]))])
        caches.append(cache)
    stacked: list[Any] = caches[0]
    if rows > 1:
        stacked = [LayerCache.stack([c[i] for c in caches]) for i in range(len(model.layers))]
    steps_logits = []
    for _ in range(steps):
        feed = mx.array([[t[-1]] for t in tokens])
        logits = model(feed, cache=stacked)[:, -1]
        mx.eval(logits)
        steps_logits.append(logits)
        choices: list[int] = mx.argmax(logits, axis=-1).tolist()  # type: ignore[assignment]
        for row, choice in enumerate(choices):
            tokens[row].append(choice)
    return steps_logits, tokens


@pytest.mark.parametrize("rows", [1, 3])
def test_fused_decode_equals_the_ops(model: Model, rows: int) -> None:
    model.tune(PLAIN)
    plain_logits, plain_tokens = decode(model, rows, 12)
    model.tune(FUSED)
    fused_logits, fused_tokens = decode(model, rows, 12)
    assert fused_tokens == plain_tokens
    for ours, theirs in zip(fused_logits, plain_logits, strict=True):
        assert float(mx.abs(ours - theirs).max()) <= 1e-3


def test_speculative_rounds_fused_equal_the_ops(model: Model) -> None:
    outputs = []
    for tuning in (PLAIN, FUSED):
        config = EngineConfig(prefill_step=16, speculative_depth=2, tuning=tuning)
        engine = Engine(MTPAdapter(model), config)
        tokens, _ = run(engine, GenerationRequest("r", GenerationParams(PROMPT, 10)))["r"]
        outputs.append(tokens)
    assert outputs[0] == outputs[1]


def test_a_fused_block_that_disagrees_steps_aside(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = moe._compiled

    def off(name: str, *constants: object, **named: object) -> object:
        fused = real(name, *constants, **named)
        if name != "mixed":
            return fused
        return lambda *arrays: fused(*arrays) + 1.0

    moe.fused_agrees.cache_clear()
    monkeypatch.setattr(moe, "_compiled", off)
    try:
        with caplog.at_level(logging.WARNING):
            assert not moe.fused_agrees(10.0)
        assert "differs" in caplog.text
        block = served().layers[1].ffn
        x = mx.random.normal((2, 1, 64), key=mx.random.key(0))
        # The block steps aside: its output is the plain ops' exactly.
        assert mx.array_equal(block(x, mx.array([[1], [2]])), block.plain(x, mx.array([[1], [2]])))
    finally:
        moe.fused_agrees.cache_clear()


def test_one_kernel_rope_equals_the_sliced_rotation() -> None:
    assert rope.whole_head_agrees(16, 4)
    rotary = rope.PartialRoPE({"rope_type": "default", "rope_theta": 10000.0}, 4, 64)
    x = mx.random.normal((2, 3, 5, 16), key=mx.random.key(1))
    offsets = mx.array([2, 40])
    for inverse in (False, True):
        ours = rotary(x, offset=offsets, inverse=inverse)
        freqs = -rotary._wavelengths if inverse else rotary._wavelengths
        theirs = rope._sliced(x, 4, offsets, 1.0, freqs)
        assert mx.array_equal(ours, theirs)


@pytest.mark.parametrize("shared", ["float", "mxfp8"])
@pytest.mark.parametrize("rows", [1, 3])
def test_the_compiled_decode_block_is_the_fused_blocks_ops(shared: str, rows: int) -> None:
    """A decode forward's MoE block as one compiled function (`moe._decode_block`)
    gives the op-by-op fused block's output exactly, routed and hashed, with the shared
    expert float or quantised; and it is the path a decode forward takes."""
    model = served()
    if shared == "mxfp8":
        quantize(
            model,
            32,
            8,
            mode="mxfp8",
            class_predicate=lambda p, m: ".shared_experts." in p and hasattr(m, "to_quantized"),
        )
        mx.eval(model.parameters())  # type: ignore[no-untyped-call]
    x = mx.random.normal((rows, 1, 64), key=mx.random.key(rows))
    tokens = mx.array([[3 + 7 * r] for r in range(rows)])
    kinds = set()
    for layer in model.layers:
        block = layer.ffn
        assert isinstance(block, moe.MoE)
        kinds.add(block.gate.hashed)
        assert block._decode_call(x.reshape(rows, 64), tokens) is not None
        block.compile_decode = True
        compiled = block.fused(x, tokens)
        block.compile_decode = False
        assert mx.array_equal(compiled, block.fused(x, tokens))
        assert float(mx.abs(compiled - block.plain(x, tokens)).max()) <= 1e-4
    assert kinds == {True, False}  # hash layers and routed ones
