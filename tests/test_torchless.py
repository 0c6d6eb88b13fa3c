"""The programs' processes keep PyTorch out (`mlxserve.torchless`); the opt-out brings it back."""

import json
import os
import subprocess
import sys

import pytest

PROBE = (
    "import json, sys\n"
    "from mlxserve.torchless import hide_torch\n"
    "hide_torch()\n"
    "from transformers.utils import is_torch_available\n"
    "import mlx_lm.tokenizer_utils\n"
    "imported = sys.modules.get('torch') is not None\n"
    "print(json.dumps([is_torch_available(), imported]))\n"
)


def _probe(**env: str) -> list[bool]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert isinstance(result, list)
    return result


def test_transformers_sees_no_torch_once_hidden() -> None:
    assert _probe(MLXSERVE_IMPORT_TORCH="0") == [False, False]


@pytest.mark.torch
def test_the_opt_out_lets_transformers_import_torch() -> None:
    pytest.importorskip("torch")
    assert _probe(MLXSERVE_IMPORT_TORCH="1") == [True, True]
