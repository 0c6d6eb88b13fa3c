"""The demo as a -0731-style checkpoint: its main model with a DSpark draft head, no MTP.

DeepSeek-V4-Flash-0731 ships a DSpark head (``mlxserve.models.deepseek_v4.dspark``) in
place of the MTP block. This variant of the demo does the same, so that path runs end
to end on a laptop: the demo's build, without its MTP block, plus the head trained by
``training/demo/dspark.py`` (``weights/dspark.fp16.safetensors``) and the config keys
that announce it. ``mlxserve demo-model --dspark`` builds it; the server then drafts
with the head.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from .build import MARKER, TOKENIZER_FILES, WEIGHTS_DIR, build_demo_model, build_once

DSPARK_WEIGHTS = "dspark.fp16.safetensors"
SUFFIX = "-dspark"
#: The head's config keys (as -0731's config.json spells them): a block of four drafts,
#: reading all three layers, the pad token as noise.
DSPARK_CONFIG: dict[str, Any] = {
    "dspark_block_size": 4,
    "dspark_target_layer_ids": [0, 1, 2],
    "dspark_markov_rank": 32,
    "dspark_noise_token_id": 0,
}


def head_spec() -> Any:
    """The demo head's shape (one stage)."""
    from ..deepseek_v4.dspark import DSparkSpec

    return DSparkSpec(
        block_size=DSPARK_CONFIG["dspark_block_size"],
        target_layers=tuple(DSPARK_CONFIG["dspark_target_layer_ids"]),
        noise_token=DSPARK_CONFIG["dspark_noise_token_id"],
        stages=1,
        markov_rank=DSPARK_CONFIG["dspark_markov_rank"],
        confidence_with_markov=True,
    )


def _write(base: Path, tmp: Path, source: Path) -> None:
    import mlx.core as mx

    weights = mx.load(str(base / "model.safetensors"))
    head = mx.load(str(source / DSPARK_WEIGHTS))
    assert isinstance(weights, dict) and isinstance(head, dict)
    kept = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
    kept.update({k: v.astype(mx.float32) if v.dtype == mx.float16 else v for k, v in head.items()})
    mx.save_safetensors(str(tmp / "model.safetensors"), kept, metadata={"format": "mlx"})
    config = json.loads((base / "config.json").read_text())
    config.update(DSPARK_CONFIG, num_nextn_predict_layers=0, mtp_layer_types=[])
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copyfile(base / name, tmp / name)


def build_dspark_demo(
    out_dir: Path | None = None, progress: bool = True, *, source: Path = WEIGHTS_DIR
) -> Path:
    """Build (or reuse) the variant next to the demo build; return its directory."""
    import hashlib

    base = build_demo_model(progress=progress)
    head_hash = hashlib.sha256((source / DSPARK_WEIGHTS).read_bytes()).hexdigest()[:16]
    digest = (base / MARKER).read_text().strip() + SUFFIX + head_hash
    target = Path(out_dir) if out_dir is not None else base.with_name(base.name + SUFFIX)
    return build_once(target, digest, lambda tmp: _write(base, tmp, source))
