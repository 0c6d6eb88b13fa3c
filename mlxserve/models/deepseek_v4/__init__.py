"""MLX implementation of DeepSeek-V4 (``model_type == "deepseek_v4"``).

The model's names are imported on first use: the model pulls in ``mlx_lm`` (seconds,
through ``transformers``), which the plan's reading of a checkpoint (``memory.py``,
``dspark.py``) does not need.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .cache import LayerCache
    from .config import ModelArgs
    from .model import Model

__all__ = ["LayerCache", "Model", "ModelArgs"]

_HOMES = {"LayerCache": ".cache", "ModelArgs": ".config", "Model": ".model"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name], __name__), name)
