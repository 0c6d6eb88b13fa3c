"""`mlxserve serve` refuses a model its engines would refuse, before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_deepseek_v41_checkpoint_without_weights_is_refused_with_exit_2(tmp_path: Path) -> None:
    """V4.1 is served now (tests/models/test_deepseek_v41.py); a broken one still gets
    one line and exit 2 before anything starts."""
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v41"}')
    run = subprocess.run(
        [sys.executable, "-m", "mlxserve", "serve", "--model", str(tmp_path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "no weights" in lines[0], run.stderr
