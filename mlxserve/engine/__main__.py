"""`python -m mlxserve.engine`: one engine process, as the front starts it.

PyTorch is hidden before `mlxserve.engine.process.loop` is imported: its imports reach
transformers, which would import PyTorch (`mlxserve.torchless`).
"""

from mlxserve.torchless import hide_torch

if __name__ == "__main__":
    hide_torch()
    from mlxserve.engine.process.loop import run_and_exit

    run_and_exit()
