"""Random tiny DeepSeek-V4 models with a DSpark head, built in memory for engine tests."""

from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from mlxserve.models.deepseek_v4 import Model, ModelArgs
from mlxserve.models.deepseek_v4.dspark import DSparkHead, DSparkSpec
from tests.engine.v4_models import tiny_v4


def tiny_dspark(seed: int = 0, block: int = 4, sharp: float = 1.0) -> Model:
    """``tiny_v4``'s main model (no MTP block) plus a random two-stage DSpark head tapping
    layers 0 and 2; ``sharp`` scales the head's final norm (a drafter surer than the
    main model, whose drafts unchecked would change the distribution)."""
    base = tiny_v4(seed)
    params = {k: v for k, v in vars(base.args).items() if not k.startswith("rope_param")}
    params.update(dspark_block_size=block, dspark_target_layer_ids=[0, 2])
    params.update(dspark_noise_token_id=60, dspark_markov_rank=8)
    args = ModelArgs.from_dict(params)
    model = Model(args)
    main = [(k, v) for k, v in tree_flatten(base.parameters()) if not k.startswith("mtp.")]
    model.update(tree_unflatten(main))
    spec = DSparkSpec(block, (0, 2), 60, 2, 8, confidence_with_markov=True)
    head = DSparkHead(args, spec)
    mx.random.seed(seed + 1)
    randomized = []
    for name, value in tree_flatten(head.parameters()):
        value = mx.random.normal(value.shape) * (1.0 if value.ndim > 1 else 0.1)
        if value.ndim > 1:
            value = value / (value.shape[-1] ** 0.5)
        randomized.append((name, value))
    head.update(tree_unflatten(randomized))
    head.norm.weight = mx.ones_like(head.norm.weight) * sharp
    model["dspark"] = head
    mx.eval(model.parameters())
    return model


def as_any(model: Model) -> Any:
    return model
