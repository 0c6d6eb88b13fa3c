"""`mlxserve serve` refuses a model its engines would refuse, before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_deepseek_v41_checkpoint_is_refused_with_exit_2(tmp_path: Path) -> None:
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
    assert len(lines) == 1 and "deepseek_v41" in lines[0], run.stderr
    assert "different architecture" in lines[0]
