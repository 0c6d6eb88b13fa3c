"""DeepSeek-V4's norms keep their input's dtype (``deepseek_v4/norm.py``).

The reference (transformers' ``DeepseekV4RMSNorm``) holds float32 weights and casts
its result back to the input's dtype; MLX's ``nn.RMSNorm`` promotes to float32, which
made every activation of a bfloat16 checkpoint float32 after the first norm.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx.nn import quantize
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.switch_layers import SwitchLinear
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm

from mlxserve.models.deepseek_v4.norm import InputDtypeRMSNorm
from tests.engine.v4_models import tiny_v4


def _to_torch(a: mx.array) -> torch.Tensor:
    return torch.from_numpy(np.array(a.astype(mx.float32)))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_the_norm_is_the_reference_s_in_the_input_s_dtype(dtype: mx.Dtype) -> None:
    key_x, key_w = mx.random.split(mx.random.key(3))
    x = (mx.random.normal((2, 5, 256), key=key_x) * 3.0).astype(dtype)
    weight = 1.0 + 0.1 * mx.random.normal((256,), key=key_w)  # float32, as published
    norm = InputDtypeRMSNorm(256, eps=1e-6)
    norm.weight = weight
    ours = norm(x)
    assert ours.dtype == dtype

    torch_dtype = {mx.bfloat16: torch.bfloat16, mx.float16: torch.float16}.get(dtype, torch.float32)
    reference = DeepseekV4RMSNorm(256, eps=1e-6)
    with torch.no_grad():
        reference.weight.copy_(_to_torch(weight))
        theirs = reference(_to_torch(x).to(torch_dtype))
    assert theirs.dtype == torch_dtype
    # The same float32 arithmetic rounded once; a sum in another order may move a
    # value across a rounding boundary: one step of the last bit at most.
    step = {mx.bfloat16: 2**-7, mx.float16: 2**-10}.get(dtype, 1e-6)
    gap = np.abs(np.array(ours.astype(mx.float32)) - theirs.float().numpy())
    assert float(gap.max()) <= step * float(np.abs(theirs.float().numpy()).max())


def _bf16_model_with_float32_norms() -> Any:
    """The tiny V4 in bfloat16 with float32 norm weights, as a published checkpoint
    loads; its routed experts quantised, as published (this CPU has no bfloat16
    ``gather_mm``)."""
    model = tiny_v4(seed=4, moe_intermediate_size=32)
    made = []
    for name, value in tree_flatten(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            value = value.astype(mx.float32 if name.endswith("norm.weight") else mx.bfloat16)
        made.append((name, value))
    model.update(tree_unflatten(made))
    quantize(model, 32, 8, class_predicate=lambda _, module: isinstance(module, SwitchLinear))
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("layer_index", [0, 1, 2])
def test_every_block_of_a_bfloat16_layer_runs_in_bfloat16(layer_index: int) -> None:
    """A layer's steps as ``DecoderLayer.__call__`` takes them, over a prefill and a
    decode step: each block's input and output is bfloat16 (MLX's promoting norm
    made them float32: twice the bytes, and CUDA's gather_qmm 15x slower)."""
    model = _bf16_model_with_float32_norms()
    layer = model.layers[layer_index]
    cache = model.make_cache()[layer_index]
    for tokens in (mx.array([[5, 17, 3, 40, 22, 9, 11, 30, 2, 7, 19, 33]]), mx.array([[8]])):
        streams = model.model.embed_tokens(tokens)[:, :, None, :]
        streams = mx.broadcast_to(streams, (*tokens.shape, model.args.hc_mult, streams.shape[-1]))
        x, post, comb = layer.hc_attn.enter(streams, layer.attn_norm)
        h = layer.attn(x, cache)
        streams, x_ffn, post, comb = layer.hc_attn.leave_enter(
            h, streams, post, comb, layer.hc_ffn, layer.ffn_norm
        )
        out = layer.ffn(x_ffn, tokens)
        mx.eval(x, h, x_ffn, out)
        assert [a.dtype for a in (x, h, x_ffn, out)] == [mx.bfloat16] * 4
