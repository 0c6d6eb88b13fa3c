"""DeepSeek-V4 ``shard(group)`` over 2 and 4 real ring ranks on loopback.

The sharded model must give the unsharded model's logits (prefill, cached decode,
MTP draft): each rank holds a slice of the heads, output groups and expert hidden
dims, and the ring's ``all_sum`` puts the partial outputs back together.
"""

import json
import sys
from pathlib import Path

import pytest

from tests.ring import RankRun, run_ring_ranks

REPO = Path(__file__).resolve().parents[2]
#: A rank of these tests, started without PyTorch (`tests.torchless_run`).
WORKER = [sys.executable, "-m", "tests.torchless_run", "tests.models.tp_worker"]

pytestmark = pytest.mark.slow


def _check(runs: list[RankRun], size: int) -> None:
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    reports = [json.loads(run.stdout.strip().splitlines()[-1]) for run in runs]
    assert sorted(r["rank"] for r in reports) == list(range(size))
    for report in reports:
        assert report["size"] == size
        tolerance = 1e-4 * max(report["scale"], 1.0)
        assert report["prefill"] <= tolerance, report
        assert report["decode"] <= tolerance, report
        assert report["mtp"] <= tolerance, report
        assert report["drafts"] == 0, report


@pytest.mark.parametrize(
    ("size", "quantized"), [(2, False), (4, False), (2, True)], ids=["2", "4", "2-quantized"]
)
def test_sharded_logits_match_the_whole_model(size: int, quantized: bool, tmp_path: Path) -> None:
    command = list(WORKER)
    if quantized:
        command.append("--quantize")
    env = {"OMP_NUM_THREADS": "1"}
    runs = run_ring_ranks(command, [env] * size, tmp_path, timeout=120, cwd=REPO)
    _check(runs, size)


def test_sharded_load_of_the_demo_checkpoint(tmp_path: Path) -> None:
    """``sharded_load`` on a real saved checkpoint (the demo's: 4-bit experts, MTP)."""
    from mlxserve.models.demo.build import build_demo_model

    path = build_demo_model(tmp_path / "demo", progress=False)
    command = [*WORKER, "--checkpoint", str(path)]
    runs = run_ring_ranks(command, [{"OMP_NUM_THREADS": "1"}] * 2, tmp_path, timeout=120, cwd=REPO)
    _check(runs, 2)
    # The loader's per-rank memory figure (headers + ``is_sharded``) is what a rank holds.
    for run in runs:
        report = json.loads(run.stdout.strip().splitlines()[-1])
        assert report["counted_bytes"] == report["held_bytes"], report


def test_sharded_load_of_a_published_flash_checkpoint(tmp_path: Path) -> None:
    """DeepSeek's FP4 / FP8 layout (raw ``I8`` / ``F8_E4M3`` / ``F8_E8M0`` headers) over 2
    ranks: same logits as the whole model, and the per-rank bytes the loader counted."""
    import shutil

    from mlxserve.models.demo.build import TOKENIZER_FILES, WEIGHTS_DIR
    from tests.models.published_layouts import build, config_for, write_checkpoint

    path = write_checkpoint(tmp_path / "flash", config_for("flash"), build("flash").tensors)
    for name in TOKENIZER_FILES:  # ``load`` wants a tokenizer; any will do here
        shutil.copyfile(WEIGHTS_DIR / name, path / name)
    command = [*WORKER, "--checkpoint", str(path)]
    runs = run_ring_ranks(command, [{"OMP_NUM_THREADS": "1"}] * 2, tmp_path, timeout=120, cwd=REPO)
    _check(runs, 2)
    for run in runs:
        report = json.loads(run.stdout.strip().splitlines()[-1])
        assert report["counted_bytes"] == report["held_bytes"], report


def test_sharded_load_refuses_sizes_that_do_not_divide(tmp_path: Path) -> None:
    from mlxserve.errors import UsageError
    from mlxserve.models import sharded_load
    from mlxserve.models.demo.build import build_demo_model

    path = build_demo_model(tmp_path / "demo", progress=False)

    class ThreeRanks:
        def size(self) -> int:
            return 3

        def rank(self) -> int:
            return 0

    with pytest.raises(UsageError, match="over 3 ranks"):
        sharded_load(str(path), ThreeRanks())


def test_an_uneven_split_loads_its_share_and_decodes_as_one_rank(tmp_path: Path) -> None:
    """``sharded_load(split=[3, 1])`` over 2 real ring ranks of a saved checkpoint with
    4-bit experts: the same logits and greedy tokens as the whole model, and each rank
    holds the bytes the loader counted for its share (3/4 and 1/4 of the sharded)."""
    from mlx.nn.layers.quantized import quantize
    from mlx_lm.models.switch_layers import SwitchLinear

    from tests.engine.v4_models import tiny_v4
    from tests.models.tp_worker import TP_SIZES, save_checkpoint

    model = tiny_v4(seed=0, **TP_SIZES)
    quantize(model, 32, 4, class_predicate=lambda p, m: isinstance(m, SwitchLinear))
    quantization = {"group_size": 32, "bits": 4, "mode": "affine"}
    path = save_checkpoint(model, tmp_path / "tp", quantization)
    command = [*WORKER, "--checkpoint", str(path)]
    command += ["--split", "3,1"]
    runs = run_ring_ranks(command, [{"OMP_NUM_THREADS": "1"}] * 2, tmp_path, timeout=120, cwd=REPO)
    _check(runs, 2)
    reports = [json.loads(run.stdout.strip().splitlines()[-1]) for run in runs]
    held = {r["rank"]: r["held_bytes"] for r in reports}
    for report in reports:
        assert report["prefill_tokens"] == 0 and report["decode_tokens"] == 0, report
        assert report["counted_bytes"] == report["held_bytes"], report
    assert held[0] > held[1], held
