"""``python -m tests.torchless_run MODULE ARGS...``: run a test's worker module as a
program without PyTorch, as mlxserve's own processes run (`mlxserve.torchless`).

The tensor-parallel and lockstep tests start their ranks from worker modules whose
imports reach transformers; hidden, PyTorch no longer costs each rank ~2 s of
start-up.
"""

import runpy
import sys

from mlxserve.torchless import hide_torch

if __name__ == "__main__":
    hide_torch()
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
