"""Load a model and its tokenizer, with DeepSeek-V4 support added to ``mlx_lm``.

``load`` goes through ``mlx_lm.utils.load_model`` (so quantised checkpoints, lazy
loading and ``sanitize`` behave as in ``mlx_lm``) and ``mlx_lm``'s tokenizer wrapper.
Only the choice of model class differs: ``model_type == "deepseek_v4"`` selects
``mlxserve.models.deepseek_v4``; every other type is left to ``mlx_lm``.

Named sources (for example a built-in ``"demo"`` model) can be plugged in with
``register_source``; ``load`` consults them before treating ``path`` as a directory
or a Hugging Face repository.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlx.nn.layers.base import Module

from mlxserve.errors import UsageError

ModelAndTokenizer = tuple[Module, Any]
SourceFactory = Callable[[], ModelAndTokenizer]

_SOURCES: dict[str, SourceFactory] = {}

#: model_type -> module (with Model and ModelArgs) that mlxserve provides itself.
_OWN_MODEL_TYPES = {"deepseek_v4": "mlxserve.models.deepseek_v4"}


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


def load_model(
    path: str | Path, *, lazy: bool = False, model_config: dict[str, Any] | None = None
) -> tuple[Module, dict[str, Any]]:
    """Load only the model (no tokenizer); returns ``(model, config)``."""
    from mlx_lm.utils import load_model as mlx_load_model

    model, config = mlx_load_model(
        _resolve(path),
        lazy=lazy,
        model_config=model_config,
        get_model_classes=get_model_classes,
    )
    return model, config


def load(
    path: str | Path,
    *,
    tokenizer_config: dict[str, Any] | None = None,
    model_config: dict[str, Any] | None = None,
    lazy: bool = False,
) -> ModelAndTokenizer:
    """Load ``(model, tokenizer)`` from a registered name, a directory or a HF repo."""
    factory = _source(path) if isinstance(path, str) else None
    if factory is not None:
        return factory()
    from mlx_lm.utils import load_tokenizer

    model_path = _resolve(path)
    model, config = load_model(model_path, lazy=lazy, model_config=model_config)
    tokenizer = load_tokenizer(  # type: ignore[no-untyped-call]
        model_path, tokenizer_config, eos_token_ids=config.get("eos_token_id")
    )
    return model, tokenizer
