"""Load a model and its tokenizer, with DeepSeek-V4 support added to ``mlx_lm``.

``load`` goes through ``mlx_lm.utils.load_model`` (so quantised checkpoints, lazy
loading and ``sanitize`` behave as in ``mlx_lm``) and ``mlx_lm``'s tokenizer wrapper.
Only the choice of model class differs: ``model_type == "deepseek_v4"`` selects
``mlxserve.models.deepseek_v4``; every other type is left to ``mlx_lm``.

DeepSeek's published FP8 / FP4 checkpoints (``quantization_config`` of
``quant_method: fp8``) load with their weights still packed: the model's ``sanitize``
repacks them into MLX's ``mxfp8`` / ``mxfp4`` layouts, and ``load_model`` tells
``mlx_lm`` to quantise exactly the modules that then carry ``.scales`` (see
``_packed_quantization``).

Before ``mlx_lm`` sees a directory, its safetensors headers are read (no tensor data):
a broken file or a checkpoint whose weights would not fit in memory is refused with
one line. DeepSeek-V4.1 (``deepseek_v41``) is mlx-lm's text model plus mlxserve's
Engram and DSpark head (``models/deepseek_v41``); the parts it does not serve (vision
tower; the draft head without its config fields) are named in one log line each, and
Engram layers without the release's token map are refused. The model
itself is then built lazily, so a missing or misshapen tensor is refused (one line,
from ``Model.load_weights`` / ``sanitize``) before any weight is read. DeepSeek-V4-Flash
-0731's DSpark draft head is loaded (``model.dspark``), with one log line.

Named sources (for example a built-in ``"demo"`` model) can be plugged in with
``register_source``; ``load`` consults them before treating ``path`` as a directory
or a Hugging Face repository.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mlx.nn.layers.base import Module

from mlxserve.errors import UsageError

from .safetensors_header import HeaderError, TensorInfo, read_checkpoint

log = logging.getLogger(__name__)

ModelAndTokenizer = tuple[Module, Any]
SourceFactory = Callable[[], ModelAndTokenizer]

_SOURCES: dict[str, SourceFactory] = {}

#: model_type -> module (with Model and ModelArgs) that mlxserve provides itself.
_OWN_MODEL_TYPES = {
    "deepseek_v4": "mlxserve.models.deepseek_v4",
    "deepseek_v41": "mlxserve.models.deepseek_v41",
}


#: model_types whose ``sanitize`` repacks DeepSeek's FP8 / FP4 weights (``.scale``).
_PACKED_FP8_TYPES = frozenset({"deepseek_v4"})

#: The ``quantization`` handed to ``mlx_lm`` for such checkpoints. Its ``_quantize``
#: only touches modules with ``.scales`` and infers each one's mode from them
#: (``infer_quant_config``: 4 bits per group of 32 -> mxfp4, 8 bits -> mxfp8), so this
#: default mode is never the one that decides.
_MX_QUANTIZATION = {"group_size": 32, "bits": 8, "mode": "mxfp8"}

#: What the ``expert_dtype`` of DeepSeek's quantization_config may say (the sanitiser
#: recognises each from the packed shapes; bf16 experts simply have no ``.scale``).
_EXPERT_DTYPES = (None, "fp4", "fp8", "bf16")


#: Built-in named sources, registered on first use: name -> "module:function".
_BUILTIN_SOURCES = {"demo": "mlxserve.models.demo:load_demo"}


def register_source(name: str, factory: SourceFactory) -> None:
    """Make ``load(name)`` return ``factory()`` (the hook for e.g. ``load("demo")``)."""
    _SOURCES[name] = factory


def _source(name: str) -> SourceFactory | None:
    """The factory registered for ``name``, registering a built-in one on first use.

    Built-ins are imported only when asked for, so importing this module stays cheap.
    """
    if name not in _SOURCES and name in _BUILTIN_SOURCES:
        import importlib

        module_name, attr = _BUILTIN_SOURCES[name].split(":")
        register_source(name, getattr(importlib.import_module(module_name), attr))
    return _SOURCES.get(name)


def get_model_classes(config: dict[str, Any]) -> tuple[type[Module], type]:
    """Model and ModelArgs classes for ``config``: ours if we provide one, else mlx_lm's."""
    import importlib

    module_name = _OWN_MODEL_TYPES.get(str(config.get("model_type")))
    if module_name is None:
        from mlx_lm.utils import _get_classes

        classes: tuple[type[Module], type] = _get_classes(config)
        return classes
    module = importlib.import_module(module_name)
    return module.Model, module.ModelArgs


