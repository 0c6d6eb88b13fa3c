"""`mlxserve demo-model`: build the built-in demo checkpoint where the operator wants it.

`model = "demo"` builds it on first use into the cache directory; this command does the
same on demand (say, to bake it into an image, or to point `--model` at a fixed path)
and prints the directory (`--dspark`: the -0731-style variant with a DSpark draft
head, `mlxserve.models.demo.dspark`). It never deletes a directory it did not build: an existing,
non-empty `--out` must be an earlier demo build (it has the build's marker file).
"""

import sys
from collections.abc import Callable
from pathlib import Path

from mlxserve.errors import UsageError


def _check_out_dir(out: Path) -> None:
    from mlxserve.models.demo.build import MARKER

    try:
        if not out.exists():
            return
        if not out.is_dir():
            raise UsageError(f"--out {out} exists and is not a directory")
        if any(out.iterdir()) and not (out / MARKER).is_file():
            raise UsageError(f"--out {out} is a non-empty directory that is not a demo build")
    except OSError as exc:
        raise UsageError(f"cannot use --out {out}: {exc}") from exc


def run_demo_model(
    out: Path | None, progress: bool, deepseek_format: bool = False, dspark: bool = False
) -> int:
    from mlxserve.models.demo.build import build_demo_model
    from mlxserve.models.demo.deepseek_format import build_deepseek_format_demo
    from mlxserve.models.demo.dspark import build_dspark_demo

    if deepseek_format and dspark:
        raise UsageError("--deepseek-format and --dspark are separate variants; pick one")
    if out is not None:
        _check_out_dir(out)
    build: Callable[..., Path] = build_demo_model
    if deepseek_format:
        build = build_deepseek_format_demo
    elif dspark:
        build = build_dspark_demo
    try:
        path = build(out, progress=progress)
    except OSError as exc:
        raise UsageError(f"cannot write the demo model: {exc}") from exc
    print(path)
    sys.stdout.flush()
    return 0
