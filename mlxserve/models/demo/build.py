"""Assemble the runnable demo checkpoint from the weights shipped in ``weights/``.

The shipped files are float16 training weights in MLX names; the runnable checkpoint
has float32 dense weights (fast on CPU) and 4-bit, group-32 affine experts
(``nn.quantize`` on the experts' ``SwitchLinear`` only), with the ``quantization``
entry in ``config.json`` that makes ``mlx_lm``'s loader rebuild that structure: it
quantises exactly the modules whose ``.scales`` are in the file. The build is a pure
function of the shipped bytes, so the cache directory is named after their hash and
reused once complete; it is written to a temporary sibling and renamed into place, so
an interrupted build never leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: Bump when the build output changes for the same shipped files.
BUILD_VERSION = "1"
WEIGHTS_DIR = Path(__file__).parent / "weights"
SHIPPED_WEIGHTS = "model.fp16.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MARKER = ".complete"


def cache_root() -> Path:
    """``$MLXSERVE_CACHE_DIR`` or ``~/.cache/mlxserve``."""
    env = os.environ.get("MLXSERVE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "mlxserve"


def content_hash(source: Path = WEIGHTS_DIR) -> str:
    """Hash of the shipped files that determine the build (and of the build version)."""
    digest = hashlib.sha256(f"mlxserve-demo-build-{BUILD_VERSION}".encode())
    for name in (SHIPPED_WEIGHTS, "config.json", *TOKENIZER_FILES):
        digest.update(name.encode())
        digest.update((source / name).read_bytes())
    return digest.hexdigest()


def flat_parameters(model: Any) -> list[tuple[str, Any]]:
    """``(name, array)`` pairs of ``model``'s parameters, sorted by name (stable files)."""
    from mlx.utils import tree_flatten

    pairs = tree_flatten(model.parameters())
    assert isinstance(pairs, list)
    return sorted(pairs, key=lambda item: str(item[0]))


def shipped_weights(model: Any) -> dict[str, Any]:
    """``model``'s parameters as ``weights/`` ships them: float16, except the few
    tensors the reference keeps in float32 (``cast_predicate``) and integer tables."""
    import mlx.core as mx

    keep = model.cast_predicate
    out: dict[str, Any] = {}
    for key, value in flat_parameters(model):
        if mx.issubdtype(value.dtype, mx.floating) and keep(key):
            value = value.astype(mx.float16)
        out[key] = value
    return out


def _is_complete(path: Path, digest: str) -> bool:
    marker = path / MARKER
    return marker.is_file() and marker.read_text().strip() == digest


def quantize_experts(model: Any) -> None:
    """Quantise ``model``'s routed experts in place, exactly as the build does."""
    from mlx.nn.layers.base import Module
    from mlx.nn.layers.quantized import quantize
    from mlx_lm.models.switch_layers import SwitchLinear

    from .spec import QUANT_BITS, QUANT_GROUP_SIZE

    def experts_only(path: str, module: Module) -> bool:
        return isinstance(module, SwitchLinear) and ".switch_mlp." in path

    quantize(model, QUANT_GROUP_SIZE, QUANT_BITS, class_predicate=experts_only)


def _write_checkpoint(source: Path, target: Path, progress: bool) -> None:
    import mlx.core as mx
    from tqdm import tqdm  # type: ignore[import-untyped]

    from ..deepseek_v4 import Model, ModelArgs
    from .spec import QUANT_BITS, QUANT_GROUP_SIZE

    bar = tqdm(total=4, desc="Building demo model", unit="step", disable=not progress)
    config: dict[str, Any] = json.loads((source / "config.json").read_text())
    model = Model(ModelArgs.from_dict(config))
    weights = mx.load(str(source / SHIPPED_WEIGHTS))
    assert isinstance(weights, dict)
    weights = {
        k: v.astype(mx.float32) if v.dtype == mx.float16 else v
        for k, v in model.sanitize(weights).items()
    }
    model.load_weights(list(weights.items()), strict=True)
    bar.update()

    quantize_experts(model)
    params = dict(flat_parameters(model))
    mx.save_safetensors(str(target / "model.safetensors"), params, metadata={"format": "mlx"})
    bar.update()

    config["quantization"] = {"group_size": QUANT_GROUP_SIZE, "bits": QUANT_BITS, "mode": "affine"}
    config["quantization_config"] = config["quantization"]
    (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    bar.update()
    for name in TOKENIZER_FILES:
        shutil.copyfile(source / name, target / name)
    bar.update()
    bar.close()


def build_demo_model(
    out_dir: Path | None = None, progress: bool = True, *, source: Path = WEIGHTS_DIR
) -> Path:
    """Build (or reuse) the runnable demo checkpoint; return its directory.

    ``out_dir`` defaults to ``<cache_root()>/demo-<first 12 hex of the content hash>``.
    ``source`` is the directory with the shipped files (training passes its output).
    """
    digest = content_hash(source)
    target = Path(out_dir) if out_dir is not None else cache_root() / f"demo-{digest[:12]}"
    return build_once(target, digest, lambda tmp: _write_checkpoint(source, tmp, progress))


def build_once(target: Path, digest: str, write: Callable[[Path], None]) -> Path:
    """`target` as `write` makes it, built once per `digest` (its completion marker).

    Written into a temporary sibling and renamed into place, so an interrupted build
    leaves nothing half-written; when several processes build at once, the first to
    finish wins and the others keep its result.
    """
    if _is_complete(target, digest):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(tmp)
        (tmp / MARKER).write_text(digest + "\n")
        if target.exists():
            if _is_complete(target, digest):  # Another process finished first.
                return target
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_demo() -> tuple[Any, Any]:
    """Build the demo checkpoint if needed and load ``(model, tokenizer)``."""
    from ..loader import load

    return load(build_demo_model())
