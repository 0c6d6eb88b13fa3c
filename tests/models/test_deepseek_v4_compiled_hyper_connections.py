"""The compiled (fused) hyper-connections compute what the ops do, up to the order of
the few float32 terms of each sum, and only small forwards compile. On CUDA the
forward runs the hyper-connection kernel instead (``mlxserve.kernels.
hyper_connection``), whose float32 sums differ from the GPU's matmuls by more."""

import mlx.core as mx
import pytest

from mlxserve.hardware.tuning import default_tuning
from mlxserve.kernels import hyper_connection as hc_kernel
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
    tolerance = 1e-3 if hc_kernel.available() else 1e-5
    assert mx.allclose(ops, compiled, rtol=tolerance, atol=tolerance)


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
    # On CUDA the kernel enters and leaves-then-enters; the last exit is compiled.
    assert set(calls) == (
        {"leave_post"} if hc_kernel.available() else {"collapse", "comb", "leave"}
    )


def test_a_disagreeing_compilation_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    real = hyper_connections._compiled

    def off_by_one(name: str, *constants: object) -> object:
        """A stand-in compilation whose every output is 1 off."""
        fused = real(name, *constants)
        return lambda *arrays: fused(*arrays) + 1.0

    for name in ("collapse", "comb", "leave", "leave_post"):
        hyper_connections.compiled_agrees.cache_clear()
        monkeypatch.setattr(
            hyper_connections,
            "_compiled",
            lambda which, *c, name=name: (
                off_by_one(which, *c) if which == name else real(which, *c)
            ),
        )
        try:
            assert not hyper_connections.compiled_agrees(CONSTANTS), name
        finally:
            hyper_connections.compiled_agrees.cache_clear()
