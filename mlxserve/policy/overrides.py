"""Operator overrides: `--nax-moe-policy`, `--policy KEY=VALUE` and `KEY@RANK=VALUE`.

An override's source names the setting it came from (`policy.nax_moe` or
`policy.overrides`), which the config file, `MLXSERVE_POLICY__*` and the CLI
flags all feed.
"""

from mlxserve.errors import UsageError
from mlxserve.policy.decisions import decision_spec
from mlxserve.policy.plan import Override


def parse_override(text: str, source: str) -> Override:
    """One override from `KEY=VALUE` or `KEY@RANK=VALUE`; bad input is a UsageError."""
    target, sep, raw = text.partition("=")
    if not sep or not target.strip() or not raw.strip():
        raise UsageError(f"{source}: expected KEY=VALUE or KEY@RANK=VALUE, got {text!r}")
    key, at, rank_text = target.strip().partition("@")
    try:
        spec = decision_spec(key)
        value = spec.coerce(_number_or_text(raw.strip()))
    except ValueError as exc:
        raise UsageError(f"{source}: {exc}") from None
    rank: int | None = None
    if at:
        if spec.scope == "world":
            raise UsageError(f"{source}: {key} is decided for the whole cluster, not per rank")
        if not rank_text.isdigit():
            raise UsageError(f"{source}: rank must be a number in {text!r}")
        rank = int(rank_text)
    return Override(key=key, rank=rank, value=value, source=source)


def collect_overrides(nax_moe: str, generic: list[str]) -> list[Override]:
    """All overrides, in the order they apply (later ones win)."""
    overrides = []
    if nax_moe != "auto":
        overrides.append(parse_override(f"nax_moe={nax_moe}", "policy.nax_moe"))
    overrides.extend(parse_override(text, "policy.overrides") for text in generic)
    return overrides


def _number_or_text(raw: str) -> str | int | float:
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            continue
    return raw
