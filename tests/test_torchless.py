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


@pytest.mark.parametrize(
    "command",
    [
        ["-m", "mlxserve.engine", "--help"],  # what the front starts
        ["-m", "mlxserve", "generate", "--model", "demo", "--prompt", "hi", "--max-tokens", "1"],
    ],
    ids=["engine", "cli"],
)
def test_the_programs_import_no_torch(command: list[str]) -> None:
    """The entry points hide PyTorch before their imports reach transformers (both do:
    the engine process imports mlx-lm to parse its flags, `generate` to load a model)."""
    env = {k: v for k, v in os.environ.items() if k != "MLXSERVE_IMPORT_TORCH"}
    done = subprocess.run(
        [sys.executable, "-X", "importtime", *command],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()]
    assert "transformers" in imported  # the import that would bring PyTorch in happened
    assert "torch" not in imported
