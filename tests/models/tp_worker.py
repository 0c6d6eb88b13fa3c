"""One rank of the tensor-parallel check, run by ``test_deepseek_v4_tensor_parallel``.

Every rank builds the same random DeepSeek-V4 (same seed), runs it whole, then shards
it over the ring group and runs it again: prefill logits, cached decode steps and an
MTP draft must match the unsharded model. Prints one JSON line of max differences.
With ``--checkpoint DIR`` the two models are instead ``mlxserve.models.load(DIR)`` and
``mlxserve.models.sharded_load(DIR)``. ``--split 3,1`` shards unevenly (each rank's
parts); the report then also counts greedy tokens that differ from the whole model's.
Usage: ``python -m tests.models.tp_worker [--quantize | --checkpoint DIR] [--split S]``
under MLX_RANK/MLX_HOSTFILE.
"""

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.nn.layers.quantized import quantize
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchLinear

from mlxserve.models.deepseek_v4 import Model
from mlxserve.models.deepseek_v4.memory import weight_bytes
from mlxserve.models.deepseek_v4.mtp import greedy_draft
from mlxserve.models.safetensors_header import read_checkpoint
from tests.engine.v4_models import tiny_v4

#: Sizes every rank count (2 and 4) divides; 4 ranks x 32 expert rows is one
#: quantization group each.
TP_SIZES: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 64,
    "moe_intermediate_size": 128,
    "num_attention_heads": 8,
    "q_lora_rank": 32,
    "n_shared_experts": 1,
    "o_groups": 4,
    "o_lora_rank": 16,
    "index_n_heads": 4,
}


def build(quantized: bool) -> Model:
    model = tiny_v4(seed=0, **TP_SIZES)
    if quantized:
        quantize(model, 32, 4, class_predicate=lambda p, m: isinstance(m, SwitchLinear))
    mx.eval(model.parameters())
    return model


def save_checkpoint(model: Model, directory: Path, quantization: dict[str, Any] | None) -> Path:
    """``model`` as a loadable MLX checkpoint (config, weights, the demo's tokenizer)."""
    import shutil

    from mlxserve.models.demo.build import TOKENIZER_FILES, WEIGHTS_DIR, flat_parameters

    directory.mkdir(parents=True)
    config = {k: v for k, v in dataclasses.asdict(model.args).items() if v is not None}
    if quantization is not None:
        config["quantization"] = config["quantization_config"] = quantization
    (directory / "config.json").write_text(json.dumps(config))
    weights = dict(flat_parameters(model))
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})
    for name in TOKENIZER_FILES:
        shutil.copyfile(WEIGHTS_DIR / name, directory / name)
    return directory


def greedy(logits: np.ndarray) -> np.ndarray:
    """The token greedy decoding picks at every position."""
    return np.argmax(logits, axis=-1)


def run(model: Model, tokens: mx.array) -> dict[str, np.ndarray]:
    """Prefill, three cached decode steps, the MTP block over the whole prefill (every
    position but the first reads a real embedding), and chained depth-2 drafts."""
    cache = model.make_cache()
    prefix = tokens[:, :-3]
    streams = model.forward_hidden(prefix, cache)
    out = {"prefill": model.head_from_streams(streams)}
    mtp_logits, _ = model.mtp_forward(streams[:, :-1], prefix[:, 1:], model.make_mtp_cache()[0])
    out["mtp"] = mtp_logits
    steps = []
    for i in range(3, 0, -1):
        streams = model.forward_hidden(tokens[:, -i:][:, :1], cache)
        steps.append(model.head_from_streams(streams))
    out["decode"] = mx.concatenate(steps, axis=1)
    mtp_cache = model.make_mtp_cache(max_rollback=2)
    out["drafts"] = mx.stack(greedy_draft(model, streams, tokens[:, -1:], mtp_cache, 2))
    mx.eval(out)
    return {k: np.asarray(v.astype(mx.float32)) for k, v in out.items()}


def main() -> None:
    group = mx.distributed.init(strict=True, backend="ring")
    split = None
    if "--split" in sys.argv:
        split = [int(s) for s in sys.argv[sys.argv.index("--split") + 1].split(",")]
    vocab = TP_SIZES["vocab_size"]
    extra: dict[str, int] = {}
    if "--checkpoint" in sys.argv:
        from mlxserve.models import load, sharded_load

        path = sys.argv[sys.argv.index("--checkpoint") + 1]
        vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
        tokens = mx.array([[(7 * i + 3) % vocab for i in range(40)]])
        whole = run(load(path)[0], tokens)
        model = sharded_load(path, group, split=split)[0]
        sharded = run(model, tokens)
        held = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        # What the loader's memory check counted for this rank, from the headers alone.
        counted = weight_bytes(
            read_checkpoint(Path(path)), group.size(), split=split, rank=group.rank()
        )
        extra["held_bytes"], extra["counted_bytes"] = held, counted
    else:
        tokens = mx.array([[(7 * i + 3) % vocab for i in range(40)]])
        model = build("--quantize" in sys.argv)
        whole = run(model, tokens)
        model.shard(group, split)
        sharded = run(model, tokens)
    diffs = {k: float(np.abs(whole[k] - sharded[k]).max()) for k in whole}
    scale = float(np.abs(whole["prefill"]).max())
    for key in ("prefill", "decode"):
        extra[f"{key}_tokens"] = int((greedy(whole[key]) != greedy(sharded[key])).sum())
    report = {"rank": group.rank(), "size": group.size(), "scale": scale, **diffs, **extra}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
