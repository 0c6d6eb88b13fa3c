"""The built-in demo model: a tiny DeepSeek-V4 (with MTP) trained on Python's own docs.

``build_demo_model()`` assembles the runnable, expert-quantised checkpoint from the
weights shipped in ``weights/``; ``mlxserve.models.load("demo")`` builds (once) and loads
it. Nothing is built or imported eagerly. The code that trained the shipped weights lives
beside the package, in the repository's ``training/demo/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["build_demo_model", "load_demo"]


def build_demo_model(out_dir: Path | None = None, progress: bool = True) -> Path:
    """See ``mlxserve.models.demo.build.build_demo_model``."""
    from .build import build_demo_model as _build

    return _build(out_dir, progress)


def load_demo() -> tuple[Any, Any]:
    """See ``mlxserve.models.demo.build.load_demo``."""
    from .build import load_demo as _load

    return _load()