def _resolve(path: str | Path) -> Path:
    """A local model directory, or a Hugging Face repository id fetched by mlx-lm.

    Anything else is the operator's mistake and a `UsageError` naming it.
    """
    local = Path(path)
    if local.is_dir():
        return local
    text = str(path)
    looks_like_repo = text.count("/") == 1 and not text.startswith((".", "/", "~"))
    if local.exists() or not looks_like_repo:
        raise UsageError(f"model {text!r}: no such model directory")
    from mlx_lm.utils import _download

    try:
        resolved: Path = _download(text)
    except Exception as exc:  # hub errors come in many types; all mean "not available"
        raise UsageError(
            f"model {text!r}: not a local directory, and fetching it failed: {exc}"
        ) from None
    return resolved


def _is_power_of_two(value: object) -> bool:
    """Block sizes must be positive powers of two (bools are ints, but not sizes)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return False
    return value & (value - 1) == 0


def _fp8_config_problem(quant: object) -> str | None:
    """Why ``quant`` is not DeepSeek's FP8 format that ``packed.py`` reads, or None.

    The scales must be powers of two (``ue8m0``) to become e8m0 without loss, and
    the blocks powers of two whose columns cover whole 32-element groups, which is
    what the sanitiser infers block sizes from.
    """
    if not isinstance(quant, dict):
        return "it is not a mapping"
    if quant.get("quant_method") != "fp8":
        return f"quant_method {quant.get('quant_method')!r}"
    if quant.get("fmt", "e4m3") != "e4m3":
        return f"fmt {quant.get('fmt')!r}"
    if quant.get("scale_fmt") != "ue8m0":
        return f"scale_fmt {quant.get('scale_fmt')!r} (power-of-two 'ue8m0' scales needed)"
    block = quant.get("weight_block_size")
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(_is_power_of_two(b) for b in block)
        or block[1] < 32
    ):
        return f"weight_block_size {block!r}"
    if quant.get("expert_dtype") not in _EXPERT_DTYPES:
        return f"expert_dtype {quant.get('expert_dtype')!r}"
    return None


def _packed_quantization(config: dict[str, Any], source: Path) -> dict[str, Any] | None:
    """The ``quantization`` to give ``mlx_lm`` for ``config``, or None to leave it be.

    Only our model types that read DeepSeek's FP8 / FP4 packing are concerned, and only
    when ``config`` holds DeepSeek's ``quantization_config`` rather than ``mlx_lm``'s
    own ``quantization`` (a converted checkpoint). ``mlx_lm`` silently ignores an
    ``fp8`` quantization_config unless its blocks are 32 x 32, which would end in a
    puzzling "unexpected .scales" error, so anything we cannot read is refused here,
    by name.
    """
    if config.get("model_type") not in _PACKED_FP8_TYPES or "quantization" in config:
        return None
    text_config = config.get("text_config")
    quant = config.get("quantization_config")
    if quant is None and isinstance(text_config, dict):
        quant = text_config.get("quantization_config")
    if not quant:  # as in mlx_lm, an empty quantization_config means none
        return None
    problem = _fp8_config_problem(quant)
    if problem is not None:
        raise UsageError(
            f"model {str(source)!r}: unsupported quantization_config {quant!r} ({problem}). "
            f"model_type {config['model_type']!r} reads DeepSeek's FP8 / FP4 checkpoints "
            "(quant_method 'fp8', fmt 'e4m3', scale_fmt 'ue8m0', power-of-two "
            "weight_block_size of at least 32 columns) and MLX-quantised ones "
            "('quantization' in config.json)."
        )
    return dict(_MX_QUANTIZATION)


def _announce_not_served(
    config: dict[str, Any], tensors: dict[str, TensorInfo], source: Path
) -> None:
    """DeepSeek-V4.1: name, once, the parts of the checkpoint that are not served
    (the vision tower; the draft head without its config fields), which ``sanitize``
    leaves out, and a DSpark head that is loaded."""
    if config.get("model_type") != "deepseek_v41":
        return
    from .deepseek_v41.parts import REASONS, draft_head_served, not_served

    for part, count in not_served(list(tensors), config).items():
        log.warning(
            "model %s: DeepSeek-V4.1's %s (%d tensors) is not served; %s",
            source,
            part,
            count,
            REASONS[part],
        )
    head = sum(1 for name in tensors if name.removeprefix("model.").startswith("mtp."))
    if head and draft_head_served(config):
        log.info("model %s: DSpark draft head (DeepSeek-V4.1, %d tensors) loaded", source, head)


def _size(count: int) -> str:
    """Bytes for people: ``158.4 GiB``, ``3.2 MiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} bytes"


