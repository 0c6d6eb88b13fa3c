"""A tensor-parallel rank loads its share of the plan's split (``load_for_serving``)."""

from pathlib import Path

import pytest
from mlx.nn.layers.quantized import quantize
from mlx_lm.models.switch_layers import SwitchLinear

from mlxserve.config import load_settings
from mlxserve.engine.core.build import load_for_serving
from mlxserve.startup.plan import build_plan
from tests.engine.v4_models import tiny_v4
from tests.models.tp_worker import TP_SIZES, save_checkpoint


class _Rank:
    """Rank ``rank`` of 2: loading and slicing need no collective (serving would)."""

    def __init__(self, rank: int) -> None:
        self._rank = rank

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return self._rank


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tiny_v4(seed=0, **TP_SIZES)
    quantize(model, 32, 4, class_predicate=lambda p, m: isinstance(m, SwitchLinear))
    quantization = {"group_size": 32, "bits": 4, "mode": "affine"}
    return save_checkpoint(model, tmp_path_factory.mktemp("tp") / "m", quantization)


@pytest.mark.parametrize(("split", "heads"), [(None, [4, 4]), ([3, 1], [6, 2])])
def test_each_rank_loads_its_share_of_the_plans_split(
    checkpoint: Path, split: list[int] | None, heads: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("MLX_RANK", "MLX_HOSTFILE"):
        monkeypatch.delenv(name, raising=False)
    cluster: dict[str, object] = {"simulate": ["cpu", "cpu"]}
    if split is not None:
        cluster["split"] = split
    settings = load_settings(None, {"model": str(checkpoint), "cluster": cluster})
    plan, _ = build_plan(settings)
    assert plan.tensor_split() == (split or [1, 1])
    for rank in (0, 1):
        loaded = load_for_serving(settings, plan, rank, _Rank(rank))
        attn = loaded.model.layers[0].attn
        assert attn.num_heads == heads[rank]
        assert attn.wq_b.weight.shape[0] == heads[rank] * attn.head_dim
        experts = loaded.model.layers[0].ffn.switch_mlp
        assert experts.gate_proj.weight.shape[1] == 128 * heads[rank] // 8
