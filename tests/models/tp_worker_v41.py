"""One rank of the DeepSeek-V4.1 tensor-parallel check (``test_deepseek_v41_tensor_parallel``).

Every rank loads the same published-layout V4.1 checkpoint whole (``load``) and sharded
over the ring group (``sharded_load``: mlx-lm's ``deepseek_v41`` ``shard`` splits the
query up-projection, the grouped output projections and the experts' hidden dims;
mlxserve's Engram layers and a DSpark head are held whole), then runs a prefill and
three cached decode steps through each. Prints one JSON line: the largest logit
differences, greedy tokens that differ, and the bytes this rank holds against what
the loader's memory check counted from the headers.
Usage: ``python -m tests.models.tp_worker_v41 DIR`` under MLX_RANK/MLX_HOSTFILE.
"""

import json
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlxserve.models import load, sharded_load
from mlxserve.models.deepseek_v41.memory import weight_bytes
from mlxserve.models.safetensors_header import read_checkpoint


def run(model: Any, tokens: mx.array) -> dict[str, np.ndarray]:
    """Prefill of all but the last three tokens, then one cached step for each."""
    cache = model.make_cache()
    out = {"prefill": model(tokens[:, :-3], cache=cache)}
    out["decode"] = mx.concatenate(
        [model(tokens[:, -i:][:, :1], cache=cache) for i in range(3, 0, -1)], axis=1
    )
    mx.eval(out)
    return {k: np.asarray(v.astype(mx.float32)) for k, v in out.items()}


def main() -> None:
    group = mx.distributed.init(strict=True, backend="ring")
    path = sys.argv[1]
    config = json.loads((Path(path) / "config.json").read_text())
    tokens = mx.array([[1, 50, 60, 70, 80, 90, 3, 4, 5, 100] * 3])
    whole = run(load(path)[0], tokens)
    model = sharded_load(path, group)[0]
    sharded = run(model, tokens)
    held = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    counted = weight_bytes(read_checkpoint(Path(path)), group.size(), config)
    report: dict[str, Any] = {"rank": group.rank(), "size": group.size()}
    report["scale"] = float(np.abs(whole["prefill"]).max())
    for key in whole:
        report[key] = float(np.abs(whole[key] - sharded[key]).max())
        report[f"{key}_tokens"] = int((whole[key].argmax(-1) != sharded[key].argmax(-1)).sum())
    report["held_bytes"], report["counted_bytes"] = held, counted
    report["engram_layers"] = list(getattr(model, "engram_layer_ids", ()))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