def _check_fits(
    config: dict[str, Any],
    tensors: dict[str, TensorInfo],
    source: Path,
    memory_bytes: int | None,
    ranks: int,
    split: Sequence[int] | None = None,
    rank: int = 0,
) -> None:
    """Refuse, before anything is read, weights larger than this rank's memory (its
    share of ``split``, default even)."""
    if config.get("model_type") == "deepseek_v41":
        from .deepseek_v41.memory import weight_bytes as v41_weight_bytes

        needed = v41_weight_bytes(tensors, ranks, config)
    elif config.get("model_type") in _OWN_MODEL_TYPES:
        from .deepseek_v4.memory import weight_bytes

        needed = weight_bytes(tensors, ranks, split=split, rank=rank)
    else:
        needed = sum(info.nbytes for info in tensors.values())
    if memory_bytes is None:
        from mlxserve.hardware.probe import usable_memory_bytes

        memory_bytes = usable_memory_bytes()
    if memory_bytes > 0 and needed > memory_bytes:
        per_rank = f" per rank over {ranks} ranks" if ranks > 1 else ""
        if ranks > 1 and split is not None:
            per_rank = f" on rank {rank} (its {split[rank]} of {sum(split)} parts)"
        raise UsageError(
            f"model {str(source)!r}: its weights need {_size(needed)}{per_rank} (from the "
            f"safetensors headers) but {_size(memory_bytes)} is usable here; use more "
            "memory, more tensor-parallel ranks or a smaller quantisation"
        )


def _drop_dspark_head(
    config: dict[str, Any], tensors: dict[str, TensorInfo], source: Path
) -> dict[str, TensorInfo]:
    """The tensors that will be loaded; a DSpark draft head (-0731) is kept and
    announced: the model drafts with it (``deepseek_v4/dspark.py``)."""
    if config.get("model_type") != "deepseek_v4":
        return tensors
    from .deepseek_v4.dspark import drop_draft_head, has_dspark_head

    if has_dspark_head(config, tensors):
        log.info(
            "model %s: DSpark draft head (DeepSeek-V4-Flash-0731, %d tensors) loaded",
            source,
            len(tensors) - len(drop_draft_head(tensors)),
        )
    return tensors


def _read_tensors(directory: Path) -> dict[str, TensorInfo]:
    """The checkpoint's tensors from its headers; a broken or missing file is one line."""
    try:
        tensors = read_checkpoint(directory)
    except HeaderError as exc:
        raise UsageError(str(exc)) from None
    if not tensors:
        raise UsageError(f"model {str(directory)!r}: no weights (model*.safetensors)")
    return tensors


def preflight(path: str | Path) -> None:
    """The checks ``load_model`` makes before reading anything, for a local directory.

    For a process that does not load the model itself (the ``serve`` front, whose
    engines load it) but should refuse what they would refuse before anything starts:
    another architecture, a quantization we cannot read, a broken safetensors header.
    Memory is left to the engines, which know their ranks. Names and Hub ids pass.
    """
    directory = Path(path)
    if not (directory / "config.json").is_file():
        return
    from mlx_lm.utils import load_config

    config = load_config(directory)
    _packed_quantization(config, directory)
    _read_tensors(directory)


def load_model(
    path: str | Path,
    *,
    lazy: bool = False,
    model_config: dict[str, Any] | None = None,
    memory_bytes: int | None = None,
    ranks: int = 1,
    split: Sequence[int] | None = None,
    rank: int = 0,
) -> tuple[Module, dict[str, Any]]:
    """Load only the model (no tokenizer); returns ``(model, config)``.

    For DeepSeek FP8 / FP4 checkpoints the ``quantization`` passed to ``mlx_lm``
    replaces ``quantization_config`` as well, as ``mlx_lm`` does for the formats it
    reads itself, so the returned (and any re-saved) config describes the MLX layout.

    ``memory_bytes`` is the memory the weights may fill (default: what
    ``hardware.probe.usable_memory_bytes`` finds; 0 skips the check), and ``ranks``
    how many tensor-parallel ranks will share them (``sharded_load``), by ``split``
    (each rank's parts; default even) of which this is rank ``rank``.
    """
    from mlx_lm.utils import load_config
    from mlx_lm.utils import load_model as mlx_load_model

    model_path = _resolve(path)
    config: dict[str, Any] = {**load_config(model_path), **(model_config or {})}
    quantization = _packed_quantization(config, model_path)
    if quantization is not None:
        model_config = {
            **(model_config or {}),
            "quantization": quantization,
            "quantization_config": quantization,
        }
    tensors = _read_tensors(model_path)
    tensors = _drop_dspark_head(config, tensors, model_path)
    _announce_not_served(config, tensors, model_path)
    _check_fits(config, tensors, model_path, memory_bytes, ranks, split, rank)
    try:
        # Lazily: the checks in sanitize / load_weights run on shapes, before any read.
        model, config = mlx_load_model(
            model_path,
            lazy=True,
            model_config=model_config,
            get_model_classes=get_model_classes,
        )
    except ValueError as exc:
        if config.get("model_type") not in _OWN_MODEL_TYPES:
            raise
        raise UsageError(f"model {str(model_path)!r}: {exc}") from None
    if config.get("model_type") == "deepseek_v41":
        try:
            model.set_token_map(model_path)  # Engram layers hash through the release's map
        except ValueError as exc:
            raise UsageError(f"model {str(model_path)!r}: {exc}") from None
    if not lazy:
        import mlx.core as mx

        mx.eval(model.parameters())
    return model, config


