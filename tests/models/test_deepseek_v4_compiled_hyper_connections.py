"""The compiled (fused) hyper-connections compute what the ops do, up to the order of
the few float32 terms of each sum, and only small forwards compile."""

import mlx.core as mx
import pytest

from mlxserve.hardware.tuning import default_tuning
from mlxserve.models.deepseek_v4 import hyper_connections
from tests.engine.v4_models import tiny_v4

CONSTANTS = hyper_connections.MixConstants(hc=4, norm_eps=1e-6, hc_eps=1e-6)


def _forward(compiled: bool, length: int) -> mx.array:
    model = tiny_v4(seed=5)
    if not compiled:
        model.tune(default_tuning().replace(compiled_hc_max_rows=0))
    cache = model.make_cache(4)
    model.forward_hidden(mx.array([[(3 * i + 1) % 61 for i in range(17)]]), cache)
    out = model.forward_hidden(mx.array([[(5 * i + 2) % 61 for i in range(length)]]), cache)
    mx.eval(out)
    return out


@pytest.mark.parametrize("length", [1, 3])
def test_a_compiled_forward_equals_the_ops(length: int) -> None:
    assert hyper_connections.compiled_agrees(CONSTANTS)
    ops = _forward(False, length)
    compiled = _forward(True, length)
    assert mx.allclose(ops, compiled, rtol=1e-5, atol=1e-5)


def test_only_small_forwards_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = hyper_connections._compiled

    def spy(name: str, *constants: object) -> object:
        calls.append(name)
        return real(name, *constants)

    monkeypatch.setattr(hyper_connections, "_compiled", spy)
    model = tiny_v4(seed=5)
    model.tune(default_tuning().replace(compiled_hc_max_rows=4))
    cache = model.make_cache(4)
    model.forward_hidden(mx.array([list(range(1, 9))]), cache)  # 8 rows: the ops
    assert calls == []
    model.forward_hidden(mx.array([[3]]), cache)  # one row: compiled
    assert set(calls) == {"enter", "leave"}


def test_a_disagreeing_compilation_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    def off_by_one(name: str, *constants: object) -> object:
        """A stand-in compilation whose every output is 1 off."""

        def enter(
            streams: mx.array, fn: mx.array, scale: mx.array, base: mx.array
        ) -> tuple[mx.array, ...]:
            outs = hyper_connections._fused_enter(streams, fn, scale, base, CONSTANTS)
            return tuple(out + 1.0 for out in outs)

        def leave(out: mx.array, streams: mx.array, post: mx.array, comb: mx.array) -> mx.array:
            return hyper_connections._fused_leave(out, streams, post, comb) + 1.0

        return enter if name == "enter" else leave

    hyper_connections.compiled_agrees.cache_clear()
    monkeypatch.setattr(hyper_connections, "_compiled", off_by_one)
    try:
        assert not hyper_connections.compiled_agrees(CONSTANTS)
    finally:
        hyper_connections.compiled_agrees.cache_clear()
