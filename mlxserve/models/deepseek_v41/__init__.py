"""DeepSeek-V4.1 (``model_type == "deepseek_v41"``): mlx-lm's text model plus Engram
and the DSpark draft head.

mlx-lm's ``deepseek_v41`` runs the text model but refuses a config with Engram layers;
``model.py`` builds it without them and adds mlxserve's own Engram (``engram.py``)
in front of those layers, the DSpark head the checkpoint ships (``dspark.py``) and
caches that speculation can roll back (``cache.py``, ``compressor.py``). Names are
imported on first use (mlx-lm is slow to import).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .model import Model, ModelArgs

__all__ = ["Model", "ModelArgs"]

_HOMES = {"Model": ".model", "ModelArgs": ".model"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name], __name__), name)