def load(
    path: str | Path,
    *,
    tokenizer_config: dict[str, Any] | None = None,
    model_config: dict[str, Any] | None = None,
    lazy: bool = False,
    memory_bytes: int | None = None,
    ranks: int = 1,
    split: Sequence[int] | None = None,
    rank: int = 0,
) -> ModelAndTokenizer:
    """Load ``(model, tokenizer)`` from a registered name, a directory or a HF repo.

    ``memory_bytes``, ``ranks``, ``split`` and ``rank``: see ``load_model``.
    """
    factory = _source(path) if isinstance(path, str) else None
    if factory is not None:
        return factory()
    from mlx_lm.utils import load_tokenizer

    model_path = _resolve(path)
    model, config = load_model(
        model_path,
        lazy=lazy,
        model_config=model_config,
        memory_bytes=memory_bytes,
        ranks=ranks,
        split=split,
        rank=rank,
    )
    tokenizer = load_tokenizer(  # type: ignore[no-untyped-call]
        model_path, tokenizer_config, eos_token_ids=config.get("eos_token_id")
    )
    return model, tokenizer


def sharded_load(
    path: str | Path,
    group: Any = None,
    *,
    tokenizer_config: dict[str, Any] | None = None,
    model_config: dict[str, Any] | None = None,
    memory_bytes: int | None = None,
    split: Sequence[int] | None = None,
) -> ModelAndTokenizer:
    """``load`` for tensor parallelism over ``group`` (default: ``mx.distributed.init()``),
    split evenly or by ``split`` (each rank's share in parts, see
    ``deepseek_v4.sharding``).

    The counterpart of ``mlx_lm.utils.sharded_load`` with a tensor group, which cannot
    see the model types mlxserve adds: the weights are loaded lazily, the model is
    sharded (``model.shard(group)``), and only then are the weights read, so each rank
    materialises just its own slices (its share of ``split``). Raises ``UsageError`` for
    a model without ``shard``, sizes the group does not divide or a split it cannot
    honour (a model without uneven support takes only the even split).
    """
    import mlx.core as mx

    group = group if group is not None else mx.distributed.init()
    if split is not None:
        from .deepseek_v4.sharding import check_split_shape

        try:
            split = check_split_shape(split, group.size())
        except ValueError as error:
            raise UsageError(f"{path}: {error}") from None
    factory = _source(path) if isinstance(path, str) else None
    if factory is not None:
        model, tokenizer = factory()
    else:
        model, tokenizer = load(
            path,
            tokenizer_config=tokenizer_config,
            model_config=model_config,
            lazy=True,
            memory_bytes=memory_bytes,
            ranks=group.size(),
            split=split,
            rank=group.rank(),
        )
    if not hasattr(model, "shard"):
        raise UsageError(f"{path}: the model has no tensor-parallel support (no shard()).")
    try:
        if split is None:
            model.shard(group)
        elif getattr(model, "model_type", None) == "deepseek_v4":
            model.shard(group, split)
        elif list(split) != [1] * group.size():
            raise ValueError(f"{path}: only DeepSeek-V4 models take an uneven split")
        else:
            model.shard(group)
    except ValueError as error:
        raise UsageError(str(error)) from error
    mx.eval(model.parameters())  # type: ignore[no-untyped-call]
    return model, tokenizer


def model_shape(path: str | Path) -> dict[str, int] | None:
    """What the split policy needs of a local DeepSeek-V4 directory, from its config and
    safetensors headers: the fields of ``policy.split.ModelShape``, which the plan's
    builder (``mlxserve.startup.plan``) makes of them, so the loader never imports the
    policy. None for anything else (a named source, a Hub id, another model type), whose
    split stays even."""
    directory = Path(path)
    named = str(path) in _SOURCES or str(path) in _BUILTIN_SOURCES
    if named or not (directory / "config.json").is_file():
        return None
    import json

    # Not mlx_lm's load_config: importing mlx_lm.utils takes seconds (transformers), and
    # the plan is built before anything else starts.
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UsageError(f"model {str(directory)!r}: cannot read config.json: {exc}") from None
    if not isinstance(config, dict) or config.get("model_type") != "deepseek_v4":
        return None
    from .deepseek_v4.dspark import drop_draft_head, has_dspark_head
    from .deepseek_v4.memory import shape_numbers

    tensors = _read_tensors(directory)
    if has_dspark_head(config, tensors):
        tensors = drop_draft_head(tensors)
    return shape_numbers(config, tensors)
