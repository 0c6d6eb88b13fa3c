"""Keep PyTorch out of mlxserve's processes.

mlxserve computes with MLX alone, but transformers, which mlx-lm's tokenizer wrapper
imports, imports PyTorch whenever it is installed (as it is beside the numerical
reference, and on many Macs). On a 2-core CPU that is most of a process's start-up:
importing mlx-lm took 3.7 s with PyTorch installed and 1.4 s with it hidden. Every
engine process, restarted engine and tensor-parallel rank pays it again, so the
programs' entry points hide PyTorch before anything imports transformers, which
then treats it as not installed (``importlib.util.find_spec`` answers None for a
module set to None in ``sys.modules``).

A tokenizer whose own code needs PyTorch (remote code) can have it back with
``MLXSERVE_IMPORT_TORCH=1``.
"""

import os
import sys

#: Set to 1 to let transformers import PyTorch.
IMPORT_TORCH_ENV = "MLXSERVE_IMPORT_TORCH"


def hide_torch() -> None:
    """Make ``import torch`` fail in this process, unless already imported or asked for."""
    if os.environ.get(IMPORT_TORCH_ENV) == "1" or "torch" in sys.modules:
        return
    sys.modules["torch"] = None  # type: ignore[assignment]
