"""DeepSeek-V4's RMSNorm: float32 weights, output in the input's dtype.

Why not MLX's ``nn.RMSNorm`` as it is: DeepSeek-V4 keeps its norms' weights in float32
(transformers' ``DeepseekV4RMSNorm`` is cast to float32, as DeepSeek's own inference
code keeps them), and ``mx.fast.rms_norm`` gives the dtype its input and weight promote
to, so on a bfloat16 checkpoint every activation after a layer's first norm became
float32. The reference computes the norm in float32 and casts the result back to the
input's dtype (``(self.weight * hidden_states).to(input_dtype)``). Besides being off
the reference, the float32 activations cost twice the bytes and, on MLX's CUDA
backend, made the routed experts' ``gather_qmm`` 15x slower than on bfloat16 rows
(``benchmarks/results/prefill_parts_h100_*_norms_stop29.json``).

The model's last norm before the vocabulary head is the exception and stays MLX's:
the logits are computed in float32 (``head.py``), as DeepSeek's inference code does.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.nn.layers.normalization import RMSNorm


class InputDtypeRMSNorm(RMSNorm):
    """``RMSNorm`` whose output has its input's dtype (module docstring). With a
    weight wider than the input (float32 over bfloat16) MLX's kernel gives the
    float32 product and it is rounded once, as the reference's; with a weight of the
    input's dtype the call is MLX's own (which rounds the normalised value before the
    weight)."""

    def __call__(self, x: mx.array) -> mx.array:
        out = mx.fast.rms_norm(x, self["weight"], self.eps)
        return out if out.dtype == x.dtype else out.astype(x.dtype)
