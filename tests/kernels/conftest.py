"""Shared pieces for the kernel tests: random quantized experts, routings, tiny models."""

from collections.abc import Callable, Iterator

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.nn.layers.base import Module
from mlx_lm.models import mixtral, qwen3_moe

from mlxserve.kernels.moe import QuantizedExperts
from mlxserve.kernels.tiles import forget_tiles
from tests.policy.conftest import PlanFor, plan_for

__all__ = ["PlanFor", "plan_for"]

GatherCall = dict[str, object]


def make_experts(
    num_experts: int,
    in_dims: int,
    out_dims: int,
    *,
    group_size: int = 64,
    bits: int = 4,
    mode: str = "affine",
    dtype: mx.Dtype = mx.float32,
    seed: int = 0,
) -> QuantizedExperts:
    """Random experts quantized the way mlx-lm's ``QuantizedSwitchLinear`` stores them."""
    key = mx.random.key(seed)
    weight = mx.random.normal((num_experts, out_dims, in_dims), key=key) / in_dims**0.5
    weight, scales, *rest = mx.quantize(weight, group_size, bits, mode=mode)
    biases = rest[0].astype(dtype) if rest else None
    if mode == "affine":
        scales = scales.astype(dtype)
    return QuantizedExperts(weight, scales, biases, group_size, bits, mode)


def route(tokens: int, num_experts: int, top_k: int, *, seed: int = 0) -> mx.array:
    """Distinct top-k experts per token, as a router's argpartition gives them (uint32)."""
    logits = mx.random.normal((tokens, num_experts), key=mx.random.key(seed + 1))
    return mx.argpartition(-logits, top_k - 1, axis=-1)[:, :top_k].astype(mx.uint32)


def sort_rows(x: mx.array, indices: mx.array) -> tuple[mx.array, mx.array]:
    """mlx-lm's ``_gather_sort``: ``x`` [T, K] and ``indices`` [T, k] to sorted rows [R, 1, K]."""
    top_k = indices.shape[-1]
    flat = indices.flatten()
    order = mx.argsort(flat)
    return mx.expand_dims(x, -2)[order // top_k], flat[order]


@pytest.fixture(autouse=True)
def _fresh_tiles() -> Iterator[None]:
    forget_tiles()
    yield
    forget_tiles()


@pytest.fixture
def gather_calls(monkeypatch: pytest.MonkeyPatch) -> list[GatherCall]:
    """Every ``mx.gather_qmm`` call's keyword arguments, recorded on the way through.

    mlx-lm's layer and mlxserve's kernels call ``mx.gather_qmm`` through the module
    attribute, so wrapping ``mlx.core.gather_qmm`` sees all of them.
    """
    calls: list[GatherCall] = []
    real: Callable[..., mx.array] = mx.gather_qmm

    def recording(*args: object, **kwargs: object) -> mx.array:
        calls.append(dict(kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(mx, "gather_qmm", recording)
    return calls


def qwen3_moe_model(*, group_size: int = 32, bits: int = 4, seed: int = 0) -> Module:
    """A two-layer quantized Qwen3-MoE (``SwitchGLU``), 16 experts, top-4."""
    args = qwen3_moe.ModelArgs(
        model_type="qwen3_moe",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_experts=16,
        num_experts_per_tok=4,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        moe_intermediate_size=64,
        rms_norm_eps=1e-6,
        vocab_size=128,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        max_position_embeddings=512,
        norm_topk_prob=True,
    )
    mx.random.seed(seed)
    return _quantized(qwen3_moe.Model(args), group_size, bits)


def mixtral_model(*, group_size: int = 64, bits: int = 8, seed: int = 0) -> Module:
    """A two-layer quantized Mixtral (``SwitchGLU``), 8 experts, top-2."""
    args = mixtral.ModelArgs(
        model_type="mixtral",
        vocab_size=128,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_experts_per_tok=2,
        num_key_value_heads=2,
        num_local_experts=8,
    )
    mx.random.seed(seed)
    return _quantized(mixtral.Model(args), group_size, bits)


def _quantized(model: Module, group_size: int, bits: int) -> Module:
    nn.quantize(model, group_size=group_size, bits=bits)
    mx.eval(model.parameters())
    return model
